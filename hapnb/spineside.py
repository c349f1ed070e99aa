"""The plain A* bound with side consumers: the spine DP (:mod:`hapnb.spine`) coupled, at each spine tensor,
with the tensor's other consumers.

:func:`hapnb.spine.spine_bound` prices one input→loss path and lets every tensor off it take any form. On
a transformer that loses most of what the program pays: the attention input feeds the query, key and value
projections, the MLP input the gate and up projections, and only one of each is on the spine; the others
took their weights sharded for free (their input's form was free). Here the spine tensor ``x``'s other
consumers (*side* ops, at most :data:`MAX_SIDES`, each assigned to one spine tensor) join the DP at ``x``:
the collectives that turn ``x`` into new forms are paid once, and every consumer (the spine op and the
sides) takes ``x`` in a form that is present or made (a small facility-location problem over ``x``'s
forms, :class:`Joint`). A side op's output stays free.

Relaxations (each can only lower the bound): computation on one device (the one with the most left),
stages merged, comm tokens ignored (a tensor may be converted into several forms), tensors off the spine
and its side inputs free, gradient syncs counted only for parameters with one consumer. Every op's cost
and every tensor's conversions are counted in exactly one term, so the sum of the terms is admissible.

The bound of a node at position ``pos`` is ``acc[jstar] + Σ term(props)``, one *term* per spine tensor with
pending consumers: the main term (the live spine tensor, with the rest of the spine behind it) and, for
an earlier spine tensor whose spine consumer ran but whose sides did not, a side term. A term is
``(mask, table, add, joint)``: ``props & mask`` is the tensor's present forms, ``table`` caches
``joint(present)`` (the cost of its pending consumers and what follows them) and ``add`` the rest of the
ops before the spine consumer that are on no path (their cheapest strategy).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from .spine import _cheapest, local_pricer

__all__ = ["MAX_SIDES", "Joint", "Term", "side_terms", "term_value"]

#: the most side consumers coupled with one spine tensor (the facility-location step enumerates subsets of
#: the tensor's forms, so this keeps it small; further consumers count their cheapest strategy)
MAX_SIDES = 4
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
        n = len(self.bits)
        made = [min(self.price[a][b] for a in have) for b in range(n)]  # cheapest collective to each form
        for a in have:
            made[a] = 0.0
        tabs = self.tabs
        if len(tabs) == 1:  # one consumer: its cheapest form, made if need be
            return min((m + x for m, x in zip(made, tabs[0])), default=_INF)
        # which forms to make (each paid once), then every consumer takes its best available form
        extra = [b for b in range(n) if made[b] > 0.0 and made[b] < _INF and any(t[b] < _INF for t in tabs)]
        best = _INF
        for r in range(min(len(extra), len(tabs)) + 1):
            for s in itertools.combinations(extra, r):
                avail = have + list(s)
                v = sum(made[b] for b in s)
                for t in tabs:
                    v += min(t[b] for b in avail)
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


def side_terms(s: Any) -> tuple[int, list[tuple[Term, ...]]]:
    """Per position (0 .. number of ops), the terms of the bound of :class:`~hapnb.search.Search` ``s``
    (being compiled; see the module docstring), and ``jstar``, the device class the bound weighs."""
    g, th, tb = s.graph, s.theory, s._tables
    n_ops = len(g.ops)
    jstar = max(range(len(s._rem[0])), key=lambda j: (s._rem[0][j], -j))
    spine_ops, entries = tb.spine, tb.entries
    local = local_pricer(s, jstar)
    prices: dict[tuple[int, int], list[list[float]]] = s._shared.setdefault("spine_prices", {})

    def price_matrix(ti: int) -> list[list[float]]:
        key = (tb.price_class[ti], tb.forms_class[ti])
        m = prices.get(key)
        if m is None:
            fs = th.forms[ti]
            m = prices[key] = [[0.0 if a == b else _cheapest(s, ti, a, b) for b in fs] for a in fs]
        return m

    # the spine's tensors and their side consumers (each op on at most one path)
    src_of = {i: src for i, (src, _) in spine_ops.items()}
    on_path = set(spine_ops)
    sides: dict[int, list[int]] = {}
    for i in sorted(spine_ops):
        x = src_of[i]
        if x < 0:
            continue
        cands = [
            o for o in g.tensors[x].consumers
            if o not in on_path and g.ops[o].inputs.count(x) == 1 and s._ops[o]
        ]  # fmt: skip
        cands.sort(key=lambda o: (not any(entries[o][c.index].spine_terms for c in s._ops[o]), o))
        sides[x] = sorted(cands[:MAX_SIDES])
        on_path.update(sides[x])

    def side_tab(o: int, x: int) -> list[float]:
        """Side op ``o``'s cheapest strategy per form it takes ``x`` in."""
        k = g.ops[o].inputs.index(x)
        tab = [_INF] * len(th.forms[x])
        for c in s._ops[o]:
            a = entries[o][c.index].in_forms[k]
            v = local(o, c)
            if v < tab[a]:
                tab[a] = v
        return tab

    minloc = [0.0 if i in on_path else min(local(i, c) for c in s._ops[i]) for i in range(n_ops)]
    terms: list[tuple[Term, ...]] = [()] * (n_ops + 1)
    # main[pos]: the main term at pos; M(pos, f): its value with the live spine tensor just made in form f
    loss_bits = tb.bits_of[g.loss]
    end = Joint([[0.0] * len(loss_bits)], price_matrix(g.loss), loss_bits)
    main: list[Term] = [(0, end.table, 0.0, end)] * (n_ops + 1)
    main[n_ops] = (_mask(loss_bits), end.table, 0.0, end)
    joints: dict[tuple[int, int, bool], Joint] = {}
    cur, add = g.loss, 0.0  # the live spine tensor; the non-path ops' cheapest since its spine consumer
    by_in: list[float] | None = None  # the spine consumer's cost per form it takes ``cur`` in
    tabs_side: dict[int, list[float]] = {}
    bits: tuple[int, ...] = loss_bits
    pm: list[list[float]] = []
    for i in range(n_ops - 1, -1, -1):
        if i in spine_ops and spine_ops[i][1] == cur:
            src, out = spine_ops[i]
            k_out = g.ops[i].outputs.index(out)
            _, _, add_n, joint_n = main[i + 1]
            nxt = [joint_n.value(b) + add_n for b in tb.bits_of[out]]
            row_of = entries[i]
            if src < 0:  # the source op: the spine tensor's form is its strategy's
                m = min(local(i, c) + nxt[row_of[c.index].out_forms[k_out]] for c in s._ops[i])
                const = Joint([[m]], [[0.0]], (0,))
                cur, by_in = -1, None
                main[i] = (0, const.table, 0.0, const)
                continue
            k_in = g.ops[i].inputs.index(src)
            by_in = [_INF] * len(th.forms[src])
            for c in s._ops[i]:
                e = row_of[c.index]
                v = local(i, c) + nxt[e.out_forms[k_out]]
                if v < by_in[e.in_forms[k_in]]:
                    by_in[e.in_forms[k_in]] = v
            cur, add = src, 0.0
            tabs_side = {o: side_tab(o, src) for o in sides.get(src, ())}
            bits, pm = tb.bits_of[src], price_matrix(src)
        elif by_in is None:  # after the loss's producer or before the source: a constant
            m1, t1, a1, j1 = main[i + 1]
            main[i] = (m1, t1, a1 + minloc[i], j1)
            continue
        else:
            add += minloc[i]
        pend = [o for o in tabs_side if o >= i]
        key = (cur, len(pend), True)
        j = joints.get(key)
        if j is None:
            j = joints[key] = Joint([by_in] + [tabs_side[o] for o in pend], pm, bits)
        main[i] = (_mask(bits), j.table, add, j)
    # side terms: a spine tensor whose spine consumer ran, with sides still to run
    for x, os_ in sides.items():
        spine_i = next(i for i, (src, _) in spine_ops.items() if src == x)
        late = [o for o in os_ if o > spine_i]
        if not late:
            continue
        bits, pm = tb.bits_of[x], price_matrix(x)
        tabs = {o: side_tab(o, x) for o in late}
        for pos in range(spine_i + 1, late[-1] + 1):
            pend = [o for o in late if o >= pos]
            key = (x, len(pend), False)
            j = joints.get(key)
            if j is None:
                j = joints[key] = Joint([tabs[o] for o in pend], pm, bits)
            terms[pos] = terms[pos] + ((_mask(bits), j.table, 0.0, j),)
    return jstar, [(main[pos],) + terms[pos] for pos in range(n_ops + 1)]


def _mask(bits: Sequence[int]) -> int:
    m = 0
    for b in bits:
        m |= b
    return m
