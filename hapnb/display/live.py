"""Views of a running job's telemetry and its live re-balances (issue 21): a bokeh chart of each rank's step
time, compute and time blocked in collectives per step, with a marker at every re-balance decision, and the
decisions in words and as a table.

Every function reads the job's metrics lines as plain dicts (``hapnb.launch``'s ``Job.steps``,
``JobResult.metrics``, ``Session.metrics``): a rank's step line (``rank``, ``step``, ``step_s`` and, with
telemetry, ``compute_s`` and ``comm_s``), rank 0's ``{"event": "telemetry", "step", "window", "scale"}``
lines and its ``{"event": "rebalance", "rebalance": {...}}`` decisions (keys of
``hapnb.run.rebalance.Proposal.record``: ``step``, ``accepted``, ``reason``, ``old_ratios``, ``new_ratios``,
``step_s``, ``predicted_step_s``, ``predicted_gain``, ``reshard_s_estimate``, ``payback_steps``, and
``reshard_s`` once done). The chart is a pure function of those lines, so a view redraws it from the lines
so far while the job runs (:func:`live_frame`, the Explorer's launch view) and once more when it ended.

>>> lines = [{"rank": r, "step": s, "step_s": 0.01 * (s + 1)} for s in range(3) for r in range(2)]
>>> rows = live_rows(lines)
>>> sorted(rows), rows[1]["step"], rows[1]["step_s"]
([0, 1], [0, 1, 2], [0.01, 0.02, 0.03])
>>> rebalance_text({"step": 5, "accepted": False, "reason": "too small"})
'after step 5: declined (too small)'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .basics import _DEVICE_COLORS, _table, esc, time_unit
from .charts import legend_outside, sandboxed_frame

__all__ = [
    "live_rows",
    "decisions",
    "windows",
    "iteration_times",
    "rebalance_text",
    "telemetry_text",
    "rebalance_html",
    "live_chart",
    "live_chart_html",
    "live_frame",
]

_ACCEPTED_COLOR = "#222222"
_DECLINED_COLOR = "#999999"
_PREDICTED_COLOR = "#756bb1"
_FIELDS = ("step", "step_s", "compute_s", "comm_s")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def live_rows(metrics: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, list[Any]]]:
    """Each rank's step lines as columns, in step order: ``{rank: {"step": [...], "step_s": [...],
    "compute_s": [...], "comm_s": [...]}}`` (``compute_s`` / ``comm_s`` None where the line has no telemetry).
    Event lines, heartbeats and lines without a step time are skipped."""
    per: dict[int, dict[int, Mapping[str, Any]]] = {}
    for m in metrics:
        if "event" in m or "phase" in m or not isinstance(m.get("step"), int) or not _number(m.get("step_s")):
            continue
        per.setdefault(int(m.get("rank", 0)), {})[m["step"]] = m
    out: dict[int, dict[str, list[Any]]] = {}
    for rank in sorted(per):
        lines = [per[rank][s] for s in sorted(per[rank])]
        out[rank] = {f: [m.get(f) if _number(m.get(f)) else None for m in lines] for f in _FIELDS}
        out[rank]["step"] = [m["step"] for m in lines]
    return out


def decisions(metrics: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The re-balance decisions (accepted and declined), in the order rank 0 made them."""
    return [dict(m["rebalance"]) for m in metrics if m.get("event") == "rebalance" and "rebalance" in m]


def windows(metrics: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The telemetry window lines (rank 0's ``"event": "telemetry"``), in order."""
    return [m for m in metrics if m.get("event") == "telemetry"]


def iteration_times(metrics: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float]]:
    """(steps, per step the slowest rank's step time): what one training iteration took."""
    per: dict[int, float] = {}
    for cols in live_rows(metrics).values():
        for s, t in zip(cols["step"], cols["step_s"]):
            per[s] = max(per.get(s, 0.0), float(t))
    steps = sorted(per)
    return steps, [per[s] for s in steps]


def _ratios(r: Any) -> str:
    """The first segment's ratios as ``0.333/0.333/0.333`` (``+ k segments`` when there are more)."""
    if not r:
        return "?"
    first = r[0] if isinstance(r[0], (list, tuple)) else r
    more = len(r) - 1 if isinstance(r[0], (list, tuple)) else 0
    return "/".join(f"{float(x):.3f}" for x in first) + (f" (+{more} segments)" if more else "")


def _ms(x: Any) -> str:
    return f"{float(x) * 1e3:.3g} ms" if _number(x) else "?"


def rebalance_text(record: Mapping[str, Any]) -> str:
    """One decision in plain words: accepted or declined and why, the ratios before and after, the step time
    measured and predicted at the new ratios, the reshard's estimate and what it took."""
    step = record.get("step", "?")
    if not record.get("accepted"):
        return f"after step {step}: declined ({record.get('reason', 'no reason given')})"
    parts = [
        f"after step {step}: re-balanced ({record.get('reason', '')})",
        f"ratios {_ratios(record.get('old_ratios'))} -> {_ratios(record.get('new_ratios'))}"
        + (" with a new program" if record.get("program_changed") else ""),
        f"step {_ms(record.get('step_s'))} -> {_ms(record.get('predicted_step_s'))} predicted "
        f"(saves {_ms(record.get('predicted_gain'))} per step)",
    ]
    reshard = f"reshard estimated {float(record.get('reshard_s_estimate', 0.0)):.3g} s"
    if _number(record.get("reshard_s")):
        reshard += f", took {record['reshard_s']:.3g} s"
    return "; ".join([*parts, reshard])


def telemetry_text(line: Mapping[str, Any]) -> str:
    """One telemetry window in words: per rank the compute and the time blocked in collectives per step
    (medians over the window) and its time against the plan's (``scale``: 1.00x as planned)."""
    w = line.get("window", {})

    def per_rank(key: str) -> str:
        return " / ".join(f"{float(x) * 1e3:.3g}" for x in w.get(key, ()))

    scale = " / ".join(f"{float(x):.2f}" for x in line.get("scale", ()))
    return (
        f"step {line.get('step', '?')}: compute {per_rank('compute_s')} ms, blocked in collectives "
        f"{per_rank('comm_s')} ms per rank; time against the plan {scale}x"
    )


def rebalance_html(metrics: Sequence[Mapping[str, Any]]) -> str:
    """The re-balance decisions of a job as a table (one row each), or a line saying there were none."""
    rows = []
    for d in decisions(metrics):
        done = bool(d.get("accepted"))
        took = f"{d['reshard_s']:.3g}" if _number(d.get("reshard_s")) else "-"
        est = f"{d['reshard_s_estimate']:.3g}" if _number(d.get("reshard_s_estimate")) else "-"
        rows.append(
            [
                esc(d.get("step", "?")),
                "<b>re-balanced</b>" if done else "declined",
                esc(d.get("reason", "")),
                esc(_ratios(d.get("old_ratios"))),
                esc(_ratios(d.get("new_ratios"))),
                esc(_ms(d.get("step_s"))),
                esc(_ms(d.get("predicted_step_s"))),
                esc(_ms(d.get("predicted_gain"))),
                f"{est} / {took}",
            ]
        )
    if not rows:
        return "<div>no re-balance decision yet</div>"
    head = [
        "after step", "verdict", "why", "ratios before", "ratios after", "step", "predicted",
        "saving / step", "reshard s (est. / took)",
    ]  # fmt: skip
    return _table(head, rows, highlight=[i for i, d in enumerate(decisions(metrics)) if d.get("accepted")])


# ============================================================================================ the chart


def _decision_source(found: list[dict[str, Any]], top: float, k: float) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {c: [] for c in ("x", "y0", "y1", "verdict", "reason", "before", "after",
                                                  "predicted", "color", "dash")}  # fmt: skip
    for d in found:
        done = bool(d.get("accepted"))
        cols["x"].append(float(d.get("step", 0)) + 0.5)  # decided at the end of that step
        cols["y0"].append(0.0)
        cols["y1"].append(top)
        cols["verdict"].append("re-balanced" if done else "declined")
        cols["reason"].append(str(d.get("reason", "")))
        cols["before"].append(_ratios(d.get("old_ratios")))
        cols["after"].append(_ratios(d.get("new_ratios")) if done else "(unchanged)")
        p = d.get("predicted_step_s")
        cols["predicted"].append(f"{float(p) * k:.4g}" if _number(p) else "-")
        cols["color"].append(_ACCEPTED_COLOR if done else _DECLINED_COLOR)
        cols["dash"].append("solid" if done else "dotted")
    return cols


def _markers(fig: Any, found: list[dict[str, Any]], top: float, k: float, unit: str, name: str) -> None:
    """A vertical line at every decision (accepted: dark, declined: grey, dotted), hover: why and ratios."""
    from bokeh.models import ColumnDataSource, HoverTool

    for verdict in ("re-balanced", "declined"):
        src = _decision_source(
            [d for d in found if bool(d.get("accepted")) == (verdict == "re-balanced")], top, k
        )
        if not src["x"]:
            continue
        r = fig.segment(
            x0="x", y0="y0", x1="x", y1="y1", source=ColumnDataSource(src), line_color="color", line_width=2,
            line_dash="dotted" if verdict == "declined" else "solid", legend_label=verdict,
            name=f"{name} {verdict}",
        )  # fmt: skip
        fig.add_tools(
            HoverTool(
                renderers=[r],
                tooltips=[
                    ("decision", "@verdict"),
                    ("why", "@reason"),
                    ("ratios before", "@before"),
                    ("ratios after", "@after"),
                    ("predicted step", f"@predicted {unit}"),
                ],
            )  # fmt: skip
        )


def _figure(
    title: str,
    y_label: str,
    width: int,
    height: int,
    x_end: float,
    x_range: Any = None,
    toolbar: Any = "above",
) -> Any:
    from bokeh.models import Range1d
    from bokeh.plotting import figure

    fig = figure(
        width=width,
        height=height,
        title=title,
        x_axis_label="step",
        y_axis_label=y_label,
        tools="xpan,xwheel_zoom,reset,save",
        toolbar_location=toolbar,
        x_range=x_range if x_range is not None else Range1d(-0.5, x_end),
    )
    fig.y_range.start = 0
    return fig


def _title(rows: dict[int, dict[str, list[Any]]], found: list[dict[str, Any]], steps: int | None) -> str:
    done = [d for d in found if d.get("accepted")]
    last = max((max(c["step"]) for c in rows.values() if c["step"]), default=-1)
    total = f"/{steps}" if steps else ""
    text = f"{len(rows)} ranks, step {last + 1}{total}"
    if done:
        text += (
            f"; {len(done)} re-balance{'s' * (len(done) != 1)}: ratios {_ratios(done[0].get('old_ratios'))} -> "
            f"{_ratios(done[-1].get('new_ratios'))}"
        )
    declined = len(found) - len(done)
    return text + (f"; {declined} declined" if declined else "")


def live_chart(
    metrics: Sequence[Mapping[str, Any]],
    *,
    steps: int | None = None,
    baseline: Sequence[Mapping[str, Any]] | None = None,
    baseline_label: str = "without re-balancing",
    width: int = 820,
    height: int = 240,
) -> Any:
    """A bokeh chart of a job's telemetry (a column of two figures sharing the step axis):

    * **step time**: each rank's step time per step (thin lines) and the iteration's, the slowest rank's
      (thick); a dashed line after each re-balance at the step time it predicted for the new ratios;
    * **compute vs blocked in collectives** (with telemetry): each rank's compute (solid) and time blocked
      in collectives (dashed), in the rank's colour: a straggler computes longest and waits least.

    A vertical line marks every re-balance decision (dark: re-balanced, grey dotted: declined; hover for
    why and the ratios before and after); the title gives the ratios before the first and after the last.
    ``steps``: the steps asked for, so a live chart's axis does not move as steps arrive. ``baseline``:
    another run's metrics lines (e.g. the same job without re-balancing), its iteration time drawn in grey
    as ``baseline_label``. The time axis is scaled to the steps after the first (a warm-up step that took
    longer runs off the top). Legends sit outside the data (:func:`hapnb.display.charts.legend_outside`)."""
    from bokeh.layouts import column
    from bokeh.models import Label

    rows, found = live_rows(metrics), decisions(metrics)
    its, times = iteration_times(metrics)
    base_its, base_times = iteration_times(baseline or ())
    shown = times[1:] + base_times[1:] or times + base_times
    unit, k = time_unit(max(shown, default=1e-3))
    last = max([*its, *base_its, *(int(d.get("step", 0)) for d in found), 0])
    x_end = (steps - 0.5) if steps else last + 0.5
    top = max([t * k for t in shown] + [float(d.get("predicted_step_s") or 0.0) * k for d in found] + [0.0])
    top = top * 1.08 if top > 0 else 1.0
    title = "step time per rank: " + _title(rows, found, steps) if rows else "waiting for the first step..."
    fig = _figure(title, f"step time ({unit})", width, height, x_end)
    for rank, cols in rows.items():
        color = _DEVICE_COLORS[rank % len(_DEVICE_COLORS)]
        ys = [t * k for t in cols["step_s"]]
        fig.line(cols["step"], ys, line_color=color, line_width=1, alpha=0.7, legend_label=f"rank {rank}",
                 name=f"step rank {rank}")  # fmt: skip
    if base_its:
        fig.line(base_its, [t * k for t in base_times], line_color=_DECLINED_COLOR, line_width=2.5,
                 legend_label=baseline_label, name="baseline")  # fmt: skip
    if its:
        fig.line(its, [t * k for t in times], line_color="black", line_width=2.5, alpha=0.6,
                 legend_label="iteration (slowest rank)", name="iteration")  # fmt: skip
    for d in found:
        p = d.get("predicted_step_s")
        if d.get("accepted") and _number(p):
            x0 = float(d.get("step", 0)) + 0.5
            fig.line([x0, max(x_end, x0 + 1)], [float(p) * k] * 2, line_color=_PREDICTED_COLOR, line_width=2,
                     line_dash="dashed", legend_label="predicted after re-balance", name="predicted")  # fmt: skip
            fig.add_layout(Label(x=x0, y=top * 0.97, text=f" -> {_ratios(d.get('new_ratios'))}",
                                 text_font_size="8pt", text_baseline="top", text_color=_ACCEPTED_COLOR))  # fmt: skip
    _markers(fig, found, top, k, unit, "decision")
    fig.y_range.end = top
    figs = [legend_outside(fig)]
    if any(v is not None for cols in rows.values() for v in cols["compute_s"]):
        inner = _figure("compute (solid) vs blocked in collectives (dashed) per rank", f"time ({unit})",
                        width, height, x_end, x_range=fig.x_range, toolbar=None)  # fmt: skip
        values: list[float] = []
        first: list[float] = []
        for rank, cols in rows.items():
            color = _DEVICE_COLORS[rank % len(_DEVICE_COLORS)]
            for key, dash, what in (("compute_s", "solid", "compute"), ("comm_s", "dashed", "blocked")):
                pts = [(s, v * k) for s, v in zip(cols["step"], cols[key]) if v is not None]
                values += [y for s, y in pts[1:]]
                first += [y for _, y in pts[:1]]
                if pts:
                    inner.line([s for s, _ in pts], [y for _, y in pts], line_color=color, line_dash=dash,
                               line_width=1.5, legend_label=f"rank {rank} {what}", name=f"{what} rank {rank}")  # fmt: skip
        top2 = max(values or first, default=0.0) * 1.08 or 1.0
        _markers(inner, found, top2, k, unit, "decision2")
        inner.y_range.end = top2
        figs.append(legend_outside(inner))
    return column(*figs)


def live_chart_html(
    metrics: Sequence[Mapping[str, Any]], *, title: str = "hapnb live telemetry", **kw: Any
) -> str:
    """A standalone page with :func:`live_chart` and the core BokehJS inlined (no CDN, works offline), the
    decisions in words under it."""
    from bokeh.embed import components
    from bokeh.resources import Resources

    script, div = components(live_chart(metrics, **kw))
    resources = Resources(mode="inline", components=["bokeh"]).render()
    words = "".join(f"<li>{esc(rebalance_text(d))}</li>" for d in decisions(metrics))
    return (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>{resources}"
        "<style>body{font-family:Helvetica,Arial,sans-serif;margin:4px;font-size:12px}</style></head>"
        f"<body>{div}{script}{f'<ul>{words}</ul>' if words else ''}</body></html>\n"
    )


def live_frame(metrics: Sequence[Mapping[str, Any]], *, steps: int | None = None, width: int = 820) -> str:
    """:func:`live_chart_html` as a sandboxed iframe for a widget (sized to its figures); a line while no
    step has arrived yet; without bokeh, the decisions table (:func:`rebalance_html`)."""
    rows = live_rows(metrics)
    if not rows and not decisions(metrics):
        return "<div>waiting for the first step...</div>"
    try:
        page = live_chart_html(metrics, steps=steps, width=width)
    except ImportError:  # no bokeh: the decisions in a table
        return rebalance_html(metrics)
    telemetry = any(v is not None for cols in rows.values() for v in cols["compute_s"])
    return sandboxed_frame(page, (2 if telemetry else 1) * 250 + 40 + 18 * len(decisions(metrics)))
