"""Views of a strategy comparison (:class:`hapnb.plans.comparison.Comparison`): an HTML table with bars and a
bokeh chart of grouped bars (one group per strategy, a bar per clock), strategies that do not fit marked."""

from __future__ import annotations

from typing import Any

from .basics import _bar, _bytes, _table, esc, time_unit

#: Bar colours per clock: the stage model and the simulators.
CLOCK_COLORS = {"stage": "#4e79a7", "simulated": "#f28e2b"}
#: Clock labels in the chart and the table.
CLOCK_LABELS = {"stage": "stage model", "simulated": "simulated"}
_OOM_COLOR = "#d62728"


def comparison_html(cmp: Any) -> str:
    """The comparison as a table: per strategy its time on each clock (with a bar and the ratio to the
    fastest strategy that fits), peak memory per device against capacity, whether it fits, and its note."""
    clocks = ("stage", "simulated")
    times = [r.time(c) for r in cmp.results if r.available for c in clocks]
    top = max([t for t in times if t is not None], default=0.0)
    unit, k = time_unit(top)
    best = {c: cmp.best(c) for c in clocks}
    ref = {c: (cmp[best[c]].time(c) if best[c] else None) for c in clocks}
    rows, hl = [], []
    for i, r in enumerate(cmp.results):
        cells = [f"<b>{esc(r.strategy)}</b>"]
        for c in clocks:
            t = r.time(c) if r.available else None
            if t is None:
                cells.append("-")
                continue
            rel = f" ({t / ref[c]:.2f}x)" if ref[c] else ""
            color = _OOM_COLOR if r.fits is False else CLOCK_COLORS[c]
            cells.append(f"{t * k:.4g}{esc(rel)} {_bar(t, top, color, width=140, min_width=1)}")
        if r.memory_bytes:
            j = max(range(len(r.memory_bytes)), key=lambda j: r.memory_bytes[j] / max(r.capacity_bytes[j], 1))
            cells.append(f"{_bytes(r.memory_bytes[j])} / {_bytes(r.capacity_bytes[j])}")
        else:
            cells.append("-")
        fits = {True: "yes", False: f"<b style='color:{_OOM_COLOR}'>OOM</b>", None: "-"}[r.fits]
        cells += [fits, esc(r.note or ("" if r.available else "not available"))]
        rows.append(cells)
        if r.strategy in best.values():
            hl.append(i)
    head = (
        f"<div><b>Strategies for {esc(cmp.model)} on {esc(cmp.cluster.name)}</b> &mdash; {cmp.cluster.n} "
        f"devices{f', batch {cmp.batch}' if cmp.batch else ''}, one cost model; highlighted: the fastest "
        "that fits on each clock. Simulated: hapnb.simulate (SPMD plans), the schedule simulation "
        "(pipelines).</div>"
    )
    table = _table(
        [
            "strategy",
            f"stage model ({unit})",
            f"simulated ({unit})",
            "peak memory / capacity",
            "fits",
            "note",
        ],
        rows,
        highlight=hl,
    )
    return head + table


def comparison_chart(
    cmp: Any, *, width: int = 760, height: int = 320, clocks: Any = ("stage", "simulated")
) -> Any:
    """A bokeh chart of the comparison: per strategy a bar on each clock (stage model, simulated); a
    strategy that does not fit is drawn in red, hatched and labelled OOM; one that is not available is
    labelled n/a at zero. Hover shows the time, the peak memory and the note. BokehJS is loaded INLINE
    by whoever shows it (``output_notebook(INLINE)`` / :func:`bokeh.embed.file_html` with INLINE)."""
    from bokeh.models import ColumnDataSource, FactorRange, HoverTool, LabelSet
    from bokeh.plotting import figure

    times = [r.time(c) for r in cmp.results if r.available for c in clocks]
    top = max([t for t in times if t is not None], default=0.0)
    unit, k = time_unit(top or 1.0)
    data: dict[str, list[Any]] = {
        key: [] for key in ("x", "top", "color", "hatch", "label", "text", "clock", "note", "memory")
    }
    for r in cmp.results:
        for c in clocks:
            t = r.time(c) if r.available else None
            data["x"].append((r.strategy, CLOCK_LABELS[c]))
            data["top"].append((t or 0.0) * k)
            data["color"].append(_OOM_COLOR if r.fits is False else CLOCK_COLORS[c])
            data["hatch"].append("/" if r.fits is False else " ")
            data["label"].append("OOM" if r.fits is False and t is not None else ("n/a" if t is None else ""))
            data["text"].append("-" if t is None else f"{t * k:.4g} {unit}")
            data["clock"].append(CLOCK_LABELS[c])
            data["note"].append(r.note or ("" if r.available else "not available"))
            data["memory"].append(_bytes(r.peak_bytes) if r.memory_bytes else "-")
    src = ColumnDataSource(data)
    fig = figure(
        x_range=FactorRange(*data["x"]),
        width=width,
        height=height,
        title=f"{cmp.model} on {cmp.cluster.name}: time per iteration",
        y_axis_label=unit,
        toolbar_location="right",
        tools="save,reset",
    )
    fig.vbar(x="x", top="top", width=0.85, source=src, fill_color="color", line_color="color",
             hatch_pattern="hatch", hatch_color="white", hatch_alpha=0.8)  # fmt: skip
    fig.add_layout(LabelSet(x="x", y="top", text="label", source=src, y_offset=2, text_font_size="9pt",
                            text_align="center", text_color=_OOM_COLOR))  # fmt: skip
    fig.add_tools(
        HoverTool(
            tooltips=[("strategy", "@x"), ("time", "@text"), ("peak memory", "@memory"), ("note", "@note")]
        )
    )
    fig.y_range.start = 0
    fig.x_range.range_padding = 0.05
    fig.xaxis.major_label_orientation = 0.9
    fig.xgrid.grid_line_color = None
    return fig
