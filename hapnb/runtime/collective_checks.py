"""Argument checks of :mod:`hapnb.runtime.collectives`: each public collective validates its tensor, dims and
shard lengths against the process group before it communicates, so a wrong call fails on every rank with a
message that names the argument, this rank's value and the fix (instead of hanging in a mismatched
collective).

>>> import torch
>>> _prep_gather("all_gather", torch.ones(2, 3), -1, (3,), None)[1:]
(1, (3,))
>>> _prep_gather("all_gather", torch.ones(2, 3), 0, (2, 1), None)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: all_gather: len(lengths)=2 but the process group has 1 ranks (...); pass exactly one shard ...
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from .transport import Group, _Ctx, _group_ctx


def _check_tensor(op: str, x: torch.Tensor, ctx: _Ctx) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if ctx.backend == "nccl" and x.device.type != "cuda":
        raise ValueError(
            f"{op}: the NCCL backend needs CUDA tensors, but rank {ctx.rank} passed a tensor on "
            f"{x.device}; move it with .cuda() or use the gloo backend for CPU tensors"
        )


def _norm_dim(op: str, x: torch.Tensor, dim: int, what: str = "dim") -> int:
    nd = x.dim()
    try:
        d = operator.index(dim)
    except TypeError:
        raise TypeError(f"{op}: {what} must be an int, got {dim!r}") from None
    if not -nd <= d < nd:
        raise ValueError(
            f"{op}: {what}={dim} is out of range for a tensor of shape {tuple(x.shape)} ({nd} dims)"
        )
    return d % nd


def _norm_lengths(op: str, lengths: Sequence[int], ctx: _Ctx, what: str = "lengths") -> tuple[int, ...]:
    try:
        out = tuple(operator.index(n) for n in lengths)
    except TypeError:
        raise TypeError(
            f"{op}: {what} must be a sequence of python ints (one per rank), got {lengths!r}"
        ) from None
    if any(n < 0 for n in out):
        raise ValueError(f"{op}: {what} must be non-negative, got {out}")
    if len(out) != ctx.world:
        hint = (
            " (torch.distributed is not initialised, so this process counts as a single rank)"
            if ctx.backend == "none"
            else ""
        )
        raise ValueError(
            f"{op}: len({what})={len(out)} but the process group has {ctx.world} ranks{hint}; "
            f"pass exactly one shard length per rank, e.g. hapnb.ir.forms.shard_lengths(size, ratios)"
        )
    return out


def _check_local(op: str, x: torch.Tensor, dim: int, lengths: tuple[int, ...], ctx: _Ctx, what: str) -> None:
    if x.size(dim) != lengths[ctx.rank]:
        raise ValueError(
            f"{op}: rank {ctx.rank} holds a {what} of shape {tuple(x.shape)} whose size on dim {dim} is "
            f"{x.size(dim)}, but {'lengths' if what == 'shard' else what}[rank]={lengths[ctx.rank]} "
            f"(lengths={lengths}); pass this rank's own slice, or fix the lengths"
        )


def _check_full(op: str, x: torch.Tensor, dim: int, lengths: tuple[int, ...], ctx: _Ctx, what: str) -> None:
    if x.size(dim) != sum(lengths):
        raise ValueError(
            f"{op}: rank {ctx.rank} holds a {what} tensor of shape {tuple(x.shape)} whose size on dim {dim} "
            f"is {x.size(dim)}, but sum(lengths)={sum(lengths)} (lengths={lengths}); the lengths must add "
            f"up to the full size of dim {dim}"
        )


def _prep_gather(
    op: str, x: torch.Tensor, dim: int, lengths: Sequence[int], group: Group
) -> tuple[_Ctx, int, tuple[int, ...]]:
    g = _group_ctx(group)
    _check_tensor(op, x, g)
    d = _norm_dim(op, x, dim)
    lens = _norm_lengths(op, lengths, g)
    _check_local(op, x, d, lens, g, "shard")
    return g, d, lens


def _prep_scatter(
    op: str, x: torch.Tensor, dim: int, lengths: Sequence[int], group: Group
) -> tuple[_Ctx, int, tuple[int, ...]]:
    g = _group_ctx(group)
    _check_tensor(op, x, g)
    d = _norm_dim(op, x, dim)
    lens = _norm_lengths(op, lengths, g)
    _check_full(op, x, d, lens, g, "partial-sum (R)")
    return g, d, lens


def _prep_all_to_all(
    op: str,
    x: torch.Tensor,
    cat_dim: int,
    split_dim: int,
    cat_lengths: Sequence[int],
    split_lengths: Sequence[int],
    group: Group,
) -> tuple[_Ctx, int, int, tuple[int, ...], tuple[int, ...]]:
    g = _group_ctx(group)
    _check_tensor(op, x, g)
    cd = _norm_dim(op, x, cat_dim, "cat_dim")
    sd = _norm_dim(op, x, split_dim, "split_dim")
    if cd == sd:
        raise ValueError(
            f"{op}: cat_dim and split_dim are both {cd}; to change the shard lengths of one dim use "
            "reshard(x, dim, old_lengths, new_lengths)"
        )
    cl = _norm_lengths(op, cat_lengths, g, "cat_lengths")
    sl = _norm_lengths(op, split_lengths, g, "split_lengths")
    _check_local(op, x, cd, cl, g, "cat_lengths")
    _check_full(op, x, sd, sl, g, "input")
    return g, cd, sd, cl, sl


def _prep_reshard(
    op: str, x: torch.Tensor, dim: int, old_lengths: Sequence[int], new_lengths: Sequence[int], group: Group
) -> tuple[_Ctx, int, tuple[int, ...], tuple[int, ...]]:
    g = _group_ctx(group)
    _check_tensor(op, x, g)
    d = _norm_dim(op, x, dim)
    old = _norm_lengths(op, old_lengths, g, "old_lengths")
    new = _norm_lengths(op, new_lengths, g, "new_lengths")
    if sum(old) != sum(new):
        raise ValueError(
            f"{op}: old_lengths {old} sum to {sum(old)} but new_lengths {new} sum to {sum(new)}; "
            "both must add up to the full size of the dim"
        )
    _check_local(op, x, d, old, g, "old_lengths")
    return g, d, old, new
