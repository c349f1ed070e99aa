"""Creation ops: the ``creation`` and ``random`` tables.

Algebra: an op without tensor inputs can make the whole tensor (``I``) or only the rank's slice of
any dim (``G(d)``, built at the rank's offset). A constant shaped like its input (``ones_like``, ...)
follows the input's shards. Random creation is replicated only: every rank must draw the same
numbers from one seed. Flops: zero.
"""

from __future__ import annotations

from ..forms import G, R
from ..graph import Graph, Op
from .registry import (
    LocalCall,
    LocalContext,
    Strategy,
    _aten,
    _Cand,
    _default_local,
    _f_zero,
    _is_float,
    _local_shape,
    _register,
    _tin,
    _tout,
)


def _gen_create(g: Graph, op: Op) -> list[_Cand]:
    out = _tout(g, op)
    return [_Cand(f"slice{d}", (), (G(d),)) for d in range(out.ndim)]


def _local_create(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    f = s.outputs[0]
    if not f.is_gather:
        return _default_local(g, op, s, ctx)
    tid = op.outputs[0]
    if op.target in (
        "aten.zeros.default",
        "aten.ones.default",
        "aten.empty.memory_format",
        "aten.full.default",
    ):
        shape = _local_shape(g, tid, f, ctx)
        return LocalCall(_aten(op.target), (shape, *op.args[1:]), op.kwargs)
    return LocalCall(
        hops.created_slice,
        (op.target, op.args, op.kwargs, f.dim, ctx.offset(tid, f.dim), ctx.local(tid, f.dim)),
    )


def _gen_like(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    cands = [_Cand(f"shard{d}", (G(d),), (G(d),)) for d in range(t.ndim)]
    if op.target in ("aten.zeros_like.default",) and _is_float(t):
        cands.append(_Cand("partial", (R,), (R,), "full"))
    return cands


_register(
    [
        "aten.arange.default",
        "aten.arange.start",
        "aten.arange.start_step",
        "aten.zeros.default",
        "aten.ones.default",
        "aten.full.default",
        "aten.empty.memory_format",
        "aten.scalar_tensor.default",
        "aten.eye.default",
        "aten.linspace.default",
    ],
    "creation",
    _gen_create,
    local=_local_create,
    flops=_f_zero,
    reason="no tensor inputs: create the full tensor (I) or only the local slice (G)",
)
_register(
    [
        "aten.ones_like.default",
        "aten.empty_like.default",
        "aten.full_like.default",
        "aten.new_zeros.default",
        "aten.new_ones.default",
        "aten.new_full.default",
        "aten.new_empty.default",
    ],
    "creation",
    lambda g, op: _gen_like(g, op) if op.target.endswith("_like.default") else [],
    flops=_f_zero,
    reason="a constant shaped like its input: follows the input's shards",
)
_register(
    [
        "aten.rand.default",
        "aten.randn.default",
        "aten.randint.default",
        "aten.randint.low",
        "aten.rand_like.default",
        "aten.randn_like.default",
        "aten.randperm.default",
        "aten.bernoulli.default",
        "aten.bernoulli.p",
    ],
    "random",
    lambda g, op: [],
    flops=_f_zero,
    reason="random creation: replicated only (every rank must draw the same numbers from one seed)",
)
