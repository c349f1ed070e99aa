"""Reductions: the ``reduction`` table (sum, mean, max/min, var/std, norms, arg-reductions).

Algebra: a reduction over dims D keeps every other dim, so ``G(d)`` for d not in D passes through
(renumbered when ``keepdim`` is False). ``sum`` and ``mean`` are linear: over a sharded dim they give
a partial sum ``R`` (``mean`` divides by the GLOBAL element count, so the partials add up to the mean),
and ``R`` stays ``R``. Nonlinear reductions (max, min, var, logsumexp, norms, argmax, ...) need the whole
reduced dim: only kept dims shard. A fixed-range histogram (``histc``) counts, and counts of disjoint
slices add: a sharded input gives ``R`` counts. Flops: one per input element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..ir.forms import G, R
from ..ir.graph import Graph, Op
from .registry import (
    LocalCall,
    LocalContext,
    Strategy,
    _arg,
    _Cand,
    _default_local,
    _dims,
    _f_in,
    _kw,
    _numel,
    _register,
    _register_samples,
    _tin,
)
from .truth import sample as _t


def _red_dims(g: Graph, op: Op) -> tuple[tuple[int, ...], bool]:
    t = _tin(g, op, 0)
    if op.target.endswith(".default") and op.target.split(".")[1] in (
        "sum",
        "mean",
        "amax",
        "amin",
        "prod",
        "any",
        "all",
        "max",
        "min",
    ):
        if op.target.split(".")[1] in ("amax", "amin"):
            return _dims(_arg(op, 1, ()), t.ndim), bool(_arg(op, 2, False))
        return tuple(range(t.ndim)), False
    if op.target in ("aten.linalg_vector_norm.default", "aten.norm.ScalarOpt_dim"):
        return _dims(_arg(op, 2), t.ndim), bool(_arg(op, 3, False))
    if op.target.startswith(("aten.var.", "aten.std.", "aten.var_mean.", "aten.std_mean.")):
        return _dims(_arg(op, 1), t.ndim), bool(_kw(op, "keepdim", False))
    return _dims(_arg(op, 1), t.ndim), bool(_arg(op, 2, False))


def _map_kept(d: int, dims: Sequence[int], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for x in dims if x < d)


def _gen_reduce(g: Graph, op: Op, linear: bool) -> list[_Cand]:
    t = _tin(g, op, 0)
    dims, keep = _red_dims(g, op)
    cands = []
    nout = len(op.outputs)
    for d in range(t.ndim):
        if d in dims:
            if linear:
                cands.append(_Cand(f"reduce{d}", (G(d),), (R,) * nout))
        else:
            cands.append(_Cand(f"shard{d}", (G(d),), (G(_map_kept(d, dims, keep)),) * nout))
    if linear:
        cands.append(_Cand("partial", (R,), (R,) * nout, "full"))
    return cands


def _local_mean(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    f = s.inputs[0]
    dims, keep = _red_dims(g, op)
    if f.is_gather and f.dim in dims:
        t = _tin(g, op, 0)
        count = _numel([t.shape[d] for d in dims])
        dtype = _kw(op, "dtype", None)
        return LocalCall(hops.mean_partial, (op.args[0], dims, keep, count, dtype))
    return _default_local(g, op, s, ctx)


_register(
    ["aten.sum.default", "aten.sum.dim_IntList"],
    "reduction",
    lambda g, op: _gen_reduce(g, op, True),
    flops=_f_in,
    reason="sum is linear: a sum over a sharded dim is a partial sum (R)",
)
_register(
    ["aten.mean.default", "aten.mean.dim"],
    "reduction",
    lambda g, op: _gen_reduce(g, op, True),
    local=_local_mean,
    flops=_f_in,
    reason="mean = sum / static global count: over a sharded dim it is R (local sum / global count)",
)
_register(
    [
        "aten.amax.default",
        "aten.amin.default",
        "aten.max.dim",
        "aten.min.dim",
        "aten.prod.dim_int",
        "aten.any.dim",
        "aten.all.dim",
        "aten.var.correction",
        "aten.std.correction",
        "aten.var.dim",
        "aten.std.dim",
        "aten.logsumexp.default",
        "aten.var_mean.correction",
        "aten.std_mean.correction",
        "aten.norm.ScalarOpt_dim",
        "aten.linalg_vector_norm.default",
        "aten.argmax.default",
        "aten.argmin.default",
    ],
    "reduction",
    lambda g, op: _gen_reduce(g, op, False),
    flops=_f_in,
    reason="nonlinear reduction: only dims that are not reduced may be sharded",
)


def _gen_histc(g: Graph, op: Op) -> list[_Cand]:
    """``histc(x, bins, min, max)`` with a FIXED range (``min < max``): a histogram counts elements,
    and counts over disjoint slices add, so an input sharded on ANY dim gives partial counts ``R``.
    With ``min == max`` the range comes from the data's own min/max (different on every shard):
    replicated only."""
    t = _tin(g, op, 0)
    lo, hi = float(_arg(op, 2, 0) or 0), float(_arg(op, 3, 0) or 0)
    if not lo < hi:
        return []
    return [_Cand(f"count{d}", (G(d),), (R,)) for d in range(t.ndim)]


_register(
    ["aten.histc.default"],
    "reduction",
    _gen_histc,
    flops=_f_in,
    reason="a fixed-range histogram: counts of disjoint slices add (sharded input -> R counts)",
)


# ------------------------------------------------------------------ ground-truth sample cases


#: ``(target, build(rng) -> (args, kwargs))`` samples for the ground-truth checker.
CASES: tuple[tuple[str, Callable[[Any], tuple[tuple, dict]]], ...] = (
    ("aten.histc.default", lambda r: ((_t(r.randint(2, 6), r.randint(2, 5)), 5, -1.0, 1.0), {})),
    ("aten.histc.default", lambda r: ((_t(r.randint(2, 9)), 4, -2.0, 0.5), {})),
    ("aten.histc.default", lambda r: ((_t(r.randint(2, 9)), 4), {})),  # data-derived range: replicated
    (
        "aten.var_mean.correction",
        lambda r: ((_t(*[r.randint(2, 5) for _ in range(3)]), [2]), {"correction": 1}),
    ),
    (
        "aten.var.correction",
        lambda r: ((_t(*[r.randint(2, 5) for _ in range(3)]), [0, 2]), {"keepdim": True}),
    ),
)
_register_samples(CASES)
