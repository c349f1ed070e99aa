"""Spine tensors that rejoin the spine: the form a later spine op takes an earlier spine tensor in, kept as a
state of the spine DP (:mod:`hapnb.synth.heuristic_side`).

The spine DP tracks one live tensor at a time. A spine tensor ``x`` whose spine consumer has run can still be
taken by a later spine op (not as its spine input): the residual stream by the add that closes a block, or
a mixture-of-experts layer's input by the dispatch einsum (``bsd,bsec->becd``), whose spine input is the
larger routing tensor. Without this module that op takes ``x`` in any form for free, so the bound lets an
expert-parallel dispatch (``x`` replicated, the routing tensor and the expert buffer sharded by expert) cost
no more than a data-parallel one, though ``x`` is sharded by batch everywhere else and replicating it costs an
all-gather of the layer's whole activation: on the MoE LM of ``examples/corpus.py`` (real size) the root
bound was 9 % below the optimum and no search within 200k expansions closed the gap; coupled, the root bound
is the optimum.

A :class:`Rejoin` is ``x`` (made by spine op ``made``, the spine input of op ``spine``) and the later spine op
``at`` that takes it. For the positions ``(made, at]`` the DP keeps, as a state, the form ``b`` that op
``at`` takes ``x`` in: at op ``at`` only the strategies that take ``x`` in ``b`` are allowed; where ``x`` is
the live spine tensor (positions ``(made, spine]``) its :class:`~hapnb.synth.heuristic_joint.Joint` has one more
consumer that needs ``b`` (so ``b`` is made once, shared with the spine op and the sides that take it); after
``x``'s spine consumer (positions ``(spine, at]``) the term pays the cheapest collective from a present form
of ``x`` to ``b`` (nothing when ``b`` is present). The term's value is the least over the states
(:class:`Coupled`), and the DP takes the least over ``b`` where ``x`` is made. A tied parameter's state
(:class:`~hapnb.synth.heuristic_side.Tied`) is the state's first component.

Admissible: every complete program takes ``x`` at op ``at`` in some form ``b``; that form is present then, so
it was made (``x``'s first form) or converted from a present form by the one collective a tensor may have
(the search converts a tensor at most once, so the collective's source is present from ``x``'s making on);
the relaxed program with that state pays at most what the program pays for ``x``'s forms and for the ops, and
the bound is the least over the states. ``x``'s collectives are counted in one term only: a spine tensor is
coupled only when none of its side consumers runs after its spine consumer (those pay their forms in a side
term of their own). Leaving a rejoin out only frees its form again (the bound without it), so which are
coupled is a matter of cost: the states at a position are the product of the forms of the coupled tensors
live there (and the tied parameter's), and :func:`find_rejoins` keeps the largest tensors first (then the
shortest spans, which nest inside the longer ones) while that product stays at most :data:`MAX_STATES`.

A tensor made by an op on no path and taken by a later spine op (:func:`made_rejoins`: a padded model's
attention mask, made once and added to every layer's scores) is a :class:`Rejoin` too, with ``spine`` its
maker: over its whole span the term pays the cheapest collective from its present form to the state's. The
bound let every layer's ``add`` take the mask in any form for free, so a program that made it split on the
key positions (which no batch-split layer can use without an all-to-all of the whole mask) looked as cheap
as one that made it split on the batch, and the search walked the first layer once per way of making it:
T5 with a padding mask (``examples/patterns.py``, real size) needed 43,694 expansions for its proof, 27,692
with the coupling. Such tensors take the room the others leave (they come last, with the merges' cap), so
they never displace a rejoin or a merge: when they did, the MoE LM's root bound fell from 9.07 to 8.23 s.
Only a tensor at least :data:`MADE_MIN_SHARE` of the spine tensor its op takes is coupled: a norm's
statistics (ResNet-50's batch norms, an RMSNorm's ``rsqrt``) are tiny, their collectives latency, and
coupling them left every root the same but steered ResNet-50's search on ``h100x8``, which stops at its
budget, to a 1.4 % costlier program (35.49 against 35.00 ms).

A :class:`Merge` is the same coupling for a branch instead of a spine tensor: a parallel block (GPT-J, Cohere)
runs its MLP beside its attention from one layer norm, so the MLP is a branch headed by a side op of the
norm's output ``x`` and merged by the add that closes the block (op ``at``). Without the coupling, the add's
share of its cost for the branch (:func:`hapnb.synth.heuristic_side._merge`) is the least over the spine's forms,
so the branch could end as a partial sum (a row-parallel down projection) for free while the spine is
priced batch-sharded: on GPT-J (real size) the root bound was 10 % below the optimum. Coupled, the state is
the form ``f`` the add takes the branch's output ``y`` in (positions ``(made, at]``); at op ``at`` only the
strategies taking ``y`` in ``f`` are allowed (so the add's whole cost is the spine's), and the head's table is
its branch's cost ending in ``f`` (:meth:`Layout.head_tab`): an extra consumer of ``x`` where ``x`` is the live
spine tensor and the head is still to run, and, after ``x``'s spine consumer, in the term of ``x``'s pending
sides, which the main term takes over up to the head (:attr:`Coupled.branch`). Admissible as a rejoin: every
program's add takes ``y`` in some form ``f``, and the branch's ops and ``x``'s forms are counted once. One
merge per ``x`` (its pending sides are valued in one state), the largest branch first, then the latest merge
op (the block's add rather than attention's query path).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..triples import LOADABLE_ROLES

__all__ = [
    "MAX_STATES",
    "MAX_MERGE_STATES",
    "Rejoin",
    "Merge",
    "Coupling",
    "find_rejoins",
    "made_rejoins",
    "find_merges",
    "Layout",
    "Coupled",
    "coupled_term",
    "taken_forms",
]

#: the most DP states at one position (the product of the coupled tensors' forms and the tied parameter's)
MAX_STATES = 16
#: the same for a merge (:class:`Merge`): 24 admits a 5-form merge beside a tied LM head's 4 states (Cohere).
#: Raising :data:`MAX_STATES` to 24 too lets T5's residual rejoins in beside its tied head: the same plan in
#: 37,842 expansions instead of 41,645, but its bound's compile time triples (synthesis 4.3 -> 4.8 s;
#: measured 2026-11-29)
MAX_MERGE_STATES = 24
#: a tensor made off every path is coupled (:func:`made_rejoins`) only when it is at least this fraction of the
#: spine tensor that its op takes (a padded model's mask beside 16 or 32 heads' scores, not a norm's statistics)
MADE_MIN_SHARE = 1 / 64
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class Rejoin:
    """Spine tensor ``x`` (made by spine op ``made``, spine input of op ``spine``) taken again by spine op
    ``at`` (its input ``k``) in one of ``forms`` (indices into ``theory.forms[x]``); ``made == spine``: ``x``
    is made by an op on no path (:func:`made_rejoins`)."""

    x: int
    made: int
    spine: int
    at: int
    k: int
    forms: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Merge:
    """A branch headed by side op ``head`` of spine tensor ``x`` (made by spine op ``made``, spine input of op
    ``spine``) whose output ``y`` spine op ``at`` takes (its input ``k``) in one of ``forms``: a parallel
    block's MLP beside its attention (GPT-J, Cohere), merged by the add that closes the block."""

    x: int
    made: int
    spine: int
    head: int
    y: int
    at: int
    k: int
    forms: tuple[int, ...]
    #: no op of the branch takes a weight: a batch norm's statistics (``mean``, ``var``), coupled in the room
    #: the other couplings leave (:func:`find_rejoins`)
    weightless: bool = False


#: what the DP keeps as a state: a rejoining spine tensor's form or a merging branch's
Coupling = Rejoin | Merge


def find_rejoins(
    s: Any,
    sides: Mapping[int, Sequence[int]],
    tied_states: int,
    merges: Sequence[Merge] = (),
    made: Sequence[Rejoin] = (),
) -> list[Coupling]:
    """The rejoining spine tensors of search ``s``, the merging branches (``merges``) and the tensors made off
    every path (``made``, :func:`made_rejoins`) that the DP couples (module docstring): each spine tensor with
    no side consumer after its spine consumer, with the first later spine op that takes it once; the largest
    first (then the shortest span), while the states at every position stay at most :data:`MAX_STATES` (a
    merge: :data:`MAX_MERGE_STATES`; ``tied_states``: the tied parameter's, 1 if none)."""
    g, spine_ops = s.graph, s._tables.spine
    found = list(made)
    for i1, (x, _) in spine_ops.items():
        made = _spine_made(s, x)
        if made is None:
            continue
        if any(o > i1 for o in sides.get(x, ())):
            continue  # its late sides pay its forms in a side term
        later = [
            o for o in g.tensors[x].consumers
            if o > i1 and o in spine_ops and spine_ops[o][0] != x and g.ops[o].inputs.count(x) == 1
        ]  # fmt: skip
        if not later or not s._ops[min(later)]:
            continue
        at = min(later)
        k = g.ops[at].inputs.index(x)
        found.append(Rejoin(x, made, i1, at, k, taken_forms(s, at, k)))
    cands: list[Coupling] = [*found, *merges]
    cands.sort(
        key=lambda r: (
            _late(r),  # a tensor made off every path, a weightless merge: in the room left
            -g.tensors[_coupled(r)].numel, r.at - r.made, _coupled(r), isinstance(r, Merge),
        )
    )  # fmt: skip
    size = [tied_states] * (len(g.ops) + 1)
    kept: list[Coupling] = []
    for r in cands:
        span = range(r.made + 1, r.at + 1)
        cap = MAX_MERGE_STATES if isinstance(r, Merge) or _late(r) else MAX_STATES
        if max(size[p] for p in span) * len(r.forms) > cap:
            continue
        for p in span:
            size[p] *= len(r.forms)
        kept.append(r)
    kept.sort(key=lambda r: (r.made, r.x, isinstance(r, Merge)))
    return kept


def _late(r: Coupling) -> bool:
    """Whether coupling ``r`` only takes the DP states the others leave: a tensor made off every path, or a
    weightless merge (when a weightless merge displaced the MoE LM's dispatch rejoin, its root bound fell from
    9.07 to 8.22 s)."""
    return r.weightless if isinstance(r, Merge) else r.made == r.spine


def find_merges(
    s: Any,
    branches: Sequence[Sequence[tuple[int, int, int]]],
    anchors: Mapping[int, int],
    consumer_of: Mapping[int, int],
) -> list[Merge]:
    """The branches of search ``s`` that the spine DP may couple (:class:`Merge`; ``branches``, ``anchors`` and
    ``consumer_of`` as :func:`hapnb.synth.heuristic_side._branches` lays them): headed by a side op of a spine
    tensor ``x``, merging into a spine op, with a weighted op after the head (which can change the branch's
    form: a row-parallel projection), the largest first, then the latest merge op, one per ``x`` (a coupled
    merge values all of ``x``'s pending sides in its state's form), or with no weighted op at all (a batch
    norm's statistics, :attr:`Merge.weightless`). Attention's key and value paths into SDPA (a weighted head,
    nothing weighted after it) are left out; coupling them made T5's synthesis slower (4.3 -> 4.8 s) for the
    same plan."""
    g, spine_ops, entries = s.graph, s._tables.spine, s._tables.entries
    out: list[Merge] = []
    taken: set[int] = set()
    for br in sorted(branches, key=lambda br: (-g.tensors[br[-1][2]].numel, -consumer_of.get(br[-1][2], -1))):
        head, y = br[0][0], br[-1][2]
        x, at = anchors.get(head, -1), consumer_of.get(y, -1)
        if x < 0 or x in taken or at not in spine_ops or g.ops[at].inputs.count(y) != 1 or not s._ops[at]:
            continue
        head_w = any(entries[head][c.index].spine_terms for c in s._ops[head])
        after_w = any(entries[b][c.index].spine_terms for b, _, _ in br[1:] for c in s._ops[b])
        if head_w and not after_w:
            continue  # its end form follows its head's output form (the head's table couples them)
        made, spine = _spine_made(s, x), consumer_of.get(x, -1)
        if made is None or spine_ops.get(spine, (-1, 0))[0] != x:
            continue  # x is not a spine tensor
        k = g.ops[at].inputs.index(y)
        taken.add(x)
        out.append(Merge(x, made, spine, head, y, at, k, taken_forms(s, at, k), not (head_w or after_w)))
    return out


def made_rejoins(s: Any, on_path: set[int]) -> list[Rejoin]:
    """Tensors made by an op on no path (after the spine's first op) that a later spine op takes, not as its
    spine input: a padded model's attention mask, made once and added to every layer's scores. Each is a
    :class:`Rejoin` at the first such op ``at``, made and "spine-consumed" by its producer, so that over its
    whole span ``(made, at]`` the term pays the cheapest collective from a present form to the state's form.
    No other term reads such a tensor's forms (its producer is on no path: it is free everywhere else)."""
    g, spine_ops = s.graph, s._tables.spine
    if not spine_ops:
        return []
    first = min(spine_ops)
    out = []
    for t, tensor in enumerate(g.tensors):
        p = tensor.producer
        if p is None or p <= first or p in on_path or tensor.role in LOADABLE_ROLES:  # on_path: spine ops too
            continue
        later = [
            o for o in tensor.consumers
            if o in spine_ops and spine_ops[o][0] != t and g.ops[o].inputs.count(t) == 1
        ]  # fmt: skip
        if not later or not s._ops[min(later)]:
            continue
        at = min(later)
        if tensor.numel < MADE_MIN_SHARE * g.tensors[spine_ops[at][0]].numel:
            continue  # small beside the spine tensor there: its collectives are latency (module docstring)
        k = g.ops[at].inputs.index(t)
        forms = taken_forms(s, at, k)
        if len(forms) > 1:
            out.append(Rejoin(t, p, p, at, k, forms))
    return out


def _least_over(
    rows: Iterable[tuple[tuple[int, ...], list[float]]], drop: Sequence[int]
) -> dict[tuple[int, ...], list[float]]:
    """Per-state value lists with the state components ``drop`` left out: the elementwise least over them."""
    out: dict[tuple[int, ...], list[float]] = {}
    for st, vals in rows:
        key = tuple(x for n, x in enumerate(st) if n not in drop)
        have = out.get(key)
        out[key] = list(vals) if have is None else [min(a, b) for a, b in zip(have, vals)]
    return out


def _spine_made(s: Any, x: int) -> int | None:
    """The spine op that makes tensor ``x`` as its spine output, or None (``x`` is not a spine tensor)."""
    made = s.graph.tensors[x].producer if x >= 0 else None
    if made is None or s._tables.spine.get(made, (0, -1))[1] != x:
        return None
    return made


def taken_forms(s: Any, at: int, k: int) -> tuple[int, ...]:
    """The forms (indices) in which op ``at``'s strategies take its input ``k``."""
    entries = s._tables.entries
    return tuple(sorted({entries[at][c.index].in_forms[k] for c in s._ops[at]}))


def _coupled(r: Coupling) -> int:
    """The tensor whose form a coupling keeps: the rejoining tensor, or the merging branch's output."""
    return r.y if isinstance(r, Merge) else r.x


class Layout:
    """The DP's states per position: ``(p, b_1, ..)``, ``p`` the tied parameter's present form (its bit, 0:
    not loaded; always 0 without one) and ``b_j`` the form the j-th live rejoin (``rejoins`` order) is taken
    in at its op ``at``. A rejoin is live at the positions ``(made, at]``."""

    def __init__(
        self,
        rejoins: Sequence[Coupling],
        pvals: Sequence[int],
        n_pos: int,
        head_tab: Callable[[Merge, int], list[float]] | None = None,
    ) -> None:
        self.rejoins = list(rejoins)
        self.pvals = list(pvals)
        #: a merging branch's head: its cost with the branch per form it takes ``x`` in, the branch ending in
        #: form ``f`` (``head_tab(merge, f)``), cached per (coupling index, f)
        self._head_tab = head_tab
        self._tabs: dict[tuple[int, int], list[float]] = {}
        #: the heads of the coupled merges (they leave the sides of their tensor ``x``)
        self.heads = {r.head for r in self.rejoins if isinstance(r, Merge)}
        self._live: list[tuple[int, ...]] = [()] * n_pos
        for j, r in enumerate(self.rejoins):
            for p in range(r.made + 1, r.at + 1):
                self._live[p] = self._live[p] + (j,)
        self._states: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def live(self, pos: int) -> tuple[int, ...]:
        """The rejoins live at ``pos`` (indices into :attr:`rejoins`)."""
        return self._live[pos]

    def states(self, pos: int) -> list[tuple[int, ...]]:
        """Every state at ``pos``."""
        live = self._live[pos]
        out = self._states.get(live)
        if out is None:
            forms = [self.rejoins[j].forms for j in live]
            out = self._states[live] = [(p, *bs) for p in self.pvals for bs in itertools.product(*forms)]
        return out

    def moves(self, i: int) -> tuple[list[tuple[int, int]], list[int]]:
        """For spine op ``i``: the state components its strategies must match, as (component, input index),
        and the components kept into the next position's state (the rest of that state: the rejoin made
        by op ``i``, which the next position's values take the least over)."""
        live = self._live[i]
        check = [(1 + n, self.rejoins[j].k) for n, j in enumerate(live) if self.rejoins[j].at == i]
        keep = [1 + n for n, j in enumerate(live) if self.rejoins[j].at != i]
        return check, keep

    def next_values(
        self, i: int, joints: Mapping[tuple[int, ...], Any], bits: Sequence[int], add: float
    ) -> dict[tuple[int, ...], list[float]]:
        """Per state after spine op ``i`` without the rejoin ``i`` makes: the value at position ``i + 1`` with
        the live spine tensor just made in each form (``bits``), the least over that rejoin's forms."""
        rows = ((st, [joints[st].value(b) + add for b in bits]) for st in self.states(i + 1))
        return _least_over(rows, self._made_at(i))

    def born(self, i: int, values: dict[tuple[int, ...], list[float]]) -> dict[tuple[int, ...], list[float]]:
        """``values`` (per state at position ``i + 1``) per state at ``i``: where op ``i`` (on no path) makes a
        coupled tensor (:func:`made_rejoins`), the least over its form; else ``values`` itself."""
        new = self._made_at(i)
        return _least_over(values.items(), new) if new else values

    def _made_at(self, i: int) -> list[int]:
        """The state components at position ``i + 1`` of the couplings that op ``i`` makes."""
        return [1 + n for n, j in enumerate(self._live[i + 1]) if self.rejoins[j].made == i]

    def extra(self, pos: int) -> tuple[tuple[int, int], ...]:
        """The couplings that add a consumer to the live spine tensor at ``pos`` (state component, index into
        rejoins): a rejoin before its spine consumer, a merge whose head is still to run."""
        out = []
        for n, j in enumerate(self._live[pos]):
            r = self.rejoins[j]
            if pos <= r.spine and (not isinstance(r, Merge) or pos <= r.head):
                out.append((1 + n, j))
        return tuple(out)

    def delta(self, pos: int, st: tuple[int, ...], n_forms: int) -> list[list[float]]:
        """The extra consumers (:meth:`extra`) of the live spine tensor at ``pos`` in state ``st``: a rejoin
        needs its form in the state (made once, like the other consumers' forms); a merge's head comes with
        its branch ending in the state's form."""
        out = []
        for comp, j in self.extra(pos):
            if isinstance(self.rejoins[j], Merge):
                out.append(self.head_tab(j, st[comp]))
            else:
                out.append([0.0 if f == st[comp] else _INF for f in range(n_forms)])
        return out

    def head_tab(self, j: int, f: int) -> list[float]:
        """Merge ``j``'s head: its cost with the branch per form it takes ``x`` in, the branch ending in ``f``."""
        key = (j, f)
        tab = self._tabs.get(key)
        if tab is None:
            assert self._head_tab is not None
            tab = self._tabs[key] = self._head_tab(self.rejoins[j], f)  # type: ignore[arg-type]
        return tab

    def outer(self, pos: int) -> list[tuple[int, int]]:
        """The rejoins at ``pos`` whose spine consumer has run: (state component, index into rejoins)."""
        return [
            (1 + n, j) for n, j in enumerate(self._live[pos])
            if isinstance(self.rejoins[j], Rejoin) and pos > self.rejoins[j].spine
        ]  # fmt: skip

    def merges_at(self, i: int) -> list[int]:
        """The state components of the merges that spine op ``i`` closes."""
        live = self._live[i]
        return [
            1 + n
            for n, j in enumerate(live)
            if isinstance(self.rejoins[j], Merge) and self.rejoins[j].at == i
        ]

    def merge_outer(self, pos: int) -> list[tuple[int, int]]:
        """The merges at ``pos`` whose tensor's spine consumer has run and whose head has not: (state
        component, index into rejoins); ``x``'s pending sides are valued in the state's form there."""
        out = []
        for n, j in enumerate(self._live[pos]):
            r = self.rejoins[j]
            if isinstance(r, Merge) and r.spine < pos <= r.head:
                out.append((1 + n, j))
        return out


class Coupled:
    """A main term where rejoins are live: the least over the states (``joints``: state -> the live spine
    tensor's Joint) of that Joint's value plus, per rejoin whose spine consumer ran (``outer``: state
    component, the tensor's form bits, its price matrix), the cheapest collective from a present form to the
    state's form (0 when present). ``pmask``: the tied parameter's bits (the state's first component is its
    present form, as :class:`~hapnb.synth.heuristic_side.Tied`); ``cmask``: the live spine tensor's. Memoised per
    properties in :attr:`table`."""

    __slots__ = ("joints", "pmask", "pvals", "cmask", "outer", "branch", "table")

    def __init__(
        self,
        joints: Mapping[tuple[int, ...], Any],
        pmask: int,
        cmask: int,
        outer: Sequence[tuple[int, Sequence[int], Sequence[Sequence[float]]]],
        branch: Sequence[tuple[int, int, Mapping[int, Any]]] = (),
    ) -> None:
        self.joints = dict(joints)
        self.pmask, self.cmask = pmask, cmask
        self.pvals = {st[0] for st in self.joints}
        self.outer = list(outer)
        #: per merge whose head is still to run after its tensor's spine consumer: (state component, the
        #: tensor's form bits as a mask, per form of the branch's end the Joint of the tensor's pending sides)
        self.branch = list(branch)
        self.table: dict[int, float] = {}

    @property
    def mask(self) -> int:
        """The property bits the value reads."""
        m = self.pmask | self.cmask
        for _, bits, _ in self.outer:
            for b in bits:
                m |= b
        for _, xmask, _ in self.branch:
            m |= xmask
        return m

    def value(self, present: int) -> float:
        """The term's value for the present bits (``props & mask``)."""
        v = self.table.get(present)
        if v is None:
            v = self.table[present] = self._solve(present)
        return v

    def _solve(self, present: int) -> float:
        p = present & self.pmask
        if p not in self.pvals:
            p = 0
        cur = present & self.cmask
        made: list[tuple[int, list[float]]] = []
        for comp, bits, price in self.outer:
            have = [a for a, b in enumerate(bits) if present & b]
            if len(have) == 1:  # a collective from the present form (the tensor's one conversion)
                cost = list(price[have[0]])
                cost[have[0]] = 0.0
            else:  # converted already: a present form only (none present: free, never the case)
                cost = [0.0 if f in have or not have else _INF for f in range(len(bits))]
            made.append((comp, cost))
        best = _INF
        for st, joint in self.joints.items():
            if st[0] != p:
                continue
            v = 0.0
            for comp, cost in made:
                v += cost[st[comp]]
            for comp, xmask, by_form in self.branch:
                v += by_form[st[comp]].value(present & xmask)
            if v >= best:
                continue
            v += joint.value(cur)
            if v < best:
                best = v
        return best


def coupled_term(
    lay: Layout,
    pos: int,
    joints: Mapping[tuple[int, ...], Any],
    pmask: int,
    cmask: int,
    bits_of: Sequence[Sequence[int]],
    price: Callable[[int], Sequence[Sequence[float]]],
    branch: Sequence[tuple[int, int, Mapping[int, Any]]] = (),
) -> Coupled:
    """The :class:`Coupled` term at ``pos`` (rejoins live there) from its per-state Joints (``bits_of``: each
    tensor's form bits; ``price``: a tensor's price matrix; ``branch``: :attr:`Coupled.branch`)."""
    outer = []
    for comp, j in lay.outer(pos):
        x = lay.rejoins[j].x
        outer.append((comp, bits_of[x], price(x)))
    return Coupled(joints, pmask, cmask, outer, branch)
