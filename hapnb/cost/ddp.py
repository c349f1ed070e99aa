"""PyTorch DDP's gradient buckets: how the gradients of replicated weights are grouped into all-reduces (used by
the simulator, the plan's lower bound and the runtime's bucketed all-reduce, :mod:`hapnb.run.buckets`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["BUCKET_CAP_BYTES", "FIRST_BUCKET_CAP_BYTES", "ddp_buckets"]

#: PyTorch DDP's gradient bucket sizes: 25 MiB per bucket, the first (the last layers' gradients) 1 MiB.
BUCKET_CAP_BYTES = 25 * 2**20
FIRST_BUCKET_CAP_BYTES = 2**20


def ddp_buckets(
    ready: Sequence[tuple[Any, int]],
    cap: int = BUCKET_CAP_BYTES,
    first_cap: int = FIRST_BUCKET_CAP_BYTES,
) -> tuple[tuple[Any, ...], ...]:
    """Group gradients into all-reduce buckets as DDP does: ``ready`` lists ``(key, bytes)`` in the order
    the gradients become ready (reverse order of first use); a bucket closes once it holds at least its cap
    (``first_cap`` for the first, then ``cap``), so a gradient larger than the cap fills a bucket alone.

    >>> ddp_buckets([("a", 600_000), ("b", 600_000), ("c", 10), ("d", 30 * 2**20), ("e", 5)])
    (('a', 'b'), ('c', 'd'), ('e',))
    """
    out: list[tuple[Any, ...]] = []
    cur: list[Any] = []
    size = 0
    for key, nbytes in ready:
        cur.append(key)
        size += int(nbytes)
        if size >= (first_cap if not out else cap):
            out.append(tuple(cur))
            cur, size = [], 0
    if cur:
        out.append(tuple(cur))
    return tuple(out)
