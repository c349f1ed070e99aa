"""Dominance: when the search may drop a partial program because another reached the same state no worse.

A search state is a key (position, property bits, comm tokens); ``seen`` maps each key to the labels of
the programs kept there. :func:`plain_dominated` compares the stage model's labels ``(base, acc, ms,
tail)``: one is dropped only if another is no worse in its closed cost and, either its open stage cannot
end cheaper (``b0 + max(a0) <= base + min(acc)``) or it is no worse on every device, its optimizer step so
far (``tail``, added to the last stage: :mod:`hapnb.synth.optimizer_step`) is no larger on any device, and
(under memory pruning) its memory is no worse; so the search stays exact for ``sum(comm + max_j comp_j)``.
:func:`duplex_dominated` keeps the Pareto front of the duplex labels (:func:`hapnb.synth.duplex.dominates`).
Either records a label that is not dominated and drops those it dominates.

>>> seen = {}
>>> plain_dominated(seen, (1, 3, 0), 1.0, (2.0, 1.0), None, None)
False
>>> plain_dominated(seen, (1, 3, 0), 1.5, (2.0, 1.0), None, None)
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .duplex import Label, dominates

__all__ = ["plain_dominated", "duplex_dominated"]

Key = tuple[int, int, int]


def plain_dominated(
    seen: dict[Key, list[Any]],
    key: Key,
    base: float,
    acc: tuple[float, ...],
    ms: Any,
    mem_dominates: Callable[[Any, Any], bool] | None,
    eps: float = 1e-12,
    tail: tuple[float, ...] = (),
) -> bool:
    """Whether a program with ``key`` at (``base``, ``acc``, memory state ``ms``, optimizer step so far
    ``tail``) is dominated; else record it (and drop the entries it dominates). ``mem_dominates(a, b)``:
    memory state ``a`` is no worse than ``b`` (None: memory is not compared)."""
    entries = seen.get(key)
    mx = max(acc)
    if entries is None:
        seen[key] = [(base, acc, ms, tail)]
        return False
    mn = min(acc)
    for b0, a0, m0, t0 in entries:
        if (
            b0 <= base + eps
            and (b0 + max(a0) <= base + mn + eps or all(x <= y + eps for x, y in zip(a0, acc)))
            and all(x <= y + eps for x, y in zip(t0, tail))
            and (mem_dominates is None or mem_dominates(m0, ms))
        ):
            return True
    keep = [
        (b0, a0, m0, t0)
        for b0, a0, m0, t0 in entries
        if not (
            base <= b0 + eps
            and (base + mx <= b0 + min(a0) + eps or all(x <= y + eps for x, y in zip(acc, a0)))
            and all(x <= y + eps for x, y in zip(tail, t0))
            and (mem_dominates is None or mem_dominates(ms, m0))
        )
    ]
    keep.append((base, acc, ms, tail))
    seen[key] = keep
    return False


def duplex_dominated(seen: dict[Key, list[Any]], key: Key, label: Label, eps: float = 1e-12) -> bool:
    """Pareto dominance of duplex labels ``(base, acc, copen, tail)`` at one state; records ``label`` when
    it is not dominated."""
    entries = seen.get(key)
    if entries is None:
        seen[key] = [label]
        return False
    if any(dominates(e, label, eps) for e in entries):
        return True
    seen[key] = [e for e in entries if not dominates(label, e, eps)] + [label]
    return False
