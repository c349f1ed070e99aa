"""Buffer updates in generated programs: batch norm's running statistics and ``num_batches_tracked``.

A traced training program also returns its buffer updates (``BUFFER_MUTATION`` outputs of the exported,
lowered program: :mod:`hapnb.tracing.lower` writes training batch norm's running statistics from the
batch statistics it computes as sums). The :class:`~hapnb.ir.graph.Graph` leaves these ops out (they do not
reach the loss, so they are not planned); :func:`emit_buffer_updates` adds them to a rank's program at
the end of its forward and writes each buffer back in place, as the single-device program does.

The update ops read the batch statistics the plan already computes (every rank needs them to normalise,
so the plan makes them replicated, ``I``: globally reduced, SyncBatchNorm semantics) and the buffers'
old values; a statistic the plan keeps only partial (``R``) or sharded (``G``) is all-reduced resp.
all-gathered first (a tiny per-channel tensor; the note says so). Every constant of the update (momentum,
the unbiased ``n / (n - 1)`` with ``n`` the global count per channel) was fixed by tracing the global
batch, so every rank computes the same new value whatever its shard, an empty one included.

>>> import torch, hapnb
>>> m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
>>> g = hapnb.trace(m, (torch.randn(6, 3),), loss=lambda out: out.pow(2).sum())
>>> [name for name, _ in mutated_buffers(g.traced_program())]
['1.running_mean', '1.running_var', '1.num_batches_tracked']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from ..ir.forms import Form, I, R
from ..ir.graph import Graph
from ..tracing.exported import live_nodes, mutated_buffers, weight_names
from . import collectives as C

__all__ = ["BufferUpdateError", "emit_buffer_updates", "mutated_buffers", "write_buffer"]


class BufferUpdateError(ValueError):
    """A buffer update the generated program cannot compute (names the buffer and why)."""


def write_buffer(buffer: torch.Tensor, value: torch.Tensor, dim: int = -1, start: int = 0) -> None:
    """Write ``value`` into ``buffer`` in place (outside autograd); ``dim >= 0``: ``buffer`` holds the
    slice ``[start, start + len)`` of ``value`` on ``dim`` (a sharded buffer)."""
    with torch.no_grad():
        buffer.copy_(value if dim < 0 else value.narrow(dim, start, buffer.shape[dim]))


def emit_buffer_updates(
    graph: Graph,
    emit: Callable[[Any, tuple, dict], fx.Node],
    env: Mapping[tuple[int, Form], fx.Node],
    lengths: Callable[[str, int], tuple[int, ...]],
    records: Mapping[str, Any],
    attr: Callable[[str], fx.Node],
) -> list[str]:
    """Append the update of every buffer the traced program of ``graph`` updates to a rank's fx graph
    (see the module doc); returns a note per buffer whose statistics needed a collective.

    ``emit(target, args, kwargs)`` appends a call; ``env`` holds the rank's values by ``(tensor id,
    form)``; ``lengths(name, dim)`` the plan's shard lengths; ``records`` the rank's
    :class:`~hapnb.runtime.program.LocalParam` by weight name and ``attr(name)`` its attribute node. Raises
    :class:`BufferUpdateError` for an update that reads a user input or a value the program lacks.
    """
    if not any(graph.tensors[t].role == "buffer" for t in graph.params):
        return []  # nothing to update (and a deferred program need not be traced to know it)
    program = graph.traced_program()
    updates = mutated_buffers(program)
    if not updates:
        return []
    weights = weight_names(program)
    live = live_nodes(program)
    activations = {t.name: t.id for t in graph.tensors if t.role == "activation"}
    done: dict[fx.Node, Any] = {}
    notes: list[str] = []

    def detached(x: fx.Node) -> fx.Node:
        return emit(torch.ops.aten.detach.default, (x,), {})

    def whole(tid: int, buffer: str) -> fx.Node:
        """The whole tensor ``tid`` from the plan's values: ``I`` as it is, else reduced or gathered."""
        t = graph.tensors[tid]
        forms = [f for (k, f) in env if k == tid]
        if I in forms:
            return detached(env[(tid, I)])
        if R in forms:
            notes.append(f"the update of buffer {buffer} all-reduces {t.name} (the plan keeps it partial)")
            return emit(C.all_reduce, (detached(env[(tid, R)]),), {"where": f"the update of buffer {buffer}"})
        gs = sorted((f for f in forms if f.kind == "G"), key=lambda f: f.dim)
        if not gs:
            raise BufferUpdateError(
                f"the update of buffer {buffer} reads {t.name}, which the rank's program never computes"
            )
        d = gs[0].dim
        notes.append(f"the update of buffer {buffer} all-gathers {t.name} (the plan keeps it sharded)")
        where = {"where": f"the update of buffer {buffer}"}
        return emit(C.all_gather, (detached(env[(tid, gs[0])]), d, lengths(t.name, d)), where)

    def weight(name: str, buffer: str) -> fx.Node:
        rec = records[name]
        if not rec.sharded:
            return detached(attr(name))
        where = {"where": f"the update of buffer {buffer}"}
        return emit(C.all_gather, (detached(attr(name)), rec.dim, rec.lengths), where)

    def value(nd: fx.Node, buffer: str) -> Any:
        if nd in done:
            return done[nd]
        val = nd.meta.get("val")
        if nd.op == "placeholder":
            if nd.name not in weights:
                raise BufferUpdateError(
                    f"the update of buffer {buffer} reads the user input {nd.name} directly; a distributed "
                    "program has only its shard of it. Compute the update from values the loss also uses"
                )
            res = weight(weights[nd.name], buffer)
        elif nd.op != "call_function":
            raise BufferUpdateError(f"the update of buffer {buffer} reads {nd.op} node {nd.name}")
        elif not isinstance(val, (torch.Tensor, list, tuple)):
            res = val  # a folded Python value (static shapes)
        elif nd in live:
            if nd.name not in activations:
                raise BufferUpdateError(
                    f"the update of buffer {buffer} reads {nd.name}, which is no tensor of graph {graph.name}"
                )
            res = whole(activations[nd.name], buffer)
        else:
            args = fx.node.map_arg(nd.args, lambda a: value(a, buffer))
            kwargs = fx.node.map_arg(nd.kwargs, lambda a: value(a, buffer))
            res = emit(nd.target, args, kwargs)
        done[nd] = res
        return res

    for name, nd in updates:
        if nd.op == "placeholder" and weights.get(nd.name) == name:
            continue  # written back unchanged
        rec = records[name]
        new = value(nd, name)
        emit(write_buffer, (attr(name), new, rec.dim, rec.start) if rec.sharded else (attr(name), new), {})
    return notes
