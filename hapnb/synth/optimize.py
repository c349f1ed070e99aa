"""Optimize: alternate the program search (Q) and the ratio LP (B) until no improvement (paper §3.1).

:func:`optimize` starts from throughput-proportional ratios B0 (moved into any ratio pins), then repeats
``Q_k = search(B_{k-1})``, ``B_k = LP(Q_k)`` while the cost strictly improves, keeps the history, and
returns the best program paired with the ratios optimised *for it* (an :class:`Optimum`). The
data-parallel and tensor-parallel programs of :func:`baseline_specs` are also balanced by the LP and used
as seeds, so the result is never worse than any baseline under the same cost model. Packaging the
result as a :class:`~hapnb.plans.plan.Plan` is :mod:`hapnb.plans.synthesis`' job (one layer up).

``memo``: a :class:`Memo` shared by several calls on one theory (what :meth:`hapnb.plans.plan.Plan.replan`
reuses): every search and every LP is a pure function of its inputs, so a call that meets the same
search (cluster, ratios, pins, options, budget) or the same LP (cluster, program, ratio pins) again takes
the earlier result instead of recomputing it, and returns exactly what it would have computed.

``duplex=True`` optimises HiDup's duplex time (:mod:`hapnb.synth.duplex`) instead: the duplex search (ψ/φ
labels) alternates with the duplex LP, and the costs in the result and its history are duplex times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..cost.memory import MemoryLinear, memory_linear
from ..cost.memory import fits as memory_fits
from ..cost.model import Conversion, CostModel, Step
from ..hardware.cluster import Cluster
from ..ir.forms import Form, parse_pin
from ..ir.graph import Graph
from ..triples import Theory
from .balance import (
    MemoryCapError,
    RatioPin,
    apply_ratio_pins,
    balance,
    balance_in_memory,
    memory_start_ratios,
    parse_ratio_pins,
)
from .duplex import duplex_cost
from .history import Round
from .memo import Memo
from .search import NoProgramError, Search, normalize_ratios, resolve_pins
from .seeds import SHARDED, data_parallel_program, dp_pins, seeds

__all__ = [
    "Round",
    "Optimum",
    "Candidate",
    "optimize",
    "assign_segments",
    "parse_pins",
    "keeps_ratio_pins",
    "proven_gap",
    "memory_budget",
    "DEFAULT_EXPANSIONS",
    "without_gc",
]


#: Expansion budget of a memory-aware search in the Q/B loop: ``MEMORY_EXPANSIONS +
#: MEMORY_EXPANSIONS_PER_OP * ops`` (and at most ``max_expansions``), then one greedy dive (four while none completed). Its first
#: greedy dive already gives a program within a fraction of a percent of the optimum at those ratios on the
#: GPT-48 benchmarks, while proving it can take 25x the expansions of the plain search (the memory-forced
#: storage costs only show once many parameters are placed); ``stats["optimal"]`` says when a search
#: stopped at the budget.
MEMORY_EXPANSIONS, MEMORY_EXPANSIONS_PER_OP = 1000, 4
#: Expansion budget of a sharded data-parallel seed's search where it is seeded for its sharded optimizer
#: step, not for memory (:func:`hapnb.synth.seeds.seeds`): data parallelism's pins leave little to search, and
#: where its search does not prove its program in this budget (ResNet-50 at realistic size on h100x8, whose
#: data-parallel seeds stop at 30,000 expansions too) the full budget only cost time (2.9 s of 11 s)
SHARDED_SEED_EXPANSIONS = 5_000
#: The default ``max_expansions`` of :func:`optimize` (and of :func:`hapnb.synthesize`): a larger one scales the
#: memory-aware searches' budget by as much (:func:`memory_budget`)
DEFAULT_EXPANSIONS = 30_000
#: With memory bound, a baseline seed that improves the best cost by less than this fraction is kept as the
#: best without the Q/B rounds from its ratios (each a memory-aware search and LP), and a Q/B round stops
#: where its LP gains less than this fraction over the ratios its memory-aware search (stopped at its budget)
#: ran at.
MEMORY_MIN_GAIN = 1e-3


def assign_segments(graph: Graph, segments: Any) -> Graph:
    """Give every op a ratio segment: ``None`` (one segment), ``"layer"`` (one per numbered module such
    as ``layers.3``; ops outside any layer share segment 0), a mapping from module-path prefix to a label
    (user markers; unmatched ops go to segment 0), or a function ``op -> label``. Labels are renumbered
    0, 1, ... in order of first appearance."""
    import dataclasses
    import re

    if segments is None:
        return graph
    if segments == "layer":
        pat = re.compile(r"^((?:[^.]+\.)*?[^.]+\.\d+)(?:\.|$)")

        def label(op: Any) -> Any:
            m = pat.match(op.module or "")
            return m.group(1) if m else ""
    elif isinstance(segments, Mapping):
        prefixes = sorted(segments, key=len, reverse=True)

        def label(op: Any) -> Any:
            for p in prefixes:
                if op.module == p or op.module.startswith(p + "."):
                    return segments[p]
            return ""
    elif callable(segments):
        label = segments
    else:
        raise ValueError(
            f"segments={segments!r}: use None, 'layer', a mapping module-prefix -> label, or a function"
        )
    labels: dict[Any, int] = {"": 0}
    ops = []
    for op in graph.ops:
        lab = label(op)
        if lab not in labels:
            labels[lab] = len(labels)
        ops.append(dataclasses.replace(op, segment=labels[lab]))
    used = sorted({op.segment for op in ops})
    renum = {s: k for k, s in enumerate(used)}
    ops = [dataclasses.replace(op, segment=renum[op.segment]) for op in ops]
    return dataclasses.replace(graph, ops=tuple(ops))


def parse_pins(pins: Mapping[str, Any] | None) -> dict[str, Form]:
    """Form pins from ``{"fc1.weight": Shard(1)}`` or ``{"fc1.weight": "G1"}`` (a parameter storage pin
    such as ``FullShard(0)`` / ``"zero3(0)"`` is kept as a :class:`~hapnb.ir.forms.Storage`)."""
    out = {}
    for k, v in (pins or {}).items():
        out[k] = parse_pin(v) if isinstance(v, str) else v
    return out


def without_gc(fn: Any) -> Any:
    """Run ``fn`` with the cyclic garbage collector paused: the search allocates many small acyclic
    values, and after tracing the heap is large, so each full collection would rescan it (seen: 0.7 s of
    a 1.4 s synthesis). Reference counting still frees everything; the collector resumes afterwards."""
    import functools
    import gc

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return wrapper


#: the search counters the loop sums over its searches
_COUNTS = ("expansions", "generated", "pruned_dominated", "pruned_bound")
#: a baseline's search options: no SFB, no grouped collectives (the plain strategies the baseline names)
_PLAIN = {"sfb": False, "grouped": False}


def _frozen(m: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (m or {}).items()))


@dataclass(frozen=True)
class _Searched:
    """One search's outcome, as :func:`optimize` uses it (the Search itself is not kept)."""

    result: Any  # SearchResult
    final: tuple[Conversion, ...]
    stats: tuple[tuple[str, Any], ...]
    ratios: tuple[tuple[float, ...], ...]  # the ratios it ran at (normalised)
    seed_expansions: int = 0
    seed_seconds: float = 0.0


#: an LP's ratios this much (relative) costlier than those the program was searched at are not taken
LP_WORSE = 1e-6

#: search options that only restrict the search space when False (the default is True)
_RESTRICTING = ("sfb", "grouped", "zero")


def _subsumes(
    th: Theory,
    res: Any,
    pins0: Mapping[str, Any],
    opts0: Mapping[str, bool],
    pins: Mapping[str, Any],
    opts: Mapping[str, bool],
) -> bool:
    """Whether a search with ``pins`` / ``opts`` at the ratios of a finished search (``res``, made with
    ``pins0`` / ``opts0``) has ``res``'s program as an optimum: ``res`` is proven optimal, every pin of the
    earlier search is a pin of this one, every option this one allows the earlier one allowed (so this
    space is a subset of that one), and the program keeps this search's pins and options (so it is in this
    space, and optimal there). Storage pins are never answered this way."""
    if not res.optimal or any(pins.get(k) != v for k, v in pins0.items()):
        return False
    if any(opts0.get(k, True) is False and opts.get(k, True) is not False for k in _RESTRICTING):
        return False
    rest0 = {k: v for k, v in opts0.items() if k not in _RESTRICTING and k != "dive"}
    if rest0 != {k: v for k, v in opts.items() if k not in _RESTRICTING and k != "dive"}:
        return False
    try:
        ids = resolve_pins(th, pins)
    except ValueError:
        return False
    if any(not isinstance(f, Form) for f in ids.values()):
        return False
    g = th.graph
    sfb, grouped = opts.get("sfb", True) is not False, opts.get("grouped", True) is not False
    for st in res.program:
        if st.strategy.sfb and not sfb:
            return False
        if not grouped and any(cv.name.startswith("grouped") for cv in st.conversions):
            return False
        if any(ld.zero != 0 or ids.get(ld.tensor, ld.form) != ld.form for ld in st.loads):
            return False
        if any(ids.get(t, f) != f for t, f in zip(g.ops[st.op].outputs, st.strategy.outputs)):
            return False
    return True


def _fits_shape(ratios: Sequence[Sequence[float]] | None, segments: int, devices: int) -> bool:
    """Whether ``ratios`` has one row of ``devices`` ratios per segment, with a positive sum."""
    return (
        ratios is not None
        and len(ratios) == segments
        and all(len(r) == devices and sum(r) > 0 for r in ratios)
    )


def _same_ratios(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], tol: float = 1e-9) -> bool:
    return all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@dataclass(frozen=True)
class Optimum:
    """The best program found by the Q/B loop, paired with the ratios balanced for it."""

    cost_s: float
    program: tuple[Step, ...]
    extra: tuple[Conversion, ...]  # collectives after the last step (final gradient syncs)
    ratios: tuple[tuple[float, ...], ...]
    history: tuple[Round, ...]
    stats: dict[str, Any]
    ratio_pins: tuple[RatioPin, ...] = ()
    #: every distinct (program, ratios) the loop balanced, best cost first: what a final choice by another
    #: measure (the overlap simulator, :func:`hapnb.synthesize`) picks among
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """A program the Q/B loop balanced, with its ratios and cost (``round``: its :class:`Round`'s index)."""

    cost_s: float
    program: tuple[Step, ...]
    extra: tuple[Conversion, ...]
    ratios: tuple[tuple[float, ...], ...]
    round: int
    #: "search" (a Q/B round's program at its balanced ratios) or "baseline dp_ev|dp_cp|tp_ev|zero2|fsdp" (a baseline's
    #: program at the baseline's own ratios, as :func:`hapnb.baselines` packages it)
    source: str = "search"
    #: a searched candidate that is also a baseline's program at the baseline's ratios: that baseline's
    #: source (the final pick always compares it, however it ranks by cost)
    baseline: str = ""


def keeps_ratio_pins(
    ratios: Sequence[Sequence[float]], pins: Sequence[RatioPin], names: Sequence[str]
) -> bool:
    """Whether every segment's ratios keep the ratio pins' bounds."""
    col = {n: j for j, n in enumerate(names)}
    return all(p.lo - 1e-9 <= row[col[p.device]] <= p.hi + 1e-9 for p in pins for row in ratios)


def optimize(
    th: Theory,
    cluster: Cluster,
    pins: Mapping[str, Form] | None = None,
    ratios: Mapping[str, Any] | Sequence[float] | Sequence[Sequence[float]] | None = None,
    *,
    options: Mapping[str, bool] | None = None,
    max_iterations: int = 10,
    max_expansions: int | None = DEFAULT_EXPANSIONS,
    max_seconds: float | None = None,
    seed_baselines: bool = True,
    progress: bool = False,
    duplex: bool = False,
    memory: bool = False,
    memo: Memo | None = None,
    start: Sequence[Sequence[float]] | None = None,
) -> Optimum:
    """Alternate A* (Q) and the LP (B) from throughput-proportional ratios until no improvement.

    ``ratios``: a mapping of ratio pins (``{"v100-0": 0.3, "p100-1": (0.05, 0.2)}``), or per-device
    ratios (one list, or one per segment) used as they are (no LP). Each search is bounded by
    ``max_expansions`` / ``max_seconds``; ``stats["optimal"]`` says whether every search finished or proved a
    bound at or above the plan's cost (``stats["optimal_by_bound"]``).
    ``duplex``: minimise the duplex time (``stats["duplex"]`` says which objective was used).
    ``memory``: keep to every device's memory, lazily: a search whose program does not fit at its
    ratios is run again with memory (:mod:`hapnb.synth.memory_prune`: pruning, ZeRO storage) and so is every later
    search; an LP whose ratios do not fit is solved again with memory caps
    (:func:`hapnb.synth.balance.balance_in_memory`); candidates that do not fit are dropped; when no program fits
    at the starting ratios, the loop starts again from :func:`hapnb.synth.balance.memory_start_ratios`. Plans
    that fit without it are unchanged. ``stats["memory_bound"]`` says whether memory bound.
    ``start``: warm start (what a fast re-plan uses): the loop starts from these ratios (one row per
    segment, each moved into the ratio pins, keeping its proportions on the free devices) instead of
    throughput-proportional ones; ignored with fixed ratios or when its shape does not fit the cluster.
    """
    loop = _Loop(
        th, cluster, pins, ratios, options=dict(options or {}), max_expansions=max_expansions,
        max_seconds=max_seconds, progress=progress, duplex=duplex, memory=memory, memo=memo,
    )  # fmt: skip
    failed: NoProgramError | None = None
    try:
        it = loop.alternate(loop.start_ratios(start), 0, max_iterations)
    except NoProgramError as e:
        if not (loop.mem_on and seed_baselines and loop.fixed is None):
            raise
        failed, it = e, 0  # nothing fits from these ratios: a seed (fsdp at even ratios) still may
    if seed_baselines and loop.fixed is None:
        loop.seed_rounds(it, max_iterations)
    if loop.best is None and failed is not None:
        raise failed
    return loop.optimum()


class _Loop:
    """The state of one :func:`optimize` call: the searches and LPs run so far, the history of rounds, the
    candidates and the best program, and whether memory bound (then every later search keeps to it)."""

    def __init__(
        self,
        th: Theory,
        c: Cluster,
        pins: Mapping[str, Form] | None,
        ratios: Any,
        *,
        options: dict[str, bool],
        max_expansions: int | None,
        max_seconds: float | None,
        progress: bool,
        duplex: bool,
        memory: bool,
        memo: Memo | None,
    ) -> None:
        self.th, self.c, self.memo = th, c, memo
        self.options, self.max_expansions, self.max_seconds = options, max_expansions, max_seconds
        self.progress, self.duplex, self.memory = progress, duplex, memory
        self.ck = None if memo is None else memo.token(c)  # the cluster in memo keys
        self.cm = CostModel(th, c) if memo is None else memo.cost_model(th, c)
        self.form_pins = dict(pins or {})
        self.fixed: tuple[tuple[float, ...], ...] | None = None
        self.ratio_pins: tuple[RatioPin, ...] = ()
        if isinstance(ratios, Mapping):
            self.ratio_pins = parse_ratio_pins(ratios, c.names)
        elif ratios is not None:
            self.fixed = normalize_ratios(ratios, c, self.cm.n_segments)
        self.history: list[Round] = []
        self.candidates: list[Candidate] = []
        self.seen: dict[Any, int] = {}  # a candidate's key -> its index in candidates
        self.best: (
            tuple[float, tuple[Step, ...], tuple[Conversion, ...], tuple[tuple[float, ...], ...]] | None
        ) = None
        self.stats: dict[str, Any] = {
            "expansions": 0, "generated": 0, "pruned_dominated": 0, "pruned_bound": 0, "search_s": 0.0,
            "balance_s": 0.0, "optimal": True, "gap": 0.0, "duplex": bool(duplex),
            "max_expansions": max_expansions, "max_seconds": max_seconds,
        }  # fmt: skip
        self.mem_on = False  # memory bound in an earlier search: every later search keeps to memory
        self._fit_memo: dict[tuple[int, int, int], tuple[Any, Any, Any, bool]] = {}
        self._linear_memo: dict[tuple[Any, Any], MemoryLinear] = {}
        # this call's searches: (ratios, pins, options, memory, outcome), for :func:`_subsumes`
        self._done: list[tuple[Any, dict[str, Any], dict[str, bool], bool, _Searched]] = []

    def start_ratios(self, start: Sequence[Sequence[float]] | None) -> tuple[tuple[float, ...], ...]:
        """B0: the fixed ratios, the warm start moved into the ratio pins, or throughput-proportional."""
        c, nseg = self.c, self.cm.n_segments
        if self.fixed is not None:
            return self.fixed
        if _fits_shape(start, nseg, c.n):
            return tuple(apply_ratio_pins(tuple(r), self.ratio_pins, c.names, tuple(r)) for r in start)  # type: ignore[union-attr]
        row = apply_ratio_pins(normalize_ratios(None, c, 1)[0], self.ratio_pins, c.names, c.flops)
        return tuple(row for _ in range(nseg))

    # ------------------------------------------------------------------ searches
    def fits(self, prog: Any, extra: Any, ratios_: Any) -> bool:
        """Whether ``prog`` fits every device's memory at ``ratios_`` (always, without ``memory``)."""
        if not self.memory:
            return True
        # by identity: one round asks for the same objects several times (hashing a program is not cheap);
        # the entry keeps them alive, so their ids stay theirs
        key = (id(prog), id(extra), id(ratios_))
        hit = self._fit_memo.get(key)
        if hit is None:
            # the program's memory as a linear function of the ratios, once per program (by value: rounds
            # find the same program again): the checks at other ratios that its upper bound settles skip the
            # breakdown
            pk = (tuple(prog), tuple(extra))
            lin = self._linear_memo.get(pk)
            if lin is None:
                lin = self._linear_memo[pk] = memory_linear(self.cm, prog, extra)
            hit = self._fit_memo[key] = (
                prog,
                extra,
                ratios_,
                memory_fits(self.cm, prog, extra, ratios_, lin),
            )
        return hit[3]

    def subsumed(self, ratios_: Any, pins_: Mapping[str, Any], merged: Mapping[str, bool], mem: bool) -> Any:
        """An earlier search of this call whose proven optimum answers this one (:func:`_subsumes`), as
        this search's outcome (no expansions), or None."""
        if self.duplex:
            return None
        key = tuple(map(tuple, ratios_))
        for r0, p0, o0, m0, out in self._done:
            if r0 == key and m0 == mem and _subsumes(self.th, out.result, p0, o0, pins_, merged):
                zero = {k: 0 for k in _COUNTS}
                res = replace(out.result, expansions=0, seconds=0.0)  # proven optimal: _subsumes checked
                return _Searched(res, out.final, tuple(zero.items()), out.ratios)
        return None

    def run_search(
        self, ratios_: Any, pins_: Mapping[str, Form], merged: Mapping[str, bool], mem: bool,
        incumbent: Any, fallback: Any, budget: int | None,
    ) -> _Searched:  # fmt: skip
        """One A* search (seeded with ``incumbent``; a duplex search with the plain optimum), within
        ``budget`` expansions (resolved by :meth:`search`); a search stopped at its budget gets ``fallback()``'s
        program as an incumbent."""
        th, c, memo, duplex = self.th, self.c, self.memo, self.duplex
        shared = None if memo is None else memo.shared((self.ck, tuple(map(tuple, ratios_))))
        if shared is not None:  # prices that do not depend on the ratios: one dict per cluster
            shared.setdefault("per_cluster", memo.shared((self.ck, "per_cluster")))  # type: ignore[union-attr]
            shared.setdefault("static", memo.shared("static"))  # type: ignore[union-attr]  # the theory's tables
        s = Search(
            th, c, ratios=ratios_, pins=pins_, options=merged, duplex=duplex, shared=shared, memory=mem
        )
        seed_exp, seed_s = 0, 0.0
        if incumbent is not None and not duplex:
            s.seed(incumbent, dive=False)  # its cost bounds the search; among equal costs it is kept
        if duplex:
            # the plain optimum (a quick search) seeds the duplex search: its duplex time bounds the A*
            # from the start, and a duplex search stopped by a limit is never worse than it
            p = Search(th, c, ratios=ratios_, pins=pins_, options=merged, shared=shared)
            pres = p.run(max_expansions=self.max_expansions, max_seconds=self.max_seconds)
            s.seed(pres.program)
            seed_exp, seed_s = p.stats["expansions"], pres.seconds
        dives = 1 if s.memory else 32  # memory makes proving optimality costly where little is left to gain
        res = s.run(max_expansions=budget, max_seconds=self.max_seconds, progress=self.progress, dives=dives)
        if fallback is not None and not duplex:
            # stopped at its budget: the fallback program (:meth:`search`) joins as an incumbent, so the
            # search's program is never worse than it and the proven bound is read with it
            res = s.fall_back(res, fallback)
        return _Searched(res, s.final_conversions(), tuple(s.stats.items()), s.ratios, seed_exp, seed_s)

    def _memory_start(self, ratios_: Any, pins_: Mapping[str, Form]) -> Any:
        """Keeping to memory: ratios where a lean program has room (proportional ratios can leave none)."""
        ids = resolve_pins(self.th, pins_)
        row = None
        for margin in (0.8, 0.9, 1.0):  # the most room a lean program can be given
            row = memory_start_ratios(self.cm, ids, self.ratio_pins, margin, start=ratios_[0])
            if row is not None:
                break
        if row is None:
            raise NoProgramError("no program fits in device memory: not even a lean one at any ratios")
        if row != tuple(ratios_[0]):
            self.stats["memory_start"] = True
            ratios_ = tuple(row for _ in ratios_)
        return ratios_

    def search(
        self,
        ratios_: Any,
        pins_: Mapping[str, Form],
        opts: Mapping[str, bool] | None = None,
        move: bool = False,
        incumbent: Any = None,
        plain: bool = False,
        budget: int | None = None,
        textbook: bool = False,
    ) -> tuple[Any, _Searched]:
        """A search at ``ratios_`` (from the memo, or answered by an earlier one of this call), counted in
        the stats; when its program does not fit, memory binds and it runs again keeping to memory.
        ``move``: a Q/B round's search (its ratios may move to where a lean program fits; a data-parallel
        fallback incumbent). ``plain``: ignore memory even where it binds (a fallback's search).

        A search stopped at its budget gets a fallback incumbent: a Q/B round's search the data-parallel
        program at its ratios; with memory, a seed's search its own plain twin (memory ignored). With
        memory a fallback counts only where it fits: a memory-aware search's budget is small, and its
        greedy completion can be far worse than a plain program that fits anyway (DeBERTa's data-parallel
        seed: 4.08 s against the plain search's 3.05 s, which fits). ``budget``: its expansions (default the
        loop's ``max_expansions``; a memory-aware search gets :func:`memory_budget` of it). ``textbook``: a
        data-parallel search (a ``dp`` seed's, a fallback's), whose plain fallback is textbook data
        parallelism (:meth:`dp_program`)."""
        budget = self.max_expansions if budget is None else budget  # a seed's own, else the loop's
        merged = {**self.options, **(opts or {})}
        if self.mem_on and move and self.fixed is None and len({tuple(r) for r in ratios_}) == 1:
            ratios_ = self._memory_start(ratios_, pins_)
        mem = self.mem_on and not plain
        if (
            mem and not self.duplex
        ):  # the budget a memory-aware search has (the plan's note on one stopped at it)
            budget = self.stats["memory_budget"] = memory_budget(budget, len(self.th.graph.ops))
        fallback: Any = None
        if (move or mem) and not self.duplex:
            fb_pins, fb_opts = ({**dp_pins(self.th), **pins_}, _PLAIN) if move else (pins_, opts)

            def fallback() -> Any:
                """The fallback program at these ratios (None where there is none, or, with memory, where it
                does not fit)."""
                try:
                    res, out = self.search(ratios_, fb_pins, fb_opts, plain=mem, textbook=move or textbook)
                except (NoProgramError, ValueError):
                    return None
                if mem and not self.fits(res.program, out.final, out.ratios):
                    return None
                return res.program

        elif textbook and not self.duplex:

            def fallback() -> Any:
                """Textbook data parallelism at these ratios (None where there is none)."""
                return self.dp_program(ratios_, pins_, opts or {})

        out = self.subsumed(ratios_, pins_, merged, mem)
        if out is not None:
            self.stats["searches_subsumed"] = self.stats.get("searches_subsumed", 0) + 1
            return out.result, out
        if self.memo is not None and self.max_seconds is None:
            key = (self.ck, tuple(map(tuple, ratios_)), _frozen(pins_), _frozen(merged), self.duplex,
                   budget, mem, incumbent, textbook)  # fmt: skip
            out = self.memo.get(
                "search",
                key,
                lambda: self.run_search(ratios_, pins_, merged, mem, incumbent, fallback, budget),
            )
        else:
            out = self.run_search(ratios_, pins_, merged, mem, incumbent, fallback, budget)
        self._done.append((tuple(map(tuple, ratios_)), dict(pins_), merged, mem, out))
        self._count(out)
        res = out.result
        if not self.duplex and not self.mem_on and not self.fits(res.program, out.final, out.ratios):
            self.mem_on = self.stats["memory_bound"] = True  # search again, keeping to memory
            return self.search(ratios_, pins_, opts, move, incumbent)
        return res, out

    def dp_program(self, ratios_: Any, pins_: Mapping[str, Form], opts: Mapping[str, bool]) -> Any:
        """Textbook data parallelism at ``ratios_`` (:func:`hapnb.synth.seeds.data_parallel_program`, from the
        memo): the fallback of a data-parallel search stopped at its budget (a ``dp`` seed's, a stopped
        round's fallback), so that it is never worse than that program; None where there is no such program."""
        merged = {**self.options, **opts}

        def make() -> Any:
            return data_parallel_program(self.th, self.c, pins_, ratios_, merged, self.max_expansions)

        if self.memo is None:
            return make()
        key = (self.ck, tuple(map(tuple, ratios_)), _frozen(pins_), _frozen(merged), self.max_expansions)
        return self.memo.get("dp_program", key, make)

    def _count(self, out: _Searched) -> None:
        """A search's expansions, time and proof in the loop's stats."""
        stats, res = self.stats, out.result
        if self.duplex:
            stats["seed_expansions"] = stats.get("seed_expansions", 0) + out.seed_expansions
            stats["search_s"] += out.seed_seconds
        st = dict(out.stats)
        for k in _COUNTS:
            stats[k] += st[k]
        stats["search_s"] += res.seconds
        stats["optimal"] = stats["optimal"] and res.optimal
        if not res.optimal:  # the least proven lower bound of a search stopped at its budget
            stats["bound_s"] = min(stats.get("bound_s", float("inf")), res.bound)

    # ------------------------------------------------------------------ balancing and candidates
    def lp(self, kind: str, what: tuple[Any, ...], make: Any) -> Any:
        """An LP's result (``make()``), from the memo when the same LP was solved before."""
        if self.memo is None:
            return make()
        return self.memo.get(kind, (self.ck, *what, self.ratio_pins, self.duplex), make)

    def add_candidate(self, cost: float, prog: Any, extra: Any, ratios_: Any, source: str = "search") -> None:
        """One candidate per program and ratios; ratios equal to 12 decimals count as equal (a baseline at
        throughput-proportional ratios and the LP's ratios for the same program often differ in the last
        bits only: the same plan, simulated once)."""
        key = (prog, tuple(tuple(round(x, 12) for x in row) for row in ratios_))
        if key in self.seen:
            k = self.seen[key]
            if source != "search" and not self.candidates[k].baseline:  # a searched one is also this baseline
                self.candidates[k] = replace(self.candidates[k], baseline=source)
        elif self.fits(prog, extra, ratios_):
            self.seen[key] = len(self.candidates)
            self.candidates.append(Candidate(cost, prog, extra, ratios_, len(self.history), source))

    def cost_at(self, prog: Any, ratios_: Any) -> float:
        """The loop's objective for ``prog`` at ``ratios_``: the duplex time or the stage cost."""
        return duplex_cost(self.cm, prog, ratios_) if self.duplex else self.cm.evaluate(prog, ratios_).cost_s

    def _balanced(self, res: Any, s: _Searched) -> tuple[Any, float, float]:
        """The LP's ratios, cost and seconds for a searched program (memory-capped where the plain LP's
        ratios overflow a device; the ratios it was found at where the LP has none or clearly costlier
        ones); ratios None when nothing fits."""
        cm, prog, stats = self.cm, res.program, self.stats
        bal = (
            None
            if self.mem_on
            else self.lp("lp", (prog,), lambda: balance(cm, prog, self.ratio_pins, duplex=self.duplex))
        )
        if bal is None or not self.fits(prog, s.final, bal.ratios):
            try:  # the LP's ratios overflow a device: balance again with memory caps
                bal = self.lp(
                    "lp_memory",
                    (prog, s.final),
                    lambda: balance_in_memory(cm, prog, s.final, self.ratio_pins, duplex=self.duplex),
                )
            except MemoryCapError:
                bal = None
        # keep the ratios the program was found at (when it fits there) where the LP has no ratios (its
        # linear memory is coarser than the search's integer shards) or clearly costlier ones (a segmented
        # program's LP prices re-cuts coarsely: a re-cut never starts a stage there)
        ratios_k, cost_k, b_sec = (bal.ratios, bal.cost, bal.seconds) if bal is not None else (None, 0.0, 0.0)
        worse = bal is not None and res.cost < cost_k * (1 - LP_WORSE)
        if (
            bal is None or (worse and keeps_ratio_pins(s.ratios, self.ratio_pins, self.c.names))
        ) and self.fits(prog, s.final, s.ratios):
            at = self.cost_at(prog, s.ratios)
            if bal is None or at < cost_k * (1 - LP_WORSE):
                ratios_k, cost_k = s.ratios, at
                kept = "memory_lp_kept_ratios" if bal is None else "lp_kept_ratios"
                stats[kept] = stats.get(kept, 0) + 1
        return ratios_k, cost_k, b_sec

    def consider(self, res: Any, s: _Searched, it: int, source: str = "search") -> bool:
        """Balance a searched program, record the round and the candidate; whether it is the new best."""
        prog = res.program
        if self.fixed is not None:
            if not self.fits(prog, s.final, self.fixed):
                return False
            ratios_k, cost_k, b_sec = self.fixed, self.cost_at(prog, self.fixed), 0.0
        else:
            ratios_k, cost_k, b_sec = self._balanced(res, s)
            if ratios_k is None:
                self.stats["memory_rejected"] = self.stats.get("memory_rejected", 0) + 1
                return False
            self.stats["balance_s"] += b_sec
        accepted = self.best is None or cost_k < self.best[0] * (1 - 1e-9)
        self.add_candidate(cost_k, prog, s.final, ratios_k)
        self.history.append(
            Round(it, res.cost, cost_k, ratios_k, dict(s.stats)["expansions"], res.seconds, b_sec, len(prog),
                  accepted, source)
        )  # fmt: skip
        if accepted:
            self.best = (cost_k, prog, s.final, ratios_k)
        return accepted

    # ------------------------------------------------------------------ rounds
    def alternate(self, B: tuple[tuple[float, ...], ...], it: int, limit: int) -> int:
        """Q/B rounds from ratios B while the cost strictly improves; returns the iteration count."""
        while it < limit:
            it += 1
            # at the best program's own ratios it seeds the search: it bounds the search from the start, and
            # a program that only ties with it does not replace it (no LP for a tie)
            best = self.best
            inc = best[1] if best is not None and _same_ratios(best[3], B) else None
            try:
                res, s = self.search(B, self.form_pins, move=True, incumbent=inc)
            except NoProgramError:
                if self.best is None:
                    raise
                break  # nothing fits at these ratios: keep the best so far
            improved = self.consider(res, s, it)
            if self.fixed is not None or not improved:
                break
            if _same_ratios(self.best[3], s.ratios):  # type: ignore[index]
                break  # the LP kept the ratios the search ran at: the next search would return the same program
            if self.mem_on and not res.optimal and self.best[0] > res.cost * (1 - MEMORY_MIN_GAIN):  # type: ignore[index]
                # memory: the LP's ratios gain this little over those the search ran at, not worth another
                # memory-aware search (a costly one, stopped at its budget like this one) from ratios this close
                self.stats["memory_rounds_cut"] = self.stats.get("memory_rounds_cut", 0) + 1
                break
            B = self.best[3]  # type: ignore[index]
        return it

    def seed_rounds(self, it: int, max_iterations: int) -> None:
        """The baseline seeds (:func:`hapnb.synth.seeds.seeds`): each a candidate at its own ratios, and a
        program not balanced before starts Q/B rounds of its own."""
        tried = {self.best[1]} if self.best is not None else set()
        # device models price the optimizer step, which ZeRO storage (priced on this cluster, allowed) shards
        sharded_step = self.cm.modelled and self.cm.zero_priced and bool(self.options.get("zero", True))
        for name, bpins, bratios, bopts in seeds(self.th, self.c, self.form_pins, self.mem_on, sharded_step):
            step_seed = name in SHARDED and not self.mem_on  # seeded for its sharded optimizer step
            budget = (
                min(self.max_expansions or SHARDED_SEED_EXPANSIONS, SHARDED_SEED_EXPANSIONS)
                if step_seed
                else None
            )
            textbook = name in ("dp_ev", "dp_cp")
            try:
                res, s = self.search(bratios, bpins, bopts, budget=budget, textbook=textbook)
            except (NoProgramError, ValueError):
                continue
            own = self.cost_at(res.program, bratios)
            keeps = keeps_ratio_pins(bratios, self.ratio_pins, self.c.names)
            if keeps:  # a candidate only where it keeps the ratio pins
                self.add_candidate(own, res.program, s.final, bratios, f"baseline {name}")
            if res.program in tried:
                # the same program was balanced already; at the baseline's own ratios it can still be a hair
                # cheaper than at the LP's (the LP prices padded collectives and integer shards linearly)
                best = self.best
                if (
                    best is not None
                    and own < best[0] * (1 - 1e-9)
                    and keeps
                    and self.fits(res.program, s.final, bratios)
                ):
                    it += 1
                    exp = dict(s.stats)["expansions"]
                    self.history.append(
                        Round(it, res.cost, own, bratios, exp, res.seconds, 0.0, len(res.program), True, f"seed {name}")
                    )  # fmt: skip
                    self.best = (own, res.program, s.final, bratios)
                continue
            tried.add(res.program)
            it += 1
            before = self.best[0] if self.best is not None else float("inf")
            if self.consider(res, s, it, f"seed {name}"):
                if self.mem_on and self.best[0] > before * (1 - MEMORY_MIN_GAIN):  # type: ignore[index]
                    continue  # memory: a seed that gains this little is kept without more rounds
                if step_seed:
                    # seeded for its sharded optimizer step: a round's search (memory ignored) cannot store a
                    # parameter sharded, and the rounds from throughput ratios searched that space already
                    # (Cohere on h100x8: a 30,599-expansion search that found data parallelism again)
                    continue
                it = self.alternate(self.best[3], it, it + max_iterations)  # type: ignore[index]

    def optimum(self) -> Optimum:
        """The best program with its ratios, the rounds, the ranked candidates and the proof."""
        if self.best is None:
            raise NoProgramError(
                "no program fits in device memory at any ratios the loop tried"
                + (f" (fixed ratios {list(self.fixed[0])})" if self.fixed is not None else "")
            )
        stats = self.stats
        cost, prog, extra, ratios_best = self.best
        ranked = tuple(sorted(self.candidates, key=lambda k: (k.cost_s, k.round, k.source)))
        stats["gap"] = proven_gap(cost, stats)
        if not stats["optimal"] and stats.get("bound_s", 0.0) >= cost * (1 - 1e-9):
            # every search stopped at its budget proved a bound at or above the plan's cost: no program of its
            # space beats the plan, so the plan is proven optimal all the same
            stats["optimal"] = stats["optimal_by_bound"] = True
        return Optimum(cost, prog, extra, ratios_best, tuple(self.history), stats, self.ratio_pins, ranked)


def memory_budget(max_expansions: int | None, n_ops: int) -> int:
    """The expansion budget of a memory-aware search in the loop for a graph of ``n_ops`` ops:
    :data:`MEMORY_EXPANSIONS` + :data:`MEMORY_EXPANSIONS_PER_OP` per op, never above ``max_expansions``, and
    scaled up by as much as ``max_expansions`` exceeds :data:`DEFAULT_EXPANSIONS` (a user who asks for a longer
    search gets it for memory-aware searches too). ``None`` (no limit on plain searches): :data:`MEMORY_EXPANSIONS`.

    >>> memory_budget(30_000, 700), memory_budget(300_000, 700), memory_budget(2_000, 700), memory_budget(None, 700)
    (3800, 38000, 2000, 1000)
    """
    if max_expansions is None:
        return MEMORY_EXPANSIONS
    base = MEMORY_EXPANSIONS + MEMORY_EXPANSIONS_PER_OP * n_ops
    return min(max_expansions, int(base * max(1.0, max_expansions / DEFAULT_EXPANSIONS)))


def proven_gap(cost_s: float, stats: Mapping[str, Any]) -> float:
    """How much cheaper (relative to ``cost_s``) a program any of the loop's searches could have found
    might be: ``(cost_s - bound) / cost_s`` with ``bound`` the least lower bound proven by a search that
    stopped at its budget (``stats["bound_s"]``); 0 when every search proved its program optimal or no
    stopped search could beat ``cost_s``. A stopped search whose bound is above the plan's cost (say, a
    tensor-parallel seed) does not count: nothing in its space beats the plan. Once the loop proved its best
    program optimal (``stats["optimal"]``, also by bound), the gap is 0 even where the plan is a costlier
    candidate the simulator preferred: the proof stands, and the plan's own place is ``stats["cost_rank"]``.

    >>> round(proven_gap(1.0, {"optimal": False, "bound_s": 0.9}), 6), proven_gap(1.0, {"optimal": True, "bound_s": 0.9})
    (0.1, 0.0)
    """
    bound = stats.get("bound_s")
    if bound is None or cost_s <= 0 or stats.get("optimal"):
        return 0.0
    return max(0.0, (cost_s - bound) / cost_s)
