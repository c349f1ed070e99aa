"""The real-model corpus at realistic size (issue 18, item 4): HAP against every baseline on one cluster.

Each model of :mod:`examples.corpus` (Hugging Face Llama, T5, ViT, ResNet-50, ConvNeXt-T, GPT-2, BERT,
Mixtral, and a top-2 MoE LM written in torch.nn) is built at ``size="real"``, traced, and compared on
``2xV100+6xP100`` under one cost model with :func:`hapnb.compare` (strategies ``hap``, ``dp_ev``,
``dp_cp``, ``tp``, ``fsdp``, ``ep``). Each model runs in a fresh process (its peak RSS is the child's own).
Reported per model:

* ``cost_s`` (the stage model, what the search minimises) and ``simulated_s`` (the overlap simulator) of
  HAP's plan and of every baseline, and HAP's speed-up over ``dp_ev`` on both clocks;
* the baselines that could not be built, and why (``note``); whether each strategy fits in memory;
* fallback ops: ops without a sharding rule (``plan.fallback_ops``) and compute steps run replicated on
  batch data (:func:`examples.corpus.replicated_ops`), counted by aten target;
* whether the batch is sharded (:func:`examples.corpus.batch_sharded`: the token ids / pixel values are
  loaded ``G0``, or loaded ``I`` and cut to ``G0`` by a free slice) and how each input is loaded;
* the search stats (``optimal``, ``expansions``, ``chosen``: whether the picked program came from the
  search or a baseline), synthesis, trace and build time, and the peak RSS.

    python benchmarks/models.py [--only NAME]... [--cluster 2xV100+6xP100] [--size real]
                                [--out docs/benchmarks/models.json] [--md docs/benchmarks/models.md]

``--suite patterns`` runs the training patterns of :mod:`examples.patterns` instead (padding masks, a
sequence classifier, Whisper, a recommender, a diffusion UNet, a DCGAN generator), by default into
``docs/benchmarks/patterns.json`` and the ``patterns-table`` markers. ``--only`` runs some models and merges
their rows into an existing ``--out`` file; ``--md`` rewrites the
table between the ``models-table`` markers of that file (``--render``: from the ``--out`` file, no runs). The same comparison from the command line:
``hapnb compare --model examples.corpus:llama --set size=real --cluster 2xV100+6xP100 --json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "2xV100+6xP100"
STRATEGIES = ("hap", "dp_ev", "dp_cp", "tp", "fsdp", "ep")
BASELINES = STRATEGIES[1:]


def suite_of(suite: str) -> dict[str, Any]:
    """The factories of a suite by name: ``corpus`` (:data:`examples.corpus.CORPUS`) or ``patterns``
    (:data:`examples.patterns.PATTERNS`)."""
    sys.path.insert(0, str(ROOT))
    if suite == "patterns":
        from examples.patterns import PATTERNS

        return PATTERNS
    from examples.corpus import CORPUS

    return CORPUS


def measure_one(name: str, size: str, cluster: str, suite: str = "corpus") -> dict[str, Any]:
    """Build, trace and compare one model of ``suite`` in this process; the row as a JSON-able dict."""
    factories = suite_of(suite)
    import torch

    import hapnb as hap
    from examples import corpus

    torch.set_num_threads(1)
    row: dict[str, Any] = {"model": name, "size": size, "cluster": cluster}
    t0 = time.perf_counter()
    model, inputs = factories[name](size=size)
    row["build_s"] = time.perf_counter() - t0
    row["params"] = sum(p.numel() for p in model.parameters())
    row["inputs"] = [list(t.shape) for t in inputs]
    t0 = time.perf_counter()
    try:
        graph = hap.trace(model, inputs, name=name)
    except Exception as e:  # a model that cannot be traced is a row too
        row["error"] = f"trace: {type(e).__name__}: {str(e)[:400]}"
        return row
    row["trace_s"] = time.perf_counter() - t0
    row["ops"] = len(graph.ops)
    del model
    cmp = hap.compare(graph, cluster, strategies=list(STRATEGIES))
    rows = {}
    for r in cmp:
        rows[r.strategy] = {
            "available": r.available,
            "cost_s": r.iteration_s,
            "simulated_s": r.simulated_s,
            "fits": r.fits,
            "peak_memory_bytes": r.peak_bytes,
            "planning_s": r.planning_s,
            "note": r.note,
        }
    row["strategies"] = rows
    hap_row = cmp["hap"]
    plan = hap_row.plan
    if "no program fits" in hap_row.note:  # OutOfMemoryError: the row is the plan ignoring memory
        row["no_program_fits"] = hap_row.note.split("no program fits", 1)[1].split(";")[0].strip(" ()")

    if plan is not None:
        stats = dict(plan.search)
        row["optimal"] = stats.get("optimal")
        row["gap"] = stats.get("gap")  # the proven relative gap of a search stopped at its budget
        row["expansions"] = stats.get("expansions")
        row["chosen"] = stats.get("chosen")  # "search" or "baseline NAME": where the picked program came from
        row["synthesis_s"] = plan.synthesis_s
        row["ratios"] = [round(x, 4) for x in plan.ratios[0]]  # the first segment's share per device
        row["devices"] = list(plan.devices)
        row["input_forms"] = corpus.input_forms(plan)
        row["batch_sharded"] = corpus.batch_sharded(plan)
        row["fallback_ops"] = dict(Counter(t for _, t in plan.fallback_ops))
        row["replicated_ops"] = dict(Counter(t for _, t in corpus.replicated_ops(plan)))
        row["replicated_ops_total"] = sum(row["replicated_ops"].values())
    dp = cmp["dp_ev"]
    for clock, key in (("stage", "cost_s"), ("simulated", "simulated_s")):
        h, d = hap_row.time(clock), dp.time(clock)
        row[f"speedup_vs_dp_ev_{key}"] = d / h if h and d else None
    return row


def run_child(name: str, size: str, cluster: str, suite: str = "corpus") -> dict[str, Any]:
    """:func:`measure_one` in a fresh process, with its wall time and peak RSS."""
    cmd = [sys.executable, __file__, "--child", name, "--size", size, "--cluster", cluster, "--suite", suite]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    code = os.waitstatus_to_exitcode(status)
    lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("{")]
    if code != 0 or not lines:
        tail = (stderr.strip().splitlines() or ["?"])[-1]
        row: dict[str, Any] = {
            "model": name,
            "size": size,
            "cluster": cluster,
            "error": f"exit {code}: {tail}",
        }
    else:
        row = json.loads(lines[-1])
    row["wall_s"] = wall
    row["rss_bytes"] = int(usage.ru_maxrss) * 1024
    return row


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.1f}"


def _oom(strategy: dict[str, Any]) -> str:
    return " (does not fit)" if strategy.get("fits") is False else ""


def _optimal(r: dict[str, Any]) -> str:
    opt = {True: "yes", False: "no"}.get(r.get("optimal"), "?")
    if r.get("optimal") is False and r.get("gap"):
        opt += f", gap {r['gap']:.1%}" if r["gap"] >= 1e-3 else f", gap {r['gap']:.3%}"
    return f"{opt} ({r['chosen']})" if r.get("chosen") else opt


def _shares(r: dict[str, Any]) -> str:
    """The plan's share of the batch per device kind, e.g. ``v100 0.187, p100 0.104`` (uneven where the
    kinds differ: heterogeneous ratios)."""
    seen: dict[str, set[float]] = {}
    for name, x in zip(r.get("devices", ()), r.get("ratios", ())):
        seen.setdefault(name.rsplit("-", 1)[0], set()).add(round(x, 3))
    return ", ".join(f"{k} " + "/".join(f"{v:.3f}" for v in sorted(xs)) for k, xs in seen.items())


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: one line per model."""
    head = (
        "| model | params (M) | batch sharded | HAP cost / sim (ms) | dp_ev cost / sim (ms) | HAP vs dp_ev "
        "(sim) | best fitting baseline (sim) | unavailable | replicated ops (targets) | optimal (picked) | "
        "share per device | trace (s) | synthesis (s) | RSS (GiB) |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        rss = r.get("rss_bytes", 0) / 2**30
        if "error" in r or "strategies" not in r:
            lines.append(
                f"| {r['model']} | | | | | | | | error: {r.get('error', '?')[:120]} | | | | | {rss:.1f} |"
            )
            continue
        s = r["strategies"]
        h, d = s["hap"], s["dp_ev"]
        avail = {
            k: v for k, v in s.items() if k != "hap" and v["available"] and v["simulated_s"] and v["fits"]
        }
        best = min(avail, key=lambda k: avail[k]["simulated_s"], default=None)
        best_txt = f"{best} {_ms(avail[best]['simulated_s'])}" if best else ""
        unavailable = ", ".join(k for k, v in s.items() if not v["available"])
        forms = r.get("input_forms", {})
        sharded = "yes" if r.get("batch_sharded") else f"no ({forms})"
        reps = r.get("replicated_ops", {})
        rep_txt = (
            f"{r.get('replicated_ops_total', 0)}: "
            + ", ".join(
                f"{t.replace('aten.', '')} x{n}" for t, n in sorted(reps.items(), key=lambda kv: -kv[1])
            )
            if reps
            else "0"
        )
        if r.get("fallback_ops"):
            rep_txt += " (no rule: " + ", ".join(t.replace("aten.", "") for t in r["fallback_ops"]) + ")"
        speed = r.get("speedup_vs_dp_ev_simulated_s")
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f} | {sharded} | {_ms(h['cost_s'])} / {_ms(h['simulated_s'])}{_oom(h)}"
            + (
                f" **no program fits** ({r['no_program_fits']}; plan ignoring memory)"
                if "no_program_fits" in r
                else ""
            )
            + " | "
            f"{_ms(d['cost_s'])} / {_ms(d['simulated_s'])}{_oom(d)} | {'' if speed is None else f'{speed:.2f}x'} | "
            f"{best_txt} | {unavailable} | {rep_txt} | {_optimal(r)} | {_shares(r)} | {r.get('trace_s', 0):.1f} | "
            f"{r.get('synthesis_s', 0):.1f} | {rss:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", default=[], help="model name (repeatable); default: all")
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--cluster", default=CLUSTER)
    ap.add_argument("--suite", default="corpus", choices=("corpus", "patterns"))
    ap.add_argument("--out", default=None, help="default: docs/benchmarks/models.json (patterns.json)")
    ap.add_argument("--md", default=None, help="rewrite the suite's table section of this markdown file")
    ap.add_argument("--render", action="store_true", help="only rewrite the table from the --out file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(measure_one(ns.child, ns.size, ns.cluster, ns.suite)), flush=True)
        return
    factories = suite_of(ns.suite)
    marker = "models" if ns.suite == "corpus" else ns.suite
    out = ROOT / (ns.out or f"docs/benchmarks/{marker}.json")
    if ns.render:
        _write_md(ns.md, table(json.loads(out.read_text())), marker)
        return
    names = ns.only or list(factories)
    bad = [n for n in names if n not in factories]
    if bad:
        raise SystemExit(f"unknown model(s) {', '.join(bad)}; {ns.suite}: {', '.join(factories)}")
    previous = json.loads(out.read_text()) if ns.only and out.exists() else []
    by_name = {r["model"]: r for r in previous}
    for name in names:
        row = run_child(name, ns.size, ns.cluster, ns.suite)
        by_name[name] = row
        print(table([row]).splitlines()[-1], flush=True)
    rows = [by_name[n] for n in factories if n in by_name]
    out.write_text(json.dumps(rows, indent=1) + "\n")
    md = table(rows)
    print(md)
    _write_md(ns.md, md, marker)


def _write_md(md_path: str | None, md: str, marker: str = "models") -> None:
    """Replace the text between the ``<marker>-table`` markers of ``md_path`` (if given) with ``md``."""
    if not md_path:
        return
    path = ROOT / md_path
    text = path.read_text()
    a, b = f"<!-- {marker}-table -->", f"<!-- /{marker}-table -->"
    if a in text and b in text:
        text = text[: text.index(a) + len(a)] + "\n" + md + "\n" + text[text.index(b) :]
        path.write_text(text)


if __name__ == "__main__":
    main()
