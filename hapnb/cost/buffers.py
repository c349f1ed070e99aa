"""The collectives of buffer updates (batch norm's running statistics), so the cost model prices them.

A training batch norm (lowered by :mod:`hapnb.tracing.lower` to sums) updates its running mean and
variance from the batch statistics. The Graph leaves those updates out (they do not reach the loss), and
every rank's program computes them after its forward (:mod:`hapnb.runtime.bufferupdates`) from the values
the plan already has: a statistic the plan holds replicated (``I``) costs nothing, one it keeps only
partial (``R``) is all-reduced, one it keeps only sharded (``G``) is all-gathered, and a buffer stored
sharded is all-gathered before the update reads it. Those collectives run once per step, in the forward,
without a backward (the update is outside autograd). :func:`update_collectives` lists them for a searched
program by the same rule, so :meth:`hapnb.cost.model.CostModel.evaluate` charges them to the last stage
and the plan lists them (``tests/cost/test_bn_pricing.py`` checks them against a generated program).

With the batch sharded, the mean is all-reduced by the plan itself (every rank needs it to normalise);
the variance is too, unless the search all-reduces ``var + eps`` instead (the same price for it), which
leaves the biased variance the update reads partial: then the update's all-reduce is the extra one.

>>> import torch, hapnb
>>> m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
>>> g = hapnb.trace(m, (torch.randn(6, 3),), loss=lambda out: out.pow(2).sum())
>>> [(r.buffer, [g.tensors[t].name for t in r.activations]) for r in update_reads(g)]
[('1.running_mean', ['div']), ('1.running_var', ['div_1']), ('1.num_batches_tracked', [])]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..ir.forms import Form, I, R
from ..ir.graph import DeferredProgram, Graph

__all__ = [
    "UpdateRead",
    "UpdateCollective",
    "update_reads",
    "update_inputs",
    "update_kind",
    "update_collectives",
]


@dataclass(frozen=True)
class UpdateRead:
    """What the update of one buffer reads: graph activations (the batch statistics) and weights
    (its own old value, by graph tensor id)."""

    buffer: str
    activations: tuple[int, ...]
    weights: tuple[int, ...]


@dataclass(frozen=True)
class UpdateCollective:
    """One collective a buffer update runs: ``kind`` (``all_reduce`` / ``all_gather``) of graph tensor
    ``tensor`` (its whole size is ``nbytes``), for ``buffer``."""

    kind: str
    tensor: int
    nbytes: int
    buffer: str
    tensor_name: str = ""

    @property
    def what(self) -> str:
        return f"buffer update {self.kind} {self.tensor_name}"


def _exported_reads(graph: Graph, program: Any) -> tuple[UpdateRead, ...]:
    """The reads of every buffer update of an exported program (the walk of
    :func:`hapnb.runtime.bufferupdates.emit_buffer_updates`: back from each new value through the ops the
    graph left out, stopping at graph activations and at weights)."""
    import torch

    from ..tracing.exported import live_nodes, mutated_buffers, weight_names

    updates = mutated_buffers(program)
    if not updates:
        return ()
    weights = weight_names(program)
    live = live_nodes(program)
    ids = {t.name: t.id for t in graph.tensors}
    out = []
    for name, new in updates:
        if new.op == "placeholder" and weights.get(new.name) == name:
            continue  # written back unchanged
        acts: list[int] = []
        reads: list[int] = []
        seen: set[Any] = set()
        todo = [new]
        while todo:
            nd = todo.pop()
            if nd in seen:
                continue
            seen.add(nd)
            if nd.op == "placeholder":
                tid = ids.get(weights.get(nd.name, ""))
                if tid is not None:
                    reads.append(tid)
            elif nd in live and isinstance(nd.meta.get("val"), torch.Tensor):
                if nd.name in ids:
                    acts.append(ids[nd.name])
            else:
                todo.extend(nd.all_input_nodes)
        out.append(UpdateRead(name, tuple(sorted(acts)), tuple(sorted(reads))))
    return tuple(out)


def update_reads(graph: Graph) -> tuple[UpdateRead, ...]:
    """What each buffer update of ``graph``'s traced program reads (none for a graph without buffers, a
    hand-built graph or an fx fallback program). Kept on the graph (computed once). A program traced on
    first use (a zoo model) is traced only when the graph has a buffer no op reads (what a running
    statistic is in training)."""
    hit = graph.__dict__.get("_update_reads")
    if hit is not None:
        return hit
    import torch

    reads: tuple[UpdateRead, ...] = ()
    bufs = [graph.tensors[t] for t in graph.params if graph.tensors[t].role == "buffer"]
    if bufs and not (isinstance(graph.program, DeferredProgram) and all(t.consumers for t in bufs)):
        program = graph.traced_program()
        if isinstance(program, torch.export.ExportedProgram):
            reads = _exported_reads(graph, program)
    object.__setattr__(graph, "_update_reads", reads)
    return reads


def _forms(program: Iterable[Any]) -> tuple[dict[int, set[Form]], dict[int, Form]]:
    """The forms a searched program makes of each tensor (loads, collectives, computations) and the
    weights it loads sharded."""
    forms: dict[int, set[Form]] = {}
    sharded: dict[int, Form] = {}
    for st in program:
        for ld in st.loads:
            forms.setdefault(ld.tensor, set()).add(ld.form)
            if ld.storage.kind == "G":
                sharded[ld.tensor] = ld.storage
        for cv in st.conversions:
            forms.setdefault(cv.tensor, set()).add(cv.dst)
    return forms, sharded


def update_collectives(graph: Graph, program: Sequence[Any]) -> tuple[UpdateCollective, ...]:
    """The collectives the buffer updates of ``graph`` run after a rank's forward under ``program`` (a
    sequence of :class:`~hapnb.cost.model.Step`): per update, a statistic without an ``I`` form all-reduced (``R``) or all-gathered (``G``), and a weight
    stored sharded all-gathered; each tensor once."""
    reads = update_reads(graph)
    if not reads:
        return ()
    forms, sharded = _forms(program)
    for st in program:
        op = graph.ops[st.op]
        for t, f in zip(op.outputs, st.strategy.outputs):
            forms.setdefault(t, set()).add(f)
    out: list[UpdateCollective] = []
    for buffer, tid in update_inputs(graph):
        kind = update_kind(graph, tid, forms.get(tid, ()), tid in sharded)
        if kind:
            t = graph.tensors[tid]
            out.append(UpdateCollective(kind, tid, t.nbytes, buffer, t.name))
    return tuple(out)


def update_inputs(graph: Graph) -> tuple[tuple[str, int], ...]:
    """``(buffer, tensor)`` for each tensor the buffer updates of ``graph`` read, each once (with the
    first buffer that reads it)."""
    out: dict[int, str] = {}
    for r in update_reads(graph):
        for tid in (*r.activations, *r.weights):
            out.setdefault(tid, r.buffer)
    return tuple((b, t) for t, b in out.items())


def update_kind(graph: Graph, tensor: int, forms: Iterable[Form], sharded: bool) -> str:
    """The collective a buffer update runs on ``tensor`` ("" for none): a weight (parameter, buffer or
    constant) stored sharded (``sharded``) is all-gathered; a statistic the program makes in ``forms`` costs
    nothing if one of them is replicated, else is all-reduced if one is partial, all-gathered if sharded."""
    if graph.tensors[tensor].role in ("param", "buffer", "const"):
        return "all_gather" if sharded else ""
    have = set(forms)
    return "" if I in have else "all_reduce" if R in have else "all_gather" if have else ""
