"""Elementwise ops: the pointwise, linear, additive, multiplicative, select and convert tables.

Algebra: an elementwise op commutes with slicing. For every output dim d, an operand that has d
(aligned from the right) with the full size is ``G(d)``; a size-1 or missing (broadcast) dim of an
operand stays ``I``. Which ops also commute with the rank *sum* (take ``R``) is what separates the
tables:

* ``pointwise`` -- nonlinear unary/binary/ternary ops (relu, exp, comparisons, ``pow``, bitwise and
  logical ops, ``maximum``, floor division, ``addcmul``/``addcdiv``/``lerp``, ...): slicing only.
  ~1 flop per output element, ~4 for transcendental ones (exp/log/erf/pow, ...), 2 for dropout, 3
  for the ternary ones. Integer and bool results are never ``R``.
* ``linear`` -- identity-like and negation (clone, detach, ``neg``, ``positive``): ``R -> R`` too.
* ``additive`` -- ``add``/``sub``/``rsub``: a sum of partials is a partial; an ``I`` operand or a
  scalar is added on rank 0 only.
* ``multiplicative`` -- ``mul``/``div``: bilinear, so ``R`` times ``I`` (or a scalar) stays ``R``.
* ``select`` -- ``where``/``masked_fill``: with an ``I`` condition, linear in the values.
* ``convert`` -- dtype casts: elementwise; float -> float is linear.

Every op target has exactly one table: ``neg``/``positive`` are linear (not plain pointwise),
``div.Tensor``/``div.Scalar`` multiplicative and ``rsub.Scalar`` additive, while the overloads without
that algebra (``div.Tensor_mode``, ``rsub.Tensor``) stay pointwise; every ``pow`` overload is a
transcendental pointwise op (~4 flops per element).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..ir.forms import G, I, R
from ..ir.graph import Graph, Op, TensorArg
from .registry import (
    LocalCall,
    LocalContext,
    Strategy,
    _Cand,
    _default_local,
    _f_out,
    _f_scale,
    _f_zero,
    _is_float,
    _kw,
    _register,
    _register_samples,
    _tin,
    _tout,
)
from .truth import sample as _t
from .truth import sample_dims as _bsh


def _broadcast_cands(g: Graph, op: Op, skip: Sequence[int] = ()) -> list[_Cand]:
    out = _tout(g, op)
    nd = out.ndim
    cands = []
    for d in range(nd):
        if out.shape[d] < 2:
            continue
        ins = []
        for k, tid in enumerate(op.inputs):
            t = g.tensors[tid]
            dk = d - (nd - t.ndim)
            ins.append(G(dk) if k not in skip and dk >= 0 and t.shape[dk] == out.shape[d] else I)
        outs = tuple(
            G(d) if len(o_shape := g.tensors[o].shape) == nd and o_shape[d] == out.shape[d] else I
            for o in op.outputs
        )
        cands.append(_Cand(f"shard{d}", tuple(ins), outs))
    return cands


def _gen_pointwise(g: Graph, op: Op) -> list[_Cand]:
    return _broadcast_cands(g, op)


def _gen_linear_unary(g: Graph, op: Op) -> list[_Cand]:
    cands = _broadcast_cands(g, op)
    if len(op.inputs) == 1:
        cands.append(_Cand("partial", (R,), (R,) * len(op.outputs), "full"))
    return cands


def _gen_add(g: Graph, op: Op) -> list[_Cand]:
    cands = _broadcast_cands(g, op)
    n = len(op.inputs)
    if n == 2:
        cands.append(_Cand("partial", (R, R), (R,), "full"))
        cands.append(_Cand("partial+rep", (R, I), (R,), "full"))
        cands.append(_Cand("rep+partial", (I, R), (R,), "full"))
    elif n == 1:  # add.Tensor(x, scalar) or add.Tensor(scalar, x)
        cands.append(_Cand("partial", (R,), (R,), "full"))
    return cands


def _local_add(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    ins = s.inputs
    sub = op.target.startswith("aten.sub")
    alpha = _kw(op, "alpha", 1)
    if any(f.is_reduce for f in ins) and ctx.rank != 0:
        a, b = op.args[0], op.args[1]
        keep_a = isinstance(a, TensorArg) and ins[a.index].is_reduce
        keep_b = isinstance(b, TensorArg) and ins[b.index].is_reduce
        if not (keep_a and keep_b):
            return LocalCall(hops.add_partial, (a, b, alpha, keep_a, keep_b, sub))
    return _default_local(g, op, s, ctx)


def _gen_mul(g: Graph, op: Op) -> list[_Cand]:
    cands = _broadcast_cands(g, op)
    n = len(op.inputs)
    if n == 2:
        cands.append(_Cand("partial*rep", (R, I), (R,), "full"))
        if not op.target.startswith("aten.div"):
            cands.append(_Cand("rep*partial", (I, R), (R,), "full"))
    elif n == 1 and isinstance(op.args[0], TensorArg):  # x * scalar, x / scalar
        cands.append(_Cand("partial", (R,), (R,), "full"))
    return cands


def _gen_scalar_add(g: Graph, op: Op) -> list[_Cand]:
    return [*_broadcast_cands(g, op), _Cand("partial", (R,), (R,), "full")]


def _local_scalar_add(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if s.inputs[0].is_reduce:
        kind = op.target.split(".")[1]
        alpha = _kw(op, "alpha", 1) if len(op.args) < 3 else op.args[2]
        return LocalCall(hops.scalar_partial, (op.args[0], kind, op.args[1] * alpha, ctx.rank == 0))
    return _default_local(g, op, s, ctx)


def _gen_where(g: Graph, op: Op) -> list[_Cand]:
    cands = _broadcast_cands(g, op)
    # where(cond, a, b) with cond I and both values R: sum_j where(c, a_j, b_j) = where(c, a, b)
    if len(op.inputs) == 3 and isinstance(op.args[0], TensorArg):
        cands.append(_Cand("partial", (I, R, R), (R,), "full"))
    return cands


def _gen_masked_fill(g: Graph, op: Op) -> list[_Cand]:
    cands = _broadcast_cands(g, op)
    if op.target == "aten.masked_fill.Scalar":
        cands.append(_Cand("partial", (R, I), (R,), "full"))
    return cands


def _local_masked_fill(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if s.inputs[0].is_reduce:
        return LocalCall(hops.masked_fill_partial, (op.args[0], op.args[1], op.args[2], ctx.rank == 0))
    return _default_local(g, op, s, ctx)


# neg and positive are linear (their own table below), so they are not listed here.
_UNARY_CHEAP = (
    "relu",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "trunc",
    "logical_not",
    "bitwise_not",
    "square",
    "reciprocal",
    "relu_",
    "hardtanh",
    "clamp",
    "clamp_min",
    "clamp_max",
    "leaky_relu",
    "hardsigmoid",
    "hardswish",
    "isnan",
    "isinf",
    "fill",
    "nan_to_num",
    "frac",
)
_UNARY_TRANS = (
    "gelu",
    "silu",
    "tanh",
    "sigmoid",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "erf",
    "sin",
    "cos",
    "softplus",
    "elu",
    "mish",
    "log1p",
    "expm1",
    "gelu_",
    "silu_",
    "tanh_",
    "sigmoid_",
    "log2",
    "exp2",
    "atan",
    "selu",
    "celu",
)
# div.Tensor/div.Scalar are multiplicative and rsub.Scalar additive (tables below); the overloads
# without that algebra are listed in _BINARY_EXTRA. pow has its own table.
_BINARY = (
    "maximum",
    "minimum",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "remainder",
    "fmod",
    "floor_divide",
    "atan2",
)
_BINARY_EXTRA = ("aten.div.Tensor_mode", "aten.rsub.Tensor")
# binary ops whose tensor-tensor overload is named ``default`` (``remainder.default`` is scalar-only)
_BINARY_DEFAULT = ("maximum", "minimum", "logical_and", "logical_or", "logical_xor", "floor_divide")
# elementwise ops of three operands (all broadcast): addcmul/addcdiv (x + v * a {*,/} b) and lerp
_TERNARY = ("aten.addcmul.default", "aten.addcdiv.default", "aten.lerp.Scalar", "aten.lerp.Tensor")


def _overloads(names: Iterable[str], kinds: Sequence[str]) -> list[str]:
    import torch

    out = []
    for n in names:
        packet = getattr(torch.ops.aten, n, None)
        if packet is None:
            continue
        have = set(packet.overloads())
        out.extend(f"aten.{n}.{k}" for k in kinds if k in have)
    return out


_register(
    _overloads(_UNARY_CHEAP, ("default", "Scalar", "Tensor")),
    "pointwise",
    _gen_pointwise,
    reason="elementwise: commutes with slicing on any dim",
)
_register(
    _overloads(_UNARY_TRANS, ("default", "Tensor_Scalar", "Scalar")),
    "pointwise",
    _gen_pointwise,
    flops=_f_scale(4, _f_out),
    reason="elementwise (transcendental, ~4 flops/element): commutes with slicing on any dim",
)
_register(
    _overloads(["pow"], ("Tensor_Scalar", "Tensor_Tensor", "Scalar")),
    "pointwise",
    _gen_pointwise,
    flops=_f_scale(4, _f_out),
    reason="power is elementwise (exp/log, ~4 flops/element) with broadcasting; not linear",
)
_register(
    [
        *_overloads(_BINARY, ("Tensor", "Scalar", "Tensor_Tensor", "Tensor_mode", "Scalar_Tensor", "other")),
        *_BINARY_EXTRA,
        *_overloads(_BINARY_DEFAULT, ("default",)),
    ],
    "pointwise",
    _gen_pointwise,
    reason="elementwise binary with broadcasting: a broadcast (size-1) dim of an operand stays I",
)
_register(
    _TERNARY,
    "pointwise",
    _gen_pointwise,
    flops=_f_scale(3, _f_out),
    reason="elementwise of three broadcast operands (~3 flops/element); products of operands: not linear",
)
_register(
    ["aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default"],
    "pointwise",
    _gen_pointwise,
    flops=_f_scale(2, _f_out),
    reason="dropout is elementwise (independent mask per element); not exact on R (the mask differs)",
)
_register(
    [
        "aten.clone.default",
        "aten.contiguous.default",
        "aten.alias.default",
        "aten.detach.default",
        "aten.lift_fresh_copy.default",
        "aten.zeros_like.default",
        "aten.positive.default",
    ],
    "linear",
    _gen_linear_unary,
    flops=_f_zero,
    reason="linear unary: commutes with slicing and with the rank sum (R -> R)",
)
_register(
    ["aten.neg.default", "aten.neg.Scalar"],
    "linear",
    _gen_linear_unary,
    reason="negation is linear: commutes with slicing and with the rank sum",
)
_register(
    ["aten.add.Tensor", "aten.sub.Tensor"],
    "additive",
    _gen_add,
    local=_local_add,
    reason="sum of R is R; an I operand added to an R is added on rank 0 only",
)
_register(
    ["aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar"],
    "additive",
    _gen_scalar_add,
    local=_local_scalar_add,
    reason="a scalar added to an R tensor is added on rank 0 only",
)
_register(
    ["aten.mul.Tensor", "aten.div.Tensor", "aten.mul.Scalar", "aten.div.Scalar"],
    "multiplicative",
    _gen_mul,
    reason="multiplication is bilinear: R times I (or a scalar) stays R; R*R is not",
)
_register(
    ["aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar"],
    "select",
    _gen_where,
    reason="where is elementwise; with an I condition it is linear in both value operands",
)
_register(
    ["aten.masked_fill.Scalar", "aten.masked_fill.Tensor"],
    "select",
    _gen_masked_fill,
    local=_local_masked_fill,
    reason="elementwise; on R the fill value lands on rank 0 only",
)


# ---- dtype conversion: linear for float -> float


def _gen_to(g: Graph, op: Op) -> list[_Cand]:
    cands = [c for c in _broadcast_cands(g, op)]
    if _is_float(_tin(g, op, 0)) and _is_float(_tout(g, op)) and len(op.inputs) == 1:
        cands.append(_Cand("partial", (R,), (R,), "full"))
    if op.target in ("aten.type_as.default", "aten.to.other"):
        # the second tensor gives its dtype only: it may be in any form (requiring I gathered a
        # batch-sharded residual stream at every Gemma/Llama-style ``x.type_as(residual)``)
        other = g.tensors[op.inputs[1]]
        forms = [I, R] + [G(d) for d in range(other.ndim)]
        cands = [
            _Cand(c.name if f == I else f"{c.name}, dtype of {f}", (c.inputs[0], f), c.outputs)
            for c in _broadcast_cands(g, op, skip=(1,))
            for f in forms
        ]
    return cands


_register(
    [
        "aten.to.dtype",
        "aten._to_copy.default",
        "aten.to.dtype_layout",
        "aten.to.device",
        "aten.to.other",
        "aten.type_as.default",
        "aten._to_dtype.default",
    ],
    "convert",
    _gen_to,
    flops=_f_zero,
    reason="dtype conversion is elementwise; float -> float is linear (R -> R)",
)


# ------------------------------------------------------------------ ground-truth sample cases


def _i(*shape: int) -> Any:
    import torch

    return torch.randint(-4, 5, shape)


def _f32(*shape: int) -> Any:
    """A float32 tensor: the dtype source of ``type_as`` / ``to.other`` (the others are float64)."""
    return _t(*shape).float()


def _nz(x: Any) -> Any:
    """``x`` with its zeros replaced by 3 (a divisor for floor/trunc division and remainder)."""
    return x.masked_fill(x == 0, 3)


#: ``(target, build(rng) -> (args, kwargs))`` samples for the ground-truth checker: the integer and
#: boolean ops (never ``R``), comparisons of both overloads, floor/trunc division, the ternary ops, and
#: ``type_as`` (its dtype source in every form).
CASES: tuple[tuple[str, Callable[[Any], tuple[tuple, dict]]], ...] = (
    ("aten.bitwise_and.Tensor", lambda r: ((_i(*(s := _bsh(r))), _i(s[2])), {})),
    ("aten.bitwise_or.Tensor", lambda r: ((_t(*(s := _bsh(r))) > 0, _t(s[1], 1) > 0), {})),
    ("aten.bitwise_not.default", lambda r: ((_i(*_bsh(r)),), {})),
    ("aten.logical_and.default", lambda r: ((_t(*(s := _bsh(r))) > 0, _t(*s) > 0), {})),
    ("aten.logical_or.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[2]) > 0), {})),
    ("aten.logical_xor.default", lambda r: ((_i(*(s := _bsh(r))), _t(s[1], s[2]) > 0), {})),
    ("aten.logical_not.default", lambda r: ((_t(*_bsh(r)) > 0,), {})),
    ("aten.minimum.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[1], s[2])), {})),
    ("aten.maximum.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[0], 1, s[2])), {})),
    ("aten.div.Tensor_mode", lambda r: ((_t(*(s := _bsh(r))) * 5, _t(s[2]) + 3), {"rounding_mode": "floor"})),
    ("aten.div.Tensor_mode", lambda r: ((_i(*(s := _bsh(r))) * 3, _nz(_i(*s))), {"rounding_mode": "trunc"})),
    ("aten.remainder.Tensor", lambda r: ((_i(*(s := _bsh(r))) * 3, _nz(_i(s[2]))), {})),
    ("aten.remainder.Scalar", lambda r: ((_t(*_bsh(r)) * 5, 1.5), {})),
    ("aten.floor_divide.default", lambda r: ((_i(*(s := _bsh(r))) * 3, _nz(_i(*s))), {})),
    ("aten.where.self", lambda r: ((_t(*(s := _bsh(r))) > 0, _t(s[2]), _t(*s)), {})),
    ("aten.eq.Scalar", lambda r: ((_i(*_bsh(r)), 1), {})),
    ("aten.ne.Tensor", lambda r: ((_i(*(s := _bsh(r))), _i(s[1], 1)), {})),
    ("aten.lt.Tensor", lambda r: ((_t(*(s := _bsh(r))), _t(*s)), {})),
    ("aten.le.Scalar", lambda r: ((_t(*_bsh(r)), 0.2), {})),
    ("aten.gt.Tensor", lambda r: ((_t(*(s := _bsh(r))), _t(s[2])), {})),
    ("aten.ge.Scalar", lambda r: ((_i(*_bsh(r)), 0), {})),
    ("aten.clamp.Tensor", lambda r: ((_t(*(s := _bsh(r))), _t(s[2]) - 1, _t(s[1], 1) + 1), {})),
    ("aten.clamp_min.default", lambda r: ((_t(*_bsh(r)), 0.1), {})),
    ("aten.clamp_max.Tensor", lambda r: ((_t(*(s := _bsh(r))), _t(s[2])), {})),
    ("aten.pow.Tensor_Tensor", lambda r: ((_t(*(s := _bsh(r))).abs() + 0.5, _t(s[2])), {})),
    ("aten.pow.Scalar", lambda r: ((2.0, _t(*_bsh(r))), {})),
    ("aten.sign.default", lambda r: ((_t(*_bsh(r)),), {})),
    ("aten.masked_fill.Scalar", lambda r: ((_i(*(s := _bsh(r))), _t(s[2]) > 0, 7), {})),
    ("aten.addcmul.default", lambda r: ((_t(*(s := _bsh(r))), _t(s[2]), _t(s[1], 1)), {"value": 0.5})),
    ("aten.addcdiv.default", lambda r: ((_t(*(s := _bsh(r))), _t(*s), _t(s[2]).abs() + 1), {})),
    ("aten.lerp.Scalar", lambda r: ((_t(*(s := _bsh(r))), _t(s[2]), 0.3), {})),
    ("aten.lerp.Tensor", lambda r: ((_t(*(s := _bsh(r))), _t(*s), _t(s[1], s[2])), {})),
    ("aten.type_as.default", lambda r: ((_t(*(s := _bsh(r))), _f32(*s)), {})),
    ("aten.type_as.default", lambda r: ((_t(*(s := _bsh(r))), _f32(s[2])), {})),
)
_register_samples(CASES)
