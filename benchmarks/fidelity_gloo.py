"""Fidelity of the cost model for plans on local gloo ranks (issue 8, 5(c)): predicted vs measured
per-iteration time of >= 6 synthesized plans (small zoo models) on K local CPU ranks.

    .venv/bin/python benchmarks/fidelity_gloo.py [--nproc 2] [--steps 20] [--warmup 3] [--quick]
    .venv/bin/python benchmarks/fidelity_gloo.py --also 3 --also-only mlp-512,gpt   # + 3 ranks on 2 cores

1. The cluster: ``--cluster`` (a cluster JSON from ``hapnb profile``) or, by default,
   :func:`hapnb.run.profile.profile_cluster` of ``--nproc`` local CPU ranks, one torch thread each: every
   device carries the profiled CPU :class:`~hapnb.hardware.devices.DeviceModel` (``overlap=false``) and the
   collectives their gloo latency/bandwidth fits.
2. Per model: ``hapnb.synthesize`` on that cluster gives the plan and its ``cost_s`` (forward, backward,
   collectives and Adam step of the slowest device, per iteration).
3. Measured: :func:`hapnb.launch` runs the plan on ``--nproc`` local gloo ranks with
   ``OMP_NUM_THREADS=1`` for ``--warmup + --steps`` steps; :func:`hapnb.run.calibrate.calibrate` takes the
   slowest rank's ``step_s`` per step and the median over the steps after the warm-up (the worker's step
   also all-reduces the loss for its report, one small collective the plan does not count). The run is
   repeated ``--repeats`` times (a fresh launch each) and the median of the runs' medians is compared;
   the 1-minute load average before each launch is kept (the machine is shared).
4. ``--one-rank``: each model also as a one-device plan (one device of the same profile) on one gloo
   rank through the same launcher: computation and the Adam step with no peer to wait for.
5. ``--also 3,4``: the same at other rank counts (more ranks than cores: oversubscribed), each with its
   own profile, kept under ``other_nproc``.

Writes ``--out`` (default docs/benchmarks/fidelity-gloo.json) and prints a table. The machine is shared and has 2
cores: timings are noisy, so the JSON keeps every repeat.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hapnb  # noqa: E402
from hapnb.hardware.cluster import Cluster  # noqa: E402
from hapnb.run.calibrate import calibrate, prediction_stats  # noqa: E402
from hapnb.run.profile import profile_cluster  # noqa: E402

_T = dict(layers=2, hidden=128, heads=4, vocab=1024, seq=64, dropout=0.0)
#: (label, zoo name, options): global batch; one rank runs a step in ~5-100 ms
PLANS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("mlp-512", "mlp", dict(layers=4, hidden=512, input=512, batch=64)),
    ("mlp-1024", "mlp", dict(layers=2, hidden=1024, input=1024, batch=128)),
    ("gpt", "gpt", dict(_T, batch=8)),
    ("bert", "bert", dict(_T, batch=8)),
    ("bert-moe", "bert-moe", dict(_T, batch=8, experts=2)),
    ("vit", "vit", dict(layers=2, hidden=128, heads=4, image=32, patch=4, batch=16, dropout=0.0)),
    ("lm-L2-H128", "lm", dict(layers=2, hidden=128, seq=64, batch=8, vocab=2048)),
    ("lm-L2-H256", "lm", dict(layers=2, hidden=256, seq=64, batch=16, vocab=4096)),
)  # fmt: skip


def measure(
    plan: Any, nproc: int, steps: int, warmup: int, extra_args: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One launch of ``plan`` on ``nproc`` gloo ranks: median slowest-rank step after ``warmup``, and
    the 1-minute load average before and after (how busy the shared machine was). ``extra_args`` go to
    the worker (e.g. ``--grad-sync sync``)."""
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    job = hapnb.launch(
        plan,
        nproc=nproc,
        steps=warmup + steps,
        env={"OMP_NUM_THREADS": "1"},
        timeout_s=300,
        extra_args=extra_args,
    )
    with job:
        res = job.wait()
    if not res.ok:
        raise RuntimeError(f"launch failed: {res.error}")
    rep = calibrate(plan, res.metrics, warmup=warmup)
    times = res.step_times(warmup)
    per_rank: dict[int, list[float]] = {}
    for m in res.metrics:
        if m.get("step", -1) >= warmup:
            per_rank.setdefault(m["rank"], []).append(m["step_s"])
    return {
        "median_s": rep.measured_s,
        "min_s": min(times),
        "steps_used": rep.steps_used,
        "rank_median_s": [statistics.median(per_rank[r]) for r in sorted(per_rank)],
        "wall_s": time.perf_counter() - t0,
        "loadavg_1min": [load0, os.getloadavg()[0]],
        "report": rep,
    }


def study(nproc: int, ns: argparse.Namespace, labels: set[str] | None) -> dict[str, Any]:
    """Profile ``nproc`` gloo ranks (or load ``--cluster``), synthesize each plan, launch and compare."""
    t_prof = time.perf_counter()
    if ns.cluster:
        cluster = Cluster.load(ns.cluster)
    else:
        cluster = profile_cluster(nproc, "gloo", quick=ns.quick, threads=1)
    t_prof = time.perf_counter() - t_prof
    if cluster.n != nproc:
        raise SystemExit(f"the cluster has {cluster.n} devices, the study needs {nproc}")
    if cluster.devices[0].model is None:
        raise SystemExit("the cluster's devices carry no device model; profile with `hapnb profile`")
    print(f"\n== {nproc} ranks ==\n{cluster}")
    rows = []
    for label, name, options in PLANS:
        if labels and label not in labels:
            continue
        t0 = time.perf_counter()
        plan = hapnb.synthesize(name, cluster, **options)
        synth_s = time.perf_counter() - t0
        runs = [measure(plan, nproc, ns.steps, ns.warmup) for _ in range(ns.repeats)]
        rep = runs[0]["report"]
        med = statistics.median(r["median_s"] for r in runs)
        low = min(r["min_s"] for r in runs)
        row = {
            "label": label, "model": name, "options": options, "nproc": nproc,
            "predicted_s": plan.cost_s, "predicted_comm_s": rep.predicted_comm_s,
            "predicted_comp_s": rep.predicted_comp_s, "stages": len(plan.stages),
            "ratios": [list(map(float, r)) for r in plan.ratios],
            "communicating_stages": sum(1 for s in plan.stages if s.comm_s > 0),
            "program": [str(i) for i in plan.program],
            "measured_s": med, "measured_min_s": low,
            "repeat_median_s": [r["median_s"] for r in runs],
            "rank_median_s": [r["rank_median_s"] for r in runs],
            "loadavg_1min": [r["loadavg_1min"] for r in runs],
            "synthesis_s": synth_s, "launch_wall_s": [r["wall_s"] for r in runs],
        }  # fmt: skip
        if ns.one_rank:  # the same model as a one-device plan on one gloo rank: computation, no peer
            one = cluster.replace(name=f"1x{cluster.devices[0].kind} (profiled)", devices=cluster.devices[:1])
            plan1 = hapnb.synthesize(name, one, **options)
            runs1 = [measure(plan1, 1, ns.steps, ns.warmup) for _ in range(ns.repeats)]
            row["one_rank"] = {
                "predicted_s": plan1.cost_s,
                "measured_s": statistics.median(r["median_s"] for r in runs1),
                "measured_min_s": min(r["min_s"] for r in runs1),
                "repeat_median_s": [r["median_s"] for r in runs1],
                "loadavg_1min": [r["loadavg_1min"] for r in runs1],
            }
            o = row["one_rank"]
            print(
                f"{'  1 rank':<12} pred {o['predicted_s'] * 1e3:8.2f} ms  measured {o['measured_s'] * 1e3:8.2f} ms "
                f"(min {o['measured_min_s'] * 1e3:.2f})  err {100 * (o['predicted_s'] / o['measured_s'] - 1):+6.1f}%"
            )
        rows.append(row)
        reps = ", ".join(f"{r['median_s'] * 1e3:.2f}" for r in runs)
        loads = ", ".join(f"{r['loadavg_1min'][0]:.1f}" for r in runs)
        print(
            f"{label:<12} pred {plan.cost_s * 1e3:8.2f} ms (comm {rep.predicted_comm_s * 1e3:6.2f})  "
            f"measured {med * 1e3:8.2f} ms (repeats {reps}; min {low * 1e3:.2f})  "
            f"err {100 * (plan.cost_s / med - 1):+6.1f}%  load {loads}",
            flush=True,
        )
    summary = {
        "step time (median of runs' medians)": prediction_stats([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
        "step time vs the fastest step": prediction_stats([r["predicted_s"] for r in rows], [r["measured_min_s"] for r in rows]),
    }  # fmt: skip
    if rows and all("one_rank" in r for r in rows):
        ones = [r["one_rank"] for r in rows]
        summary["one rank, one-device plan: step time (median)"] = prediction_stats(
            [o["predicted_s"] for o in ones], [o["measured_s"] for o in ones]
        )
        summary["one rank, one-device plan: vs the fastest step"] = prediction_stats(
            [o["predicted_s"] for o in ones], [o["measured_min_s"] for o in ones]
        )
    print()
    print(f"{'plan':<12} {'pred ms':>8} {'comm ms':>8} {'meas ms':>8} {'err':>7} {'min ms':>8} {'err':>7}")
    for r in rows:
        m, lo = r["measured_s"], r["measured_min_s"]
        print(
            f"{r['label']:<12} {r['predicted_s'] * 1e3:8.2f} {r['predicted_comm_s'] * 1e3:8.2f} {m * 1e3:8.2f}"
            f" {100 * (r['predicted_s'] / m - 1):+6.1f}% {lo * 1e3:8.2f} {100 * (r['predicted_s'] / lo - 1):+6.1f}%"
        )
    for k, s in summary.items():
        print(f"{k}: mean |err| {s['mean_abs_pct']:.1f} %, max {s['max_abs_pct']:.1f} %, "
              f"Pearson {s['pearson']:.3f}, Spearman {s['spearman']:.3f}")  # fmt: skip
    return {
        "nproc": nproc,
        "profile_s": t_prof,
        "cluster": cluster.to_json(),
        "summary": summary,
        "runs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="local gloo ranks of the main study (1 thread each)")
    ap.add_argument(
        "--also", default="", help="comma-separated further rank counts (e.g. 3,4: oversubscribed)"
    )
    ap.add_argument(
        "--also-only", default=None, help="labels to run at the --also rank counts (default: all)"
    )
    ap.add_argument("--cluster", default=None, help="a profiled cluster JSON (default: profile now)")
    ap.add_argument("--quick", action="store_true", help="profile in quick mode (poor collective fits)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="launches per plan")
    ap.add_argument(
        "--one-rank", action="store_true", help="also run each model as a one-device plan on one gloo rank"
    )
    ap.add_argument("--only", default=None, help="comma-separated labels to run (no JSON written)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "fidelity-gloo.json"))
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    only = set(ns.only.split(",")) if ns.only else None
    main_study = study(ns.nproc, ns, only)
    others = []
    also_only = set(ns.also_only.split(",")) if ns.also_only else only
    for k in (int(x) for x in ns.also.split(",") if x):
        others.append(study(k, argparse.Namespace(**{**vars(ns), "cluster": None}), also_only))
    out = {
        "what": f"plans on {ns.nproc} local gloo CPU ranks (1 torch thread each): predicted (hapnb.synthesize "
        "on the profiled cluster, cost_s) vs measured (hapnb.launch, slowest rank's step, median after warm-up, "
        "median over repeated launches)",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "steps": ns.steps,
        "warmup": ns.warmup,
        "repeats": ns.repeats,
        "command": "python benchmarks/fidelity_gloo.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        **main_study,
        "other_nproc": others,
    }
    if not only:
        Path(ns.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {ns.out}")
    rows = main_study["runs"] + [r for s in others for r in s["runs"]]
    return 0 if rows and all(math.isfinite(r["predicted_s"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
