"""Row folds: a view that folds leading dims into one, row-wise ops, and the view that unfolds them again
(issue 18: seq-first attention keeps the batch sharded).

``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.Transformer``; seq-first, and batch-first too, which it transposes to seq-first) folds the batch into
an inner position around its output projection::

    reshape (S, B, H, d) -> (S*B, E);  linear -> (S*B, E);  view -> (S, B, E)

The view rule (:func:`hapnb.rules.views._view_pairs`) never pairs ``G(1) -> G(0)`` through the fold: a
rank's rows of the batch are strided in the merged dim, not a contiguous shard. So the batch could not stay
sharded through the projection and such models replicated it. The ops between the two views act on each
row (the last dim) alone, and a row-major reshape keeps the rows in the same order whatever the leading
dims are, so :func:`unfold_rows` gives the row-wise ops the unfolded leading dims instead::

    reshape (S, B, H, d) -> (S, B, E);  linear -> (S, B, E);  view -> (S, B, E)  (now the identity)

Every tensor holds the same elements in the same order; only the shapes of the fold's output and of the
row-wise results change (their ids, names and wiring stay), so the rewritten graph computes exactly what
the traced program computes, and the view rule offers ``G(1) -> G(1)`` all along.

A pattern is rewritten when (the tests in ``tests/tracing/test_seq_first.py``):

* the fold is a view-like op (``view``/``reshape``/``flatten``/... ) whose output ``t`` has at least two
  dims, the leading ones ``t.shape[:-1]`` the rows;
* ``t`` and every later result of the chain has exactly one consumer (so nothing else sees the folded
  shape), and is neither the loss nor a graph input;
* each op of the chain is row-wise: ``aten.linear`` on the chain tensor (weights are not), ``layer_norm`` /
  ``rms_norm`` over the last dim only, or an elementwise op (pointwise, linear, additive, multiplicative,
  select and convert families) without a dim argument whose other tensor operands broadcast along the
  rows (every dim but the last is 1) and whose result has the chain tensor's shape;
* the chain ends in a view-like op to ``L + (n,)`` with ``prod(L) == prod(t.shape[:-1])``, ``n`` the
  chain's last dim and ``L`` different from the folded rows.

The fold then reshapes to ``L + (t.shape[-1],)``, the row-wise results get the shapes ``L + (their last
dim,)``, and the unfold (a reshape to its own output shape) is the identity. A fold and unfold with
nothing in between, or a chain that reaches any other op, is left as it is. Graphs without such a pattern
(every zoo model) are returned unchanged, the same object.

>>> from hapnb.ir.graph import Graph, Op, TensorArg as A, TensorRef as T
>>> ts = (T(0, "x", (3, 2, 4), "float32", "input", None, (0,)),
...       T(1, "w", (5, 4), "float32", "param", None, (1,), True),
...       T(2, "flat", (6, 4), "float32", "activation", 0, (1,)),
...       T(3, "lin", (6, 5), "float32", "activation", 1, (2,)),
...       T(4, "out", (3, 2, 5), "float32", "activation", 2, (3,)),
...       T(5, "loss", (), "float32", "activation", 3))
>>> ops = (Op(0, "flat", "aten.reshape.default", (0,), (2,), (A(0), (6, 4))),
...        Op(1, "lin", "aten.linear.default", (2, 1), (3,), (A(0), A(1), None)),
...        Op(2, "out", "aten.view.default", (3,), (4,), (A(0), (3, 2, 5))),
...        Op(3, "loss", "aten.sum.default", (4,), (5,), (A(0),)))
>>> g = unfold_rows(Graph(ts, ops, (0,), (1,), 5))
>>> [g.tensors[t].shape for t in (2, 3, 4)], g.ops[0].args[1]
([(3, 2, 4), (3, 2, 5), (3, 2, 5)], (3, 2, 4))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..ir.graph import Graph, Op, TensorArg, TensorRef, fingerprint

__all__ = ["RowFold", "find_row_folds", "unfold_rows"]

#: view-like ops: their output is their input's elements in row-major order, whatever the arguments
VIEW_TARGETS = frozenset(
    {
        "aten.view.default",
        "aten.reshape.default",
        "aten._unsafe_view.default",
        "aten.flatten.using_ints",
        "aten.unflatten.int",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.unsqueeze.default",
    }
)
#: view-like ops whose second argument is the output shape (kept when the op is rewritten)
_SHAPE_ARG = frozenset({"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"})
#: rule families of elementwise ops (:mod:`hapnb.rules.pointwise`)
ELEMENTWISE_FAMILIES = frozenset({"pointwise", "linear", "additive", "multiplicative", "select", "convert"})
_NORMS = frozenset({"aten.layer_norm.default", "aten.rms_norm.default"})
#: schema arguments that make an elementwise op depend on dim positions (never in a chain)
_DIM_ARGS = frozenset({"dim", "dims", "dimension", "size", "shape", "normalized_shape"})


@dataclass(frozen=True)
class RowFold:
    """One rewrite: the fold op, the row-wise ops after it, the unfold op, and the leading dims ``lead``
    (the unfold's) the rows get."""

    fold: int
    chain: tuple[int, ...]
    unfold: int
    lead: tuple[int, ...]


def _has_dim_arg(target: str) -> bool:
    from ..rules.registry import _aten

    try:
        schema = _aten(target)._schema
    except KeyError:
        return True  # not an op of this process: unknown arguments
    return any(a.name in _DIM_ARGS for a in schema.arguments)


def _row_operand(shape: tuple[int, ...], rows: int) -> bool:
    """A tensor operand that broadcasts along the rows: no more dims than the chain tensor, and every
    dim but its last of size 1."""
    return len(shape) <= rows + 1 and all(s == 1 for s in shape[:-1])


def _row_wise(g: Graph, op: Op, cur: int) -> bool:
    """Whether ``op`` acts on each row (last dim) of chain tensor ``cur`` alone (see the module doc)."""
    from ..rules import family

    if len(op.outputs) != 1 or op.output_items:
        return False
    t, out = g.tensors[cur], g.tensors[op.outputs[0]]
    rows = t.ndim - 1
    if out.shape[:-1] != t.shape[:-1]:
        return False
    others = [k for k in op.inputs if k != cur]
    if op.target == "aten.linear.default":
        return op.inputs[0] == cur and cur not in op.inputs[1:] and op.args[:1] == (TensorArg(0),)
    if op.target in _NORMS:
        shape = op.args[1] if len(op.args) > 1 else ()
        return (
            op.inputs[0] == cur
            and len(tuple(shape)) == 1
            and all(_row_operand(g.tensors[k].shape, rows) for k in others)
        )
    if family(op.target) not in ELEMENTWISE_FAMILIES or _has_dim_arg(op.target):
        return False
    return out.shape == t.shape and all(_row_operand(g.tensors[k].shape, rows) for k in others)


def _single_consumer(g: Graph, tid: int) -> int | None:
    t = g.tensors[tid]
    if tid == g.loss or t.role != "activation" or len(t.consumers) != 1:
        return None
    return t.consumers[0]


def _match(g: Graph, fold: Op) -> RowFold | None:
    """The row fold that starts at ``fold``, or None."""
    if fold.target not in VIEW_TARGETS or len(fold.outputs) != 1 or len(fold.inputs) != 1:
        return None
    start = fold.outputs[0]
    rows = g.tensors[start].shape[:-1]
    if not rows:
        return None
    chain: list[int] = []
    cur = start
    while True:
        nxt = _single_consumer(g, cur)
        if nxt is None:
            return None
        op = g.ops[nxt]
        if op.target in VIEW_TARGETS:
            break
        if not _row_wise(g, op, cur):
            return None
        chain.append(op.id)
        cur = op.outputs[0]
    unfold = g.ops[nxt]
    if not chain or len(unfold.inputs) != 1 or len(unfold.outputs) != 1:
        return None
    out = g.tensors[unfold.outputs[0]].shape
    lead = tuple(out[:-1])
    if len(out) < 2 or out[-1] != g.tensors[cur].shape[-1] or lead == rows:
        return None
    if math.prod(lead) != math.prod(rows):
        return None
    return RowFold(fold.id, tuple(chain), unfold.id, lead)


def find_row_folds(g: Graph) -> tuple[RowFold, ...]:
    """Every fold / row-wise chain / unfold pattern of ``g`` that :func:`unfold_rows` rewrites."""
    found = []
    for op in g.ops:
        m = _match(g, op)
        if m is not None:
            found.append(m)
    return tuple(found)


def _as_reshape(op: Op, shape: tuple[int, ...]) -> Op:
    """``op`` (view-like, one tensor input) as a reshape to ``shape``: a view/reshape keeps its target,
    any other view-like op becomes ``aten.reshape.default`` (its origin says what it was)."""
    if op.target in _SHAPE_ARG:
        return dataclasses.replace(op, args=(TensorArg(0), shape) + tuple(op.args[2:]))
    return dataclasses.replace(
        op,
        target="aten.reshape.default",
        args=(TensorArg(0), shape),
        kwargs=(),
        origin=op.origin or op.target,
    )


def unfold_rows(g: Graph) -> Graph:
    """``g`` with every row fold (:func:`find_row_folds`) rewritten so the row-wise ops work on the
    unfolded leading dims (see the module doc); ``g`` itself when it has none. Exact: every tensor keeps
    its elements in the same order, only shapes of the fold's output and the row-wise results change."""
    from ..rules import family, flops

    folds = find_row_folds(g)
    if not folds:
        return g
    tensors: list[TensorRef] = list(g.tensors)
    ops: list[Op] = list(g.ops)

    def reshaped(tid: int, lead: tuple[int, ...]) -> tuple[int, ...]:
        shape = lead + (g.tensors[tid].shape[-1],)
        tensors[tid] = dataclasses.replace(g.tensors[tid], shape=shape)
        return shape

    for f in folds:
        fold = g.ops[f.fold]
        ops[f.fold] = _as_reshape(fold, reshaped(fold.outputs[0], f.lead))
        for k in f.chain:
            reshaped(g.ops[k].outputs[0], f.lead)
        unfold = g.ops[f.unfold]
        ops[f.unfold] = _as_reshape(unfold, g.tensors[unfold.outputs[0]].shape)
    for f in folds:
        for k in (f.fold, *f.chain, f.unfold):
            op = ops[k]
            ins = [tensors[t].shape for t in op.inputs]
            outs = [tensors[t].shape for t in op.outputs]
            try:
                fl = float(flops(op.target, ins, outs, op.args, op.kwargs))
            except Exception:  # a flop formula must never break tracing (as in the builder)
                fl = op.flops
            ops[k] = dataclasses.replace(op, flops=fl, family=family(op.target))
    return dataclasses.replace(
        g, tensors=tuple(tensors), ops=tuple(ops), fingerprint=fingerprint(tensors, ops)
    )
