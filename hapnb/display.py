"""Renderers: hapnb objects as HTML tables, graphviz drawings, SVG pictures and bokeh Gantt charts.

Every function here is pure: it reads a hapnb value (Graph, Theory, Search, Plan, Cluster) and returns
an HTML string, a ``graphviz.Digraph`` or a bokeh figure. Optional packages (graphviz, bokeh) are
imported inside the functions, so ``import hapnb.display`` is cheap and works without them. The
``_repr_html_`` methods of the core types call :func:`safe_html`, which never raises: a broken renderer
shows the object's plain text and a one-line note instead of a traceback.

Renderers (all accept the value as first argument):

======================  =====================================================================
HTML                    ``graph_html``, ``theory_html`` (filter by op/tensor/kind, highlight triple
                        ids), ``search_html``, ``frontier_html``, ``plan_html``, ``history_html``,
                        ``plan_diff_html(old, new)``, ``sharding_html(plan, tensor)``,
                        ``cluster_html``, ``gantt_svg`` (static timeline, no JavaScript),
                        ``report_html(plan, baselines=...)`` (a whole self-contained page)
graphviz                ``graph_dot(graph, plan=None)``, ``search_tree_dot(search, around=None,
                        depth=2, event=None)``, ``proof_dot(plan)``; ``svg(drawing)`` renders one to
                        an SVG string (``None`` when the ``dot`` program is missing)
bokeh                   ``gantt(plan, measured=None)`` (a figure), ``gantt_html(plan)`` (a standalone
                        page with inline BokehJS: no CDN, works offline)
helpers                 ``enabled_triples(search, node)``: ids of the triples enabled at a search node
======================  =====================================================================

A drawing returned without the ``dot`` program still displays in a notebook (as its dot source).

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)  # doctest: +SKIP
>>> from hapnb import display
>>> html = display.plan_html(plan)  # doctest: +SKIP
>>> fig = display.gantt(plan)  # doctest: +SKIP
>>> display.graph_dot(plan)  # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import html as _html
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "safe_html",
    "graph_html",
    "theory_html",
    "search_html",
    "frontier_html",
    "plan_html",
    "history_html",
    "plan_diff_html",
    "cluster_html",
    "sharding_html",
    "gantt",
    "gantt_html",
    "gantt_svg",
    "report_html",
    "graph_dot",
    "search_tree_dot",
    "proof_dot",
    "svg",
    "has_dot",
    "enabled_triples",
    "form_text",
    "FORM_COLORS",
]

#: Fill colours of the three forms (I replicated, G sharded, R partial sums) in every drawing.
FORM_COLORS: Mapping[str, str] = {"I": "#9ecae1", "G": "#a1d99b", "R": "#fdae6b", "?": "#eeeeee"}
_COMM_COLOR = "#e6550d"
_COMP_COLOR = "#3182bd"
_IDLE_COLOR = "#dddddd"
_DEVICE_COLORS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
)  # fmt: skip

_TABLE = "border-collapse:collapse;font-family:monospace;font-size:12px;margin:4px 0"
_TD = "border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top"
_TDR = "border:1px solid #ccc;padding:2px 6px;text-align:right;vertical-align:top"
_TH = "border:1px solid #ccc;padding:2px 6px;background:#f4f4f4;text-align:left"
_HIGHLIGHT = "background:#fff3b0"


def esc(x: Any) -> str:
    """HTML-escape ``str(x)``."""
    return _html.escape(str(x), quote=True)


# ============================================================================================ basics


def safe_html(fn: Any, obj: Any, *args: Any, **kwargs: Any) -> str:
    """``fn(obj, *args, **kwargs)`` as HTML; on any error, the escaped ``repr(obj)`` plus a short note.

    Never raises (``KeyboardInterrupt`` aside), so a display bug never breaks a notebook cell.

    >>> safe_html(lambda o: 1 / 0, "x").startswith("<div")
    True
    """
    try:
        out = fn(obj, *args, **kwargs)
        return out if isinstance(out, str) else str(out)
    except Exception as e:  # noqa: BLE001 - a display must never raise
        try:
            text = repr(obj)
        except Exception as e2:  # noqa: BLE001
            text = f"<{type(obj).__name__} object (repr failed: {type(e2).__name__}: {e2})>"
        name = getattr(fn, "__name__", "renderer")
        return (
            f"<div><pre style='white-space:pre-wrap'>{esc(text)}</pre>"
            f"<div style='color:#a00;font-size:11px'>(hapnb: {esc(name)} could not render this: "
            f"{esc(type(e).__name__)}: {esc(str(e)[:300])})</div></div>"
        )


def _table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    highlight: Iterable[int] = (),
    right: Iterable[int] = (),
    caption: str = "",
) -> str:
    """An HTML table; ``rows`` hold already-escaped cell HTML; ``highlight`` row indices; ``right`` cols."""
    hl = set(highlight)
    rc = set(right)
    head = "".join(f"<th style='{_TH}'>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        style = f" style='{_HIGHLIGHT}'" if i in hl else ""
        cells = "".join(f"<td style='{_TDR if k in rc else _TD}'>{c}</td>" for k, c in enumerate(row))
        body.append(f"<tr{style}>{cells}</tr>")
    cap = f"<caption style='text-align:left;font-weight:bold'>{caption}</caption>" if caption else ""
    return f"<table style='{_TABLE}'>{cap}<tr>{head}</tr>{''.join(body)}</table>"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{int(n)} B"


def short_target(target: str) -> str:
    """``aten.linear.default`` -> ``linear``."""
    parts = target.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims", "torch"):
        return parts[1]
    return target


def form_text(form: Any, words: bool = False) -> str:
    """A form in math notation: ``G(0)``, ``I``, ``R``; with ``words`` the paper's All-Gather(0)/...

    Accepts a :class:`~hapnb.forms.Form` or its string (``"G0"``).
    """
    from .forms import Form, parse_form

    f = form if isinstance(form, Form) else parse_form(str(form))
    if words:
        return f.math()
    return f"G({f.dim})" if f.kind == "G" else f.kind


def _kind(form: Any) -> str:
    s = str(form)
    return s[:1] if s[:1] in ("I", "G", "R") else "?"


def _props_text(props: Iterable[tuple[str, Any]], words: bool = False) -> str:
    return "{" + ", ".join(f"{name} | {form_text(f, words)}" for name, f in props) + "}"


# ============================================================================================ graphviz


def has_dot() -> bool:
    """Whether the graphviz ``dot`` program is installed (drawings render to SVG only with it)."""
    return shutil.which("dot") is not None


_DIGRAPH_CLASS: Any = None


def _digraph(name: str, **attrs: Any) -> Any:
    """A ``graphviz.Digraph`` whose notebook display falls back to its dot source without ``dot``."""
    global _DIGRAPH_CLASS
    import graphviz

    if _DIGRAPH_CLASS is None:

        class Drawing(graphviz.Digraph):
            """A graphviz Digraph that shows its dot source when the ``dot`` program is missing."""

            def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kw: Any) -> Any:
                try:
                    return super()._repr_mimebundle_(include, exclude, **kw)
                except Exception as e:  # noqa: BLE001 - dot missing or failing: show the source
                    note = (
                        "graphviz could not render this drawing "
                        f"({type(e).__name__}); install graphviz (e.g. `apt-get install graphviz`) to see "
                        "it. Its dot source:\n"
                    )
                    return {"text/plain": note + self.source}

        _DIGRAPH_CLASS = Drawing
    g = _DIGRAPH_CLASS(name=name)
    g.attr(**attrs)
    return g


def svg(drawing: Any) -> str | None:
    """Render a graphviz drawing to an inline SVG string (no XML header); ``None`` without ``dot``."""
    if drawing is None or not has_dot():
        return None
    try:
        out = drawing.pipe(format="svg").decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - a failing dot run means no picture, not an error
        return None
    start = out.find("<svg")
    return out[start:] if start >= 0 else out


def _rec(text: Any) -> str:
    """Escape text for a graphviz record label field."""
    s = str(text)
    for ch in '\\{}|<>"':
        s = s.replace(ch, "\\" + ch)
    return s.replace("\n", "\\n")


def _lbl(text: Any) -> str:
    """Escape text for a plain graphviz label (real newlines become line breaks)."""
    return str(text).replace("\\", "\\\\").replace("\n", "\\n")


def _program_ops(plan: Any) -> list[dict[str, Any]]:
    """Ops of a plan's program (used when the plan has no Graph, e.g. loaded from JSON)."""
    ops = []
    for ins in plan.program:
        if ins.kind == "compute":
            ops.append(
                dict(
                    name=ins.op,
                    target=ins.target,
                    inputs=[t for t, _ in ins.inputs],
                    outputs=[t for t, _ in ins.outputs],
                )
            )
    return ops


def _plan_views(plan: Any) -> tuple[dict[str, Any], dict[str, str], dict[tuple[str, str], list[str]]]:
    """(op name -> compute Instruction, tensor -> loaded form, (tensor, dst form) -> collective names)."""
    compute: dict[str, Any] = {}
    loaded: dict[str, str] = {}
    convs: dict[tuple[str, str], list[str]] = {}
    for ins in plan.program:
        if ins.kind == "compute":
            compute[ins.op] = ins
        elif ins.kind == "load":
            loaded[ins.tensor] = ins.form
        else:
            convs.setdefault((ins.tensor, ins.form), []).append(f"{ins.name}: {ins.src}→{ins.form}")
    return compute, loaded, convs


def graph_dot(graph: Any, plan: Any = None, *, max_ops: int = 400) -> Any:
    """Draw the single-device program (a Graph, Theory or Plan) as a graphviz ``Digraph``.

    Ops are record nodes (name | target | output shape | chosen strategy and forms); parameters, inputs
    and buffers are boxes. With a ``plan`` (or a Plan as first argument), nodes are coloured by the form
    the plan gives their output (I blue, G green, R orange) and edges show the form each consumer reads,
    with the collective that converted it (``all_gather: G1→I``).
    """
    from .plan import Plan

    if isinstance(graph, Plan):
        plan, graph = graph, graph.graph
    g = getattr(graph, "graph", graph)  # a Theory has .graph
    if g is not None and not hasattr(g, "ops"):
        g = None
    compute, loaded, convs = _plan_views(plan) if plan is not None else ({}, {}, {})
    title = getattr(g, "name", None) or getattr(plan, "name", "program")
    dot = _digraph(
        "graph", rankdir="TB", fontname="Helvetica", fontsize="11", label=_lbl(title), labelloc="t"
    )
    dot.attr("node", fontname="Helvetica", fontsize="9")
    dot.attr("edge", fontname="Helvetica", fontsize="8")
    if g is not None:
        ops = [
            dict(
                name=op.name,
                target=op.target,
                inputs=[g.tensors[t].name for t in op.inputs],
                outputs=[g.tensors[t].name for t in op.outputs],
                module=op.module,
                flops=op.flops,
            )
            for op in g.ops
        ]
        shapes = {t.name: t.shape for t in g.tensors}
        roles = {t.name: t.role for t in g.tensors}
        loss = g.tensors[g.loss].name
    elif plan is not None:
        ops = _program_ops(plan)
        shapes = {}
        roles = {t: "param" for t in loaded}
        inputs = set(dict(plan.options).get("inputs", ()))
        roles.update({t: "input" for t in inputs})
        loss = ops[-1]["outputs"][0] if ops and ops[-1]["outputs"] else ""
    else:
        raise TypeError(f"graph_dot needs a Graph, Theory or Plan, got {type(graph).__name__}")
    producer: dict[str, str] = {}
    for k, op in enumerate(ops):
        for t in op["outputs"]:
            producer[t] = f"op{k}"
    truncated = len(ops) > max_ops
    ops = ops[:max_ops]
    leaves_drawn: set[str] = set()

    def leaf(t: str) -> str:
        nid = "t_" + re.sub(r"\W", "_", t)
        if t not in leaves_drawn:
            leaves_drawn.add(t)
            role = roles.get(t, "const")
            form = loaded.get(t)
            shape = "x".join(map(str, shapes.get(t, ()))) if t in shapes else ""
            label = f"{t}\n[{shape}]" if shape else t
            if form:
                label += f"\n{form_text(form)}"
            dot.node(
                nid,
                _lbl(label),
                shape="parallelogram" if role == "input" else "box",
                style="rounded,filled" if form else "rounded",
                fillcolor=FORM_COLORS[_kind(form)] if form else "white",
            )
        return nid

    for k, op in enumerate(ops):
        ins = compute.get(op["name"])
        out_name = op["outputs"][0] if op["outputs"] else ""
        shape = "x".join(map(str, shapes.get(out_name, ()))) if out_name in shapes else ""
        fields = [op["name"]]
        if short_target(op["target"]) != op["name"]:
            fields.append(short_target(op["target"]))
        if shape:
            fields.append(f"[{shape}]")
        fill = "white"
        if ins is not None:
            outs = ", ".join(form_text(f) for _, f in ins.outputs)
            fields.append(f"{ins.name}: {outs}")
            fill = FORM_COLORS[_kind(ins.outputs[0][1])] if ins.outputs else fill
        label = "{" + "|".join(_rec(x) for x in fields) + "}"
        extra = {"penwidth": "2", "color": "#a50f15"} if out_name == loss else {}
        dot.node(f"op{k}", label, shape="record", style="filled", fillcolor=fill, **extra)
        for pos, t in enumerate(op["inputs"]):
            src = producer.get(t) or leaf(t)
            f = ins.inputs[pos][1] if ins is not None and pos < len(ins.inputs) else None
            elabel = form_text(f) if f else ""
            how = convs.get((t, f or ""))
            if how and producer.get(t):
                elabel += "\n" + "\n".join(how)
            style = {"color": _COMM_COLOR, "penwidth": "1.6"} if how and producer.get(t) else {}
            dot.edge(src, f"op{k}", label=_lbl(elabel), **style)
    if truncated:
        dot.node("more", f"... more ops (drawing limited to {max_ops} ops)", shape="note")
    if plan is not None:
        dot.node(
            "legend",
            "forms: I replicated (blue), G(d) sharded on dim d (green), R partial sums (orange); "
            "red edges: collectives",
            shape="plaintext",
            fontsize="8",
        )
    return dot


def _step_text(graph: Any, step: Any) -> str:
    if step is None:
        return "start: {}"
    op = graph.ops[step.op]
    parts = [f"{op.name}[{step.strategy.name}]"]
    for cv in step.conversions:
        parts.append(f"{cv.name} {graph.tensors[cv.tensor].name}")
    return "\n".join(parts)


def search_tree_dot(
    search: Any,
    around: int | None = None,
    depth: int = 2,
    *,
    event: Any = None,
    max_children: int = 12,
) -> Any:
    """Draw the part of the A* tree around one node as a graphviz ``Digraph``.

    Shows the path from the root to ``around`` (default: the node ``event`` popped, else the best
    complete node, else the root), ``depth`` levels of its descendants (at most ``max_children`` per
    node, best score first), the children ``event`` pruned as dashed grey nodes with the reason, and the
    best complete program's path in bold red. Node labels: id, op position, step, cost g, heuristic h
    and score f = g + h (ms). Frontier (open) nodes are yellow, complete ones green.
    """
    g = search.graph
    nops = len(g.ops)
    best = search.best
    if around is None:
        popped = getattr(event, "popped", None)
        around = popped.id if popped is not None else (best.id if best is not None else 0)
    open_ids = {n.id for n in search.frontier}
    best_path: set[int] = set()
    nid = best.id if best is not None else -1
    while nid >= 0:
        best_path.add(nid)
        nid = search.node(nid).parent
    dot = _digraph(
        "search", rankdir="TB", fontname="Helvetica", fontsize="10", labelloc="t",
        label=_lbl(f"A* tree of {g.name}: {search.stats.get('expansions', 0)} expansions, "
                   f"{len(open_ids)} open" + (f", best {_ms(best.cost)} ms" if best else "")),
    )  # fmt: skip
    dot.attr("node", fontname="Helvetica", fontsize="8", shape="box", style="rounded,filled")
    dot.attr("edge", fontsize="7")
    drawn: set[int] = set()

    def draw(node: Any) -> None:
        if node.id in drawn:
            return
        drawn.add(node.id)
        label = (
            f"#{node.id}  op {node.position}/{nops}\n{_step_text(g, node.step)}\n"
            f"g={_ms(node.cost)} h={_ms(node.heuristic)} f={_ms(node.score)} ms"
        )
        fill = "#c7e9c0" if node.complete else "#fff7bc" if node.id in open_ids else "white"
        attrs: dict[str, str] = {}
        if node.id == around:
            attrs.update(penwidth="3", color="#2171b5")
        if best is not None and node.id == best.id:
            attrs.update(shape="doubleoctagon", color="#a50f15", penwidth="2.5")
        dot.node(f"n{node.id}", _lbl(label), fillcolor=fill, **attrs)

    def edge(parent: int, child: int) -> None:
        on_best = parent in best_path and child in best_path
        style = {"color": "#a50f15", "penwidth": "2.5"} if on_best else {}
        dot.edge(f"n{parent}", f"n{child}", **style)

    # path root -> around
    chain = []
    nid = around
    while nid >= 0:
        chain.append(search.node(nid))
        nid = chain[-1].parent
    chain.reverse()
    for a, b in zip(chain, chain[1:]):
        draw(a)
        draw(b)
        edge(a.id, b.id)
    draw(chain[-1])
    # descendants of around
    level = [chain[-1]]
    for _ in range(max(0, depth)):
        nxt = []
        for node in level:
            kids = sorted(search.children_of(node.id), key=lambda n: (n.score, n.id))
            # keep the best path visible even if it is not among the best-scored children
            shown = kids[:max_children] + [k for k in kids[max_children:] if k.id in best_path]
            for k in shown:
                draw(k)
                edge(node.id, k.id)
                nxt.append(k)
            if len(kids) > len(shown):
                more = f"more{node.id}"
                dot.node(more, f"+{len(kids) - len(shown)} more", shape="plaintext")
                dot.edge(f"n{node.id}", more, style="dotted")
        level = nxt
    # pruned children of the popped node
    popped = getattr(event, "popped", None)
    if popped is not None and event.pruned:
        draw(popped)
        for k, (desc, reason) in enumerate(event.pruned[: max_children * 2]):
            pid = f"p{popped.id}_{k}"
            dot.node(
                pid,
                _lbl(f"pruned: {desc}\n{reason}"),
                style="dashed",
                color="#999999",
                fontcolor="#777777",
            )
            dot.edge(f"n{popped.id}", pid, style="dashed", color="#999999")
        if len(event.pruned) > max_children * 2:
            dot.node(
                f"pmore{popped.id}", f"+{len(event.pruned) - max_children * 2} more pruned", shape="plaintext"
            )
    return dot


def _instr_props(ins: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """(precondition, postcondition, instruction text) of a plan Instruction."""
    if ins.kind == "load":
        return [], [(ins.tensor, ins.form)], f"{ins.name} {ins.tensor}"
    if ins.kind == "collective":
        return [(ins.tensor, ins.src)], [(ins.tensor, ins.form)], f"{ins.name} {ins.tensor}"
    return list(ins.inputs), list(ins.outputs), f"{ins.op} = {short_target(ins.target)}[{ins.name}]"


def proof_dot(plan: Any, *, words: bool = False) -> Any:
    """The plan as a proof: a chain of Hoare triples from the inputs to ``loss | R``.

    Each instruction is a record ``{pre} | instruction | {post}``; an edge goes from the triple that
    established a property to each triple that uses it; stages are boxed; the last node is the goal.
    """
    dot = _digraph(
        "proof", rankdir="TB", fontname="Helvetica", fontsize="10", labelloc="t",
        label=_lbl(f"Proof of {plan.name}: {{}} program {{loss | R}} ({len(plan.program)} triples)"),
    )  # fmt: skip
    dot.attr("node", fontname="Helvetica", fontsize="8", shape="record", style="filled")
    dot.attr("edge", fontname="Helvetica", fontsize="7")
    made: dict[tuple[str, str], str] = {}
    by_stage: dict[int, list[int]] = {}
    for i, ins in enumerate(plan.program):
        by_stage.setdefault(ins.stage, []).append(i)
    stage_info = {s.index: s for s in plan.stages}
    for st, idx in sorted(by_stage.items()):
        info = stage_info.get(st)
        comm = ", ".join(info.comm) if info is not None and info.comm else "no communication"
        with dot.subgraph(name=f"cluster_{st}") as sub:
            sub.attr(label=_lbl(f"stage {st}: {comm}"), style="rounded", color="#bbbbbb", fontsize="9")
            for i in idx:
                ins = plan.program[i]
                pre, post, text = _instr_props(ins)
                fill = _COMM_COLOR if ins.kind == "collective" and ins.communicates else None
                color = {"load": "#f0f0f0", "collective": "#fdd0a2", "compute": "#deebf7"}[ins.kind]
                label = (
                    "{"
                    + "|".join(_rec(x) for x in (_props_text(pre, words), text, _props_text(post, words)))
                    + "}"
                )
                sub.node(f"i{i}", label, fillcolor=color, **({"color": fill} if fill else {}))
    for i, ins in enumerate(plan.program):
        pre, post, _ = _instr_props(ins)
        for p in pre:
            src = made.get(p)
            if src is not None:
                dot.edge(src, f"i{i}", label=_lbl(f"{p[0]} | {form_text(p[1], words)}"), fontsize="7")
        for p in post:
            made[p] = f"i{i}"
    goal = next(((t, f) for (t, f) in reversed(list(made)) if str(f) == "R"), None)
    if plan.program:
        last = f"i{len(plan.program) - 1}"
        src = made.get(goal, last) if goal else last
        gl = f"loss | {form_text('R', words)}" if goal is None else f"{goal[0]} | {form_text('R', words)}"
        dot.node("goal", _lbl(f"∎ {gl}"), shape="doubleoctagon", fillcolor="#c7e9c0")
        dot.edge(src, "goal", penwidth="2")
    return dot


# ============================================================================================ HTML: graph


def graph_html(graph: Any, *, max_rows: int = 200) -> str:
    """A Graph (or Theory's graph) as a summary line, an op table and, with ``dot``, a drawing."""
    g = getattr(graph, "graph", graph) if not hasattr(graph, "ops") else graph
    rows = []
    for op in g.ops[:max_rows]:
        ins = ", ".join(str(g.tensors[t]) for t in op.inputs)
        outs = ", ".join(str(g.tensors[t]) for t in op.outputs)
        rows.append(
            [
                esc(op.id), esc(op.name), esc(short_target(op.target)), esc(op.family), esc(ins), esc(outs),
                f"{op.flops:.3g}", esc(op.module),
            ]
        )  # fmt: skip
    more = f"<div>... {len(g.ops) - max_rows} more ops</div>" if len(g.ops) > max_rows else ""
    table = _table(
        ["#", "op", "target", "family", "inputs", "outputs", "fwd flops", "module"], rows, right=(0, 6)
    )
    picture = ""
    if len(g.ops) <= 150:
        s = svg(graph_dot(g))
        if s:
            picture = f"<details><summary>drawing</summary>{s}</details>"
    ops = f"<details open><summary>ops</summary>{table}{more}</details>"
    return f"<div><b>{esc(g.summary())}</b>{picture}{ops}</div>"


def cluster_html(cluster: Any) -> str:
    """A Cluster: its devices and collective models (the Cluster's own HTML)."""
    return cluster._repr_html_()


# ============================================================================================ HTML: theory


def triple_text(th: Any, tr: Any, words: bool = False) -> tuple[str, str, str]:
    """(precondition, instruction, postcondition) of a theory Triple in math notation."""
    g = th.graph
    pre = _props_text(((g.tensors[t].name, f) for t, f in tr.pre), words)
    post = _props_text(((g.tensors[t].name, f) for t, f in tr.post), words)
    i = tr.instr
    if i.kind == "compute":
        op = g.ops[i.op]
        instr = f"{op.name} = {short_target(op.target)}[{i.name}]"
    elif i.kind == "load":
        instr = f"load {g.tensors[i.tensor].name}"
    else:
        instr = f"{i.name}"
        if words:
            instr = {
                "all_gather": "All-Gather (padded)",
                "grouped_all_gather": "All-Gather (grouped broadcast)",
                "all_reduce": "All-Reduce",
                "reduce_scatter": "Reduce-Scatter (padded)",
                "grouped_reduce_scatter": "Reduce-Scatter (grouped reduce)",
                "all_to_all": "All-to-All",
                "slice": "Slice",
                "to_partial": "To-Partial",
            }.get(i.name, i.name)
    return pre, instr, post


def theory_html(
    th: Any,
    op: str | int | None = None,
    tensor: str | int | None = None,
    highlight: Iterable[int] | None = None,
    *,
    kind: str | None = None,
    words: bool = False,
    limit: int = 500,
    only: Iterable[int] | None = None,
) -> str:
    """The theory as a table of Hoare triples ``{pre} instruction {post}`` in math notation.

    Filter by ``op`` (name, target substring or id), ``tensor`` (name or id) and ``kind``
    (``compute``/``load``/``collective``); rows whose triple id is in ``highlight`` are yellow (e.g.
    :func:`enabled_triples` at a search node); ``only`` keeps just those ids. ``words`` uses the paper's
    words (All-Gather(0), Identity, All-Reduce).
    """
    from .triples import COLLECTIVES

    triples = (
        th.filter(op=op, tensor=tensor, kind=kind) if (op, tensor, kind) != (None, None, None) else list(th)
    )
    hl = set(highlight or ())
    if only is not None:
        keep = set(only)
        triples = [tr for tr in triples if tr.id in keep]
    rows, marks = [], []
    for k, tr in enumerate(triples[:limit]):
        pre, instr, post = triple_text(th, tr, words)
        i = tr.instr
        if i.kind == "compute" and i.strategy is not None:
            note = f"flops: scaled {i.strategy.scaled_flops:.3g}, fixed {i.strategy.fixed_flops:.3g}"
            note += ", SFB" if i.strategy.sfb else ""
        elif i.kind == "collective":
            note = COLLECTIVES.get(i.name, ("", "", ""))[2]
        else:
            note = "loaded in this form (no communication)"
        rows.append([esc(tr.id), esc(i.kind), esc(pre), f"<b>{esc(instr)}</b>", esc(post), esc(note)])
        if tr.id in hl:
            marks.append(k)
    filt = ", ".join(f"{k}={v}" for k, v in (("op", op), ("tensor", tensor), ("kind", kind)) if v is not None)
    head = (
        f"<b>{esc(repr(th))}</b><div>showing {min(len(triples), limit)} of {len(triples)} triples"
        + (f" ({esc(filt)})" if filt else "")
        + (f"; {len(hl)} highlighted ({len(marks)} shown)" if hl else "")
        + "</div>"
    )
    more = f"<div>... {len(triples) - limit} more</div>" if len(triples) > limit else ""
    table = _table(["id", "kind", "pre", "instruction", "post", "note"], rows, highlight=marks, right=(0,))
    return f"<div>{head}{table}{more}</div>"


def enabled_triples(search: Any, node: Any = None) -> set[int]:
    """Ids of the theory triples enabled at a search node (default: the best frontier node).

    A triple is enabled when its precondition holds in the node's properties and its postcondition adds
    a property: the next op's compute triples (the search follows program order), loads of that op's
    parameters/inputs not loaded yet, and collectives on tensors the node holds.
    """
    th = search.theory
    g = th.graph
    if node is None:
        front = search.frontier
        node = front[0] if front else search.node(0)
    elif isinstance(node, int):
        node = search.node(node)
    props = set(node.props)
    held = {t for t, _ in props}
    loaded = _loaded_tensors(search, node)
    next_op = g.ops[node.position] if node.position < len(g.ops) else None
    out = set()
    for tr in th:
        i = tr.instr
        if set(tr.post) <= props:
            continue
        if i.kind == "compute":
            if next_op is None or i.op != next_op.id:
                continue
            ok = all(p in props or (g.tensors[p[0]].role in _LOADABLE and p[0] not in loaded) for p in tr.pre)
            if ok:
                out.add(tr.id)
        elif i.kind == "load":
            if next_op is not None and i.tensor in next_op.inputs and i.tensor not in loaded:
                out.add(tr.id)
        elif all(p in props for p in tr.pre) and i.tensor in held:
            out.add(tr.id)
    return out


_LOADABLE = ("input", "param", "buffer", "const")


def _loaded_tensors(search: Any, node: Any) -> set[int]:
    out = set()
    try:
        for st in search.program(node.id):
            out.update(ld.tensor for ld in st.loads)
    except Exception:  # noqa: BLE001 - without the program we only know the properties
        pass
    return out


# ============================================================================================ HTML: search


def _node_instructions(search: Any, node: Any) -> int:
    try:
        return sum(1 + len(st.loads) + len(st.conversions) for st in search.program(node.id))
    except Exception:  # noqa: BLE001
        return node.position


def _props_short(g: Any, props: Iterable[tuple[int, Any]], limit: int = 8) -> str:
    ps = [f"{g.tensors[t].name}:{f}" for t, f in props]
    more = f" +{len(ps) - limit}" if len(ps) > limit else ""
    return ", ".join(ps[:limit]) + more


def frontier_html(search: Any, limit: int = 30) -> str:
    """The open partial programs, best score first: score = cost + heuristic, #instructions, properties."""
    g = search.graph
    front = search.frontier
    best = search.best
    rows = []
    for rank, n in enumerate(front[:limit]):
        rows.append(
            [
                esc(rank), esc(f"#{n.id}"), _ms(n.score), _ms(n.cost), _ms(n.heuristic),
                esc(f"{_node_instructions(search, n)} ({n.position}/{len(g.ops)} ops)"),
                "✓" if n.complete else "", esc(_step_text(g, n.step).replace("\n", "; ")),
                esc(_props_short(g, n.props)),
            ]
        )  # fmt: skip
    mark = [k for k, n in enumerate(front[:limit]) if best is not None and n.id == best.id]
    more = f"<div>... {len(front) - limit} more open</div>" if len(front) > limit else ""
    table = _table(
        ["rank", "node", "score f (ms)", "cost g (ms)", "heuristic h (ms)", "#instructions (position)",
         "complete", "last step", "properties"],
        rows, highlight=mark, right=(0, 2, 3, 4),
        caption=f"frontier: {len(front)} open",
    )  # fmt: skip
    return table + more


def search_html(search: Any, event: Any = None, *, limit: int = 30) -> str:
    """A Search: its stats, the best complete program so far, the frontier and the last event."""
    st = search.stats
    best = search.best
    status = "done (best proven optimal)" if search.done else "running"
    head = (
        f"<b>{esc(repr(search))}</b><div>{esc(status)}; "
        + ", ".join(f"{esc(k)} {esc(_fmt(v))}" for k, v in st.items())
        + "</div>"
    )
    best_html = "<div>no complete program yet</div>"
    if best is not None:
        steps = search.program(best.id)
        items = "".join(f"<li>{esc(_step_text(search.graph, s).replace(chr(10), '; '))}</li>" for s in steps)
        best_html = (
            f"<details><summary>best complete program #{best.id}: {_ms(best.cost)} ms, {len(steps)} steps"
            f"</summary><ol style='font-family:monospace;font-size:12px'>{items}</ol></details>"
        )
    ev = event_html(search, event) if event is not None else ""
    return f"<div>{head}{best_html}{ev}{frontier_html(search, limit)}</div>"


def event_html(search: Any, event: Any) -> str:
    """What one ``Search.step()`` did: popped node, children, pruned children with reasons."""
    g = search.graph
    if event.popped is None:
        return "<div>nothing to expand: the search is done</div>"
    p = event.popped
    kids = _table(
        ["child", "step", "cost g (ms)", "score f (ms)", "complete"],
        [
            [esc(f"#{c.id}"), esc(_step_text(g, c.step).replace("\n", "; ")), _ms(c.cost), _ms(c.score),
             "✓" if c.complete else ""]
            for c in event.children
        ],
        right=(2, 3),
        caption=f"popped #{p.id} ({esc(_step_text(g, p.step).replace(chr(10), '; '))}): "
        f"{len(event.children)} children, {len(event.pruned)} pruned",
    )  # fmt: skip
    pruned = ""
    if event.pruned:
        pruned = _table(
            ["pruned child", "reason"], [[esc(d), esc(r)] for d, r in event.pruned], caption="pruned"
        )
    return f"<div>{kids}{pruned}</div>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ============================================================================================ HTML: plan


def _stage_starts(plan: Any) -> list[float]:
    out, t = [], 0.0
    for s in plan.stages:
        out.append(t)
        t += s.time_s
    return out


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


def _forms_by_tensor(plan: Any) -> dict[str, tuple[str, ...]]:
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
    fo, fn = _forms_by_tensor(old), _forms_by_tensor(new)
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
    forms = _forms_by_tensor(plan).get(tensor, ())
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
    from bokeh.models import ColumnDataSource, HoverTool, Range1d, Span
    from bokeh.plotting import figure

    devs = list(plan.devices)
    steps, stage_meas = _measured_parts(measured)
    lanes = list(reversed(devs))
    if steps or stage_meas:
        lanes = ["measured", "predicted"] + lanes
    data: dict[str, list[Any]] = {
        k: [] for k in ("lane", "left", "right", "kind", "color", "stage", "dur", "comm", "instrs", "alpha")
    }

    def add(lane: str, a: float, b: float, kind: str, color: str, stage: Any, comm: str, instrs: str) -> None:
        data["lane"].append(lane)
        data["left"].append(a * 1e3)
        data["right"].append(b * 1e3)
        data["kind"].append(kind)
        data["color"].append(color)
        data["stage"].append(str(stage))
        data["dur"].append((b - a) * 1e3)
        data["comm"].append(comm)
        data["instrs"].append(instrs)
        data["alpha"].append(0.5 if kind == "idle" else 0.9)

    total = 0.0
    for s, t0 in zip(plan.stages, _stage_starts(plan)):
        mx = max(s.comp_s) if s.comp_s else 0.0
        comm = "; ".join(s.comm) or "none"
        texts = [str(plan.program[i]) for i in s.instructions if i < len(plan.program)]
        instrs = "; ".join(texts)
        if len(instrs) > 700:
            instrs = instrs[:700] + f" ... ({len(texts)} instructions)"
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
                f"mean of {len(steps)} steps (min {min(steps) * 1e3:.4g}, max {max(steps) * 1e3:.4g} ms)", "",
            )  # fmt: skip
    src = ColumnDataSource(data)
    fig = figure(
        y_range=lanes,
        width=width,
        height=height or (70 + 28 * len(lanes)),
        title=f"{plan.name} on {plan.cluster.name}: {plan.cost_s * 1e3:.4g} ms predicted per iteration",
        x_axis_label="time (ms)",
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
                ("device", "@lane"), ("stage", "@stage"), ("what", "@kind"), ("duration", "@dur{0.0000} ms"),
                ("communication", "@comm"), ("instructions", "@instrs"),
            ]
        )
    )  # fmt: skip
    end = max([total] + [r / 1e3 for r in data["right"]]) * 1e3
    fig.x_range = Range1d(0, end * 1.02 if end > 0 else 1.0)
    if steps:
        fig.add_layout(
            Span(location=total * 1e3, dimension="height", line_color="#756bb1", line_dash="dashed")
        )
    fig.legend.location = "bottom_right"
    fig.legend.label_text_font_size = "9pt"
    fig.ygrid.grid_line_color = None
    return fig


def gantt_html(plan: Any, measured: Any = None, **kw: Any) -> str:
    """A standalone HTML page with the Gantt chart and BokehJS inlined (no CDN, works offline)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    return file_html(gantt(plan, measured, **kw), resources=INLINE, title=f"hapnb Gantt: {plan.name}")


# ============================================================================================ report


def report_html(
    plan: Any,
    baselines: Mapping[str, Any] | None = None,
    search_stats: Mapping[str, Any] | None = None,
    *,
    title: str | None = None,
    measured: Any = None,
) -> str:
    """One self-contained HTML page: plan summary, stages, Gantt (BokehJS inline), search stats,
    baselines (name -> Plan or cost in seconds) and, with ``dot``, the graph and the proof drawing."""
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
        if s:
            sections.append(f"<h2>{esc(heading)}</h2><div style='overflow:auto'>{s}</div>")
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title>{resources}"
        "<style>body{font-family:Helvetica,Arial,sans-serif;margin:16px} h2{margin-top:24px}</style>"
        f"</head><body>{body}</body></html>\n"
    )
