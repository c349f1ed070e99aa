"""bokeh Gantt charts of a plan (inline BokehJS: no CDN) with an optional measured overlay, and of a
simulated timeline (:func:`timeline_gantt`: a lane per device, a sub-lane per stream) with its memory
over time (:func:`memory_chart`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .basics import (
    _COMM_COLOR,
    _COMP_COLOR,
    _DEVICE_COLORS,
    _IDLE_COLOR,
    _stage_starts,
    esc,
    safe_html,
    time_unit,
)

# ============================================================================================ bokeh


def legend_outside(fig: Any, place: str = "right") -> Any:
    """Move the figure's legends out of the plotted data, to the side panel ``place`` (``"right"``,
    ``"below"``, ...), in small type; a bar or a curve is never hidden under its legend. Returns ``fig``."""
    for legend in list(fig.legend):
        if legend in fig.center:
            fig.center.remove(legend)
        legend.location = "top_left" if place in ("right", "left") else "center"
        legend.label_text_font_size = "9pt"
        fig.add_layout(legend, place)
    return fig


def finish_time_axis(fig: Any, end: float) -> Any:
    """A Gantt chart's common finish: the time axis from 0 to ``end`` (plus 2 %) in plain numbers, the
    legend outside the bars, on the right (:func:`legend_outside`), no horizontal grid lines. Returns
    ``fig``."""
    from bokeh.models import BasicTickFormatter, Range1d

    fig.x_range = Range1d(0, end * 1.02 if end > 0 else 1.0)
    fig.xaxis.formatter = BasicTickFormatter(use_scientific=False)
    fig.ygrid.grid_line_color = None
    return legend_outside(fig)


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
    Given a simulated timeline (anything with ``spans``) instead, draws it with :func:`timeline_gantt`.

    Hover shows the stage, its instructions and what it communicates (with sizes from the cost model).
    ``measured``: per-step times (a list, seconds) or ``{"step_s": [...], "stage_s": [...]}``; adds a
    "measured" row (per-stage segments, or the mean step as one bar) next to the "predicted" row.
    """
    if hasattr(plan, "spans") and hasattr(plan, "iteration_s"):
        return timeline_gantt(plan, width=width, height=height)
    from bokeh.models import ColumnDataSource, HoverTool, Span
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
    if steps:
        fig.add_layout(Span(location=total * k, dimension="height", line_color="#756bb1", line_dash="dashed"))
    return finish_time_axis(fig, max([total * k, *data["right"]]))


def gantt_html(plan: Any, measured: Any = None, **kw: Any) -> str:
    """A standalone HTML page with the Gantt chart and BokehJS inlined (no CDN, works offline)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    return file_html(gantt(plan, measured, **kw), resources=INLINE, title=f"hapnb Gantt: {plan.name}")


def gantt_frame(plan: Any, measured: Any = None, width: int = 860) -> str:
    """The Gantt chart as a sandboxed iframe for a widget (its page inlined, sized to the devices and the
    measured lanes); without bokeh, the static SVG timeline (:func:`hapnb.display.gantt_svg`)."""
    from .plans import gantt_svg

    try:
        page = gantt_html(plan, measured or None, width=width)
    except Exception:  # noqa: BLE001 - no bokeh: the static timeline
        return safe_html(gantt_svg, plan)
    return sandboxed_frame(page, 110 + 28 * (plan.cluster.n + (2 if measured else 0)))


def sandboxed_frame(page: str, height: int) -> str:
    """A standalone HTML ``page`` (its scripts inlined) as a sandboxed iframe ``height`` pixels high, what a
    widget shows a bokeh chart in."""
    return (
        f"<iframe srcdoc=\"{esc(page)}\" style='width:100%;height:{height}px;border:0' "
        "sandbox='allow-scripts'></iframe>"
    )


#: Fill colours of a simulated span by phase and stream (computation blue, communication orange).
PHASE_COLORS: Mapping[tuple[str, str], str] = {
    ("compute", "forward"): "#6baed6",
    ("compute", "backward"): "#2171b5",
    ("compute", "optimizer"): "#31a354",
    ("feature-comm", "forward"): "#fdae6b",
    ("feature-comm", "backward"): "#e6550d",
    ("gradient-comm", "backward"): "#a63603",
}
_STREAM_ORDER = ("compute", "feature-comm", "gradient-comm")


def timeline_lanes(timeline: Any) -> list[str]:
    """The y factors of :func:`timeline_gantt`, top to bottom: ``"device / stream"`` for every stream a
    device has spans on (its compute stream always)."""
    used = {(s.device, s.stream) for s in timeline.spans}
    lanes = []
    for d in timeline.devices:
        for st in _STREAM_ORDER:
            if st == "compute" or (d, st) in used:
                lanes.append(f"{d} / {st}")
    return lanes


def timeline_gantt(timeline: Any, *, width: int = 900, height: int | None = None) -> Any:
    """A bokeh Gantt chart of a simulated timeline (duck-typed: ``devices``, ``spans`` with ``device,
    stream, start_s, end_s, instruction, phase, micro_batch, what``, ``iteration_s``, ``plan_name``):
    one lane per device with a sub-lane per stream, one bar per span coloured by stream and phase
    (:data:`PHASE_COLORS`); hover shows the instruction, what runs, the phase and the micro-batch."""
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure

    unit, k = time_unit(timeline.iteration_s)
    lanes = timeline_lanes(timeline)
    cols = ("lane", "left", "right", "color", "phase", "stream", "mb", "instruction", "what", "dur", "label")
    data: dict[str, list[Any]] = {c: [] for c in cols}
    for s in timeline.spans:
        data["lane"].append(f"{s.device} / {s.stream}")
        data["left"].append(s.start_s * k)
        data["right"].append(s.end_s * k)
        data["color"].append(PHASE_COLORS.get((s.stream, s.phase), _IDLE_COLOR))
        data["phase"].append(s.phase)
        data["stream"].append(s.stream)
        data["mb"].append(s.micro_batch)
        data["instruction"].append(s.instruction)
        data["what"].append(s.what if len(s.what) <= 200 else s.what[:200] + " ...")
        data["dur"].append((s.end_s - s.start_s) * k)
        data["label"].append(f"{s.phase} ({'computation' if s.stream == 'compute' else s.stream})")
    mode = "overlap" if getattr(timeline, "overlap", False) else "stage-synchronous"
    fig = figure(
        y_range=list(reversed(lanes)),
        width=width,
        height=height or (70 + 22 * len(lanes)),
        title=f"{timeline.plan_name}, simulated ({mode}): {timeline.iteration_s * k:.4g} {unit} per iteration",
        x_axis_label=f"time ({unit})",
        tools="xpan,xwheel_zoom,reset,save",
        toolbar_location="above",
    )
    fig.hbar(
        y="lane", left="left", right="right", height=0.8, fill_color="color", line_color="white",
        line_width=0.5, source=ColumnDataSource(data), legend_field="label", name="spans",
    )  # fmt: skip
    fig.add_tools(
        HoverTool(
            tooltips=[
                ("lane", "@lane"), ("phase", "@phase"), ("micro-batch", "@mb"), ("instruction", "@instruction"),
                ("what", "@what"), ("duration", f"@dur{{0.000}} {unit}"),
            ]
        )
    )  # fmt: skip
    return finish_time_axis(fig, timeline.iteration_s * k)


def memory_chart(timeline: Any, *, width: int = 900, height: int = 300) -> Any:
    """A bokeh step chart of each device's memory over the simulated iteration (``timeline.memory``:
    per device (time, bytes) points), in MiB, with each device's capacity as a dashed line when it is
    within twice the peak."""
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure

    unit, k = time_unit(timeline.iteration_s)
    fig = figure(
        width=width,
        height=height,
        title=f"{timeline.plan_name}: memory per device (simulated)",
        x_axis_label=f"time ({unit})",
        y_axis_label="MiB",
        tools="xpan,xwheel_zoom,reset,save",
        toolbar_location="above",
    )
    caps = getattr(timeline, "memory_capacity_bytes", ())
    peaks = getattr(timeline, "peak_memory_bytes", ())
    for j, (d, pts) in enumerate(zip(timeline.devices, timeline.memory)):
        pts = list(pts)
        if pts and pts[-1][0] < timeline.iteration_s:
            pts.append((timeline.iteration_s, pts[-1][1]))
        color = _DEVICE_COLORS[j % len(_DEVICE_COLORS)]
        src = ColumnDataSource({"t": [t * k for t, _ in pts], "mib": [b / 2**20 for _, b in pts], "device": [d] * len(pts)})  # fmt: skip
        fig.step(x="t", y="mib", mode="after", source=src, line_color=color, line_width=2, legend_label=d, name=f"memory {d}")  # fmt: skip
        if j < len(caps) and j < len(peaks) and caps[j] <= 2 * max(1, peaks[j]):
            fig.line(
                [0, timeline.iteration_s * k], [caps[j] / 2**20] * 2, line_color=color, line_dash="dashed"
            )
    fig.add_tools(HoverTool(tooltips=[("device", "@device"), ("time", f"@t{{0.000}} {unit}"), ("memory", "@mib{0.0} MiB")]))  # fmt: skip
    return legend_outside(fig)
