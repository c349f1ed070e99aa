"""Synthesis-time benchmark, comparable with the original HAP's measurements on this machine.

Runs ``hapnb plan --json --no-baselines`` in a fresh process per run (median of 3) for ViT with
2/4/8/12/16/24 layers and BERT-12 on 4 and 8 heterogeneous devices (V100-like 3.8588e12 and P100-like
2.1493e12 FLOP/s in a 1:3 mix) and on 8 homogeneous devices (5.9666e12), with HAP's profiled
bandwidths (measured with the original HAP build on this machine; the figures are in ``ANCHOR`` below). ``synthesis_s`` spans graph -> final plan
(tracing excluded), the same span as the original's "Time".

    python benchmarks/synthesis.py [--quick] [--out docs/benchmarks/benchmarks-synthesis.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# HAP's master.py bandwidths (bytes/s), used for every cluster in the anchor measurements
HAP_BW = {
    "all_gather": 9463184466, "all_reduce": 5906161310, "reduce_scatter": 9740459122,
    "all_to_all": 24588140722, "broadcast": 9146232360, "reduce": 8756865799,
}  # fmt: skip
V100, P100, HOMO = 3858755112937, 2149250936815, 5966645808610

# the original HAP's synthesis times on this machine (median of 3 runs of its own benchmark)
ANCHOR = {
    ("vit", 2, "het4"): 0.057, ("vit", 4, "het4"): 0.180, ("vit", 8, "het4"): 0.555, ("vit", 12, "het4"): 1.261,
    ("vit", 16, "het4"): 2.105, ("vit", 24, "het4"): 5.200, ("bert", 12, "het4"): 1.637,
    ("vit", 2, "het8"): 0.068, ("vit", 4, "het8"): 0.219, ("vit", 8, "het8"): 0.587, ("vit", 12, "het8"): 1.312,
    ("vit", 16, "het8"): 2.661, ("vit", 24, "het8"): 6.847, ("bert", 12, "het8"): 1.897,
    ("vit", 12, "homo8"): 1.351, ("bert", 12, "homo8"): 1.626,
}  # fmt: skip


def cluster_json(kind: str) -> dict:
    if kind == "het4":
        flops = [V100] + [P100] * 3
    elif kind == "het8":
        flops = [V100] * 2 + [P100] * 6
    else:
        flops = [HOMO] * 8
    return {
        "name": kind,
        "dtype_bytes": 4,
        "devices": [
            {
                "name": f"d{j}",
                "kind": "custom",
                "flops": float(f),
                "memory_bytes": 32 << 30,
                "machine": f"m{j}",
                "gpus": 1,
            }
            for j, f in enumerate(flops)
        ],
        "collectives": {k: {"latency_s": 0.0, "bandwidth_Bps": float(v)} for k, v in HAP_BW.items()},
        "intra_machine_Bps": 1e11,
    }


def run_once(model: str, layers: int, cluster_path: str) -> dict:
    cmd = [sys.executable, "-m", "hapnb", "plan", "--model", model, "--layers", str(layers), "--cluster",
           cluster_path, "--json", "--no-baselines", "--pick", "cost"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one run per case, fewer cases")
    ap.add_argument("--out", default="docs/benchmarks/benchmarks-synthesis.json")
    ns = ap.parse_args()
    cases = [("vit", n, c) for c in ("het4", "het8") for n in (2, 4, 8, 12, 16, 24)]
    cases += [("bert", 12, "het4"), ("bert", 12, "het8"), ("vit", 12, "homo8"), ("bert", 12, "homo8")]
    if ns.quick:
        cases = [("vit", 2, "het8"), ("bert", 12, "het8")]
    repeats = 1 if ns.quick else 3
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, layers, kind in cases:
            path = Path(tmp) / f"{kind}.json"
            path.write_text(json.dumps(cluster_json(kind)))
            runs = [run_once(model, layers, str(path)) for _ in range(repeats)]
            times = [r["synthesis_s"] for r in runs]
            med = statistics.median(times)
            anchor = ANCHOR.get((model, layers, kind))
            row = {
                "model": model, "layers": layers, "cluster": kind, "synthesis_s": med, "runs_s": times,
                "anchor_s": anchor, "expansions": runs[0]["expansions"], "cost_s": runs[0]["cost_s"],
                "iterations": runs[0]["iterations"], "instructions": len(runs[0]["program"]),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{model:5s} {layers:3d} {kind:6s} synth {med:7.3f} s  (HAP {anchor if anchor else '-'} s)  "
                f"expansions {row['expansions']:6d}  cost {row['cost_s']:.4f} s",
                flush=True,
            )
    Path(ns.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
