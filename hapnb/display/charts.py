"""bokeh Gantt charts of a plan (inline BokehJS: no CDN) with an optional measured overlay."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .basics import _COMM_COLOR, _COMP_COLOR, _IDLE_COLOR, _stage_starts, time_unit

# ============================================================================================ bokeh


def _measured_parts(measured: Any) -> tuple[list[float], list[float]]:
    """(per-step times, per-stage times) from a list (per-step) or a mapping with step_s / stage_s."""
    if measured is None:
        return [], []
    if isinstance(measured, Mapping):
        steps = [float(x) for x in measured.get("step_s", ()) or ()]
        stages = [float(x) for x in measured.get("stage_s", ()) or ()]
        return steps, stages
    return [float(x) for x in measured], []


def gantt(plan: Any, measured: Any = None, *, width: int = 900, height: int | None = None) -> Any:
    """A bokeh Gantt chart of the plan: one row per device; per stage a communication segment (all
    devices, same length), then each device's computation and its idle time until the slowest finishes.

    Hover shows the stage, its instructions and what it communicates (with sizes from the cost model).
    ``measured``: per-step times (a list, seconds) or ``{"step_s": [...], "stage_s": [...]}``; adds a
    "measured" row (per-stage segments, or the mean step as one bar) next to the "predicted" row.
    """
    from bokeh.models import BasicTickFormatter, ColumnDataSource, HoverTool, Range1d, Span
    from bokeh.plotting import figure

    devs = list(plan.devices)
    steps, stage_meas = _measured_parts(measured)
    span = max([sum(s.time_s for s in plan.stages), *steps, sum(stage_meas)])
    unit, k = time_unit(span)  # one unit per chart: the one its span reads best in
    lanes = list(reversed(devs))
    if steps or stage_meas:
        lanes = ["measured", "predicted"] + lanes
    data: dict[str, list[Any]] = {
        k: [] for k in ("lane", "left", "right", "kind", "color", "stage", "dur", "comm", "instrs", "alpha")
    }

    def add(lane: str, a: float, b: float, kind: str, color: str, stage: Any, comm: str, instrs: str) -> None:
        data["lane"].append(lane)
        data["left"].append(a * k)
        data["right"].append(b * k)
        data["kind"].append(kind)
        data["color"].append(color)
        data["stage"].append(str(stage))
        data["dur"].append((b - a) * k)
        data["comm"].append(comm)
        data["instrs"].append(instrs)
        data["alpha"].append(0.5 if kind == "idle" else 0.9)

    total = 0.0
    for s, t0 in zip(plan.stages, _stage_starts(plan)):
        mx = max(s.comp_s) if s.comp_s else 0.0
        comm = "; ".join(s.comm) or "none"
        texts = [str(plan.program[i]) for i in s.instructions if i < len(plan.program)]
        instrs = "; ".join(texts)
        if len(instrs) > 240:
            instrs = instrs[:240] + f" ... ({len(texts)} instructions)"
        for j, d in enumerate(devs):
            c = s.comp_s[j] if j < len(s.comp_s) else 0.0
            if s.comm_s > 0:
                add(d, t0, t0 + s.comm_s, "communication", _COMM_COLOR, s.index, comm, instrs)
            if c > 0:
                add(d, t0 + s.comm_s, t0 + s.comm_s + c, "computation", _COMP_COLOR, s.index, comm, instrs)
            if mx - c > 0:
                add(d, t0 + s.comm_s + c, t0 + s.comm_s + mx, "idle", _IDLE_COLOR, s.index, comm, instrs)
        total = t0 + s.time_s
    if steps or stage_meas:
        add("predicted", 0.0, total, "predicted step", "#756bb1", "all", f"{len(plan.stages)} stages", "")
        if stage_meas:
            t = 0.0
            for k, x in enumerate(stage_meas):
                add("measured", t, t + x, "measured stage", "#54278f", k, "", "")
                t += x
        else:
            mean = sum(steps) / len(steps)
            add(
                "measured", 0.0, mean, "measured step", "#54278f", "all",
                f"mean of {len(steps)} steps (min {min(steps) * k:.4g}, max {max(steps) * k:.4g} {unit})", "",
            )  # fmt: skip
    src = ColumnDataSource(data)
    fig = figure(
        y_range=lanes,
        width=width,
        height=height or (70 + 28 * len(lanes)),
        title=f"{plan.name} on {plan.cluster.name}: {plan.cost_s * k:.4g} {unit} predicted per iteration",
        x_axis_label=f"time ({unit})",
        tools="xpan,xwheel_zoom,reset,save",
        toolbar_location="above",
    )
    fig.hbar(
        y="lane", left="left", right="right", height=0.72, fill_color="color", line_color="white",
        fill_alpha="alpha", source=src, legend_field="kind",
    )  # fmt: skip
    fig.add_tools(
        HoverTool(
            tooltips=[
                ("device", "@lane"), ("stage", "@stage"), ("what", "@kind"), ("duration", f"@dur{{0.000}} {unit}"),
                ("communication", "@comm"), ("instructions", "@instrs"),
            ]
        )
    )  # fmt: skip
    end = max([total * k, *data["right"]])
    fig.x_range = Range1d(0, end * 1.02 if end > 0 else 1.0)
    fig.xaxis.formatter = BasicTickFormatter(use_scientific=False)
    if steps:
        fig.add_layout(Span(location=total * k, dimension="height", line_color="#756bb1", line_dash="dashed"))
    fig.legend.location = "bottom_right"
    fig.legend.label_text_font_size = "9pt"
    fig.ygrid.grid_line_color = None
    return fig


def gantt_html(plan: Any, measured: Any = None, **kw: Any) -> str:
    """A standalone HTML page with the Gantt chart and BokehJS inlined (no CDN, works offline)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    return file_html(gantt(plan, measured, **kw), resources=INLINE, title=f"hapnb Gantt: {plan.name}")
