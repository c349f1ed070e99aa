"""Views of a pipeline plan (:class:`hapnb.pipelines.PipelinePlan`): its stages drawn on the cluster
(graphviz: machines as boxes, each device coloured by the stage it runs), a table of its stages, and its
schedule as a bokeh Gantt chart (:class:`hapnb.pipelines.plan.PipelineTimeline`: micro-batches' forward
and backward per stage, the transfers across the cuts, the tail)."""

from __future__ import annotations

from typing import Any

from .basics import _DEVICE_COLORS, _IDLE_COLOR, _bytes, _ms, _table, esc, time_unit
from .charts import finish_time_axis
from .drawings import _digraph, _lbl, svg

#: Fill colours of the schedule's operations (forward light, backward dark, transfers orange, tail green).
SCHEDULE_COLORS = {
    "forward": "#6baed6",
    "backward": "#2171b5",
    "send": "#fdae6b",
    "send grad": "#e6550d",
    "sync": "#31a354",
}


def _stage_color(k: int) -> str:
    return _DEVICE_COLORS[k % len(_DEVICE_COLORS)]


def _units_text(plan: Any, s: Any) -> str:
    """``blocks.0 .. blocks.3 (4 units)``, or the one unit's name."""
    first, last = plan.units[s.units[0]], plan.units[s.units[1] - 1]
    k = s.units[1] - s.units[0]
    return first if k == 1 else f"{first} .. {last} ({k} units)"


def _times_text(s: Any) -> str:
    unit, k = time_unit(max(s.forward_s, s.backward_s))
    return f"F {s.forward_s * k:.4g} {unit}, B {s.backward_s * k:.4g} {unit}"


def pipeline_dot(plan: Any) -> Any:
    """The pipeline's stages drawn on the cluster: one box per machine holding its devices, each device
    filled with its stage's colour (idle devices grey), and a row of stage nodes (units, per-micro-batch
    forward/backward) linked in pipeline order and to the devices that run them."""
    c = plan.cluster
    stage_of = {d: s.index for s in plan.stages for d in s.devices}
    g = _digraph(f"pipeline_{plan.name}", rankdir="TB", fontname="Helvetica", fontsize="10", newrank="true")
    g.attr("node", fontname="Helvetica", fontsize="9", style="filled", shape="box")
    with g.subgraph(name="stages") as top:
        top.attr(rank="same")
        for s in plan.stages:
            label = f"stage {s.index}\n{_units_text(plan, s)}\n{_times_text(s)} per micro-batch"
            top.node(f"stage{s.index}", _lbl(label), fillcolor=_stage_color(s.index), fontcolor="white",
                     shape="box", style="filled,rounded")  # fmt: skip
    for a, b in zip(plan.stages, plan.stages[1:]):
        g.edge(
            f"stage{a.index}", f"stage{b.index}", label="activations \u2192\n\u2190 gradients", fontsize="8"
        )
    machines: dict[str, list[Any]] = {}
    for d in c.devices:
        machines.setdefault(d.machine, []).append(d)
    for m, ds in machines.items():
        with g.subgraph(name=f"cluster_{m}") as sub:
            sub.attr(label=f"{m} ({ds[0].kind}{'' if len({d.kind for d in ds}) == 1 else ', mixed'})",
                     style="rounded", color="#999999", fontsize="9")  # fmt: skip
            for d in ds:
                k = stage_of.get(d.name)
                if k is None:
                    sub.node(d.name, _lbl(f"{d.name}\nidle"), fillcolor=_IDLE_COLOR)
                else:
                    sub.node(
                        d.name, _lbl(f"{d.name}\nstage {k}"), fillcolor=_stage_color(k), fontcolor="white"
                    )
    for s in plan.stages:
        for d in s.devices:
            g.edge(f"stage{s.index}", d, color=_stage_color(s.index), arrowhead="none", style="dashed")
    return g


def pipeline_html(plan: Any) -> str:
    """A pipeline plan: its summary, the stages drawn on the cluster (when graphviz is installed) and a
    table of the stages (units, devices and their shares, per-micro-batch times, peak memory)."""
    head = (
        f"<div><b>Pipeline plan {esc(plan.name)}</b> &mdash; {len(plan.stages)} stages on "
        f"{len(plan.devices)} of {plan.cluster.n} devices, {esc(plan.schedule)}, {plan.micro_batches} "
        f"micro-batches of {plan.micro_batch_size}; iteration {_ms(plan.iteration_s)} ms (planned by "
        f"{esc(plan.method or '?')} in {plan.planning_s:.3f} s)</div>"
    )
    rows = []
    for s in plan.stages:
        devs = ", ".join(f"{d} ({sh:.2f})" for d, sh in zip(s.devices, s.shares))
        mem = _bytes(max(s.memory_bytes)) if s.memory_bytes else "-"
        swatch = f"<span style='display:inline-block;width:10px;height:10px;background:{_stage_color(s.index)}'></span>"
        rows.append(
            [f"{swatch} {s.index}", esc(_units_text(plan, s)), str(s.units[1] - s.units[0]), esc(devs),
             _ms(s.forward_s), _ms(s.backward_s), mem]
        )  # fmt: skip
    table = _table(
        [
            "stage",
            "units",
            "#",
            "devices (share of a micro-batch)",
            "forward (ms)",
            "backward (ms)",
            "peak memory",
        ],
        rows,
        right=(2, 4, 5),
    )
    pic = svg(pipeline_dot(plan)) or ""
    return head + (f"<div style='max-width:100%;overflow:auto'>{pic}</div>" if pic else "") + table


def pipeline_gantt(timeline: Any, *, width: int = 900, height: int | None = None, labels: bool = True) -> Any:
    """A bokeh Gantt chart of a pipeline's schedule (a :class:`~hapnb.pipelines.plan.PipelineTimeline`):
    one lane per stage and per transfer, a bar per micro-batch's forward / backward / transfer and each
    stage's tail (gradient all-reduce + optimizer step), micro-batch numbers on the bars when they fit;
    hover shows the operation."""
    from bokeh.models import ColumnDataSource, HoverTool, LabelSet
    from bokeh.plotting import figure

    unit, k = time_unit(timeline.iteration_s)
    cols = ("lane", "left", "right", "mid", "color", "kind", "mb", "dur", "text")
    data: dict[str, list[Any]] = {c: [] for c in cols}
    end = timeline.iteration_s * k
    for s in timeline.spans:
        a, b = s.start_s * k, s.end_s * k
        data["lane"].append(s.lane)
        data["left"].append(a)
        data["right"].append(b)
        data["mid"].append((a + b) / 2)
        data["color"].append(SCHEDULE_COLORS.get(s.kind, _IDLE_COLOR))
        data["kind"].append(s.kind)
        data["mb"].append("-" if s.micro_batch < 0 else str(s.micro_batch))
        data["dur"].append(b - a)
        wide = end > 0 and (b - a) / end * width > 14 and s.micro_batch >= 0
        data["text"].append(str(s.micro_batch) if wide and labels else "")
    src = ColumnDataSource(data)
    fig = figure(
        y_range=list(reversed(timeline.lanes)),
        width=width,
        height=height or (80 + 26 * len(timeline.lanes)),
        title=(
            f"{timeline.name}: {timeline.schedule}, {timeline.micro_batches} micro-batches, "
            f"{end:.4g} {unit} per iteration"
            + ("" if timeline.exact else " (transfers and tail not recorded)")
        ),
        x_axis_label=f"time ({unit})",
        tools="xpan,xwheel_zoom,reset,save",
        toolbar_location="above",
    )
    fig.hbar(y="lane", left="left", right="right", height=0.8, fill_color="color", line_color="white",
             line_width=0.5, source=src, legend_field="kind")  # fmt: skip
    fig.add_layout(LabelSet(x="mid", y="lane", text="text", source=src, text_align="center",
                            text_baseline="middle", text_font_size="7pt", text_color="white"))  # fmt: skip
    fig.add_tools(
        HoverTool(tooltips=[("lane", "@lane"), ("operation", "@kind"), ("micro-batch", "@mb"),
                            ("duration", f"@dur{{0.000}} {unit}")])
    )  # fmt: skip
    return finish_time_axis(fig, end)
