"""HTML tables of a Graph, a Cluster, a Theory (the Hoare triples) and a Search (frontier, events)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .basics import _fmt, _ms, _props_text, _table, esc, short_target
from .drawings import _step_text, graph_dot, svg

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
        stored = f"({i.src})" if getattr(i, "src", None) is not None else ""
        instr = f"{i.name}{stored} {g.tensors[i.tensor].name}"
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
    notes = getattr(th, "collective_notes", {})
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
            if i.strategy.name.startswith("discovered"):
                note += ", discovered rule (no hand rule; checked by ground truth)"
            origin = getattr(th.graph.ops[i.op], "origin", "") if 0 <= i.op < len(th.graph.ops) else ""
            if origin:
                note += f", decomposed: lowered from {origin} at trace time"
        elif i.kind == "collective":
            note = notes.get(i.name, "")
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
