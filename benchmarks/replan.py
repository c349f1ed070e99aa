"""Re-planning benchmark: ``plan.replan(...)`` against a fresh ``hapnb.synthesize`` with the same inputs.

For one model and cluster (default BERT-12 at the paper's configuration on ``paper-hetero-8``) it
synthesizes the base plan, then times, for each edit, a fresh synthesis with the edited inputs
(``synthesis_s``: graph -> plan, tracing excluded) and ``base.replan(...)`` with the same edit (wall and
CPU seconds, median of ``--repeat`` runs, each re-plan from a fresh copy of the base plan's context so
that no edit is timed with its own answer already in the memo), and checks that the two plans are
equal (timings aside). Edits: one pin, the pin removed again (every search answered from the memo), a
ratio lock, a device 10 % faster, the all-reduce bandwidth 10 % higher. Also: ``plan.sensitivity()``
and ``plan.why_not(...)`` on the base plan. Writes a JSON file and prints a Markdown table.

    python benchmarks/replan.py [--model bert] [--layers 12] [--cluster paper-hetero-8] [--repeat 3]
                                [--sweep bert,gpt,vit] [--out docs/benchmarks/benchmarks-replan.json]

Each edit is also re-planned with ``exact=False`` (the fast path: the Q/B loop from the base plan's ratios,
no baseline seeds), timed the same way and compared with the fresh plan. ``--sweep``: for each model,
every single-pin edit of :func:`sweep_pins`, fast against exact (same plan? cost and simulated ratios).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import hapnb
from hapnb.plans.explain import faster
from hapnb.synth.memo import Memo


def timeless(p: hapnb.Plan) -> hapnb.Plan:
    return p.without_timings()


def timed(fn: Any) -> tuple[Any, float, float]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def snapshot(memo: Memo) -> Memo:
    """A copy of the memo's tables (the per-ratio cost dicts too: searches add to them)."""
    out = Memo(memo.limit, memo.limits)
    out.tables = {k: dict(v) for k, v in memo.tables.items()}
    out.tables["shared"] = {
        k: {n: dict(d) if isinstance(d, dict) else d for n, d in v.items()}
        for k, v in out.tables.get("shared", {}).items()
    }
    return out


def fresh_context(base: hapnb.Plan, pristine: Memo | None = None) -> hapnb.Plan:
    """The base plan with a copy of its planner as synthesize left it (so no edit meets its own answer)."""
    planner = copy.copy(base.planner)
    planner.memo = snapshot(PRISTINE if pristine is None else pristine)
    return dataclasses.replace(base, planner=planner)


def sweep_pins(base: hapnb.Plan, layers: int) -> list[tuple[str, str]]:
    """Single-pin edits: every 2-D weight of layers 0 and ``layers // 3``, in each of I, G0, G1 that the
    base plan does not already give it."""
    g = base.planner.theory.graph
    picked = []
    for name in dict(base.options)["params"]:
        parts = name.split(".")
        if len(g.tensor(name).shape) != 2 or not any(p in parts for p in ("0", str(layers // 3))):
            continue
        picked += [(name, f) for f in ("I", "G0", "G1") if f not in base.form_of(name)]
    return picked


def sweep(models: list[str], layers: int, cluster: str) -> dict[str, Any]:
    """Fast re-plans (``exact=False``) against exact ones (what a fresh synthesize returns) over the single-pin
    edits of :func:`sweep_pins`, each from the base plan's memo as synthesize left it."""
    rows = []
    for model in models:
        base = hapnb.synthesize(model, cluster, layers=layers)
        pristine = snapshot(base.planner.memo)
        for name, form in sweep_pins(base, layers):
            edit = {"pins": {name: form}}
            start = fresh_context(base, pristine)
            (fast, wall, cpu) = timed(lambda start=start, edit=edit: start.replan(**edit, exact=False))
            exact = fresh_context(base, pristine).replan(**edit)
            rows.append({
                "model": model, "pin": f"{name}={form}", "fast_wall_s": wall, "fast_cpu_s": cpu,
                "exact_synthesis_s": exact.synthesis_s,
                "same_plan": fast.program == exact.program and fast.ratios == exact.ratios,
                "cost_ratio": fast.cost_s / exact.cost_s, "simulated_ratio": fast.simulated_s / exact.simulated_s,
                "exact_chosen": exact.stats.get("chosen"),
            })  # fmt: skip
    n = len(rows)
    return {
        "models": models,
        "layers": layers,
        "cluster": cluster,
        "edits": n,
        "same_plan": sum(r["same_plan"] for r in rows),
        "cost_within_1e-9": sum(r["cost_ratio"] <= 1 + 1e-9 for r in rows),
        "max_cost_ratio": max(r["cost_ratio"] for r in rows),
        "min_cost_ratio": min(r["cost_ratio"] for r in rows),
        "max_simulated_ratio": max(r["simulated_ratio"] for r in rows),
        "median_fast_wall_s": statistics.median(r["fast_wall_s"] for r in rows),
        "max_fast_wall_s": max(r["fast_wall_s"] for r in rows),
        "rows": rows,
        "loadavg": os.getloadavg(),
    }


PRISTINE: Any = None


def main() -> None:
    global PRISTINE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cluster", default="paper-hetero-8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="docs/benchmarks/benchmarks-replan.json")
    ap.add_argument(
        "--sweep", default="bert,gpt,vit", help="models of the fast-vs-exact single-pin sweep ('' skips it)"
    )
    ns = ap.parse_args()
    opts = {"layers": ns.layers}
    base = hapnb.synthesize(ns.model, ns.cluster, **opts)
    PRISTINE = snapshot(base.planner.memo)
    c = base.cluster
    params = [
        p for p in dict(base.options)["params"] if p.endswith("linear1.weight") or p.endswith(".weight")
    ]
    pin_name = (
        next(p for p in params if ".3." in p and "linear1" in p)
        if ns.model == "bert"
        else params[len(params) // 2]
    )
    form = "G1" if "G1" not in base.form_of(pin_name) else "G0"
    edits = [
        ("one pin", dict(pins={pin_name: form}), dict(pins={pin_name: form})),
        ("ratio lock", dict(ratio_pins={c.names[0]: 0.2}), dict(ratios={c.names[0]: 0.2})),
        ("device +10 % flop/s", dict(cluster=faster(c, device=c.names[0])), dict(cluster=faster(c, device=c.names[0]))),
        ("all_reduce +10 % bandwidth", dict(cluster=faster(c, collective="all_reduce")),
         dict(cluster=faster(c, collective="all_reduce"))),
    ]  # fmt: skip
    rows = []
    th = base.planner.theory  # fresh syntheses from the traced program: tracing is not timed
    for label, edit, fresh_kw in edits:
        cl = fresh_kw.pop("cluster", ns.cluster)
        fresh = [timed(lambda cl=cl, kw=fresh_kw: hapnb.synthesize(th, cl, **kw)) for _ in range(ns.repeat)]
        same = hapnb.synthesize(ns.model, cl, **fresh_kw, **opts)  # from the zoo: records the model too
        runs = [timed(lambda edit=edit: fresh_context(base).replan(**edit)) for _ in range(ns.repeat)]
        fast = [
            timed(lambda edit=edit: fresh_context(base).replan(**edit, exact=False)) for _ in range(ns.repeat)
        ]
        new, quick = runs[0][0], fast[0][0]
        row = {
            "edit": label,
            "fresh_wall_s": statistics.median(r[1] for r in fresh),
            "fresh_cpu_s": statistics.median(r[2] for r in fresh),
            "replan_wall_s": statistics.median(r[1] for r in runs),
            "replan_cpu_s": statistics.median(r[2] for r in runs),
            "equal_to_fresh": timeless(new) == timeless(same),
            "cost_s": new.cost_s,
            "memo": repr(new.planner.memo),
            "fast_wall_s": statistics.median(r[1] for r in fast),
            "fast_cpu_s": statistics.median(r[2] for r in fast),
            "fast_same_plan": quick.program == same.program and quick.ratios == same.ratios,
            "fast_cost_ratio": quick.cost_s / same.cost_s,
            "fast_simulated_ratio": quick.simulated_s / same.simulated_s,
        }  # fmt: skip
        rows.append(row)
        if label == "one pin":  # the pin taken back: every search, LP and simulation is in the memo
            again = [timed(lambda new=new: new.replan(pins={pin_name: None})) for _ in range(ns.repeat)]
            rows.append({
                "edit": "the pin removed again",
                "fresh_wall_s": base.synthesis_s,
                "fresh_cpu_s": None,
                "replan_wall_s": statistics.median(r[1] for r in again),
                "replan_cpu_s": statistics.median(r[2] for r in again),
                "equal_to_fresh": timeless(again[0][0]) == timeless(base),
                "cost_s": again[0][0].cost_s,
                "memo": repr(again[0][0].planner.memo),
            })  # fmt: skip
    sens = [timed(lambda: fresh_context(base).sensitivity()) for _ in range(ns.repeat)]
    swept = sweep(ns.sweep.split(","), ns.layers, ns.cluster) if ns.sweep else None
    why = [timed(lambda: fresh_context(base).why_not({pin_name: form})) for _ in range(ns.repeat)]
    out = {
        "model": ns.model,
        "layers": ns.layers,
        "cluster": ns.cluster,
        "devices": c.n,
        "pin": f"{pin_name}={form}",
        "base_synthesis_s": base.synthesis_s,
        "rows": rows,
        "sensitivity_wall_s": statistics.median(r[1] for r in sens),
        "why_not_wall_s": statistics.median(r[1] for r in why),
        "sweep": swept,
        "loadavg": os.getloadavg(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    Path(ns.out).write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"{ns.model}-{ns.layers} on {ns.cluster} ({c.n} devices); pin {pin_name}={form}; load {out['loadavg']}"
    )
    print(
        "| edit | fresh synthesize wall / CPU (s) | replan (exact) wall / CPU (s) | equal to fresh "
        "| replan(exact=False) wall / CPU (s) | fast = fresh | fast cost / fresh |"
    )
    print("|---|---:|---:|---|---:|---|---:|")
    for r in rows:
        cpu = "-" if r["fresh_cpu_s"] is None else f"{r['fresh_cpu_s']:.3f}"
        quick = (
            f"{r['fast_wall_s']:.3f} / {r['fast_cpu_s']:.3f} | {'yes' if r['fast_same_plan'] else 'no'} | "
            f"{r['fast_cost_ratio']:.4f}"
            if "fast_wall_s" in r
            else "- | - | -"
        )
        print(
            f"| {r['edit']} | {r['fresh_wall_s']:.3f} / {cpu} | {r['replan_wall_s']:.3f} / {r['replan_cpu_s']:.3f} | "
            f"{'yes' if r['equal_to_fresh'] else 'NO'} | {quick} |"
        )
    if swept:
        print(
            f"sweep ({', '.join(swept['models'])}, {swept['edits']} single-pin edits): fast = exact plan in "
            f"{swept['same_plan']}, cost within 1e-9 in {swept['cost_within_1e-9']}; fast cost / exact "
            f"{swept['min_cost_ratio']:.4f}..{swept['max_cost_ratio']:.4f}, simulated <= "
            f"{swept['max_simulated_ratio']:.4f}x; fast re-plan median {swept['median_fast_wall_s']:.3f} s, "
            f"max {swept['max_fast_wall_s']:.3f} s (load {swept['loadavg']})"
        )
    print(f"sensitivity {out['sensitivity_wall_s']:.3f} s, why_not {out['why_not_wall_s']:.3f} s")


if __name__ == "__main__":
    main()
