"""Memory per device: what a program keeps on each GPU, by category, and its peak.

One set of rules, the *pieces* of a step (:func:`step_pieces`), serves three users: the exact breakdown at
integer shard lengths (:func:`memory_breakdown`, behind :meth:`hapnb.cost.model.CostModel.memory_breakdown` and
every report), the same model as a linear function of the ratios for the ratio LP (:func:`memory_linear`),
and the search's per-step increments (:mod:`hapnb.synth.memory_prune`). A piece is one tensor's contribution:

=============  ===========================================================================================
``param``      a parameter in its *stored* form: the parameter, its gradient and Adam's two states (x4)
``input``      a user input, buffer or constant as loaded
``saved``      an activation autograd keeps for the backward (:data:`SAVED_FOR_BACKWARD`; each (tensor,
               form, factor) once)
``gathered``   a ZeRO-2 parameter's full copy, all-gathered before its first use and kept until its backward
``output``     an op's output; the largest local one sets the backward's transient (its gradient and the
               input gradient made from it: twice)
``regather``   a sharded parameter's full size in the backward: ZeRO-2's full gradient before its
               reduce-scatter (x1), ZeRO-3's re-gathered weight plus that gradient (x2); the largest counts
``extra``      a final conversion (after the last step)
=============  ===========================================================================================

Per device, with P, In, A (saved + gathered), L (largest output), F (largest regather) and X (extras) in
bytes, the peak of one iteration is the larger of two phases::

    backward:       P + 2P (Adam) + In + A + (2L + F + X)      gradients grow as activations are freed
    optimizer step: P + P (gradients) + 2P (Adam) + In + P     one parameter-sized foreach temporary

i.e. ``raw = 3P + In + max(2P, A + 2L + F + X)``; a device model adds ``raw * memory_overhead +
memory_const_bytes`` (per GPU) and a virtual device splits the bytes over its GPUs. Every term only grows
as a program grows (sums and maxima of non-negative pieces), so the peak of a program's prefix is a lower
bound of the final peak: what the search prunes with.

ZeRO / FSDP (a parameter stored ``G(d)`` and all-gathered to ``I`` before use, :class:`hapnb.cost.model.Load`
with ``zero``): its parameter, gradient and Adam states are the shard; ZeRO-2 keeps the gathered copy
until the backward (``gathered``), ZeRO-3 frees it after the forward use and gathers it again in the
backward (``regather`` x2).

>>> from hapnb.cost.memory import peak_raw
>>> peak_raw(P=10, In=1, A=30, L=5, F=0, X=0)   # backward phase: 3*10 + 1 + 30 + 2*5
71.0
>>> peak_raw(P=10, In=1, A=0, L=0, F=0, X=0)    # optimizer phase: 3*10 + 1 + 2*10
51.0
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..ir.forms import Form, I
from ..ir.graph import Graph, Op
from ..rules import Strategy

__all__ = [
    "SAVED_FOR_BACKWARD",
    "MEMORY_CATEGORIES",
    "PIECE_KINDS",
    "Piece",
    "MemoryLinear",
    "SAVED_BY_NAME",
    "NOT_DIFFERENTIABLE",
    "SAME_STORAGE",
    "Storage",
    "storage",
    "saved_key",
    "saved_bytes",
    "is_alias",
    "saved_tensors",
    "step_pieces",
    "memory_breakdown",
    "memory_linear",
    "peak_raw",
    "largest_pieces",
    "overflow",
    "fits",
    "lean_linear",
]

#: What autograd keeps for the backward, per family: ``in`` (non-parameter inputs), ``in0``, ``out``,
#: ``qkvo`` (q, k, v, out + logsumexp: memory-efficient SDPA), ``ids`` (the indices), ``norm`` (input +
#: mean/rstd), ``loss`` (the log-probabilities, input-sized, + target), ``mask`` (dropout p>0: 1 byte per
#: element), ``none``. ReLU keeps its output; other pointwise ops their inputs. Not listed: ``in``.
SAVED_FOR_BACKWARD: Mapping[str, str] = MappingProxyType(
    {
        "matmul": "in",
        "linear": "in0",
        "conv": "in0",
        "attention": "qkvo",
        "embedding": "ids",
        "norm": "norm",
        "loss": "loss",
        "additive": "none",
        "view": "none",
        "select": "none",
        "creation": "none",
        "convert": "none",
        "random": "none",
        "reduction": "none",
        "dimwise": "out",
    }
)
#: What autograd keeps for the backward, by aten name, before the family's rule (:func:`saved_tensors`):
#: ``none`` (the gradient needs no tensor: sums, negation, copies, creation), ``out`` (the result),
#: ``other`` (products and quotients, matmuls: for each operand that needs a gradient, the other operands),
#: ``in0`` / ``in1`` (the condition of ``where``, the mask of ``masked_fill``). Read from PyTorch's
#: derivative formulas; tests/tracing/test_memory_saved.py checks the totals against autograd's saved tensors.
SAVED_BY_NAME: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(
            ("add", "sub", "rsub", "neg", "clone", "_to_copy", "to", "alias", "detach", "contiguous", "copy",
             "fill", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "cat", "stack", "expand",
             "slice_scatter", "select_scatter", "constant_pad_nd", "pad"),
            "none",
        ),
        **dict.fromkeys(("relu", "exp", "tanh", "sigmoid", "rsqrt", "sqrt", "reciprocal"), "out"),
        **dict.fromkeys(("mul", "div", "matmul", "bmm", "mm", "einsum"), "other"),
        "where": "in0",
        "masked_fill": "in1",
    }
)  # fmt: skip
#: Ops whose result autograd does not track (comparisons, logic, indices): they save nothing and what
#: they make needs no gradient.
NOT_DIFFERENTIABLE = frozenset(
    ("lt", "le", "gt", "ge", "eq", "ne", "__and__", "__or__", "bitwise_and", "bitwise_or", "bitwise_not",
     "logical_and", "logical_or", "logical_not", "argmax", "argmin", "sign", "floor_divide", "isnan")
)  # fmt: skip
#: Ops whose output is a view of their first input in eager PyTorch, or a copy eager skips (``clone`` and
#: ``to`` the tracer records where the model's dropout(p=0) or a same-dtype ``to`` returned its input):
#: a tensor saved through one of them is stored once (:func:`storage`).
SAME_STORAGE = frozenset(
    ("view", "_unsafe_view", "reshape", "flatten", "transpose", "t", "permute", "unsqueeze", "squeeze",
     "alias", "detach", "clone", "contiguous", "lift_fresh_copy", "_to_copy", "to", "type_as", "view_as",
     "reshape_as", "unflatten", "movedim")
)  # fmt: skip
#: A lowered group's statistics are at most 1/STAT_FRACTION of its largest input (:func:`storage`).
STAT_FRACTION = 16
#: The memory breakdown's categories (bytes each; they sum to the predicted peak).
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "inputs", "activations", "transient", "overhead")
#: Piece kinds (see the module docstring) and the category each lands in.
PIECE_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "param": "parameters",
        "input": "inputs",
        "saved": "activations",
        "gathered": "activations",
        "output": "transient",
        "regather": "transient",
        "extra": "transient",
    }
)

#: The order of the memory parts (see the module docstring).
_PARTS = ("P", "In", "A", "L", "F", "X")
#: The part a piece of each summed kind adds to (``output`` and ``regather`` set L and F by their maximum).
_PART_OF: Mapping[str, str] = MappingProxyType(
    {"param": "P", "input": "In", "saved": "A", "gathered": "A", "extra": "X"}
)


@dataclass(frozen=True)
class Piece:
    """One tensor's contribution to memory: ``kind`` from :data:`PIECE_KINDS`, the tensor in ``form``
    (cut for ``segment``'s ratios; -1: the tensor's own segment), times ``scale``; ``storage``: the tensor
    whose storage it is (a saved view; -1: its own)."""

    kind: str
    tensor: int
    form: Form
    segment: int = -1
    scale: float = 1.0
    storage: int = -1


@dataclass(frozen=True)
class MemoryLinear:
    """A fixed program's memory as a function of the ratios, for the LP. Each part is ``(const, coef)``:
    bytes ``const + sum_s coef[s] * r[s][j]`` on device j (a G-form tensor's local bytes are its bytes times
    the device's ratio, integer rounding aside). ``L``: the largest output is ``max(L_const, max_s
    L_coef[s] * r[s][j])``; ``F`` (the largest regather) does not depend on the ratios."""

    P: tuple[float, dict[int, float]]
    In: tuple[float, dict[int, float]]
    A: tuple[float, dict[int, float]]
    X: tuple[float, dict[int, float]]
    L_const: float
    L_coef: dict[int, float] = field(default_factory=dict)
    F: float = 0.0
    #: per part ("P", "In", "A", "X": summed; "L": the largest): the most the integer shard lengths can add
    #: to the continuous shares (a G-form tensor's shard is at most one length unit longer than its share)
    slack: Mapping[str, float] = field(default_factory=dict)

    def parts(self, r: Sequence[Sequence[float]], j: int) -> dict[str, float]:
        """The parts on device j at ratios ``r`` (continuous shares; for checks and tests)."""

        def val(p: tuple[float, dict[int, float]]) -> float:
            return p[0] + sum(c * r[s][j] for s, c in p[1].items())

        L = max([self.L_const] + [c * r[s][j] for s, c in self.L_coef.items()])
        return {"P": val(self.P), "In": val(self.In), "A": val(self.A), "X": val(self.X), "L": L, "F": self.F}

    def upper(self, ratios: Sequence[Sequence[float]], j: int, model: Any = None, gpus: int = 1) -> float:
        """An upper bound of the predicted peak bytes per GPU (:func:`memory_breakdown`'s sum) on device j at
        ``ratios``: the parts at the shares :func:`hapnb.ir.forms.shard_lengths` cuts (each row normalised)
        plus the :attr:`slack`, with the device model's overhead (``model``; ``gpus``: a virtual device's
        GPUs); infinite when a row cannot be cut."""
        rows = []
        for row in ratios:
            total = float(sum(row))
            if not total > 0 or min(row) < 0:
                return float("inf")
            rows.append([x / total for x in row])
        v = self.parts(rows, j)
        up = {k: x * (1 + 1e-9) + self.slack.get(k, 0.0) * (1 + 1e-6) for k, x in v.items()}
        raw = peak_raw(**up)
        over = model.memory_overhead if model is not None else 0.0
        if over < -1.0:
            return float("inf")
        const = model.memory_const_bytes * gpus if model is not None else 0.0
        return (raw * (1.0 + over) + const) / gpus * (1 + 1e-9) + 1.0


def peak_raw(P: float, In: float, A: float, L: float, F: float, X: float) -> float:
    """The raw peak (before the device model's overhead) from the parts (see the module docstring)."""
    return 3.0 * P + In + max(2.0 * P, A + 2.0 * L + F + X)


def is_alias(op: Op) -> bool:
    """``dropout(p=0)`` (or not training) returns its input: no kernel, no new storage."""
    if "dropout" not in op.target:
        return False
    args = list(op.args) + [None, None, None]
    p, train = args[1], args[2]
    return p == 0 or train is False


def _name(op: Op) -> str:
    """The aten name of an op's target (``aten.mul.Tensor`` -> ``mul``)."""
    parts = op.target.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _same_storage(g: Graph, op: Op) -> bool:
    """Whether ``op``'s output is its first input's storage in eager PyTorch: ``dropout(p=0)``, a view
    (:data:`SAME_STORAGE`), or a copy eager skips (a ``clone``/``to`` the tracer records for an op that
    returns its input) — one output with the input's element count and dtype."""
    if not (op.inputs and len(op.outputs) == 1):
        return False
    if not (is_alias(op) or _name(op) in SAME_STORAGE):
        return False
    a, b = g.tensors[op.inputs[0]], g.tensors[op.outputs[0]]
    return a.numel == b.numel and a.dtype == b.dtype


@dataclass(frozen=True)
class Storage:
    """What the saved-activation rules need to know of a whole graph (:func:`storage`): ``root`` maps a
    tensor to the tensor whose storage it is (:func:`_same_storage` chains); ``grad`` holds the tensors
    autograd tracks (trainable parameters and what is computed from them); ``keep`` restricts what an op
    lowered from a fused op (:attr:`hapnb.ir.graph.Op.origin`) may save of its own, by op id, and ``extra``
    lists the group's inputs it saves for the fused op."""

    root: Mapping[int, int]
    grad: frozenset[int]
    keep: Mapping[int, frozenset[int]]
    extra: Mapping[int, tuple[int, ...]]


def storage(g: Graph) -> Storage:
    """The :class:`Storage` facts of ``g`` (one pass over its ops).

    A group of ops lowered from one op (connected ops with the same ``origin``, e.g. the sums, products and
    square roots of a training batch norm) stands for the fused kernel the model called: it keeps the
    group's own floating-point inputs (as most ops keep theirs) and, of what the decomposition's ops save,
    only the small statistics (tensors at most 1/:data:`STAT_FRACTION` of the group's largest input, per
    channel or per row), not its full-size intermediates. Computed once per graph.
    """
    hit = _STORAGE.get(g)
    if hit is None:
        hit = _STORAGE[g] = _storage(g)
    return hit


#: :func:`storage` per graph (a graph is a frozen value compared by identity)
_STORAGE: weakref.WeakKeyDictionary[Graph, Storage] = weakref.WeakKeyDictionary()


def _storage(g: Graph) -> Storage:
    root: dict[int, int] = {}
    grad = {t.id for t in g.tensors if t.role == "param" and t.requires_grad}
    for op in g.ops:
        if _same_storage(g, op):
            root[op.outputs[0]] = root.get(op.inputs[0], op.inputs[0])
        if any(t in grad for t in op.inputs) and _name(op) not in NOT_DIFFERENTIABLE:
            grad.update(t for t in op.outputs if g.tensors[t].is_float)
    keep, extra = _lowered_groups(g)
    return Storage(MappingProxyType(root), frozenset(grad), MappingProxyType(keep), MappingProxyType(extra))


def _lowered_groups(g: Graph) -> tuple[dict[int, frozenset[int]], dict[int, tuple[int, ...]]]:
    """Per op of a group lowered from one fused op (see :func:`storage`): the tensors it may save of its
    own, and the group inputs it saves for the group (each at its first reader)."""
    group: dict[int, int] = {}  # op id -> a union-find parent

    def find(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    for op in g.ops:
        if not op.origin:
            continue
        group[op.id] = op.id
        for t in op.inputs:
            p = g.tensors[t].producer
            if p is not None and p in group and g.ops[p].origin == op.origin:
                group[find(op.id)] = find(p)
    members: dict[int, list[Op]] = {}
    for i in sorted(group):
        members.setdefault(find(i), []).append(g.ops[i])
    keep: dict[int, frozenset[int]] = {}
    extra: dict[int, tuple[int, ...]] = {}
    for ops in members.values():
        if len(ops) < 2:  # one op (an in-place op made functional): its own rule
            continue
        made = {t for op in ops for t in op.outputs}
        ins = [t for op in ops for t in op.inputs if t not in made and g.tensors[t].role == "activation"]
        ins = [t for t in ins if g.tensors[t].is_float]
        largest = max((g.tensors[t].numel for t in ins), default=0)
        small = frozenset(t for t in made if g.tensors[t].numel * STAT_FRACTION <= largest)
        first: dict[int, int] = {}
        for op in ops:
            keep[op.id] = small
            for t in op.inputs:
                if t in ins and t not in first:
                    first[t] = op.id
        for t, i in first.items():
            extra[i] = (*extra.get(i, ()), t)
    return keep, extra


def saved_tensors(
    g: Graph, op: Op, s: Strategy, grad: frozenset[int] | None = None
) -> list[tuple[int, Form, float]]:
    """Tensors (with the form the op uses and a byte factor) autograd keeps for ``op``'s backward.

    ``grad``: the tensors autograd tracks (:attr:`Storage.grad`; None: every input): an op none of whose
    inputs is tracked saves nothing, and a product keeps an operand only for another's gradient."""
    ins = list(zip(op.inputs, s.inputs))
    outs = list(zip(op.outputs, s.outputs))
    if grad is not None and not any(t in grad for t in op.inputs):
        return []
    name = _name(op)
    kind = SAVED_BY_NAME.get(name) or SAVED_FOR_BACKWARD.get(op.family, "in")
    if op.family == "pointwise" and name not in SAVED_BY_NAME:
        kind = "in"
        if "dropout" in op.target:
            kind = "none" if is_alias(op) else "mask"
    if kind == "none":
        return []
    if kind == "other":  # for each operand that needs a gradient, the others
        if grad is None:
            return [(t, f, 1.0) for t, f in ins]
        need = {k for k, (t, _) in enumerate(ins) if t in grad}
        return [(t, f, 1.0) for k, (t, f) in enumerate(ins) if need - {k}]
    if kind == "in0":
        return [(t, f, 1.0) for t, f in ins[:1]]
    if kind == "in1":
        return [(t, f, 1.0) for t, f in ins[1:2]]
    if kind == "out":
        return [(t, f, 1.0) for t, f in outs[:1]]
    if kind == "mask":
        t, f = outs[0]
        return [(t, f, 1.0 / max(1, g.tensors[t].itemsize))]
    if kind == "ids":
        return [(t, f, 1.0) for t, f in ins[1:2]]
    if kind == "qkvo":
        hd = g.tensors[op.inputs[0]].shape[-1] if g.tensors[op.inputs[0]].shape else 1
        lse = [(t, f, 1.0 / max(1, hd)) for t, f in outs[:1]]  # logsumexp: one float per row
        return [(t, f, 1.0) for t, f in ins[:3]] + [(t, f, 1.0) for t, f in outs[:1]] + lse
    if kind == "norm":
        t, f = ins[0]
        last = g.tensors[t].shape[-1] if g.tensors[t].shape else 1
        return [(t, f, 1.0 + 2.0 / max(1, last))]  # + mean and rstd per row
    if kind == "loss":
        return [(t, f, 1.0) for t, f in ins[:2]]  # log-probabilities (input-sized) + target
    return [(t, f, 1.0) for t, f in ins]


def load_pieces(g: Graph, ld: Any) -> list[Piece]:
    """Pieces of one load (a :class:`hapnb.cost.model.Load`): the stored form, and a ZeRO load's full copies."""
    t = g.tensors[ld.tensor]
    zero = getattr(ld, "zero", 0)
    stored = ld.stored if zero else ld.form
    if t.role != "param":
        return [Piece("input", ld.tensor, stored)]
    out = [Piece("param", ld.tensor, stored)]
    if zero == 2:
        out += [Piece("gathered", ld.tensor, I), Piece("regather", ld.tensor, I, scale=1.0)]
    elif zero == 3:
        out.append(Piece("regather", ld.tensor, I, scale=2.0))
    return out


def op_pieces(g: Graph, op: Op, s: Strategy, st: Storage) -> list[Piece]:
    """Pieces of one computation: its outputs (transient candidates) and what autograd saves (``st``:
    :func:`storage` of ``g``)."""
    out = []
    if op.family != "view" and not is_alias(op):
        for t, f in zip(op.outputs, s.outputs):
            if g.tensors[t].is_float:
                out.append(Piece("output", t, f, op.segment))
    keep = st.keep.get(op.id)
    saved = saved_tensors(g, op, s, st.grad)
    if keep is not None:
        saved = [x for x in saved if x[0] in keep]
        if any(t in st.grad for t in op.inputs):
            saved += [(t, s.inputs[op.inputs.index(t)], 1.0) for t in st.extra.get(op.id, ())]
    for t, f, scale in saved:
        r = st.root.get(t, t)
        if g.tensors[r].role == "activation":
            out.append(Piece("saved", t, f, op.segment, scale, r))
    return out


def saved_key(p: Piece, n: int) -> tuple[int, str, float]:
    """What makes two saved pieces one tensor in memory: the storage, its form (on one device every form
    is the whole tensor), the byte factor."""
    return (p.storage if p.storage >= 0 else p.tensor, str(p.form) if n > 1 else "", p.scale)


def _first_save(p: Piece, n: int, seen: set[tuple[int, str, float]]) -> bool:
    """Whether saved piece ``p`` is the first of its :func:`saved_key` (recorded in ``seen``)."""
    key = saved_key(p, n)
    if key in seen:
        return False
    seen.add(key)
    return True


def saved_bytes(g: Graph) -> float:
    """Bytes of activations the single-device program keeps for its backward (every form the whole
    tensor; each storage once): what :func:`hapnb.run.profile.measure_saved_bytes` measures in PyTorch.

    >>> from hapnb.tracing import zoo_graph
    >>> g, _ = zoo_graph("mlp", hidden=8, batch=4, layers=2)
    >>> saved_bytes(g) > 0
    True
    """
    st = storage(g)
    seen: set[tuple[int, str, float]] = set()
    total = 0.0
    for op in g.ops:
        rep = Strategy("replicate", (I,) * len(op.inputs), (I,) * len(op.outputs))
        for p in op_pieces(g, op, rep, st):
            if p.kind == "saved" and _first_save(p, 1, seen):
                total += g.tensors[p.tensor].nbytes * p.scale
    return total


def step_pieces(g: Graph, step: Any, st: Storage) -> list[Piece]:
    """Every piece of one :class:`hapnb.cost.model.Step` (its loads, then its computation)."""
    out = []
    for ld in step.loads:
        out += load_pieces(g, ld)
    return out + op_pieces(g, g.ops[step.op], step.strategy, st)


def _program_pieces(cm: Any, program: Sequence[Any], extra: Sequence[Any]) -> list[Piece]:
    """The pieces of a whole program, deduplicated as memory is: a tensor loaded once, an activation
    saved once per storage, form and factor (:func:`saved_key`)."""
    g = cm.graph
    st = storage(g)
    seen_load: set[int] = set()
    saved: set[tuple[int, str, float]] = set()
    out: list[Piece] = []
    for step in program:
        for ld in step.loads:
            if ld.tensor not in seen_load:
                seen_load.add(ld.tensor)
                out += load_pieces(g, ld)
        for p in op_pieces(g, g.ops[step.op], step.strategy, st):
            if p.kind != "saved" or _first_save(p, cm.n, saved):
                out.append(p)
    out += [Piece("extra", cv.tensor, cv.dst) for cv in extra]
    return out


def _fold(pieces: Sequence[Piece], local: Any, n: int) -> dict[str, list[float]]:
    """Per device parts ``P, In, A, L, F, X`` (one float per device) of ``pieces`` with ``local(piece) ->
    bytes per device``."""
    parts = {k: [0.0] * n for k in _PARTS}
    for p in pieces:
        sc = p.scale
        v = local(p)
        if p.kind in ("output", "regather"):
            row = parts["L" if p.kind == "output" else "F"]
            for j in range(n):
                x = sc * float(v[j])
                if x > row[j]:
                    row[j] = x
        else:
            row = parts[_PART_OF[p.kind]]
            for j in range(n):
                row[j] += sc * float(v[j])
    return parts


def memory_breakdown(
    cm: Any, program: Sequence[Any], extra: Sequence[Any], ratios: Sequence[Sequence[float]]
) -> tuple[dict[str, int], ...]:
    """Per GPU, the predicted peak of ``program`` on ``cm``'s cluster split by :data:`MEMORY_CATEGORIES`
    (bytes; they sum to the peak). See the module docstring for the model."""
    pieces = _program_pieces(cm, program, extra)
    parts = _fold(pieces, lambda p: cm._local(p.tensor, p.form, ratios, p.segment), cm.n)
    out = []
    for j, d in enumerate(cm.cluster.devices):
        P, In, A = float(parts["P"][j]), float(parts["In"][j]), float(parts["A"][j])
        transient = 2.0 * float(parts["L"][j]) + float(parts["F"][j]) + float(parts["X"][j])
        c = {"parameters": P, "gradients": P, "optimizer": 2.0 * P, "inputs": In}
        if 2.0 * P > A + transient:  # the optimizer step: gradients + one parameter-sized temporary
            c.update(activations=0.0, transient=P)
        else:  # the backward: gradients grow as saved activations are freed
            c.update(gradients=0.0, activations=A, transient=transient)
        m = d.model
        raw = sum(c.values())
        k = cm.gpus[j]
        c["overhead"] = raw * m.memory_overhead + m.memory_const_bytes * k if m else 0.0
        out.append({key: int(c[key] / k) for key in MEMORY_CATEGORIES})
    return tuple(out)


def _add_linear(cm: Any, part: list[Any], t: int, f: Form, seg: int, nbytes: float) -> None:
    """Add ``nbytes`` of tensor ``t`` in form ``f`` to a linear part ``[const, coef]``: a sharded (G-form)
    tensor's bytes scale with its segment's ratio (``seg`` -1: the tensor's own segment)."""
    if f.kind == "G" and cm.graph.tensors[t].shape:
        s = cm.segment_of[t] if seg < 0 else seg
        part[1][s] = part[1].get(s, 0.0) + nbytes
    else:
        part[0] += nbytes


def memory_linear(cm: Any, program: Sequence[Any], extra: Sequence[Any]) -> MemoryLinear:
    """``program``'s memory parts as linear functions of the ratios (see :class:`MemoryLinear`)."""
    g = cm.graph
    acc: dict[str, list[Any]] = {k: [0.0, {}] for k in ("P", "In", "A", "X")}
    L_const, L_coef, F = 0.0, {}, 0.0
    units = cm.theory.units
    slack = dict.fromkeys(("P", "In", "A", "X", "L"), 0.0)
    for p in _program_pieces(cm, program, extra):
        t = g.tensors[p.tensor]
        nbytes = float(t.nbytes) * p.scale
        if p.form.kind == "G" and t.shape and p.kind != "regather":  # a shard: up to one unit over its share
            size = t.shape[p.form.dim]
            over = nbytes / size * units.get((p.tensor, p.form.dim), (1, size))[0]
            key = "L" if p.kind == "output" else _PART_OF[p.kind]
            slack[key] = max(slack[key], over) if key == "L" else slack[key] + over
        if p.kind == "output":
            if p.form.kind == "G" and t.shape:
                seg = cm.segment_of[p.tensor] if p.segment < 0 else p.segment
                L_coef[seg] = max(L_coef.get(seg, 0.0), nbytes)
            else:
                L_const = max(L_const, nbytes)
        elif p.kind == "regather":
            F = max(F, nbytes)
        else:
            _add_linear(cm, acc[_PART_OF[p.kind]], p.tensor, p.form, p.segment, nbytes)
    return MemoryLinear(
        *(tuple(acc[k]) for k in ("P", "In", "A", "X")),  # type: ignore[arg-type]
        L_const=L_const,
        L_coef=L_coef,
        F=F,
        slack=slack,
    )


def largest_pieces(
    cm: Any,
    program: Sequence[Any],
    extra: Sequence[Any],
    ratios: Sequence[Sequence[float]],
    j: int,
    k: int = 5,
) -> list[tuple[str, str, int]]:
    """The ``k`` largest pieces on device j: ``(tensor name, what, bytes)``, what fills the memory first
    (a parameter counts its gradient and Adam states too)."""
    g = cm.graph
    label = {
        "param": "parameter + gradient + Adam states",
        "input": "input",
        "saved": "saved for the backward",
        "gathered": "ZeRO-2 gathered copy",
        "output": "output (backward transient)",
        "regather": "re-gathered in the backward",
        "extra": "final conversion",
    }
    rows = []
    for p in _program_pieces(cm, program, extra):
        v = cm._local(p.tensor, p.form, ratios, p.segment)[j] * p.scale * (4.0 if p.kind == "param" else 1.0)
        if p.kind == "output":
            v *= 2.0
        rows.append((g.tensors[p.tensor].name, f"{label[p.kind]} ({p.form})", int(v)))
    rows.sort(key=lambda r: (-r[2], r[0]))
    return rows[:k]


def overflow(
    cm: Any, program: Sequence[Any], extra: Sequence[Any], ratios: Sequence[Sequence[float]]
) -> list[int]:
    """Bytes per device by which ``program``'s predicted peak exceeds the device's memory (<= 0: fits)."""
    peak = cm.memory(program, extra, ratios)
    return [m - d.memory_bytes // d.gpus for m, d in zip(peak, cm.cluster.devices)]


def fits(
    cm: Any,
    program: Sequence[Any],
    extra: Sequence[Any],
    ratios: Sequence[Sequence[float]],
    linear: MemoryLinear | None = None,
) -> bool:
    """Whether ``program``'s predicted peak fits every device's memory (``max(overflow(...)) <= 0``).
    ``linear``: the program's :func:`memory_linear` (made once per program, for checks at several ratios):
    when its upper bound (:meth:`MemoryLinear.upper`) fits every device, the breakdown is not computed."""
    if linear is not None and all(
        linear.upper(ratios, j, d.model, k) <= d.memory_bytes // d.gpus
        for j, (d, k) in enumerate(zip(cm.cluster.devices, cm.gpus))
    ):
        return True
    return max(overflow(cm, program, extra, ratios)) <= 0


def lean_linear(cm: Any, pins: Mapping[int, Any]) -> MemoryLinear:
    """A lean estimate of the least memory a program can need, as a :class:`MemoryLinear`: every parameter
    and input in a sharded form where it can take one (its pin's form if pinned; a ZeRO pin's shard), every
    op under the strategy whose saved activations and outputs have the least replicated bytes (then the
    least sharded). For picking ratios that leave room (:func:`hapnb.synth.optimize.optimize`), not a bound."""
    g, th = cm.graph, cm.theory
    st = storage(g)
    seen: set[tuple[int, str, float]] = set()
    acc: dict[str, list[Any]] = {k: [0.0, {}] for k in ("P", "In", "A")}
    L_const, L_coef = 0.0, {}

    def add(key: str, t: int, f: Form, seg: int, scale: float = 1.0) -> None:
        _add_linear(cm, acc[key], t, f, seg, float(g.tensors[t].nbytes) * scale)

    for t in g.tensors:
        if t.role in ("param", "input", "buffer", "const") and t.consumers:
            pin = pins.get(t.id)
            gs = [f for f in th.forms[t.id] if f.kind == "G"]
            f = getattr(pin, "form", pin) if pin is not None else (gs[0] if gs else I)
            add("P" if t.role == "param" else "In", t.id, f, -1)
    for op, ss in zip(g.ops, th.strategies):

        def weight(s: Strategy, op: Op = op) -> tuple[float, float]:
            rep = shard = 0.0
            for p in op_pieces(g, op, s, st):
                nb = g.tensors[p.tensor].nbytes * p.scale
                if p.form.kind == "G":
                    shard += nb
                else:
                    rep += nb
            return rep, shard

        s = min(ss, key=weight)
        for p in op_pieces(g, op, s, st):
            if p.kind == "saved":
                if _first_save(p, cm.n, seen):
                    add("A", p.tensor, p.form, p.segment, p.scale)
            elif p.form.kind == "G":
                L_coef[op.segment] = max(L_coef.get(op.segment, 0.0), float(g.tensors[p.tensor].nbytes))
            else:
                L_const = max(L_const, float(g.tensors[p.tensor].nbytes))
    return MemoryLinear(
        *(tuple(acc[k]) for k in ("P", "In", "A")),  # type: ignore[arg-type]
        X=(0.0, {}),
        L_const=L_const,
        L_coef=L_coef,
    )
