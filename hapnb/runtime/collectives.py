"""Uneven-shard collectives with autograd duals (the runtime half of HAP's instruction set).

Forms (see :mod:`hapnb.ir.forms`): ``G(d)`` = rank-ordered contiguous slices along ``d`` whose integer
lengths ``lengths`` (one per rank, uneven, zeros allowed) are static Python ints; ``I`` = every rank
holds the full tensor; ``R`` = every rank holds a full-shape partial sum.

Every rank back-propagates its own partial loss, so gradients of ``I`` tensors are partial and gradients
of ``G`` shards and ``R`` tensors are complete. Each collective's backward is therefore its dual:

============================  ================  =====================================
function                      forward           backward (of the gradient)
============================  ================  =====================================
:func:`all_gather`            ``G(d) -> I``     reduce-scatter (padded or grouped)
:func:`reduce_scatter`        ``R -> G(d)``     all-gather (padded or grouped)
:func:`all_reduce`            ``R -> I``        all-reduce
:func:`all_to_all`            ``G(a) -> G(b)``  all-to-all ``G(b) -> G(a)``
:func:`reshard`               ``G(d) -> G(d)``  reshard back to the old lengths
:func:`shard`                 ``I -> G(d)``     nothing (plain autograd of a slice)
:func:`replicate`             identity          all-reduce (replicated parameters)
:func:`to_partial`            ``I -> R``        rank 0 keeps the gradient, others get 0
:func:`gather_param`          ``G(d) -> I``     reduce-scatter; ops under :func:`regathering` gather it
                                                again for their backward instead of keeping it (ZeRO-3)
============================  ================  =====================================

``padded=True`` collectives pad every slice to ``max(lengths)`` and use one equal-size collective
(traffic grows with the largest shard); ``padded=False`` ("grouped") issues one broadcast / reduce per
rank with exact-size buffers (traffic grows with the sum of shards, more calls).

Rank and world size come from ``group`` (the default group when ``None``). When torch.distributed is
not initialised and ``group`` is ``None``, every function acts as a single rank (world size 1), which is
handy for checking generated programs in one process:

>>> import torch
>>> x = torch.arange(6.0).reshape(3, 2)
>>> all_gather(x, 0, (3,)).tolist()
[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
>>> shard(x, 1, (2,)).shape
torch.Size([3, 2])

The ``*_async`` variants start the forward communication and return an :class:`AsyncCollective` whose
``wait()`` gives the result; the result is connected to autograd and its backward runs synchronously.
Works on gloo (CPU tensors) and NCCL (CUDA tensors); only primitives both support are used.

Every communicating call takes ``where=``, a label of what it runs for (generated rank programs pass
``"instruction k (...)"``). It costs nothing while the collective runs; when the backend raises (a
timeout, a peer that went away), the error becomes a
:class:`~hapnb.runtime.collective_errors.CollectiveError` naming this rank, the label, forward or
backward (the dual in the backward keeps its forward's label) and the timeout.

This module holds each collective's autograd function (forward and dual), the public calls, ZeRO-3
regathering and the async variants. The raw transfers they run are in :mod:`hapnb.runtime.transport`, and
the argument checks in :mod:`hapnb.runtime.collective_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hapnb.ir.forms import shard_offsets

from .collective_checks import (
    _check_full,
    _check_tensor,
    _norm_dim,
    _norm_lengths,
    _prep_all_to_all,
    _prep_gather,
    _prep_reshard,
    _prep_scatter,
)
from .collective_errors import guarded
from .transport import (
    Group,
    _Ctx,
    _Finish,
    _group_ctx,
    _raw_all_to_all,
    _raw_reshard,
    _run,
    _start_all_gather,
    _start_all_reduce,
    _start_all_to_all,
    _start_reshard,
)
from .transport import _start_reduce_scatter as _start_reduce_scatter_raw

__all__ = [
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "reshard",
    "shard",
    "replicate",
    "to_partial",
    "gather_param",
    "regathering",
    "regathered",
    "all_gather_async",
    "reduce_scatter_async",
    "all_reduce_async",
    "all_to_all_async",
    "reshard_async",
    "AsyncCollective",
]

#: what a collective runs for, named in its error (``instruction 7 (...)``; :mod:`.collective_errors`)
Where = str | None

# Set to True to take the all-reduce + slice path for padded reduce-scatter on every backend (tests use
# it to exercise the fallback that backends without reduce_scatter take).
_FORCE_ALL_REDUCE_FOR_REDUCE_SCATTER = False


def _start_reduce_scatter(
    x: torch.Tensor, dim: int, lengths: tuple[int, ...], padded: bool, ctx: _Ctx, async_op: bool
) -> tuple[list[Any], _Finish]:
    """The transport's reduce-scatter, taking the all-reduce + slice path while the test hook
    ``_FORCE_ALL_REDUCE_FOR_REDUCE_SCATTER`` is set."""
    return _start_reduce_scatter_raw(
        x, dim, lengths, padded, ctx, async_op, all_reduce_only=_FORCE_ALL_REDUCE_FOR_REDUCE_SCATTER
    )


# --------------------------------------------------------------------------------------------------
# the communication of each collective, under its label (a backend error names it: collective_errors)
# --------------------------------------------------------------------------------------------------


def _gather(x: torch.Tensor, dim: int, lengths: tuple[int, ...], padded: bool, g: _Ctx, where: Where) -> Any:
    return guarded(
        g.rank, g.group, "all_gather", where,
        lambda: _run(_start_all_gather(x, dim, lengths, padded, g, async_op=False)),
    )  # fmt: skip


def _scatter(x: torch.Tensor, dim: int, lengths: tuple[int, ...], padded: bool, g: _Ctx, where: Where) -> Any:
    return guarded(
        g.rank, g.group, "reduce_scatter", where,
        lambda: _run(_start_reduce_scatter(x, dim, lengths, padded, g, async_op=False)),
    )  # fmt: skip


def _reduce(x: torch.Tensor, g: _Ctx, where: Where) -> Any:
    return guarded(
        g.rank, g.group, "all_reduce", where, lambda: _run(_start_all_reduce(x, g, async_op=False))
    )


def _to_all(
    x: torch.Tensor, cd: int, sd: int, cl: tuple[int, ...], sl: tuple[int, ...], g: _Ctx, where: Where
) -> Any:
    return guarded(g.rank, g.group, "all_to_all", where, _raw_all_to_all, x, cd, sd, cl, sl, g)


def _recut(
    x: torch.Tensor, dim: int, old: tuple[int, ...], new: tuple[int, ...], g: _Ctx, where: Where
) -> Any:
    return guarded(g.rank, g.group, "reshard", where, _raw_reshard, x, dim, old, new, g)


# --------------------------------------------------------------------------------------------------
# autograd functions
# --------------------------------------------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, lengths, padded, g, where):  # type: ignore[override]
        ctx.args = (dim, lengths, padded, g, where)
        return _gather(x, dim, lengths, padded, g, where)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dim, lengths, padded, g, where = ctx.args
        return _scatter(grad, dim, lengths, padded, g, where), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, lengths, padded, g, where):  # type: ignore[override]
        ctx.args = (dim, lengths, padded, g, where)
        return _scatter(x, dim, lengths, padded, g, where)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dim, lengths, padded, g, where = ctx.args
        return _gather(grad, dim, lengths, padded, g, where), None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, where):  # type: ignore[override]
        ctx.args = (g, where)
        return _reduce(x, g, where)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce(grad, *ctx.args), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cat_dim, split_dim, cat_lengths, split_lengths, g, where):  # type: ignore[override]
        ctx.args = (cat_dim, split_dim, cat_lengths, split_lengths, g, where)
        return _to_all(x, cat_dim, split_dim, cat_lengths, split_lengths, g, where)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cat_dim, split_dim, cat_lengths, split_lengths, g, where = ctx.args
        gx = _to_all(grad, split_dim, cat_dim, split_lengths, cat_lengths, g, where)
        return gx, None, None, None, None, None, None


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, old, new, g, where):  # type: ignore[override]
        ctx.args = (dim, old, new, g, where)
        return _recut(x, dim, old, new, g, where)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dim, old, new, g, where = ctx.args
        return _recut(grad, dim, new, old, g, where), None, None, None, None, None


class _Replicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, where):  # type: ignore[override]
        ctx.args = (g, where)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce(grad, *ctx.args), None, None


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def all_gather(
    x: torch.Tensor,
    dim: int,
    lengths: Sequence[int],
    *,
    padded: bool = True,
    group: Group = None,
    where: Where = None,
) -> torch.Tensor:
    """``G(dim) -> I``: concatenate every rank's slice along ``dim``; ``x`` is this rank's slice.

    ``lengths[r]`` is rank r's slice length on ``dim``. ``padded=True`` pads slices to ``max(lengths)``
    and runs one all-gather; ``padded=False`` runs one exact-size broadcast per rank. Backward: the
    (padded resp. grouped) reduce-scatter of the gradient, which turns the partial ``I`` gradients into
    the complete gradient of this rank's slice. ``where`` (every collective takes it) names what the
    call runs for, e.g. ``"instruction 7 (...)"``: a timeout or a lost peer, in the forward or in the
    backward, raises :class:`~hapnb.runtime.collective_errors.CollectiveError` naming it and the rank.
    """
    g, d, lens = _prep_gather("all_gather", x, dim, lengths, group)
    return _AllGather.apply(x, d, lens, bool(padded), g, where)


def reduce_scatter(
    x: torch.Tensor,
    dim: int,
    lengths: Sequence[int],
    *,
    padded: bool = True,
    group: Group = None,
    where: Where = None,
) -> torch.Tensor:
    """``R -> G(dim)``: sum the full-shape partials over ranks and keep this rank's slice of ``dim``.

    ``padded=True`` pads the slices to ``max(lengths)`` and runs one reduce-scatter (all-reduce + slice on
    backends without it); ``padded=False`` runs one ``reduce`` per rank. Backward: all-gather of the
    gradient (padded resp. grouped).
    """
    g, d, lens = _prep_scatter("reduce_scatter", x, dim, lengths, group)
    return _ReduceScatter.apply(x, d, lens, bool(padded), g, where)


def all_reduce(x: torch.Tensor, group: Group = None, *, where: Where = None) -> torch.Tensor:
    """``R -> I``: the element-wise sum over ranks (out of place). Backward: all-reduce of the gradient."""
    g = _group_ctx(group)
    _check_tensor("all_reduce", x, g)
    return _AllReduce.apply(x, g, where)


def all_to_all(
    x: torch.Tensor,
    cat_dim: int,
    split_dim: int,
    cat_lengths: Sequence[int],
    split_lengths: Sequence[int],
    group: Group = None,
    *,
    where: Where = None,
) -> torch.Tensor:
    """``G(cat_dim) -> G(split_dim)``: re-shard from one dim to another.

    ``x`` has size ``cat_lengths[rank]`` on ``cat_dim`` and the full size ``sum(split_lengths)`` on
    ``split_dim``; the result has the full size on ``cat_dim`` and ``split_lengths[rank]`` on
    ``split_dim``. One ``all_to_all_single`` with per-peer split sizes. Backward: the reverse all-to-all.
    """
    g, cd, sd, cl, sl = _prep_all_to_all(
        "all_to_all", x, cat_dim, split_dim, cat_lengths, split_lengths, group
    )
    return _AllToAll.apply(x, cd, sd, cl, sl, g, where)


def reshard(
    x: torch.Tensor,
    dim: int,
    old_lengths: Sequence[int],
    new_lengths: Sequence[int],
    group: Group = None,
    *,
    where: Where = None,
) -> torch.Tensor:
    """``G(dim)`` with ``old_lengths`` -> ``G(dim)`` with ``new_lengths`` (same total).

    Each rank sends the overlap of its old interval with every peer's new interval (one
    ``all_to_all_single``). Used where segments with different sharding ratios meet. Backward: the
    reverse reshard of the gradient.
    """
    g, d, old, new = _prep_reshard("reshard", x, dim, old_lengths, new_lengths, group)
    return _Reshard.apply(x, d, old, new, g, where)


def shard(x: torch.Tensor, dim: int, lengths: Sequence[int], group: Group = None) -> torch.Tensor:
    """``I -> G(dim)`` (free): this rank's contiguous slice of ``dim``; plain autograd (no communication).

    >>> shard(torch.arange(5), 0, (5,)).tolist()
    [0, 1, 2, 3, 4]
    """
    op = "shard"
    g = _group_ctx(group)
    d = _norm_dim(op, x, dim)
    lens = _norm_lengths(op, lengths, g)
    _check_full(op, x, d, lens, g, "replicated (I)")
    return x.narrow(d, shard_offsets(lens)[g.rank], lens[g.rank]).contiguous()


def replicate(x: torch.Tensor, group: Group = None, *, where: Where = None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron's "f"); wrap replicated parameters.

    After ``loss.backward()`` every rank's parameter gradient is the complete (summed) gradient: this is
    the whole of data-parallel gradient synchronisation. The result is a view of ``x`` (no copy), so
    autograd refuses in-place ops on it; clone it first if you need one.
    """
    g = _group_ctx(group)
    _check_tensor("replicate", x, g)
    return _Replicate.apply(x, g, where)


def to_partial(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """``I -> R``: rank 0 keeps ``x``, other ranks hold ``x * 0`` (so the sum over ranks is exactly ``x``).

    The gradient is the upstream gradient on rank 0 and 0 elsewhere (a partial gradient of ``I``).
    """
    g = _group_ctx(group)
    return x if g.rank == 0 else x * 0


# --------------------------------------------------------------------------------------------------
# ZeRO-3: gathered parameters are not kept for the backward
# --------------------------------------------------------------------------------------------------

_REGATHER = "_hapnb_regather"


def gather_param(
    x: torch.Tensor, dim: int, lengths: Sequence[int], group: Group = None, *, where: Where = None
) -> torch.Tensor:
    """ZeRO-3 / FSDP: :func:`all_gather` (padded) of a parameter's shard ``x``, with the result marked so
    that ops run under :func:`regathering` do not keep it for the backward: they keep a token and the
    backward all-gathers the shard again. Backward of the gather itself: the reduce-scatter of the
    gradient into the shard, as for :func:`all_gather`.

    >>> w = torch.arange(4.0, requires_grad=True)
    >>> y = regathering(torch.mul, gather_param(w, 0, (4,)), 2.0)
    >>> y.sum().backward(); w.grad.tolist()
    [2.0, 2.0, 2.0, 2.0]
    """
    out = all_gather(x, dim, lengths, padded=True, group=group, where=where)
    setattr(out, _REGATHER, (x, dim, tuple(lengths), group, where))
    return out


@dataclass(frozen=True)
class _Token:
    """What autograd keeps instead of a gathered parameter (or a view of it)."""

    source: tuple[Any, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _pack(t: torch.Tensor) -> Any:
    base = t._base if t._base is not None else t
    src = getattr(base, _REGATHER, None)
    if src is None:
        return t
    return _Token(src, tuple(t.size()), tuple(t.stride()), t.storage_offset() - base.storage_offset())


def _unpack(x: Any) -> torch.Tensor:
    if not isinstance(x, _Token):
        return x
    shard, dim, lengths, group, where = x.source
    with torch.no_grad():
        full = all_gather(shard.detach(), dim, lengths, padded=True, group=group, where=where)
    return full.as_strided(x.size, x.stride, full.storage_offset() + x.offset)


def regathering(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` where autograd keeps a token instead of any tensor from :func:`gather_param`
    (or a view of one): the backward all-gathers that parameter again (same ranks, same order), so the
    gathered copy lives only while ``fn`` runs in the forward and while its backward runs. Other saved
    tensors are kept as usual. Generated programs call every op this way when a plan stores a parameter
    ZeRO-3 (``load_zero3``)."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        return fn(*args, **kwargs)


_REGATHERED: dict[Any, Callable[..., Any]] = {}


def regathered(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under :func:`regathering` (one named function per ``fn``, so a generated fx program can
    call it as an op).

    >>> regathered(torch.add).__name__
    'regathered_add'
    """
    w = _REGATHERED.get(fn)
    if w is None:

        def w(*args: Any, **kwargs: Any) -> Any:
            return regathering(fn, *args, **kwargs)

        name = "regathered_" + "".join(ch if ch.isalnum() else "_" for ch in getattr(fn, "__name__", "op"))
        w.__name__ = w.__qualname__ = name
        _REGATHERED[fn] = w
    return w


# --------------------------------------------------------------------------------------------------
# async variants
# --------------------------------------------------------------------------------------------------


class AsyncCollective:
    """A started collective; :meth:`wait` blocks until it is done and returns the result (once).

    The result is connected to autograd: its backward is the synchronous dual collective. ``g`` and
    ``where`` name the rank and what the collective runs for when its wait fails.
    """

    def __init__(
        self,
        name: str,
        works: list[Any],
        finish: _Finish,
        attach: Callable[[torch.Tensor], Any],
        g: _Ctx | None = None,
        where: Where = None,
    ):
        self.name = name
        self._works = works
        self._finish = finish
        self._attach = attach
        self._g = g if g is not None else _group_ctx(None)
        self.where = where
        self._result: torch.Tensor | None = None

    def is_completed(self) -> bool:
        """True when the communication has finished (``wait`` will not block)."""
        return self._result is not None or all(w is None or w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        """Block until the communication is done and return the result (the same tensor on every call)."""
        if self._result is None:
            g = self._g
            done = guarded(g.rank, g.group, self.name, self.where, _run, (self._works, self._finish))
            self._result = self._attach(done)
            self._works = []
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._result is not None else "pending"
        return f"AsyncCollective({self.name}, {state})"


class _Attach(torch.autograd.Function):
    """Joins a result computed outside autograd to its input ``x``; backward runs ``dual(grad)``."""

    @staticmethod
    def forward(ctx, x, holder, dual):  # type: ignore[override]
        ctx.dual = dual
        # the result travels in a list so that autograd does not treat it as an input returned as-is
        # (which would make it a view that refuses in-place ops)
        return holder[0]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.dual(grad), None, None


def _attacher(x: torch.Tensor, dual: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Any]:
    if not (torch.is_grad_enabled() and x.requires_grad):
        return lambda y: y
    return lambda y: _Attach.apply(x, [y.detach()], dual)


def all_gather_async(
    x: torch.Tensor,
    dim: int,
    lengths: Sequence[int],
    *,
    padded: bool = True,
    group: Group = None,
    where: Where = None,
) -> AsyncCollective:
    """Start :func:`all_gather`; ``.wait()`` returns the gathered tensor. Backward is synchronous."""
    g, d, lens = _prep_gather("all_gather_async", x, dim, lengths, group)
    with torch.no_grad():
        works, finish = guarded(
            g.rank,
            g.group,
            "all_gather",
            where,
            _start_all_gather,
            x.detach(),
            d,
            lens,
            bool(padded),
            g,
            True,
        )

    def dual(grad: torch.Tensor) -> torch.Tensor:
        return _scatter(grad, d, lens, bool(padded), g, where)

    return AsyncCollective("all_gather", works, finish, _attacher(x, dual), g, where)


def reduce_scatter_async(
    x: torch.Tensor,
    dim: int,
    lengths: Sequence[int],
    *,
    padded: bool = True,
    group: Group = None,
    where: Where = None,
) -> AsyncCollective:
    """Start :func:`reduce_scatter`; ``.wait()`` returns this rank's summed slice (sync backward)."""
    g, d, lens = _prep_scatter("reduce_scatter_async", x, dim, lengths, group)
    with torch.no_grad():
        works, finish = guarded(
            g.rank, g.group, "reduce_scatter", where,
            _start_reduce_scatter, x.detach(), d, lens, bool(padded), g, True,
        )  # fmt: skip

    def dual(grad: torch.Tensor) -> torch.Tensor:
        return _gather(grad, d, lens, bool(padded), g, where)

    return AsyncCollective("reduce_scatter", works, finish, _attacher(x, dual), g, where)


def all_reduce_async(x: torch.Tensor, group: Group = None, *, where: Where = None) -> AsyncCollective:
    """Start :func:`all_reduce`; ``.wait()`` returns the sum over ranks. Backward is synchronous."""
    g = _group_ctx(group)
    _check_tensor("all_reduce_async", x, g)
    with torch.no_grad():
        works, finish = guarded(g.rank, g.group, "all_reduce", where, _start_all_reduce, x.detach(), g, True)

    def dual(grad: torch.Tensor) -> torch.Tensor:
        return _reduce(grad, g, where)

    return AsyncCollective("all_reduce", works, finish, _attacher(x, dual), g, where)


def all_to_all_async(
    x: torch.Tensor,
    cat_dim: int,
    split_dim: int,
    cat_lengths: Sequence[int],
    split_lengths: Sequence[int],
    group: Group = None,
    *,
    where: Where = None,
) -> AsyncCollective:
    """Start :func:`all_to_all`; ``.wait()`` returns the re-sharded tensor. Backward is synchronous."""
    g, cd, sd, cl, sl = _prep_all_to_all(
        "all_to_all_async", x, cat_dim, split_dim, cat_lengths, split_lengths, group
    )
    with torch.no_grad():
        works, finish = guarded(
            g.rank, g.group, "all_to_all", where, _start_all_to_all, x.detach(), cd, sd, cl, sl, g, True
        )

    def dual(grad: torch.Tensor) -> torch.Tensor:
        return _to_all(grad, sd, cd, sl, cl, g, where)

    return AsyncCollective("all_to_all", works, finish, _attacher(x, dual), g, where)


def reshard_async(
    x: torch.Tensor,
    dim: int,
    old_lengths: Sequence[int],
    new_lengths: Sequence[int],
    group: Group = None,
    *,
    where: Where = None,
) -> AsyncCollective:
    """Start :func:`reshard`; ``.wait()`` returns the re-cut slice. Backward is synchronous."""
    g, d, old, new = _prep_reshard("reshard_async", x, dim, old_lengths, new_lengths, group)
    with torch.no_grad():
        works, finish = guarded(
            g.rank, g.group, "reshard", where, _start_reshard, x.detach(), d, old, new, g, True
        )

    def dual(grad: torch.Tensor) -> torch.Tensor:
        return _recut(grad, d, new, old, g, where)

    return AsyncCollective("reshard", works, finish, _attacher(x, dual), g, where)
