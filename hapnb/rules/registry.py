"""The rule registry: strategy types, the op-target -> rule table, flop formulas, and the lookups.

This is the bottom of :mod:`hapnb.rules`; every family module registers its table here and nothing
here imports a family. A *rule* turns one traced :class:`~hapnb.ir.graph.Op` into its :class:`Strategy`
list (the op's Hoare triples ``{inputs} op {outputs}``) and, for a chosen strategy, into the
:class:`LocalCall` every rank runs on its local tensors. Ops without a hand rule run replicated, plus
whatever the fallback provider (rule discovery, :mod:`.discover`, installed through :func:`_set_fallback`
so nothing here imports it) finds; :func:`rule_source` says where an op's strategies come from.

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

Registration
------------
``_register(targets, family, gen, local=..., flops=..., reason=...)`` adds one rule per op target.
An op has exactly one rule: registering a target that already has one raises :class:`ValueError`
(naming the op and both registrations) unless ``override=True``.

>>> _register(["aten.relu.default"], "pointwise", lambda g, op: [])  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: aten.relu.default is registered twice: ...
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..ir.forms import Form, I, shard_offsets
from ..ir.graph import Graph, Op, TensorArg, TensorRef, map_args

__all__ = [
    "Strategy",
    "LocalContext",
    "LocalCall",
    "strategies",
    "flops",
    "family",
    "localize",
    "registered",
    "rule_source",
    "RULE_SOURCES",
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
    """One op's rule: its family, candidate generator, localizer, flop formula and the reason the
    family's algebra makes it sound."""

    family: str
    gen: Gen
    local: Loc | None
    flops: Flops
    reason: str

    @property
    def module(self) -> str:
        """The module whose table registered the rule (where its generator is defined)."""
        return getattr(self.gen, "__module__", None) or "?"

    def describe(self) -> str:
        return f"{self.family!r} in {self.module} ({self.reason or 'no reason given'})"


_RULES: dict[str, _Rule] = {}
#: sample cases for the ground-truth checker that family modules register with their tables:
#: ``(target, build(rng) -> (args, kwargs))`` (:func:`_register_samples`)
_SAMPLES: list[tuple[str, Callable[[Any], tuple[tuple, dict]]]] = []
_STRICT = False  # check() turns rule-generator errors into failures instead of warnings


def _register(
    targets: Iterable[str],
    family: str,
    gen: Gen,
    *,
    local: Loc | None = None,
    flops: Flops | None = None,
    reason: str = "",
    override: bool = False,
) -> None:
    """Register one rule for every op target in ``targets`` (``flops`` defaults to one flop per output
    element). A target that already has a rule (or appears twice in ``targets``) raises
    :class:`ValueError` naming both registrations, unless ``override=True`` replaces it."""
    targets = list(targets)
    rule = _Rule(family, gen, local, flops or _f_out, reason)
    seen: set[str] = set()
    for t in targets:
        if t in seen:
            raise ValueError(f"{t} appears twice in one registration as {rule.describe()}")
        seen.add(t)
        old = _RULES.get(t)
        if old is not None and not override:
            raise ValueError(
                f"{t} is registered twice: first as {old.describe()}, then as {rule.describe()}; "
                "an op has exactly one rule (pass override=True to replace it)"
            )
    for t in targets:
        _RULES[t] = rule


def _register_samples(cases: Iterable[tuple[str, Callable[[Any], tuple[tuple, dict]]]]) -> None:
    """Add a family's sample cases (``(target, build(rng) -> (args, kwargs))``, float64 tensors) to what
    the ground-truth checker (:mod:`.checker`) runs."""
    _SAMPLES.extend(cases)


def registered() -> dict[str, tuple[str, str]]:
    """Every op with a rule: ``{target: (family, reason)}``."""
    return {t: (r.family, r.reason) for t, r in sorted(_RULES.items())}


def family(target: str) -> str:
    """The rule family of an op target (``"matmul"``, ``"pointwise"``, ...) or ``"unknown"``."""
    r = _RULES.get(target)
    return r.family if r else "unknown"


@contextlib.contextmanager
def _strict() -> Iterator[None]:
    """Inside the block, a rule generator that raises makes :func:`strategies` raise (the checker
    reports it) instead of warning and falling back to the replicated strategy."""
    global _STRICT
    before, _STRICT = _STRICT, True
    try:
        yield
    finally:
        _STRICT = before


def _aten(target: str) -> Any:
    """The callable op overload of a canonical op name ``ns.op.overload``: ``aten.linear.default`` or a
    custom op registered with ``torch.library`` (``mylib.myop.default`` -> ``torch.ops.mylib.myop.default``).
    Raises :class:`KeyError` naming the op when there is none."""
    import torch

    parts = target.split(".")
    if len(parts) != 3 or not all(parts):
        raise KeyError(f"{target!r} is not an op name like 'aten.linear.default' or 'mylib.myop.default'")
    ns, name, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError) as exc:
        raise KeyError(
            f"{target!r} has no op overload torch.ops.{ns}.{name}.{overload} in this process"
            + ("" if ns == "aten" else f" (is the library that defines {ns}::{name} imported?)")
        ) from exc


# ------------------------------------------------------------------ rules of ops without a hand rule

#: The strategy source of ops without a hand rule: ``fallback(graph, op)`` -> candidates, set by
#: :mod:`.discover` when the package is imported (so nothing here imports it); None: replicated only.
_FALLBACK: Callable[[Graph, Op], Sequence[_Cand]] | None = None


def _set_fallback(provider: Callable[[Graph, Op], Sequence[_Cand]] | None) -> None:
    """Install (or, with None, remove) the provider of strategies for ops without a hand rule."""
    global _FALLBACK
    _FALLBACK = provider


#: where an op's strategies come from (:func:`rule_source`), in the order coverage reports list them
RULE_SOURCES: dict[str, str] = {
    "hand": "a hand-written rule table of hapnb.rules",
    "decomposed": "lowered at trace time (in-place or composite op without a rule) to ops with hand rules",
    "discovered": "no hand rule: strategies found by running the op on unevenly split random inputs",
    "none": "no rule: the op runs replicated, and so do the tensors it touches",
}


def rule_source(op: Op | str, graph: Graph | None = None) -> str:
    """Where the strategies of ``op`` come from: ``"hand"`` (a rule table), ``"decomposed"`` (an op with a
    hand rule that tracing lowered from an op without one: ``Op.origin`` is set), ``"discovered"`` (no
    hand rule; ground truth accepted strategies, :mod:`.discover`) or ``"none"`` (runs replicated).

    For an :class:`Op` with its ``graph`` the answer runs (or reads the cached) discovery for its shapes;
    for a target name (or an Op without its graph), "discovered" means some discovery of that target in
    this process accepted a strategy.

    >>> rule_source("aten.linear.default"), rule_source("aten.frobnicate.default")
    ('hand', 'none')
    """
    target = op if isinstance(op, str) else op.target
    if target in _RULES:
        return "decomposed" if isinstance(op, Op) and op.origin else "hand"
    if _FALLBACK is None:
        return "none"
    if isinstance(op, Op) and graph is not None:
        try:
            return "discovered" if _FALLBACK(graph, op) else "none"
        except Exception:  # noqa: BLE001 - a failing discovery means no discovered rule
            return "none"
    known = getattr(_FALLBACK, "known", None)
    return "discovered" if known is not None and known(target) else "none"


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
    """All valid strategies of ``op``; the replicated one (all I) comes first. No hand rule: it and the
    strategies discovery accepts (:mod:`.discover`; none when ``HAPNB_DISCOVER=0``).

    >>> import torch, hapnb
    >>> g = hapnb.trace(torch.nn.Linear(4, 3), (torch.randn(8, 4),), loss=lambda o: o.sum())
    >>> [str(s) for s in strategies(g, g.ops[0])][:3]
    ['replicate: (I,I,I) -> (I)', 'shard:a: (G0,I,I) -> (G0)', 'reduce:k: (G1,G1,I) -> (R)']
    """
    F = op.flops
    out = [Strategy("replicate", (I,) * len(op.inputs), (I,) * len(op.outputs), 0.0, 3.0 * F)]
    rule = _RULES.get(op.target)
    if rule is None:
        return tuple(out) + _fallback_strategies(graph, op, out[0])
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


def _fallback_strategies(graph: Graph, op: Op, replicate: Strategy) -> tuple[Strategy, ...]:
    """The strategies of an op without a hand rule from the fallback provider (discovery): candidates
    with a G form cost like 'shard' (3F scaled), the others (partial sums) 'full' (3F fixed)."""
    if _FALLBACK is None:
        return ()
    try:
        cands = list(_FALLBACK(graph, op))
    except Exception as exc:
        if _STRICT:
            raise
        warnings.warn(
            f"hapnb.rules: discovering strategies of {op.name} ({op.target}) failed ({_short(exc)}); "
            "the op runs replicated.",
            stacklevel=3,
        )
        return ()
    F = op.flops
    seen = {(replicate.inputs, replicate.outputs)}
    out = []
    for c in cands:
        if not _valid(graph, op, c) or (c.inputs, c.outputs) in seen:
            continue
        seen.add((c.inputs, c.outputs))
        sharded = any(f.is_gather for f in c.inputs + c.outputs)
        sc, fx = (3.0 * F, 0.0) if sharded else (0.0, 3.0 * F)
        out.append(Strategy(c.name, c.inputs, c.outputs, sc, fx))
    return tuple(out)


def localize(graph: Graph, op: Op, strategy: Strategy, ctx: LocalContext) -> LocalCall:
    """The call rank ``ctx.rank`` runs for ``op`` under ``strategy`` (shape args made local). An op
    without a hand rule (replicated or a discovered strategy) runs its own op overload with its original
    non-tensor arguments on the local tensors: that is what discovery checked."""
    rule = _RULES.get(op.target)
    if strategy.name == "replicate" or rule is None:
        try:
            fn = _aten(op.target)
        except KeyError as exc:
            raise KeyError(f"op {op.name} ({op.target}) has no op overload to run: {exc.args[0]}") from None
        return LocalCall(fn, op.args, op.kwargs)
    return (rule.local or _default_local)(graph, op, strategy, ctx)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:240] if text else type(exc).__name__
