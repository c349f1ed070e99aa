"""The Planner: one object that owns a model's theory, synthesize's arguments and every cache, and makes,
re-plans and explains its plans.

A :class:`Planner` holds the traced program (``theory``, segmented), the cluster it was made for, how to
rebuild the model (``spec``), synthesize's arguments (``args``: ratio pins or fixed ratios, search options,
budgets, the objective ``duplex``, ``pick``, ``check_memory``) and a :class:`~hapnb.synth.memo.Memo`
of every search, LP, simulation and sensitivity computed so far. Every plan it makes carries it
(``plan.planner``), so ``plan.replan(...)`` / ``plan.why_not(...)`` / ``plan.sensitivity()`` are
``planner.replan(plan, ...)`` & co. A re-plan with other pins, ratio pins or cluster runs the same steps on
the merged inputs and takes every result whose inputs did not change from the memo, so it returns exactly
the plan a fresh :func:`hapnb.synthesize` would (timings aside); ``exact=False`` starts the Q/B loop from
the plan's own ratios without the baseline seeds instead (faster; a fixpoint of the loop).

A plan loaded from JSON is data and carries no planner: :meth:`Planner.for_plan` rebuilds its model once
from the recorded spec.

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=32, input=16, batch=8)
>>> planner = plan.planner
>>> planner.replan(plan, pins={"x": "I"}).form_of("x")
['I']
>>> planner.objective
'stage'
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..cost.model import CostModel
from ..hardware.cluster import Cluster
from ..synth.duplex import duplex_cost
from ..synth.memo import Memo
from ..synth.optimize import (
    Candidate,
    Optimum,
    assign_segments,
    keeps_ratio_pins,
    optimize,
    parse_pins,
    proven_gap,
    without_gc,
)
from ..synth.search import NoProgramError
from ..triples import Theory, theory
from . import explain, whynot
from .fit import check_memory, out_of_memory
from .packaging import make_plan
from .plan import Plan, freeze_mapping
from .simulation import iteration_lower_bound, iteration_time

__all__ = ["Planner", "DEFAULT_ARGS", "FINAL_CANDIDATES", "even_batch_ratios", "program_lower_bound"]

#: how many of the Q/B loop's candidates (best cost first) the overlap simulator compares for the final pick
FINAL_CANDIDATES = 8

#: synthesize's keyword arguments and their defaults (what a planner for a loaded plan assumes for those the
#: plan does not record)
DEFAULT_ARGS: Mapping[str, Any] = dict(
    ratios=None, options={}, max_iterations=10, max_expansions=30_000, max_seconds=None, seed_baselines=True,
    check_memory=True, progress=False, duplex=False, pick="simulated", segments="none",
)  # fmt: skip


class Planner:
    """What plans are made from, and every cache that making them fills (not a value: it caches).

    ``theory`` (the traced program, segmented), ``cluster`` (the default for :meth:`synthesize`), ``spec``
    (how to rebuild the model, or None), ``args`` (synthesize's keyword arguments, see
    :data:`DEFAULT_ARGS`), ``traced`` (how the graph was made: zoo models' build_s, trace_s, trace_path)
    and ``memo`` (:class:`~hapnb.synth.memo.Memo`: searches, LPs, simulated times, packaged plans and
    sensitivities computed so far)."""

    def __init__(
        self,
        theory: Theory,
        cluster: Cluster,
        spec: Mapping[str, Any] | None = None,
        args: Mapping[str, Any] | None = None,
        traced: Mapping[str, Any] | None = None,
        memo: Memo | None = None,
    ) -> None:
        unknown = sorted(set(args or {}) - set(DEFAULT_ARGS))
        if unknown:
            raise TypeError(f"Planner: unknown synthesize argument(s) {', '.join(unknown)}")
        if (args or {}).get("pick", "simulated") not in ("simulated", "cost"):
            raise ValueError(f"pick must be 'simulated' or 'cost', got {args['pick']!r}")  # type: ignore[index]
        self.theory = theory
        self.cluster = cluster
        self.spec = dict(spec) if spec else None
        self.args = {**DEFAULT_ARGS, **(args or {})}
        self.args["options"] = dict(self.args["options"] or {})
        self.traced = dict(traced or {})
        self.memo = memo if memo is not None else Memo()

    @property
    def objective(self) -> str:
        """What the search and the LP minimise: ``"stage"`` (the stage model's time) or ``"duplex"``
        (HiDup's duplex time, :mod:`hapnb.synth.duplex`)."""
        return "duplex" if self.args["duplex"] else "stage"

    def __repr__(self) -> str:
        return f"Planner({self.theory.graph.name} on {self.cluster.name}, {self.objective}, {self.memo!r})"

    # ------------------------------------------------------------------ making planners
    @classmethod
    def for_plan(cls, plan: Plan) -> Planner:
        """The plan's own planner, or for a plan without one (loaded from JSON, or made by
        :func:`~hapnb.plans.packaging.make_plan` directly) a new one: the graph is the plan's own or its model
        rebuilt from the recorded spec, synthesize's arguments those the plan records (pins, ratio pins,
        options, segments, duplex, pick) and the defaults for the rest."""
        if plan.planner is not None:
            return plan.planner
        graph = plan.graph if plan.graph is not None else explain.rebuild_graph(plan)
        opts = dict(plan.options)
        label = opts.get("segments", "none")
        if label not in ("none", "layer"):
            raise ValueError(
                f"plan {plan.name!r} was made with custom ratio segments ({label}), which its JSON does not "
                "record: synthesize it again with the same segments= to re-plan it"
            )
        th = theory(graph if label == "none" else assign_segments(graph, "layer"))
        args = dict(
            ratios={d: (lo, hi) for d, lo, hi in plan.ratio_pins} or None,
            options={k: v for k, v in opts.items() if isinstance(v, bool)},
            duplex=plan.duplex,
            pick=plan.stats.get("pick", "simulated"),
            segments=label,
        )
        return cls(th, plan.cluster, plan.model_spec, args)

    def derived(self, **args: Any) -> Planner:
        """A planner with other synthesize arguments that shares this one's theory and memo (every memo key
        names all that a result depends on, so the memo stays valid)."""
        if not args or {**self.args, **args} == self.args:
            return self
        return Planner(self.theory, self.cluster, self.spec, {**self.args, **args}, self.traced, self.memo)

    # ------------------------------------------------------------------ plans
    @without_gc
    def synthesize(
        self,
        pins: Mapping[str, Any] | None = None,
        cluster: Cluster | None = None,
        *,
        started: float | None = None,
    ) -> Plan:
        """The plan for ``pins`` (tensor -> form or storage) on ``cluster`` (default: the planner's): the Q/B
        loop's best program and ratios, picked as ``args["pick"]`` says, memory checked
        (``args["check_memory"]``). ``started``: when the synthesis began (``time.perf_counter()``), for
        ``plan.synthesis_s``."""
        return self._synthesize(self.cluster if cluster is None else cluster, pins, started)

    @without_gc
    def replan(
        self,
        plan: Plan,
        pins: Mapping[str, Any] | None = None,
        ratio_pins: Mapping[str, Any] | None = None,
        cluster: Cluster | str | None = None,
        *,
        exact: bool = True,
        **overrides: Any,
    ) -> Plan:
        """``plan`` re-planned with its pins, ratio pins or cluster changed, reusing every search, LP and
        simulation whose inputs did not change (this planner's memo).

        ``pins``: tensor -> form or parameter storage (``"zero3(0)"``, :class:`~hapnb.ir.forms.FullShard`),
        merged into the plan's pins (``None`` or ``"auto"`` removes a pin); ``ratio_pins``: device -> ratio
        or ``(lo, hi)``, merged into the plan's ratio pins (``None`` removes one); ``cluster``: another
        cluster (object, preset, JSON path or inline spec): ratio pins of devices it lacks are dropped.
        ``overrides``: other synthesize arguments to change (e.g. ``check_memory=False``,
        ``max_iterations=3``).

        ``exact=True`` (default): the result equals ``synthesize(model, cluster, pins=merged pins,
        ratios=merged ratio pins, ...)`` with the plan's other arguments, timings aside.

        ``exact=False`` (fast; what the Explorer and :class:`~hapnb.session.Session` use): the Q/B loop starts
        from the plan's own ratios (moved into the merged ratio pins; throughput-proportional ones when the
        cluster has another number of devices) instead of the default start, the baseline seeds are skipped
        (their job is escaping a bad start), and the plan is the loop's optimum whatever ``pick`` says (it
        is simulated, ``simulated_s``, but no other candidate is). The result satisfies every pin and ratio
        pin and is a fixpoint of the loop (unless ``max_iterations`` rounds ran out): no program is cheaper
        than its program at its ratios (the A* at its ratios finds none; proven when ``stats["optimal"]``),
        and the ratio LP for its program finds no cheaper ratios than its own. It may differ from a fresh
        synthesize: another fixpoint, reached from the old ratios, or (``pick="simulated"``) a baseline's
        program that the fresh pick simulates faster. ``plan.stats["replan"] == "fast"`` marks such a plan.
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
        unknown = sorted(set(overrides) - set(self.args))
        if unknown:
            raise TypeError(f"replan: unknown synthesize argument(s) {', '.join(unknown)}")
        c = plan.cluster if cluster is None else Cluster.resolve(cluster)
        merged_pins = dict(plan.pins)
        for k, v in (pins or {}).items():
            if v is None or v == "auto":
                merged_pins.pop(k, None)
            else:
                merged_pins[k] = v
        args = {**self.args, **overrides}
        fixed = args["ratios"] is not None and not isinstance(args["ratios"], Mapping)
        if fixed and (ratio_pins or (cluster is not None and c.n != plan.cluster.n)):
            raise ValueError(
                f"plan {plan.name!r} was made with fixed ratios (ratios=[...]), so it has no ratio pins to "
                "change and no ratios for another number of devices: pass ratios=... (a mapping of ratio "
                "pins, or None for the LP) to replan"
            )
        if not fixed and "ratios" not in overrides:
            # the plan's ratio pins on devices the cluster still has, then the asked ones (checked by name)
            rp: dict[str, Any] = {d: (lo, hi) for d, lo, hi in plan.ratio_pins if d in c.names}
            for k, v in (ratio_pins or {}).items():
                if v is None:
                    rp.pop(k, None)
                else:
                    rp[k] = v
            args["ratios"] = rp or None
        out = self.derived(**args)._synthesize(c, merged_pins, t0, start=None if exact else plan.ratios)
        if plan.model and not self.spec:
            out = dataclasses.replace(out, model=plan.model)  # the model spec a session recorded
        return out

    def why_not(self, plan: Plan, pins: Mapping[str, Any]) -> whynot.WhyNot:
        """Why the search did not choose ``pins`` for ``plan`` (:func:`hapnb.plans.whynot.why_not`)."""
        return whynot.why_not(plan, pins, planner=self)

    def sensitivity(self, plan: Plan, factor: float = 1.1) -> explain.Sensitivity:
        """What bounds ``plan``'s step (:func:`hapnb.plans.explain.sensitivity`), kept in the memo."""
        return explain.sensitivity(plan, factor, planner=self)

    def known_sensitivity(self, plan: Plan, factor: float = 1.1) -> explain.Sensitivity | None:
        """:meth:`sensitivity` if computed before, else None (never solves: what displays call)."""
        return self.memo.peek("sensitivity", explain.sensitivity_key(plan, factor, self.args))

    # ------------------------------------------------------------------ the steps
    def _synthesize(
        self,
        c: Cluster,
        pins: Mapping[str, Any] | None,
        t0: float | None,
        start: tuple[tuple[float, ...], ...] | None = None,
    ) -> Plan:
        """The Q/B loop on the planner's theory and arguments, the final pick and the memory check.
        ``start``: a fast re-plan's warm start (the Q/B loop from these ratios, no baseline seeds)."""
        t0 = time.perf_counter() if t0 is None else t0
        a, th = self.args, self.theory
        form_pins = parse_pins(pins)
        try:
            best = optimize(
                th, c, form_pins, a["ratios"], options=a["options"], max_iterations=a["max_iterations"],
                max_expansions=a["max_expansions"], max_seconds=a["max_seconds"],
                seed_baselines=a["seed_baselines"] and start is None, progress=a["progress"],
                duplex=a["duplex"], memo=self.memo, memory=a["check_memory"], start=start,
            )  # fmt: skip
        except NoProgramError as e:
            if a["check_memory"] and "memory" in str(e):
                raise out_of_memory(th, c, form_pins) from e
            raise
        pick = _Pick(self, c, best, form_pins)
        chosen, k, stats = pick.final(fast=start is not None)
        if start is not None:
            stats["replan"] = "fast"  # a fixpoint of the Q/B loop from the previous plan's ratios
        if a["duplex"] and not isinstance(a["ratios"], Sequence):
            # two micro-batches need an even local batch on every rank: cut the batch in pairs of samples
            even = even_batch_ratios(
                k.ratios, th.graph.tensors[th.graph.inputs[0]].shape[0] if th.graph.inputs else 0
            )
            if even != k.ratios and keeps_ratio_pins(even, best.ratio_pins, c.names):
                cost = duplex_cost(pick.cost_model(), k.program, even)
                chosen = pick.package(dataclasses.replace(k, ratios=even, cost_s=cost), best.stats)
                stats["ratios_even_batch"] = True
        plan = dataclasses.replace(
            chosen, search=freeze_mapping(stats), synthesis_s=time.perf_counter() - t0, planner=self
        )
        if a["check_memory"]:
            check_memory(plan)
        return plan


class _Pick:
    """The final pick among the Q/B loop's candidates: each packaged as a plan and simulated (memoised on
    everything the plan depends on), the fastest simulated wins (``pick="simulated"``), or the loop's own
    optimum (``pick="cost"``, and fast re-plans)."""

    def __init__(self, planner: Planner, c: Cluster, best: Optimum, form_pins: Mapping[str, Any]) -> None:
        self.planner, self.c, self.best, self.form_pins = planner, c, best, form_pins
        self.token = planner.memo.token(c)
        self.frozen_pins = freeze_mapping({k: str(v) for k, v in form_pins.items()})

    def cost_model(self) -> CostModel:
        """One cost model (and its caches) for the Q/B loop and every candidate's bound and plan."""
        return self.planner.memo.cost_model(self.planner.theory, self.c)

    def package(self, k: Candidate, stats: Mapping[str, Any], simulated_s: float | None = None) -> Plan:
        """The candidate as a Plan with its simulated time."""
        p, a, best = self.planner, self.planner.args, self.best

        def make() -> Plan:
            plan = make_plan(
                p.theory, self.c, k.program, k.extra, k.ratios, history=best.history, pins=self.form_pins,
                ratio_pins=best.ratio_pins, stats=stats, model=p.spec,
                options={**a["options"], "segments": a["segments"]}, cost_model=self.cost_model(),
            )  # fmt: skip
            if a["duplex"]:
                plan = dataclasses.replace(plan, duplex=True, cost_s=k.cost_s)
            sim = iteration_time(plan) if simulated_s is None else simulated_s
            return dataclasses.replace(plan, simulated_s=sim)

        key = (self.token, k, a["duplex"], best.history, best.ratio_pins, self.frozen_pins,
               freeze_mapping(stats), a["segments"], freeze_mapping(a["options"]), freeze_mapping(p.spec))  # fmt: skip
        return p.memo.get("plan", key, make)

    def _sim_key(self, k: Candidate) -> Any:
        return (self.token, k.program, k.extra, k.ratios, k.cost_s, self.planner.args["duplex"])

    def simulated(self, k: Candidate) -> tuple[float, Plan | None]:
        """The candidate's simulated time (from the memo when simulated before) and its plan if made now."""
        made: list[Plan] = []

        def run() -> float:
            made.append(self.package(k, self.best.stats))
            return made[0].simulated_s  # type: ignore[return-value]

        return self.planner.memo.get("simulate", self._sim_key(k), run), (made[0] if made else None)

    def final(self, fast: bool) -> tuple[Plan, Candidate, dict[str, Any]]:
        """The final program: the loop's optimum (``pick="cost"``, or a fast re-plan), or the candidate the
        overlap simulator finds fastest (ties: the lower cost_s) among the cheapest searched ones and every
        baseline's. Returns the plan, the candidate it was made of and its stats."""
        best, a = self.best, self.planner.args
        own = Candidate(best.cost_s, best.program, best.extra, best.ratios, 0)
        if a["pick"] == "cost" or not best.candidates or fast:
            top: list[Candidate] = [own]  # a fast re-plan: the loop's fixpoint (simulated, not picked)
        else:
            searched = [k for k in best.candidates if k.source == "search"]
            # the cheapest searched ones, those that are also a baseline's program, and every baseline's
            top = [k for n, k in enumerate(searched) if n < FINAL_CANDIDATES or k.baseline]
            top += [k for k in best.candidates if k.source != "search"]
        # candidates simulated before cost nothing; the others are simulated cheapest lower bound first, and
        # one whose bound is above the fastest simulated so far is skipped: it can be neither the min nor a tie
        memo, duplex = self.planner.memo, a["duplex"]
        known = [memo.peek("simulate", self._sim_key(k)) for k in top]
        bounds = [
            v if v is not None else program_lower_bound(self.cost_model(), k.program, k.ratios, duplex)
            if len(top) > 1 else 0.0
            for k, v in zip(top, known)
        ]  # fmt: skip
        sims: dict[int, tuple[float, Plan | None]] = {}
        fastest = float("inf")
        for i in sorted(range(len(top)), key=lambda i: (known[i] is None, bounds[i], i)):
            if known[i] is None and bounds[i] * (1 - 1e-9) > fastest:
                continue
            sims[i] = self.simulated(top[i])
            fastest = min(fastest, sims[i][0])
        i = min(sims, key=lambda i: (sims[i][0], top[i].cost_s, i))
        chosen = sims[i][1] or self.package(top[i], best.stats, sims[i][0])
        # chosen: where the final program came from ("search", or e.g. "baseline dp_cp" when the simulator
        # prefers a baseline's program at its own ratios); cost_rank: its place by cost_s among the candidates;
        # candidates_bounded: those not simulated, their lower bound above the fastest simulated time
        stats = {**best.stats, "candidates_simulated": len(sims), "candidates_bounded": len(top) - len(sims),
                 "chosen": top[i].source, "cost_rank": i, "pick": a["pick"], **self.planner.traced}  # fmt: skip
        stats["gap"] = proven_gap(chosen.cost_s, stats)  # against the picked program's own cost
        return chosen, top[i], stats


def program_lower_bound(cm: CostModel, program: Sequence[Any], ratios: Any, duplex: bool = False) -> float:
    """:func:`hapnb.plans.simulation.iteration_lower_bound` of the plan :func:`make_plan` would make of
    ``program`` at ``ratios``, priced as it prices the plan's instructions (a load, a conversion, a
    computation each), without making the plan."""
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
