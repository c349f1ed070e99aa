"""The single-device program as a module hapnb can run: the traced program with its weights (tied
parameters one Parameter again), dropout optionally off, cast for float64 verification, and runnable on any
device (:func:`reference_module`); :func:`reference_params` maps its parameters to the model's names."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.fx as fx

from ..ir.graph import Graph
from .program import (
    CodegenError,
    as_run,
    device_anchor,
    strip_prefix,
    tied_groups,
)
from .random_stream import STREAM_ATTR, RandomStream

__all__ = ["reference_module", "reference_params"]


def reference_module(
    graph: Graph, dropout: bool = False, dtype: torch.dtype | str | None = None, seed: int | None = None
) -> Any:
    """The single-device program as an fx GraphModule: ``module(*inputs)`` is the loss.

    Parameters live under their model FQNs (``module.get_parameter(fqn)`` with the traced wrapper's
    ``model.`` prefix; use :func:`reference_params` for a name -> parameter map). ``dropout=False``
    replaces dropout by identity, like :func:`generate`; ``dtype`` casts floating weights and float32 and half dtype
    constants (float64 verification). Random ops draw from a
    :class:`~hapnb.runtime.random_stream.RandomStream` seeded with ``seed`` (default
    ``torch.initial_seed()``): the numbers a rank program (:func:`generate`) given the same seed draws.
    """
    prog = graph.traced_program()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(prog, torch.export.ExportedProgram):
        with warnings.catch_warnings():  # torch's own deprecation noise from copying pytree specs
            warnings.simplefilter("ignore")
            gm = prog.module()
            _tie(gm)  # before the copy: deepcopy clones each Parameter, so shared memory must be one object
            gm = copy.deepcopy(gm)  # never train the traced program's own weights
    elif isinstance(prog, torch.nn.Module):
        gm = copy.deepcopy(prog)
        _tie(gm)
    else:
        raise CodegenError(f"graph {graph.name} has no traced program to run on one device")
    if not isinstance(gm, fx.GraphModule):
        raise CodegenError(f"the traced program of {graph.name} is not an fx GraphModule")
    changed = False
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    made: dict[str, fx.Node] = {}

    def runtime_device() -> fx.Node:
        if "device" not in made:
            with gm.graph.inserting_before(first):
                made["device"] = device_anchor(gm, gm.graph)
        return made["device"]

    def stream() -> fx.Node:
        if "stream" not in made:
            gm.add_module(STREAM_ATTR, RandomStream(torch.initial_seed() if seed is None else seed))
            with gm.graph.inserting_before(first):
                made["stream"] = gm.graph.get_attr(STREAM_ATTR)
        return made["stream"]

    for nd in list(gm.graph.nodes):
        if nd.op != "call_function":
            continue
        fn, a, kw = as_run(
            nd.target, tuple(nd.args), dict(nd.kwargs), dtype=dtype, dropout=dropout, device=runtime_device,
            stream=stream,
        )  # fmt: skip
        if (fn, a, kw) != (nd.target, tuple(nd.args), dict(nd.kwargs)):
            nd.target, nd.args, nd.kwargs = fn, a, kw
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    if dtype is not None:
        for p in gm.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in list(gm.named_buffers()):
            if b.is_floating_point():
                mod, _, leaf = name.rpartition(".")
                owner = gm.get_submodule(mod) if mod else gm
                owner._buffers[leaf] = b.to(dtype)
    # lifted constants are plain tensor attributes: make them non-persistent buffers, so that
    # ``module.to(device)`` moves them and the state dict does not list them
    for mod in gm.modules():
        for name, v in [(k, v) for k, v in vars(mod).items() if isinstance(v, torch.Tensor)]:
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            delattr(mod, name)
            mod.register_buffer(name, v, persistent=False)
    return gm


def _tie(module: torch.nn.Module) -> None:
    """Make tied parameters one ``Parameter`` again: a loaded exported program gives each name its own
    Parameter over shared memory, so each would get only part of the gradient and its own update."""
    named = dict(module.named_parameters(remove_duplicate=False))
    for members in tied_groups(named, list(named)).values():
        first = named[members[0]]
        for name in members[1:]:
            if named[name] is not first:
                owner, _, leaf = name.rpartition(".")
                (module.get_submodule(owner) if owner else module)._parameters[leaf] = first


def reference_params(graph: Graph, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Graph tensor name (model FQN) -> parameter of a :func:`reference_module`."""
    out = {}
    named = {strip_prefix(k): p for k, p in module.named_parameters(remove_duplicate=False)}
    for tid in graph.params:
        t = graph.tensors[tid]
        if t.role == "param" and t.name in named:
            out[t.name] = named[t.name]
    return out
