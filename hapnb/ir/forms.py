"""Tensor forms (the paper's properties) and integer shard lengths.

A distributed tensor relates to its single-device reference tensor ``e`` in one of three forms:

* ``I`` (:class:`Identity`): every device holds all of ``e``.
* ``G(d)`` (:class:`Gather`): device j holds a contiguous slice of dim ``d``; slices are in rank
  order, their lengths follow the sharding ratios (uneven and zero lengths allowed).
* ``R`` (:class:`Reduce`): every device holds a full-shape tensor; their element-wise sum is ``e``.

>>> str(G(1)), str(I), str(R)
('G1', 'I', 'R')
>>> shard_lengths(10, [0.5, 0.3, 0.2])
(5, 3, 2)
>>> shard_lengths(7, [0.5, 0.5, 0.0])
(4, 3, 0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Form",
    "Identity",
    "Gather",
    "Reduce",
    "I",
    "R",
    "G",
    "Shard",
    "Replicate",
    "Partial",
    "Storage",
    "FullShard",
    "ShardGradOp",
    "parse_form",
    "parse_recut",
    "parse_recut",
    "parse_pin",
    "shard_lengths",
    "shard_offsets",
]


@dataclass(frozen=True, order=True)
class Form:
    """Base class of the three forms; ``kind`` is 'I', 'G' or 'R' and ``dim`` is set only for G."""

    kind: str
    dim: int = -1

    def __str__(self) -> str:
        return f"G{self.dim}" if self.kind == "G" else self.kind

    def __repr__(self) -> str:
        return {"I": "I", "R": "R"}.get(self.kind, f"G({self.dim})")

    @property
    def is_gather(self) -> bool:
        return self.kind == "G"

    @property
    def is_identity(self) -> bool:
        return self.kind == "I"

    @property
    def is_reduce(self) -> bool:
        return self.kind == "R"

    def math(self) -> str:
        """Notation used in the paper's triples: ``Identity``, ``All-Gather(d)``, ``All-Reduce``."""
        return {"I": "Identity", "R": "All-Reduce"}.get(self.kind, f"All-Gather({self.dim})")


def Identity() -> Form:  # noqa: N802 - reads like a constructor
    return I


def Reduce() -> Form:  # noqa: N802
    return R


def Gather(dim: int) -> Form:  # noqa: N802
    return G(dim)


I = Form("I")
R = Form("R")
_G_CACHE: dict[int, Form] = {}


def G(dim: int) -> Form:  # noqa: N802
    """The form ``G(dim)``; dims are non-negative (normalise negative dims before calling)."""
    if dim < 0:
        raise ValueError(f"G(d) needs a non-negative dim, got {dim}")
    f = _G_CACHE.get(dim)
    if f is None:
        f = _G_CACHE[dim] = Form("G", dim)
    return f


# Pins use the names people know from DTensor; they are the same values.
def Shard(dim: int) -> Form:  # noqa: N802
    """Pin a tensor to be sharded along ``dim`` (the form ``G(dim)``)."""
    return G(dim)


def Replicate() -> Form:  # noqa: N802
    """Pin a tensor to be replicated on every device (the form ``I``)."""
    return I


def Partial() -> Form:  # noqa: N802
    """Pin a tensor to be held as partial sums (the form ``R``)."""
    return R


@dataclass(frozen=True)
class Storage:
    """A pin on a parameter's *storage*: kept sharded on ``dim`` (its parameter, gradient and Adam states
    are the shard, ``G(dim)``) and all-gathered to ``I`` just before use, the gradient reduce-scattered
    back to the shard. ``zero=3`` (ZeRO-3, FSDP's FULL_SHARD) frees the gathered copy after the forward
    use and gathers it again in the backward; ``zero=2`` (ZeRO-2, FSDP's SHARD_GRAD_OP) keeps it until
    the backward. Pins: ``{"fc1.weight": hapnb.FullShard(0)}``, ``--pin fc1.weight=zero3(0)``.

    >>> str(FullShard(0)), str(ShardGradOp(1)), parse_pin("fsdp(0)") == FullShard(0)
    ('zero3(0)', 'zero2(1)', True)
    """

    zero: int
    dim: int

    def __post_init__(self) -> None:
        if self.zero not in (2, 3) or self.dim < 0:
            raise ValueError(f"Storage needs zero 2 or 3 and a non-negative dim, got {self.zero}, {self.dim}")

    def __str__(self) -> str:
        return f"zero{self.zero}({self.dim})"

    @property
    def form(self) -> Form:
        """The stored form ``G(dim)``."""
        return G(self.dim)


def FullShard(dim: int) -> Storage:  # noqa: N802
    """Pin a parameter to ZeRO-3 / FSDP storage: sharded on ``dim``, gathered before each use (forward
    and backward), gradient reduce-scattered."""
    return Storage(3, dim)


def ShardGradOp(dim: int) -> Storage:  # noqa: N802
    """Pin a parameter to ZeRO-2 storage: sharded on ``dim``, gathered once per step before its first use
    and kept until the backward, gradient reduce-scattered."""
    return Storage(2, dim)


def parse_pin(text: str) -> Form | Storage:
    """A pin: a form (:func:`parse_form`) or a storage: ``zero3(d)`` / ``fsdp(d)`` / ``fullshard(d)``
    (ZeRO-3), ``zero2(d)`` / ``shardgradop(d)`` (ZeRO-2).

    >>> parse_pin("zero2(1)"), parse_pin("G0")
    (Storage(zero=2, dim=1), G(0))
    """
    low = text.strip().replace(" ", "").lower()
    for prefix, zero in (("zero3(", 3), ("fsdp(", 3), ("fullshard(", 3), ("zero2(", 2), ("shardgradop(", 2)):
        if low.startswith(prefix) and low.endswith(")") and low[len(prefix) : -1].isdigit():
            return Storage(zero, int(low[len(prefix) : -1]))
    try:
        return parse_form(text)
    except ValueError:
        raise ValueError(
            f"cannot read the pin {text!r}: use a form (I / Replicate, R / Partial, G(d) / Gd / Shard(d)) or a "
            "parameter storage (zero3(d) / fsdp(d): ZeRO-3, zero2(d): ZeRO-2)"
        ) from None


def parse_form(text: str) -> Form:
    """Parse ``I``, ``R``, ``G1``, ``G(1)``, ``Shard(1)``, ``Replicate``, ``Partial`` (case-insensitive).

    >>> parse_form("shard(0)"), parse_form("G2"), parse_form("replicate")
    (G(0), G(2), I)
    """
    s = text.strip().replace(" ", "")
    low = s.lower()
    if low in ("i", "replicate", "replicate()", "identity", "identity()"):
        return I
    if low in ("r", "partial", "partial()", "reduce", "reduce()"):
        return R
    for prefix in ("shard(", "g(", "gather("):
        if low.startswith(prefix) and low.endswith(")"):
            return G(int(low[len(prefix) : -1]))
    if low.startswith("g") and low[1:].isdigit():
        return G(int(low[1:]))
    raise ValueError(
        f"cannot read the form {text!r}: use I / Replicate, R / Partial, or G(d) / Gd / Shard(d) "
        "with a non-negative dim d"
    )


def parse_recut(text: str) -> tuple[Form, int | None]:
    """A form as a program writes it, with the ratio segment a re-cut tensor is cut for: ``"G1@2"`` (``G(1)``
    re-cut for segment 2's ratios) or a plain form (segment ``None``).

    >>> parse_recut("G1@2"), parse_recut("I")
    ((G(1), 2), (I, None))
    """
    base, sep, segment = text.partition("@")
    return parse_form(base), (int(segment) if sep else None)


def shard_lengths(length: int, ratios: Sequence[float]) -> tuple[int, ...]:
    """Integer shard lengths of a dim of ``length`` split by ``ratios`` (they need not sum to 1).

    Floor every share, then give +1 to the device with the largest deficit ``r_j*L - len_j`` until the
    lengths sum to ``length`` (ties go to the lower rank). Deterministic in (length, ratios), so every rank
    computes the same lengths. Zero lengths are allowed.
    """
    n = len(ratios)
    if n == 0:
        raise ValueError("shard_lengths needs at least one ratio")
    if any(r < 0 or not math.isfinite(r) for r in ratios):
        raise ValueError(f"ratios must be finite and non-negative, got {list(ratios)}")
    total = float(sum(ratios))
    if total <= 0:
        raise ValueError(f"ratios must not all be zero, got {list(ratios)}")
    exact = [r / total * length for r in ratios]
    # a tiny tolerance keeps 0.3*10 = 2.9999999999999996 at 3
    lens = [int(math.floor(x + 1e-9)) for x in exact]
    missing = length - sum(lens)
    if 0 < missing <= n:
        # every deficit is < 1, so no device gets two: the `missing` largest deficits (lower rank first)
        # get +1, as the one-at-a-time rule below gives them (O(n log n) instead of O(n * missing))
        for j in sorted(range(n), key=lambda k: (lens[k] - exact[k], k))[:missing]:
            lens[j] += 1
        missing = 0
    while missing > 0:
        j = max(range(n), key=lambda k: (exact[k] - lens[k], -k))
        lens[j] += 1
        missing -= 1
    while missing < 0:  # only reachable through the tolerance above
        j = min(range(n), key=lambda k: (exact[k] - lens[k], k) if lens[k] > 0 else (math.inf, k))
        lens[j] -= 1
        missing += 1
    return tuple(lens)


def shard_offsets(lengths: Sequence[int]) -> tuple[int, ...]:
    """Start offset of every shard: ``shard_offsets((2, 3, 1)) == (0, 2, 5)``."""
    out, acc = [], 0
    for n in lengths:
        out.append(acc)
        acc += n
    return tuple(out)
