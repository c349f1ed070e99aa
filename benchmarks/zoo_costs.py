"""Plan cost of every zoo model (paper configurations) against the baselines, on the paper's clusters.

For each model and cluster: the synthesized plan's estimated iteration time, the lower bound (total
flops / total throughput), DP-EV, DP-CP and Megatron-style TP under the same cost model, synthesis time
and search expansions. Weak scaling as in the paper: batch 32 per device (MoE: 2 experts per device).

    python benchmarks/zoo_costs.py [--clusters paper-hetero-8,a100-p100] [--models bert,vit] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import hapnb as hap
from hapnb import zoo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clusters", default="paper-hetero-8,paper-hetero-16,a100-p100")
    ap.add_argument("--models", default=",".join(zoo.ZOO_NAMES))
    ap.add_argument("--layers", type=int, help="override the layer count (quick runs)")
    ap.add_argument("--out", default="docs/benchmarks/benchmarks-zoo.json")
    ns = ap.parse_args()
    rows = []
    for cname in ns.clusters.split(","):
        c = hap.Cluster.resolve(cname)
        for name in ns.models.split(","):
            opts = {"layers": ns.layers} if ns.layers and name not in ("vgg19",) else {}
            t0 = time.perf_counter()
            model, inputs, _ = zoo.build(name, devices=c.n, **opts)
            g = hap.trace(model, inputs, name=name)
            trace_s = time.perf_counter() - t0
            plan = hap.synthesize(g, c, check_memory=False, pick="cost")  # HAP's choice, like-for-like
            base = hap.baselines(g, c)
            row = {
                "cluster": cname,
                "model": name,
                "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
                "cost_s": plan.cost_s,
                "lower_bound_s": plan.lower_bound_s,
                "synthesis_s": plan.synthesis_s,
                "trace_s": trace_s,
                "expansions": plan.stats.get("expansions"),
                "optimal": plan.stats.get("optimal"),
                "collectives": sum(1 for i in plan.program if i.communicates),
                "sharded_params": sum(
                    1 for i in plan.program if i.kind == "load" and i.form.startswith("G") and "." in i.tensor
                ),
                "fits_memory": all(
                    m <= d.memory_bytes / d.gpus for m, d in zip(plan.memory_bytes, plan.cluster.devices)
                ),
                **{k: v.cost_s for k, v in base.items()},
            }
            rows.append(row)
            best_base = min(v.cost_s for v in base.values())
            print(
                f"{cname:16s} {name:9s} plan {plan.cost_s:8.4f} s  LB {plan.lower_bound_s:8.4f}  "
                + "  ".join(f"{k} {v.cost_s:8.4f}" for k, v in base.items())
                + f"  speedup vs best baseline {best_base / plan.cost_s:5.2f}x  synth {plan.synthesis_s:5.2f} s",
                flush=True,
            )
            del model, g
    Path(ns.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
