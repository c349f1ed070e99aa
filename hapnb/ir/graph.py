"""The single-device program as values: reference tensors, ops and the graph that wires them (the IR).

:mod:`hapnb.tracing` builds a Graph from a PyTorch model; this module holds only the frozen values.

>>> t = TensorRef(0, "fc1.weight", (3, 4), "torch.float32", "param", requires_grad=True)
>>> t.ndim, t.numel, t.nbytes
(2, 12, 48)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = [
    "TensorRef", "Op", "Graph", "TraceError", "DeferredProgram", "map_args", "normalize_args", "fingerprint",
]  # fmt: skip


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and why."""


@dataclass(frozen=True)
class TensorRef:
    """A reference tensor ``e`` of the single-device program.

    ``role`` is one of ``input`` (a user input / placeholder), ``param`` (trainable parameter),
    ``buffer`` (non-trainable state, e.g. a mask), ``const`` (a constant lifted by tracing) or
    ``activation`` (produced by an op). ``name`` is the parameter/buffer FQN (``layers.0.fc1.weight``),
    the user input's argument name, or the fx node name of the producing op.
    """

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    producer: int | None = None
    consumers: tuple[int, ...] = ()
    requires_grad: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def numel(self) -> int:  # cached: the cost and memory models read it millions of times
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 4)

    @cached_property
    def nbytes(self) -> int:  # read ~10^5 times a synthesis by the cost model: computed once
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    def __str__(self) -> str:
        return f"{self.name}[{','.join(map(str, self.shape))}]"


_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One computation of the single-device program.

    ``target`` is the canonical op name (``aten.linear.default``); ``inputs`` are the tensor ids of its
    tensor arguments in argument order (a tensor used twice appears twice); ``outputs`` are the tensors it
    produces (several for tuple results). ``args``/``kwargs`` hold the op's arguments with every tensor
    replaced by a :class:`TensorArg` placeholder, so rules can read non-tensor arguments (dims, shapes,
    reductions). ``module`` is the owning module path (``layers.0.self_attn``); ``flops`` the analytic
    forward flop count from the op's rule family; ``segment`` the sharding-ratio segment.
    ``output_items`` is empty when the op returns one tensor; for a tuple/list result it gives, for
    every entry of ``outputs``, its position in the result (``outputs[k] = result[output_items[k]]``;
    unused results of the tuple have no tensor). ``origin`` is the op target this op was lowered from
    (:mod:`hapnb.tracing.lower`: an in-place or composite op without a rule, e.g. ``aten.pad.default``),
    empty for an op the model wrote itself.
    """

    id: int
    name: str
    target: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    module: str = ""
    flops: float = 0.0
    family: str = "unknown"
    segment: int = 0
    output_items: tuple[int, ...] = ()
    origin: str = ""

    @property
    def kw(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def __str__(self) -> str:
        return f"{self.name} = {self.target}"


@dataclass(frozen=True)
class TensorArg:
    """Marks where tensor number ``index`` of ``Op.inputs`` sits inside ``Op.args``/``Op.kwargs``."""

    index: int

    def __repr__(self) -> str:
        return f"%{self.index}"


def map_args(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every non-container value of an argument tree (tuples, lists, dicts), keeping
    its shape: the one walk used to fill :class:`TensorArg` placeholders or to rewrite constants.

    >>> map_args((TensorArg(0), [1, TensorArg(1)]), lambda v: "t" if isinstance(v, TensorArg) else v)
    ('t', [1, 't'])
    """
    if type(value) is tuple:
        return tuple(map_args(v, leaf) for v in value)
    if isinstance(value, list):
        return [map_args(v, leaf) for v in value]
    if isinstance(value, dict):
        return {k: map_args(v, leaf) for k, v in value.items()}
    return leaf(value)


class DeferredProgram:
    """``Graph.program`` of a graph built without its traced program — a zoo model recorded on meta tensors
    (:mod:`hapnb.tracing.record`) or read from the trace cache: ``make()`` traces the model with its weights
    (torch.export) when a program is first needed (:meth:`Graph.traced_program`: code generation,
    verification, bundles) and returns that program; the result is kept.

    >>> d = DeferredProgram(lambda: "the program", "demo")
    >>> d(), d
    ('the program', DeferredProgram(demo, traced))
    """

    def __init__(self, make: Callable[[], Any], label: str) -> None:
        self._make = make
        self.label = label
        self._program: Any = None

    def __call__(self) -> Any:
        if self._program is None:
            self._program = self._make()
        return self._program

    def __repr__(self) -> str:
        return f"DeferredProgram({self.label}, {'traced' if self._program is not None else 'not traced yet'})"


@dataclass(frozen=True, eq=False)
class Graph:
    """The traced single-device program (tensors, ops, inputs, parameters, loss).

    ``program`` keeps the traced artifact (a ``torch.export.ExportedProgram`` or an fx ``GraphModule``)
    for code generation, or a :class:`DeferredProgram` that traces it on first use (read it through
    :meth:`traced_program`); ``fingerprint`` identifies the graph structure (ops, shapes) so a plan can check
    it is applied to the program it was made for.
    """

    tensors: tuple[TensorRef, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    params: tuple[int, ...]
    loss: int
    program: Any = field(default=None, repr=False)
    fingerprint: str = ""
    name: str = "model"

    def traced_program(self) -> Any:
        """The traced program (ExportedProgram or fx GraphModule; None for hand-built graphs), tracing it
        now when the graph was built without it (:class:`DeferredProgram`)."""
        p = self.program
        return p() if isinstance(p, DeferredProgram) else p

    # ----------------------------------------------------------------- lookups
    def tensor(self, key: int | str) -> TensorRef:
        """A tensor by id or by name (parameter FQN, input name or fx node name)."""
        if isinstance(key, int):
            return self.tensors[key]
        t = self._by_name().get(key)
        if t is None:
            near = sorted(n for n in self._by_name() if key.split(".")[-1] in n)[:8]
            raise KeyError(f"no tensor named {key!r} in {self.name}; similar names: {near or 'none'}")
        return t

    def _by_name(self) -> dict[str, TensorRef]:
        cache = self.__dict__.get("_name_cache")
        if cache is None:
            cache = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_name_cache", cache)
        return cache

    @property
    def total_flops(self) -> float:
        """Forward flops of the whole program."""
        return sum(op.flops for op in self.ops)

    @property
    def param_bytes(self) -> int:
        return sum(self.tensors[t].nbytes for t in self.params if self.tensors[t].role == "param")

    def summary(self) -> str:
        n_param = sum(self.tensors[t].numel for t in self.params if self.tensors[t].role == "param")
        return (
            f"Graph {self.name}: {len(self.ops)} ops, {len(self.tensors)} tensors, "
            f"{n_param / 1e6:.2f} M parameters, {self.total_flops:.3e} forward flops, "
            f"loss {self.tensors[self.loss].name}"
        )

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        from .. import display

        return display.safe_html(display.graph_html, self)


def fingerprint(tensors: Sequence[TensorRef], ops: Sequence[Op]) -> str:
    """A stable hash of the graph structure (op targets, wiring, shapes, dtypes). The device a model was
    traced on is not part of it (a traced ``arange(..., device=...)``): a plan made from a model on the
    CPU runs the same model on a GPU."""
    import torch

    def nodev(v: Any) -> Any:
        return "device" if isinstance(v, torch.device) else v

    h = hashlib.sha256()
    for t in tensors:
        h.update(json.dumps([t.name, t.shape, t.dtype, t.role]).encode())
    for op in ops:
        args, kwargs = map_args(op.args, nodev), map_args(op.kwargs, nodev)
        h.update(json.dumps([op.target, op.inputs, op.outputs, repr(args), repr(kwargs)]).encode())
    return h.hexdigest()[:16]


def normalize_args(target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Args in aten schema order: every positional schema argument (defaults filled in), and only
    the keyword-only arguments that were given."""
    import torch

    if not isinstance(target, torch._ops.OpOverload):
        return tuple(args), dict(kwargs)
    schema = target._schema
    pos = [a for a in schema.arguments if not a.kwarg_only]
    out = list(args)
    kw = dict(kwargs)
    for a in pos[len(out) :]:
        if a.name in kw:
            out.append(kw.pop(a.name))
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            break
    return tuple(out), kw
