"""DDP-style gradient buckets: replicated gradients all-reduced asynchronously during the backward.

A generated rank program (``generate(..., grad_sync="buckets")``) leaves the gradients of its replicated
(``I``) parameters partial and lists them in :attr:`~hapnb.runtime.program.RankProgram.grad_sync` in order of
first use. :class:`GradBuckets` groups them as PyTorch's DDP does (:func:`hapnb.cost.ddp.ddp_buckets`: the
gradients in the order they become ready, i.e. reverse order of first use, 25 MiB buckets after a first
1 MiB one), registers a post-accumulate-grad hook on each parameter and, as soon as every gradient of a
bucket is ready, flattens the bucket and starts ``all_reduce(async_op=True)``. :meth:`GradBuckets.wait`
(call it after ``backward`` and before reading gradients or stepping the optimizer) starts what is still
unstarted, waits for every bucket and writes the summed values back into ``.grad``.

Buckets start strictly in index order on every rank (a ready bucket waits for its predecessors), and on
their own process group (``group``), so the all-reduces match up across ranks whatever order autograd
runs the feature collectives of the backward in. A parameter used several times (tied weights) is ready
once: PyTorch fires a leaf's post-accumulate hook once per backward, after every use has accumulated. A
parameter that got no gradient in a step contributes zeros (and receives the sum of the others'). A
bucket whose all-reduce times out or loses a peer raises
:class:`~hapnb.runtime.collective_errors.CollectiveError` naming the rank, the bucket and its gradients
(:meth:`GradBuckets.label`). Works in one process without torch.distributed (then nothing is communicated):

>>> import torch
>>> a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
>>> gb = GradBuckets([("a", a), ("b", b)], first_cap=1, cap=1)
>>> gb.buckets
(('b',), ('a',))
>>> (a.sum() * 2 + b.sum()).backward()
>>> [e for e, _ in gb.events]
['start', 'start']
>>> gb.wait()
2
>>> a.grad.tolist()
[2.0, 2.0]
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..cost.ddp import BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES, ddp_buckets
from ..runtime.collective_errors import group_timeout, guarded

__all__ = ["GradBuckets", "program_buckets", "destroy_groups"]

#: the buckets with a process group of their own, so :func:`destroy_groups` can let go of their groups
#: while a distributed module is still referenced
_WITH_GROUP: weakref.WeakSet[GradBuckets] = weakref.WeakSet()


class GradBuckets:
    """Async bucketed all-reduce of the gradients of ``params`` (``(name, Parameter)`` in order of first
    use in the forward). ``group``: the process group for the all-reduces (None: the default group; pass
    a dedicated one, see the module doc). ``on_event(kind, bucket)`` is called with ``"start"`` when a
    bucket's all-reduce starts and ``"done"`` when :meth:`wait` has finished it; :attr:`events` keeps the
    same list of ``(kind, bucket)``. ``wait_at_backward_end``: the first hook of a backward queues
    :meth:`wait` on the autograd engine, so ``backward()`` returns with the sums in ``.grad`` (as DDP
    does); else call :meth:`wait` yourself."""

    def __init__(
        self,
        params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        group: Any = None,
        cap: int = BUCKET_CAP_BYTES,
        first_cap: int = FIRST_BUCKET_CAP_BYTES,
        on_event: Callable[[str, int], None] | None = None,
        wait_at_backward_end: bool = False,
    ) -> None:
        seen: set[int] = set()
        uniq: list[tuple[str, torch.nn.Parameter]] = []
        for name, p in params:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            uniq.append((name, p))
        self.params = dict(uniq)
        ready = [(name, p.numel() * p.element_size()) for name, p in reversed(uniq)]
        self.buckets: tuple[tuple[str, ...], ...] = ddp_buckets(ready, cap=cap, first_cap=first_cap)
        self._bucket_of = {name: k for k, names in enumerate(self.buckets) for name in names}
        self.group = group
        if group is not None:
            _WITH_GROUP.add(self)
        self._closed = False
        self.on_event = on_event
        self.events: list[tuple[str, int]] = []
        self._active = dist.is_available() and dist.is_initialized()
        #: False: the hooks start nothing (gradient accumulation without sync, ``no_sync``); the gradients
        #: accumulate in ``.grad`` and the next backward with ``paused=False`` all-reduces their sums
        self.paused = False
        self.wait_at_backward_end = wait_at_backward_end
        self._queued = False
        #: each gradient's tensor version right after the last :meth:`wait` wrote it
        self._written: dict[str, int] = {}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in self.params.items()
        ]
        self._reset()

    def _reset(self) -> None:
        self._missing = [set(names) for names in self.buckets]
        self._next = 0  # the next bucket to start (buckets start in index order)
        self._pending: list[tuple[torch.Tensor, Any] | None] = [None] * len(self.buckets)
        self._late: list[str] = []

    def _emit(self, kind: str, k: int) -> None:
        self.events.append((kind, k))
        if self.on_event is not None:
            self.on_event(kind, k)

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            if self.paused:
                return
            self._check_open()
            if self.wait_at_backward_end and not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.wait)
            k = self._bucket_of[name]
            if k < self._next:  # a second backward before wait(): this bucket already went out
                self._late.append(name)
                return
            self._missing[k].discard(name)
            while self._next < len(self.buckets) and not self._missing[self._next]:
                self._start(self._next)

        return hook

    def _start(self, k: int) -> None:
        parts = []
        for name in self.buckets[k]:
            p = self.params[name]
            g = p.grad
            parts.append(g.detach().reshape(-1) if g is not None else p.detach().new_zeros(p.numel()))
        flat = torch.cat(parts)  # a fresh buffer: the reduce never aliases a live .grad
        work = None
        if self._active:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending[k] = (flat, work)
        self._next = k + 1
        self._emit("start", k)

    def label(self, k: int) -> str:
        """What errors call bucket ``k``'s all-reduce: the bucket and the gradients in it."""
        names = self.buckets[k]
        some = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"gradient bucket {k} of {len(self.buckets)} (the all-reduce of the gradients of {some})"

    def started(self) -> int:
        """How many buckets of the current step have started their all-reduce."""
        return self._next

    def wait(self) -> int:
        """Start the buckets not started yet (missing gradients count as zeros), wait for every bucket,
        write the sums into ``.grad`` and reset for the next step. Returns the number of buckets."""
        self._check_open()
        while self._next < len(self.buckets):
            self._start(self._next)
        for k, names in enumerate(self.buckets):
            pend = self._pending[k]
            assert pend is not None
            flat, work = pend
            if work is not None:
                guarded(
                    dist.get_rank(), self.group, "all_reduce", self.label(k), work.wait, direction="backward"
                )
            off = 0
            for name in names:
                p = self.params[name]
                piece = flat[off : off + p.numel()].view_as(p)
                off += p.numel()
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
            self._emit("done", k)
        late = self._late
        self._reset()
        self._queued = False
        self._written = {n: p.grad._version for n, p in self.params.items() if p.grad is not None}
        if late:
            raise RuntimeError(
                f"the gradients of {', '.join(sorted(set(late)))} changed after their bucket's all-reduce "
                "started (two backward passes before wait()); run one backward per wait(), e.g. on the "
                "sum of the micro-batch losses"
            )
        return len(self.buckets)

    def holds_sums(self) -> bool:
        """Whether some gradient still holds the sum the last :meth:`wait` wrote (not set to None, zeroed or
        changed in place since): a backward now would add to it, and the next all-reduce count it once
        per rank."""
        return any(
            (p := self.params[n]).grad is not None and p.grad._version == v for n, v in self._written.items()
        )

    def remove(self) -> None:
        """Remove the hooks (the parameters no longer sync)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        """Let go of the process group and of every pending all-reduce (:func:`destroy_groups` calls it
        before the groups go); a later backward or :meth:`wait` raises instead of syncing nothing."""
        self._closed = True
        self.group = None
        self._pending = [None] * len(self.buckets)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"{self!r}: the process groups were destroyed (hapnb.destroy_groups), so these gradients "
                "can no longer be all-reduced; destroy the groups after the last backward"
            )

    def __repr__(self) -> str:
        return f"GradBuckets({len(self.params)} parameters in {len(self.buckets)} buckets)"


def program_buckets(
    module: Any,
    grad_sync: Sequence[str],
    *,
    cap: int | None = None,
    first_cap: int | None = None,
    wait_at_backward_end: bool = False,
) -> GradBuckets:
    """:class:`GradBuckets` of a rank program's replicated parameters (``grad_sync``, the names
    :attr:`~hapnb.runtime.program.RankProgram.grad_sync` lists) on a process group of their own, so the
    buckets' all-reduces never interleave with the feature collectives the backward runs on the default
    group; its collectives wait as long as the default group's (its timeout). Call it on every rank (it
    makes a process group)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    group = None
    if world > 1:
        limit = group_timeout()
        timeout = {"timeout": timedelta(seconds=limit)} if limit is not None else {}
        group = dist.new_group(list(range(world)), **timeout)
    caps = {k: v for k, v in (("cap", cap), ("first_cap", first_cap)) if v is not None}
    named = [(nm, module.get_parameter(nm)) for nm in grad_sync]
    return GradBuckets(named, group=group, wait_at_backward_end=wait_at_backward_end, **caps)


def destroy_groups() -> None:
    """Destroy every process group (``torch.distributed.destroy_process_group``) after collecting garbage
    and closing the gradient buckets still alive (:meth:`GradBuckets.close`): a distributed module sits in
    reference cycles (its hooks refer to it), and a script may still hold it, so its buckets' process group
    and work objects would otherwise be freed during interpreter shutdown, after the groups, where gloo can
    abort the process (SIGABRT, "terminate called without an active exception") although the run
    succeeded. Nothing happens without an initialised process group."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        for buckets in list(_WITH_GROUP):
            buckets.close()
        gc.collect()
        dist.destroy_process_group()
