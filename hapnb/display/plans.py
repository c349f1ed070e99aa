"""HTML views of a Plan: summary, ratios and memory, static timeline, stages, history, diffs, sharding."""

from __future__ import annotations

import difflib
from typing import Any

from .basics import (
    _COMM_COLOR,
    _COMP_COLOR,
    _DEVICE_COLORS,
    _IDLE_COLOR,
    FORM_COLORS,
    _bytes,
    _fmt,
    _ms,
    _stage_starts,
    _table,
    esc,
    form_text,
    short_target,
)

# ============================================================================================ HTML: plan


def gantt_svg(plan: Any, width: int = 720) -> str:
    """A static SVG timeline of the plan's stages per device (communication, computation, idle)."""
    devs = plan.devices
    total = sum(s.time_s for s in plan.stages) or 1.0
    lane, left, top = 18, 90, 16
    h = top + lane * len(devs) + 20
    scale = (width - left - 10) / total
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{h}' "
        "style='font-family:monospace;font-size:10px'>"
    ]
    for j, d in enumerate(devs):
        y = top + j * lane
        parts.append(f"<text x='2' y='{y + 12}'>{esc(d[:12])}</text>")
    for s, t0 in zip(plan.stages, _stage_starts(plan)):
        mx = max(s.comp_s) if s.comp_s else 0.0
        for j in range(len(devs)):
            y = top + j * lane + 2
            c = s.comp_s[j] if j < len(s.comp_s) else 0.0
            segs = (
                ("comm", t0, s.comm_s, _COMM_COLOR),
                ("comp", t0 + s.comm_s, c, _COMP_COLOR),
                ("idle", t0 + s.comm_s + c, mx - c, _IDLE_COLOR),
            )
            for kind, a, dur, color in segs:
                if dur <= 0:
                    continue
                tip = f"stage {s.index} {kind} {dur * 1e3:.4g} ms" + (
                    f": {', '.join(s.comm)}" if kind == "comm" and s.comm else ""
                )
                parts.append(
                    f"<rect x='{left + a * scale:.2f}' y='{y}' width='{max(dur * scale, 0.5):.2f}' "
                    f"height='{lane - 4}' fill='{color}'><title>{esc(tip)}</title></rect>"
                )
    parts.append(
        f"<text x='{left}' y='{h - 4}'>0</text><text x='{width - 80}' y='{h - 4}'>{total * 1e3:.4g} ms</text>"
        f"<rect x='{left + 60}' y='{h - 12}' width='8' height='8' fill='{_COMM_COLOR}'/>"
        f"<text x='{left + 72}' y='{h - 4}'>communication</text>"
        f"<rect x='{left + 170}' y='{h - 12}' width='8' height='8' fill='{_COMP_COLOR}'/>"
        f"<text x='{left + 182}' y='{h - 4}'>computation</text>"
        f"<rect x='{left + 270}' y='{h - 12}' width='8' height='8' fill='{_IDLE_COLOR}'/>"
        f"<text x='{left + 282}' y='{h - 4}'>idle</text></svg>"
    )
    return "".join(parts)


def history_html(plan: Any) -> str:
    """The Q/B rounds of a plan: program searched at the old ratios, then the LP's ratios for it."""
    rows = []
    for r in plan.history:
        ratios = "; ".join(", ".join(f"{x:.3f}" for x in row) for row in r.ratios[:2])
        if len(r.ratios) > 2:
            ratios += f" (+{len(r.ratios) - 2} segments)"
        rows.append(
            [
                esc(r.iteration), _ms(r.search_cost_s), _ms(r.balanced_cost_s), esc(ratios),
                esc(r.expansions),
                esc(r.instructions), f"{r.search_s:.3g}", f"{r.balance_s:.3g}", "✓" if r.accepted else "",
            ]
        )  # fmt: skip
    if not rows:
        return "<div>no Q/B history (ratios were fixed or the plan was loaded without it)</div>"
    marks = [k for k, r in enumerate(plan.history) if r.accepted]
    return _table(
        ["round", "Q at old B (ms)", "Q at new B (ms)", "ratios B", "expansions", "steps", "search s",
         "LP s", "accepted"],
        rows, highlight=marks, right=(0, 1, 2, 4, 5, 6, 7),
        caption="Q/B alternation (accepted rounds highlighted)",
    )  # fmt: skip


def plan_html(plan: Any, *, max_instructions: int = 400) -> str:
    """A Plan: summary, per-device ratios and memory, a static timeline, the stages and the history."""
    c = plan.cluster
    n_comm = sum(1 for i in plan.program if i.communicates)
    lb = plan.lower_bound_s
    head = (
        f"<div><b>Plan for {esc(plan.name)} on {esc(c.name)}</b> ({c.n} devices): "
        f"<b>{_ms(plan.cost_s)} ms</b>/iteration (lower bound {_ms(lb)} ms"
        + (f", {plan.cost_s / lb:.2f}x" if lb > 0 else "")
        + f"), {len(plan.stages)} stages, {len(plan.program)} instructions, {n_comm} collectives, "
        f"synthesis {plan.synthesis_s:.2f} s</div>"
    )
    busy = [0.0] * c.n
    for s in plan.stages:
        for j, x in enumerate(s.comp_s):
            busy[j] += x
    dev_rows = []
    over = []
    for j, d in enumerate(c.devices):
        ratios = ", ".join(f"{row[j]:.3f}" for row in plan.ratios[:4]) + (
            " ..." if len(plan.ratios) > 4 else ""
        )
        mem = plan.memory_bytes[j] if j < len(plan.memory_bytes) else None
        cap = d.memory_bytes / max(1, d.gpus)
        mem_s = f"{_bytes(mem)} / {_bytes(cap)} ({mem / cap:.0%})" if mem is not None else "?"
        if mem is not None and mem > cap:
            over.append(j)
            mem_s = f"<b style='color:#a00'>{esc(mem_s)} OOM</b>"
        else:
            mem_s = esc(mem_s)
        util = busy[j] / plan.cost_s if plan.cost_s > 0 else 0.0
        dev_rows.append(
            [esc(j), esc(d.name), esc(d.kind), f"{d.flops / 1e12:.3g}", esc(ratios), mem_s, f"{util:.0%}"]
        )
    devices = _table(
        ["rank", "device", "kind", "TFLOP/s", "ratio", "memory (est.)", "busy"], dev_rows,
        highlight=over, right=(0, 3, 6),
    )  # fmt: skip
    stage_rows = []
    shown = 0
    for s in plan.stages:
        mx = max(s.comp_s) if s.comp_s else 0.0
        comp = " ".join(f"<b>{_ms(x)}</b>" if x == mx and mx > 0 else _ms(x) for x in s.comp_s)
        ins = s.instructions[: max(0, max_instructions - shown)]
        shown += len(ins)
        text = "<br>".join(esc(str(plan.program[i])) for i in ins if i < len(plan.program))
        if len(ins) < len(s.instructions):
            text += f"<br>... {len(s.instructions) - len(ins)} more"
        stage_rows.append(
            [esc(s.index), _ms(s.comm_s), esc(", ".join(s.comm) or "-"), comp, _ms(s.time_s), text]
        )
    stages = _table(
        ["stage", "comm (ms)", "communication", "computation per device (ms)", "stage (ms)", "instructions"],
        stage_rows, right=(0, 1, 4),
    )  # fmt: skip
    extras = []
    if plan.fallback_ops:
        extras.append(
            "<div style='color:#a50'>ops without a rule (run replicated): "
            + esc(", ".join(f"{n} ({short_target(t)})" for n, t in plan.fallback_ops))
            + "</div>"
        )
    if plan.pins:
        extras.append("<div>pins: " + esc(", ".join(f"{t}={f}" for t, f in plan.pins)) + "</div>")
    if plan.ratio_pins:
        extras.append(
            "<div>ratio pins: "
            + esc(
                ", ".join(
                    f"{d}={lo:g}" if lo == hi else f"{d} in [{lo:g}, {hi:g}]" for d, lo, hi in plan.ratio_pins
                )
            )
            + "</div>"
        )
    if plan.search:
        extras.append("<div>search: " + esc(", ".join(f"{k} {_fmt(v)}" for k, v in plan.search)) + "</div>")
    return (
        f"<div>{head}{devices}{gantt_svg(plan)}{''.join(extras)}"
        f"<details><summary>stages ({len(plan.stages)})</summary>{stages}</details>"
        f"<details><summary>Q/B history ({len(plan.history)} rounds)</summary>{history_html(plan)}"
        "</details></div>"
    )


def forms_by_tensor(plan: Any) -> dict[str, tuple[str, ...]]:
    """Every form each tensor takes in the plan's program, in program order (loads, collectives, outputs)."""
    out: dict[str, list[str]] = {}
    for ins in plan.program:
        if ins.kind in ("load", "collective"):
            out.setdefault(ins.tensor, []).append(ins.form)
        for t, f in ins.outputs:
            out.setdefault(t, []).append(f)
    return {k: tuple(v) for k, v in out.items()}


def plan_diff_html(old: Any, new: Any) -> str:
    """How ``new`` differs from ``old``: cost, ratios per device, forms per tensor, changed instructions."""
    dc = new.cost_s - old.cost_s
    rel = dc / old.cost_s if old.cost_s else 0.0
    color = "#060" if dc < 0 else "#a00" if dc > 0 else "#333"
    head = (
        f"<div><b>cost {_ms(old.cost_s)} ms → {_ms(new.cost_s)} ms</b> "
        f"<span style='color:{color}'>({'+' if dc >= 0 else ''}{_ms(dc)} ms, {rel:+.1%})</span>; "
        f"stages {len(old.stages)} → {len(new.stages)}; "
        f"instructions {len(old.program)} → {len(new.program)}</div>"
    )
    parts = [head]
    if old.cluster != new.cluster:
        parts.append(f"<div>cluster: {esc(old.cluster.name)} → {esc(new.cluster.name)} (edited)</div>")
    if tuple(old.pins) != tuple(new.pins):
        parts.append(
            "<div>pins: "
            + esc(", ".join(f"{t}={f}" for t, f in old.pins) or "none")
            + " → "
            + esc(", ".join(f"{t}={f}" for t, f in new.pins) or "none")
            + "</div>"
        )
    names_old, names_new = old.cluster.names, new.cluster.names
    rows = []
    for j, d in enumerate(names_new):
        a = old.ratios[0][names_old.index(d)] if d in names_old else None
        b = new.ratios[0][j]
        if a is None or abs(a - b) > 5e-4:
            rows.append([esc(d), "-" if a is None else f"{a:.3f}", f"{b:.3f}"])
    if rows:
        parts.append(
            _table(["device", "old ratio", "new ratio"], rows, right=(1, 2), caption="ratios changed")
        )
    fo, fn = forms_by_tensor(old), forms_by_tensor(new)
    frows = [
        [esc(t), esc(", ".join(fo.get(t, ())) or "-"), esc(", ".join(fn.get(t, ())) or "-")]
        for t in dict.fromkeys(list(fo) + list(fn))
        if fo.get(t) != fn.get(t)
    ]
    if frows:
        parts.append(_table(["tensor", "old forms", "new forms"], frows, caption="forms changed"))
    a = [str(i) for i in old.program]
    b = [str(i) for i in new.program]
    diff = [
        line for line in difflib.unified_diff(a, b, "old", "new", n=0, lineterm="")
        if not line.startswith(("---", "+++", "@@"))
    ]  # fmt: skip
    if diff:
        lines = "".join(
            f"<div style='color:{'#060' if d[0] == '+' else '#a00'}'>{esc(d)}</div>" for d in diff[:200]
        )
        parts.append(
            f"<details open><summary>instructions changed ({len(diff)} lines)</summary>"
            f"<div style='font-family:monospace;font-size:12px'>{lines}</div></details>"
        )
    else:
        parts.append("<div>same program</div>")
    return "<div>" + "".join(parts) + "</div>"


def sharding_html(plan: Any, tensor: str, *, width: int = 480) -> str:
    """A picture (SVG) of one tensor's slices per device: uneven G(d) shards, or I/R copies."""
    forms = forms_by_tensor(plan).get(tensor, ())
    shape = None
    if plan.graph is not None:
        try:
            shape = plan.graph.tensor(tensor).shape
        except KeyError:
            shape = None
    devs = plan.devices
    blocks = []
    dims = [(d, ls) for t, d, ls in plan.lengths if t == tensor]
    head = (
        f"<div><b>{esc(tensor)}</b>"
        + (f" [{esc('x'.join(map(str, shape)))}]" if shape is not None else "")
        + f": forms {esc(', '.join(forms) or 'none in this plan')}</div>"
    )
    for dim, ls in dims:
        total = sum(ls) or 1
        x = 0.0
        rects = []
        for j, n in enumerate(ls):
            w = width * n / total
            col = _DEVICE_COLORS[j % len(_DEVICE_COLORS)]
            rects.append(
                f"<rect x='{x:.2f}' y='0' width='{max(w, 0):.2f}' height='28' fill='{col}' stroke='white'>"
                f"<title>{esc(devs[j] if j < len(devs) else j)}: rows {sum(ls[:j])}..{sum(ls[: j + 1])} "
                f"({n})</title></rect>"
            )
            if w > 30:
                rects.append(
                    f"<text x='{x + 3:.2f}' y='18' fill='white'>"
                    f"{esc(devs[j] if j < len(devs) else j)}: {n}</text>"
                )
            x += w
        blocks.append(
            f"<div>G({dim}): lengths {esc(list(ls))}</div>"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' "
            f"height='30' style='font-family:monospace;font-size:10px'>{''.join(rects)}</svg>"
        )
    for f in dict.fromkeys(forms):
        if f in ("I", "R"):
            what = "a full copy" if f == "I" else "a full-shape partial sum"
            cells = "".join(
                f"<span style='display:inline-block;margin:2px;padding:2px 6px;background:{FORM_COLORS[f]}'>"
                f"{esc(d)}</span>"
                for d in devs
            )
            blocks.append(f"<div>{esc(form_text(f))}: every device holds {what} {cells}</div>")
    if not blocks:
        blocks.append("<div>this tensor does not appear in the plan's program</div>")
    return "<div>" + head + "".join(blocks) + "</div>"
