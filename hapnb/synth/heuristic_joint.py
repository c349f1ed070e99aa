"""The facility-location step of the A* bound (:mod:`hapnb.synth.heuristic_side`): a :class:`Joint` values a
tensor's pending consumers from its present forms, and a :data:`Term` is one summand of a node's bound.

A tensor is converted at most once (the search's rule): besides the form it was made in, a :class:`Joint`
gives its consumers at most one more form (the cheapest collective from the present form; a slice of a
replicated form is free but is that one conversion), none once two are present.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

__all__ = ["Joint", "Term", "term_value"]

_INF = float("inf")

#: (mask of the tensor's form bits, cache: present bits -> value, constant added, the Joint)
Term = tuple[int, dict[int, float], float, "Joint"]


class Joint:
    """The cheapest way to serve a tensor's pending consumers from its present forms: ``tabs[c][b]`` is
    consumer ``c``'s cost (its op and, for the spine op, everything after it) when it takes the tensor in
    form ``b``; ``price[a][b]`` the cheapest collective from form ``a`` to ``b``; ``bits[b]`` form ``b``'s
    property bit. :meth:`value` is memoised per present-form bits in :attr:`table`."""

    __slots__ = ("tabs", "price", "bits", "table")

    def __init__(
        self, tabs: Sequence[Sequence[float]], price: Sequence[Sequence[float]], bits: Sequence[int]
    ):
        self.tabs = [list(t) for t in tabs]
        self.price = price
        self.bits = bits
        self.table: dict[int, float] = {}

    def value(self, present: int) -> float:
        """The bound for the present forms (bits); none present: the tensor is made later, in one form."""
        v = self.table.get(present)
        if v is None:
            if present:
                v = self._solve([k for k, b in enumerate(self.bits) if present & b])
            else:
                v = min((self._solve([k]) for k in range(len(self.bits))), default=_INF)
            self.table[present] = v
        return v

    def _solve(self, have: list[int]) -> float:
        """The least cost of the consumers' forms with ``have`` present. A tensor is converted at most once
        (the search's rule), so its forms are the one it was made in and at most one more: with one form
        present, at most one form is made (the cheapest collective from it; a slice of a replicated form is
        free but still the tensor's one conversion); with two present, none."""
        tabs = self.tabs
        if len(have) > 1:  # converted already: every consumer takes a present form
            v = 0.0
            for t in tabs:
                v += min([t[b] for b in have])
            return v
        a = have[0]
        made = list(self.price[a])  # the cheapest collective from the present form to each form
        made[a] = 0.0
        if len(tabs) == 1:  # one consumer: its cheapest form, made if need be
            return min(map(operator.add, made, tabs[0]), default=_INF)
        best = 0.0  # no form made: every consumer takes the present one
        for t in tabs:
            best += t[a]
        for b, m in enumerate(made):
            if b == a or m >= best:
                continue
            v = m  # form b made: every consumer takes the better of the two
            for t in tabs:
                v += t[a] if t[a] < t[b] else t[b]
                if v >= best:
                    break
            if v < best:
                best = v
        return best


def term_value(terms: Sequence[Term], props: int) -> float:
    """The sum of the terms for a node's properties (what the search's hot loop computes inline)."""
    h = 0.0
    for mask, table, add, joint in terms:
        p = props & mask
        v = table.get(p)
        h += (joint.value(p) if v is None else v) + add
    return h
