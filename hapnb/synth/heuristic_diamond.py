"""Diamonds on a branch: a branch tensor ``x`` whose side ops head branches that merge back into a later op
``m`` of ``x``'s own branch, so that the branch DP (:class:`hapnb.synth.heuristic_side._BranchTables`) values
the forms ``m`` takes them in together with the form it takes its path input in.

A decoder's self-attention is one: its layer norm's output ``x`` feeds the query projection (on the branch:
the path goes through the query) and, as sides, the key and value projections, whose branches end at the
attention op ``m``. Without the coupling a branch merging into a branch op ends in any form for free, so the
bound let the query path run replicated (its cheapest for ``x`` replicated: the replicated attention) while
the key and value projections ran tensor-parallel (their cheapest for ``x`` replicated), a program no
attention strategy runs: on Whisper (real size; its decoder is off the spine, whose path goes through the
cross-attention's larger key and value) the bound rose by 5.4 ms at each decoder layer's query projection,
1.3 % of the optimum in all, and the search did not prove it within its default budget.

Coupled, the DP keeps a state between ``m`` and ``x``'s path consumer ``P``: the forms ``m`` takes the heads'
branch outputs ``y_1, ..`` in. At ``m`` only the strategies taking each ``y_i`` in its state's form count;
the path's tables are carried back to ``P`` per state; at ``x`` the :class:`~hapnb.synth.heuristic_joint.Joint`
of the state has ``P``'s table, each head with its branch ending in its state's form and ``x``'s other sides;
``x``'s value is the least over the states (:class:`Least`). Admissible: every program's ``m`` takes each
``y_i`` in some form, so its state is one of them, and the ops it pays for are counted once, as without the
coupling (``m`` in the path's table, each head's branch in its own). The heads with the largest outputs are
coupled first, while the states stay at most :data:`MAX_DIAMOND_STATES`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .heuristic_rejoin import taken_forms

__all__ = ["MAX_DIAMOND_STATES", "Diamond", "Least", "find_diamonds", "coupled_joint"]

#: the most states of one diamond (the product of the forms ``m`` takes its coupled inputs in)
MAX_DIAMOND_STATES = 36
_INF = float("inf")


class Diamond(NamedTuple):
    """Branch tensor ``x``, the later path op ``at`` (``m``) into which the branches of the side ops ``heads``
    merge, and the places in the branch of ``x``'s path consumer (``P``) and of ``m`` (``span``); per head,
    (head op, its branch's output ``y``, ``m``'s input index of ``y``, the forms ``m`` takes ``y`` in)."""

    x: int
    at: int
    span: tuple[int, int]
    heads: tuple[tuple[int, int, int, tuple[int, ...]], ...]


class Least:
    """The least over a diamond's states of their Joints' values, memoised per present-form bits."""

    __slots__ = ("joints", "table")

    def __init__(self, joints: Sequence[Any]) -> None:
        self.joints = list(joints)
        self.table: dict[int, float] = {}

    def value(self, present: int) -> float:
        v = self.table.get(present)
        if v is None:
            v = self.table[present] = min((j.value(present) for j in self.joints), default=_INF)
        return v


def find_diamonds(
    s: Any,
    br: Sequence[tuple[int, int, int]],
    sides: Mapping[int, Sequence[int]],
    heads: Mapping[int, Sequence[tuple[int, int, int]]],
) -> dict[int, Diamond]:
    """The diamonds of branch ``br`` (a list of (op, path input, output) in program order) by their tensor
    ``x``: a side op of ``x`` heading a branch (``heads``: head op -> its branch) whose output a later op of
    ``br`` takes once. Per ``x`` one merge op (the one the largest head output merges into)."""
    g = s.graph
    index = {b: n for n, (b, _, _) in enumerate(br)}
    out: dict[int, Diamond] = {}
    for n, (_, x, _) in enumerate(br):
        if x < 0:
            continue
        cands = []
        for o in sides.get(x, ()):
            hb = heads.get(o)
            if hb is None:
                continue
            y = hb[-1][2]
            at = next((c for c in g.tensors[y].consumers if index.get(c, -1) > n), -1)
            if at < 0 or g.ops[at].inputs.count(y) != 1 or not s._ops[at]:
                continue
            k = g.ops[at].inputs.index(y)
            cands.append((-g.tensors[y].numel, y, o, at, k, taken_forms(s, at, k)))
        if not cands:
            continue
        cands.sort()
        at = cands[0][3]
        kept, size = [], 1
        for _, y, o, m, k, forms in cands:
            if m == at and size * len(forms) <= MAX_DIAMOND_STATES:
                kept.append((o, y, k, forms))
                size *= len(forms)
        if kept:
            out[x] = Diamond(x, at, (n, index[at]), tuple(kept))
    return out


def coupled_joint(bt: Any, br: Sequence[tuple[int, int, int]], d: Diamond, nxt_at: Sequence[float]) -> Least:
    """``d.x``'s value (:class:`Least`) from the values of ``d.at``'s output forms (``nxt_at``, with what
    follows): per state, the path's table from ``d.at`` back to ``x``'s path consumer restricted to the
    strategies of ``d.at`` that take each head's output in the state's form, joined at ``x`` with each head's
    branch ending in that form (``bt.head_to``, once per head and form) and ``x``'s other sides. ``bt``: the
    branch tables (:class:`hapnb.synth.heuristic_side._BranchTables`)."""
    entries = bt.s._tables.entries[d.at]
    lo, hi = d.span
    m, src_m, out_m = br[hi]
    coupled = {o for o, _, _, _ in d.heads}
    others = [bt.side_tab(o, d.x) for o in bt.sides.get(d.x, ()) if o not in coupled]
    head_tabs = {(o, f): bt.head_to(o, d.x, y, f) for o, y, _, forms in d.heads for f in forms}
    joints = []
    for st in itertools.product(*(forms for _, _, _, forms in d.heads)):
        checks = [(k, f) for (_, _, k, _), f in zip(d.heads, st)]

        def allow(c: Any, checks: list[tuple[int, int]] = checks) -> bool:
            e = entries[c.index]
            return all(e.in_forms[k] == f for k, f in checks)

        tab = bt.carry_back(br[lo:hi], bt.back(m, src_m, out_m, nxt_at, allow))
        if min(tab) == _INF:
            continue  # no strategy of the merge op takes the heads' outputs in these forms
        heads = [head_tabs[(o, f)] for (o, _, _, _), f in zip(d.heads, st)]
        joints.append(bt.joint(d.x, [tab, *heads, *others]))
    return Least(joints)
