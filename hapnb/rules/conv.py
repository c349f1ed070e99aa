"""Convolution, pooling and resampling: the ``conv`` and ``pool`` tables.

Algebra: a convolution is a contraction over in-channels and the kernel window: the batch dim shards
(``G0``), out-channels shard with the weight's dim 0 (``G1``), in-channels shard with the weight's dim 1
and give a partial sum (``R``); a transposed convolution (``aten.convolution`` with ``transposed``, what
``ConvTranspose1d/2d/3d`` trace to, as ``Conv3d`` does) the same with its weight's ``(in, out / groups)``
layout; a partial input with a replicated weight stays ``R``. Pooling acts on
the spatial dims only, so batch and channel dims shard, and average pooling is linear (``R -> R``).
Resampling (``F.interpolate``: nearest, linear, bilinear, bicubic, trilinear) is a fixed linear map of each
(batch, channel) plane, so batch and channels shard and ``R -> R``. Spatial dims are never sharded, so
padding needs no halo exchange. Conv flops:
``2*N*Cout*Ho*Wo*(Cin/groups)*kh*kw`` (+ one per output element for a bias).
"""

from __future__ import annotations

from ..ir.forms import G, I, R
from ..ir.graph import Graph, Op
from .registry import (
    LocalCall,
    LocalContext,
    Strategy,
    _arg,
    _aten,
    _Cand,
    _default_local,
    _f_in,
    _f_out,
    _numel,
    _register,
    _tin,
)


def _gen_conv(g: Graph, op: Op) -> list[_Cand]:
    x, w = _tin(g, op, 0), _tin(g, op, 1)
    has_b = len(op.inputs) == 3
    groups = int(_arg(op, 6, 1))
    batched = x.ndim == w.ndim
    cands = []
    if batched:
        cands.append(_Cand("batch", (G(0), I) + ((I,) if has_b else ()), (G(0),)))
    ch = 1 if batched else 0
    if groups == 1:
        cands.append(_Cand("out_channel", (I, G(0)) + ((G(0),) if has_b else ()), (G(ch),)))
        cands.append(_Cand("in_channel", (G(ch), G(1)) + ((I,) if has_b else ()), (R,)))
    cands.append(_Cand("partial", (R, I) + ((I,) if has_b else ()), (R,), "full"))
    return cands


def _local_conv(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if _has_empty_shard(op, s, ctx):
        return LocalCall(hops.conv_local, (*op.args[:7], ctx.rank == 0))
    if s.outputs[0].is_reduce and len(op.inputs) == 3:
        return LocalCall(hops.conv_partial, (*op.args[:7], ctx.rank == 0))
    return _default_local(g, op, s, ctx)


def _gen_convolution(g: Graph, op: Op) -> list[_Cand]:
    """``aten.convolution`` (what ``ConvTranspose1d/2d/3d`` and ``Conv3d`` trace to): the conv algebra with
    the transposed weight's layout ``(in, out / groups, *kernel)``; batched inputs only."""
    x, w = _tin(g, op, 0), _tin(g, op, 1)
    if x.ndim != w.ndim:
        return []
    has_b = len(op.inputs) == 3
    transposed, groups = bool(_arg(op, 6, False)), int(_arg(op, 8, 1))
    cin, cout = (0, 1) if transposed else (1, 0)  # the weight's dims of input and output channels
    bias = (I,) if has_b else ()
    cands = [_Cand("batch", (G(0), I, *bias), (G(0),))]
    if groups == 1:
        cands.append(_Cand("out_channel", (I, G(cout)) + ((G(0),) if has_b else ()), (G(1),)))
        cands.append(_Cand("in_channel", (G(1), G(cin), *bias), (R,)))
    cands.append(_Cand("partial", (R, I, *bias), (R,), "full"))
    return cands


def _local_convolution(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    with_bias = not s.outputs[0].is_reduce or ctx.rank == 0
    return LocalCall(hops.convolution_local, (*op.args[:9], with_bias))


def _f_convolution(ins: list, outs: list, args: tuple, kw: dict) -> float:
    """A transposed convolution scatters each input element over ``out / groups`` channels and the kernel."""
    if not (len(args) > 6 and args[6]):
        return _f_conv(ins, outs, args, kw)
    x, w, out = ins[0], ins[1], outs[0]
    return float(2 * _numel(x) * w[1] * _numel(w[2:]) + (_numel(out) if len(ins) == 3 else 0))


def _has_empty_shard(op: Op, s: Strategy, ctx: LocalContext) -> bool:
    """Whether this rank's shard of some G-form tensor of the op is empty."""
    return any(
        f.is_gather and ctx.local(t, f.dim) == 0 for t, f in zip(op.inputs + op.outputs, s.inputs + s.outputs)
    )


def _local_pool(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if _has_empty_shard(op, s, ctx):
        return LocalCall(hops.pool_local, (_aten(op.target), *op.args), op.kwargs)
    return _default_local(g, op, s, ctx)


def _f_conv(ins: list, outs: list, args: tuple, kw: dict) -> float:
    w, out = ins[1], outs[0]
    per_out = w[1] * _numel(w[2:])  # (Cin / groups) * kernel
    return float(2 * _numel(out) * per_out + (_numel(out) if len(ins) == 3 else 0))


_register(
    ["aten.conv2d.default", "aten.conv1d.default"],
    "conv",
    _gen_conv,
    local=_local_conv,
    flops=_f_conv,
    reason="conv is a contraction over in-channels: batch -> G0, out-channel -> G1, in-channel -> R "
    "(spatial dims are never sharded, so padding needs no halo)",
)


_register(
    ["aten.convolution.default"],
    "conv",
    _gen_convolution,
    local=_local_convolution,
    flops=_f_convolution,
    reason="convolution or transposed convolution (1-3d): batch -> G0, out-channel -> G1, in-channel -> R",
)


# ---- pooling: spatial only; average pooling is linear


def _spatial(target: str) -> int:
    """How many trailing spatial dims a pooling or resampling op acts on (its name says: 1d, 2d, 3d)."""
    return 1 if "1d" in target else 3 if "3d" in target else 2


def _gen_pool(g: Graph, op: Op, linear: bool) -> list[_Cand]:
    x = _tin(g, op, 0)
    lead = x.ndim - _spatial(op.target)  # spatial dims are never sharded
    nout = len(op.outputs)
    cands = [_Cand(f"shard{d}", (G(d),), (G(d),) * nout) for d in range(lead)]
    if linear:
        cands.append(_Cand("partial", (R,), (R,), "full"))
    return cands


_register(
    [
        "aten.max_pool2d.default",
        "aten.max_pool2d_with_indices.default",
        "aten.max_pool1d.default",
        "aten.max_pool3d.default",
        "aten.max_pool3d_with_indices.default",
        "aten.adaptive_max_pool1d.default",
        "aten.adaptive_max_pool2d.default",
        "aten.adaptive_max_pool3d.default",
    ],
    "pool",
    lambda g, op: _gen_pool(g, op, False),
    local=_local_pool,
    flops=_f_in,
    reason="pooling acts on the spatial dims: batch and channel shard",
)
_register(
    [
        "aten.adaptive_avg_pool2d.default",
        "aten.avg_pool2d.default",
        "aten.adaptive_avg_pool1d.default",
        "aten.avg_pool1d.default",
        "aten.adaptive_avg_pool3d.default",
        "aten.avg_pool3d.default",
    ],
    "pool",
    lambda g, op: _gen_pool(g, op, True),
    local=_local_pool,
    flops=_f_in,
    reason="average pooling is linear and spatial: batch/channel shard, R -> R",
)


#: resampling ops (``F.interpolate``'s modes), each with its ``.vec`` (scale factors) form
RESAMPLE = tuple(
    f"aten.{name}.{overload}"
    for name in (
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    )
    for overload in ("default", "vec")
)  # fmt: skip
_register(
    list(RESAMPLE),
    "pool",
    lambda g, op: _gen_pool(g, op, True),
    local=_local_pool,
    flops=_f_out,
    reason="resampling maps each (batch, channel) plane linearly: batch/channel shard, R -> R",
)
