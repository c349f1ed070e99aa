"""Every strategy on the HAP paper's clusters, under one cost model (docs/benchmarks/comparison.md): the shape of the
paper's Fig. 13 (VGG19, ViT, BERT, BERT-MoE on paper-hetero-8/16/32/64), Fig. 14 (the same models on
paper-homo-32) and Fig. 17 (BERT-MoE on a100-p100 with a varying number of experts, tokens proportional
to the experts: HAP's uneven experts against DeepSpeed's even, padded expert parallelism).

Each row is one :func:`hapnb.compare` (HAP with ``pick="cost"``, HAP's own stage-model choice, as the
paper compares) plus HAP's default pick (``pick="simulated"``, by re-planning the same context: cheap), so
both clocks can be checked: the stage model with ``pick="cost"`` and the simulated time with the default
pick. Paper configurations (the zoo's defaults: hidden 768, 12 heads, 12 layers, seq 128; BERT-MoE with
2 experts per device) and the paper's weak scaling: 64 samples per device (32 for BERT-MoE).

    python benchmarks/comparison.py                       # everything (minutes: see docs/benchmarks/comparison.md)
    python benchmarks/comparison.py --figures 17 --budget 600
    python benchmarks/comparison.py --figures 13 --clusters paper-hetero-8 --models vgg19,bert

Rows are appended to ``--out`` (default docs/benchmarks/comparison.json) as they finish, each with the load average;
``--budget`` seconds (default 5400) stops starting new rows once spent (the skipped rows are listed).
``--tables`` prints the markdown tables of docs/benchmarks/comparison.md from an existing JSON without running.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import hapnb as hap
from hapnb.plans.comparison import expert_groups
from hapnb.plans.synthesis import replan

FIG13_CLUSTERS = ("paper-hetero-8", "paper-hetero-16", "paper-hetero-32", "paper-hetero-64")
FIG14_CLUSTERS = ("paper-homo-32",)
MODELS = ("vgg19", "vit", "bert", "bert-moe")
#: Fig. 17: expert counts on a100-p100 (4 devices), sequences proportional to the experts (16 per expert,
#: 128 tokens each: each expert's load stays ~5120 tokens).
FIG17_EXPERTS = tuple(range(4, 17))
PER_DEVICE = {"bert-moe": 32}  # samples per device (paper §7.1); 64 for the others
TOL = 1 + 1e-9


def _load() -> float:
    return os.getloadavg()[0]


def run_row(figure: str, model: str, cluster: str, **options: Any) -> dict[str, Any]:
    c = hap.Cluster.resolve(cluster)
    t0 = time.perf_counter()
    load0 = _load()
    cmp = hap.compare(model, c, pick="cost", **options)
    compare_s = time.perf_counter() - t0
    row: dict[str, Any] = {
        "figure": figure, "model": model, "cluster": cluster, "devices": c.n, "options": options,
        "batch": cmp.batch, "trace_s": cmp.trace_s, "compare_s": compare_s,
    }  # fmt: skip
    row["strategies"] = {r.strategy: r.to_json() for r in cmp}
    hap_row = cmp["hap"]
    if hap_row.available:
        t1 = time.perf_counter()
        sim_plan = replan(hap_row.plan, pick="simulated")  # the same context: searches and LPs reused
        row["hap_default_pick"] = {
            "iteration_s": sim_plan.cost_s,
            "simulated_s": sim_plan.simulated_s,
            "chosen": sim_plan.stats.get("chosen"),
            "replan_s": time.perf_counter() - t1,
        }
        row["hap_synthesis_s"] = hap_row.planning_s
        row["hap_optimal"] = hap_row.plan.stats.get("optimal")
        row["hap_chosen"] = hap_row.plan.stats.get("chosen")
        groups = expert_groups(hap_row.plan.planner.theory)
        if groups:  # the experts each device holds in HAP's plan (first MoE layer; dim 0 of its first weight)
            name, dim = groups[0].weights[0]
            try:
                row["hap_experts"] = list(hap_row.plan.lengths_of(name, dim))
            except KeyError:  # not sharded on the expert dim
                row["hap_experts"] = "not sharded"
    row["claims"] = claims(row)
    row["total_s"] = time.perf_counter() - t0
    row["load"] = [load0, _load()]
    return row


def claims(row: dict[str, Any]) -> dict[str, Any]:
    """HAP vs every data-parallel baseline: stage model with pick="cost" and simulated with the default
    pick (the claims), and the two crossed clocks (reported, not claimed)."""
    s = row["strategies"]
    dp = [k for k in ("dp_ev", "dp_cp") if s.get(k, {}).get("available")]
    if not s.get("hap", {}).get("available") or not dp:
        return {}
    h = s["hap"]
    d = row.get("hap_default_pick", {})
    out = {
        "stage_pick_cost": all(h["iteration_s"] <= s[k]["iteration_s"] * TOL for k in dp),
        "simulated_pick_cost": all(h["simulated_s"] <= s[k]["simulated_s"] * TOL for k in dp),
    }
    if d:
        out["simulated_default_pick"] = all(d["simulated_s"] <= s[k]["simulated_s"] * TOL for k in dp)
        out["stage_default_pick"] = all(d["iteration_s"] <= s[k]["iteration_s"] * TOL for k in dp)
    return out


def plan_rows(ns: argparse.Namespace) -> list[tuple[str, str, str, dict[str, Any]]]:
    figures = ns.figures.split(",")
    models = ns.models.split(",")
    out = []
    for fig, clusters in (("13", FIG13_CLUSTERS), ("14", FIG14_CLUSTERS)):
        if fig not in figures:
            continue
        for cluster in clusters:
            if ns.clusters and cluster not in ns.clusters.split(","):
                continue
            n = hap.Cluster.resolve(cluster).n
            for m in models:
                out.append((fig, m, cluster, {"batch": PER_DEVICE.get(m, 64) * n}))
    if "17" in figures:
        for e in FIG17_EXPERTS:
            opts = {"experts": e, "batch": 16 * e, "strategies": "hap,dp_ev,dp_cp,tp,ep,fsdp"}
            out.append(("17", "bert-moe", "a100-p100", opts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--figures", default="13,14,17")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clusters", default="", help="only these clusters (Fig. 13/14)")
    ap.add_argument("--budget", type=float, default=5400.0, help="seconds; no new row starts after")
    ap.add_argument("--out", default="docs/benchmarks/comparison.json")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --out (others replaced)")
    ap.add_argument("--tables", action="store_true", help="print the markdown tables of --out and exit")
    ns = ap.parse_args()
    out = Path(ns.out)
    if ns.tables:
        print(tables(json.loads(out.read_text())))
        return
    doc: dict[str, Any] = {"rows": [], "skipped": []}
    if ns.append and out.exists():
        doc = json.loads(out.read_text())
    t0 = time.perf_counter()
    for fig, model, cluster, opts in plan_rows(ns):
        key = (
            fig,
            model,
            cluster,
            json.dumps({k: v for k, v in opts.items() if k != "strategies"}, sort_keys=True),
        )
        doc["rows"] = [r for r in doc["rows"] if _key(r) != key]
        if time.perf_counter() - t0 > ns.budget:
            doc["skipped"].append({"figure": fig, "model": model, "cluster": cluster, "options": opts})
            continue
        row = run_row(fig, model, cluster, **opts)
        doc["rows"].append(row)
        doc["elapsed_s"] = time.perf_counter() - t0
        out.write_text(_dumps(doc))
        st = row["strategies"]
        print(
            f"fig {fig} {model:9s} {cluster:16s} {json.dumps(opts):48s} "
            + " ".join(
                f"{k} {v['iteration_s']:.4g}{'!' if v['fits'] is False else ''}"
                for k, v in st.items()
                if v["available"]
            )
            + f"  claims {row['claims']}  {row['total_s']:.1f} s (load {row['load'][0]:.1f})",
            flush=True,
        )
    doc["elapsed_s"] = time.perf_counter() - t0
    out.write_text(_dumps(doc))


def _dumps(doc: dict[str, Any]) -> str:
    """The JSON file: one row per line (diffs stay readable, the file small)."""
    rows = ",\n".join(json.dumps(r, separators=(",", ":")) for r in doc["rows"])
    rest = json.dumps({k: v for k, v in doc.items() if k != "rows"})[1:-1]
    return "{" + rest + (", " if rest else "") + '"rows": [\n' + rows + "\n]}\n"


def _key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    opts = {k: v for k, v in r["options"].items() if k != "strategies"}
    return (r["figure"], r["model"], r["cluster"], json.dumps(opts, sort_keys=True))


def _label(r: dict[str, Any]) -> str:
    layers = r["options"].get("layers")
    return f"{r['model']} ({layers} layers)" if layers else r["model"]


def _t(v: dict[str, Any] | None, clock: str = "iteration_s") -> str:
    if not v or not v.get("available") or v.get(clock) is None:
        return "—"
    mark = " (OOM)" if v.get("fits") is False else ""
    return f"{v[clock]:.3f}{mark}"


ORDER = ("hap", "dp_ev", "dp_cp", "tp", "ep", "fsdp", "pipeline")


def _figure_table(rows: list[dict[str, Any]], clock: str, title: str) -> list[str]:
    """One clock's table of Fig. 13/14 rows; on the simulated clock HAP is its default pick's plan."""
    synth = clock == "iteration_s"
    lines = [
        title,
        "| cluster | model | "
        + " | ".join(ORDER)
        + " | HAP vs best DP |"
        + (" HAP synthesis (s) |" if synth else ""),
        "|---|---|" + "---:|" * (len(ORDER) + 1 + synth),
    ]
    for r in rows:
        s = dict(r["strategies"])
        d = r.get("hap_default_pick")
        if d and not synth:
            s["hap"] = {**s["hap"], "simulated_s": d["simulated_s"]}
        dp = [s[k][clock] for k in ("dp_ev", "dp_cp") if s.get(k, {}).get("available")]
        speed = f"{min(dp) / s['hap'][clock]:.2f}x" if dp and s["hap"]["available"] else "—"
        lines.append(
            f"| {r['cluster']} | {_label(r)} | "
            + " | ".join(_t(s.get(k), clock) for k in ORDER)
            + f" | {speed} |"
            + (f" {r.get('hap_synthesis_s', 0):.1f} |" if synth else "")
        )
    return lines


def tables(doc: dict[str, Any]) -> str:
    """The markdown tables of docs/benchmarks/comparison.md."""
    lines = []
    for fig in ("13", "14"):
        rows = [r for r in doc["rows"] if r["figure"] == fig]
        if rows:
            lines += _figure_table(
                rows,
                "iteration_s",
                f'\n**Fig. {fig}** — stage model, seconds per iteration (HAP: `pick="cost"`); (OOM): does not '
                "fit in memory\n",
            )
            lines += _figure_table(
                rows,
                "simulated_s",
                f'\n**Fig. {fig}** — simulated, seconds per iteration (HAP: the default `pick="simulated"`; '
                "pipeline: its schedule simulation)\n",
            )
    rows = [r for r in doc["rows"] if r["figure"] == "17"]
    if rows:
        lines += [
            '\n**Fig. 17** — BERT-MoE on a100-p100, seconds per iteration: stage model (HAP `pick="cost"`) '
            "and simulated (HAP's default pick)\n",
            "| experts | batch | hap | experts per device (hap) | ep (padded) | ep padded to | ep / hap | dp_ev | "
            "dp_cp | tp | hap simulated | ep simulated | ep / hap simulated |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            s = r["strategies"]
            e = r["options"]["experts"]
            ep, h = s.get("ep", {}), s["hap"]
            hs = r.get("hap_default_pick", {}).get("simulated_s")
            both = ep.get("available") and h["available"]
            speed = f"{ep['iteration_s'] / h['iteration_s']:.2f}x" if both else "—"
            speed_sim = f"{ep['simulated_s'] / hs:.2f}x" if both and hs else "—"
            experts = ", ".join(map(str, r["hap_experts"])) if isinstance(r.get("hap_experts"), list) else "—"
            lines.append(
                f"| {e} | {r['batch']} | {_t(h)} | {experts} | {_t(ep)} | {4 * math.ceil(e / 4)} | {speed} | "
                f"{_t(s.get('dp_ev'))} | {_t(s.get('dp_cp'))} | {_t(s.get('tp'))} | "
                f"{'—' if hs is None else f'{hs:.3f}'} | {_t(ep, 'simulated_s')} | {speed_sim} |"
            )
    ok = [r for r in doc["rows"] if r.get("claims")]
    for k in ("stage_pick_cost", "simulated_default_pick", "simulated_pick_cost", "stage_default_pick"):
        good = sum(1 for r in ok if r["claims"].get(k))
        lines.append(f"\n* `{k}`: HAP at least as good as every DP baseline in {good} of {len(ok)} rows")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
