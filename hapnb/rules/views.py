"""Views and data movement: the ``view`` table (view/reshape, transpose/permute, expand, select/slice/
split, cat/stack, pad, repeat, triu/tril).

Algebra: these ops move elements without combining them, so they are all linear (``R -> R``) and a
sharded dim stays sharded wherever the op carries it. A view regroups contiguous dims: the outermost
non-1 dims of a regrouped block map onto each other (a contiguous chunk of the block), so
``G(d_in) -> G(d_out)`` for them and for untouched dims. A permutation moves the sharded dim with it;
indexing/concatenating/padding along a dim leaves the other dims sharded; triu/tril shift their
diagonal by the shard's offset. Localized views rewrite their shape arguments to the LOCAL sizes.
Flops: zero, except triu/tril (one per element).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..forms import G, I, R
from ..graph import Graph, Op
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
    _tin,
    _tout,
)


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
    a, b = _tin(g, op, 0).shape, _tout(g, op).shape
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
    t, out = _tin(g, op, 0), _tout(g, op)
    off = out.ndim - t.ndim
    cands = [
        _Cand(f"shard{d}", (G(d),), (G(d + off),)) for d in range(t.ndim) if t.shape[d] == out.shape[d + off]
    ]
    return cands + [_Cand("partial", (R,), (R,), "full")]


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
