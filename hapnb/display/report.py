"""Reports: a whole self-contained HTML page of a plan, and the status lines of a verify and of a launch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .basics import _fmt, _ms, _table, esc, safe_html
from .charts import gantt
from .drawings import graph_dot, proof_dot, svg
from .plans import history_html, plan_html

# ============================================================================================ report


def report_html(
    plan: Any,
    baselines: Mapping[str, Any] | None = None,
    search_stats: Mapping[str, Any] | None = None,
    *,
    title: str | None = None,
    measured: Any = None,
    timeline: Any = None,
) -> str:
    """One self-contained HTML page: plan summary, stages, Gantt (BokehJS inline), the simulated
    ``timeline`` (``hapnb.simulate``'s, streams as sub-lanes) when given, search stats, baselines
    (name -> Plan or cost in seconds) and, with ``dot``, the graph and the proof drawing."""
    title = title or f"hapnb plan: {plan.name} on {plan.cluster.name}"
    sections = [f"<h1>{esc(title)}</h1>", safe_html(plan_html, plan)]
    resources = ""
    try:
        from bokeh.embed import components
        from bokeh.resources import Resources

        script, div = components(gantt(plan, measured))
        # only the core BokehJS bundle (the chart needs no widgets, tables, GL or MathJax): ~1.3 MB
        resources = Resources(mode="inline", components=["bokeh"]).render()
        sections.append(f"<h2>Timeline</h2>{div}{script}")
        if timeline is not None:
            script, div = components(gantt(timeline))
            sections.append(
                f"<h2>Simulated with overlap: {timeline.iteration_s * 1e3:.3f} ms per iteration</h2>"
                f"<p>Gradient buckets beside the backward, feature collectives beside unrelated computation "
                f"(stage model: {plan.cost_s * 1e3:.3f} ms).</p>{div}{script}"
            )
    except Exception as e:  # noqa: BLE001 - no bokeh: the static SVG timeline is in plan_html already
        sections.append(f"<div>(interactive Gantt unavailable: {esc(type(e).__name__)}: {esc(e)})</div>")
    if baselines:
        rows = []
        for name, b in baselines.items():
            cost = getattr(b, "cost_s", b)
            try:
                cost = float(cost)
            except (TypeError, ValueError):
                continue
            rows.append([esc(name), _ms(cost), f"{cost / plan.cost_s:.2f}x" if plan.cost_s > 0 else "-"])
        for name, why in getattr(baselines, "unavailable", {}).items():  # hapnb.baselines' Baselines
            rows.append([esc(name), "not available", esc(why)])
        rows.insert(0, ["<b>hapnb</b>", f"<b>{_ms(plan.cost_s)}</b>", "1.00x"])
        sections.append(
            "<h2>Baselines (same cost model)</h2>"
            + _table(["strategy", "ms / iteration", "time vs hapnb"], rows, right=(1, 2))
        )
    stats = dict(search_stats or {}) or dict(plan.search)
    if stats:
        sections.append(
            "<h2>Search</h2>"
            + _table(["statistic", "value"], [[esc(k), esc(_fmt(v))] for k, v in stats.items()], right=(1,))
        )
    sections.append(f"<h2>Q/B history</h2>{safe_html(history_html, plan)}")
    for heading, fn in (("Proof (Hoare triples)", proof_dot), ("Program graph", graph_dot)):
        try:
            s = svg(fn(plan)) if len(plan.program) <= 600 else None
        except Exception:  # noqa: BLE001 - a missing drawing is not worth failing the report
            s = None
        if s:  # collapsed: a long plan's drawing is tens of thousands of pixels tall
            sections.append(
                f"<details><summary style='font-size:1.5em;font-weight:bold;margin-top:24px;cursor:pointer'>"
                f"{esc(heading)} ({len(plan.program)} instructions; click to open)</summary>"
                f"<div style='overflow:auto;max-height:90vh'>{s}</div></details>"
            )
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title>{resources}"
        "<style>body{font-family:Helvetica,Arial,sans-serif;margin:16px} h2{margin-top:24px}</style>"
        f"</head><body>{body}</body></html>\n"
    )


# ============================================================================================ runs


def verify_status_html(report: Any) -> str:
    """A verify report as one coloured line with its per-tensor table folded under it (``None``: the
    verify failed, its error shown elsewhere)."""
    if report is None:
        return "verify failed (see the error above)"
    color = "#060" if report.ok else "#a00"
    return (
        f"<span style='color:{color}'>verify: {esc(report.summary())}</span>"
        f"<details><summary>per tensor</summary>{safe_html(lambda r: r._repr_html_(), report)}</details>"
    )


def launch_html(state: Any) -> str:
    """A launch snapshot (``hapnb.run.launch.JobState``): predicted vs measured step time and the last 30
    step lines (rank, step, loss, step ms; a live re-balancing job's telemetry and decision lines are shown
    by :mod:`hapnb.display.live`)."""
    if not state.started:
        return "<div>no launch yet</div>"
    steps = [m for m in state.metrics if "event" not in m]
    rows = "".join(
        f"<tr><td>{m.get('rank', '')}</td><td>{m.get('step', '')}</td><td>{_number(m.get('loss'))}</td>"
        f"<td>{_number(m.get('step_s'), 1e3)}</td></tr>"
        for m in steps[-30:]
    )
    mean = state.mean_step_s
    return (
        f"<div>{len(state.metrics)} metric lines; predicted {state.predicted_s * 1e3:.4g} ms/step"
        + (f", measured mean {mean * 1e3:.4g} ms (slowest rank per step)" if mean is not None else "")
        + "</div><table style='font-family:monospace;font-size:12px'><tr><th>rank</th><th>step</th>"
        f"<th>loss</th><th>step ms</th></tr>{rows}</table>"
    )


def _number(x: Any, scale: float = 1.0) -> str:
    return f"{float(x) * scale:.5g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else ""
