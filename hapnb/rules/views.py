"""Views and data movement: the ``view`` table (view/reshape, transpose/permute, expand, select/slice/
split, cat/stack, pad, repeat, triu/tril, slice/select scatter, roll).

Algebra: these ops move elements without combining them, so they are all linear (``R -> R``) and a
sharded dim stays sharded wherever the op carries it. A view regroups contiguous dims: the outermost
non-1 dims of a regrouped block map onto each other (a contiguous chunk of the block), so
``G(d_in) -> G(d_out)`` for them and for untouched dims (a dim inside a block, like the batch folded
into ``(S, B, E) -> (S*B, E)``, is strided there and never offered; where only row-wise ops sit between
such a fold and the view that unfolds it, as around seq-first attention's output projection, tracing
removes the fold instead: :mod:`hapnb.tracing.folds`). A permutation moves the sharded dim with it;
indexing/concatenating/padding along a dim leaves the other dims sharded; triu/tril shift their
diagonal by the shard's offset. Localized views rewrite their shape arguments to the LOCAL sizes.
Flops: zero, except triu/tril (one per element).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    _f_zero,
    _is_float,
    _local_shape,
    _ndim_dim,
    _numel,
    _register,
    _register_samples,
    _tin,
    _tout,
)
from .truth import sample as _t
from .truth import sample_dims as _bsh


def _view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = 1
        if i < len(a):
            gi.append(i)
            pa = a[i]
            i += 1
        if j < len(b):
            gj.append(j)
            pb = b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                break
        # trailing size-1 dims join the current group
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            gi.append(i)
            i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _view_pairs(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """The (input dim, output dim) pairs of a view ``a -> b`` whose shard stays contiguous.

    The view is cut into blocks of equal products (:func:`_view_groups`: input dims ``gi`` regroup into
    output dims ``gj``). Within a block, a dim's rank-order slices stay contiguous slices of the other
    side exactly when it is the block's OUTERMOST non-1 dim on both sides: every dim before it in the
    block has size 1 (input and output), so a contiguous range of it is a contiguous range of the
    block's flat elements. With ``a0``/``b0`` those outer dims and ``N`` the block's size, the theory's
    class base is ``base = gcd(a0, b0, ...)`` and rank j holds ``(a0/base)·l_j`` input rows and
    ``(b0/base)·l_j`` output rows, both ``N·l_j/base`` elements starting at the same flat offset. So
    merges ``(a, b) -> a·b`` (``a`` sharded: local rows = b·local a), leading size-1 dims
    ``(1, B, S) -> B·S``, splits ``a·b -> (a, b)`` (the class lengths are multiples of ``b`` because
    ``base`` divides ``a``), ``(B, S, H, d) -> (B, S, H·d)`` with B or H sharded, and
    ``(B·H, S, d) <-> (B, H, S, d)`` with B sharded (or H when B == 1) are all offered.

    A dim INSIDE a block (after a non-1 dim) is never paired: folding the batch into an inner
    position, ``(S, B, E) -> (S·B, E)`` with B sharded (seq-first attention), gives each rank a
    strided set of rows of the merged dim, not a contiguous shard, so offering ``G(1) -> G(0)`` there
    would be unsound. Only ``S`` (the outer dim) can stay sharded through that view. Seq-first attention
    (``nn.MultiheadAttention``) folds so only around its output projection, a row-wise op followed by the
    view back to ``(S, B, E)``: tracing rewrites that pattern so the projection works on ``(S, B, E)``
    (:func:`hapnb.tracing.folds.unfold_rows`), and the batch stays sharded without this rule pairing it.

    >>> _view_pairs((4, 3, 5), (12, 5)), _view_pairs((3, 2, 5), (6, 5)), _view_pairs((1, 4, 3), (12,))
    ([(0, 0), (2, 1)], [(0, 0), (2, 1)], [(1, 0)])
    >>> _view_pairs((6, 3, 5), (2, 3, 3, 5)), _view_pairs((1, 3, 4, 5), (3, 4, 5))
    ([(0, 0), (1, 2), (2, 3)], [(1, 0), (2, 1), (3, 2)])
    """
    if _numel(a) != _numel(b):
        return []
    pairs = []
    for gi, gj in _view_groups(a, b):
        ia = [d for d in gi if a[d] != 1]
        jb = [d for d in gj if b[d] != 1]
        if ia and jb and a[ia[0]] >= 2 and b[jb[0]] >= 2:
            pairs.append((ia[0], jb[0]))
    return pairs


def _gen_view(g: Graph, op: Op) -> list[_Cand]:
    """``G(i) -> G(j)`` for every contiguous pair of :func:`_view_pairs`, and ``R -> R`` (a view is
    linear). ``view_as``/``reshape_as`` take a second tensor only for its shape: it follows the
    output (``G(j)``, or ``I`` with an ``R`` input)."""
    a, b = _tin(g, op, 0).shape, _tout(g, op).shape
    if len(op.inputs) == 2:
        cands = [_Cand(f"shard{i}->{j}", (G(i), G(j)), (G(j),)) for i, j in _view_pairs(a, b)]
        return cands + [_Cand("partial", (R, I), (R,), "full")]
    cands = [_Cand(f"shard{i}->{j}", (G(i),), (G(j),)) for i, j in _view_pairs(a, b)]
    return cands + [_Cand("partial", (R,), (R,), "full")]


def _local_view(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import torch

    shape = _local_shape(g, op.outputs[0], s.outputs[0], ctx)
    return LocalCall(torch.ops.aten.reshape.default, (op.args[0], shape))


_register(
    [
        "aten.view.default",
        "aten.reshape.default",
        "aten._unsafe_view.default",
        "aten.flatten.using_ints",
        "aten.unflatten.int",
        "aten.view_as.default",
        "aten.reshape_as.default",
        "aten.squeeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.unsqueeze.default",
    ],
    "view",
    _gen_view,
    local=_local_view,
    flops=_f_zero,
    reason="a view regroups contiguous dims: the outer dim of a regrouped block can stay sharded",
)


def _gen_transpose(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    nd = t.ndim
    if op.target == "aten.permute.default":
        perm = [_ndim_dim(d, nd) for d in op.args[1]]
    else:
        perm = list(range(nd))
        if op.target != "aten.t.default" or nd == 2:
            d0, d1 = (
                (0, 1)
                if op.target == "aten.t.default"
                else (_ndim_dim(op.args[1], nd), _ndim_dim(op.args[2], nd))
            )
            perm[d0], perm[d1] = perm[d1], perm[d0]
    cands = [_Cand(f"shard{perm[j]}->{j}", (G(perm[j]),), (G(j),)) for j in range(nd)]
    return cands + [_Cand("partial", (R,), (R,), "full")]


_register(
    ["aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.swapaxes.default"],
    "view",
    _gen_transpose,
    flops=_f_zero,
    reason="a permutation of dims moves the sharded dim with it; linear",
)


def _gen_expand(g: Graph, op: Op) -> list[_Cand]:
    """Kept (not expanded) dims shard; ``expand_as``'s second tensor gives only the shape and follows
    the output."""
    t, out = _tin(g, op, 0), _tout(g, op)
    off = out.ndim - t.ndim
    other = len(op.inputs) == 2
    cands = [
        _Cand(f"shard{d}", (G(d), G(d + off)) if other else (G(d),), (G(d + off),))
        for d in range(t.ndim)
        if t.shape[d] == out.shape[d + off]
    ]
    return cands + [_Cand("partial", (R, I) if other else (R,), (R,), "full")]


def _local_expand(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    shape = _local_shape(g, op.outputs[0], s.outputs[0], ctx)
    return LocalCall(_aten("aten.expand.default"), (op.args[0], shape))


_register(
    ["aten.expand.default", "aten.expand_as.default", "aten.broadcast_to.default"],
    "view",
    _gen_expand,
    local=_local_expand,
    flops=_f_zero,
    reason="expand repeats size-1 dims; kept dims stay sharded; linear",
)


def _gen_select_slice(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    dim_pos = (
        2
        if op.target.split(".")[1] in ("split", "split_with_sizes", "chunk", "unsafe_split", "tensor_split")
        else 1
    )
    dim = _ndim_dim(int(_arg(op, dim_pos, 0)), t.ndim)
    drop = op.target.startswith(("aten.select.", "aten.unbind."))
    nout = len(op.outputs)
    cands = []
    for d in range(t.ndim):
        if d == dim:
            continue
        od = d - 1 if drop and d > dim else d
        cands.append(_Cand(f"shard{d}", (G(d),) + (I,) * (len(op.inputs) - 1), (G(od),) * nout))
    if _is_float(t):
        cands.append(_Cand("partial", (R,) + (I,) * (len(op.inputs) - 1), (R,) * nout, "full"))
    return cands


_register(
    [
        "aten.select.int",
        "aten.slice.Tensor",
        "aten.narrow.default",
        "aten.split.Tensor",
        "aten.split_with_sizes.default",
        "aten.chunk.default",
        "aten.unbind.int",
        "aten.unsafe_split.Tensor",
        "aten.split.sizes",
        "aten.tensor_split.sections",
        "aten.index_select.default",
    ],
    "view",
    _gen_select_slice,
    flops=_f_zero,
    reason="indexing along one dim: every other dim stays sharded; linear",
)


def _gen_cat(g: Graph, op: Op) -> list[_Cand]:
    out = _tout(g, op)
    n = len(op.inputs)
    ins = [g.tensors[t] for t in op.inputs]
    dim_arg = int(_arg(op, 1, 0))
    stack = op.target.startswith("aten.stack")
    dim = _ndim_dim(dim_arg, out.ndim if stack else ins[0].ndim)
    cands = []
    for d in range(ins[0].ndim):
        if not stack and d == dim:
            continue
        if any(t.ndim != ins[0].ndim or t.shape[d] != ins[0].shape[d] for t in ins):
            continue
        od = d + 1 if stack and d >= dim else d
        cands.append(_Cand(f"shard{d}", (G(d),) * n, (G(od),)))
    if all(_is_float(t) for t in ins):
        cands.append(_Cand("partial", (R,) * n, (R,), "full"))
    return cands


_register(
    ["aten.cat.default", "aten.stack.default", "aten.concat.default"],
    "view",
    _gen_cat,
    flops=_f_zero,
    reason="concatenation along one dim: the other dims stay sharded; linear",
)


def _gen_pad(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    pad = list(op.args[1])
    padded = {t.ndim - 1 - k // 2 for k in range(len(pad)) if pad[k] != 0}
    cands = [_Cand(f"shard{d}", (G(d),), (G(d),)) for d in range(t.ndim) if d not in padded]
    if float(_arg(op, 2, 0) or 0) == 0:
        cands.append(_Cand("partial", (R,), (R,), "full"))
    return cands


_register(
    ["aten.constant_pad_nd.default"],
    "view",
    _gen_pad,
    flops=_f_zero,
    reason="padding some dims leaves the others sliceable; zero padding is linear",
)


def _gen_repeat(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    reps = list(op.args[1])
    off = len(reps) - t.ndim
    return [_Cand(f"shard{d}", (G(d),), (G(d + off),)) for d in range(t.ndim) if reps[d + off] == 1] + [
        _Cand("partial", (R,), (R,), "full")
    ]


_register(
    ["aten.repeat.default"],
    "view",
    _gen_repeat,
    flops=_f_zero,
    reason="dims repeated once keep their shards; linear",
)


def _gen_tri(g: Graph, op: Op) -> list[_Cand]:
    t = _tin(g, op, 0)
    return [_Cand(f"shard{d}", (G(d),), (G(d),)) for d in range(t.ndim)] + [
        _Cand("partial", (R,), (R,), "full")
    ]


def _local_tri(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    t = _tin(g, op, 0)
    f = s.inputs[0]
    diag = int(_arg(op, 1, 0))
    if f.is_gather and f.dim == t.ndim - 2:  # rows start at the offset: keep j - i >= k
        diag += ctx.offset(op.inputs[0], f.dim)
    elif f.is_gather and f.dim == t.ndim - 1:
        diag -= ctx.offset(op.inputs[0], f.dim)
    return LocalCall(_aten(op.target), (op.args[0], diag), op.kwargs)


_register(
    ["aten.triu.default", "aten.tril.default"],
    "view",
    _gen_tri,
    local=_local_tri,
    reason="triu/tril keep j - i >= k: a row/column shard shifts the diagonal by its offset",
)


def _gen_scatter_view(g: Graph, op: Op) -> list[_Cand]:
    """``slice_scatter(self, src, dim, ...)``/``select_scatter(self, src, dim, index)``: every dim but
    ``dim`` shards in ``self``, ``src`` and the output together (``select_scatter``'s ``src`` lacks
    ``dim``); writing a slice is linear in (self, src) jointly, so ``(R, R) -> R``."""
    t = _tin(g, op, 0)
    dim = _ndim_dim(int(_arg(op, 2, 0)), t.ndim)
    drop = op.target.startswith("aten.select_scatter")
    cands = [
        _Cand(f"shard{d}", (G(d), G(d - 1 if drop and d > dim else d)), (G(d),))
        for d in range(t.ndim)
        if d != dim
    ]
    if _is_float(t) and _is_float(_tin(g, op, 1)):
        cands.append(_Cand("partial", (R, R), (R,), "full"))
    return cands


_register(
    ["aten.slice_scatter.default", "aten.select_scatter.default"],
    "view",
    _gen_scatter_view,
    flops=_f_zero,
    reason="writing a slice along one dim: the other dims of self, src and output shard together; linear",
)


def _gen_roll(g: Graph, op: Op) -> list[_Cand]:
    """Dims that are not rolled keep their shards (no dims: a roll of the flattened tensor, none)."""
    t = _tin(g, op, 0)
    rolled = [_ndim_dim(int(d), t.ndim) for d in (_arg(op, 2, ()) or ())]
    if not rolled:
        return [_Cand("partial", (R,), (R,), "full")]
    return [_Cand(f"shard{d}", (G(d),), (G(d),)) for d in range(t.ndim) if d not in rolled] + [
        _Cand("partial", (R,), (R,), "full")
    ]


_register(
    ["aten.roll.default"],
    "view",
    _gen_roll,
    flops=_f_zero,
    reason="a roll moves elements along its dims only: the other dims stay sharded; linear",
)


# ------------------------------------------------------------------ ground-truth sample cases


#: ``(target, build(rng) -> (args, kwargs))`` samples for the ground-truth checker: merges and splits
#: that keep a shard contiguous (leading size-1 dims, ``(B, S, H, d) <-> (B, S, H·d)``,
#: ``(B·H, S, d) <-> (B, H, S, d)``), the seq-first fold (where only the outer dim may shard), the
#: two-tensor ``*_as`` forms, slice/select scatter and roll.
CASES: tuple[tuple[str, Callable[[Any], tuple[tuple, dict]]], ...] = (
    ("aten.view.default", lambda r: ((_t(1, b := r.randint(2, 5), s := r.randint(2, 5)), [b * s]), {})),
    ("aten.view.default", lambda r: ((_t(*(s := _bsh(r)), 3), [s[0], s[1], s[2] * 3]), {})),
    ("aten.view.default", lambda r: ((_t(*(s := _bsh(r)), 3), [s[0] * s[1], s[2] * 3]), {})),
    ("aten.view.default", lambda r: ((_t((s := _bsh(r))[0], s[1], s[2] * 2), [*s, 2]), {})),
    ("aten.view.default", lambda r: ((_t((s := _bsh(r))[0] * s[1], s[2], 3), [*s, 3]), {})),
    ("aten.view.default", lambda r: ((_t(*(s := _bsh(r)), 3), [s[0] * s[1], s[2], 3]), {})),
    ("aten.view.default", lambda r: ((_t(1, *(s := _bsh(r))), [s[0] * s[1], s[2]]), {})),
    ("aten.view.default", lambda r: ((_t(s := r.randint(2, 5), b := r.randint(2, 5), 3), [s * b, 3]), {})),
    ("aten.view.default", lambda r: ((_t(r.choice((4, 6)), 6), [6, -1]), {})),
    ("aten._unsafe_view.default", lambda r: ((_t(*(s := _bsh(r))), [s[0] * s[1], s[2]]), {})),
    ("aten.reshape.default", lambda r: ((_t(*(s := _bsh(r)), 2), [s[0], -1, 2]), {})),
    ("aten.flatten.using_ints", lambda r: ((_t(1, *_bsh(r)), 0, 2), {})),
    ("aten.unflatten.int", lambda r: ((_t((s := _bsh(r))[0] * s[1], s[2]), 0, [s[0], s[1]]), {})),
    ("aten.squeeze.dims", lambda r: ((_t((s := _bsh(r))[0], 1, s[1], 1), [1, 3]), {})),
    ("aten.view_as.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[0] * s[1], s[2])), {})),
    ("aten.reshape_as.default", lambda r: ((_t((s := _bsh(r))[0] * s[1], s[2]), _t(*s)), {})),
    ("aten.expand_as.default", lambda r: ((_t((s := _bsh(r))[0], 1, s[2]), _t(*s)), {})),
    ("aten.expand.default", lambda r: ((_t((s := _bsh(r))[0], 1, s[2]), [2, s[0], -1, s[2]]), {})),
    ("aten.slice_scatter.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[0], 1, s[2]), 1, 1, 2), {})),
    ("aten.slice_scatter.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[0], s[1], 1), -1, 0, 1), {})),
    ("aten.select_scatter.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[0], s[2]), 1, 1), {})),
    ("aten.roll.default", lambda r: ((_t(*_bsh(r)), [1], [1]), {})),
    ("aten.roll.default", lambda r: ((_t(*_bsh(r)), [1, -2], [0, 2]), {})),
)
_register_samples(CASES)
