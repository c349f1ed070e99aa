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

__all__ = [
    "CodegenError", "LocalParam", "RankProgram", "COLLECTIVE_FUNCTIONS", "DROPOUT_TARGETS", "NATIVE_DROPOUT",
    "DEVICE_ANCHOR", "STRIDE_FREE", "count_collectives", "program_weights", "tied_groups", "ident", "retype",
    "redevice", "zero_dropout", "strip_prefix", "device_anchor", "as_run", "run_constants",
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
    every rank's slice lengths on that dim (empty for full tensors).
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

    ``params`` maps every local weight to its model FQN and slice (see :class:`LocalParam`);
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

    @property
    def code(self) -> str:
        """The generated Python source of the rank's forward."""
        return self.module.code

    def param(self, name: str) -> LocalParam:
        """The local parameter record of model tensor ``name`` (FQN) or of local attribute ``name``."""
        for p in self.params:
            if p.name == name or p.local_name == name:
                return p
        raise KeyError(f"rank {self.rank} program has no parameter {name!r}")

    def local_inputs(self, *full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Cut the full global inputs to what this program expects (identity when ``inputs='full'``)."""
        if len(full) != len(self.input_names):
            raise TypeError(
                f"the program takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                f"got {len(full)}"
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
    """Replace float32 dtype constants in an argument tree by ``dtype`` (for float64 verification)."""
    if dtype is None:
        return value
    return map_args(value, lambda v: dtype if isinstance(v, torch.dtype) and v == torch.float32 else v)


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
    """An argument tree's traced constants as a program runs them: float32 dtypes as ``dtype``, fixed
    devices as the program's own."""
    return redevice(retype(value, dtype), device)


def as_run(
    fn: Any, args: tuple, kwargs: dict, *, dtype: torch.dtype | None, dropout: bool, device: Callable[[], Any]
) -> tuple[Any, tuple, dict]:
    """A traced op's call as a program runs it: float32 dtype constants as ``dtype``, fixed devices as the
    program's own (``device()``), ``dropout_p`` zeroed when ``dropout`` is off, a stride-dependent view
    as ``reshape`` (:data:`STRIDE_FREE`). The one rewrite rank programs and the single-device program
    share."""
    args, kwargs = run_constants(args, dtype, device), run_constants(kwargs, dtype, device)
    if not dropout:
        args, kwargs = zero_dropout(fn, args, kwargs)
    return STRIDE_FREE.get(fn, fn), args, kwargs


def zero_dropout(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Set an op's ``dropout_p`` argument (scaled_dot_product_attention and friends) to 0."""
    schema = getattr(fn, "_schema", None)
    if schema is None:
        return args, kwargs
    for k, a in enumerate(schema.arguments):
        if a.name == "dropout_p":
            if a.name in kwargs:
                kwargs = {**kwargs, a.name: 0.0}
            elif k < len(args) and not a.kwarg_only:
                args = (*args[:k], 0.0, *args[k + 1 :])
    return args, kwargs
