"""Live re-balancing benchmark (issue 21): 3 local gloo ranks, one slowed ``--factor`` times (it sleeps in
proportion to its compute), with and without ``--rebalance``.

Three runs of the same bundle, same steps: ``calm`` (no slowdown, re-balancing on: it must never
re-balance its ratios; it may re-plan its program when the link fit finds the links mispriced and that
pays), ``static`` (slowed, telemetry only: the planned ratios to the end) and ``rebalanced`` (slowed,
re-balancing on). Each re-balance says whether it changed the program (``program_changed``), and the
telemetry windows carry the link fit (``link_scale``: per collective kind, the plan's time multiplied by
it, relative to the compute's; :mod:`hapnb.run.linkfit`). Reports, for the rebalanced run, the median step time after the (last)
re-balance against the ``predicted_step_s`` its decision made for the new ratios (target: within 20 %),
and the speedup over the static run's median step time over the same steps (target: >= 1.5x); and that the
rebalanced run's losses equal the calm run's (float64, relative 1e-9). Writes the raw rows to a JSON
file and prints a Markdown table.

    python benchmarks/rebalance.py [--hidden 512] [--input 512] [--batch 384] [--layers 2]
        [--steps 60] [--factor 3] [--repeat 1] [--out docs/benchmarks/rebalance.json]

The model is the zoo MLP on ``3xV100`` (equal devices: equal planned ratios), large enough that a rank's
compute grows with its share of the batch; on a tiny model a CPU rank's step is mostly fixed overhead
(Python dispatch, collective latency) that no re-balancing removes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import hapnb
from hapnb.run.bundle import write_bundle
from hapnb.run.launch import launch
from hapnb.run.rebalance import summarize


def _run(bundle: Path, steps: int, **kw: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    job = launch(bundle, nproc=3, steps=steps, timeout_s=300, wall_timeout_s=900, dtype="float64", **kw)
    with job:
        res = job.wait()
    if not res.ok:
        raise SystemExit(f"benchmark run failed: {res.error}")
    s = summarize(res.metrics)
    s["wall_s"] = time.perf_counter() - t0
    s["telemetry"] = [
        {
            "step": m["step"],
            **{k: m["window"][k] for k in ("compute_s", "optimizer_s", "comm_s", "step_s")},
            "scale": m.get("scale"),
            "link_scale": m.get("link_scale"),
            "link_overall": m.get("link_overall"),
        }
        for m in res.metrics
        if m.get("event") == "telemetry"
    ]
    return s


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One repetition: the three runs and the figures compared with the targets."""
    plan = hapnb.synthesize(
        "mlp", "3xV100", layers=args.layers, hidden=args.hidden, input=args.input, batch=args.batch
    )
    with tempfile.TemporaryDirectory(prefix="hapnb-rebalance-") as tmp:
        bundle = write_bundle(plan, Path(tmp) / "bundle")
        calm = _run(bundle, args.steps, rebalance=True, extra_args=["--no-dropout"])
        static = _run(
            bundle, args.steps, telemetry=True, slowdown={2: args.factor}, extra_args=["--no-dropout"]
        )
        reb = _run(bundle, args.steps, rebalance=True, slowdown={2: args.factor}, extra_args=["--no-dropout"])
    row: dict[str, Any] = {
        "steps": args.steps,
        "factor": args.factor,
        "calm_rebalances": len(calm["rebalances"]),
        "calm_program_changes": sum(bool(r.get("program_changed")) for r in calm["rebalances"]),
        "static_link_scale": static["telemetry"][-1]["link_scale"] if static["telemetry"] else None,
        "calm_link_scale": calm["telemetry"][0]["link_scale"] if calm["telemetry"] else None,
        "calm_rebalance_records": calm["rebalances"],
        "rebalanced_telemetry": reb["telemetry"],
        "calm_median_step_s": statistics.median(calm["step_s"][1:]),
        "static_median_step_s": statistics.median(static["step_s"][1:]),
        "rebalances": reb["rebalances"],
        "rejected": reb["rejected"],
        "losses_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(reb["losses"], calm["losses"])),
        "wall_s": {"calm": calm["wall_s"], "static": static["wall_s"], "rebalanced": reb["wall_s"]},
    }
    if reb["rebalances"]:
        last = reb["rebalances"][-1]
        after_steps = range(last["step"] + 2, args.steps)  # the first step after a reshard warms up
        after = statistics.median(reb["step_s"][s] for s in after_steps)
        static_after = statistics.median(static["step_s"][s] for s in after_steps)
        row.update(
            rebalance_step=last["step"],
            old_ratios=last["old_ratios"][0],
            new_ratios=last["new_ratios"][0],
            step_s_before=reb["step_s_before"],
            step_s_after=after,
            predicted_step_s=last["predicted_step_s"],
            prediction_error=after / last["predicted_step_s"] - 1.0,
            static_step_s_same_steps=static_after,
            speedup=static_after / after,
            reshard_s=last.get("reshard_s"),
            reshard_s_estimate=last["reshard_s_estimate"],
            program_changed=[bool(r.get("program_changed")) for r in reb["rebalances"]],
            link_scale=last.get("link_scale"),
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--input", type=int, default=512)
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default="docs/benchmarks/rebalance.json")
    args = ap.parse_args()
    rows = [measure(args) for _ in range(args.repeat)]
    out = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load": os.getloadavg(),
        },
        "model": {"layers": args.layers, "hidden": args.hidden, "input": args.input, "batch": args.batch},
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(
        "| run | re-balanced at | ratios after | predicted step | measured after | error | static | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        if "speedup" not in r:
            print(
                f"| {i} | never ({len(r['rejected'])} rejected) | | | | | {r['static_median_step_s'] * 1e3:.1f} ms | |"
            )
            continue
        ratios = "/".join(f"{x:.3f}" for x in r["new_ratios"])
        print(
            f"| {i} | step {r['rebalance_step']} | {ratios} | {r['predicted_step_s'] * 1e3:.1f} ms "
            f"| {r['step_s_after'] * 1e3:.1f} ms | {r['prediction_error']:+.1%} "
            f"| {r['static_step_s_same_steps'] * 1e3:.1f} ms | {r['speedup']:.2f}x |"
        )
    for r in rows:
        fmt = lambda d: ", ".join(f"{k} {v:.3g}x" for k, v in (d or {}).items())  # noqa: E731
        print(
            f"link fit (x the plan's time, relative to compute): static run's last window {fmt(r['static_link_scale'])}; "
            f"program changes: rebalanced run {r.get('program_changed', [])}, calm run {r['calm_program_changes']}"
        )
        print(
            f"calm run re-balanced {r['calm_rebalances']} times; losses max relative difference "
            f"{r['losses_max_rel_diff']:.2e}; reshard {r.get('reshard_s') or 0:.3f} s "
            f"(estimated {r.get('reshard_s_estimate') or 0:.3f} s); wall {r['wall_s']}"
        )


if __name__ == "__main__":
    main()
