"""Per-op sharding rules: which forms an op accepts and produces, its flops, and how it runs locally.

A rule turns one traced :class:`~hapnb.graph.Op` into its :class:`Strategy` list (the op's Hoare
triples ``{inputs} op {outputs}``) and, for a chosen strategy, into the :class:`LocalCall` every rank
runs on its local tensors. Rules are grouped in tables by the algebra that makes them sound; each
table carries a one-line reason. Ops without a rule run replicated (all inputs ``I``).

Strategy semantics
------------------
* ``inputs``/``outputs``: one form per entry of ``Op.inputs``/``Op.outputs``.
* ``scaled_flops``: training flops (forward + backward, backward = 2x forward) done on the sharded
  part, so device j does ``ratio_j * scaled_flops``; ``fixed_flops``: flops every device does in full.
  The replicated strategy has ``scaled 0, fixed 3F``; a sharded one ``scaled 3F, fixed 0``; SFB
  ``scaled 2F`` (forward and input gradient on the shard) ``fixed F`` (the full weight gradient).
* One partition per strategy: all G-form (tensor, dim) pairs of a strategy are sharded along the
  same logical index (batch, head, contracted index, ...). The theory unions them into one class and
  gives every pair ``unit * shard_lengths(base, ratios)`` with ``base`` = gcd of the class's dim
  lengths and ``unit = len / base``. So a view ``[B,S,H] -> [B*S,H]`` with ``G(0) -> G(0)`` is sound
  (local rows = S * local batch). G(d) is only emitted for dims of size >= 2.
* ``R`` means "the sum over ranks". Only linear ops take R; a replicated operand of an R-form sum
  (a bias, a scalar, an added I tensor) counts on rank 0 only (see :mod:`hapnb.ops`). Integer and
  bool tensors are never R.

>>> from hapnb.rules import family, flops
>>> family("aten.linear.default"), family("aten.frobnicate.default")
('matmul', 'unknown')
>>> flops("aten.linear.default", [(8, 4), (3, 4), (3,)], [(8, 3)], (), ())
216.0
"""

from __future__ import annotations

import math
import random
import string
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .forms import Form, G, I, R, shard_lengths, shard_offsets
from .graph import Graph, Op, TensorArg, TensorRef, map_args

__all__ = [
    "Strategy",
    "LocalContext",
    "LocalCall",
    "CheckRow",
    "CheckReport",
    "strategies",
    "flops",
    "family",
    "localize",
    "registered",
    "check",
    "main",
]


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on every device: the input forms it needs and the output forms it makes.

    ``inputs`` has one form per entry of ``Op.inputs``; ``outputs`` one per entry of ``Op.outputs``.
    ``scaled_flops`` are the training (forward + backward) flops that scale with the device's sharding
    ratio (work on a sharded dim); ``fixed_flops`` those every device does in full. ``sfb`` marks a
    sufficient-factor-broadcasting strategy: its replicated weight inputs skip the gradient all-reduce,
    because the strategy all-gathers the sufficient factors (its G input and the output gradient) in the
    backward and computes the full weight gradient on every device.
    """

    name: str
    inputs: tuple[Form, ...]
    outputs: tuple[Form, ...]
    scaled_flops: float = 0.0
    fixed_flops: float = 0.0
    sfb: bool = False

    def __str__(self) -> str:
        ins = ",".join(map(str, self.inputs))
        outs = ",".join(map(str, self.outputs))
        return f"{self.name}: ({ins}) -> ({outs})"


@dataclass(frozen=True)
class LocalContext:
    """What a rank knows when it localizes an op: its rank, the world size, and the shard lengths of
    every G-form tensor dim of the strategy (``lengths(tensor_id, dim)`` -> one length per rank)."""

    rank: int
    n: int
    lengths: Callable[[int, int], tuple[int, ...]]

    def local(self, tid: int, dim: int) -> int:
        return self.lengths(tid, dim)[self.rank]

    def offset(self, tid: int, dim: int) -> int:
        return shard_offsets(self.lengths(tid, dim))[self.rank]


@dataclass(frozen=True)
class LocalCall:
    """What a rank runs: ``fn(*args, **dict(kwargs))`` with :class:`TensorArg` placeholders standing
    for the rank's local input tensors. ``fn`` is an aten OpOverload or a :mod:`hapnb.ops` function."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()

    def bind(self, values: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with each placeholder ``TensorArg(i)`` replaced by ``values[i]`` (local
        tensors when running, fx nodes when generating code)."""

        def sub(v: Any) -> Any:
            return values[v.index] if isinstance(v, TensorArg) else v

        return map_args(tuple(self.args), sub), map_args(dict(self.kwargs), sub)

    def run(self, tensors: Sequence[Any]) -> Any:
        """Call ``fn`` with the placeholders replaced by ``tensors`` (the rank's local inputs)."""
        args, kwargs = self.bind(tensors)
        return self.fn(*args, **kwargs)


# ============================================================================ candidate + registry


@dataclass(frozen=True)
class _Cand:
    """A strategy before costing: ``cost`` is 'shard' (3F scaled), 'full' (3F fixed) or 'sfb'."""

    name: str
    inputs: tuple[Form, ...]
    outputs: tuple[Form, ...]
    cost: str = "shard"


Gen = Callable[[Graph, Op], Iterable[_Cand]]
Loc = Callable[[Graph, Op, Strategy, LocalContext], LocalCall]
Flops = Callable[[list, list, tuple, dict], float]


@dataclass(frozen=True)
class _Rule:
    family: str
    gen: Gen
    local: Loc | None
    flops: Flops
    reason: str


_RULES: dict[str, _Rule] = {}
_STRICT = False  # check() turns rule-generator errors into failures instead of warnings


def _register(
    targets: Iterable[str],
    family: str,
    gen: Gen,
    *,
    local: Loc | None = None,
    flops: Flops | None = None,
    reason: str = "",
) -> None:
    for t in targets:
        _RULES[t] = _Rule(family, gen, local, flops or _f_out, reason)


def registered() -> dict[str, tuple[str, str]]:
    """Every op with a rule: ``{target: (family, reason)}``."""
    return {t: (r.family, r.reason) for t, r in sorted(_RULES.items())}


def family(target: str) -> str:
    """The rule family of an op target (``"matmul"``, ``"pointwise"``, ...) or ``"unknown"``."""
    r = _RULES.get(target)
    return r.family if r else "unknown"


def _aten(target: str) -> Any:
    import torch

    parts = target.split(".")
    if parts[0] != "aten" or len(parts) != 3:
        raise KeyError(f"{target!r} is not an aten op name like 'aten.linear.default'")
    return getattr(getattr(torch.ops.aten, parts[1]), parts[2])


# ---------------------------------------------------------------------------------- small helpers


def _tin(g: Graph, op: Op, k: int) -> TensorRef:
    return g.tensors[op.inputs[k]]


def _tout(g: Graph, op: Op, k: int = 0) -> TensorRef:
    return g.tensors[op.outputs[k]]


def _arg(op: Op, k: int, default: Any = None) -> Any:
    return op.args[k] if len(op.args) > k else default


def _kw(op: Op, name: str, default: Any = None) -> Any:
    return op.kw.get(name, default)


def _ndim_dim(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def _dims(d: Any, nd: int) -> tuple[int, ...]:
    """Normalize a dim / dim list (None or [] = all dims)."""
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return tuple(range(nd))
    if isinstance(d, int):
        d = (d,)
    return tuple(sorted({_ndim_dim(int(x), nd) if nd else 0 for x in d}))


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def _is_float(t: TensorRef) -> bool:
    return t.is_float


def _replace_args(op: Op, **pos: Any) -> tuple:
    args = list(op.args)
    for k, v in pos.items():
        args[int(k[1:])] = v
    return tuple(args)


def _local_shape(g: Graph, tid: int, form: Form, ctx: LocalContext) -> tuple[int, ...]:
    shape = list(g.tensors[tid].shape)
    if form.is_gather:
        shape[form.dim] = ctx.local(tid, form.dim)
    return tuple(shape)


def _default_local(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    return LocalCall(_aten(op.target), op.args, op.kwargs)


# ================================================================================== flop formulas


def _f_zero(ins: list, outs: list, args: tuple, kw: dict) -> float:
    return 0.0


def _f_out(ins: list, outs: list, args: tuple, kw: dict) -> float:
    return float(sum(_numel(s) for s in outs))


def _f_in(ins: list, outs: list, args: tuple, kw: dict) -> float:
    return float(_numel(ins[0])) if ins else 0.0


def _f_scale(c: float, base: Flops) -> Flops:
    return lambda i, o, a, k: c * base(i, o, a, k)


def flops(
    op_target: str,
    in_shapes: Sequence[Sequence[int]],
    out_shapes: Sequence[Sequence[int]],
    args: Sequence[Any] = (),
    kwargs: Any = (),
) -> float:
    """Analytic forward flops of one op (a multiply-add counts as 2).

    Matmul-like ops: 2 x the product of all index extents (+ the bias adds); SDPA: 2·B·H·L·S·(E+Ev)
    + 5·B·H·L·S (scale, softmax); conv: 2·N·Cout·Ho·Wo·(Cin/groups)·kh·kw (+ bias); pointwise: a few
    flops per output element; views and creation ops: 0.

    >>> flops("aten.scaled_dot_product_attention.default", [(2, 4, 5, 8)] * 3, [(2, 4, 5, 8)])
    7400.0
    """
    r = _RULES.get(op_target)
    if r is None:
        return float(sum(_numel(s) for s in out_shapes))
    kw = dict(kwargs) if not isinstance(kwargs, dict) else kwargs
    ins = [tuple(s) for s in in_shapes]
    outs = [tuple(s) for s in out_shapes]
    return float(r.flops(ins, outs, tuple(args), kw))


# ====================================================================================== pointwise
#
# Elementwise ops commute with slicing: for every output dim d, an operand that has d (aligned from
# the right) with the full size is G on it, a size-1 / missing (broadcast) dim is I.


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


_UNARY_CHEAP = (
    "relu",
    "neg",
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
    "positive",
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
    "pow",
    "exp2",
    "atan",
    "selu",
    "celu",
)
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
    "pow",
    "rsub",
    "div",
)


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
    _overloads(_BINARY, ("Tensor", "Scalar", "Tensor_Tensor", "Tensor_mode", "Scalar_Tensor", "other")),
    "pointwise",
    _gen_pointwise,
    reason="elementwise binary with broadcasting: a broadcast (size-1) dim of an operand stays I",
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
    ["aten.neg.default"],
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
        cands = [_Cand(c.name, (c.inputs[0], I), c.outputs) for c in _broadcast_cands(g, op, skip=(1,))]
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


# ===================================================================================== reductions
#
# A reduction over dims D keeps every other dim: G(d), d not in D, passes through (renumbered when
# keepdim is False). sum/mean over a sharded dim give R (mean divides by the GLOBAL count); sum/mean
# of R stay R. max/min/var need the whole reduced dim.


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
        dtype = _kw(op, "dtype", None) if op.target == "aten.mean.dim" else _kw(op, "dtype", None)
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


# ================================================================================ dim-wise ops
#
# Ops that act along one dim (softmax over it, a scan along it, top-k in it) are independent
# across every other dim: G(d) for d != dim passes through.


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


# ======================================================================== matmul-like (einsum)
#
# ONE generator for every contraction: an index kept in the output shards every operand that has
# it (operands that broadcast it stay I) and the output; a contracted index shards every operand
# that has it and makes the output R; one R operand with all others I gives R (multilinearity).


@dataclass(frozen=True)
class _Ein:
    ins: tuple[str, ...]  # subscripts per operand
    out: str
    sizes: tuple[tuple[int, ...], ...]  # per operand shapes


def _einsum_cands(e: _Ein, out_shape: Sequence[int], float_ops: Sequence[bool]) -> list[_Cand]:
    cands = []
    letters = []
    for s in e.ins:
        for c in s:
            if c not in letters:
                letters.append(c)
    for c in letters:
        if c in e.out:
            p = e.out.index(c)
            if out_shape[p] < 2:
                continue
            ins = tuple(
                G(s.index(c)) if c in s and sz[s.index(c)] == out_shape[p] else I
                for s, sz in zip(e.ins, e.sizes)
            )
            cands.append(_Cand(f"shard:{c}", ins, (G(p),)))
        else:
            size = max(sz[s.index(c)] for s, sz in zip(e.ins, e.sizes) if c in s)
            if size < 2:
                continue
            if any(c in s and sz[s.index(c)] != size for s, sz in zip(e.ins, e.sizes)):
                continue
            ins = tuple(G(s.index(c)) if c in s else I for s in e.ins)
            cands.append(_Cand(f"reduce:{c}", ins, (R,)))
    for k in range(len(e.ins)):
        if float_ops[k]:
            ins = tuple(R if j == k else I for j in range(len(e.ins)))
            cands.append(_Cand(f"partial{k}", ins, (R,), "full"))
    return cands


def _ein_letters(n: int, avoid: str = "") -> str:
    pool = [c for c in string.ascii_letters if c not in avoid]
    return "".join(pool[:n])


def _matmul_ein(a: Sequence[int], b: Sequence[int]) -> _Ein:
    """Subscripts for torch.matmul with broadcasting batch dims (k = contracted)."""
    k, m, n = "k", "m", "n"
    if len(a) == 1 and len(b) == 1:
        return _Ein(("k", "k"), "", (tuple(a), tuple(b)))
    if len(b) == 1:
        batch = _ein_letters(len(a) - 2, "kmn")
        return _Ein((batch + m + k, k), batch + m, (tuple(a), tuple(b)))
    if len(a) == 1:
        batch = _ein_letters(len(b) - 2, "kmn")
        return _Ein((k, batch + k + n), batch + n, (tuple(a), tuple(b)))
    nb = max(len(a), len(b)) - 2
    batch = _ein_letters(nb, "kmn")
    sa = batch[nb - (len(a) - 2) :] + m + k
    sb = batch[nb - (len(b) - 2) :] + k + n
    return _Ein((sa, sb), batch + m + n, (tuple(a), tuple(b)))


def _ein_for(g: Graph, op: Op) -> _Ein:
    """The contraction of a matmul-like op over its (first two / all) matrix operands."""
    tgt = op.target
    shp = [g.tensors[t].shape for t in op.inputs]
    if tgt == "aten.linear.default":
        x, w = shp[0], shp[1]
        batch = _ein_letters(len(x) - 1, "kn")
        if len(w) == 1:
            return _Ein((batch + "k", "k"), batch, (x, w))
        return _Ein((batch + "k", "nk"), batch + "n", (x, w))
    if tgt in (
        "aten.mm.default",
        "aten.bmm.default",
        "aten.matmul.default",
        "aten.mv.default",
        "aten.dot.default",
    ):
        return _matmul_ein(shp[0], shp[1])
    if tgt in ("aten.addmm.default", "aten.baddbmm.default"):
        return _matmul_ein(shp[1], shp[2])
    if tgt == "aten.einsum.default":
        return _parse_einsum(op.args[0], shp)
    raise KeyError(tgt)


def _parse_einsum(eq: str, shapes: Sequence[Sequence[int]]) -> _Ein:
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    used = set(eq) - set(".,->")
    ell_n = max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t), default=0)
    ell = _ein_letters(ell_n, "".join(used))
    ins = []
    for t, s in zip(terms, shapes):
        if "..." in t:
            k = len(s) - (len(t) - 3)
            t = t.replace("...", ell[ell_n - k :])
        ins.append(t)
    if not _:
        counts: dict[str, int] = {}
        for t in ins:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        rhs = ell + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    return _Ein(tuple(ins), rhs, tuple(tuple(s) for s in shapes))


def _gen_matmul(g: Graph, op: Op) -> list[_Cand]:
    tgt = op.target
    e = _ein_for(g, op)
    out = _tout(g, op)
    if tgt in ("aten.addmm.default", "aten.baddbmm.default"):
        mats = op.inputs[1:3]
    elif tgt == "aten.einsum.default" or tgt != "aten.linear.default":
        mats = op.inputs
    else:
        mats = op.inputs[:2]
    float_ops = [_is_float(g.tensors[t]) for t in mats]
    core = _einsum_cands(e, out.shape, float_ops)
    cands: list[_Cand] = []
    for c in core:
        if tgt == "aten.linear.default":
            extra: tuple[Form, ...] = ()
            if len(op.inputs) == 3:  # bias [N]: follows n, else I (rank 0 only under R)
                o = c.outputs[0]
                extra = (
                    G(0)
                    if o.is_gather and o.dim == out.ndim - 1 and len(e.out) == out.ndim and e.out[-1] == "n"
                    else I,
                )
            cands.append(_Cand(c.name, c.inputs + extra, c.outputs, c.cost))
        elif tgt in ("aten.addmm.default", "aten.baddbmm.default"):
            bias = _tin(g, op, 0)
            o = c.outputs[0]
            if o.is_reduce:
                bf: Form = I
            elif o.is_gather:
                db = o.dim - (out.ndim - bias.ndim)
                bf = G(db) if db >= 0 and bias.shape[db] == out.shape[o.dim] else I
            else:
                bf = I
            cands.append(_Cand(c.name, (bf,) + c.inputs, c.outputs, c.cost))
        else:
            cands.append(c)
    # SFB: x sharded on a batch index, 2-D weight replicated
    if tgt in ("aten.linear.default", "aten.matmul.default", "aten.mm.default"):
        w = _tin(g, op, 1)
        x = _tin(g, op, 0)
        if w.ndim == 2 and x.ndim >= 2 and _is_float(w):
            for c in cands:
                if (
                    c.cost == "shard"
                    and c.inputs[1] is I
                    and c.inputs[0].is_gather
                    and c.inputs[0].dim < x.ndim - 1
                    and c.outputs[0].is_gather
                ):
                    cands.append(_Cand("sfb:" + c.name.split(":")[-1], c.inputs, c.outputs, "sfb"))
    return cands


def _local_matmul(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    tgt = op.target
    if s.sfb:
        d = s.inputs[0].dim
        lens = ctx.lengths(op.inputs[0], d)
        if tgt == "aten.linear.default":
            b = op.args[2] if len(op.inputs) == 3 else None
            return LocalCall(hops.sfb_linear, (op.args[0], op.args[1], b, d, lens))
        return LocalCall(hops.sfb_matmul, (op.args[0], op.args[1], d, lens))
    out_r = s.outputs[0].is_reduce
    if tgt == "aten.linear.default" and len(op.inputs) == 3 and out_r:
        return LocalCall(hops.linear_partial, (op.args[0], op.args[1], op.args[2], ctx.rank == 0))
    if tgt in ("aten.addmm.default", "aten.baddbmm.default") and out_r:
        beta, alpha = _kw(op, "beta", 1), _kw(op, "alpha", 1)
        return LocalCall(hops.addmm_partial, (*op.args[:3], beta, alpha, ctx.rank == 0))
    return _default_local(g, op, s, ctx)


def _f_matmul(ins: list, outs: list, args: tuple, kw: dict, target: str = "") -> float:
    return 0.0


def _f_ein(target: str) -> Flops:
    def f(ins: list, outs: list, args: tuple, kw: dict) -> float:
        if target == "aten.einsum.default":
            e = _parse_einsum(args[0], ins)
        elif target in ("aten.addmm.default", "aten.baddbmm.default"):
            e = _matmul_ein(ins[1], ins[2])
        elif target == "aten.linear.default":
            x, w = ins[0], ins[1]
            batch = _ein_letters(len(x) - 1, "kn")
            e = _Ein(
                (batch + "k", "nk" if len(w) == 2 else "k"), batch + ("n" if len(w) == 2 else ""), (x, w)
            )
        else:
            e = _matmul_ein(ins[0], ins[1])
        size: dict[str, int] = {}
        for s, sh in zip(e.ins, e.sizes):
            for c, n in zip(s, sh):
                size[c] = max(size.get(c, 1), n)
        total = 2.0 * _numel(list(size.values()))
        if target == "aten.linear.default" and len(ins) == 3:
            total += _numel(outs[0])
        if target in ("aten.addmm.default", "aten.baddbmm.default"):
            total += _numel(outs[0])
        return total

    return f


for _t in (
    "aten.linear.default",
    "aten.mm.default",
    "aten.bmm.default",
    "aten.matmul.default",
    "aten.addmm.default",
    "aten.baddbmm.default",
    "aten.einsum.default",
    "aten.mv.default",
    "aten.dot.default",
):
    _register(
        [_t],
        "matmul",
        _gen_matmul,
        local=_local_matmul,
        flops=_f_ein(_t),
        reason="one einsum generator: kept index -> G, contracted index -> R, one R operand -> R",
    )


# ========================================================================================== views
#
# A view regroups dims; the outermost non-1 dims of a regrouped block map onto each other (a
# contiguous chunk of the block), so G(d_in) -> G(d_out) for them and for untouched dims. Views are
# linear (R -> R). Localized views rewrite their shape arguments to the LOCAL sizes.


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


def _local_repeat(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    return _default_local(g, op, s, ctx)


_register(
    ["aten.repeat.default"],
    "view",
    _gen_repeat,
    local=_local_repeat,
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


# =========================================================================== creation ops
#
# No tensor inputs: the result is I, or G(d) by creating only the rank's slice.


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


# =============================================================================== norms
#
# Normalization over the trailing normalized_shape: any leading dim may be sharded, the affine
# weight/bias stay I. (Sharding a normalized dim would need the statistics across ranks.)


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


# ============================================================================ attention
#
# softmax(q k^T) v is independent across batch and heads (q, k, v and the mask share the leading
# dims) and across query rows when there is no causal offset (k, v stay I).


def _gen_sdpa(g: Graph, op: Op) -> list[_Cand]:
    q, k, v = (_tin(g, op, i) for i in range(3))
    has_mask = isinstance(_arg(op, 3), TensorArg)
    mask = _tin(g, op, op.args[3].index) if has_mask else None
    nd = q.ndim
    cands = []

    def mask_form(d: int) -> tuple[Form, ...]:
        if mask is None:
            return ()
        dm = d - (nd - mask.ndim)
        return (G(dm) if dm >= 0 and mask.shape[dm] == q.shape[d] else I,)

    for d in range(nd - 2):
        if q.shape[d] < 2:
            continue
        kv = tuple(G(d) if t.shape[d] == q.shape[d] else I for t in (k, v))
        if any(t.shape[d] not in (1, q.shape[d]) for t in (k, v)):
            continue  # grouped-query heads: k/v heads differ from q heads
        cands.append(_Cand(f"shard{d}", (G(d),) + kv + mask_form(d), (G(d),)))
    causal = bool(_arg(op, 5, False))
    if not causal and q.shape[nd - 2] >= 2:
        cands.append(_Cand("rows", (G(nd - 2), I, I) + mask_form(nd - 2), (G(nd - 2),)))
    return cands


def _f_sdpa(ins: list, outs: list, args: tuple, kw: dict) -> float:
    q, k, v = ins[0], ins[1], ins[2]
    lead = _numel(q[:-2])
    L, E = q[-2], q[-1]
    S, Ev = k[-2], v[-1]
    return float(2 * lead * L * S * (E + Ev) + 5 * lead * L * S)


_register(
    ["aten.scaled_dot_product_attention.default"],
    "attention",
    _gen_sdpa,
    flops=_f_sdpa,
    reason="attention is independent across batch and heads, and across query rows (non-causal)",
)


# ============================================================================= embedding


def _gen_embedding(g: Graph, op: Op) -> list[_Cand]:
    w, idx = _tin(g, op, 0), _tin(g, op, 1)
    cands = [_Cand(f"batch{d}", (I, G(d)), (G(d),)) for d in range(idx.ndim)]
    cands.append(_Cand("hidden", (G(1), I), (G(idx.ndim),)))
    if w.shape[0] >= 2:
        cands.append(_Cand("vocab", (G(0), I), (R,), "full"))
    cands.append(_Cand("partial", (R, I), (R,), "full"))
    return cands


def _local_embedding(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    f = s.inputs[0]
    if f.is_gather and f.dim == 0:
        return LocalCall(hops.embedding_vocab, (op.args[0], op.args[1], ctx.offset(op.inputs[0], 0)))
    return _default_local(g, op, s, ctx)


_register(
    ["aten.embedding.default"],
    "embedding",
    _gen_embedding,
    local=_local_embedding,
    reason="lookup is independent per index and per hidden unit; vocab shards sum (masked) to R",
)


# ================================================================================ losses


def _gen_loss(g: Graph, op: Op) -> list[_Cand]:
    x, tgt = _tin(g, op, 0), _tin(g, op, 1)
    reduction = int(_arg(op, 3, 1))
    rest = (I,) * (len(op.inputs) - 2)
    prob = tgt.is_float
    cands = []
    # sample dims: input 0 <-> target 0, input k (k >= 2) <-> target k-1 (prob target: same dim)
    pairs = [(0, 0)] + [(k, k if prob else k - 1) for k in range(2, x.ndim)]
    if x.ndim == 1:
        pairs = []
    for dx, dt in pairs:
        if x.shape[dx] < 2:
            continue
        if reduction == 0:
            out_d = dx if dx == 0 else dx - 1
            cands.append(_Cand(f"shard{dx}", (G(dx), G(dt)) + rest, (G(out_d),)))
        else:
            cands.append(_Cand(f"reduce{dx}", (G(dx), G(dt)) + rest, (R,)))
    return cands


def _local_loss(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if not s.outputs[0].is_reduce:
        return _default_local(g, op, s, ctx)
    kind = "ce" if op.target.startswith("aten.cross_entropy") else "nll"
    x = _tin(g, op, 0)
    count = x.numel // (x.shape[1] if x.ndim > 1 else x.numel)
    smoothing = float(_arg(op, 5, 0.0)) if kind == "ce" else 0.0
    return LocalCall(
        hops.loss_partial,
        (kind, op.args[0], op.args[1], op.args[2], int(op.args[3]), int(op.args[4]), smoothing, count),
    )


_register(
    [
        "aten.cross_entropy_loss.default",
        "aten.nll_loss_nd.default",
        "aten.nll_loss.default",
        "aten.nll_loss2d.default",
    ],
    "loss",
    _gen_loss,
    local=_local_loss,
    flops=lambda i, o, a, k: 6.0 * _numel(i[0]),
    reason="per-sample losses: a sharded batch (or extra dim) sums to R; mean divides by the "
    "global count of non-ignored targets",
)


def _gen_mse(g: Graph, op: Op) -> list[_Cand]:
    a = _tin(g, op, 0)
    red = int(_arg(op, 2, 1))
    if len(op.inputs) != 2 or _tin(g, op, 1).shape != a.shape:
        return []
    return [_Cand(f"shard{d}", (G(d), G(d)), (G(d),) if red == 0 else (R,)) for d in range(a.ndim)]


def _local_mse(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if not s.outputs[0].is_reduce:
        return _default_local(g, op, s, ctx)
    return LocalCall(hops.mse_partial, (op.args[0], op.args[1], int(op.args[2]), _tin(g, op, 0).numel))


_register(
    ["aten.mse_loss.default"],
    "loss",
    _gen_mse,
    local=_local_mse,
    flops=lambda i, o, a, k: 3.0 * _numel(i[0]),
    reason="elementwise squared error: shards sum to R (mean divides by the static global count)",
)


# ============================================================================ conv / pooling


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


def _gen_pool(g: Graph, op: Op, linear: bool) -> list[_Cand]:
    x = _tin(g, op, 0)
    lead = x.ndim - (1 if "1d" in op.target else 2)  # spatial dims are never sharded
    nout = len(op.outputs)
    cands = [_Cand(f"shard{d}", (G(d),), (G(d),) * nout) for d in range(lead)]
    if linear:
        cands.append(_Cand("partial", (R,), (R,), "full"))
    return cands


_register(
    ["aten.max_pool2d.default", "aten.max_pool2d_with_indices.default", "aten.max_pool1d.default"],
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
    ],
    "pool",
    lambda g, op: _gen_pool(g, op, True),
    local=_local_pool,
    flops=_f_in,
    reason="average pooling is linear and spatial: batch/channel shard, R -> R",
)


# ============================================================================== public API


def _valid(g: Graph, op: Op, c: _Cand) -> bool:
    if len(c.inputs) != len(op.inputs) or len(c.outputs) != len(op.outputs):
        return False
    for tid, f in zip(op.inputs + op.outputs, c.inputs + c.outputs):
        t = g.tensors[tid]
        if f.is_gather and (f.dim >= t.ndim or t.shape[f.dim] < 2):
            return False
        if f.is_reduce and not t.is_float:
            return False
    return any(not f.is_identity for f in c.inputs + c.outputs)


def strategies(graph: Graph, op: Op) -> tuple[Strategy, ...]:
    """All valid strategies of ``op``; the replicated one (all I) comes first. No rule: only it.

    >>> import torch, hapnb
    >>> g = hapnb.trace(torch.nn.Linear(4, 3), (torch.randn(8, 4),), loss=lambda o: o.sum())
    >>> [str(s) for s in strategies(g, g.ops[0])][:3]
    ['replicate: (I,I,I) -> (I)', 'shard:a: (G0,I,I) -> (G0)', 'reduce:k: (G1,G1,I) -> (R)']
    """
    F = op.flops
    out = [Strategy("replicate", (I,) * len(op.inputs), (I,) * len(op.outputs), 0.0, 3.0 * F)]
    rule = _RULES.get(op.target)
    if rule is None:
        return tuple(out)
    seen = {(out[0].inputs, out[0].outputs, False)}
    try:
        cands = list(rule.gen(graph, op))
    except Exception as exc:
        if _STRICT:
            raise
        warnings.warn(
            f"hapnb.rules: the {rule.family} rule of {op.name} ({op.target}) failed ({_short(exc)}); "
            "the op runs replicated. Please report this with the op's shapes.",
            stacklevel=2,
        )
        return tuple(out)
    for c in cands:
        if not _valid(graph, op, c):
            continue
        key = (c.inputs, c.outputs, c.cost == "sfb")
        if key in seen:
            continue
        seen.add(key)
        if c.cost == "shard":
            sc, fx = 3.0 * F, 0.0
        elif c.cost == "sfb":
            sc, fx = 2.0 * F, F
        else:
            sc, fx = 0.0, 3.0 * F
        out.append(Strategy(c.name, c.inputs, c.outputs, sc, fx, sfb=c.cost == "sfb"))
    return tuple(out)


def localize(graph: Graph, op: Op, strategy: Strategy, ctx: LocalContext) -> LocalCall:
    """The call rank ``ctx.rank`` runs for ``op`` under ``strategy`` (shape args made local)."""
    rule = _RULES.get(op.target)
    if strategy.name == "replicate" or rule is None:
        if rule is None and not op.target.startswith("aten."):
            raise KeyError(f"op {op.name} ({op.target}) has no aten overload to run")
        return LocalCall(_aten(op.target), op.args, op.kwargs)
    return (rule.local or _default_local)(graph, op, strategy, ctx)


# ======================================================================== ground-truth checker
#
# strategy_validation, HAP style: for every registered op family, build sample inputs, and for every
# strategy split random full inputs per its input forms with UNEVEN ratios (zero-length shards
# included): G narrows by the class lengths, R gets asymmetric random partials that sum to the full
# tensor, I is a full copy. Run localize(...) per simulated rank, reassemble (G: concat in rank
# order, R: sum, I: every rank must equal the full result) and compare with the full op in float64.
# Backward: grads of G inputs must concat to the full grad, of R inputs be complete on every rank, of
# I inputs sum to the full grad (SFB weights: complete on every rank).


@dataclass(frozen=True)
class CheckRow:
    """One checked (op case, strategy): status is 'ok', 'wrong' or 'crash'."""

    target: str
    case: str
    strategy: str
    status: str
    detail: str = ""


@dataclass(frozen=True)
class CheckReport:
    """All rows of a :func:`check` run; ``ok`` when no rule is wrong or crashes."""

    rows: tuple[CheckRow, ...]
    seconds: float = 0.0
    unchecked: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.rows) and bool(self.rows)

    @property
    def wrong(self) -> tuple[CheckRow, ...]:
        return tuple(r for r in self.rows if r.status == "wrong")

    @property
    def crashed(self) -> tuple[CheckRow, ...]:
        return tuple(r for r in self.rows if r.status == "crash")

    def by_target(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for r in self.rows:
            d = out.setdefault(r.target, {"ok": 0, "wrong": 0, "crash": 0})
            d[r.status] += 1
        return out

    def __str__(self) -> str:
        lines = [f"{'op':44s} {'ok':>5s} {'wrong':>6s} {'crash':>6s}"]
        for t, d in sorted(self.by_target().items()):
            lines.append(f"{t:44s} {d['ok']:5d} {d['wrong']:6d} {d['crash']:6d}")
        if self.wrong:
            lines.append("\nWRONG rules (output differs from the single-device op):")
            lines.extend(f"  {r.target} [{r.case}] {r.strategy}: {r.detail}" for r in self.wrong[:40])
        if self.crashed:
            lines.append("\nCRASHING rules (localized op raised):")
            lines.extend(f"  {r.target} [{r.case}] {r.strategy}: {r.detail}" for r in self.crashed[:40])
        if self.unchecked:
            more = f", ... ({len(self.unchecked)} in all)" if len(self.unchecked) > 12 else ""
            lines.append(
                "\nregistered without a sample case (same table generator as checked ops): "
                + ", ".join(self.unchecked[:12])
                + more
            )
        n_ok = sum(r.status == "ok" for r in self.rows)
        lines.append(
            f"\n{len(self.rows)} checks, {n_ok} ok, {len(self.wrong)} wrong, {len(self.crashed)} crashed "
            f"({self.seconds:.1f} s): {'PASS' if self.ok else 'FAIL'}"
        )
        return "\n".join(lines)


def _single_op(target: str, args: tuple, kwargs: dict) -> tuple[Graph, Op, list[Any]]:
    """A one-op Graph for ``target(*args, **kwargs)`` with real tensors as its inputs."""
    import torch

    from .graph import normalize_args as _normalize

    fn = _aten(target)
    args, kwargs = _normalize(fn, tuple(args), dict(kwargs))
    tensors: list[TensorRef] = []
    full: list[Any] = []

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            k = len(full)
            full.append(v)
            tensors.append(TensorRef(k, f"in{k}", tuple(v.shape), str(v.dtype)[6:], "input"))
            return TensorArg(k)
        if isinstance(v, (list, tuple)):
            return tuple(conv(x) for x in v)
        return v

    cargs = tuple(conv(a) for a in args)
    ckw = tuple(sorted((k, conv(v)) for k, v in kwargs.items()))
    res = fn(*args, **kwargs)
    outs = list(res) if isinstance(res, (tuple, list)) else [res]
    items = tuple(range(len(outs))) if isinstance(res, (tuple, list)) else ()
    out_ids = []
    for k, o in enumerate(outs):
        tid = len(tensors)
        tensors.append(TensorRef(tid, f"out{k}", tuple(o.shape), str(o.dtype)[6:], "activation", producer=0))
        out_ids.append(tid)
    in_ids = tuple(range(len(full)))
    fl = flops(
        target, [t.shape for t in tensors[: len(full)]], [tensors[t].shape for t in out_ids], cargs, ckw
    )
    op = Op(
        0,
        "op",
        target,
        in_ids,
        tuple(out_ids),
        cargs,
        ckw,
        flops=fl,
        family=family(target),
        output_items=items,
    )
    g = Graph(tuple(tensors), (op,), in_ids, (), out_ids[0], name=target)
    return g, op, full


def _class_lengths(g: Graph, op: Op, s: Strategy, ratios: Sequence[float]) -> Callable[[int, int], tuple]:
    pairs = [(t, f.dim) for t, f in zip(op.inputs + op.outputs, s.inputs + s.outputs) if f.is_gather]
    if not pairs:
        return lambda t, d: ()
    base = 0
    for t, d in pairs:
        base = math.gcd(base, g.tensors[t].shape[d])
    lens = shard_lengths(base, ratios)

    def lengths(t: int, d: int) -> tuple[int, ...]:
        unit = g.tensors[t].shape[d] // base
        return tuple(unit * x for x in lens)

    return lengths


def _close(a: Any, b: Any, tol: float = 1e-9) -> tuple[bool, str]:
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False, f"not tensors: {type(a).__name__} vs {type(b).__name__}"
    if tuple(a.shape) != tuple(b.shape):
        return False, f"shape {tuple(a.shape)} != expected {tuple(b.shape)}"
    if not (a.is_floating_point() or b.is_floating_point()):
        same = bool(torch.equal(a, b.to(a.dtype)))
        return same, "" if same else "integer values differ"
    a64, b64 = a.double(), b.double()
    fin = torch.isfinite(b64)
    if not torch.equal(fin, torch.isfinite(a64)):
        return False, "non-finite entries differ"
    if min(a.dtype.itemsize, b.dtype.itemsize) < 8:
        tol = max(tol, 1e-5)
    scale = float(b64[fin].abs().max()) if fin.any() else 0.0
    err = float((a64[fin] - b64[fin]).abs().max()) if fin.any() else 0.0
    ok = err <= tol * max(1.0, scale)
    return ok, "" if ok else f"max abs error {err:.3g} (scale {scale:.3g})"


# inputs that never take a gradient (class weights of losses)
_NON_DIFF_INPUTS: dict[str, tuple[int, ...]] = {
    "aten.cross_entropy_loss.default": (2,),
    "aten.nll_loss_nd.default": (2,),
    "aten.nll_loss.default": (2,),
}


def _split_input(x: Any, f: Form, tid: int, lengths: Callable, n: int, gen: Any) -> list[Any]:
    import torch

    if f.is_gather:
        lens = lengths(tid, f.dim)
        offs = shard_offsets(lens)
        return [x.narrow(f.dim, o, k).clone() for o, k in zip(offs, lens)]
    if f.is_reduce:
        parts = []
        for j in range(n - 1):
            parts.append(torch.randn(x.shape, dtype=x.dtype, generator=gen) * (j + 1.5))
        last = x - sum(parts) if parts else x.clone()
        return [*parts, last]
    return [x.clone() for _ in range(n)]


def _outputs_of(res: Any, op: Op) -> list[Any]:
    if op.output_items:
        return [res[k] for k in op.output_items]
    return [res]


def _check_strategy(
    g: Graph, op: Op, full: list[Any], s: Strategy, n: int, ratios: Sequence[float], seed: int, backward: bool
) -> tuple[str, str]:
    import torch

    from . import ops as hops

    gen = torch.Generator().manual_seed(seed)
    lengths = _class_lengths(g, op, s, ratios)
    full_call = LocalCall(_aten(op.target), op.args, op.kwargs)
    no_grad = _NON_DIFF_INPUTS.get(op.target, ())
    diff = [backward and x.is_floating_point() and k not in no_grad for k, x in enumerate(full)]
    want_in = [x.detach().clone().requires_grad_(d) for x, d in zip(full, diff)]
    low = any(g.tensors[t].itemsize < 8 and g.tensors[t].is_float for t in op.inputs + op.outputs)
    tol = 1e-5 if low else 1e-9
    want = _outputs_of(full_call.run(want_in), op)
    local_ins = [_split_input(x, f, t, lengths, n, gen) for x, f, t in zip(full, s.inputs, op.inputs)]
    cots = [
        torch.randn(w.shape, dtype=w.dtype, generator=gen) if w.is_floating_point() else None for w in want
    ]
    do_bwd = backward and any(w.requires_grad for w in want)
    if do_bwd:
        loss = sum((w * c).sum() for w, c in zip(want, cots) if c is not None and w.requires_grad)
        loss.backward()  # type: ignore[union-attr]
    sim = hops.RankSimulator(n)
    calls = [localize(g, op, s, LocalContext(r, n, lengths)) for r in range(n)]
    for _pass in range(2):
        got: list[list[Any]] = []
        grads: list[list[Any]] = []
        for r in range(n):
            xs = [v[r].detach().clone().requires_grad_(do_bwd and d) for v, d in zip(local_ins, diff)]
            with sim.rank(r):
                outs = _outputs_of(calls[r].run(xs), op)
                if do_bwd:
                    lsum: Any = 0
                    for tid, o, f, c in zip(op.outputs, outs, s.outputs, cots):
                        if c is None or not o.requires_grad:
                            continue
                        if f.is_gather:
                            lens = lengths(tid, f.dim)
                            lc = c.narrow(f.dim, shard_offsets(lens)[r], lens[r])
                        elif f.is_reduce:
                            lc = c
                        else:
                            lc = c / n
                        lsum = lsum + (o * lc).sum()
                    if isinstance(lsum, torch.Tensor) and lsum.requires_grad:
                        lsum.backward()
            got.append([o.detach() for o in outs])
            grads.append([x.grad if x.requires_grad else None for x in xs])
        if not sim.records:
            break
        sim.next_pass()
    # forward
    for k, (w, f) in enumerate(zip(want, s.outputs)):
        tid = op.outputs[k]
        parts = [got[r][k] for r in range(n)]
        if f.is_gather:
            lens = lengths(tid, f.dim)
            for r in range(n):
                if parts[r].shape[f.dim] != lens[r]:
                    return "wrong", f"output {k} rank {r}: local length {parts[r].shape[f.dim]} != {lens[r]}"
            ok, why = _close(torch.cat(parts, f.dim), w.detach(), tol)
        elif f.is_reduce:
            ok, why = _close(sum(parts[1:], parts[0]), w.detach(), tol)
        else:
            ok, why = True, ""
            for r in range(n):
                ok, why = _close(parts[r], w.detach(), tol)
                if not ok:
                    why = f"rank {r}: {why}"
                    break
        if not ok:
            return "wrong", f"output {k} ({f}): {why}"
    if not do_bwd:
        return "ok", ""
    for k, (x, f) in enumerate(zip(want_in, s.inputs)):
        if not x.requires_grad:
            continue
        ref = x.grad if x.grad is not None else torch.zeros_like(x)
        gs = [grads[r][k] if grads[r][k] is not None else torch.zeros_like(local_ins[k][r]) for r in range(n)]
        if f.is_gather:
            ok, why = _close(torch.cat(gs, f.dim), ref, tol)
        elif f.is_reduce or (s.sfb and k > 0):
            ok, why = True, ""
            for r in range(n):
                ok, why = _close(gs[r], ref, tol)
                if not ok:
                    why = f"rank {r}: {why}"
                    break
        else:
            ok, why = _close(sum(gs[1:], gs[0]), ref, tol)
        if not ok:
            return "wrong", f"grad of input {k} ({f}): {why}"
    return "ok", ""


# -------------------------------------------------------------------------------- sample cases


def _cases() -> list[tuple[str, Callable[[Any], tuple[tuple, dict]]]]:
    """(target, builder(rng) -> (args, kwargs)) with float64 tensors; shapes drawn from ``rng``."""
    import torch

    f64 = torch.float64

    def T(*shape: int) -> Any:  # noqa: N802
        return torch.randn(*shape, dtype=f64)

    def dims(r: Any, k: int, lo: int = 2, hi: int = 6) -> list[int]:
        return [r.randint(lo, hi) for _ in range(k)]

    C: list[tuple[str, Callable[[Any], tuple[tuple, dict]]]] = []

    def add(target: str, fn: Callable[[Any], tuple[tuple, dict]]) -> None:
        C.append((target, fn))

    def bsh(r: Any) -> tuple[int, int, int]:
        b, s, h = dims(r, 3)
        return b, s, h

    for u in ("relu", "gelu", "silu", "tanh", "sigmoid", "exp", "neg", "abs", "rsqrt", "erf", "log"):
        add(
            f"aten.{u}.default",
            lambda r, u=u: ((T(*bsh(r)).abs() + 0.5 if u in ("rsqrt", "log") else T(*bsh(r)),), {}),
        )
    add("aten.gelu.default", lambda r: ((T(*bsh(r)),), {"approximate": "tanh"}))
    add("aten.dropout.default", lambda r: ((T(*bsh(r)), 0.0, True), {}))
    add("aten.pow.Tensor_Scalar", lambda r: ((T(*bsh(r)), 2), {}))
    for b_op in ("add", "sub"):
        add(f"aten.{b_op}.Tensor", lambda r, o=b_op: ((T(*(s := bsh(r))), T(s[2])), {"alpha": 2}))
        add(f"aten.{b_op}.Tensor", lambda r: ((T(*(s := bsh(r))), T(s[0], 1, s[2])), {}))
        add(f"aten.{b_op}.Tensor", lambda r: ((T(*bsh(r)), 2.5), {}))
        add(f"aten.{b_op}.Tensor", lambda r: ((T(*(s := bsh(r))), T(*s)), {}))
    add("aten.mul.Tensor", lambda r: ((T(*(s := bsh(r))), T(s[1], s[2])), {}))
    add("aten.mul.Tensor", lambda r: ((T(*bsh(r)), 3.0), {}))
    add("aten.div.Tensor", lambda r: ((T(*(s := bsh(r))), T(s[2]).abs() + 1), {}))
    add("aten.div.Tensor", lambda r: ((T(*bsh(r)), 4.0), {}))
    add("aten.add.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.rsub.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.maximum.default", lambda r: ((T(*(s := bsh(r))), T(*s)), {}))
    add("aten.gt.Scalar", lambda r: ((T(*bsh(r)), 0.0), {}))
    add("aten.eq.Tensor", lambda r: ((torch.randint(0, 3, (s := bsh(r))), torch.randint(0, 3, s[1:])), {}))
    add("aten.where.self", lambda r: ((T((s := bsh(r))[1], 1) > 0, T(*s), T(*s)), {}))
    add("aten.masked_fill.Scalar", lambda r: ((T(*(s := bsh(r))), T(s[1], s[2]) > 0, -1.5), {}))
    add("aten.clone.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.contiguous.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.alias.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.to.dtype", lambda r: ((T(*bsh(r)), torch.float32), {}))
    add("aten._to_copy.default", lambda r: ((T(*bsh(r)),), {"dtype": torch.float32}))
    add("aten.zeros_like.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.ones_like.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.full_like.default", lambda r: ((T(*bsh(r)), 2.0), {}))
    # reductions
    add("aten.sum.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.sum.dim_IntList", lambda r: ((T(*bsh(r)), [1]), {}))
    add("aten.sum.dim_IntList", lambda r: ((T(*bsh(r)), [0, 2], True), {}))
    add("aten.mean.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.mean.dim", lambda r: ((T(*bsh(r)), [-1], True), {}))
    add("aten.mean.dim", lambda r: ((T(*bsh(r)), [0, 1]), {}))
    add("aten.amax.default", lambda r: ((T(*bsh(r)), [1]), {}))
    add("aten.max.dim", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.argmax.default", lambda r: ((T(*bsh(r)), 2), {}))
    # dim-wise
    add("aten.softmax.int", lambda r: ((T(*bsh(r)), -1), {}))
    add("aten.log_softmax.int", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten._softmax.default", lambda r: ((T(*bsh(r)), 2, False), {}))
    add("aten.cumsum.default", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.topk.default", lambda r: ((T(*bsh(r)), 2, -1), {}))
    add("aten.one_hot.default", lambda r: ((torch.randint(0, 5, dims(r, 2)), 5), {}))
    add("aten.flip.default", lambda r: ((T(*bsh(r)), [1]), {}))
    # matmul family
    add("aten.linear.default", lambda r: _lin(r, T, False))
    add("aten.linear.default", lambda r: _lin(r, T, True))
    add("aten.linear.default", lambda r: _lin(r, T, False, two_d=True))
    add("aten.mm.default", lambda r: ((T((m := dims(r, 3))[0], m[1]), T(m[1], m[2])), {}))
    add("aten.bmm.default", lambda r: ((T((m := dims(r, 4))[0], m[1], m[2]), T(m[0], m[2], m[3])), {}))
    add("aten.matmul.default", lambda r: ((T((m := dims(r, 4))[0], m[1], m[2]), T(m[2], m[3])), {}))
    add(
        "aten.matmul.default",
        lambda r: ((T((m := dims(r, 5, 2, 4))[0], m[1], m[2], m[3]), T(m[0], m[1], m[3], m[4])), {}),
    )
    add("aten.matmul.default", lambda r: ((T((m := dims(r, 4))[0], 1, m[1], m[2]), T(m[3], m[2], 3)), {}))
    add("aten.addmm.default", lambda r: ((T((m := dims(r, 3))[2]), T(m[0], m[1]), T(m[1], m[2])), {}))
    for eq, spec in (
        ("bsd,bsec->becd", ("bsd", "bsec")),
        ("edh,becd->bech", ("edh", "becd")),
        ("ehd,bech->becd", ("ehd", "bech")),
        ("becd,bsec->bsd", ("becd", "bsec")),
        ("bhqd,bhkd->bhqk", ("bhqd", "bhkd")),
    ):
        add("aten.einsum.default", lambda r, eq=eq, spec=spec: _ein_case(r, eq, spec, T))
    # views
    add("aten.view.default", lambda r: ((T(*(s := bsh(r))), [s[0] * s[1], s[2]]), {}))
    add("aten.view.default", lambda r: ((T((s := bsh(r))[0] * s[1], s[2]), list(s)), {}))
    add(
        "aten.view.default",
        lambda r: ((T(*(s := (r.randint(2, 4), r.randint(2, 4), 6))), [s[0], s[1], 2, 3]), {}),
    )
    add("aten.reshape.default", lambda r: ((T(*(s := bsh(r))), [s[0], s[1] * s[2]]), {}))
    add("aten.view.default", lambda r: ((T(6, 4), [4, 6]), {}))
    add("aten.flatten.using_ints", lambda r: ((T(*dims(r, 4, 2, 4)), 1), {}))
    add("aten.unflatten.int", lambda r: ((T(*bsh(r)[:2], 6), -1, [2, 3]), {}))
    add("aten.transpose.int", lambda r: ((T(*bsh(r)), 1, 2), {}))
    add("aten.permute.default", lambda r: ((T(*bsh(r)), [2, 0, 1]), {}))
    add("aten.t.default", lambda r: ((T(*dims(r, 2)),), {}))
    add("aten.unsqueeze.default", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.squeeze.dim", lambda r: ((T((s := bsh(r))[0], 1, s[2]), 1), {}))
    add("aten.expand.default", lambda r: ((T((s := bsh(r))[0], 1, s[2]), list(s)), {}))
    add("aten.expand.default", lambda r: ((T((s := bsh(r))[1], s[2]), list(s)), {}))
    add("aten.select.int", lambda r: ((T(*bsh(r)), 1, 1), {}))
    add("aten.slice.Tensor", lambda r: ((T(*bsh(r)), 1, 1, 3), {}))
    add("aten.split.Tensor", lambda r: ((T(*bsh(r)[:2], 5), 2, -1), {}))
    add("aten.chunk.default", lambda r: ((T(*bsh(r)), 2, 1), {}))
    add("aten.split_with_sizes.default", lambda r: ((T(*bsh(r)[:2], 5), [2, 3], 2), {}))
    add("aten.unbind.int", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.cat.default", lambda r: (([T(*(s := bsh(r))), T(s[0], 3, s[2])], 1), {}))
    add("aten.stack.default", lambda r: (([T(*(s := bsh(r))), T(*s)], 1), {}))
    add("aten.triu.default", lambda r: ((T(*[r.randint(3, 7)] * 2), 1), {}))
    add("aten.tril.default", lambda r: ((T(r.randint(2, 4), *[r.randint(3, 7)] * 2), -1), {}))
    add("aten.constant_pad_nd.default", lambda r: ((T(*bsh(r)), [1, 1]), {}))
    add("aten.repeat.default", lambda r: ((T(*bsh(r)), [1, 2, 1]), {}))
    # more ops the zoo models export (and close relatives)
    add("aten.clamp.default", lambda r: ((T(*bsh(r)), -0.5, 0.7), {}))
    add("aten.lt.Scalar", lambda r: ((T(*bsh(r)), 0.1), {}))
    add("aten.bitwise_not.default", lambda r: ((T(*bsh(r)) > 0,), {}))
    add("aten.sqrt.default", lambda r: ((T(*bsh(r)).abs(),), {}))
    add("aten.mul.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.sub.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.div.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add(
        "aten.masked_fill.Tensor",
        lambda r: ((T(*(s := bsh(r))), T(s[2]) > 0, torch.tensor(2.0, dtype=f64)), {}),
    )
    add("aten.squeeze.default", lambda r: ((T((s := bsh(r))[0], 1, s[2]),), {}))
    add("aten.index_select.default", lambda r: ((T(*bsh(r)), 1, torch.tensor([1, 0, 1])), {}))
    add("aten.narrow.default", lambda r: ((T(*bsh(r)), 2, 0, 2), {}))
    add("aten.logsumexp.default", lambda r: ((T(*bsh(r)), [2]), {}))
    add("aten.min.dim", lambda r: ((T(*bsh(r)), 0, True), {}))
    add("aten.amin.default", lambda r: ((T(*bsh(r)), [0, 2]), {}))
    add("aten._log_softmax.default", lambda r: ((T(*bsh(r)), 0, False), {}))
    add("aten.sort.default", lambda r: ((T(*bsh(r)), 1), {}))
    add(
        "aten.baddbmm.default",
        lambda r: ((T((m := dims(r, 4))[0], m[1], m[3]), T(*m[:3]), T(m[0], m[2], m[3])), {}),
    )
    add("aten.group_norm.default", lambda r: ((T(r.randint(2, 5), 4, 3), 2, T(4), T(4)), {}))
    add("aten.conv1d.default", lambda r: ((T(3, 4, 7), T(5, 4, 3), T(5)), {}))
    add("aten.max_pool2d_with_indices.default", lambda r: ((T(*dims(r, 2), 4, 6), [2, 2]), {}))
    add("aten.max_pool1d.default", lambda r: ((T(*dims(r, 2), 6), [2]), {}))
    add("aten.linalg_vector_norm.default", lambda r: ((T(*bsh(r)), 2, [1]), {}))
    add("aten.fill.Scalar", lambda r: ((T(*bsh(r)), 2.0), {}))
    add("aten.to.other", lambda r: ((T(*bsh(r)), torch.ones(2, dtype=torch.float32)), {}))
    add("aten.detach.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.scalar_tensor.default", lambda r: ((2.5,), {"dtype": f64}))
    add("aten.arange.start", lambda r: ((2, r.randint(4, 11)), {"dtype": f64}))
    # creation
    add("aten.arange.default", lambda r: ((r.randint(2, 9),), {"dtype": f64}))
    add("aten.arange.start_step", lambda r: ((1, 2 * r.randint(2, 9) + 1, 2), {"dtype": f64}))
    add("aten.zeros.default", lambda r: ((dims(r, 2),), {"dtype": f64}))
    add("aten.ones.default", lambda r: ((dims(r, 2),), {"dtype": f64}))
    add("aten.full.default", lambda r: ((dims(r, 2), 3.0), {"dtype": f64}))
    # norms
    add("aten.layer_norm.default", lambda r: ((T(*(s := bsh(r))), [s[2]], T(s[2]), T(s[2])), {}))
    add("aten.layer_norm.default", lambda r: ((T(*(s := bsh(r))), [s[1], s[2]], None, None), {}))
    add("aten.rms_norm.default", lambda r: ((T(*(s := bsh(r))), [s[2]], T(s[2]), 1e-6), {}))
    # attention
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, None))
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, "float"))
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, "bool"))
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, "causal"))
    # embedding
    add(
        "aten.embedding.default",
        lambda r: ((T(v := r.randint(2, 9), r.randint(2, 6)), torch.randint(0, v, dims(r, 2))), {}),
    )
    # losses
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 2))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 0))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, weight=True))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, smoothing=0.1))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, extra=True))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, prob=True))
    add("aten.nll_loss_nd.default", lambda r: _ce_case(r, T, 1, nll=True))
    add("aten.nll_loss_nd.default", lambda r: _ce_case(r, T, 2, nll=True, extra=True))
    add("aten.mse_loss.default", lambda r: ((T(*(s := bsh(r))), T(*s), 1), {}))
    add("aten.mse_loss.default", lambda r: ((T(*(s := bsh(r))), T(*s), 2), {}))
    # conv / pool
    add("aten.conv2d.default", lambda r: _conv_case(r, T, 1, 1))
    add("aten.conv2d.default", lambda r: _conv_case(r, T, 2, 0))
    add("aten.max_pool2d.default", lambda r: ((T(*dims(r, 2), 4, 6), [2, 2], [2, 2]), {}))
    add("aten.adaptive_avg_pool2d.default", lambda r: ((T(*dims(r, 2), 4, 6), [1, 1]), {}))
    add("aten.avg_pool2d.default", lambda r: ((T(*dims(r, 2), 4, 6), [2, 2]), {}))
    return C


def _lin(r: Any, T: Callable, bias: bool, two_d: bool = False) -> tuple[tuple, dict]:  # noqa: N803
    k, n = r.randint(2, 6), r.randint(2, 6)
    x = T(r.randint(2, 6), k) if two_d else T(r.randint(2, 5), r.randint(2, 5), k)
    return ((x, T(n, k), T(n)) if bias else (x, T(n, k))), {}


def _ein_case(r: Any, eq: str, spec: tuple[str, ...], T: Callable) -> tuple[tuple, dict]:  # noqa: N803
    size = {c: r.randint(2, 4) for c in set("".join(spec))}
    return (eq, [T(*[size[c] for c in s]) for s in spec]), {}


def _sdpa_case(r: Any, T: Callable, mask: str | None) -> tuple[tuple, dict]:  # noqa: N803
    import torch

    b, h, lq, s, e = r.randint(2, 4), r.randint(2, 4), r.randint(2, 5), r.randint(2, 5), r.randint(2, 5)
    if mask == "causal":
        s = lq
    q, k, v = T(b, h, lq, e), T(b, h, s, e), T(b, h, s, e + 1)
    if mask == "float":
        return (q, k, v, T(lq, s)), {}
    if mask == "bool":
        m = torch.rand(b, 1, lq, s) > 0.3
        m[..., 0] = True
        return (q, k, v, m), {}
    return (q, k, v, None, 0.0, mask == "causal"), {}


def _ce_case(
    r: Any,
    T: Callable,
    red: int,
    weight: bool = False,
    smoothing: float = 0.0,
    extra: bool = False,
    prob: bool = False,
    nll: bool = False,
) -> tuple[tuple, dict]:  # noqa: N803
    import torch

    n, c = r.randint(2, 7), r.randint(2, 5)
    shape = (n, c, r.randint(2, 4)) if extra else (n, c)
    x = T(*shape)
    if prob:
        tgt = torch.softmax(T(*shape), 1)
    else:
        tshape = (shape[0],) + shape[2:]
        tgt = torch.randint(0, c, tshape)
        tgt[torch.rand(tshape) < 0.25] = -100
    if nll:
        return (torch.log_softmax(x, 1), tgt, None, red, -100), {}
    w = T(c).abs() + 0.5 if weight else None
    return (x, tgt, w, red, -100, smoothing), {}


def _conv_case(r: Any, T: Callable, stride: int, pad: int) -> tuple[tuple, dict]:  # noqa: N803
    n, ci, co = r.randint(2, 4), r.randint(2, 4), r.randint(2, 4)
    return (T(n, ci, 5, 6), T(co, ci, 3, 3), T(co), [stride, stride], [pad, pad], [1, 1], 1), {}


_FIXED_RATIOS: tuple[tuple[float, ...], ...] = ((0.7, 0.3), (0.5, 0.0, 0.5), (0.4, 0.3, 0.2, 0.1))


def check(
    targets: Sequence[str] | None = None,
    *,
    trials: int = 20,
    seed: int = 0,
    shapes_per_case: int = 2,
    backward: bool = True,
) -> CheckReport:
    """Check every rule against the single-device op (see the section comment above).

    ``targets`` restricts the check to those ops (``"linear"`` matches ``aten.linear.*``); ``trials``
    random (n, ratios) draws per strategy (n = 2..4, zero ratios included) on top of three fixed
    uneven ones; backward is checked on the fixed draws.
    """
    global _STRICT
    t0 = time.perf_counter()
    _STRICT = True
    try:
        return _check(targets, trials, seed, shapes_per_case, backward, t0)
    finally:
        _STRICT = False


def _check(
    targets: Sequence[str] | None, trials: int, seed: int, shapes_per_case: int, backward: bool, t0: float
) -> CheckReport:
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows: list[CheckRow] = []
    cases = _cases()
    want = None
    if targets:
        want = [t if t.startswith("aten.") else f"aten.{t}." for t in targets]
    checked: set[str] = set()
    for target, build in cases:
        if want and not any(target == w or target.startswith(w) for w in want):
            continue
        checked.add(target)
        for _shape in range(shapes_per_case):
            try:
                args, kwargs = build(rng)
                g, op, full = _single_op(target, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - a broken sample is reported, not fatal
                rows.append(CheckRow(target, "?", "-", "crash", f"building the sample: {_short(exc)}"))
                continue
            case = " ".join(f"{list(t.shape)}" for t in (g.tensors[i] for i in op.inputs))
            try:
                strats = strategies(g, op)
            except Exception as exc:  # noqa: BLE001
                rows.append(CheckRow(target, case, "-", "crash", f"generating strategies: {_short(exc)}"))
                continue
            for s in strats:
                draws = [(r_, True) for r_ in _FIXED_RATIOS]
                for _ in range(max(0, trials // shapes_per_case - len(draws))):
                    nn = rng.randint(2, 4)
                    rs = [rng.choice((0.0, rng.random() + 0.05, rng.random() + 0.05)) for _ in range(nn)]
                    if sum(rs) == 0:
                        rs[0] = 1.0
                    draws.append((tuple(rs), False))
                status, detail = "ok", ""
                for ratios, fixed in draws:
                    try:
                        status, detail = _check_strategy(
                            g, op, full, s, len(ratios), ratios, rng.randrange(1 << 30), backward and fixed
                        )
                    except Exception as exc:  # noqa: BLE001
                        status, detail = "crash", _short(exc)
                    if status != "ok":
                        detail = f"ratios {list(ratios)}: {detail}"
                        break
                rows.append(CheckRow(target, case, str(s), status, detail))
    unchecked = () if want else tuple(sorted(set(_RULES) - checked))
    return CheckReport(tuple(rows), time.perf_counter() - t0, unchecked)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:240] if text else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """CLI body: ``python -m hapnb.triples --check [OP ...] [--trials N] [--seed S] [--list]``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m hapnb.triples", description="check hapnb's per-op sharding rules"
    )
    p.add_argument(
        "--check", nargs="*", metavar="OP", help="check all rules, or only these ops (e.g. linear)"
    )
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the rule tables")
    a = p.parse_args(argv)
    if a.list:
        for t, (fam, why) in registered().items():
            print(f"{fam:14s} {t:44s} {why}")
        return 0
    if a.check is None:
        p.print_help()
        return 2
    report = check(a.check or None, trials=a.trials, seed=a.seed)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
