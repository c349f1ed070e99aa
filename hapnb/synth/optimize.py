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
from ..ir.forms import Form, FullShard, G, I, ShardGradOp, parse_pin
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
from .search import NoProgramError, Search, normalize_ratios, resolve_pins

__all__ = [
    "Round",
    "Optimum",
    "Candidate",
    "optimize",
    "assign_segments",
    "parse_pins",
    "baseline_specs",
    "fsdp_pins",
    "without_gc",
    "Memo",
]


#: Expansion budget of a memory-aware search in the Q/B loop: ``MEMORY_EXPANSIONS +
#: MEMORY_EXPANSIONS_PER_OP * ops`` (and at most ``max_expansions``), then one greedy dive (four while none completed). Its first
#: greedy dive already gives a program within a fraction of a percent of the optimum at those ratios on the
#: GPT-48 benchmarks, while proving it can take 25x the expansions of the plain search (the memory-forced
#: storage costs only show once many parameters are placed); ``stats["optimal"]`` says when a search
#: stopped at the budget.
MEMORY_EXPANSIONS, MEMORY_EXPANSIONS_PER_OP = 1000, 4
#: With memory bound, a baseline seed that improves the best cost by less than this fraction is kept as the
#: best without the Q/B rounds from its ratios (each a memory-aware search and LP).
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


class Memo:
    """Results of searches and LPs on one theory, keyed by everything they depend on (the cluster, the
    ratios, the pins, the search options and budget; the program and the ratio pins), for reuse by later
    :func:`optimize` calls (a searched result is reused only when no time limit could have cut it short).
    ``reused`` / ``computed`` count the lookups by kind. A table is cleared when it grows past its limit
    (``limits[kind]``, else ``limit`` entries: an interactive session makes many plans; whole plans are
    large, so few of them are kept)."""

    def __init__(self, limit: int = 512, limits: Mapping[str, int] | None = None) -> None:
        self.limit = limit
        self.limits = {"plan": 32, "shared": 64, **(limits or {})}
        self.tables: dict[str, dict[Any, Any]] = {}
        self.reused: dict[str, int] = {}
        self.computed: dict[str, int] = {}

    def get(self, kind: str, key: Any, make: Any) -> Any:
        """The value for ``key`` in table ``kind``, made by ``make()`` on a miss (an exception it raises
        is remembered and raised again on every later lookup of the same key)."""
        table = self.tables.setdefault(kind, {})
        if key in table:
            self.reused[kind] = self.reused.get(kind, 0) + 1
            value = table[key]
        else:
            self.computed[kind] = self.computed.get(kind, 0) + 1
            try:
                value = make()
            except (NoProgramError, ValueError, RuntimeError) as e:
                value = _Raised(e)
            if len(table) >= self.limits.get(kind, self.limit):
                table.clear()
            table[key] = value
        if isinstance(value, _Raised):
            raise value.error
        return value

    def cost_model(self, th: Theory, cluster: Cluster) -> CostModel:
        """The :class:`~hapnb.cost.model.CostModel` of ``th`` on ``cluster``, kept for reuse (its caches: each op's
        times, the lower bound) by the Q/B loop and the plans packaged from it."""
        return self.get("cost_model", (self.token(cluster), id(th)), lambda: CostModel(th, cluster))

    def peek(self, kind: str, key: Any) -> Any:
        """The value for ``key`` in table ``kind`` when one was made (None when not, or when its ``make()``
        raised), without making it or counting a lookup."""
        value = self.tables.get(kind, {}).get(key)
        return None if isinstance(value, _Raised) else value

    def token(self, value: Any) -> int:
        """A small int standing for ``value`` (e.g. a cluster) in keys, hashed once per call instead of once
        per key; stable for the memo's life (the token table is never cleared)."""
        tokens = self.tables.setdefault("token", {})
        return tokens.setdefault(value, len(tokens))

    def shared(self, key: Any) -> dict[str, Any]:
        """A dict of costs shared by the searches at ``key`` (cluster and ratios, see ``Search(shared=)``; or
        cluster and ``"per_cluster"``: what does not depend on the ratios)."""
        table = self.tables.setdefault("shared", {})
        if key not in table and len(table) >= self.limits["shared"]:  # each holds a cost per op and strategy
            table.clear()
        return table.setdefault(key, {})

    def __repr__(self) -> str:
        kinds = sorted(set(self.reused) | set(self.computed))
        return (
            "Memo("
            + ", ".join(
                f"{k}: {self.reused.get(k, 0)} reused / {self.computed.get(k, 0)} computed" for k in kinds
            )
            + ")"
        )


@dataclass(frozen=True)
class _Raised:
    error: BaseException


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


def baseline_specs(
    th: Theory, c: Cluster, user_pins: Mapping[str, Form]
) -> list[tuple[str, dict[str, Form], tuple[tuple[float, ...], ...], dict[str, bool]]]:
    """(name, pins, ratios, search options) of the baselines: data parallel with even (``dp_ev``) and
    throughput-proportional (``dp_cp``) ratios, and Megatron-style tensor parallel (``tp_ev``)."""
    g = th.graph
    nseg = 1 + max((op.segment for op in th.graph.ops), default=0)
    even = tuple(tuple(1.0 / c.n for _ in range(c.n)) for _ in range(nseg))
    cp = normalize_ratios(None, c, nseg)
    dp_pins = _dp_pins(th)
    tp_pins = {t.name: I for t in g.tensors if t.role == "input"}
    plain = {"sfb": False, "grouped": False}
    out = []
    for name, pins, r in (("dp_ev", dp_pins, even), ("dp_cp", dp_pins, cp), ("tp_ev", tp_pins, even)):
        merged = {**pins, **user_pins}
        out.append((name, merged, r, plain))
    return out


def _seeds(th: Theory, c: Cluster, user_pins: Mapping[str, Form], mem_on: Sequence[bool]) -> Any:
    """The baseline seeds of the Q/B loop: :func:`baseline_specs`, then, when memory binds by then
    (``mem_on[0]``), sharded data parallelism at even ratios: ZeRO-2 (``zero2``: parameters gathered once
    per step, gradients and optimizer states sharded; about data parallelism's communication) and fully
    sharded (``fsdp``, ZeRO-3, as :func:`hapnb.compare` builds it). Where memory binds, a sharded program
    that fits is a candidate of the final pick too, so the plan is never slower than it on the clock it is
    picked by."""
    specs = baseline_specs(th, c, user_pins)
    yield from specs
    if mem_on[0]:
        _, _, even, plain = specs[0]
        yield "zero2", fsdp_pins(th, even[0], user_pins, zero=2), even, plain
        yield "fsdp", fsdp_pins(th, even[0], user_pins), even, plain


def _dp_pins(th: Theory) -> dict[str, Form]:
    """Data parallel: parameters replicated, inputs split on the batch dim (when they can be)."""
    out: dict[str, Form] = {}
    for t in th.graph.tensors:
        if t.role == "param":
            out[t.name] = I
        elif t.role == "input":
            out[t.name] = G(0) if G(0) in th.forms[t.id] else I
    return out


def fsdp_pins(
    th: Theory, ratios: Sequence[float], user_pins: Mapping[str, Any] | None = None, zero: int = 3
) -> dict[str, Any]:
    """Fully sharded data parallel (ZeRO-3 / PyTorch FSDP's FULL_SHARD): the data-parallel pins with every
    parameter stored sharded and all-gathered before each use (:func:`~hapnb.ir.forms.FullShard`), on the
    dim whose largest shard at ``ratios`` (one row) is the smallest (parameters that cannot be split stay
    replicated); ``user_pins`` win. ``zero=2``: ZeRO-2 / FSDP's SHARD_GRAD_OP instead (gathered once per
    step and kept until the backward, :func:`~hapnb.ir.forms.ShardGradOp`).

    >>> import hapnb
    >>> from hapnb.tracing import zoo_graph
    >>> th = hapnb.theory(zoo_graph("mlp", layers=1, hidden=8, input=6, batch=4)[0])
    >>> {k: str(v) for k, v in fsdp_pins(th, [0.5, 0.5]).items()}["layers.0.weight"]  # [8, 6]: 4 rows
    'zero3(0)'
    """
    out: dict[str, Any] = dict(_dp_pins(th))
    for t in th.graph.tensors:
        gs = [f for f in th.forms[t.id] if f.kind == "G"]
        if t.role == "param" and gs:
            best = min(
                gs, key=lambda f: (max(th.lengths(t.id, f.dim, ratios)) / t.shape[f.dim] * t.numel, f.dim)
            )
            out[t.name] = FullShard(best.dim) if zero == 3 else ShardGradOp(best.dim)
    return {**out, **(user_pins or {})}


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
    max_expansions: int | None = 30_000,
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
    c = cluster
    ck = None if memo is None else memo.token(c)  # the cluster in memo keys
    cm = CostModel(th, c) if memo is None else memo.cost_model(th, c)
    form_pins = dict(pins or {})
    fixed: tuple[tuple[float, ...], ...] | None = None
    ratio_pins: tuple[RatioPin, ...] = ()
    if isinstance(ratios, Mapping):
        ratio_pins = parse_ratio_pins(ratios, c.names)
    elif ratios is not None:
        fixed = normalize_ratios(ratios, c, cm.n_segments)
    if fixed is None and _fits_shape(start, cm.n_segments, c.n):
        B = tuple(apply_ratio_pins(tuple(r), ratio_pins, c.names, tuple(r)) for r in start)  # type: ignore[union-attr]
    elif fixed is None:
        row = apply_ratio_pins(normalize_ratios(None, c, 1)[0], ratio_pins, c.names, c.flops)
        B = tuple(row for _ in range(cm.n_segments))
    else:
        B = fixed
    history: list[Round] = []
    candidates: list[Candidate] = []
    seen: dict[Any, int] = {}  # a candidate's key -> its index in candidates
    best: tuple[float, tuple[Step, ...], tuple[Conversion, ...], tuple[tuple[float, ...], ...]] | None = None
    stats: dict[str, Any] = {
        "expansions": 0,
        "generated": 0,
        "pruned_dominated": 0,
        "pruned_bound": 0,
        "search_s": 0.0,
        "balance_s": 0.0,
        "optimal": True,
        "gap": 0.0,
        "duplex": bool(duplex),
    }

    mem_on = [False]  # memory bound in an earlier search: every later search keeps to memory

    fit_memo: dict[tuple[int, int, int], tuple[Any, Any, Any, bool]] = {}
    linear_memo: dict[tuple[Any, Any], MemoryLinear] = {}

    def fits(prog: Any, extra: Any, ratios_: Any) -> bool:
        if not memory:
            return True
        # by identity: one round asks for the same objects several times (hashing a program is not cheap);
        # the entry keeps them alive, so their ids stay theirs
        key = (id(prog), id(extra), id(ratios_))
        hit = fit_memo.get(key)
        if hit is None:
            # the program's memory as a linear function of the ratios, once per program (by value: rounds
            # find the same program again): the checks at other ratios that its upper bound settles skip the
            # breakdown
            pk = (tuple(prog), tuple(extra))
            lin = linear_memo.get(pk)
            if lin is None:
                lin = linear_memo[pk] = memory_linear(cm, prog, extra)
            hit = fit_memo[key] = (prog, extra, ratios_, memory_fits(cm, prog, extra, ratios_, lin))
        return hit[3]

    # this call's searches: (ratios, pins, options, memory, outcome), for :func:`_subsumes`
    done: list[tuple[Any, dict[str, Any], dict[str, bool], bool, _Searched]] = []

    def subsumed(ratios_: Any, pins_: Mapping[str, Any], merged: Mapping[str, bool], mem: bool) -> Any:
        """An earlier search of this call whose proven optimum answers this one (:func:`_subsumes`), as
        this search's outcome (no expansions), or None."""
        if duplex:
            return None
        key = tuple(map(tuple, ratios_))
        for r0, p0, o0, m0, out in done:
            if r0 == key and m0 == mem and _subsumes(th, out.result, p0, o0, pins_, merged):
                zero = {k: 0 for k in ("expansions", "generated", "pruned_dominated", "pruned_bound")}
                res = replace(out.result, expansions=0, seconds=0.0)  # proven optimal: _subsumes checked
                return _Searched(res, out.final, tuple(zero.items()), out.ratios)
        return None

    def run_search(
        ratios_: Any,
        pins_: Mapping[str, Form],
        merged: Mapping[str, bool],
        mem: bool,
        incumbent: Any = None,
        fallback: Any = None,
    ) -> _Searched:
        shared = None if memo is None else memo.shared((ck, tuple(map(tuple, ratios_))))
        if shared is not None:  # prices that do not depend on the ratios: one dict per cluster
            shared.setdefault("per_cluster", memo.shared((ck, "per_cluster")))
            shared.setdefault("static", memo.shared("static"))  # the theory's search tables
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
            pres = p.run(max_expansions=max_expansions, max_seconds=max_seconds)
            s.seed(pres.program)
            seed_exp, seed_s = p.stats["expansions"], pres.seconds
        budget, dives = max_expansions, 32
        if s.memory:  # memory makes proving optimality costly where little is left to gain (see below)
            budget = min(
                budget or MEMORY_EXPANSIONS, MEMORY_EXPANSIONS + MEMORY_EXPANSIONS_PER_OP * len(th.graph.ops)
            )
            dives = 1
        res = s.run(max_expansions=budget, max_seconds=max_seconds, progress=progress, dives=dives)
        if not res.optimal and fallback is not None and not duplex and not s.memory:
            # stopped at its budget: the data-parallel program at these ratios (a quick, proven search in
            # a smaller space) joins as an incumbent, so the search's program is never worse than it and the
            # proven bound is read with it
            prog = fallback()
            if prog is not None and s.seed(prog, dive=False):
                res = replace(s.result(res.seconds), seconds=res.seconds)
        return _Searched(res, s.final_conversions(), tuple(s.stats.items()), s.ratios, seed_exp, seed_s)

    def search(
        ratios_: Any,
        pins_: Mapping[str, Form],
        opts: Mapping[str, bool] | None = None,
        move: bool = False,
        incumbent: Any = None,
    ) -> tuple[Any, _Searched]:
        merged = {**(options or {}), **(opts or {})}
        if mem_on[0] and move and fixed is None and len({tuple(r) for r in ratios_}) == 1:
            # keeping to memory: start where a lean program has room (proportional ratios can leave none)
            ids = resolve_pins(th, pins_)
            row = None
            for margin in (0.8, 0.9, 1.0):  # the most room a lean program can be given
                row = memory_start_ratios(cm, ids, ratio_pins, margin, start=ratios_[0])
                if row is not None:
                    break
            if row is None:
                raise NoProgramError("no program fits in device memory: not even a lean one at any ratios")
            if row != tuple(ratios_[0]):
                stats["memory_start"] = True
                ratios_ = tuple(row for _ in ratios_)
        mem = mem_on[0]
        fallback = None
        if move and not duplex:

            def fallback() -> Any:
                """The data-parallel program at these ratios (None where there is none)."""
                dp_pins = {**_dp_pins(th), **{k: v for k, v in pins_.items()}}
                try:
                    return search(ratios_, dp_pins, {"sfb": False, "grouped": False})[0].program
                except (NoProgramError, ValueError):
                    return None

        found = subsumed(ratios_, pins_, merged, mem)
        if found is not None:
            stats["searches_subsumed"] = stats.get("searches_subsumed", 0) + 1
            return found.result, found
        if memo is not None and max_seconds is None:
            key = (
                ck,
                tuple(map(tuple, ratios_)),
                _frozen(pins_),
                _frozen(merged),
                duplex,
                max_expansions,
                mem,
                incumbent,
            )
            out = memo.get(
                "search", key, lambda: run_search(ratios_, pins_, merged, mem, incumbent, fallback)
            )
        else:
            out = run_search(ratios_, pins_, merged, mem, incumbent, fallback)
        done.append((tuple(map(tuple, ratios_)), dict(pins_), merged, mem, out))
        if duplex:
            stats["seed_expansions"] = stats.get("seed_expansions", 0) + out.seed_expansions
            stats["search_s"] += out.seed_seconds
        st = dict(out.stats)
        res = out.result
        for k in ("expansions", "generated", "pruned_dominated", "pruned_bound"):
            stats[k] += st[k]
        stats["search_s"] += res.seconds
        stats["optimal"] = stats["optimal"] and res.optimal
        if not res.optimal:  # the least proven lower bound of a search stopped at its budget
            stats["bound_s"] = min(stats.get("bound_s", float("inf")), res.bound)
        if not duplex and not mem_on[0] and not fits(res.program, out.final, out.ratios):
            mem_on[0] = stats["memory_bound"] = True  # search again, keeping to memory
            return search(ratios_, pins_, opts, move, incumbent)
        return res, out

    def lp(kind: str, what: tuple[Any, ...], make: Any) -> Any:
        """An LP's result (``make()``), from the memo when the same LP was solved before."""
        if memo is None:
            return make()
        return memo.get(kind, (ck, *what, ratio_pins, duplex), make)

    def add_candidate(cost: float, prog: Any, extra: Any, ratios_: Any, source: str = "search") -> None:
        # one candidate per program and ratios; ratios equal to 12 decimals count as equal (a baseline at
        # throughput-proportional ratios and the LP's ratios for the same program often differ in the last
        # bits only: the same plan, simulated once)
        key = (prog, tuple(tuple(round(x, 12) for x in row) for row in ratios_))
        if key in seen:
            k = seen[key]
            if source != "search" and not candidates[k].baseline:  # a searched one is also this baseline
                candidates[k] = replace(candidates[k], baseline=source)
        elif fits(prog, extra, ratios_):
            seen[key] = len(candidates)
            candidates.append(Candidate(cost, prog, extra, ratios_, len(history), source))

    def cost_at(prog: Any, ratios_: Any) -> float:
        """The loop's objective for ``prog`` at ``ratios_``: the duplex time or the stage cost."""
        return duplex_cost(cm, prog, ratios_) if duplex else cm.evaluate(prog, ratios_).cost_s

    def consider(res: Any, s: _Searched, it: int, source: str = "search") -> bool:
        nonlocal best
        prog = res.program
        if fixed is not None:
            if not fits(prog, s.final, fixed):
                return False
            ratios_k, cost_k, b_sec = fixed, cost_at(prog, fixed), 0.0
        else:
            bal = (
                None if mem_on[0] else lp("lp", (prog,), lambda: balance(cm, prog, ratio_pins, duplex=duplex))
            )
            if bal is None or not fits(prog, s.final, bal.ratios):
                try:  # the LP's ratios overflow a device: balance again with memory caps
                    bal = lp(
                        "lp_memory",
                        (prog, s.final),
                        lambda: balance_in_memory(cm, prog, s.final, ratio_pins, duplex=duplex),
                    )
                except MemoryCapError:
                    bal = None
            # keep the ratios the program was found at (when it fits there) where the LP has no ratios (its
            # linear memory is coarser than the search's integer shards) or clearly costlier ones (a segmented
            # program's LP prices re-cuts coarsely: a re-cut never starts a stage there)
            ratios_k, cost_k, b_sec = (
                (bal.ratios, bal.cost, bal.seconds) if bal is not None else (None, 0.0, 0.0)
            )
            worse = bal is not None and res.cost < cost_k * (1 - LP_WORSE)
            if (bal is None or (worse and keeps_ratio_pins(s.ratios, ratio_pins, c.names))) and fits(
                prog, s.final, s.ratios
            ):
                at = cost_at(prog, s.ratios)
                if bal is None or at < cost_k * (1 - LP_WORSE):
                    ratios_k, cost_k = s.ratios, at
                    kept = "memory_lp_kept_ratios" if bal is None else "lp_kept_ratios"
                    stats[kept] = stats.get(kept, 0) + 1
            if ratios_k is None:
                stats["memory_rejected"] = stats.get("memory_rejected", 0) + 1
                return False
            stats["balance_s"] += b_sec
        accepted = best is None or cost_k < best[0] * (1 - 1e-9)
        add_candidate(cost_k, prog, s.final, ratios_k)
        history.append(
            Round(
                it,
                res.cost,
                cost_k,
                ratios_k,
                dict(s.stats)["expansions"],
                res.seconds,
                b_sec,
                len(prog),
                accepted,
                source,
            )
        )
        if accepted:
            best = (cost_k, prog, s.final, ratios_k)
        return accepted

    def alternate(B: tuple[tuple[float, ...], ...], it: int, limit: int) -> int:
        """Q/B rounds from ratios B while the cost strictly improves; returns the iteration count."""
        while it < limit:
            it += 1
            # at the best program's own ratios it seeds the search: it bounds the search from the start, and
            # a program that only ties with it does not replace it (no LP for a tie)
            inc = best[1] if best is not None and _same_ratios(best[3], B) else None
            try:
                res, s = search(B, form_pins, move=True, incumbent=inc)
            except NoProgramError:
                if best is None:
                    raise
                break  # nothing fits at these ratios: keep the best so far
            improved = consider(res, s, it)
            if fixed is not None or not improved:
                break
            if _same_ratios(best[3], s.ratios):  # type: ignore[index]
                break  # the LP kept the ratios the search ran at: the next search would return the same program
            B = best[3]  # type: ignore[index]
        return it

    failed: NoProgramError | None = None
    try:
        it = alternate(B, 0, max_iterations)
    except NoProgramError as e:
        if not (mem_on[0] and seed_baselines and fixed is None):
            raise
        failed, it = e, 0  # nothing fits from these ratios: a seed (fsdp at even ratios) still may
    if seed_baselines and fixed is None:
        tried = {best[1]} if best is not None else set()
        for name, bpins, bratios, bopts in _seeds(th, c, form_pins, mem_on):
            try:
                res, s = search(bratios, bpins, bopts)
            except (NoProgramError, ValueError):
                continue
            own = cost_at(res.program, bratios)
            keeps = keeps_ratio_pins(bratios, ratio_pins, c.names)
            if keeps:  # a candidate only where it keeps the ratio pins
                add_candidate(own, res.program, s.final, bratios, f"baseline {name}")
            if res.program in tried:
                # the same program was balanced already; at the baseline's own ratios it can still be a hair
                # cheaper than at the LP's (the LP prices padded collectives and integer shards linearly)
                if (
                    best is not None
                    and own < best[0] * (1 - 1e-9)
                    and keeps
                    and fits(res.program, s.final, bratios)
                ):
                    it += 1
                    exp = dict(s.stats)["expansions"]
                    history.append(
                        Round(
                            it,
                            res.cost,
                            own,
                            bratios,
                            exp,
                            res.seconds,
                            0.0,
                            len(res.program),
                            True,
                            f"seed {name}",
                        )
                    )
                    best = (own, res.program, s.final, bratios)
                continue
            tried.add(res.program)
            it += 1
            before = best[0] if best is not None else float("inf")
            if consider(res, s, it, f"seed {name}"):
                if mem_on[0] and best[0] > before * (1 - MEMORY_MIN_GAIN):  # type: ignore[index]
                    continue  # memory: a seed that gains this little is kept without more rounds
                it = alternate(best[3], it, it + max_iterations)  # type: ignore[index]
    if best is None and failed is not None:
        raise failed
    if best is None:
        raise NoProgramError(
            "no program fits in device memory at any ratios the loop tried"
            + (f" (fixed ratios {list(fixed[0])})" if fixed is not None else "")
        )
    cost, prog, extra, ratios_best = best
    ranked = tuple(sorted(candidates, key=lambda k: (k.cost_s, k.round, k.source)))
    stats["gap"] = proven_gap(cost, stats)
    if not stats["optimal"] and stats.get("bound_s", 0.0) >= cost * (1 - 1e-9):
        # every search stopped at its budget proved a bound at or above the plan's cost: no program of its
        # space beats the plan, so the plan is proven optimal all the same
        stats["optimal"] = stats["optimal_by_bound"] = True
    return Optimum(cost, prog, extra, ratios_best, tuple(history), stats, ratio_pins, ranked)


def proven_gap(cost_s: float, stats: Mapping[str, Any]) -> float:
    """How much cheaper (relative to ``cost_s``) a program any of the loop's searches could have found
    might be: ``(cost_s - bound) / cost_s`` with ``bound`` the least lower bound proven by a search that
    stopped at its budget (``stats["bound_s"]``); 0 when every search proved its program optimal or no
    stopped search could beat ``cost_s``. A stopped search whose bound is above the plan's cost (say, a
    tensor-parallel seed) does not count: nothing in its space beats the plan."""
    bound = stats.get("bound_s")
    if bound is None or cost_s <= 0:
        return 0.0
    return max(0.0, (cost_s - bound) / cost_s)
