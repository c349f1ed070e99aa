"""Simulated vs measured per-iteration time on local gloo ranks with and without overlap (issue 9, 5):
each plan runs three ways on ``--nproc`` local CPU ranks (one torch thread each) and is predicted three ways.

    .venv/bin/python benchmarks/fidelity_overlap.py [--nproc 2] [--steps 15] [--repeats 2] [--cluster c.json]

Runs (measured, :func:`hapnb.launch`, slowest rank's step, median after the warm-up, median over repeats):

* ``sync``: replicated gradients all-reduced one by one inside autograd (``--grad-sync sync``): every
  collective blocks, what the stage model assumes;
* ``buckets``: the default runtime, DDP-like buckets all-reduced asynchronously during the backward and
  waited for before the optimizer step (what the overlap simulator assumes);
* ``duplex``: the plan re-synthesized with ``duplex=True`` (HiDup: two micro-batches, one's collectives
  beside the other's computation), default runtime.

Predictions: the plan's ``cost_s`` (stage model; the duplex ψ cost for the duplex plan),
``hapnb.simulate(plan, overlap=False)`` (stage-synchronous, equals ``cost_s`` for plain plans) and
``hapnb.simulate(plan)`` (overlap, bandwidth sharing, γ from the profile). The cluster is profiled first
(:func:`hapnb.run.profile.profile_cluster`, overlap slowdown included) unless ``--cluster`` is given.
Writes ``--out`` (default docs/benchmarks/fidelity-overlap.json) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fidelity_gloo import measure  # noqa: E402

import hapnb  # noqa: E402
from hapnb.hardware.cluster import Cluster  # noqa: E402
from hapnb.run.calibrate import prediction_stats  # noqa: E402
from hapnb.run.profile import profile_cluster  # noqa: E402

#: (label, zoo name, options): plans with gradient all-reduces (data-parallel parts) to overlap
PLANS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("mlp-1024", "mlp", dict(layers=2, hidden=1024, input=1024, batch=64)),
    ("mlp-512x4", "mlp", dict(layers=4, hidden=512, input=512, batch=64)),
    ("gpt", "gpt", dict(layers=2, hidden=128, heads=4, vocab=1024, seq=64, dropout=0.0, batch=8)),
    ("bert", "bert", dict(layers=2, hidden=128, heads=4, vocab=1024, seq=64, dropout=0.0, batch=8)),
    ("vit", "vit", dict(layers=2, hidden=128, heads=4, image=32, patch=4, batch=16, dropout=0.0)),
    ("lm-L2-H256", "lm", dict(layers=2, hidden=256, seq=64, batch=16, vocab=4096)),
)
MODES = ("sync", "buckets", "duplex")


def predictions(plan: Any) -> dict[str, float]:
    return {
        "cost_s": plan.cost_s,
        "stage_sim_s": hapnb.simulate(plan, overlap=False).iteration_s,
        "overlap_sim_s": hapnb.simulate(plan).iteration_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--cluster", default=None, help="a profiled cluster JSON (default: profile now)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated labels (no JSON written)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "fidelity-overlap.json"))
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    only = set(ns.only.split(",")) if ns.only else None
    t0 = time.perf_counter()
    cluster = Cluster.load(ns.cluster) if ns.cluster else profile_cluster(ns.nproc, "gloo", threads=1)
    print(f"{cluster}\n(profile {time.perf_counter() - t0:.0f} s)")
    rows = []
    for label, name, options in PLANS:
        if only and label not in only:
            continue
        plain = hapnb.synthesize(name, cluster, **options)
        duplex = hapnb.synthesize(name, cluster, duplex=True, **options)
        row: dict[str, Any] = {"label": label, "model": name, "options": options, "nproc": ns.nproc}
        for mode in MODES:
            plan = duplex if mode == "duplex" else plain
            args = ("--grad-sync", "sync") if mode == "sync" else ()
            runs = [measure(plan, ns.nproc, ns.steps, ns.warmup, args) for _ in range(ns.repeats)]
            row[mode] = {
                **predictions(plan),
                "measured_s": statistics.median(r["median_s"] for r in runs),
                "measured_min_s": min(r["min_s"] for r in runs),
                "repeat_median_s": [r["median_s"] for r in runs],
                "loadavg_1min": [r["loadavg_1min"] for r in runs],
            }
            m = row[mode]
            print(
                f"{label:<11} {mode:<8} cost {m['cost_s'] * 1e3:8.2f}  stage-sim {m['stage_sim_s'] * 1e3:8.2f}  "
                f"overlap-sim {m['overlap_sim_s'] * 1e3:8.2f}  measured {m['measured_s'] * 1e3:8.2f} ms "
                f"(min {m['measured_min_s'] * 1e3:.2f})",
                flush=True,
            )
        rows.append(row)
    pairs = {
        "sync runs vs cost_s (stage model)": ("sync", "cost_s"),
        "bucketed runs vs cost_s (stage model)": ("buckets", "cost_s"),
        "bucketed runs vs the overlap simulation": ("buckets", "overlap_sim_s"),
        "duplex runs vs the duplex cost (psi)": ("duplex", "cost_s"),
        "duplex runs vs the overlap simulation": ("duplex", "overlap_sim_s"),
    }
    summary = {
        k: prediction_stats([r[m][p] for r in rows], [r[m]["measured_s"] for r in rows])
        for k, (m, p) in pairs.items()
        if rows
    }
    benefit = {
        r["label"]: {
            "measured_sync_over_buckets": r["sync"]["measured_s"] / r["buckets"]["measured_s"],
            "simulated_stage_over_overlap": r["buckets"]["stage_sim_s"] / r["buckets"]["overlap_sim_s"],
            "measured_plain_over_duplex": r["buckets"]["measured_s"] / r["duplex"]["measured_s"],
            "simulated_plain_over_duplex": r["buckets"]["overlap_sim_s"] / r["duplex"]["overlap_sim_s"],
        }
        for r in rows
    }
    print()
    for k, s in summary.items():
        print(f"{k}: mean |err| {s['mean_abs_pct']:.1f} %, max {s['max_abs_pct']:.1f} %, "
              f"Pearson {s['pearson']:.3f}, Spearman {s['spearman']:.3f}")  # fmt: skip
    for k, b in benefit.items():
        print(f"{k:<11} " + "  ".join(f"{n} {v:.3f}" for n, v in b.items()))
    if not only:
        out = {
            "what": "plans on local gloo CPU ranks run with blocking gradient all-reduce (sync), DDP-like async "
            "buckets (buckets) and as duplex plans; predicted by the stage model, the stage-synchronous and the "
            "overlap simulation",
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
            "command": "python benchmarks/fidelity_overlap.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "cluster": cluster.to_json(),
            "summary": summary,
            "benefit": benefit,
            "runs": rows,
        }
        Path(ns.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
