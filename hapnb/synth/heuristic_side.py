"""The plain A* bound with side consumers: the spine DP (:mod:`hapnb.synth.heuristic`) coupled, at each spine tensor,
with the tensor's other consumers.

:func:`hapnb.synth.heuristic.spine_bound` prices one input→loss path and lets every tensor off it take any form. On
a transformer that loses most of what the program pays: the attention input feeds the query, key and value
projections, the MLP input the gate and up projections, and only one of each is on the spine; the others
took their weights sharded for free (their input's form was free). Here the spine tensor ``x``'s other
consumers (*side* ops, at most :data:`MAX_SIDES`, each assigned to one spine tensor) join the DP at ``x``:
the collectives that turn ``x`` into new forms are paid once, and every consumer (the spine op and the
sides) takes ``x`` in a form that is present or made (a small facility-location problem over ``x``'s
forms, :class:`Joint`). A side op's output stays free.

Off the spine, *branches* (:func:`_branches`) join the bound the same way: a path into a path op's other
activation input (an encoder-decoder's decoder side before its first cross-attention, a shared
position-bias computation), back through each op's largest input, with its own sides; the op it merges
into gives it its share of its cost by the form it takes the branch in (what that op costs above its
cheapest for the spine's form; one branch per op), and a branch that starts at a tracked tensor is that
tensor's side; so is one whose input a side op makes (a parallel block's MLP after its first projection:
that op heads the branch, so the form it makes is the form the branch starts in). A branch merging into a
spine op can instead be coupled there (:class:`~hapnb.synth.heuristic_rejoin.Merge`; a branch without a weight
only where it reduces over the batch, :func:`_reduces_batch`: a batch norm's mean and variance, which data
parallelism all-reduces before the norm uses them, and which the bound otherwise left free: on a stack of
batch-normed convolutions on ``h100x8`` the root bound was 11 % below the optimum, and is the optimum); a
side's branch that merges back into a later op of its tensor's own branch (a decoder's self-attention off the
spine) is coupled in the branch DP (:mod:`hapnb.synth.heuristic_diamond`). A parameter that several spine
ops take (tied embeddings, :func:`_tied`), or that a spine op takes after an op off the spine (Whisper's
decoder embedding), is loaded once in one form: the spine DP keeps its form as a state read from
the properties (:class:`Tied`), and pays its load (its gradient's sync) where the DP first loads it if no
form is present yet. A spine tensor that a later spine op takes again (a residual, a mixture-of-experts
layer's input at its dispatch einsum) keeps the form that op takes it in as a state too
(:mod:`hapnb.synth.heuristic_rejoin`).

A tensor is converted at most once (the search's rule): besides the form it was made in, a :class:`Joint`
gives its consumers at most one more form (the cheapest collective from the present form; a slice of a
replicated form is free but is that one conversion), none once two are present. A statistic that a buffer
update reads (a training batch norm's mean and variance, :mod:`hapnb.synth.updates`) has the update as one
more consumer of its Joint where it is a branch tensor (a norm's statistics are; elsewhere the update is
left out, which only lowers the bound), priced per form as if the program held it in that form alone
(nothing ``I``, an all-reduce ``R``, an all-gather sharded): the search charges the update when the
statistic dies, at least the least of its forms' prices. Left out, a norm computed feature-split (its
statistics need no collective in the norm itself) looked cheaper than it is: on ResNet-50 on ``h100x8`` the
bound stayed 1.4 % below the optimum after 71,793 expansions; with it the loop proves its plan in 27,943.

Relaxations (each can only lower the bound): computation on one device (the one with the most left),
stages merged, tensors off the spine and its side inputs free, gradient syncs counted only for parameters
with one consumer (and the tied one). Every op's cost and every tensor's conversions are counted in
exactly one term, so the sum of the terms is admissible.

The bound of a node at position ``pos`` is ``acc[jstar] + Σ term(props)``, one *term* per spine tensor with
pending consumers: the main term (the live spine tensor, with the rest of the spine behind it) and, for
an earlier spine tensor whose spine consumer ran but whose sides did not, a side term. A term is
``(mask, table, add, joint)``: ``props & mask`` is the tensor's present forms, ``table`` caches
``joint(present)`` (the cost of its pending consumers and what follows them) and ``add`` the rest of the
ops before the spine consumer that are on no path (their cheapest strategy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ..triples import LOADABLE_ROLES
from .heuristic import bound_device, local_pricer, price_matrices, storage_open
from .heuristic_diamond import Least, coupled_joint, find_diamonds
from .heuristic_joint import Joint, Term
from .heuristic_rejoin import Layout, Merge, coupled_term, find_merges, find_rejoins, made_rejoins

__all__ = ["MAX_SIDES", "side_terms"]

#: the most side consumers coupled with one spine tensor (the facility-location step enumerates subsets of
#: the tensor's forms, so this keeps it small; further consumers count their cheapest strategy)
MAX_SIDES = 16
#: the most ops on one branch (:func:`_branches`)
MAX_BRANCH = 256
_INF = float("inf")


def side_terms(s: Any) -> tuple[int, list[tuple[Term, ...]]]:
    """Per position (0 .. number of ops), the terms of the bound of :class:`~hapnb.synth.search.Search` ``s``
    (being compiled; see the module docstring), and ``jstar``, the device class the bound weighs."""
    g, tb = s.graph, s._tables
    n_ops = len(g.ops)
    jstar = bound_device(s)
    spine_ops, entries = tb.spine, tb.entries
    local = local_pricer(s, jstar)
    price_matrix = price_matrices(s)

    # the spine's tensors and their side consumers (each op on at most one path)
    src_of = {i: src for i, (src, _) in spine_ops.items()}
    on_path = set(spine_ops)
    sides: dict[int, list[int]] = {}
    for i in sorted(spine_ops):
        x = src_of[i]
        if x < 0:
            continue
        sides[x] = _side_consumers(s, x, on_path)
        on_path.update(sides[x])
    # loads the bound otherwise misses, priced at the op that takes them: a weight's prologue (its cast
    # under autocast) and a weight shared by a spine op with off-spine ops
    tables, windows = _prologue_tables(s, local, price_matrix, on_path)
    shared, shared_windows = _shared_param_tables(s, price_matrix, jstar)
    for i, rows in shared.items():
        tables.setdefault(i, []).extend(rows)
    windows += shared_windows
    local = _with_input_tables(local, tables, entries)
    # branches (paths into a path op's other inputs) with their sides; x -> the path op taking it
    consumer_of = {src: i for i, (src, _) in spine_ops.items() if src >= 0}
    branches, anchors = _branches(s, on_path, sides, consumer_of)

    minloc = [0.0 if i in on_path else min(local(i, c) for c in s._ops[i]) for i in range(n_ops)]
    terms: list[tuple[Term, ...]] = [()] * (n_ops + 1)
    joints: dict[tuple[Any, ...], Joint] = {}  # (tensor, pending sides, main?, state) -> its Joint
    bt = _BranchTables(s, local, price_matrix, sides, anchors, branches, on_path, minloc, terms)

    # a branch into a spine op is solved when the DP below reaches that op (it reads the op's share, see
    # merge_share), the others now
    merging: dict[int, list[tuple[int, int, int]]] = {}
    for br in branches:
        m = consumer_of[br[-1][2]]
        if m in spine_ops:
            merging.setdefault(m, []).append(br)
        else:
            bt.solve(br)
    merges = find_merges(s, branches, anchors, consumer_of)
    paths = _Paths(local, minloc, sides, price_matrix, merging, joints, merges, bt, jstar)
    main, coupled = _main_terms(s, paths)
    for br in branches:
        if br[0][0] not in bt.solved:
            bt.solve(br)
    for br in branches:  # positions (b, consumer]: the live branch tensor ``out``
        for b, _, out in br:
            for pos in range(b + 1, consumer_of[out] + 1):
                pend = [o for o in sides.get(out, ()) if o >= pos]
                j = bt.term_joint(out, bt.by_ins[-1 - b], pend)
                terms[pos] = terms[pos] + ((_mask(tb.bits_of[out]), j.table, 0.0, j),)
    # side terms: a spine tensor whose spine consumer ran, with sides still to run
    for x, os_ in sides.items():
        spine_i = consumer_of[x]
        late = [o for o in os_ if o > spine_i]
        if not late:
            continue
        bits, pm = tb.bits_of[x], price_matrix(x)
        tabs = {o: bt.side_tab(o, x) for o in late}
        # up to a coupled merge's head, the main term values these sides in the state's form
        first = max(spine_i, coupled[x].head) + 1 if x in coupled else spine_i + 1
        for pos in range(first, late[-1] + 1):
            pend = [o for o in late if o >= pos]
            key = (x, len(pend), False)
            j = joints.get(key)
            if j is None:
                j = joints[key] = Joint([tabs[o] for o in pend], pm, bits)
            terms[pos] = terms[pos] + ((_mask(bits), j.table, 0.0, j),)
    # a prologue that ran is in the node's cost: take off what its consumer's table may add (twice: a merge
    # op's share of its cost for a branch is a difference of two of its strategies)
    for p_op, c_op, most in windows:
        _add_constant(terms, p_op + 1, c_op + 1, -2.0 * most)
    return jstar, [(main[pos],) + terms[pos] for pos in range(n_ops + 1)]


def _add_constant(terms: list[tuple[Term, ...]], first: int, stop: int, v: float) -> None:
    """Add ``v`` to the bound at the positions ``first .. stop - 1`` (a term of no properties)."""
    const = Joint([[v]], [[0.0]], (0,))
    for pos in range(first, stop):
        terms[pos] = terms[pos] + ((0, const.table, 0.0, const),)


class _BranchTables:
    """The tables of the side ops and branches of :func:`side_terms`: per branch op, its cost per form it
    takes its path input in (``by_ins``, with the rest of its branch and the merge op's share,
    ``merge_tabs``); a branch whose first op takes a tracked tensor (``heads``) is that tensor's side, with
    the branch's rest in its tab. A branch that starts on no tensor is charged before its first op
    (``minloc``, ``terms``)."""

    def __init__(
        self,
        s: Any,
        local: Callable[[int, Any], float],
        price_matrix: Callable[[int], list[list[float]]],
        sides: dict[int, list[int]],
        anchors: dict[int, int],
        branches: Sequence[list[tuple[int, int, int]]],
        on_path: set[int],
        minloc: list[float],
        terms: list[tuple[Term, ...]],
    ) -> None:
        self.s, self.local, self.price_matrix = s, local, price_matrix
        self.sides, self.anchors, self.on_path = sides, anchors, on_path
        self.minloc, self.terms = minloc, terms
        self.heads = {br[0][0]: br for br in branches if br[0][0] in anchors}
        self.by_ins: dict[int, list[float]] = {}
        self.merge_tabs: dict[int, list[float]] = {}
        self.solved: set[int] = set()
        self._joints: dict[tuple[int, int], Joint] = {}
        #: a branch tensor's diamond-coupled value (:mod:`hapnb.synth.heuristic_diamond`) while its sides pend
        self.coupled: dict[int, Least] = {}
        upd = s._updates
        #: a statistic a buffer update reads: the update's price per form, one more consumer of its Joint
        self.update_tabs: dict[int, list[float]] = upd.form_prices() if upd is not None else {}

    def plain_tab(self, o: int, x: int) -> list[float]:
        """Side op ``o``'s cheapest strategy per form it takes ``x`` in."""
        s = self.s
        k = s.graph.ops[o].inputs.index(x)
        tab = [_INF] * len(s.theory.forms[x])
        for c in s._ops[o]:
            a = s._tables.entries[o][c.index].in_forms[k]
            v = self.local(o, c)
            if v < tab[a]:
                tab[a] = v
        return tab

    def side_tab(self, o: int, x: int) -> list[float]:
        """Side op ``o`` of ``x``: its plain table, or, heading a branch, with what follows it."""
        br = self.heads.get(o)
        if br is None:
            return self.plain_tab(o, x)
        if o not in self.solved:
            self.solve(br)
        return self.by_ins[o]

    def branch_joint(self, x: int, by_in: list[float], pend: list[int], cache: bool = True) -> Joint:
        """A branch tensor's term: its path consumer (``by_in``) and its sides still to run (``pend``); cached
        per tensor and pending count unless ``cache`` is off (a merge's head table ends in a chosen form)."""
        key = (x, len(pend))
        j = self._joints.get(key) if cache else None
        if j is None:
            j = self.joint(x, [by_in] + [self.side_tab(o, x) for o in pend])
            if cache:
                self._joints[key] = j
        return j

    def joint(self, x: int, tabs: list[list[float]]) -> Joint:
        """The :class:`Joint` of tensor ``x``'s consumers with these tables (and a buffer update that reads it)."""
        up = self.update_tabs.get(x)
        return Joint(tabs if up is None else [*tabs, up], self.price_matrix(x), self.s._tables.bits_of[x])

    def term_joint(self, x: int, by_in: list[float], pend: list[int]) -> Joint | Least:
        """Branch tensor ``x``'s term with its sides ``pend`` still to run: coupled with its diamond
        (:mod:`hapnb.synth.heuristic_diamond`) while every side is pending, else :meth:`branch_joint`."""
        least = self.coupled.get(x)
        if least is not None and len(pend) == len(self.sides.get(x, ())):
            return least
        return self.branch_joint(x, by_in, pend)

    def charge_before(self, b: int, v: float) -> None:
        """Count ``v`` at every position up to op ``b``: in the latest op's cheapest cost up to ``b`` that is
        on no path, and as a constant term at the positions after it."""
        p = b
        while p >= 0 and p in self.on_path:
            p -= 1
        if p >= 0:
            self.minloc[p] += v
        if p < b:
            _add_constant(self.terms, p + 1, b + 1, v)

    def back(
        self, b: int, x: int, out: int, nxt: Sequence[float], allow: Callable[[Any], bool] | None = None
    ) -> list[float]:
        """Branch op ``b``'s cost per form it takes its path input ``x`` in, ``nxt`` valuing its output
        ``out``'s forms (with what follows); ``allow``: which of its strategies count (default all)."""
        s = self.s
        g, entries = s.graph, s._tables.entries
        k_in, k_out = g.ops[b].inputs.index(x), g.ops[b].outputs.index(out)
        tab = [_INF] * len(s.theory.forms[x])
        for c in s._ops[b]:
            if allow is not None and not allow(c):
                continue
            e = entries[b][c.index]
            v = self.local(b, c) + nxt[e.out_forms[k_out]]
            if v < tab[e.in_forms[k_in]]:
                tab[e.in_forms[k_in]] = v
        return tab

    def solve(self, br: list[tuple[int, int, int]]) -> None:
        """Branch ``br``'s tables, backwards from the merge op's share of its cost (0: any form is free)."""
        s = self.s
        g, entries, bits_of = s.graph, s._tables.entries, s._tables.bits_of
        self.solved.add(br[0][0])
        y = br[-1][2]
        nxt_tab = self.merge_tabs.get(y) or [0.0] * len(s.theory.forms[y])
        diamonds = find_diamonds(s, br, self.sides, self.heads)
        merge_ops = {d.at for d in diamonds.values()}
        nxt_of: dict[int, list[float]] = {}  # a diamond's merge op -> the values of its output's forms
        for b, src, out in reversed(br):
            self.by_ins[-1 - b] = nxt_tab  # the consumer's tab of ``out``
            d = diamonds.get(out)
            at: Joint | Least
            if d is not None:
                at = self.coupled[out] = coupled_joint(self, br, d, nxt_of[d.at])
            else:
                at = self.branch_joint(out, nxt_tab, list(self.sides.get(out, ())))
            nxt = [at.value(bit) for bit in bits_of[out]]
            if b in merge_ops:
                nxt_of[b] = nxt
            if src < 0 and b not in self.anchors:  # its first op: its best strategy, counted before it
                k_out = g.ops[b].outputs.index(out)
                best = min(self.local(b, c) + nxt[entries[b][c.index].out_forms[k_out]] for c in s._ops[b])
                self.charge_before(b, best)
                return
            nxt_tab = self.by_ins[b] = self.back(b, self.anchors[b] if src < 0 else src, out, nxt)

    def head_tab(self, m: Merge, f: int) -> list[float]:
        """A coupled merge's head with its branch, per form it takes ``m.x`` in, the branch ending in form
        ``f`` at the merge op (whose cost the spine DP counts in that state); nothing is cached under the
        branch's own keys."""
        return self.head_to(m.head, m.x, m.y, f)

    def head_to(self, head: int, x: int, y: int, f: int) -> list[float]:
        """Side op ``head`` of ``x`` with its branch, per form it takes ``x`` in, the branch's output ``y``
        taken in form ``f`` by the op it merges into (made in ``f`` or converted to it)."""
        end = [0.0 if b == f else _INF for b in range(len(self.s.theory.forms[y]))]
        return self.carry_back(self.heads[head], end, x)

    def carry_back(self, ops: Sequence[tuple[int, int, int]], tab: list[float], x: int = -1) -> list[float]:
        """``tab`` (the values of the last op's output forms) carried back along the branch ops ``ops`` ((op,
        path input, output) in program order; a first op with no path input takes ``x``): each output's
        Joint with its sides (uncached: ``tab`` is not the branch's own), then the op's cost per form it
        takes its input in."""
        bits_of = self.s._tables.bits_of
        for b, src, out in reversed(ops):
            at = self.branch_joint(out, tab, list(self.sides.get(out, ())), cache=False)
            tab = self.back(b, x if src < 0 else src, out, [at.value(bit) for bit in bits_of[out]])
        return tab


class _Paths(NamedTuple):
    """What :func:`side_terms` hands its main DP (:func:`_main_terms`): the op pricer, the cheapest cost of
    the ops on no path, the sides, the price matrices, the branches that merge into spine ops, the Joint
    cache, the merges it may couple, the side and branch tables (with the merge ops' shares) and the device
    class the bound weighs."""

    local: Callable[[int, Any], float]
    minloc: list[float]
    sides: dict[int, list[int]]
    price_matrix: Callable[[int], list[list[float]]]
    merging: dict[int, list[tuple[int, int, int]]]
    joints: dict[tuple[Any, ...], Joint]
    merges: list[Merge]
    bt: _BranchTables
    jstar: int


def _main_terms(s: Any, pt: _Paths) -> tuple[list[Term], dict[int, Merge]]:
    """The main term per position: the spine DP from the loss back to the source op. ``main[pos]`` values the
    live spine tensor's present forms (with the rest of the spine behind it); the DP reads it with the
    tensor just made in each form. States (:class:`hapnb.synth.heuristic_rejoin.Layout`): a tied parameter's present form
    (:func:`_tied`, :class:`Tied`) and the forms that rejoining spine tensors and merging branches are taken
    in (:mod:`hapnb.synth.heuristic_rejoin`, :class:`~hapnb.synth.heuristic_rejoin.Coupled`); without either
    there is one state. Also returns the coupled merges by their tensor ``x``."""
    g, th, tb = s.graph, s.theory, s._tables
    n_ops, spine_ops, entries, local = len(g.ops), tb.spine, tb.entries, pt.local
    loss_bits = tb.bits_of[g.loss]
    end = Joint([[0.0] * len(loss_bits)], pt.price_matrix(g.loss), loss_bits)
    main: list[Term] = [(0, end.table, 0.0, end)] * (n_ops + 1)
    main[n_ops] = (_mask(loss_bits), end.table, 0.0, end)
    # a parameter that several spine ops take (tied embeddings) is loaded once, in one form: the DP keeps
    # its form as a state (0: not loaded yet), read from the node's properties (:class:`Tied`)
    tied = _tied(s)
    pmask = _mask(tb.bits_of[tied]) if tied >= 0 else 0
    # its load (with its gradient's sync and its optimizer step's excess) is paid once, where the DP first
    # loads it (state 0 -> its form)
    tied_load = (
        {b: _load_with_step(s, tied, f, pt.jstar) for f, b in zip(th.forms[tied], tb.bits_of[tied])}
        if tied >= 0
        else {}
    )
    pvals = [0, *tb.bits_of[tied]] if tied >= 0 else [0]
    made = made_rejoins(s, pt.bt.on_path)
    lay = Layout(find_rejoins(s, pt.sides, len(pvals), pt.merges, made), pvals, n_ops + 1, pt.bt.head_tab)
    per_state: list[dict[tuple[int, ...], Joint]] = [{}] * (n_ops + 1)  # per position: state -> Joint
    per_state[n_ops] = {st: end for st in lay.states(n_ops)}
    tieds: dict[tuple[int, int], Tied] = {}
    cur, add = g.loss, 0.0  # the live spine tensor; the non-path ops' cheapest since its spine consumer
    by_in: dict[tuple[int, ...], list[float]] | None = None  # per state: the spine consumer's cost per form
    tabs_side: dict[int, list[float]] = {}
    bits: tuple[int, ...] = loss_bits
    pm: list[list[float]] = []
    for i in range(n_ops - 1, -1, -1):
        if i in spine_ops and spine_ops[i][1] == cur:
            src, out = spine_ops[i]
            op = g.ops[i]
            k_out = op.outputs.index(out)
            k_p = op.inputs.index(tied) if tied >= 0 and op.inputs.count(tied) == 1 else -1
            nxt = lay.next_values(i, per_state[i + 1], tb.bits_of[out], main[i + 1][2])
            check, keep = lay.moves(i)
            k_in = op.inputs.index(src) if src >= 0 else -1
            by_in = {st: [_INF] * (len(th.forms[src]) if src >= 0 else 1) for st in lay.states(i)}
            # per strategy: ((state it can run in, its cost with the rest), its form of ``src``, its index)
            moves: list[tuple[list[tuple[tuple[int, ...], float]], int, int]] = []
            for c in s._ops[i]:
                e = entries[i][c.index]
                v0 = local(i, c)
                fp = tb.bits_of[tied][e.in_forms[k_p]] if k_p >= 0 else 0
                row = []
                for st in by_in:
                    p = st[0]
                    if fp and p and p != fp:
                        continue  # the tied parameter is loaded in another form
                    if any(e.in_forms[k] != st[n] for n, k in check):
                        continue  # a rejoining tensor taken in another form than the state's
                    v = v0 + tied_load[fp] if fp and not p else v0  # the tied parameter loaded here
                    row.append((st, v + nxt[(fp or p, *(st[n] for n in keep))][e.out_forms[k_out]]))
                moves.append((row, e.in_forms[k_in] if src >= 0 else 0, c.index))
            for row, a, _ in moves:
                for st, v in row:
                    if v < by_in[st][a]:
                        by_in[st][a] = v
            if i in pt.merging:  # the branch with the largest input into op i gets the op's share (one only)
                _merge(s, pt, i, moves, by_in, lay.merges_at(i))
            if src < 0:  # the source op: the spine tensor's form is its strategy's
                consts = {st: Joint([by_in[st]], [[0.0]], (0,)) for st in by_in}
                t0 = Tied({st[0]: j for st, j in consts.items()}, pmask) if tied >= 0 else consts[(0,)]
                cur, by_in = -1, None
                main[i], per_state[i] = (pmask, t0.table, 0.0, t0), consts
                continue
            cur, add = src, 0.0
            tabs_side = {o: pt.bt.side_tab(o, src) for o in pt.sides.get(src, ()) if o not in lay.heads}
            bits, pm = tb.bits_of[src], pt.price_matrix(src)
        elif by_in is None:  # after the loss's producer or before the source: a constant
            m1, t1, a1, j1 = main[i + 1]
            main[i], per_state[i] = (m1, t1, a1 + pt.minloc[i], j1), per_state[i + 1]
            continue
        else:
            add += pt.minloc[i]
            by_in = lay.born(i, by_in)  # a coupled tensor op i makes: the least over its form before it
        pend = [o for o in tabs_side if o >= i]
        js = {}
        for st in by_in:
            key = (cur, len(pend), True, st, lay.extra(i))  # a merge's head leaves them once it ran
            j = pt.joints.get(key)
            if j is None:
                tabs = [by_in[st]] + [tabs_side[o] for o in pend] + lay.delta(i, st, len(bits))
                j = pt.joints[key] = Joint(tabs, pm, bits)
            js[st] = j
        per_state[i] = js
        if lay.live(i):
            t2 = coupled_term(
                lay, i, js, pmask, _mask(bits), tb.bits_of, pt.price_matrix, _merge_outer(s, pt, lay, i)
            )
            main[i] = (t2.mask, t2.table, add, t2)
        elif tied < 0:
            main[i] = (_mask(bits), js[(0,)].table, add, js[(0,)])
        else:
            t1 = tieds.get((cur, len(pend)))
            if t1 is None:
                t1 = tieds[(cur, len(pend))] = Tied({st[0]: j for st, j in js.items()}, pmask)
            main[i] = (_mask(bits) | pmask, t1.table, add, t1)
    return main, {r.x: r for r in lay.rejoins if isinstance(r, Merge)}


def _merge_outer(s: Any, pt: _Paths, lay: Layout, pos: int) -> list[tuple[int, int, dict[int, Joint]]]:
    """Per coupled merge whose tensor ``x``'s spine consumer ran and whose head did not (at ``pos``): its state
    component, ``x``'s form mask and, per form the branch ends in, the Joint of ``x``'s pending sides (the
    head with its branch ending in that form) for :class:`~hapnb.synth.heuristic_rejoin.Coupled`."""
    out = []
    bits_of = s._tables.bits_of
    for comp, j in lay.merge_outer(pos):
        m = lay.rejoins[j]
        pend = [o for o in pt.sides[m.x] if o > m.spine and o >= pos]
        by_form = {}
        for f in m.forms:
            key = (m.x, len(pend), "merge", f)
            jt = pt.joints.get(key)
            if jt is None:
                tabs = [lay.head_tab(j, f) if o == m.head else pt.bt.side_tab(o, m.x) for o in pend]
                jt = pt.joints[key] = Joint(tabs, pt.price_matrix(m.x), bits_of[m.x])
            by_form[f] = jt
        out.append((comp, _mask(bits_of[m.x]), by_form))
    return out


def _merge(
    s: Any,
    pt: _Paths,
    i: int,
    moves: Sequence[tuple[Sequence[tuple[tuple[int, ...], float]], int, int]],
    by_in: Mapping[tuple[int, ...], list[float]],
    free: Sequence[int] = (),
) -> None:
    """Spine op ``i``'s share of its cost for the branch with the largest input into it (what a strategy
    costs above the cheapest one for the spine tensor's form, in any state: the least over them is
    admissible), then solve the branches that merge there.

    ``free``: the state components of the merges coupled at op ``i``. The share serves the positions after
    a merge's head, where the main term is the least over that component and nothing else depends on it,
    so the cheapest for the spine's form is taken over it too (per state, every strategy would be the
    cheapest of its own merge form, and the share would vanish)."""
    g, th, entries = s.graph, s.theory, s._tables.entries
    brs = sorted(pt.merging[i], key=lambda br: (-g.tensors[br[-1][2]].numel, br[-1][2]))
    y = brs[0][-1][2]
    k_y = g.ops[i].inputs.index(y)

    def key(st: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(-1 if n in free else x for n, x in enumerate(st))

    best: dict[tuple[int, ...], list[float]] = {}
    for st, tab in by_in.items():
        have = best.get(key(st))
        best[key(st)] = list(tab) if have is None else [min(u, w) for u, w in zip(have, tab)]
    share = [_INF] * len(th.forms[y])
    for row, a, index in moves:
        f = entries[i][index].in_forms[k_y]
        for st, v in row:
            b = best[key(st)][a]
            if v < _INF and b < _INF:
                v = max(0.0, v - b)
                if v < share[f]:
                    share[f] = v
    pt.bt.merge_tabs[y] = share
    for br in brs:
        if br[0][0] not in pt.bt.solved:
            pt.bt.solve(br)


def _branches(
    s: Any, on_path: set[int], sides: dict[int, list[int]], consumer_of: dict[int, int]
) -> tuple[list[list[tuple[int, int, int]]], dict[int, int]]:
    """Paths into a path op's other activation inputs, each a list of (op, path input or -1, output) in
    program order, latest branch first: from the input back through each op's largest activation input
    made by an op on no path (an encoder-decoder's decoder side before its cross-attention, a shared
    position-bias computation) or by a side op of a spine tensor (which then heads the branch, anchored at
    that tensor), kept when an op on it takes a parameter (or an SFB strategy), or, with none, when it starts
    at a tracked tensor and reduces over the batch (:func:`_reduces_batch`: a batch norm's statistics). A
    branch tensor's other consumers become its sides (as a spine tensor's); ``on_path``, ``sides`` and
    ``consumer_of`` (tensor -> the path op taking it) grow by them."""
    g, entries = s.graph, s._tables.entries
    depth = [0] * len(g.tensors)
    for op in g.ops:
        d = 1 + max((depth[t] for t in op.inputs), default=0)
        for t in op.outputs:
            depth[t] = d

    # a side op (of a spine tensor) that makes a branch's input heads that branch, anchored at its tensor
    side_of = {o: x for x, os_ in sides.items() for o in os_}
    batch = {g.tensors[t].shape[0] for t in g.inputs if g.tensors[t].shape}  # for _reduces_batch
    taken: set[int] = set()

    def free(x: int) -> bool:
        p = g.tensors[x].producer
        return (
            p is not None
            and (p not in on_path or (p in side_of and p not in taken))
            and bool(s._ops[p])
            and g.tensors[x].role not in LOADABLE_ROLES
        )

    out: list[list[tuple[int, int, int]]] = []
    anchors: dict[int, int] = {}
    work = sorted(on_path, reverse=True)
    while work:
        m = work.pop(0)
        for y in g.ops[m].inputs:
            if y in consumer_of or not free(y) or g.ops[m].inputs.count(y) != 1:
                continue
            br: list[tuple[int, int, int]] = []
            t, seen = y, set()
            while True:
                b = g.tensors[t].producer
                seen.add(b)
                acts = [x for x in g.ops[b].inputs if g.tensors[x].role not in LOADABLE_ROLES]
                src = max(acts, key=lambda x: (g.tensors[x].numel, depth[x], -x)) if acts else -1
                if b in side_of or (src >= 0 and (not free(src) or g.tensors[src].producer in seen)):
                    src = -1  # its largest input is on a path (or it is a side op): the branch starts here
                br.append((b, src, t))
                if src < 0 or len(br) >= MAX_BRANCH:
                    break
                t = src
            b = br[-1][0]
            if len(br) >= MAX_BRANCH:
                br[-1] = (b, -1, br[-1][2])
            # an op taking a tracked tensor twice (a variance's mul(x, x)) starts at it too
            tracked = [x for x in g.ops[b].inputs if x in consumer_of]
            weighted = any(entries[k][c.index].spine_terms for k, _, _ in br for c in s._ops[k])
            if not weighted and not (
                (b in side_of or (br[-1][1] < 0 and tracked)) and _reduces_batch(s, br, batch)
            ):
                continue  # weightless: kept only where it reduces over the batch from a tracked tensor
            if b in side_of:  # a side op heads it: it stays its tensor's side
                anchors[b] = side_of[b]
                taken.add(b)
            elif br[-1][1] < 0 and tracked:  # it starts at a tracked tensor: that tensor's side
                anchors[b] = max(tracked, key=lambda x: (g.tensors[x].numel, depth[x], -x))
            br.reverse()
            consumer_of[y] = m
            for b, src, _ in br:
                on_path.add(b)
                if src >= 0:
                    consumer_of[src] = b
            out.append(br)
            work.extend(b for b, _, _ in reversed(br))
    out.sort(key=lambda br: -br[-1][0])
    for br in out:  # the sides, once every branch is laid (a side must not cut a branch short)
        for _, src, t in br:
            for x in (src, t) if src >= 0 else (t,):
                if x in sides:
                    continue
                sides[x] = _side_consumers(s, x, on_path)
                on_path.update(sides[x])
    for b, x in anchors.items():
        sides[x] = sorted({*sides.get(x, ()), b})
    return out, anchors


#: per op, ``(input index, cost per form the op takes that input in)``: what :func:`_with_input_tables` adds
InputTables = dict[int, list[tuple[int, list[float]]]]


def _via(cost: Sequence[float], price: Sequence[Sequence[float]]) -> list[float]:
    """Per form ``b``: the least, over forms ``a``, of ``cost[a]`` plus the cheapest collective from ``a`` to
    ``b`` (``price``, 0 on its diagonal)."""
    n = len(cost)
    return [min((cost[a] + price[a][b] for a in range(n) if cost[a] < _INF), default=_INF) for b in range(n)]


def _with_input_tables(
    local: Callable[[int, Any], float], tables: InputTables, entries: Sequence[Any]
) -> Callable[[int, Any], float]:
    """``local`` plus, for each op of ``tables``, each row's cost of the form its strategy takes that input in."""
    if not tables:
        return local

    def priced(i: int, c: Any) -> float:
        v = local(i, c)
        for k, tab in tables.get(i, ()):
            v += tab[entries[i][c.index].in_forms[k]]
        return v

    return priced


def _prologue_tables(
    s: Any,
    local: Callable[[int, Any], float],
    price_matrix: Callable[[int], list[list[float]]],
    on_path: set[int],
) -> tuple[InputTables, list[tuple[int, int, float]]]:
    """Each *prologue* priced in its consumer. A prologue is an op on no path whose inputs are all loaded
    tensors, one of them a parameter, and whose one output one op takes once: a weight cast to bfloat16
    under ``torch.autocast`` before its linear layer. Off every path its output took any form for free, so
    the bound let the linear layer take its weight sharded (no gradient all-reduce) while the layer's input
    stayed batch-sharded, as no program can (on HF Llama under autocast the root bound was 39 % below the
    plan). Here the consumer's strategy pays, for the form ``f`` it takes the output in, the least over the
    prologue's strategies of their cost (with the weight's load) plus the cheapest collective from their
    output form to ``f``; the prologue joins ``on_path`` (it is counted there only). Every program pays at
    least that, so the bound stays admissible. Once the prologue has run, its cost is in the node's cost:
    at the positions after it up to its consumer the bound takes off twice the most the consumer's table
    adds (returned as ``(prologue, consumer, most)`` windows; twice, since :func:`_merge` splits a merge
    op's cost into the spine's part and a branch's share, and each may hold the table's value)."""
    g, entries = s.graph, s._tables.entries
    tables: InputTables = {}
    windows: list[tuple[int, int, float]] = []
    for op in g.ops:
        if op.id in on_path or not s._ops[op.id] or len(op.outputs) != 1:
            continue
        roles = [g.tensors[t].role for t in op.inputs]
        if "param" not in roles or any(r not in LOADABLE_ROLES for r in roles):
            continue
        y = op.outputs[0]
        cons = g.tensors[y].consumers
        if y == g.loss or len(set(cons)) != 1 or g.ops[cons[0]].inputs.count(y) != 1:
            continue
        made = [_INF] * len(s.theory.forms[y])
        for c in s._ops[op.id]:
            f = entries[op.id][c.index].out_forms[0]
            made[f] = min(made[f], local(op.id, c))
        tab = _via(made, price_matrix(y))
        tables.setdefault(cons[0], []).append((g.ops[cons[0]].inputs.index(y), tab))
        windows.append((op.id, cons[0], max(v for v in tab if v < _INF)))
        on_path.add(op.id)
    return tables, windows


def _shared_param_tables(
    s: Any, price_matrix: Callable[[int], list[list[float]]], jstar: int
) -> tuple[InputTables, list[tuple[int, int, float]]]:
    """The load of each parameter that several ops take, one of them a spine op, other than the one the DP
    keeps as a state (:func:`_tied`), priced at a spine op that takes it: for the form ``f`` that op takes
    the parameter in, the least over the parameter's forms ``l`` of its load in ``l`` (its gradient's sync)
    plus the cheapest collective from ``l`` to ``f``. Without it no term counted such a parameter's load
    (only a single consumer's). Every program loads the parameter in some form and gives that op its form
    by at most one collective (or a load of its own), and no other term counts the load, so the bound stays
    admissible. The program loads it where its first consumer runs: priced at the first consumer when that
    is a spine op, else at the last spine op that takes it, and between the two the load is in the node's
    cost, so there the bound takes off twice the most the table adds (returned as ``(first consumer, spine
    op, most)`` windows, as :func:`_prologue_tables`'s)."""
    g, spine_ops, tied = s.graph, s._tables.spine, _tied(s)
    tables: InputTables = {}
    windows: list[tuple[int, int, float]] = []
    for t in g.params:
        cons = sorted(set(g.tensors[t].consumers))
        if len(cons) < 2 or t == tied or t in s.pins:
            continue
        on_spine = [o for o in cons if o in spine_ops and g.ops[o].inputs.count(t) == 1 and s._ops[o]]
        if not on_spine:
            continue
        at = cons[0] if cons[0] == on_spine[0] else on_spine[-1]
        tab = _via([_load_with_step(s, t, f, jstar) for f in s.theory.forms[t]], price_matrix(t))
        tables.setdefault(at, []).append((g.ops[at].inputs.index(t), tab))
        if at != cons[0]:
            windows.append((cons[0], at, max(v for v in tab if v < _INF)))
    return tables, windows


def _load_with_step(s: Any, t: int, f: Any, jstar: int) -> float:
    """Weight ``t``'s load in form ``f`` (its gradient's sync) with, on device-model devices, what its optimizer
    step in that storage adds on the bound's device over the least one, which the optimizer-step part of the
    bound counts for a weight several ops take (:meth:`hapnb.synth.optimizer_step.OptimizerStep.excess`; a
    single consumer's weight gets its step in :func:`hapnb.synth.heuristic.local_pricer`). A program loads
    the weight once, in one form, so adding the excess where the load is priced counts its step once."""
    v = s._load_s(t, f, False)
    if s._opt is not None:
        v += s._opt.excess(t, f, storage_open(s, t), jstar)
    return v


def _reduces_batch(s: Any, br: Sequence[tuple[int, int, int]], batch: set[int]) -> bool:
    """Whether an op of branch ``br`` has a strategy that makes a partial sum from an input split on its
    batch (dim 0 of a size in ``batch``, the inputs' dim 0 sizes): a batch norm's statistics, which data
    parallelism all-reduces. A norm over the hidden dim (a strategy splitting the hidden dim makes a partial
    sum too) is not one: coupling those made every transformer's synthesis slower for the same bound."""
    g = s.graph
    for k, _, _ in br:
        op = g.ops[k]
        for c in s._ops[k]:
            st = c.strategy
            if any(f.kind == "R" for f in st.outputs) and any(
                f.kind == "G" and f.dim == 0 and g.tensors[t].shape[0] in batch
                for t, f in zip(op.inputs, st.inputs)
            ):
                return True
    return False


def _side_consumers(s: Any, x: int, on_path: set[int]) -> list[int]:
    """The consumers of tensor ``x`` coupled with it as its sides: ops on no path yet that take ``x`` (an op
    taking it twice, a variance's ``mul(x, x)``, counts the form its first input takes: a relaxation), those
    with communicating strategies first, at most :data:`MAX_SIDES`, in program order."""
    g, entries = s.graph, s._tables.entries
    cands = [o for o in g.tensors[x].consumers if o not in on_path and s._ops[o]]
    cands.sort(key=lambda o: (not any(entries[o][c.index].spine_terms for c in s._ops[o]), o))
    return sorted(cands[:MAX_SIDES])


class Tied:
    """A main term's value where a tied parameter's form is part of the state: the :class:`Joint` of the
    parameter's present form (``pmask`` its form bits; 0: not loaded), memoised per properties."""

    __slots__ = ("joints", "pmask", "table")

    def __init__(self, joints: dict[int, Joint], pmask: int) -> None:
        self.joints, self.pmask = joints, pmask
        self.table: dict[int, float] = {}

    def value(self, present: int) -> float:
        v = self.table.get(present)
        if v is None:
            j = self.joints.get(present & self.pmask) or self.joints[0]
            v = self.table[present] = j.value(present & ~self.pmask)
        return v


def _tied(s: Any) -> int:
    """The parameter whose form the spine DP keeps as a state (:class:`Tied`), or -1: the largest that two
    or more spine ops take (once each; tied embeddings), else the largest that a spine op takes after an op
    off the spine has taken it (Whisper's decoder embedding, tied to the output projection on the spine;
    the program loads it there, and the spine op must take it in that form; only a trainable weight, whose
    load costs its gradient's sync: a state for a free load would only take the room of rejoin states)."""
    g, spine_ops = s.graph, s._tables.spine
    best, key = -1, (False, -1)
    for t in g.params:
        cons = sorted(set(g.tensors[t].consumers))
        on = [o for o in cons if o in spine_ops and g.ops[o].inputs.count(t) == 1]
        tr = g.tensors[t]
        if not on or (len(on) < 2 and (cons[0] == on[0] or tr.role != "param" or not tr.requires_grad)):
            continue  # one spine op: only a weight with a gradient to sync (its load costs something)
        k = (len(on) >= 2, g.tensors[t].numel)
        if k > key:
            best, key = t, k
    return best


def _mask(bits: Sequence[int]) -> int:
    m = 0
    for b in bits:
        m |= b
    return m
