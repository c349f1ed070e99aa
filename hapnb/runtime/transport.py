"""The raw, autograd-free transfers behind :mod:`hapnb.runtime.collectives`.

A process group is read once into a :class:`_Ctx` (rank, world size, backend; a single rank when
torch.distributed is not initialised). Each ``_start_*`` function starts one collective on uneven slices
and returns ``(pending works, finish)``: ``finish()`` builds the result once the works are done, and
:func:`_run` waits and finishes. With ``async_op=False`` the communication is over when the start
returns (its works are None or already waited for). The collectives module wraps these in autograd functions whose backward is each one's dual, and in the
``*_async`` variants. Only primitives both gloo (CPU tensors) and NCCL (CUDA tensors) support are used.

>>> import torch
>>> ctx = _group_ctx(None)
>>> (ctx.rank, ctx.world)
(0, 1)
>>> _run(_start_all_gather(torch.ones(2, 3), 0, (2,), True, ctx, async_op=False)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hapnb.ir.forms import shard_offsets

Group = Any  # a torch.distributed ProcessGroup or None (the default group)


# --------------------------------------------------------------------------------------------------
# the process group
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ctx:
    """Rank, world size and backend of a process group (a single rank when dist is not initialised)."""

    rank: int
    world: int
    backend: str
    group: Group

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def _group_ctx(group: Group) -> _Ctx:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError(
                "a process group was passed but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first"
            )
        return _Ctx(rank=0, world=1, backend="none", group=None)
    return _Ctx(
        rank=dist.get_rank(group),
        world=dist.get_world_size(group),
        backend=str(dist.get_backend(group)),
        group=group,
    )


# --------------------------------------------------------------------------------------------------
# raw (autograd-free) implementations; each returns (list of pending works, finish callable)
# --------------------------------------------------------------------------------------------------

_Finish = Callable[[], torch.Tensor]


def _sized(x: torch.Tensor, dim: int, n: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = n
    return shape


def _pad_to(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """A fresh contiguous tensor of size ``n`` on ``dim`` holding ``x`` first and zeros after it."""
    out = x.new_zeros(_sized(x, dim, n))
    out.narrow(dim, 0, x.size(dim)).copy_(x)
    return out


def _copies_back(x: torch.Tensor, ctx: _Ctx) -> bool:
    """Whether the backend writes a broadcast's result into the root's own buffer as a tensor copy
    (gloo stages CUDA tensors through the host and copies back on every rank, the root included)."""
    return x.is_cuda and "gloo" in ctx.backend


def _start_all_gather(
    x: torch.Tensor, dim: int, lengths: tuple[int, ...], padded: bool, ctx: _Ctx, async_op: bool
) -> tuple[list[Any], _Finish]:
    if ctx.world == 1:
        y = x.contiguous()
        return [], lambda: y.clone() if y is x else y
    if padded:
        m = max(lengths)
        send = _pad_to(x, dim, m)
        if send.numel() == 0:  # every rank sees the same static sizes, so all skip together
            return [], lambda: x.new_empty(_sized(x, dim, sum(lengths)))
        bufs = [torch.empty_like(send) for _ in range(ctx.world)]
        work = dist.all_gather(bufs, send, group=ctx.group, async_op=async_op)

        def finish() -> torch.Tensor:
            return torch.cat([b.narrow(dim, 0, n) for b, n in zip(bufs, lengths)], dim=dim)

        return [work], finish
    # grouped: one broadcast per rank with exact-size buffers
    bufs = []
    works = []
    for i, n in enumerate(lengths):
        if i == ctx.rank:  # the root's buffer is only read; clone when async so x may change meanwhile,
            # and with gloo on CUDA tensors, whose broadcast copies the result back into the root's
            # buffer too (an in-place write autograd would see on a tensor saved for the backward)
            b = (
                x.clone(memory_format=torch.contiguous_format)
                if async_op or _copies_back(x, ctx)
                else x.contiguous()
            )
        else:
            b = x.new_empty(_sized(x, dim, n))
        bufs.append(b)
        if b.numel() == 0:
            continue
        works.append(dist.broadcast(b, src=ctx.global_rank(i), group=ctx.group, async_op=True))
    if not async_op:
        for w in works:
            w.wait()
        works = []
    return works, lambda: torch.cat(bufs, dim=dim)


def _start_reduce_scatter(
    x: torch.Tensor,
    dim: int,
    lengths: tuple[int, ...],
    padded: bool,
    ctx: _Ctx,
    async_op: bool,
    all_reduce_only: bool = False,
) -> tuple[list[Any], _Finish]:
    """``all_reduce_only`` takes the all-reduce + slice path of a padded reduce-scatter on every backend
    (backends without reduce_scatter, such as MPI, always take it)."""
    offs = shard_offsets(lengths)
    if ctx.world == 1:
        y = x.contiguous()
        return [], lambda: y.clone() if y is x else y
    if padded:
        m = max(lengths)
        if x.numel() == 0 or m == 0:
            return [], lambda: x.new_zeros(_sized(x, dim, lengths[ctx.rank]))
        own_off, own_len = offs[ctx.rank], lengths[ctx.rank]
        if all_reduce_only or "mpi" in ctx.backend:  # no reduce_scatter there
            buf = x.clone(memory_format=torch.contiguous_format)
            work = dist.all_reduce(buf, group=ctx.group, async_op=async_op)
            return [work], lambda: buf.narrow(dim, own_off, own_len).clone(
                memory_format=torch.contiguous_format
            )
        pieces = [_pad_to(x.narrow(dim, o, n), dim, m) for o, n in zip(offs, lengths)]
        out = torch.empty_like(pieces[0])
        work = dist.reduce_scatter(out, pieces, group=ctx.group, async_op=async_op)

        def finish() -> torch.Tensor:
            if own_len == m:
                return out
            return out.narrow(dim, 0, own_len).clone(memory_format=torch.contiguous_format)

        return [work], finish
    # grouped: one reduce per rank; root i receives the sum of slice i
    works = []
    mine = None
    for i, (o, n) in enumerate(zip(offs, lengths)):
        b = x.narrow(dim, o, n).clone(memory_format=torch.contiguous_format)
        if i == ctx.rank:
            mine = b
        if b.numel() == 0:
            continue
        works.append(dist.reduce(b, dst=ctx.global_rank(i), group=ctx.group, async_op=True))
    if not async_op:
        for w in works:
            w.wait()
        works = []
    assert mine is not None
    return works, lambda: mine


def _start_all_reduce(x: torch.Tensor, ctx: _Ctx, async_op: bool) -> tuple[list[Any], _Finish]:
    buf = x.clone(memory_format=torch.contiguous_format)
    if ctx.world == 1 or buf.numel() == 0:
        return [], lambda: buf
    work = dist.all_reduce(buf, group=ctx.group, async_op=async_op)
    return [work], lambda: buf


def _start_exchange(
    send: list[torch.Tensor],
    recv_shapes: list[list[int]],
    total_numel: int,
    like: torch.Tensor,
    ctx: _Ctx,
    async_op: bool,
) -> tuple[list[Any], Callable[[], list[torch.Tensor]]]:
    """Send ``send[j]`` to rank j and receive a tensor of ``recv_shapes[i]`` from every rank i.

    ``total_numel`` is the number of elements exchanged over the whole group (the same on every rank);
    when it is 0 no communication happens. One ``all_to_all_single`` with per-peer split sizes.
    """
    if ctx.world == 1:
        out = [s.clone(memory_format=torch.contiguous_format) for s in send]
        return [], lambda: out
    if total_numel == 0:  # every rank computes the same total, so all skip together
        return [], lambda: [like.new_empty(s) for s in recv_shapes]
    flat_in = torch.cat([s.reshape(-1) for s in send])
    in_splits = [s.numel() for s in send]
    out_splits = [_numel(s) for s in recv_shapes]
    flat_out = like.new_empty(sum(out_splits))
    work = dist.all_to_all_single(
        flat_out, flat_in, out_splits, in_splits, group=ctx.group, async_op=async_op
    )

    def finish() -> list[torch.Tensor]:
        return [piece.view(shape) for piece, shape in zip(flat_out.split(out_splits), recv_shapes)]

    return [work], finish


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _start_all_to_all(
    x: torch.Tensor,
    cat_dim: int,
    split_dim: int,
    cat_lengths: tuple[int, ...],
    split_lengths: tuple[int, ...],
    ctx: _Ctx,
    async_op: bool = False,
) -> tuple[list[Any], _Finish]:
    r = ctx.rank
    soffs = shard_offsets(split_lengths)
    send = [x.narrow(split_dim, o, n) for o, n in zip(soffs, split_lengths)]
    recv_shapes = []
    for i in range(ctx.world):
        shape = list(x.shape)
        shape[cat_dim] = cat_lengths[i]
        shape[split_dim] = split_lengths[r]
        recv_shapes.append(shape)
    other = _numel([s for k, s in enumerate(x.shape) if k not in (cat_dim, split_dim)])
    total = other * sum(cat_lengths) * sum(split_lengths)
    works, pieces = _start_exchange(send, recv_shapes, total, x, ctx, async_op)
    return works, lambda: torch.cat(pieces(), dim=cat_dim)


def _start_reshard(
    x: torch.Tensor, dim: int, old: tuple[int, ...], new: tuple[int, ...], ctx: _Ctx, async_op: bool = False
) -> tuple[list[Any], _Finish]:
    r = ctx.rank
    ooffs, noffs = shard_offsets(old), shard_offsets(new)

    def overlap(i: int, j: int) -> tuple[int, int]:
        """(start relative to rank i's old slice, length) of old slice i intersected with new slice j."""
        lo = max(ooffs[i], noffs[j])
        n = max(0, min(ooffs[i] + old[i], noffs[j] + new[j]) - lo)
        return (lo - ooffs[i], n) if n else (0, 0)

    n_world = ctx.world
    other = _numel([s for k, s in enumerate(x.shape) if k != dim])
    moved = other * sum(overlap(i, j)[1] for i in range(n_world) for j in range(n_world) if i != j)
    if moved == 0:  # nothing crosses ranks (the same on every rank): no communication
        if other == 0:
            return [], lambda: x.new_empty(_sized(x, dim, new[r]))
        y = x.narrow(dim, *overlap(r, r)).clone(memory_format=torch.contiguous_format)
        return [], lambda: y
    send = [x.narrow(dim, *overlap(r, j)) for j in range(n_world)]
    recv_shapes = [_sized(x, dim, overlap(i, r)[1]) for i in range(n_world)]
    works, pieces = _start_exchange(send, recv_shapes, moved, x, ctx, async_op)
    return works, lambda: torch.cat(pieces(), dim=dim)


def _raw_all_to_all(
    x: torch.Tensor,
    cat_dim: int,
    split_dim: int,
    cat_lengths: tuple[int, ...],
    split_lengths: tuple[int, ...],
    ctx: _Ctx,
) -> torch.Tensor:
    return _run(_start_all_to_all(x, cat_dim, split_dim, cat_lengths, split_lengths, ctx))


def _raw_reshard(
    x: torch.Tensor, dim: int, old: tuple[int, ...], new: tuple[int, ...], ctx: _Ctx
) -> torch.Tensor:
    return _run(_start_reshard(x, dim, old, new, ctx))


def _run(works_finish: tuple[list[Any], _Finish]) -> torch.Tensor:
    works, finish = works_finish
    for w in works:
        if w is not None:
            w.wait()
    return finish()
