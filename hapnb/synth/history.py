"""The Q/B loop's history record: one :class:`Round` per search-then-LP iteration.

A plain frozen value, apart from the loop that makes it (:mod:`hapnb.synth.optimize`) so that a
:class:`~hapnb.plans.plan.Plan`, which keeps its rounds, imports a record and not the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Round"]


@dataclass(frozen=True)
class Round:
    """One Q/B iteration: the program searched at the previous ratios, then the LP's ratios for it."""

    iteration: int
    search_cost_s: float  # cost of Q_k at B_{k-1}
    balanced_cost_s: float  # cost of Q_k at B_k
    ratios: tuple[tuple[float, ...], ...]  # B_k
    expansions: int
    search_s: float
    balance_s: float
    instructions: int
    accepted: bool
    #: "search" (Q_k from B_{k-1}) or "seed dp_ev|dp_cp|tp_ev|zero2|fsdp" (a baseline program)
    source: str = "search"
