"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards of
the weights and of the optimizer state, and a checkpoint loads onto any plan of the same model (another
cluster, other ratios, another number of ranks) or into the single-device model.

>>> hapnb.save_checkpoint("ckpt/step30", dm, opt, step=30, sched=sched.state_dict())  # doctest: +SKIP
>>> extra = hapnb.load_checkpoint("ckpt/step30", dm2, opt2)  # another plan: resharded  # doctest: +SKIP
>>> extra = hapnb.load_checkpoint("ckpt/step30", model, opt)  # one device, no process group  # doctest: +SKIP

How it is stored: each tensor is described by its global shape and the part this rank holds (a weight
sharded by the plan as the slice ``[start, start + length)`` of one dim, by the plan's shard lengths;
a replicated weight whole, written once). Optimizer state shaped like its parameter (Adam's
``exp_avg``/``exp_avg_sq``) is stored sharded as the parameter; scalar state (``step``) once. Keys are
the model's names (``model/<name>``, ``optim/<name>/<state>``), so DCP's resharding reads, for the
layout of the loading rank, the overlapping parts of whatever layout wrote them. A distributed module's
random stream (its seed and the draws so far, :mod:`hapnb.runtime.random_stream`) is stored too, so a
resumed run's random ops (drop path) draw on instead of repeating the first steps' numbers.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..runtime.random_stream import RandomStream
from .distribute import DistributedModule

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_keys"]

MODEL, OPTIM, GROUPS, EXTRA = "model/", "optim/", "optim_groups", "extra"
#: the random ops' stream of a distributed module (its seed and draws so far): resumed, they draw on
STREAM = "random_stream"


@dataclasses.dataclass(frozen=True)
class _Weight:
    """One local weight: its model names (the first is the one it is saved under), this rank's tensor
    (a slice of dim ``dim`` from ``start`` when ``dim >= 0``), the full shape, and the parameter object
    an optimizer holds (None for a buffer)."""

    names: tuple[str, ...]
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int = -1
    start: int = 0
    param: torch.Tensor | None = None

    def offsets(self) -> tuple[int, ...]:
        return tuple(self.start if d == self.dim else 0 for d in range(len(self.full_shape)))


@dataclasses.dataclass(frozen=True)
class _Slice:
    """This rank's part ``local`` of a tensor of global shape ``size``, at ``offsets``."""

    local: torch.Tensor
    size: tuple[int, ...]
    offsets: tuple[int, ...]


def _weights(target: torch.nn.Module) -> list[_Weight]:
    """The local weights of a :class:`DistributedModule` (by the plan's slices) or of a plain module
    (whole; a tied weight once, under all its names), in a fixed order."""
    if isinstance(target, DistributedModule):
        state = dict(target.module.named_parameters())
        state.update(dict(target.module.named_buffers()))
        keep = set(target.state_keys) if target.state_keys is not None else None
        out = []
        for p in target.program.params:
            names = tuple(nm for nm in p.names if keep is None or nm in keep)
            if p.kind == "const" or not names:
                continue  # a traced constant, or a buffer the model's state_dict leaves out
            t = state[p.local_name]
            out.append(
                _Weight(
                    names, t.detach(), tuple(p.full_shape), p.dim, p.start, t if p.kind == "param" else None
                )
            )
        return out
    if not isinstance(target, torch.nn.Module):
        raise TypeError(
            f"expected a hapnb.distribute() module or a torch.nn.Module, got {type(target).__name__}"
        )
    params = {id(p) for p in target.parameters()}
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in target.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    return [
        _Weight(
            tuple(names),
            tensors[k].detach(),
            tuple(tensors[k].shape),
            param=tensors[k] if k in params else None,
        )
        for k, names in groups.items()
    ]


def _value(w: _Weight, t: torch.Tensor) -> torch.Tensor | _Slice:
    """What is saved (or loaded into) for tensor ``t`` laid out as weight ``w``."""
    return _Slice(t, w.full_shape, w.offsets()) if w.dim >= 0 else t


def _param_names(weights: Sequence[_Weight], optimizer: torch.optim.Optimizer) -> list[list[_Weight]]:
    """The weight of every parameter of every group of ``optimizer`` (raises for one that is not the
    module's)."""
    by_id = {id(w.param): w for w in weights if w.param is not None}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        row = []
        for pi, p in enumerate(group["params"]):
            if id(p) not in by_id:
                raise ValueError(
                    f"optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a parameter of "
                    "the module: build the optimizer on dm.parameters() (or model.parameters() on one device)"
                )
            row.append(by_id[id(p)])
        out.append(row)
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _state_dict(
    target: torch.nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any]
) -> dict[str, Any]:
    weights = _weights(target)
    sd: dict[str, Any] = {MODEL + w.names[0]: _value(w, w.tensor) for w in weights}
    if optimizer is not None:
        groups = []
        for group, ws in zip(optimizer.param_groups, _param_names(weights, optimizer)):
            for p, w in zip(group["params"], ws):
                for k, v in optimizer.state.get(p, {}).items():
                    key = f"{OPTIM}{w.names[0]}/{k}"
                    if not torch.is_tensor(v):
                        sd[key] = v
                    elif w.dim >= 0 and v.dim() > 0:
                        if tuple(v.shape) != tuple(w.tensor.shape):
                            raise ValueError(
                                f"rank {_rank()}: optimizer state {k!r} of {w.names[0]} has shape {tuple(v.shape)}, "
                                f"neither this rank's shard {tuple(w.tensor.shape)} of the weight nor a scalar: "
                                "save_checkpoint stores state shaped like its parameter or scalar state only"
                            )
                        sd[key] = _value(w, v.detach())
                    else:
                        sd[key] = v.detach()
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [w.names[0] for w in ws]}
            )
        sd[GROUPS] = groups
    sd[EXTRA] = dict(extra)
    stream = _stream(target)
    if stream is not None:
        sd[STREAM] = {"seed": stream.seed, "draws": stream.draws}
    return sd


def _stream(target: torch.nn.Module) -> RandomStream | None:
    """The random stream of ``target``'s program (:mod:`hapnb.runtime.random_stream`), None without one."""
    return next((m for m in target.modules() if isinstance(m, RandomStream)), None)


@contextmanager
def _quiet() -> Iterator[None]:
    """Hide DCP's 'assuming the intent is to ... in a single process' warning (one device is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _planners() -> tuple[Any, Any]:
    """DCP save and load planners that also take :class:`_Slice` values (a rank's part of a tensor at
    its offsets in the global shape); everything else goes the default way."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    def chunk(s: _Slice) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=s.local.shape)

    class SavePlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> Any:
            everything = self.state_dict
            self.state_dict = {k: v for k, v in everything.items() if not isinstance(v, _Slice)}
            try:
                plan = super().create_local_plan()
            finally:
                self.state_dict = everything
            items = [
                WriteItem(
                    index=MetadataIndex(k, torch.Size(s.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk(s),
                        properties=TensorProperties.create_from_tensor(s.local),
                        size=torch.Size(s.size),
                    ),
                )
                for k, s in everything.items()
                if isinstance(s, _Slice) and s.local.numel()
            ]
            self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            v = self.state_dict[index.fqn]
            return v.local if isinstance(v, _Slice) else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            self.original_state_dict = self.state_dict = state_dict
            self.metadata, self.is_coordinator, self.mappings = metadata, is_coordinator, {}

        def create_local_plan(self) -> Any:
            plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, _Slice)}
            items = list(create_default_local_load_plan(plain, self.metadata, True).items)
            for k, s in self.state_dict.items():
                if isinstance(s, _Slice) and s.local.numel():
                    items += create_read_items_for_chunk_list(
                        k, self.metadata.state_dict_metadata[k], [chunk(s)]
                    )
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            v = self.state_dict[index.fqn]
            return v.local if isinstance(v, _Slice) else super().lookup_tensor(index)

    return SavePlanner(), LoadPlanner()


def save_checkpoint(
    path: str | os.PathLike[str],
    dm: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **extra: Any,
) -> None:
    """Save the weights and the optimizer state of ``dm`` sharded into the directory ``path`` (one file
    per rank, and DCP's ``.metadata``), with ``extra`` objects (a step count, an LR scheduler's
    ``state_dict()``, ...) pickled once.

    Call it on every rank of the job with the module of :func:`hapnb.distribute` (each rank writes its
    shards; a replicated tensor is written by one rank), or in one process with the single-device model.
    The optimizer must be built on ``dm.parameters()``; its state is stored by the model's parameter
    names, sharded as the parameters. Load with :func:`load_checkpoint`, onto any plan of the same model.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sd, failed = None, None
    try:
        sd = _state_dict(dm, optimizer, extra)
        Path(path).mkdir(parents=True, exist_ok=True)
    except Exception as e:  # every rank learns it: the others would wait in DCP's collectives
        failed = e
    _agree(failed, f"save_checkpoint({os.fspath(path)!r})")
    save, _ = _planners()
    with _quiet():
        dcp.save(sd, checkpoint_id=os.fspath(path), planner=save, no_dist=not dist.is_initialized())


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed to prepare ``what`` (its own error where it happened, one
    naming that rank elsewhere), before DCP's collectives, where the others would wait for it."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, None if error is None else f"{type(error).__name__}: {error}")
        if error is None:
            bad = next((r for r, e in enumerate(every) if e), None)
            if bad is not None:
                raise RuntimeError(f"{what} failed on rank {bad}: {every[bad]}")
    if error is not None:
        raise error


def checkpoint_keys(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...] | None]:
    """Every entry of the checkpoint at ``path``: a tensor's global shape, None for a pickled object."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _metadata(path)
    return {k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None for k, v in md.items()}


def _metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """DCP's description of every entry of the checkpoint at ``path``."""
    from torch.distributed.checkpoint import FileSystemReader

    if not Path(path, ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint: it has no .metadata file (save_checkpoint writes one when every rank "
            "has finished writing; a run that stopped while saving leaves none)"
        )
    return dict(FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata)


def _resolve(path: Any, keys: Mapping[str, Any], w: _Weight) -> str:
    """The name ``w`` is saved under in the checkpoint (any of its tied names), checking its shape."""
    name = next((nm for nm in w.names if MODEL + nm in keys), None)
    if name is None:
        raise ValueError(
            f"rank {_rank()}: checkpoint {path} has no weight {' / '.join(w.names)}: it was saved from another "
            "model (or with other tied weights)"
        )
    if keys[MODEL + name] != w.full_shape:
        raise ValueError(
            f"rank {_rank()}: checkpoint {path} holds {name} with shape {keys[MODEL + name]}, but the model's is "
            f"{w.full_shape}: it was saved from another model"
        )
    return name


def _optimizer_targets(
    path: Any, md: Mapping[str, Any], keys: Mapping[str, Any], optimizer: torch.optim.Optimizer,
    weights: Sequence[_Weight], names: Mapping[int, str], sd: dict[str, Any],
) -> list[tuple[torch.Tensor, str, str]]:  # fmt: skip
    """Add to ``sd`` a tensor to load each saved optimizer state of ``optimizer``'s parameters into
    (laid out as its parameter when shaped like it); returns ``(param, state, key)`` for each."""
    if GROUPS not in keys:
        raise ValueError(f"checkpoint {path} has no optimizer state: it was saved without an optimizer")
    out = []
    for group, ws in zip(optimizer.param_groups, _param_names(weights, optimizer)):
        on_device = bool(group.get("capturable") or group.get("fused"))
        for p, w in zip(group["params"], ws):
            prefix = f"{OPTIM}{names[id(w)]}/"
            for key in keys:
                if not key.startswith(prefix):
                    continue
                shape = keys[key]
                if shape is None:
                    sd[key] = None
                elif shape == w.full_shape and len(shape) > 0:
                    dtype = (
                        p.dtype if md[key].properties.dtype.is_floating_point else md[key].properties.dtype
                    )
                    sd[key] = _value(w, torch.zeros(w.tensor.shape, dtype=dtype, device=p.device))
                else:
                    dev = p.device if on_device else torch.device("cpu")
                    sd[key] = torch.zeros(shape, dtype=md[key].properties.dtype, device=dev)
                out.append((p, key[len(prefix) :], key))
    return out


def load_checkpoint(
    path: str | os.PathLike[str], dm: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` into ``dm`` (and ``optimizer``'s state and
    hyperparameters), in place; returns the ``extra`` objects it was saved with.

    ``dm`` is this rank's module of :func:`hapnb.distribute` on any plan of the same model (another
    cluster, other ratios, another number of ranks: each rank reads the parts of its own slices, from
    whichever ranks wrote them), called on every rank; or the single-device model in one process (no
    process group needed). The optimizer must be built on ``dm.parameters()`` with the same parameter
    groups as the saved one. Raises ValueError naming the tensor when the checkpoint is of another model.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sd: dict[str, Any] = {}
    targets: list[tuple[torch.Tensor, str, str]] = []
    failed, objects = None, {}
    try:
        md = _metadata(path)
        keys = checkpoint_keys(path)
        weights = _weights(dm)
        names = {id(w): _resolve(path, keys, w) for w in weights}
        unused = sorted({k for k in keys if k.startswith(MODEL)} - {MODEL + n for n in names.values()})
        if unused:
            raise ValueError(
                f"rank {_rank()}: checkpoint {path} holds weights the model does not have "
                f"({', '.join(k[len(MODEL) :] for k in unused[:5])}): it was saved from another model"
            )
        sd = {MODEL + names[id(w)]: _value(w, w.tensor) for w in weights}
        objects = _read_objects(
            path,
            [
                EXTRA,
                *([GROUPS] if optimizer is not None and GROUPS in keys else []),
                *([STREAM] if STREAM in keys else []),
            ],
        )
        if optimizer is not None:
            targets = _optimizer_targets(path, md, keys, optimizer, weights, names, sd)
            _check_groups(path, optimizer, _param_names(weights, optimizer), names, objects[GROUPS])
    except Exception as e:  # every rank learns it: the others would wait in DCP's collectives
        failed = e
    _agree(failed, f"load_checkpoint({os.fspath(path)!r})")
    _, load = _planners()
    with _quiet(), torch.no_grad():
        dcp.load(sd, checkpoint_id=os.fspath(path), planner=load, no_dist=not dist.is_initialized())
    if optimizer is not None:
        for group, was in zip(optimizer.param_groups, objects[GROUPS]):
            group.update({k: v for k, v in was.items() if k != "params"})
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for p, k, key in targets:
            v = load.state_dict[key]
            state.setdefault(p, {})[k] = v.local if isinstance(v, _Slice) else v
        optimizer.state.clear()
        optimizer.state.update(state)
    stream, saved = _stream(dm), objects.get(STREAM)
    if stream is not None and saved:  # the random ops draw on where the saved run stopped
        stream.seed, stream.draws = int(saved["seed"]), int(saved["draws"])
    return dict(objects[EXTRA] or {})


def _read_objects(path: str | os.PathLike[str], keys: Sequence[str]) -> dict[str, Any]:
    """The pickled objects ``keys`` of the checkpoint, read by this process alone (no collectives)."""
    import torch.distributed.checkpoint as dcp

    sd: dict[str, Any] = dict.fromkeys(keys)
    _, load = _planners()
    with _quiet():
        dcp.load(sd, checkpoint_id=os.fspath(path), planner=load, no_dist=True)
    return dict(load.state_dict)


def _check_groups(
    path: Any, optimizer: torch.optim.Optimizer, ws: Sequence[Sequence[_Weight]], names: Mapping[int, str],
    saved: Sequence[Mapping[str, Any]],
) -> None:  # fmt: skip
    """Check that the optimizer's parameter groups hold the saved groups' parameters (their
    hyperparameters, lr, betas, ..., are then set to the saved ones)."""
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint {path} was saved with an optimizer of {len(saved)} parameter groups, this one has "
            f"{len(optimizer.param_groups)}: build the optimizer's groups as in the run that saved it"
        )
    for gi, (row, was) in enumerate(zip(ws, saved)):
        mine = {names[id(w)] for w in row}
        if mine != set(was["params"]):
            diff = sorted(mine ^ set(was["params"]))
            raise ValueError(
                f"optimizer parameter group {gi} holds other parameters than the saved group {gi} of checkpoint "
                f"{path} (first difference: {diff[0]}): build the optimizer's groups as in the run that saved it"
            )
