"""What a rank program is made of, and the helpers code generation and the single-device program share:
:class:`RankProgram` (the module, its local weights as :class:`LocalParam`, how it cuts its inputs), the
model's weights by graph name (:func:`program_weights`, tied names grouped by :func:`tied_groups`), and how
a traced op's constants are rewritten for the program that runs them (dtype, device, strides, dropout)."""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..ir.graph import Graph, map_args
from . import collectives as C
from .random_stream import from_stream, is_random

__all__ = [
    "CodegenError", "LocalParam", "RankProgram", "COLLECTIVE_FUNCTIONS", "DROPOUT_TARGETS", "NATIVE_DROPOUT",
    "DEVICE_ANCHOR", "STRIDE_FREE", "count_collectives", "program_weights", "tied_groups", "ident", "retype",
    "redevice", "zero_dropout", "strip_prefix", "device_anchor", "as_run", "run_constants", "has_dropout",
    "when_training", "TRAINING_FLAG",
]  # fmt: skip


class CodegenError(ValueError):
    """The plan cannot be turned into a per-rank program (names the instruction and why)."""


#: hapnb.runtime.collectives functions that communicate (what the plan's communicating instructions become)
COLLECTIVE_FUNCTIONS = (C.all_gather, C.reduce_scatter, C.all_reduce, C.all_to_all, C.reshard)

DROPOUT_TARGETS = ("aten.dropout.default", "aten.feature_dropout.default", "aten.alpha_dropout.default")
NATIVE_DROPOUT = "aten.native_dropout.default"


@dataclass(frozen=True)
class LocalParam:
    """How one parameter/buffer/constant of the model lives on a rank.

    ``local_name`` is the attribute in the rank's GraphModule, ``name`` the model's FQN (graph tensor
    name), ``kind`` ``param``/``buffer``/``const``. ``form`` is ``"I"`` when the rank holds the full tensor
    and ``"G<d>"`` when it holds the slice ``[start, start + length)`` of dim ``dim``; ``lengths`` are
    every rank's slice lengths on that dim (empty for full tensors). ``aliases`` are the model's other
    names of the same tensor (tied parameters, e.g. GPT-2's ``wte.weight`` and ``lm_head.weight``): one
    local weight, listed once in :attr:`RankProgram.unique_params`.
    """

    local_name: str
    name: str
    kind: str
    form: str
    full_shape: tuple[int, ...]
    dim: int = -1
    start: int = 0
    length: int = 0
    lengths: tuple[int, ...] = ()
    requires_grad: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every model name of this weight: ``name`` first, then its tied ``aliases``."""
        return (self.name, *self.aliases)

    @property
    def sharded(self) -> bool:
        return self.dim >= 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor ``full``."""
        if not self.sharded:
            return full
        return full.narrow(self.dim, self.start, self.length)


@dataclass(frozen=True, eq=False)
class RankProgram:
    """The program one rank runs: ``module(*inputs)`` returns the rank's partial loss (R form).

    ``params`` maps every model weight name to its local weight and slice (see :class:`LocalParam`; a
    tied parameter once per name, every record naming the one local weight); :attr:`unique_params`
    lists each local weight once (what an optimizer or a norm must see);
    ``input_names`` are the placeholders in order; ``input_slices`` gives, per input, ``(dim, start,
    length)`` of the slice the program expects when ``inputs == "local"`` (``dim == -1``: the full input).
    """

    module: fx.GraphModule
    rank: int
    n: int
    params: tuple[LocalParam, ...]
    input_names: tuple[str, ...]
    input_slices: tuple[tuple[int, int, int], ...]
    inputs: str
    loss: str
    fingerprint: str = ""
    notes: tuple[str, ...] = field(default=())
    #: local names of the replicated parameters whose gradients stay partial in the program and must be
    #: all-reduced by the runtime (``grad_sync="buckets"``, :class:`hapnb.run.buckets.GradBuckets`), in
    #: order of first use in the forward; empty with ``grad_sync="sync"`` (the program all-reduces them)
    grad_sync: tuple[str, ...] = ()
    #: the global shape of every input the program was made for (empty: not recorded)
    input_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def code(self) -> str:
        """The generated Python source of the rank's forward."""
        return self.module.code

    @property
    def unique_params(self) -> tuple[LocalParam, ...]:
        """One record per local weight, in ``params`` order: a tied parameter once, under its first name
        with the others as ``aliases``."""
        seen: set[str] = set()
        out = []
        for p in self.params:
            if p.local_name not in seen:
                seen.add(p.local_name)
                out.append(p)
        return tuple(out)

    def param(self, name: str) -> LocalParam:
        """The local parameter record of model tensor ``name`` (FQN, a tied alias included) or of local
        attribute ``name``."""
        for p in self.params:
            if p.name == name or p.local_name == name:
                return p
        for p in self.params:
            if name in p.aliases:
                return p
        raise KeyError(f"rank {self.rank} program has no parameter {name!r}")

    def local_inputs(self, *full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Cut the full global inputs to what this program expects (identity when ``inputs='full'``); a
        global batch of another shape than planned is refused (it would be cut short or fail on some
        ranks only)."""
        if len(full) != len(self.input_names):
            raise TypeError(
                f"the program takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                f"got {len(full)}"
            )
        for name, x, want in zip(self.input_names, full, self.input_shapes):
            if tuple(x.shape) != tuple(want):
                raise ValueError(
                    f"rank {self.rank}: input {name} has shape {tuple(x.shape)}, but the program takes the global "
                    f"batch as {tuple(want)} (its shapes and loss scale are fixed when it is planned); feed "
                    "batches of the planned shape, or synthesize a plan for this batch"
                )
        if self.inputs == "full":
            return tuple(full)
        out = []
        for x, (d, start, length) in zip(full, self.input_slices):
            out.append(x if d < 0 else x.narrow(d, start, length))
        return tuple(out)

    def collective_count(self) -> int:
        """Number of communicating collective calls in the module's graph."""
        return count_collectives(self.module)

    def __repr__(self) -> str:
        nshard = sum(1 for p in self.params if p.sharded)
        return (
            f"RankProgram(rank {self.rank}/{self.n}, {len(self.module.graph.nodes)} nodes, "
            f"{self.collective_count()} collectives, {len(self.params)} weights ({nshard} sharded), "
            f"inputs={self.inputs!r})"
        )


def count_collectives(gm: fx.GraphModule) -> int:
    """How many ``call_function`` nodes of ``gm`` call a communicating :mod:`hapnb.runtime.collectives` function."""
    return sum(1 for nd in gm.graph.nodes if nd.op == "call_function" and nd.target in COLLECTIVE_FUNCTIONS)


# ------------------------------------------------------------------------------------------- weights


def strip_prefix(path: str) -> str:
    from ..tracing import module_path as strip

    return strip(path)


def program_weights(graph: Graph) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and constant of the traced program by graph tensor name (model FQN)."""
    prog = graph.traced_program()
    if prog is None:
        raise CodegenError(
            f"graph {graph.name} has no traced program to take weights from; pass weights={{name: tensor}}"
        )
    out: dict[str, torch.Tensor] = {}
    if isinstance(prog, torch.export.ExportedProgram):
        sig = prog.graph_signature
        src: dict[str, str] = {}
        src.update(sig.inputs_to_parameters)
        src.update(sig.inputs_to_buffers)
        src.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
        state = dict(prog.state_dict)
        consts = dict(prog.constants)
        holders = [
            nd
            for nd in prog.graph.nodes
            if nd.op == "placeholder" and nd.name in src and isinstance(nd.meta.get("val"), torch.Tensor)
        ]
        if len(holders) != len(graph.params):
            raise CodegenError(
                f"graph {graph.name} lists {len(graph.params)} weights but its exported program has "
                f"{len(holders)}; the graph was not traced from this program"
            )
        for nd, tid in zip(holders, graph.params):
            fqn = src[nd.name]
            t = state[fqn] if fqn in state else consts.get(fqn)
            if t is None:
                raise CodegenError(f"the exported program has no tensor for {fqn}")
            out[graph.tensors[tid].name] = t
        return out
    if isinstance(prog, torch.nn.Module):
        named = {strip_prefix(k): v for k, v in prog.named_buffers()}
        named.update({strip_prefix(k): v for k, v in prog.named_parameters(remove_duplicate=False)})
        for tid in graph.params:
            nm = graph.tensors[tid].name
            if nm not in named:
                raise CodegenError(f"the traced module has no parameter or buffer {nm}")
            out[nm] = named[nm]
        return out
    raise CodegenError(f"cannot read weights from a program of type {type(prog).__name__}")


def tied_groups(weights: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, list[str]]:
    """Names of ``names`` whose weights are one tensor (tied parameters: the same memory, shape and
    strides), each mapped to its group in ``names`` order; names that share with no other are left out.

    >>> w = torch.zeros(3, 2)
    >>> tied_groups({"a": w, "b": torch.ones(2), "c": w}, ["a", "b", "c"])
    {'a': ['a', 'c'], 'c': ['a', 'c']}
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for nm in names:
        t = weights[nm]
        if t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key, []).append(nm)
    return {nm: members for members in groups.values() if len(members) > 1 for nm in members}


# ------------------------------------------------------------------------------------------- helpers


def ident(name: str, used: set[str]) -> str:
    base = re.sub(r"\W", "_", name) or "t"
    if base[0].isdigit() or keyword.iskeyword(base) or hasattr(torch.nn.Module, base):
        base = "w_" + base
    nm, k = base, 1
    while nm in used:
        nm = f"{base}_{k}"
        k += 1
    used.add(nm)
    return nm


def retype(value: Any, dtype: torch.dtype | None) -> Any:
    """Replace float32 and half dtype constants in an argument tree by ``dtype`` (for float64 verification):
    float32, and the half types of a model traced in bfloat16 or float16 (its casts, such as an RMSNorm's
    return to the input's dtype, and export's dtype assertions name them), so that every float the program
    makes is ``dtype`` as its weights are."""
    if dtype is None:
        return value
    return map_args(value, lambda v: dtype if isinstance(v, torch.dtype) and v in _RETYPED else v)


#: the floating dtypes :func:`retype` replaces (an explicit float64 in a model's code stays float64)
_RETYPED = frozenset({torch.float32, torch.bfloat16, torch.float16})


#: ops whose traced form depends on the strides the tracing device gave (a ``view`` after a
#: transpose is valid where the kernel before it left the data in that order, and fails where another
#: device's kernel did not): the program runs them as ``reshape``, a view where one is possible
STRIDE_FREE: Mapping[Any, Any] = {
    torch.ops.aten.view.default: torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default,
}

#: a zero-size, non-persistent buffer of every program that makes tensors: its device is where the
#: program runs (``module.to(device)`` moves it), read by the ops the trace gave a fixed device
DEVICE_ANCHOR = "_hapnb_device"


def redevice(value: Any, device: Callable[[], Any]) -> Any:
    """Replace ``torch.device`` constants in an argument tree (a traced ``arange(..., device=cpu)``, a
    ``.to(cpu)``) by ``device()``, the node of the device the program runs on."""
    return map_args(value, lambda v: device() if isinstance(v, torch.device) else v)


def device_anchor(module: torch.nn.Module, graph: fx.Graph) -> fx.Node:
    """Register :data:`DEVICE_ANCHOR` on ``module`` and add, at ``graph``'s insertion point, the node of
    its device: where the program runs."""
    module.register_buffer(DEVICE_ANCHOR, torch.empty(0), persistent=False)
    return graph.call_function(getattr, (graph.get_attr(DEVICE_ANCHOR), "device"))


def run_constants(value: Any, dtype: torch.dtype | None, device: Callable[[], Any]) -> Any:
    """An argument tree's traced constants as a program runs them: float32 and half dtypes as ``dtype``, fixed
    devices as the program's own."""
    return redevice(retype(value, dtype), device)


def as_run(
    fn: Any,
    args: tuple,
    kwargs: dict,
    *,
    dtype: torch.dtype | None,
    dropout: bool,
    device: Callable[[], Any],
    stream: Callable[[], Any],
) -> tuple[Any, tuple, dict]:
    """A traced op's call as a program runs it: float32 and half dtype constants as ``dtype``, fixed devices as the
    program's own (``device()``), when ``dropout`` is off every dropout the identity (``dropout_p`` zeroed,
    ``train=False``), a random op drawing from the program's stream (``stream()``, the node of its
    :class:`~hapnb.runtime.random_stream.RandomStream`), a stride-dependent view as ``reshape``
    (:data:`STRIDE_FREE`). The one rewrite rank programs and the single-device program share."""
    args, kwargs = run_constants(args, dtype, device), run_constants(kwargs, dtype, device)
    if not dropout:
        args, kwargs = zero_dropout(fn, args, kwargs, all_dropout=True)
    if is_random(fn):  # the same numbers on every rank and on one device
        fn, args = from_stream(fn), (stream(), *args)
    return STRIDE_FREE.get(fn, fn), args, kwargs


#: the attribute of a rank program's module that says whether it trains (``nn.Module.training``): what
#: the program's dropout reads at run time (:func:`when_training`)
TRAINING_FLAG = "training"


def has_dropout(fn: Any) -> bool:
    """Whether op ``fn`` drops out: an aten dropout (a ``train`` argument) or an attention with
    ``dropout_p``."""
    schema = getattr(fn, "_schema", None)
    return schema is not None and any(a.name in ("train", "dropout_p") for a in schema.arguments)


_WHEN_TRAINING: dict[Any, Callable[..., Any]] = {}


def when_training(fn: Any) -> Callable[..., Any]:
    """``fn`` with a leading ``training`` flag: as traced while the module trains, without dropout when it
    does not (``train=False``, ``dropout_p=0``), so ``module.eval()`` switches a rank program's dropout
    off as it does the model's (one named function per ``fn``, callable as an fx op).

    >>> f = when_training(torch.ops.aten.dropout.default)
    >>> x = torch.ones(4)
    >>> f.__name__, torch.equal(f(False, x, 0.5, True), x)
    ('when_training_dropout_default', True)
    """
    w = _WHEN_TRAINING.get(fn)
    if w is None:

        def w(training: bool, *args: Any, **kwargs: Any) -> Any:
            if not training:
                args, kwargs = zero_dropout(fn, args, kwargs, all_dropout=True)
            return fn(*args, **kwargs)

        name = "when_training_" + "".join(ch if ch.isalnum() else "_" for ch in getattr(fn, "__name__", "op"))
        w.__name__ = w.__qualname__ = name
        _WHEN_TRAINING[fn] = w
    return w


def zero_dropout(fn: Any, args: tuple, kwargs: dict, *, all_dropout: bool = False) -> tuple[tuple, dict]:
    """Set an op's ``dropout_p`` argument (scaled_dot_product_attention and friends) to 0, and with
    ``all_dropout`` also a dropout's ``train`` argument to False (the op is then the identity)."""
    schema = getattr(fn, "_schema", None)
    if schema is None:
        return args, kwargs
    zeroed = {"dropout_p": 0.0, **({"train": False} if all_dropout else {})}
    for k, a in enumerate(schema.arguments):
        if a.name in zeroed:
            if a.name in kwargs:
                kwargs = {**kwargs, a.name: zeroed[a.name]}
            elif k < len(args) and not a.kwarg_only:
                args = (*args[:k], zeroed[a.name], *args[k + 1 :])
    return args, kwargs
