"""Ditto's evaluation (§7, Fig. 9 and 10) with hapnb's planner: GPT-2 XL (48 layers, hidden 1600, 25 heads,
seq 1024, vocab 50257) on the five heterogeneous clusters of Fig. 8 (presets ``ditto-ex1..5``), planned by
DP recovery (Ditto's, and hapnb's default with both choice widths and cut refinement), greedy recovery,
and the exhaustive search — with branch and bound (exact when it finishes) and plain (Ditto's reference,
within a budget, extrapolated when it runs out).

Targets (issue 11): DP recovery within 8 % of the exhaustive optimum on every cluster; planning at least
10x faster than the exhaustive search on ex3-ex5.

    python benchmarks/pipelines.py [--presets 1,2,3,4,5] [--budget 900] [--plain-budget 300]
                                   [--out docs/benchmarks/benchmarks-pipelines.json]

Every figure is wall time on the machine it runs on, with the load average beside it; the layer costs
(tracing a 2-block GPT-2 XL and pricing it) are measured separately from planning, as Ditto's planning
latency leaves profiling out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from hapnb.hardware.cluster import Cluster
from hapnb.pipelines.costs import model_costs
from hapnb.pipelines.exhaustive import exhaustive
from hapnb.pipelines.planner import default_micro_batches, plan_pipeline
from hapnb.pipelines.timing import Pricer


def load() -> float:
    return os.getloadavg()[0]


def run_preset(ex: int, budget: float, plain_budget: float) -> dict:
    c = Cluster.preset(f"ditto-ex{ex}")
    batch = 32 * c.n
    k = default_micro_batches(batch)
    t0 = time.perf_counter()
    costs = model_costs("gpt2-xl", c, micro_batch=batch // k, batch=batch)
    costs_s = time.perf_counter() - t0
    row: dict = {"preset": f"ditto-ex{ex}", "devices": c.n, "batch": batch, "micro_batches": k}
    row["costs_s"] = costs_s
    row["load_before"] = load()
    plan = plan_pipeline(costs, c, k, exhaustive_search=True, budget_s=budget, prune=True, name="gpt2-xl")
    st = plan.stats
    ex_stats = st["exhaustive"]
    row.update(
        dp_iteration_s=plan.iteration_s,
        dp_planning_s=plan.planning_s,
        dp_paper_iteration_s=st.get("dp_paper_iteration_s"),
        dp_wide_iteration_s=st.get("dp_wide_iteration_s"),
        greedy_iteration_s=st.get("greedy_iteration_s"),
        greedy_paper_iteration_s=st.get("greedy_paper_iteration_s"),
        greedy_planning_s=st.get("greedy_planning_s"),
        fold=st["fold"],
        stages=[
            {"units": [plan.units[s.units[0]], plan.units[s.units[1] - 1]], "devices": list(s.devices)}
            for s in plan.stages
        ],
        simulated_s=st.get("simulated_s"),
        exhaustive_iteration_s=plan.exhaustive_iteration_s,
        exhaustive_planning_s=plan.exhaustive_planning_s,
        exhaustive_finished=ex_stats["finished"],
        exhaustive_stopped_at=ex_stats["stopped_at"],
    )
    row["load_after_dp_and_bnb"] = load()
    opt = plan.exhaustive_iteration_s if ex_stats["finished"] else None
    if opt:
        row["dp_gap"] = plan.iteration_s / opt - 1
        for key in ("dp_paper", "greedy", "greedy_paper"):
            if row.get(f"{key}_iteration_s"):
                row[f"{key}_gap"] = row[f"{key}_iteration_s"] / opt - 1
    # Ditto's reference: the plain exhaustive search, no bound, within its budget
    pricer = Pricer(costs, c, k)
    t0 = time.perf_counter()
    plain = exhaustive(pricer, budget_s=plain_budget, prune=False)
    row["plain"] = plain.to_json()
    row["plain"]["wall_s"] = time.perf_counter() - t0
    row["load_after_plain"] = load()
    # a plain run that ran out of budget still proves the speed-up is at least budget / DP time
    row["speedup_vs_plain"] = plain.planning_s / plan.planning_s
    row["speedup_vs_plain_is_lower_bound"] = not plain.finished
    row["speedup_vs_plain_extrapolated"] = plain.extrapolated_s / plan.planning_s
    row["speedup_vs_bnb"] = (plan.exhaustive_planning_s or 0.0) / plan.planning_s
    return row


def _pct(row: dict, key: str) -> str:
    return f"{100 * row[key]:.1f} %" if row.get(key) is not None else "-"


def table(rows: list[dict]) -> str:
    head = (
        "| cluster | GPUs | DP (s) | Ditto's DP (s) | greedy (s) | exhaustive optimum (s) | DP gap | Ditto's DP gap "
        "| greedy gap | DP planning (s) | exhaustive B&B (s) | plain exhaustive (s) | speed-up vs plain |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    out = [head]
    for r in rows:
        plain = r["plain"]
        plain_s = (
            f"{plain['planning_s']:.1f}"
            if plain["finished"]
            else f"> {plain['planning_s']:.0f} (~{plain['extrapolated_s']:.0f} extrapolated)"
        )
        opt = f"{r['exhaustive_iteration_s']:.3f}" if r["exhaustive_finished"] else "not reached"
        ge = ">" if r["speedup_vs_plain_is_lower_bound"] else ""
        out.append(
            f"| {r['preset']} | {r['devices']} | {r['dp_iteration_s']:.3f} | {r['dp_paper_iteration_s']:.3f} | "
            f"{r['greedy_iteration_s']:.3f} | {opt} | {_pct(r, 'dp_gap')} | {_pct(r, 'dp_paper_gap')} | {_pct(r, 'greedy_gap')} | "
            f"{r['dp_planning_s']:.2f} | {r['exhaustive_planning_s']:.1f} | {plain_s} | {ge}{r['speedup_vs_plain']:.0f}x |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="1,2,3,4,5")
    ap.add_argument("--budget", type=float, default=900.0, help="branch-and-bound exhaustive budget (s)")
    ap.add_argument("--plain-budget", type=float, default=300.0, help="plain exhaustive budget (s)")
    ap.add_argument("--out", default="docs/benchmarks/benchmarks-pipelines.json")
    ns = ap.parse_args()
    rows = []
    for ex in (int(x) for x in ns.presets.split(",")):
        row = run_preset(ex, ns.budget, ns.plain_budget)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("stages", "fold")}), flush=True)
    doc = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model": "gpt2-xl (zoo gpt: 48 layers, hidden 1600, 25 heads, seq 1024, vocab 50257), batch 32/GPU, "
        "micro-batches of 4, 1F1B",
        "budgets_s": {"branch_and_bound": ns.budget, "plain": ns.plain_budget},
        "rows": rows,
    }
    Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
