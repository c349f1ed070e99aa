"""Creation ops: the ``creation`` and ``random`` tables.

Algebra: an op without tensor inputs can make the whole tensor (``I``) or only the rank's slice of
any dim (``G(d)``, built at the rank's offset). A constant shaped like its input (``ones_like``, ...)
follows the input's shards; ``new_zeros(x, size)`` & co make any slice of ``size`` (localized), with
``x`` replicated or sharded on the matching dim. Random creation is replicated only: every rank must draw the same
numbers from one seed. Flops: zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ir.forms import G, I, R
from ..ir.graph import Graph, Op
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
    _register_samples,
    _tin,
    _tout,
)
from .truth import sample as _t


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


def _gen_new(g: Graph, op: Op) -> list[_Cand]:
    """``x.new_zeros(size)`` & co: ``x`` gives only the dtype, the output's shape is ``size``. The
    output may be any slice ``G(d)`` (its size list localized): with ``x`` replicated, or with ``x``
    sharded on its dim that matches ``d`` (aligned from the right, same length), so a batch-sharded
    ``labels.new_zeros(labels.shape)`` (T5's label shift) stays sharded. Zeros also sum: ``R -> R``."""
    t, out = _tin(g, op, 0), _tout(g, op)
    off = out.ndim - t.ndim
    cands = []
    for d in range(out.ndim):
        dx = d - off
        if 0 <= dx < t.ndim and t.shape[dx] == out.shape[d]:
            cands.append(_Cand(f"follow{dx}->{d}", (G(dx),), (G(d),)))
        cands.append(_Cand(f"slice{d}", (I,), (G(d),)))
    if op.target == "aten.new_zeros.default" and _is_float(t) and _is_float(out):
        cands.append(_Cand("partial", (R,), (R,), "full"))
    return cands


def _local_new(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    f = s.outputs[0]
    if not f.is_gather:
        return _default_local(g, op, s, ctx)
    shape = _local_shape(g, op.outputs[0], f, ctx)
    return LocalCall(_aten(op.target), (op.args[0], shape, *op.args[2:]), op.kwargs)


_register(
    ["aten.ones_like.default", "aten.empty_like.default", "aten.full_like.default"],
    "creation",
    _gen_like,
    flops=_f_zero,
    reason="a constant shaped like its input: follows the input's shards",
)
_register(
    ["aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default", "aten.new_empty.default"],
    "creation",
    _gen_new,
    local=_local_new,
    flops=_f_zero,
    reason="a constant of a given size (the input gives the dtype): any slice, the size list localized",
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


# ------------------------------------------------------------------ ground-truth sample cases


def _labels(*shape: int) -> Any:
    import torch

    return torch.randint(0, 9, shape)


#: ``(target, build(rng) -> (args, kwargs))`` samples for the ground-truth checker: ``new_*`` with a
#: size list that matches the input (T5's ``labels.new_zeros(labels.shape)``) or not.
CASES: tuple[tuple[str, Callable[[Any], tuple[tuple, dict]]], ...] = (
    ("aten.new_zeros.default", lambda r: ((_labels(b := r.randint(2, 5), s := r.randint(2, 6)), [b, s]), {})),
    ("aten.new_zeros.default", lambda r: ((_t(b := r.randint(2, 5), 3), [b, r.randint(2, 5), 3]), {})),
    ("aten.new_ones.default", lambda r: ((_t(r.randint(2, 5), 3), [r.randint(2, 5), 3]), {})),
    ("aten.new_full.default", lambda r: ((_labels(b := r.randint(2, 5), 4), [b, 4], 7), {})),
    ("aten.full_like.default", lambda r: ((_labels(r.randint(2, 5), 4), -100), {})),
    ("aten.ones_like.default", lambda r: ((_t(r.randint(2, 5), 4),), {})),
)
_register_samples(CASES)
