"""graphviz drawings: the program graph, the A* search tree and the proof chain of a plan."""

from __future__ import annotations

import re
import shutil
from typing import Any

from .basics import _COMM_COLOR, FORM_COLORS, _kind, _ms, _props_text, form_text, short_target

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
    if hasattr(graph, "program") and hasattr(graph, "ratios"):  # a Plan
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
    rankdir: str = "TB",
) -> Any:
    """Draw the part of the A* tree around one node as a graphviz ``Digraph`` (``rankdir="LR"`` puts
    the root at the left edge, for boxes that scroll sideways).

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
        "search", rankdir=rankdir, fontname="Helvetica", fontsize="10", labelloc="t",
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
