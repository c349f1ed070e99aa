"""Synthesis: the public entry points that turn a model and a cluster into :class:`~hapnb.plans.plan.Plan` values.

:func:`synthesize` resolves the model (a Graph, a Theory, an nn.Module with example inputs, a zoo name or
``package.module:factory``), runs the Q/B loop of :mod:`hapnb.synth.optimize`, packages the best program with
its ratios as a Plan and checks that it fits in memory. :func:`baselines` packages the data-parallel and
tensor-parallel programs under the same cost model, for comparison.

Every plan :func:`synthesize` returns carries its :class:`SynthesisContext` (``plan.context``: the theory,
the model spec, synthesize's arguments and a :class:`~hapnb.synth.optimize.Memo` of searches, LPs and
simulated times), shared by every plan :func:`replan` (``plan.replan(...)``) makes from it: a re-plan with
other pins, ratio pins or cluster runs synthesize's own steps on the merged inputs and takes every
search, LP and simulation whose inputs did not change from the memo, so it returns exactly the plan a
fresh :func:`synthesize` would (timings aside); ``exact=False`` starts the Q/B loop from the plan's own
ratios without the baseline seeds instead (faster; a fixpoint of the loop, see :func:`replan`). A plan
loaded from JSON gets a context on its first re-plan (its model rebuilt once from the recorded spec).

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)
>>> plan.cost_s >= plan.lower_bound_s
True
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..cost.memory import largest_pieces
from ..cost.model import CostModel
from ..hardware.cluster import Cluster
from ..ir.graph import Graph
from ..synth.balance import solver_name
from ..synth.duplex import duplex_cost
from ..synth.optimize import (
    Candidate,
    Memo,
    assign_segments,
    baseline_specs,
    fsdp_pins,
    keeps_ratio_pins,
    optimize,
    parse_pins,
    proven_gap,
    without_gc,
)
from ..synth.search import NoProgramError, Search
from ..tracing import resolve_model
from ..triples import Theory, coverage, theory
from . import plan as plan_module
from .explain import rebuild_graph, sensitivity, why_not
from .plan import Plan, freeze_mapping, make_plan
from .simulation import iteration_lower_bound, iteration_time

__all__ = [
    "synthesize",
    "baselines",
    "fixed_plan",
    "replan",
    "OutOfMemoryError",
    "out_of_memory",
    "SynthesisContext",
]


#: how many of the Q/B loop's candidates (best cost first) the overlap simulator compares for the final pick
FINAL_CANDIDATES = 8


class OutOfMemoryError(RuntimeError):
    """No plan fits every device's memory (the message says what the leanest program needs and what fills
    it); ``need``: the same in one line, for reports (hapnb.compare's note)."""

    def __init__(self, message: str, need: str = "") -> None:
        super().__init__(message)
        self.need = need


@without_gc
def synthesize(
    model_or_graph: Any,
    cluster: Cluster | str,
    pins: Mapping[str, Any] | None = None,
    example_inputs: Sequence[Any] | None = None,
    *,
    ratios: Mapping[str, Any] | Sequence[float] | Sequence[Sequence[float]] | None = None,
    loss: Any = None,
    options: Mapping[str, bool] | None = None,
    max_iterations: int = 10,
    max_expansions: int | None = 30_000,
    max_seconds: float | None = None,
    segments: Any = None,
    seed_baselines: bool = True,
    check_memory: bool = True,
    progress: bool = False,
    duplex: bool = False,
    pick: str = "simulated",
    **zoo_options: Any,
) -> Plan:
    """Synthesize a plan: the program Q and ratios B minimising the per-iteration time.

    ``max_expansions`` / ``max_seconds`` bound each A* search (the default budget proves optimality for
    the paper's transformers many times over; when a search hits it, the best program found by A* plus
    greedy dives is used and ``plan.stats["optimal"]`` is False).
    ``segments``: ``None`` (one ratio vector), ``"layer"`` or markers (see :func:`assign_segments`).
    ``ratios``: a mapping of ratio pins (``{"v100-0": 0.3, "p100-1": (0.05, 0.2)}``), or a list of
    per-device ratios (one list, or one per segment) to use as they are (no LP).
    ``duplex``: HiDup's duplex schedule (two micro-batches, one computing while the other communicates,
    :mod:`hapnb.synth.duplex`): search and LP minimise the duplex time; the plan has ``duplex=True``,
    ``cost_s`` = its duplex time and ``stats["duplex"]`` True (its stages are the plain cost model's).

    ``check_memory`` (default True): the plan fits every device's memory. The Q/B loop keeps to memory
    where it binds (:func:`hapnb.synth.optimize.optimize` ``memory``: memory-aware search with ZeRO-2/3 storage,
    memory caps in the LP); plans that fit without it are unchanged; when nothing fits,
    :class:`OutOfMemoryError` says what the leanest program needs. ``False``: memory is ignored.

    ``pick``: ``"simulated"`` (default): the loop's candidates (the :data:`FINAL_CANDIDATES` cheapest
    programs it balanced, and each baseline's program at the baseline's own ratios) are simulated with
    overlap (:func:`hapnb.simulate`) and the fastest is the plan, so its ``simulated_s`` is never above a
    baseline's (a candidate whose lower bound, :func:`hapnb.plans.simulation.iteration_lower_bound`, is above the
    fastest time simulated so far cannot win and is not simulated: ``stats["candidates_bounded"]``);
    ``"cost"``: the loop's optimum under the stage model (or duplex) cost, as HAP picks it (the paper
    comparisons). Either way ``plan.cost_s`` is the stage-model (or duplex) cost and
    ``plan.simulated_s`` the simulated time; ``stats["chosen"]`` says where the program came from.
    """
    if pick not in ("simulated", "cost"):
        raise ValueError(f"pick must be 'simulated' or 'cost', got {pick!r}")
    c = cluster if isinstance(cluster, Cluster) else Cluster.resolve(cluster)
    traced: dict[str, Any] = {}  # how the graph was made (zoo models: build_s, trace_s, trace_path)
    graph, spec = _graph_of(model_or_graph, c, example_inputs, loss, traced, **zoo_options)
    solver_name()  # import and probe the LP solver outside the timed span, as the model's modules are
    t0 = time.perf_counter()
    if segments is not None:
        graph = assign_segments(graph, segments)
    th = model_or_graph if isinstance(model_or_graph, Theory) and segments is None else theory(graph)
    args = dict(
        ratios=ratios, options=dict(options or {}), max_iterations=max_iterations,
        max_expansions=max_expansions, max_seconds=max_seconds, seed_baselines=seed_baselines,
        check_memory=check_memory, progress=progress, duplex=duplex, pick=pick,
        segments=_segments_label(segments),
    )  # fmt: skip
    return _synthesize(SynthesisContext(th, spec, args, traced), c, pins, t0)


class SynthesisContext:
    """What a plan was synthesized from and what re-planning reuses (not a value: it caches).

    ``theory`` (the traced program, segmented), ``spec`` (how to rebuild the model, or None), ``args``
    (synthesize's keyword arguments: ``ratios`` (ratio pins or fixed ratios), ``options``,
    ``max_iterations``, ``max_expansions``, ``max_seconds``, ``seed_baselines``, ``check_memory``,
    ``progress``, ``duplex``, ``pick``, ``segments``) and ``memo``, the searches, LPs and simulated times
    computed so far (:class:`~hapnb.synth.optimize.Memo`; also what :mod:`hapnb.plans.explain` reuses)."""

    def __init__(
        self,
        theory: Theory,
        spec: Mapping[str, Any] | None,
        args: Mapping[str, Any],
        traced: Mapping[str, Any] | None = None,
    ) -> None:
        self.theory = theory
        self.traced = dict(traced or {})  # how the graph was made (zoo models: build_s, trace_s, trace_path)
        self.spec = dict(spec) if spec else None
        self.args = dict(args)
        self.memo = Memo()

    def __repr__(self) -> str:
        return f"SynthesisContext({self.theory.graph.name}, {self.memo!r})"


def _synthesize(
    ctx: SynthesisContext,
    c: Cluster,
    pins: Mapping[str, Any] | None,
    t0: float,
    start: tuple[tuple[float, ...], ...] | None = None,
) -> Plan:
    """:func:`synthesize` on a context's theory and arguments (the steps :func:`replan` repeats).
    ``start``: a fast re-plan's warm start (the Q/B loop from these ratios, no baseline seeds)."""
    a = ctx.args
    th, ratios, duplex, options = ctx.theory, a["ratios"], a["duplex"], a["options"]
    form_pins = parse_pins(pins)
    try:
        best = optimize(
            th,
            c,
            form_pins,
            ratios,
            options=options,
            max_iterations=a["max_iterations"],
            max_expansions=a["max_expansions"],
            max_seconds=a["max_seconds"],
            seed_baselines=a["seed_baselines"] and start is None,
            progress=a["progress"],
            duplex=duplex,
            memo=ctx.memo,
            memory=a["check_memory"],
            start=start,
        )
    except NoProgramError as e:
        if a["check_memory"] and "memory" in str(e):
            raise out_of_memory(th, c, form_pins) from e
        raise

    frozen_pins = freeze_mapping({k: str(v) for k, v in form_pins.items()})
    ck = ctx.memo.token(c)

    def cost_model() -> CostModel:
        """One cost model (and its caches) for the Q/B loop and every candidate's bound and plan."""
        return ctx.memo.cost_model(th, c)

    def package(k: Candidate, stats: Mapping[str, Any], simulated_s: float | None = None) -> Plan:
        """The candidate as a Plan with its simulated time (memoised on everything the plan depends on)."""

        def make() -> Plan:
            plan = make_plan(
                th,
                c,
                k.program,
                k.extra,
                k.ratios,
                history=best.history,
                pins=form_pins,
                ratio_pins=best.ratio_pins,
                stats=stats,
                model=ctx.spec,
                options={**options, "segments": a["segments"]},
                cost_model=cost_model(),
            )
            if duplex:
                plan = dataclasses.replace(plan, duplex=True, cost_s=k.cost_s)
            sim = iteration_time(plan) if simulated_s is None else simulated_s
            return dataclasses.replace(plan, simulated_s=sim)

        key = (ck, k, duplex, best.history, best.ratio_pins, frozen_pins, freeze_mapping(stats), a["segments"],
               freeze_mapping(options), freeze_mapping(ctx.spec))  # fmt: skip
        return ctx.memo.get("plan", key, make)

    def sim_key(k: Candidate) -> Any:
        return (ck, k.program, k.extra, k.ratios, k.cost_s, duplex)

    def simulated(k: Candidate) -> tuple[float, Plan | None]:
        """The candidate's simulated time (from the memo when simulated before) and its plan if made now."""
        made: list[Plan] = []

        def run() -> float:
            made.append(package(k, best.stats))
            return made[0].simulated_s  # type: ignore[return-value]

        return ctx.memo.get("simulate", sim_key(k), run), (made[0] if made else None)

    def lower_bound(k: Candidate) -> float:
        """A lower bound of the candidate's simulated time without packaging it."""
        return program_lower_bound(cost_model(), k.program, k.ratios, duplex)

    # the final program: the loop's optimum (pick="cost"), or the candidate the overlap simulator finds
    # fastest (pick="simulated"; ties: the lower cost_s): the cheapest searched ones and every baseline's
    own = Candidate(best.cost_s, best.program, best.extra, best.ratios, 0)
    if a["pick"] == "cost" or not best.candidates or start is not None:
        top: Sequence[Candidate] = (own,)  # a fast re-plan: the loop's fixpoint (simulated, not picked)
    else:
        searched = [k for k in best.candidates if k.source == "search"]
        # the cheapest searched ones, those that are also a baseline's program, and every baseline's
        top = [k for n, k in enumerate(searched) if n < FINAL_CANDIDATES or k.baseline]
        top += [k for k in best.candidates if k.source != "search"]
    # candidates simulated before cost nothing; the others are simulated cheapest lower bound first, and
    # one whose bound is above the fastest simulated so far is skipped: it can be neither the min nor a tie
    known = [ctx.memo.peek("simulate", sim_key(k)) for k in top]
    bounds = [v if v is not None else lower_bound(k) if len(top) > 1 else 0.0 for k, v in zip(top, known)]
    sims: dict[int, tuple[float, Plan | None]] = {}
    fastest = float("inf")
    for i in sorted(range(len(top)), key=lambda i: (known[i] is None, bounds[i], i)):
        if known[i] is None and bounds[i] * (1 - 1e-9) > fastest:
            continue
        sims[i] = simulated(top[i])
        fastest = min(fastest, sims[i][0])
    i = min(sims, key=lambda i: (sims[i][0], top[i].cost_s, i))
    chosen = sims[i][1] or package(top[i], best.stats, sims[i][0])
    # chosen: where the final program came from ("search", or e.g. "baseline dp_cp" when the simulator
    # prefers a baseline's program at its own ratios); cost_rank: its place by cost_s among the candidates;
    # candidates_bounded: those not simulated, their lower bound above the fastest simulated time
    stats = {**best.stats, "candidates_simulated": len(sims), "candidates_bounded": len(top) - len(sims),
             "chosen": top[i].source, "cost_rank": i, "pick": a["pick"], **ctx.traced}  # fmt: skip
    stats["gap"] = proven_gap(chosen.cost_s, stats)  # against the picked program's own cost
    if start is not None:
        stats["replan"] = "fast"  # a fixpoint of the Q/B loop from the previous plan's ratios
    if duplex and not isinstance(ratios, Sequence):
        # two micro-batches need an even local batch on every rank: cut the batch in pairs of samples
        k = top[i]
        even = even_batch_ratios(
            k.ratios, th.graph.tensors[th.graph.inputs[0]].shape[0] if th.graph.inputs else 0
        )
        if even != k.ratios and keeps_ratio_pins(even, best.ratio_pins, c.names):
            cost = duplex_cost(cost_model(), k.program, even)
            chosen = package(dataclasses.replace(k, ratios=even, cost_s=cost), best.stats)
            stats["ratios_even_batch"] = True
    plan = dataclasses.replace(
        chosen, search=freeze_mapping(stats), synthesis_s=time.perf_counter() - t0, context=ctx
    )
    if a["check_memory"]:
        _check_memory(plan)
    return plan


def program_lower_bound(cm: CostModel, program: Sequence[Any], ratios: Any, duplex: bool = False) -> float:
    """:func:`hapnb.plans.simulation.iteration_lower_bound` of the plan :func:`make_plan` would make of ``program``
    at ``ratios``, priced as it prices the plan's instructions (a load, a conversion, a computation each),
    without making the plan."""
    comp, feature, grads = [], [], []
    for st in program:
        comp.append(cm.step_comp(st, ratios))
        if cm.n == 1:
            continue
        loads, convs, sfb = cm.step_parts(st)
        nbytes_of = [cm.graph.tensors[ld.tensor].nbytes for ld in st.loads]
        for terms, nbytes in [*zip(loads, nbytes_of), *((ts, 0) for ts in convs), (sfb, 0)]:
            f = b = 0.0
            for tm in terms:
                total, bwd = tm.time(ratios), tm.backward_time(ratios)
                if tm.gradient:
                    grads.append(nbytes)
                else:
                    f += total - bwd
                    b += bwd
            feature.append((f, b))
    opt = cm.optimizer_comp(program, ratios) if any(cm.models) else (0.0,) * cm.n
    return iteration_lower_bound(comp, feature, grads, opt, cm.cluster, duplex)


@without_gc
def replan(
    plan: Plan,
    pins: Mapping[str, Any] | None = None,
    ratio_pins: Mapping[str, Any] | None = None,
    cluster: Cluster | str | None = None,
    *,
    exact: bool = True,
    **overrides: Any,
) -> Plan:
    """``plan`` re-planned with its pins, ratio pins or cluster changed (``plan.replan``), reusing every
    search, LP and simulation whose inputs did not change (the plan's context's memo).

    ``pins``: tensor -> form or parameter storage (``"zero3(0)"``, :class:`~hapnb.ir.forms.FullShard`), merged
    into the plan's pins (``None`` or ``"auto"`` removes a pin);
    ``ratio_pins``: device -> ratio or ``(lo, hi)``, merged into the plan's ratio pins (``None`` removes
    one); ``cluster``: another cluster (object, preset, JSON path or inline spec): ratio pins of devices it
    lacks are dropped. ``overrides``: other synthesize arguments to change (e.g. ``check_memory=False``,
    ``max_iterations=3``). The result shares the plan's context (and so its caches).

    ``exact=True`` (default): the result equals ``synthesize(model, cluster, pins=merged pins,
    ratios=merged ratio pins, ...)`` with the plan's other arguments, timings aside.

    ``exact=False`` (fast; what the Explorer and :class:`~hapnb.session.Session` use): the Q/B loop starts
    from the plan's own ratios (moved into the merged ratio pins; throughput-proportional ones when the
    cluster has another number of devices) instead of the default start, and the baseline seeds are
    skipped (their job is escaping a bad start), and the plan is the loop's optimum whatever ``pick`` says
    (it is simulated, ``simulated_s``, but no other candidate is). The result satisfies every pin and
    ratio pin and is a fixpoint of the loop (unless ``max_iterations`` rounds ran out): no program is
    cheaper than its program at its ratios (the A* at its ratios finds none; proven when
    ``stats["optimal"]``), and the ratio LP for its program finds no cheaper ratios than its own. It may
    differ from a fresh synthesize: another fixpoint, reached from the old ratios, or (``pick="simulated"``)
    a baseline's program that the fresh pick simulates faster. ``plan.stats["replan"] == "fast"`` marks
    such a plan.
    ``benchmarks/replan.py`` measures how often it equals the fresh plan and by how much it is worse.

    >>> import hapnb
    >>> a = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=32, input=16, batch=8)
    >>> b = a.replan(pins={"x": "I"})
    >>> dict(b.pins), b.replan(pins={"x": None}).program == a.program
    ({'x': 'I'}, True)
    >>> f = a.replan(pins={"x": "I"}, exact=False)
    >>> f.form_of("x"), f.stats["replan"]
    (['I'], 'fast')
    """
    t0 = time.perf_counter()
    ctx = context_of(plan)
    unknown = sorted(set(overrides) - set(ctx.args) - {"ratios"})
    if unknown:
        raise TypeError(f"replan: unknown synthesize argument(s) {', '.join(unknown)}")
    c = plan.cluster if cluster is None else Cluster.resolve(cluster)
    merged_pins = dict(plan.pins)
    for k, v in (pins or {}).items():
        if v is None or v == "auto":
            merged_pins.pop(k, None)
        else:
            merged_pins[k] = v
    args = {**ctx.args, **overrides}
    fixed = args["ratios"] is not None and not isinstance(args["ratios"], Mapping)
    if fixed and (ratio_pins or (cluster is not None and c.n != plan.cluster.n)):
        raise ValueError(
            f"plan {plan.name!r} was made with fixed ratios (ratios=[...]), so it has no ratio pins to change "
            "and no ratios for another number of devices: pass ratios=... (a mapping of ratio pins, or "
            "None for the LP) to replan"
        )
    if not fixed:
        # the plan's ratio pins on devices the cluster still has, then the asked ones (checked by name)
        rp: dict[str, Any] = {d: (lo, hi) for d, lo, hi in plan.ratio_pins if d in c.names}
        for k, v in (ratio_pins or {}).items():
            if v is None:
                rp.pop(k, None)
            else:
                rp[k] = v
        if "ratios" not in overrides:
            args["ratios"] = rp or None
    run = ctx if args == ctx.args else _derived(ctx, args)
    out = _synthesize(run, c, merged_pins, t0, start=None if exact else plan.ratios)
    if plan.model and not ctx.spec:
        out = dataclasses.replace(out, model=plan.model)  # the model spec a session recorded
    return out


def _derived(ctx: SynthesisContext, args: Mapping[str, Any]) -> SynthesisContext:
    """A context with other arguments that shares ``ctx``'s theory and memo (every memo key names all
    that a result depends on, so the memo stays valid)."""
    out = SynthesisContext(ctx.theory, ctx.spec, args, ctx.traced)
    out.memo = ctx.memo
    return out


def context_of(plan: Plan) -> SynthesisContext:
    """The plan's :class:`SynthesisContext`; for a plan without one (loaded from JSON, or made by
    :func:`hapnb.plans.plan.make_plan` directly) one is made and kept on the plan: the graph is the plan's own or
    its model rebuilt from the recorded spec (once), synthesize's arguments those the plan records
    (pins, ratio pins, options, segments, duplex, pick) and the defaults for the rest."""
    if plan.context is not None:
        return plan.context
    graph = plan.graph if plan.graph is not None else rebuild_graph(plan)
    opts = dict(plan.options)
    label = opts.get("segments", "none")
    if label not in ("none", "layer"):
        raise ValueError(
            f"plan {plan.name!r} was made with custom ratio segments ({label}), which its JSON does not "
            "record: synthesize it again with the same segments= to re-plan it"
        )
    th = theory(graph if label == "none" else assign_segments(graph, "layer"))
    options = {k: v for k, v in opts.items() if isinstance(v, bool)}
    ratios = {d: (lo, hi) for d, lo, hi in plan.ratio_pins} or None
    args = dict(
        ratios=ratios, options=options, max_iterations=10, max_expansions=30_000, max_seconds=None,
        seed_baselines=True, check_memory=True, progress=False, duplex=plan.duplex,
        pick=plan.stats.get("pick", "simulated"), segments=label,
    )  # fmt: skip
    ctx = SynthesisContext(th, plan.model_spec, args)
    object.__setattr__(plan, "context", ctx)  # a cache field (not compared, not in JSON)
    return ctx


plan_module.register_tuning(replan=replan, why_not=why_not, sensitivity=sensitivity, context=context_of)


def even_batch_ratios(ratios: tuple[tuple[float, ...], ...], batch: int) -> tuple[tuple[float, ...], ...]:
    """``ratios`` moved to the nearest multiples of ``2 / batch`` (largest remainder; each row still sums to
    1), so a batch of ``batch`` samples cuts into even local batches (a duplex plan's two micro-batches);
    unchanged when ``batch`` is odd or too small to matter.

    >>> even_batch_ratios(((0.62, 0.38),), 8)
    ((0.5, 0.5),)
    >>> even_batch_ratios(((0.7, 0.2, 0.1),), 20)
    ((0.7, 0.2, 0.1),)
    """
    if batch < 2 or batch % 2:
        return ratios
    pairs = batch // 2
    out = []
    for row in ratios:
        want = [r * pairs for r in row]
        got = [int(w) for w in want]
        for j in sorted(range(len(row)), key=lambda j: (got[j] - want[j], j))[: pairs - sum(got)]:
            got[j] += 1
        out.append(tuple(g / pairs for g in got))
    return tuple(out)


def _segments_label(segments: Any) -> str:
    if segments is None or isinstance(segments, str):
        return segments or "none"
    if isinstance(segments, Mapping):
        return "markers"
    return getattr(segments, "__name__", "custom")


@without_gc
def baselines(
    model_or_graph: Any,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[Any] | None = None,
    max_expansions: int | None = 30_000,
    **zoo_options: Any,
) -> dict[str, Plan]:
    """Data parallel with even (``dp_ev``) and throughput-proportional (``dp_cp``) ratios, and Megatron-style
    tensor parallel (``tp_ev``: replicated batch, weights split by the search, even ratios), all under the
    same cost model. A baseline that cannot be built for this model is left out; the result's
    ``unavailable`` says which and why (:class:`Baselines`)."""
    c = cluster if isinstance(cluster, Cluster) else Cluster.resolve(cluster)
    graph, spec = _graph_of(model_or_graph, c, example_inputs, **zoo_options)
    th = model_or_graph if isinstance(model_or_graph, Theory) else theory(graph)
    out = Baselines()
    for name, pins, ratios, opts in baseline_specs(th, c, {}):
        try:
            out[name] = fixed_plan(
                th, c, pins, ratios, opts, name=name, model=spec, max_expansions=max_expansions
            )
        except (NoProgramError, ValueError) as e:
            out.unavailable[name] = _unavailable(th, e)
    if "tp_ev" in out and not any(
        i.kind == "load" and i.form.startswith("G") and _is_param(th, i.tensor) for i in out["tp_ev"].program
    ):
        del out["tp_ev"]  # no weight could be split: tensor parallelism does not apply
        out.unavailable["tp_ev"] = "no weight can be split: tensor parallelism does not apply"
    return out


class Baselines(dict):  # type: ignore[type-arg]
    """``{name: Plan}`` of the baselines that could be built, and ``unavailable``: ``{name: why}`` for
    those that could not (e.g. data parallelism when an input cannot be sharded on its batch dim)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.unavailable: dict[str, str] = {}


def _unavailable(th: Theory, exc: Exception) -> str:
    """Why a baseline could not be built: the error's first line, and the ops without a rule (they run
    replicated and force their tensors to ``I``, the usual reason a data-parallel program is missing)."""
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    fb = coverage(th).fallback
    if fb:
        ops = ", ".join(f"{r.op} ({r.target})" for r in fb[:5]) + (" ..." if len(fb) > 5 else "")
        why += f"; ops without a rule (run replicated): {ops}"
    return why


def fixed_plan(
    th: Theory,
    c: Cluster,
    pins: Mapping[str, Any],
    ratios: Sequence[Sequence[float]],
    options: Mapping[str, bool] | None = None,
    *,
    name: str = "fixed",
    model: Mapping[str, Any] | None = None,
    max_expansions: int | None = 30_000,
) -> Plan:
    """The plan of one A* search at fixed ``ratios`` (one row per segment; no LP) with form ``pins`` and
    search ``options``, with its simulated time: how :func:`baselines` (and the strategies of
    :func:`hapnb.compare`) package a fixed strategy. ``name`` is recorded as ``options["baseline"]``.
    Raises :class:`~hapnb.synth.search.NoProgramError` (or ValueError for bad pins) when no program exists."""
    t0 = time.perf_counter()
    opts = dict(options or {})
    s = Search(th, c, ratios=ratios, pins=pins, options=opts)
    res = s.run(max_expansions=max_expansions)
    st = s.stats
    stats = {k: st[k] for k in ("expansions", "generated", "pruned_dominated", "pruned_bound")}
    stats["optimal"] = res.optimal
    plan = make_plan(
        th,
        c,
        res.program,
        s.final_conversions(),
        s.ratios,
        pins=parse_pins(pins),
        stats=stats,
        model=model,
        options={**opts, "baseline": name},
        synthesis_s=time.perf_counter() - t0,
    )
    return dataclasses.replace(plan, simulated_s=iteration_time(plan))


def _is_param(th: Theory, name: str) -> bool:
    return th.graph.tensor(name).role == "param"


def _size(n: float) -> str:
    """Bytes for people: ``_size(3 * 2**30) == '3.00 GiB'``, ``_size(5000) == '4.88 KiB'``."""
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 2**k:
            return f"{n / 2**k:.2f} {unit}"
    return f"{int(n)} B"


def _filling(pieces: Iterable[tuple[str, float]]) -> str:
    """What fills a device, largest first: ``_filling([("grads", 1024), ("acts", 0), ("weights", 2048)])
    == 'weights 2.00 KiB, grads 1.00 KiB'``."""
    return ", ".join(f"{k} {_size(v)}" for k, v in sorted(pieces, key=lambda kv: -kv[1]) if v)


_TO_FIT = (
    "To fit: a smaller batch (--batch) or sequence (--seq), fewer or narrower layers, devices with more memory, "
    "or more devices; pass check_memory=False to get a plan anyway."
)


def _check_memory(plan: Plan) -> None:
    bad = []
    worst = (0.0, -1)
    for j, (d, m) in enumerate(zip(plan.cluster.devices, plan.memory_bytes)):
        cap = d.memory_bytes / d.gpus
        if m > cap:
            bad.append(f"{d.name} needs {_size(m)} of {_size(cap)}")
            worst = max(worst, (m / cap, j))
    if bad:
        j = worst[1]
        fill = _filling(plan.memory_breakdown[j]) if plan.memory_breakdown else ""
        raise OutOfMemoryError(
            "the best plan does not fit in device memory: "
            + "; ".join(bad)
            + (f". On {plan.cluster.devices[j].name}: {fill}" if fill else "")
            + ". Pin parameters to be stored sharded (e.g. pins={'<weight>': hapnb.FullShard(0)}, ZeRO-3). "
            + _TO_FIT
        )


def out_of_memory(th: Theory, c: Cluster, pins: Mapping[str, Any] | None = None) -> OutOfMemoryError:
    """The error for "no program fits": the leaner of two programs at ratios proportional to memory (data
    parallel with every parameter stored sharded and gathered before each use, ZeRO-3 / FSDP; and the
    cheapest program ignoring memory), what it needs per device, the smallest uniform capacity that would
    hold it, and what fills the fullest device."""
    cm = CostModel(th, c)
    caps = [d.memory_bytes for d in c.devices]
    ratios = [x / sum(caps) for x in caps]
    lean = fsdp_pins(th, ratios, pins)
    head = "no program fits in device memory (the search pruned every candidate that does not fit)"
    tried = []
    for what, pins_, opts in (
        ("data parallel, every parameter stored sharded and gathered before each use: ZeRO-3 / FSDP", lean,
         {"sfb": False, "grouped": False}),
        ("the cheapest program ignoring memory", dict(pins or {}), {}),
    ):  # fmt: skip
        try:
            s = Search(th, c, ratios=ratios, pins=pins_, options=opts)
            # a diagnosis, not a plan: a short search (its dives complete a program) is enough to measure
            res = s.run(max_expansions=6_000)
        except (NoProgramError, ValueError):
            continue
        peak = cm.memory(res.program, s.final_conversions(), s.ratios)
        per = [m / (d.memory_bytes / d.gpus) for m, d in zip(peak, c.devices)]
        tried.append((max(per), what, res.program, s.final_conversions(), s.ratios, peak, per))
    if not tried:
        return OutOfMemoryError(f"{head}; no program could be built to measure what it needs. {_TO_FIT}")
    worst, what, prog, extra, r, peak, per = min(tried, key=lambda x: x[0])
    j = max(range(c.n), key=lambda k: (per[k], -k))
    d = c.devices[j]
    fill = _filling(cm.memory_breakdown(prog, extra, r)[j].items())
    top = "; ".join(f"{n}: {w} {_size(b)}" for n, w, b in largest_pieces(cm, prog, extra, r, j))
    over = [f"{dv.name} {_size(m)}" for dv, m in zip(c.devices, peak) if m > dv.memory_bytes / dv.gpus]
    need = ", ".join(over[:4]) + (f" and {len(over) - 4} more" if len(over) > 4 else "")
    return OutOfMemoryError(
        f"{head}. The leanest program hapnb tried ({what}; ratios proportional to memory) needs "
        f"{_size(peak[j])} on {d.name}, which has {_size(d.memory_bytes / d.gpus)}: every device would need "
        f"at least {worst:.2f}x its memory"
        + (f" (over: {need})" if need else "")
        + f". What fills {d.name}: {fill}. Largest: {top}. "
        + _TO_FIT,
        need=f"leanest program needs {_size(peak[j])} on {d.name} of {_size(d.memory_bytes / d.gpus)}, "
        f"{worst:.2f}x its memory",
    )


def _graph_of(
    model_or_graph: Any,
    cluster: Cluster,
    example_inputs: Sequence[Any] | None = None,
    loss: Any = None,
    timings: dict[str, Any] | None = None,
    **zoo: Any,
) -> tuple[Graph, dict[str, Any] | None]:
    if isinstance(model_or_graph, Theory):
        return model_or_graph.graph, None
    return resolve_model(model_or_graph, cluster, example_inputs, loss, timings, **zoo)
