"""A* synthesis of the distributed program Q for fixed sharding ratios B (paper §4.3-4.5).

A *partial program* is a sequence of :class:`~hapnb.cost.model.Step` values (a computation with the loads and
collectives fused in front of it). Its properties are the (tensor, form) pairs it has established. The
search expands the cheapest partial program by every triple whose precondition holds and whose
postcondition adds a property, until a complete program (``loss | R``) is proven optimal.

Search-space reductions (each documented with its reason):

* **Fused loads** (paper §4.5, first): parameters and inputs are loaded in exactly one form, fused into
  their first consumer, so their position is not enumerated.
* **Fused communication**: collectives appear only in front of a consumer that needs the new form.
* **No repeated communication** (paper §4.5, second): each tensor is converted by at most one collective;
  parameters and inputs are never communicated (they are loaded in the form needed).
* **Redundant properties** (paper §4.5, third): once every consumer of a tensor has run, its properties
  are dropped, so equivalent partial programs share one key.
* **Canonical order**: computations follow the single-device program's topological order. Programs that
  only reorder independent computations establish the same properties, so this removes duplicate
  interleavings; the search still chooses every strategy, form, collective and stage boundary.

The cost is the cost model's (:meth:`hapnb.cost.model.CostModel.evaluate`): the stage cost ``sum(comm + max_j
comp_j)``, with the collectives of batch norm's running-statistics updates (:mod:`hapnb.synth.updates`, charged
where a partial program decides them) and, on device-model devices, the optimizer step in the last stage
(:mod:`hapnb.synth.optimizer_step`: each weight's part, by its storage, in a per-device ``tail``).
Dominance is keyed on the property set (plus the comm tokens and the position); two partial programs
with the same key are compared by (closed cost, per-device computation of the open stage, optimizer step
so far): one is dropped only if the other is no worse in every component, so the search is exact for
that cost. The heuristic is the larger of the remaining computation at infinite
bandwidth, ``max_j (open_j + remaining lower bound_j)``, and a relaxed program along the spine coupled with
its tensors' other consumers (:mod:`hapnb.synth.heuristic_side`); a search still open after
:data:`~hapnb.synth.chain_bound.SWITCH_AFTER` expansions adds the chain bound (:mod:`hapnb.synth.chain_bound`: the spine
and the side chains to the ops they meet, by memoised DP). Each never overestimates, so the first complete
program popped is optimal; a search stopped by a limit reports the proven lower bound
(:attr:`SearchResult.bound`, ``gap``).

**Duplex** (``Search(..., duplex=True)``, HiDup's two micro-batches, :mod:`hapnb.synth.duplex`): a node's label
is ``(base, acc, copen, tail)``: ``base`` is HiDup's ``ψ_{i-1} + φ_{i-1} + max(-φ_{i-1}, c_i)`` for the
open stage i plus the gradient syncs so far (whole, once), ``acc`` the open stage's per-device
computation, ``copen`` its feature communication, ``tail`` the per-device inner syncs of virtual
devices. Labels at one state are pruned by Pareto dominance (:func:`hapnb.synth.dominance.duplex_dominated`) and the
priority is an admissible bound of ψ (:meth:`Search._h_duplex`), so the first complete program popped
minimises the duplex time (the optimizer step and buffer updates left out). ``step()``, ``run()``
and the views work the same; a node's ``cost`` is the partial program's duplex time if it ended there.

**Memory** (``Search(..., memory=True)``, :mod:`hapnb.synth.memory_prune`): partial programs whose memory lower
bound exceeds a device's capacity are pruned ("memory: ..." in :attr:`SearchEvent.pruned`); a parameter
used replicated is loaded with its storage deferred (replicated, ZeRO-2 or ZeRO-3), priced at the cheapest
and realized when the program completes (the cheapest storage that fits), and dominance also compares
memory. Exact for fixed ratios among the programs that fit (on device-model devices a deferred storage
is realised by its communication and memory; the optimizer step it changes is charged, not weighed).

>>> import hapnb
>>> g = hapnb.zoo_graph("mlp", layers=2, hidden=16, batch=8, inputs=16)  # doctest: +SKIP
"""

from __future__ import annotations

import heapq
import itertools
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..cost.model import Conversion, CostModel, Load, Step
from ..hardware.cluster import Cluster
from ..ir.forms import Form, I, R, Storage
from ..ir.graph import Graph
from ..triples import Theory
from ..triples import theory as build_theory
from .chain_bound import NEAR, SWITCH_AFTER, ChainBound, switch
from .dominance import duplex_dominated, plain_dominated
from .duplex import label_close, label_step, priority
from .heuristic import spine_bound, spine_value
from .heuristic_joint import Term, term_value
from .heuristic_side import side_terms
from .memory_prune import MemoryTracker
from .moves import _UNMET, Moves, stage_step
from .optimizer_step import OptimizerStep
from .spec import (
    PinError,
    SearchEvent,
    SearchNode,
    SearchResult,
    explain_no_program,
    normalize_ratios,
    resolve_pins,
)
from .tables import ratio_classes
from .updates import BufferUpdates

__all__ = ["Search", "SearchNode", "SearchEvent", "SearchResult", "PinError", "NoProgramError"]

_EPS = 1e-12
_INF = float("inf")
#: :meth:`Search.run` dives after this share of the ops' count of A* expansions (at least DIVE_AFTER_MIN)
DIVE_AFTER = 0.05
DIVE_AFTER_MIN = 8
#: dives from the best open programs before a search switches to the chain bound (:meth:`Search._switch_bound`)
SWITCH_DIVES = 8


class NoProgramError(RuntimeError):
    """No complete program exists under the given pins."""


@dataclass
class _Stats:
    expansions: int = 0
    generated: int = 0
    pruned_dominated: int = 0
    pruned_bound: int = 0
    pruned_repeated_comm: int = 0
    max_frontier: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(slots=True)
class _Node:
    parent: int
    step: Step | None
    base: float
    acc: tuple[float, ...]
    pos: int
    props: int
    comm: int
    score: float
    complete: bool = False
    extra: tuple[Conversion, ...] = field(default=())
    expanded: bool = False
    copen: float = 0.0  # duplex: the open stage's feature communication (full batch)
    tail: tuple[float, ...] = ()  # duplex: per-device inner gradient sync, charged once at the end
    ms: Any = None  # memory=True: the MemState (hapnb.synth.memory_prune)
    real: tuple[Load, ...] = ()  # memory=True, complete: the deferred loads as realized (in program order)


class Search(Moves):
    """Step-able A* over one program's theory for fixed ratios.

    ``ratios``: one list of per-device ratios per segment (a single flat list is used for every
    segment); default throughput-proportional. ``pins``: tensor name -> form (``hapnb.Shard(d)``,
    ``hapnb.Replicate()``, or a parameter storage ``hapnb.FullShard(d)`` / ``hapnb.ShardGradOp(d)``); names are
    parameter FQNs, input names or op-output names. ``duplex``: minimise HiDup's duplex time (two
    micro-batches, see the module docstring) instead of the stage sum. ``memory``: keep to every device's
    memory (module docstring; ``options["zero"]=False`` leaves ZeRO storage out; not with ``duplex``).
    """

    def __init__(
        self,
        graph: Graph | Theory,
        cluster: Cluster,
        ratios: Sequence[float] | Sequence[Sequence[float]] | None = None,
        pins: Mapping[str, Form] | None = None,
        *,
        options: Mapping[str, bool] | None = None,
        duplex: bool = False,
        memory: bool = False,
        shared: dict[str, Any] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        # costs that depend only on the theory, the cluster and the ratios (not on pins or options), shared
        # by the searches of one re-planning context at the same ratios (hapnb.synth.memo.Memo.shared)
        self._shared: dict[str, Any] = {} if shared is None else shared
        self.duplex = bool(duplex)
        self.theory = graph if isinstance(graph, Theory) else build_theory(graph)
        self.graph = g = self.theory.graph
        self.cluster = cluster
        self.cost_model = cm = CostModel(self.theory, cluster)
        self.ratios = normalize_ratios(ratios, cluster, cm.n_segments)
        resolved = resolve_pins(self.theory, pins or {})
        #: parameters pinned to ZeRO storage (hapnb.FullShard / ShardGradOp): loaded I through a gather
        self.storage = {t: p for t, p in resolved.items() if isinstance(p, Storage)}
        self.pins = {t: (I if isinstance(p, Storage) else p) for t, p in resolved.items()}
        self.options = {"grouped": True, "sfb": True, **(options or {})}
        #: memory=True: prune programs that cannot fit, realize replicated parameters' storage at the end
        self.memory = bool(memory) and not self.duplex
        self._mem: MemoryTracker | None = None
        self.n = cluster.n
        #: devices whose computation is the same for every op (same speed, device model and ratios): the
        #: search keeps one per class in its per-device vectors (exact: they are equal within a class)
        self._reps = ratio_classes(cm, self.ratios)
        self._compile()
        self._stats = _Stats()
        self._nodes: list[_Node] = []
        self._heap: list[tuple[float, int, int]] = []
        self._seen: dict[tuple[int, int, int], list[tuple[float, tuple[float, ...]]]] = {}
        self._best: int | None = None
        self._counter = itertools.count()
        zero = (0.0,) * len(self._reps)
        if self.duplex:
            root = _Node(-1, None, 0.0, zero, 0, 0, 0, self._h_duplex(0, 0.0, 0.0, zero, zero, 0), tail=zero)
            self._seen[(0, 0, 0)] = [(root.base, root.acc, root.copen, root.tail)]
        else:
            root = _Node(-1, None, 0.0, zero, 0, 0, 0, self._h(0, zero, 0), tail=zero)
            root.ms = self._mem.root() if self._mem is not None else None
            self._seen[(0, 0, 0)] = [(root.base, root.acc, root.ms, root.tail)]
        self._push(root)
        self._stats.seconds += time.perf_counter() - t0
        del g

    # ------------------------------------------------------------------ compile
    def _compile(self) -> None:
        lb = self._compile_moves()
        if self.memory:
            self._mem = MemoryTracker(self)
        # batch norm's running-statistics updates, charged where decided (the duplex time leaves them out)
        upd = BufferUpdates(self.graph, self._tables, self.cost_model)
        self._updates = upd if upd and not self.duplex else None
        # device models' optimizer step, in the last stage (the duplex time leaves it out)
        self._opt = (
            OptimizerStep(self.cost_model, self.theory, self.ratios, self._reps)
            if self.cost_model.modelled and not self.duplex
            else None
        )
        # suffix sums of the per-device lower bounds: remaining computation at infinite bandwidth
        rem = [(0.0,) * len(self._reps)]
        for v in reversed(lb):
            rem.append(tuple(a + b for a, b in zip(rem[-1], v)))
        rem.reverse()
        self._rem = rem
        if self.duplex:
            self._jstar, self._spine_opts = spine_bound(self)
            self._spine_comm_opts = spine_bound(self, comm_only=True)[1]
            self._terms: list[tuple[Term, ...]] = []
        else:  # the spine coupled with its tensors' other consumers (hapnb.synth.heuristic_side)
            self._jstar, self._terms = side_terms(self)
        self._w = tuple(1.0 if j == self._jstar else 0.0 for j in range(len(self._reps)))
        # the heuristic's remaining computation with the least optimizer step the rest adds (on jstar: _opt_j)
        self._rem_h, self._opt_j = self._rem, [0.0] * len(self._rem)
        if self._opt is not None:
            self._rem_h, self._opt_j = self._opt.bounds(self._rem, self._jstar, self._tables.single_param)
        self._chain: ChainBound | None = None  # the stronger bound, after SWITCH_AFTER expansions

    # ------------------------------------------------------------------ costs
    def _h(self, pos: int, acc: tuple[float, ...], props: int) -> float:
        """Admissible lower bound of the rest: the larger of (a) the remaining computation at infinite
        bandwidth per device and (b) the spine bound: the bottleneck device's computation plus the
        communication that the spine path cannot avoid (:func:`hapnb.synth.heuristic.spine_bound`)."""
        h = max(map(operator.add, acc, self._rem_h[pos]))
        h2 = acc[self._jstar] + self._opt_j[pos] + term_value(self._terms[pos], props)  # one-hot: jstar
        return h2 if h2 > h else h

    # ------------------------------------------------------------------ core
    def _push(self, node: _Node) -> int:
        nid = len(self._nodes)
        self._nodes.append(node)
        heapq.heappush(self._heap, (node.score, next(self._counter), nid))
        if len(self._heap) > self._stats.max_frontier:
            self._stats.max_frontier = len(self._heap)
        return nid

    def _h_duplex(
        self, pos: int, base: float, copen: float, acc: tuple[float, ...], tail: tuple[float, ...], props: int
    ) -> float:
        """Duplex A* priority: an admissible bound of the duplex time (:func:`~hapnb.synth.duplex.priority`)."""
        spine = spine_value(self._spine_opts[pos], props)
        comm = spine_value(self._spine_comm_opts[pos], props)
        return priority(base, copen, acc, tail, self._rem[pos], self._w, spine, comm)

    def _complete(
        self,
        nid: int,
        props: int,
        base: float,
        acc: tuple[float, ...],
        copen: float,
        tail: tuple[float, ...],
        ms: Any,
        loads: tuple[Load, ...],
        best_cost: float,
    ) -> tuple[float, tuple[Conversion, ...], Any] | str:
        """A child after the last op: its final cost (the open stage closed, the loss made partial when it
        is not, the deferred parameters' storage realised under memory pruning), the collectives after the
        last step and the realised loads; or why it is pruned."""
        extra: tuple[Conversion, ...] = ()
        if not props & self._loss_bits_R:
            extra = (Conversion(self.graph.loss, "to_partial", I, R),)
        storage_s, real = 0.0, ()
        if self._mem is not None:  # the deferred parameters' storage: the cheapest that fits
            deferred = [ld for st in self.program(nid) for ld in st.loads if ld.zero == -1]
            deferred += [ld for ld in loads if ld.zero == -1]
            done = self._mem.realize(self._mem.finish(ms, extra), deferred)
            if done is None:
                return "memory: no storage of the replicated parameters fits"
            storage_s, real = done
            if self._opt is not None:
                tail = self._opt.realized(tail, deferred, real)
        if self.duplex:
            base += label_close(copen, acc, tail)
        else:
            base += self._opt.close(acc, tail) if self._opt is not None else max(acc)
        if self._updates is not None:
            base += self._updates.end(props)
        if self._mem is not None and base + storage_s >= best_cost - _EPS:
            return f"cost {base + storage_s:.4g} with its storage >= best complete {best_cost:.4g}"
        return base + storage_s, extra, real

    def _dominated_any(
        self,
        key: tuple[int, int, int],
        base: float,
        copen: float,
        acc: tuple[float, ...],
        tail: tuple[float, ...],
        ms: Any,
    ) -> bool:
        """Whether a program already reached ``key``'s properties at no greater cost (recording this one
        when not): the duplex labels' or the plain ones' dominance."""
        if self.duplex:
            return duplex_dominated(self._seen, key, (base, acc, copen, tail), _EPS)
        mem = self._mem.dominates if ms is not None and self._mem is not None else None
        return plain_dominated(self._seen, key, base, acc, ms, mem, _EPS, tail)

    def _children(self, nid: int, record: bool) -> tuple[list[int], list[tuple[str, str]]]:
        node = self._nodes[nid]
        g = self.graph
        pos = node.pos
        pruned: list[tuple[str, str]] = []
        kids: list[int] = []
        if pos == len(g.ops):
            return kids, pruned
        op = g.ops[pos]
        props, comm = node.props, node.comm
        best_cost = self._nodes[self._best].base if self._best is not None else float("inf")
        dies, dies_comm = self._dies_at[pos], self._dies_comm[pos]
        generated = 0
        # what every child shares: its parent's open-stage maximum and the heuristic's tables at pos + 1
        # (:meth:`_h` inlined below: the same arithmetic, without a call per child)
        node_max = max(node.acc)
        opens = node.parent == -1  # the root: its first step always opens a stage
        rem_next, sterms, jstar = (
            self._rem_h[pos + 1],
            self._terms[pos + 1] if self._terms else (),
            self._jstar,
        )
        opt_next = self._opt_j[pos + 1]
        seen, nodes, heap, counter, heappush = (
            self._seen,
            self._nodes,
            self._heap,
            self._counter,
            heapq.heappush,
        )
        chain, updates, opt = self._chain, self._updates, self._opt
        upd_rows = updates.rows_at.get(pos, ()) if updates is not None else ()
        for c in self._ops[pos]:
            per_need, fail, t, f = self._need_options(c, props, comm)
            if fail:
                if record:
                    pruned.append(
                        (f"{op.name}[{c.strategy.name}]", _UNMET[fail].format(t=g.tensors[t].name, f=f))
                    )
                continue
            for combo in itertools.product(*per_need):
                # one pass over the options: loads and conversions in order, new properties and tokens
                loads_l: list[Any] = []
                convs_l: list[Any] = []
                conv_ts: list[float] = []
                new_props = props | c.out_bits
                new_comm = comm
                grad_t = 0.0
                for x in combo:
                    kind = x[3]
                    if kind == 1:
                        loads_l.append(x[0])
                        new_props |= x[1]
                        grad_t += x[4]
                    elif kind == 2:
                        convs_l.append(x[0])
                        new_props |= x[1]
                        new_comm |= x[2]
                        conv_ts.append(x[4])
                if len(convs_l) > 1 and len({cv.tensor for cv in convs_l}) != len(convs_l):
                    continue  # one tensor converted twice in one step
                loads = tuple(loads_l)
                convs = tuple(convs_l) + c.reshards  # a segment boundary: re-cut for this op's ratios
                upd = updates.step(upd_rows, new_props, loads) if updates is not None else 0.0
                new_props &= ~dies
                new_comm &= ~dies_comm
                comp = c.comp
                tail = node.tail
                if loads and (self._has_inner or opt is not None):  # inner syncs, optimizer step
                    comp, tail = self._with_loads(loads, comp, tail)
                comm_t = 0.0
                if not self.duplex:
                    comm_t += grad_t
                for x in conv_ts:
                    comm_t += x
                for x in c.fixed if c.fixed is not None else self._fixed(op.id, c):
                    comm_t += x
                copen = 0.0
                if self.duplex:
                    base, copen, acc = label_step(
                        node.base, node.copen, node.acc, opens, comm_t, grad_t, comp
                    )
                else:  # a buffer update opens no stage: it adds to the iteration (hapnb.synth.updates)
                    base, acc = stage_step(node.base + upd, node.acc, node_max, opens, comm_t, comp)
                generated += 1
                npos = pos + 1
                if self.duplex:
                    score = self._h_duplex(npos, base, copen, acc, tail, new_props)
                else:  # base + self._h(npos, acc, new_props)
                    acc_h = acc if opt is None else tuple(map(operator.add, acc, tail))  # with its optimizer
                    h = max(map(operator.add, acc_h, rem_next))
                    h2 = acc_h[jstar] + opt_next
                    for smask, stable, sadd, sjoint in sterms:
                        sp = new_props & smask
                        sv = stable.get(sp)
                        h2 += (sjoint.value(sp) if sv is None else sv) + sadd
                    score = base + (h2 if h2 > h else h)
                    if chain is not None and score < best_cost:
                        h2 = base + acc_h[jstar] + opt_next + chain.value(npos, new_props)
                        if h2 > score:
                            score = h2
                desc = f"{op.name}[{c.strategy.name}]" if record else ""
                ms, real = None, ()
                if self._mem is not None and score < best_cost - _EPS:
                    ms = self._mem.advance(node.ms, pos, c, loads)
                    why, storage = self._mem.check(ms, npos)
                    if why:
                        if record:
                            pruned.append((desc, why))
                        continue
                    score += storage  # what the storage that memory forces will cost
                if score >= best_cost - _EPS and self._best is not None:
                    self._stats.pruned_bound += 1
                    if record:
                        pruned.append((desc, f"score {score:.4g} >= best complete {best_cost:.4g}"))
                    continue
                complete = npos == len(g.ops)
                extra: tuple[Conversion, ...] = ()
                if complete:
                    done = self._complete(nid, new_props, base, acc, copen, tail, ms, loads, best_cost)
                    if isinstance(done, str):
                        if record:
                            pruned.append((desc, done))
                        continue
                    base, extra, real = done
                    ms, copen, tail = None, 0.0, (0.0,) * len(self._reps)
                    acc = (0.0,) * len(self._reps)
                    score = base
                key = (npos, new_props, new_comm)
                if key not in seen and not self.duplex:  # the first program with these properties
                    seen[key] = [(base, acc, ms, tail)]
                elif self._dominated_any(key, base, copen, acc, tail, ms):
                    self._stats.pruned_dominated += 1
                    if record:
                        pruned.append((desc, "dominated: same properties reached at no greater cost"))
                    continue
                step = Step(op.id, c.strategy, loads, convs)
                child = _Node(nid, step, base, acc, npos, new_props, new_comm, score, complete, extra)
                child.copen, child.tail, child.ms, child.real = copen, tail, ms, real
                cid = len(nodes)  # self._push(child), inlined
                nodes.append(child)
                heappush(heap, (score, next(counter), cid))
                if complete and (self._best is None or base < self._nodes[self._best].base - _EPS):
                    self._best = cid
                    best_cost = base
                kids.append(cid)
        self._stats.generated += generated
        if len(heap) > self._stats.max_frontier:
            self._stats.max_frontier = len(heap)
        return kids, pruned

    def _pop(self) -> int | None:
        while self._heap:
            score, _, nid = heapq.heappop(self._heap)
            node = self._nodes[nid]
            if node.expanded:
                continue  # already expanded by a dive
            entries = self._seen.get((node.pos, node.props, node.comm), [])
            if not node.complete and not any(e[0] is node.base and e[1] is node.acc for e in entries):
                continue  # superseded by a dominating program with the same properties
            return nid
        return None

    @property
    def done(self) -> bool:
        if not self._heap:
            return True
        if self._best is None:
            return False
        return (
            self._heap[0][0] >= self._nodes[self._best].base - _EPS or self._nodes[self._heap[0][2]].complete
        )

    def step(self) -> SearchEvent:
        """Pop the cheapest partial program and expand it; returns what happened."""
        t0 = time.perf_counter()
        if self.done:
            return SearchEvent(None, (), (), True)
        nid = self._pop()
        if nid is None:
            return SearchEvent(None, (), (), True)
        node = self._nodes[nid]
        if node.complete:
            self._stats.seconds += time.perf_counter() - t0
            return SearchEvent(self.node(nid), (), (), True)
        kids, pruned = self._expand(nid, record=True)
        self._stats.seconds += time.perf_counter() - t0
        return SearchEvent(self.node(nid), tuple(self.node(k) for k in kids), tuple(pruned), self.done)

    def run(
        self,
        max_expansions: int | None = None,
        max_seconds: float | None = None,
        progress: bool = False,
        dives: int = 32,
    ) -> SearchResult:
        """Search until the best complete program is proven optimal (or a limit is hit).

        Unless a complete program is known (:meth:`seed`), after a short A* phase (:data:`DIVE_AFTER` of the
        ops' count of expansions) a greedy dive (always the child with the lowest score) from the best open
        program finds a complete program whose cost then prunes every partial program that cannot beat it
        (the short phase first: a dive from the root follows the heuristic's first misjudgement to its
        end, which the A* then walks again); if a limit stops the search before any complete program is
        known, a last dive from the best open program completes one, and up to ``dives`` dives from the
        best open programs try to improve it. ``optimal`` in the result says whether the best program was
        proven optimal.
        """
        t0 = time.perf_counter()
        dive_at = (
            max(DIVE_AFTER_MIN, int(DIVE_AFTER * len(self.graph.ops)))
            if self._best is None and self.options.get("dive", True)
            else None
        )
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc="A* expansions", unit="exp", leave=False)
        n = 0
        try:
            while not self.done:
                if dive_at is not None and n >= dive_at:
                    dive_at = None
                    nid = self._pop() if self._best is None else None
                    if nid is not None and not self._nodes[nid].complete:
                        self._dive(nid)
                    elif nid is not None:
                        heapq.heappush(self._heap, (self._nodes[nid].score, -1, nid))
                    continue
                if max_expansions is not None and n >= max_expansions:
                    break
                if n == SWITCH_AFTER and self._chain is None and not self.duplex and self._mem is None:
                    self._switch_bound()
                if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                    break
                nid = self._pop()
                if nid is None:
                    break
                if self._nodes[nid].complete:
                    heapq.heappush(self._heap, (self._nodes[nid].score, -1, nid))
                    break
                n += 1
                self._expand(nid, record=False)
                if bar is not None and n % 200 == 0:
                    bar.update(200)
        finally:
            if bar is not None:
                bar.close()
            self._stats.seconds += time.perf_counter() - t0
        if not self.done:
            self._improve_by_dives(dives)
        if self._best is None:
            raise NoProgramError(explain_no_program(self))
        return self.result(time.perf_counter() - t0)

    def result(self, seconds: float = 0.0) -> SearchResult:
        """The best complete program so far as a :class:`SearchResult` (with the proven lower bound)."""
        if self._best is None:
            raise NoProgramError(explain_no_program(self))
        cost = self._nodes[self._best].base
        done = self.done
        return SearchResult(
            self.program(self._best), cost, done, self._stats.expansions, seconds,
            cost if done else min(cost, self.lower_bound()),
        )  # fmt: skip

    def fall_back(self, res: SearchResult, program: Callable[[], Sequence[Step] | None]) -> SearchResult:
        """``res``, this search's result, or where it stopped at its budget the result once ``program()`` (a
        known program, made only then; None: none) is walked in (:meth:`seed`): never costlier than it."""
        if res.optimal:
            return res
        prog = program()
        return self.result(res.seconds) if prog is not None and self.seed(prog, dive=False) else res

    def lower_bound(self) -> float:
        """A lower bound of the optimum at these ratios: the least score of a live open program (every
        program not yet found extends one of them, and scores never overestimate), or the best cost."""
        best = self._nodes[self._best].base if self._best is not None else _INF
        heap = self._heap
        while heap:
            score, _, nid = heap[0]
            node = self._nodes[nid]
            if node.expanded or (
                not node.complete
                and not any(
                    e[0] is node.base and e[1] is node.acc
                    for e in self._seen.get((node.pos, node.props, node.comm), [])
                )
            ):
                heapq.heappop(heap)  # expanded by a dive, or superseded: as _pop drops it
                continue
            return min(best, score)
        return best

    def _switch_bound(self) -> None:
        """Add the chain bound to the heuristic (:func:`hapnb.synth.chain_bound.switch`), unless its DP went past
        its cap in an earlier search on this theory, or a dive from the best open program leaves a gap of
        at most :data:`~hapnb.synth.chain_bound.NEAR` to the proven bound (what is left are near-ties of small
        tensors' forms, which the chain bound does not separate)."""
        static = self._shared.get("static")
        if static is not None and static.get("chain exhausted") is self.theory:
            return
        if NEAR > 0:
            self._improve_by_dives(SWITCH_DIVES)
            if self._best is not None and self.lower_bound() >= self._nodes[self._best].base * (1 - NEAR):
                return
        self._chain = switch(self)
        if self._chain is None and static is not None:
            static["chain exhausted"] = self.theory

    def _expand(self, nid: int, record: bool) -> tuple[list[int], list[tuple[str, str]]]:
        self._nodes[nid].expanded = True
        self._stats.expansions += 1
        return self._children(nid, record)

    def seed(self, program: Sequence[Step], dive: bool = True) -> bool:
        """Walk a known complete program (e.g. the plain search's optimum, for a duplex search) down the
        tree, so that its cost bounds the search from the start (with ``dive``, a greedy dive from the root
        runs first and the better of the two is kept). Returns whether the walk reached a complete node; it stops early (False) where the
        program leaves the search space or where the best complete program already beats its prefix
        (the bound pruned it). Where a step's child was dominated, the walk goes on from the cheapest
        live node with the same properties (no worse, by dominance). Afterwards the best complete
        program costs at most the seeded one, when that one is in the search space."""
        nid = 0 if self._nodes and self._nodes[0].parent == -1 else None
        if nid is None or len(program) != len(self.graph.ops):
            return False
        if dive and self._best is None and self.options.get("dive", True):
            self._dive(0)
        for st in program:
            node = self._nodes[nid]
            if node.complete:
                return False
            kids = self._children(nid, record=False)[0] if not node.expanded else self._kids_of(nid)
            if not node.expanded:
                node.expanded = True
                self._stats.expansions += 1
            same = [k for k in kids if self._nodes[k].step == st]
            if not same:  # dominated: go on from the live node that dominates it (maybe off this path)
                key = self._key_after(node, st)
                live = self._seen.get(key, [])
                same = [
                    k
                    for k, n in enumerate(self._nodes)
                    if (n.pos, n.props, n.comm) == key and any(e[0] is n.base and e[1] is n.acc for e in live)
                ]
            if not same:
                return False
            nid = min(same, key=lambda k: (self._nodes[k].score, k))
        if not self._nodes[nid].complete:
            return False
        if self._best is None or self._nodes[nid].base < self._nodes[self._best].base - _EPS:
            self._best = nid
        return True

    def _key_after(self, node: _Node, st: Step) -> tuple[int, int, int]:
        """The dominance key of ``node`` extended by ``st`` (as :meth:`_children` computes it)."""
        pos = node.pos
        props, comm = node.props, node.comm
        for c in self._ops[pos]:
            if c.strategy == st.strategy:
                props |= c.out_bits
        for ld in st.loads:
            props |= self._bit[(ld.tensor, ld.form)]
        for cv in st.conversions:
            if cv.name != "reshard":
                props |= self._bit[(cv.tensor, cv.dst)]
                comm |= 1 << cv.tensor
        return pos + 1, props & ~self._dies_at[pos], comm & ~self._dies_comm[pos]

    def _kids_of(self, nid: int) -> list[int]:
        return [i for i, n in enumerate(self._nodes) if n.parent == nid]

    def _dive(self, nid: int) -> None:
        """Greedy descent: expand, follow the child with the lowest score, until a complete program."""
        while not self._nodes[nid].complete:
            kids, _ = self._expand(nid, record=False)
            if not kids:
                return  # every child was pruned here: leave the rest to A*
            nid = min(kids, key=lambda k: (self._nodes[k].score, k))

    def _improve_by_dives(self, count: int) -> None:
        """A limit stopped A*: dive from the most promising open programs (lowest score first) to
        complete them greedily, keeping the best complete program found (not proven optimal). Without
        memory a dive always completes, so it goes on until one did; with memory (where a dive can end in
        pruned children) at most ``4 * count`` dives are tried."""
        tried = 0
        while (
            tried < count or (self._best is None and (self._mem is None or tried < 4 * count))
        ) and self._heap:
            nid = self._pop()
            if nid is None:
                break
            if self._nodes[nid].complete:
                heapq.heappush(self._heap, (self._nodes[nid].score, -1, nid))
                break
            self._dive(nid)
            tried += 1

    # ------------------------------------------------------------------ views
    def program(self, nid: int) -> tuple[Step, ...]:
        """The steps from the root to node ``nid`` (a complete node's deferred storage as realized)."""
        real = list(self._nodes[nid].real) if nid >= 0 else []
        steps = []
        while nid > 0:
            node = self._nodes[nid]
            if node.step is not None:
                steps.append(node.step)
            nid = node.parent
        steps.reverse()
        if real:
            real.reverse()
            steps = [
                st if not any(ld.zero == -1 for ld in st.loads)
                else replace(st, loads=tuple(real.pop() if ld.zero == -1 else ld for ld in st.loads))
                for st in steps
            ]  # fmt: skip
        return tuple(steps)

    def final_conversions(self, nid: int | None = None) -> tuple[Conversion, ...]:
        nid = self._best if nid is None else nid
        return self._nodes[nid].extra if nid is not None else ()

    def node(self, nid: int) -> SearchNode:
        n = self._nodes[nid]
        props = []
        bits = n.props
        while bits:
            low = bits & -bits
            bits ^= low
            props.append(self._forms_of_bit[low])
        if n.complete:
            cost = n.base
        elif self.duplex:
            p = 0.5 * max(n.acc)
            cost = n.base + max(0.5 * n.copen, p) + p + max(n.tail)
        else:
            cost = n.base + max(n.acc)
        return SearchNode(nid, n.parent, n.step, cost, n.score, n.pos, tuple(props), n.complete)

    @property
    def frontier(self) -> list[SearchNode]:
        """Open partial programs, best score first."""
        live = []
        for _score, _, nid in sorted(self._heap):
            node = self._nodes[nid]
            entries = self._seen.get((node.pos, node.props, node.comm), [])
            if node.complete or any(e[0] is node.base and e[1] is node.acc for e in entries):
                live.append(self.node(nid))
        return live

    @property
    def best(self) -> SearchNode | None:
        return self.node(self._best) if self._best is not None else None

    @property
    def stats(self) -> dict[str, Any]:
        d = self._stats.as_dict()
        d["frontier"] = len(self._heap)
        d["nodes"] = len(self._nodes)
        if self._mem is not None:
            d.update(self._mem.stats)
        if self.duplex:
            d["duplex"] = True
        return d

    def children_of(self, nid: int) -> list[SearchNode]:
        return [self.node(i) for i, n in enumerate(self._nodes) if n.parent == nid]

    def __repr__(self) -> str:
        b = self.best
        return (
            f"Search({self.graph.name} on {self.cluster.name}{' (duplex)' if self.duplex else ''}: "
            f"{self._stats.expansions} expansions, "
            f"frontier {len(self._heap)}, best {'none' if b is None else f'{b.cost:.4g} s'}"
            f"{', done' if self.done else ''})"
        )

    def _repr_html_(self) -> str:
        from .. import display

        return display.safe_html(display.search_html, self)
