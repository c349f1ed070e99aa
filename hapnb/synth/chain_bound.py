"""A stronger A* bound for long searches: a relaxed program over tracked chains, solved exactly by memoised DP.

:class:`hapnb.synth.search.Search` starts with the cheap bound of :mod:`hapnb.synth.heuristic_side` (one lookup per child).
On a transformer LM that bound leaves the query / value paths of attention free between their projection
and the attention op, so programs that shard the hidden state (and must later pay for it) look cheap and
the search stalls on the combinations of small tensors' forms. After :data:`SWITCH_AFTER` expansions a
search switches to :class:`ChainBound` as well (the larger of the two is used, and the open programs'
scores are raised at once); every search the zoo's models make finishes before that, so their plans and
times do not change.

The relaxed program tracks a set of tensors: the spine (:func:`hapnb.synth.heuristic.spine_path`) and, from each
spine tensor's other consumers, a *chain* forward along one consumer each step until it meets a tracked
op (the attention op for the query and value paths). Relaxations (each can only lower the bound):
computation on one device (the one with the most left), stages merged (the stage cost is at least the
communication plus that device's computation), comm tokens ignored (a tracked tensor keeps every form it
was given; a conversion costs the cheapest collective from a present form), untracked tensors free,
untracked ops at their cheapest strategy, gradient syncs counted only for parameters with one consumer.
Each op's cost and each tracked tensor's conversions are counted once, so the value is admissible.

The value of a state (the present forms of the tracked tensors live at a position) is computed on demand
by a memoised DP over the tracked ops (iterative: no recursion limit), shared by every node that meets it.
"""

from __future__ import annotations

import heapq
from operator import itemgetter
from typing import Any

from .heuristic import local_pricer

__all__ = ["SWITCH_AFTER", "NEAR", "MAX_CHAIN", "ChainBound", "switch"]

#: a search switches to the chain bound after this many expansions without a proof
SWITCH_AFTER = 5000
#: a search whose proven bound is within this share of its best program (after a dive) does not switch
NEAR = 0.002
#: the most ops on one side chain
MAX_CHAIN = 64
#: the most DP states one chain bound expands (about 30 us each). The searches it helps need up to ~27k
#: (the corpus's tiny Llama ~12k, with LoRA adapters ~27k; at realistic sizes every corpus search proves
#: its program before it would switch); past the cap the bound gives up (:attr:`ChainBound.exhausted`; an
#: encoder-decoder's bias and cross-attention chains can need millions: T5, Whisper, Cohere at real size)
#: and states not solved yet are valued at the untracked ops' part alone (still admissible). At 60k giving
#: up took 1.3-2.0 s of those models' 3-5 s syntheses
MAX_STATES = 32_000
_INF = float("inf")


class ChainBound:
    """The relaxed program's cost from a position, for a search's properties (see the module docstring).

    ``s``: the :class:`~hapnb.synth.search.Search` (compiled; its strategies, tables, ratios and price caches).
    :meth:`value` is the bound of the ops from ``pos`` on (add the open stage's computation on ``jstar``).
    """

    def __init__(self, s: Any) -> None:
        g, tb = s.graph, s._tables
        self.n = n = len(g.ops)
        self.jstar = jstar = s._jstar
        local = local_pricer(s, jstar)
        edges = self._choose(s)
        tracked_ops = set(edges)
        tracked = {t for ts in edges.values() for t in ts}
        entries = tb.entries
        # per tracked op: its distinct moves (the cheapest strategy per forms of its tracked inputs and
        # outputs): (cost, ((tensor, bit needed), ...), (bit made, ...) in its tracked outputs' order)
        raw: dict[int, tuple[list[int], list[Any]]] = {}
        last: dict[int, int] = {}
        for i in sorted(tracked_ops):
            op = g.ops[i]
            tin = [(k, t) for k, t in enumerate(op.inputs) if t in edges[i]]
            tout = [(k, t) for k, t in enumerate(op.outputs) if t in tracked]
            for _, t in tin:
                last[t] = i
            cheapest: dict[tuple[Any, ...], float] = {}
            for c in s._ops[i]:
                e = entries[i][c.index]
                need = tuple((t, tb.bits_of[t][e.in_forms[k]]) for k, t in tin)
                made = tuple(tb.bits_of[t][e.out_forms[k]] for k, t in tout)
                v = local(i, c)
                if v < cheapest.get((need, made), _INF):
                    cheapest[(need, made)] = v
            raw[i] = ([t for _, t in tout], [(v, need, made) for (need, made), v in cheapest.items()])
        born = {t: g.tensors[t].producer for t in tracked}
        # live tracked tensors before each op: made by an earlier op, needed by a tracked op at or after it
        self.live: list[tuple[int, ...]] = [
            tuple(sorted(t for t in tracked if t in last and born[t] is not None and born[t] < p <= last[t]))
            for p in range(n + 1)
        ]
        self._mask = [tb.tmask[t] for t in range(len(g.tensors))]
        # untracked ops: their cheapest strategy, as suffix sums; the next tracked op from each position
        suffix = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            m = 0.0 if i in tracked_ops else min((local(i, c) for c in s._ops[i]), default=0.0)
            suffix[i] = suffix[i + 1] + m
        self._suffix = suffix
        self._next = [n] * (n + 1)
        for p in range(n - 1, -1, -1):
            self._next[p] = p if p in tracked_ops else self._next[p + 1]
        self._memo: dict[tuple[int, tuple[int, ...]], float] = {}
        self._states = 0  # DP states expanded (_succ calls), against MAX_STATES
        #: the DP went past :data:`MAX_STATES`: unsolved states count 0 beyond the untracked ops
        self.exhausted = False
        self._price = _Prices(s)
        # the moves with state indices: needs as (index in the state before op i or -1, bit, tensor); the
        # next state read by one getter off the state before followed by the made bits
        self._moves: dict[int, tuple[Any, list[Any]]] = {}
        for i, (outs, moves) in raw.items():
            at = {t: k for k, t in enumerate(self.live[i])}
            n_in = len(self.live[i])
            src = [at[t] if t not in outs else n_in + outs.index(t) for t in self.live[i + 1]]
            self._moves[i] = (
                _getter(src),
                [(v, tuple((at.get(t, -1), b, t) for t, b in need), made) for v, need, made in moves],
            )

    @staticmethod
    def _choose(s: Any) -> dict[int, set[int]]:
        """The tracked ops, each with the tensors it takes along a tracked edge: the spine's, and a chain
        from each other consumer of a spine tensor that passes a parameter (or an SFB strategy) before it
        ends or meets a tracked op (a chain without one adds states, not cost)."""
        g, tb = s.graph, s._tables
        entries = tb.entries
        edges: dict[int, set[int]] = {i: ({src} if src >= 0 else set()) for i, (src, _) in tb.spine.items()}
        spine_tensors = sorted({t for src, out in tb.spine.values() for t in (src, out) if t >= 0})
        for x in spine_tensors:
            for o in sorted(g.tensors[x].consumers):
                if o in edges or not s._ops[o] or g.ops[o].inputs.count(x) != 1:
                    continue
                chain: list[tuple[int, int]] = []  # (op, the tensor it takes along the chain)
                i, t, merge = o, x, None
                for _ in range(MAX_CHAIN):
                    chain.append((i, t))
                    outs = [y for y in g.ops[i].outputs if g.tensors[y].consumers]
                    if not outs:
                        break
                    t = max(outs, key=lambda y: (g.tensors[y].numel, -y))
                    cons = sorted(c for c in g.tensors[t].consumers if g.ops[c].inputs.count(t) == 1)
                    hit = [c for c in cons if c in edges or any(c == k for k, _ in chain)]
                    if hit:
                        merge = hit[0] if hit[0] in edges else None
                        break
                    if not cons:
                        break
                    i = cons[0]
                if not any(entries[k][c.index].spine_terms for k, _ in chain for c in s._ops[k]):
                    continue
                for k, y in chain:
                    edges[k] = {y}
                if merge is not None:
                    edges[merge].add(t)
        return edges

    def value(self, pos: int, props: int) -> float:
        """A lower bound of the cost of ops ``pos ..`` (communication plus computation on ``jstar``)."""
        j = self._next[pos]
        head = self._suffix[pos] - self._suffix[j]
        if j >= self.n:
            return head
        mask = self._mask
        key = (j, tuple(props & mask[t] for t in self.live[j]))
        v = self._memo.get(key)
        if v is None:
            v = 0.0 if self.exhausted else self._solve(key)
        return head + v

    def _succ(self, key: tuple[int, tuple[int, ...]]) -> list[tuple[float, Any]]:
        """The moves from a state: (cost to the next tracked op's state, that state or None at the end)."""
        i, bits = key
        j = self._next[i + 1]
        head = self._suffix[i + 1] - self._suffix[j]
        cheapest, known = self._price.cheapest, self._price._memo
        nxt, moves = self._moves[i]
        end = j >= self.n
        out = []
        for cost, need, made in moves:
            st = bits
            for k, b, t in need:
                if k < 0:
                    continue  # not live in the relaxed program: free
                have = st[k]
                if have & b or not have:
                    continue  # present (or unknown: free)
                x = known.get((t, have, b))
                cost += cheapest(t, have, b) if x is None else x
                if st is bits:
                    st = list(bits)
                st[k] = have | b
            if cost >= _INF:
                continue
            out.append((cost + head, None if end else (j, nxt((*st, *made)))))
        return out

    def _solve(self, key: tuple[int, tuple[int, ...]]) -> float:
        """The DP value of ``key`` (memoised), by an explicit depth-first walk over the successor states."""
        memo = self._memo
        succ: dict[Any, list[tuple[float, Any]]] = {}
        stack = [key]
        while stack:
            k = stack[-1]
            if k in memo:
                stack.pop()
                continue
            moves = succ.get(k)
            if moves is None:
                self._states += 1
                if self._states > MAX_STATES:
                    self.exhausted = True  # give up: the partial results in memo are exact, keep them
                    return 0.0
                moves = succ[k] = self._succ(k)
                todo = [nk for _, nk in moves if nk is not None and nk not in memo]
                if todo:
                    stack.extend(todo)
                    continue
            best = _INF
            for c, nk in moves:
                v = c + (memo[nk] if nk is not None else 0.0)
                if v < best:
                    best = v
            memo[k] = best
            del succ[k]
            stack.pop()
        return memo[key]


def switch(s: Any) -> ChainBound | None:
    """Make the chain bound of search ``s`` and raise its open programs' scores to it (the larger of two
    admissible bounds is admissible); returns the bound for the search's hot loop, or None when its DP
    went past :data:`MAX_STATES` while rescoring (the search goes on with its first bound, unchanged)."""
    chain = ChainBound(s)
    j, nodes = s._jstar, s._nodes
    heap, raised = [], []
    for score, k, nid in s._heap:
        node = nodes[nid]
        if not node.complete and not node.expanded:
            v = node.base + node.acc[j] + chain.value(node.pos, node.props)
            if chain.exhausted:
                return None
            if v > score:
                score = v
                raised.append((node, v))
        heap.append((score, k, nid))
    for node, v in raised:
        node.score = v
    heapq.heapify(heap)
    s._heap = heap
    return chain


def _getter(idx: list[int]) -> Any:
    """``f(values)``: the tuple of ``values`` at ``idx`` (:func:`operator.itemgetter`, also for 0 or 1 index)."""
    if len(idx) > 1:
        return itemgetter(*idx)
    if idx:
        k = idx[0]
        return lambda v: (v[k],)
    return lambda v: ()


class _Prices:
    """The cheapest collective from any present form (bits) of a tensor to a form (bit), memoised per price
    class (the search's collective prices are shared by the tensors of one class)."""

    def __init__(self, s: Any) -> None:
        from .heuristic import _cheapest

        self._s, self._cheapest = s, _cheapest
        self._memo: dict[tuple[int, int, int], float] = {}

    def cheapest(self, t: int, have: int, b: int) -> float:
        """Seconds of the cheapest collective giving tensor ``t`` the form of bit ``b`` from bits ``have``."""
        key = (t, have, b)
        v = self._memo.get(key)
        if v is None:
            s = self._s
            tb = s._tables
            bits = tb.bits_of[t]
            forms = s.theory.forms[t]
            dst = forms[bits.index(b)]
            v = min(
                (self._cheapest(s, t, f, dst) for f, fb in zip(forms, bits) if have & fb),
                default=_INF,
            )
            self._memo[key] = v
        return v
