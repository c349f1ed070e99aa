"""Ops that act along some dims and are independent across the others: the ``dimwise``, ``scan`` and
``norm`` tables.

Algebra: softmax normalizes along one dim, a scan (cumsum/cumprod; logcumsumexp, the ``scan`` table:
transcendental, priced apart by the device model) or sort/top-k runs along one dim, flip reverses some
dims, and a layer/RMS norm takes statistics over the trailing ``normalized_shape`` (group norm: per
sample). Every *other* dim is independent, so ``G(d)`` for such a d passes through;
the acted-on dims never shard (that would need the statistics/prefix across ranks). Linear members
(cumsum, flip) also take ``R -> R``. Affine norm weight/bias stay ``I``. ``repeat_interleave`` repeats
each element in place, so it keeps contiguous slices of every dim, its own included (linear).
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
    _arg,
    _aten,
    _Cand,
    _dims,
    _f_in,
    _f_out,
    _f_scale,
    _f_zero,
    _kw,
    _ndim_dim,
    _register,
    _register_samples,
    _tin,
    _tout,
)
from .truth import sample as _t
from .truth import sample_dims as _bsh


def _gen_dimwise(
    g: Graph,
    op: Op,
    dim_arg: int = 1,
    default_dim: int = -1,
    linear: bool = False,
    extra_out_dim: bool = False,
) -> list[_Cand]:
    t = _tin(g, op, 0)
    dim = _ndim_dim(int(_arg(op, dim_arg, default_dim)), t.ndim) if dim_arg >= 0 else None
    nout = len(op.outputs)
    cands = [
        _Cand(f"shard{d}", (G(d),) + (I,) * (len(op.inputs) - 1), (G(d),) * nout)
        for d in range(t.ndim)
        if d != dim
    ]
    if linear:
        cands.append(_Cand("partial", (R,), (R,) * nout, "full"))
    return cands


_register(
    [
        "aten.softmax.int",
        "aten._softmax.default",
        "aten.log_softmax.int",
        "aten._log_softmax.default",
        "aten._safe_softmax.default",
    ],
    "dimwise",
    lambda g, op: _gen_dimwise(g, op),
    flops=_f_scale(5, _f_out),
    reason="softmax normalizes along one dim; every other dim is independent",
)
_register(
    ["aten.cumsum.default"],
    "dimwise",
    lambda g, op: _gen_dimwise(g, op, linear=True),
    reason="a prefix sum along one dim; independent across others, and linear (R -> R)",
)
_register(
    ["aten.cumprod.default", "aten.sort.default", "aten.argsort.default"],
    "dimwise",
    lambda g, op: _gen_dimwise(g, op, dim_arg=1),
    reason="a scan / sort along one dim; independent across the others",
)

#: Forward flops per element of ``logcumsumexp``: each step is ``log(e^a + e^b)``, computed stably as
#: ``max(a, b) + log1p(exp(min(a, b) - max(a, b)))``: two transcendentals at the tables' 4 flops each
#: (exp, log1p) and four simple ops (min, max, subtract, add).
LOGCUMSUMEXP_FLOPS = 2 * 4 + 4


_register(
    ["aten.logcumsumexp.default"],
    "scan",
    lambda g, op: _gen_dimwise(g, op, dim_arg=1),
    flops=_f_scale(LOGCUMSUMEXP_FLOPS, _f_out),
    reason="a running log-sum-exp along one dim (nonlinear scan); independent across the others",
)
_register(
    ["aten.topk.default"],
    "dimwise",
    lambda g, op: _gen_dimwise(g, op, dim_arg=2),
    flops=_f_scale(2, _f_in),
    reason="top-k along one dim; independent across the others",
)
_register(
    ["aten.one_hot.default"],
    "dimwise",
    lambda g, op: [_Cand(f"shard{d}", (G(d),), (G(d),)) for d in range(_tin(g, op, 0).ndim)],
    reason="one_hot adds a class dim at the end; every index dim is independent",
)


def _gen_flip(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    dims = _dims(_arg(op, 1), t.ndim)
    return [_Cand(f"shard{d}", (G(d),), (G(d),)) for d in range(t.ndim) if d not in dims] + [
        _Cand("partial", (R,), (R,), "full")
    ]


_register(
    ["aten.flip.default"],
    "dimwise",
    _gen_flip,
    flops=_f_zero,
    reason="flip reverses some dims; the others stay in place; linear",
)


# ---- norms: statistics over the trailing normalized_shape (group norm: per sample)


def _gen_norm(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    lead = t.ndim - len(op.args[1])
    rest = (I,) * (len(op.inputs) - 1)
    return [_Cand(f"shard{d}", (G(d),) + rest, (G(d),) * len(op.outputs)) for d in range(lead)]


_register(
    ["aten.layer_norm.default", "aten.rms_norm.default"],
    "norm",
    _gen_norm,
    flops=_f_scale(8, _f_in),
    reason="normalizes over the trailing dims: leading dims shard, weight/bias stay I",
)


def _gen_group_norm(g: Graph, op: Op) -> list[_Cand]:
    rest = (I,) * (len(op.inputs) - 1)
    return [_Cand("shard0", (G(0),) + rest, (G(0),))]


_register(
    ["aten.group_norm.default"],
    "norm",
    _gen_group_norm,
    flops=_f_scale(8, _f_in),
    reason="group norm statistics are per sample: the batch dim shards",
)


def _gen_sort_stable(g: Graph, op: Op) -> list[_Cand]:
    """``sort.stable``/``argsort.stable`` take ``dim`` as a keyword: every other dim shards."""
    t = _tin(g, op, 0)
    dim = _ndim_dim(int(_kw(op, "dim", -1)), t.ndim)
    nout = len(op.outputs)
    return [_Cand(f"shard{d}", (G(d),), (G(d),) * nout) for d in range(t.ndim) if d != dim]


_register(
    ["aten.sort.stable", "aten.argsort.stable"],
    "dimwise",
    _gen_sort_stable,
    reason="a (stable) sort along one dim; independent across the others",
)


def _gen_repeat_interleave(g: Graph, op: Op) -> list[_Cand]:
    """``repeat_interleave(x, r, dim)`` repeats each element ``r`` times in place: a contiguous slice of
    ANY dim (``dim`` itself included) gives a contiguous slice of the output (``r`` x as long along
    ``dim``). Without ``dim`` the input is flattened first: only its outermost dim stays sharded."""
    t = _tin(g, op, 0)
    dim = _arg(op, 2)
    dims = [0] if dim is None else list(range(t.ndim))
    return [_Cand(f"shard{d}", (G(d),), (G(0 if dim is None else d),)) for d in dims] + [
        _Cand("partial", (R,), (R,), "full")
    ]


def _local_repeat_interleave(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    """The output length along the repeated dim (keyword ``output_size``), when given, is made local."""
    f, dim, kw = s.outputs[0], _arg(op, 2), dict(op.kwargs)
    if kw.get("output_size") is not None and f.is_gather:
        out_dim = 0 if dim is None else _ndim_dim(int(dim), _tout(g, op).ndim)
        if f.dim == out_dim:
            kw["output_size"] = ctx.local(op.outputs[0], f.dim)
    return LocalCall(_aten(op.target), op.args, tuple(sorted(kw.items())))


_register(
    ["aten.repeat_interleave.self_int"],
    "dimwise",
    _gen_repeat_interleave,
    local=_local_repeat_interleave,
    flops=_f_zero,
    reason="repeating each element in place keeps contiguous slices contiguous (any dim); linear",
)


# ------------------------------------------------------------------ ground-truth sample cases


#: ``(target, build(rng) -> (args, kwargs))`` samples for the ground-truth checker.
CASES: tuple[tuple[str, Callable[[Any], tuple[tuple, dict]]], ...] = (
    ("aten.sort.stable", lambda r: ((_t(*_bsh(r)),), {"stable": True, "dim": 1})),
    ("aten.argsort.stable", lambda r: ((_t(*_bsh(r)),), {"stable": True, "dim": -1, "descending": True})),
    ("aten.argsort.default", lambda r: ((_t(*_bsh(r)), 0), {})),
    ("aten.cumsum.default", lambda r: ((_t(*_bsh(r)), -1), {})),
    ("aten.repeat_interleave.self_int", lambda r: ((_t(*_bsh(r)), 2, 1), {})),
    ("aten.repeat_interleave.self_int", lambda r: ((_t(*_bsh(r)), 3), {})),
    ("aten.repeat_interleave.self_int", lambda r: ((_t(*(s := _bsh(r))), 2, 0), {"output_size": 2 * s[0]})),
)
_register_samples(CASES)
