"""Ditto's planner end to end (:func:`pipeline`, ``hapnb.pipeline`` and ``hapnb pipeline``): layer costs
-> node folding -> homogeneous template -> DP (or greedy) recovery -> devices placed -> a
:class:`~hapnb.pipelines.plan.PipelinePlan`; optionally the exhaustive search as the reference.

Its ``iteration_s`` is the pipeline time model of :mod:`hapnb.pipelines.timing` on hapnb's cost model (the
same per-op computation and collective terms HAP's SPMD plans are priced with), so a pipeline and a
synthesized plan compare. ``planning_s`` counts folding, the template search and the recovery, not the
tracing and costing before them (reported as ``costs_s`` in ``plan.stats``), as Ditto's planning latency.

>>> p = pipeline("gpt", "2xV100+2xRTX3090", layers=4, hidden=32, heads=4, seq=8, vocab=64, batch=16)
>>> p.method, p.micro_batches, len(p.devices) <= 4, p.iteration_s > 0
('dp', 4, True, True)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..hardware.cluster import Cluster
from ..ir.graph import Graph
from .costs import LayerCosts, layer_costs, model_costs
from .exhaustive import ExhaustiveResult, exhaustive
from .folding import fold
from .plan import PipelinePlan, PipelineStage, _freeze
from .recovery import Recovered, dp_recovery, greedy_recovery, refine_cuts
from .template import homogeneous_template
from .timing import Pricer

__all__ = [
    "pipeline",
    "plan_pipeline",
    "NoPipelineError",
    "DEFAULT_MICRO_BATCH",
    "default_micro_batches",
    "METHODS",
    "runnable",
]

#: Samples per micro-batch when the number of micro-batches is not given (the smallest divisor of the
#: batch that is at least this).
DEFAULT_MICRO_BATCH = 4
#: Planners :func:`pipeline` can return: Ditto's DP recovery, its greedy recovery, the exhaustive search.
METHODS = ("dp", "greedy", "exhaustive")
#: The keywords of :func:`plan_pipeline` that :func:`pipeline` passes on (the rest are model options).
_PLANNING = ("schedule", "method", "exhaustive_search", "budget_s", "prune", "fold_comm", "refine")


class NoPipelineError(ValueError):
    """No pipeline of the model fits the cluster (memory), or the model cannot be cut."""


def default_micro_batches(batch: int) -> int:
    """Micro-batches for a batch: micro-batches of the smallest size >= :data:`DEFAULT_MICRO_BATCH`
    dividing the batch.

    >>> default_micro_batches(256), default_micro_batches(6), default_micro_batches(3)
    (64, 1, 1)
    """
    size = next(s for s in range(min(DEFAULT_MICRO_BATCH, batch), batch + 1) if batch % s == 0)
    return batch // size


def pipeline(
    model: Any,
    cluster: Cluster | str,
    *,
    layers: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    micro_batches: int | None = None,
    example_inputs: Sequence[Any] | None = None,
    loss: Any = None,
    seed: int = 0,
    **options: Any,
) -> PipelinePlan:
    """Plan a heterogeneous pipeline for ``model`` on ``cluster`` with Ditto (see the module docstring).

    ``model``: a zoo name (or :data:`~hapnb.pipelines.costs.MODEL_PRESETS` name such as ``"gpt2-xl"``),
    ``package.module:factory``, an ``nn.Module`` with ``example_inputs`` (one micro-batch), or a Graph
    traced at one micro-batch. ``batch``: the global batch (zoo default 32 per device), cut into
    ``micro_batches`` (default :func:`default_micro_batches`). ``options``: how to plan — the keywords of
    :func:`plan_pipeline` (``schedule``, ``method``, ``exhaustive_search``, ``budget_s``, ``prune``,
    ``fold_comm``, ``refine``) — and the rest the model's (zoo options such as ``hidden=64``).

    The plan always runs (:func:`runnable`). When the 1F1B pipeline has more stages than micro-batches,
    a zoo model with the default micro-batches also tries 1F1B with more of them (the smallest divisor of
    the batch at least the stages), and the default schedule (None) also GPipe; the fastest is returned and
    ``plan.stats["schedule_note"]`` says what was picked over what.
    """
    planning = {k: options.pop(k) for k in _PLANNING if k in options}
    if planning.get("method", "dp") not in METHODS:
        raise ValueError(f"method {planning['method']!r} is not one of {', '.join(METHODS)}")
    c = cluster if isinstance(cluster, Cluster) else Cluster.resolve(cluster)
    t0 = time.perf_counter()
    micro_batches_given = micro_batches
    costs, batch, micro_batches = _costs(
        model, c, layers, batch, seq, micro_batches, example_inputs, loss, seed, options
    )
    name = model if isinstance(model, str) else getattr(model, "name", type(model).__name__)
    kw = {**planning, "name": f"{name}@{c.name}", "costs_s": time.perf_counter() - t0}
    schedule = kw.pop("schedule", None)
    known = {micro_batches: costs}

    def costs_for(k: int) -> LayerCosts:  # a zoo model's costs at another micro-batch count
        if k not in known:
            known[k] = _zoo_costs(model, c, batch, k, layers, seq, seed, options)
        return known[k]

    # a zoo model with the default micro-batches may take more of them for 1F1B to run
    free = isinstance(model, str) and micro_batches_given is None
    return _pick_runnable(costs_for, c, micro_batches, schedule, batch if free else None, kw)


def plan_pipeline(
    costs: LayerCosts,
    c: Cluster,
    micro_batches: int,
    *,
    schedule: str | None = None,
    method: str = "dp",
    exhaustive_search: bool = False,
    budget_s: float | None = 60.0,
    prune: bool = True,
    fold_comm: bool = False,
    refine: bool = True,
    name: str = "pipeline",
    costs_s: float = 0.0,
) -> PipelinePlan:
    """:func:`pipeline` from layer costs already computed (one micro-batch of ``costs.micro_batch``).

    ``schedule``: ``"1F1B"``, ``"GPipe"``, or None (default): 1F1B where it runs, else GPipe. A plan
    always runs (:func:`runnable`): 1F1B needs at least as many micro-batches as stages, so when the 1F1B
    plan has more stages than ``micro_batches`` the default plans GPipe instead (``stats["schedule_note"]``
    says so), and an explicit ``"1F1B"`` raises :class:`NoPipelineError`.
    ``method``: the plan returned — ``"dp"`` (Ditto's DP recovery), ``"greedy"`` or ``"exhaustive"``.
    ``exhaustive_search=True`` also runs the exhaustive search (within ``budget_s`` seconds; ``prune``: its
    branch and bound) and fills ``exhaustive_iteration_s`` / ``exhaustive_planning_s``. ``fold_comm``:
    node folding with communication (§5.3.2). ``refine``: re-choose the recovered pipeline's cuts for its
    device groups (:func:`~hapnb.pipelines.recovery.refine_cuts`); ``plan.stats`` keeps the paper's
    recoveries' times (``dp_paper_iteration_s``, ``greedy_paper_iteration_s``) beside the result's. The
    greedy recovery runs when it is the method or the exhaustive search is asked for (to compare).
    """
    kw: dict[str, Any] = dict(method=method, exhaustive_search=exhaustive_search, budget_s=budget_s, prune=prune,
              fold_comm=fold_comm, refine=refine, name=name, costs_s=costs_s)  # fmt: skip
    return _pick_runnable(lambda _k: costs, c, micro_batches, schedule, None, kw)


def runnable(plan: PipelinePlan) -> bool:
    """Whether the plan's schedule runs as torch.distributed.pipelining runs it: GPipe always, 1F1B with at
    least as many micro-batches as stages."""
    return plan.schedule != "1F1B" or plan.micro_batches >= len(plan.stages)


def _pick_runnable(
    costs_for: Callable[[int], LayerCosts],
    c: Cluster,
    k: int,
    schedule: str | None,
    batch: int | None,
    kw: dict[str, Any],
) -> PipelinePlan:
    """The plan for ``k`` micro-batches under ``schedule`` when it runs (:func:`runnable`). A 1F1B plan with
    more stages than micro-batches does not: then the fastest of 1F1B with more micro-batches (when
    ``batch`` is given: the micro-batch count may change; the smallest divisor of it that is at least the
    stages) and, when ``schedule`` is None, GPipe with ``k``; ``stats["schedule_note"]`` says which."""
    first = _plan_fixed(costs_for(k), c, k, schedule or "1F1B", **kw)
    if runnable(first):
        return first
    S = len(first.stages)
    tried: list[str] = []
    options: list[PipelinePlan] = []
    if batch is not None:
        for k2 in [d for d in range(S, batch + 1) if batch % d == 0][:3]:
            try:
                more = _plan_fixed(costs_for(k2), c, k2, "1F1B", **kw)
            except NoPipelineError as e:
                tried.append(f"1F1B with {k2} micro-batches: {e}")
                continue
            if runnable(more):
                options.append(more)
                break
            tried.append(f"1F1B with {k2} micro-batches plans {len(more.stages)} stages")
    if schedule is None:
        try:
            options.append(_plan_fixed(costs_for(k), c, k, "GPipe", **kw))
        except NoPipelineError as e:
            tried.append(f"GPipe with {k} micro-batches: {e}")
    why = (
        f"{kw['name']}: the best 1F1B pipeline for {k} micro-batch{'es' * (k != 1)} has {S} stages, and 1F1B "
        f"needs at least as many micro-batches as stages"
    )
    if not options:
        if batch is None:
            fix = f"pass at least {S} micro-batches (micro_batches= / --micro-batches)"
        else:
            fix = f"use a batch with a divisor of at least {S} (its micro-batches)"
        if schedule == "1F1B":
            fix += ", or the GPipe schedule (schedule='GPipe' / --schedule GPipe)"
        done = "; ".join(tried) or f"the {k} micro-batches are fixed"
        raise NoPipelineError(f"{why} ({done}). Fix: {fix}")
    best = min(options, key=lambda p: p.iteration_s)
    picked = " over ".join(
        f"{p.schedule} with {p.micro_batches} micro-batches ({p.iteration_s * 1e3:.3f} ms)"
        for p in sorted(options, key=lambda p: p.iteration_s)
    )
    note = f"{why}; picked {picked}"
    return _with(best, search=_freeze({**best.stats, "schedule_note": note}))


def _plan_fixed(
    costs: LayerCosts,
    c: Cluster,
    micro_batches: int,
    schedule: str,
    *,
    method: str = "dp",
    exhaustive_search: bool = False,
    budget_s: float | None = 60.0,
    prune: bool = True,
    fold_comm: bool = False,
    refine: bool = True,
    name: str = "pipeline",
    costs_s: float = 0.0,
) -> PipelinePlan:
    """One planning run under ``schedule`` (see :func:`plan_pipeline`), runnable or not."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    batch = costs.micro_batch * micro_batches
    pricer = Pricer(costs, c, micro_batches, schedule)
    stats: dict[str, Any] = {"costs_s": costs_s, "costs_source": costs.source}

    t0 = time.perf_counter()
    folding = fold(costs, c, comm=fold_comm, micro_batches=micro_batches)
    fold_s = time.perf_counter() - t0
    S = folding.virtual_devices
    stats["fold"] = folding.to_json()
    results: dict[str, Recovered] = {}
    times: dict[str, float] = {}
    reasons = []
    bare = pricer.for_templates()  # virtual templates: no cross-node communication, no memory limit
    virtual = homogeneous_template(bare, min(S, pricer.L), (1,))
    if virtual is None:
        reasons.append("no template of one-device stages on the weakest devices fits in memory")
    else:
        stats["dp_template"] = {"stages": len(virtual.stages), "iteration_s": virtual.iteration_s}
        t0 = time.perf_counter()
        # Ditto's choices (at most one node per stage), then, when that is narrower, up to the
        # micro-batch's width (a stage across nodes, which the runtime runs as data parallel too)
        wide = any(min(k.per_node, k.count, pricer.b) < min(k.count, pricer.b) for k in pricer.classes)
        found: list[Recovered] = []
        for widest, key in [(None, "dp_paper")] + ([(pricer.b, "dp_wide")] if wide else []):
            bound = min((r.iteration_s for r in found), default=None)  # the wider space holds the narrower
            r = dp_recovery(pricer, folding, virtual, widest=widest, upper_bound=bound)
            if r is not None:
                stats[f"{key}_iteration_s"] = r.iteration_s
                found.append(refine_cuts(pricer, r) if refine else r)
        if found:
            results["dp"] = min(found, key=lambda r: r.iteration_s)
            times["dp"] = fold_s + virtual.planning_s + time.perf_counter() - t0
        else:
            reasons.append("no tiling of the virtual template fits in memory")
    weak = folding.weakest
    greedy = method == "greedy" or exhaustive_search  # the greedy recovery: asked for, or to compare
    best_template = (
        homogeneous_template(bare, S, range(1, min(weak.per_node, pricer.b) + 1)) if greedy else None
    )
    if greedy and best_template is None:
        reasons.append(
            f"the greedy recovery's homogeneous template search found no template (stages of 1.."
            f"{min(weak.per_node, pricer.b)} devices of the weakest kind) with a unit for every stage that fits "
            "in memory; method='dp' plans without one"
        )
    if best_template is not None:
        stats["greedy_template"] = {
            "stages": len(best_template.stages),
            "widths": [g for _, _, g in best_template.stages],
            "iteration_s": best_template.iteration_s,
        }
        t0 = time.perf_counter()
        gr = greedy_recovery(pricer, folding, best_template)
        if gr is None:
            reasons.append(
                "the greedy recovery could not place the template's stages on the cluster's devices"
            )
        else:
            stats["greedy_paper_iteration_s"] = gr.iteration_s
            results["greedy"] = refine_cuts(pricer, gr) if refine else gr
            times["greedy"] = fold_s + best_template.planning_s + time.perf_counter() - t0
    for k, r in results.items():
        stats[f"{k}_iteration_s"] = r.iteration_s
        stats[f"{k}_planning_s"] = times[k]
        if r.note:
            stats[f"{k}_note"] = r.note
    ex: ExhaustiveResult | None = None
    if exhaustive_search or method == "exhaustive":
        bound = min((r.iteration_s for r in results.values()), default=None)
        ex = exhaustive(pricer, budget_s=budget_s, upper_bound=bound, prune=prune)
        stats["exhaustive"] = ex.to_json()
        if ex.stages:
            results["exhaustive"] = Recovered(ex.stages, ex.iteration_s, "exhaustive", ex.planning_s)
            times["exhaustive"] = ex.planning_s
        elif ex.finished and bound is not None:  # nothing beats the bound: the known plan is optimal
            stats["exhaustive"]["iteration_s"] = bound
    chosen = results.get(method)
    if chosen is None and method == "exhaustive" and ex is not None and ex.finished and results:
        chosen = min(results.values(), key=lambda r: r.iteration_s)
        times["exhaustive"] = ex.planning_s
    if chosen is None:
        raise NoPipelineError(_no_plan_message(name, c, pricer, method, reasons, ex))
    plan = _plan(name, c, costs, pricer, chosen, batch, micro_batches, schedule)
    if ex is not None:
        exh_t = stats["exhaustive"]["iteration_s"]
        plan = _with(plan, exhaustive_iteration_s=exh_t, exhaustive_planning_s=ex.planning_s)
    lab = pricer.evaluate(chosen.stages)
    assert lab is not None
    t1, t2, t3 = pricer.parts(lab)
    stats.update(t1_s=t1, t2_s=t2, t3_s=t3)
    # what PipelinePlan.timeline() replays: each boundary's transfer per micro-batch and each stage's
    # once-per-iteration tail (gradient all-reduce + optimizer step); its replay is stats["simulated_s"]
    priced = [st for a, b, counts in chosen.stages if (st := pricer.stage(a, b, counts)) is not None]
    stats.update(boundary_s=[st.link for st in priced[:-1]], tail_s=[st.A for st in priced])
    plan = _with(plan, planning_s=times[method], method=method, search=_freeze(stats))
    return _with(plan, search=_freeze({**stats, "simulated_s": plan.timeline().iteration_s}))


def _with(plan: PipelinePlan, **changes: Any) -> PipelinePlan:
    return dataclasses.replace(plan, **changes)


def _costs(
    model: Any,
    c: Cluster,
    layers: int | None,
    batch: int | None,
    seq: int | None,
    micro_batches: int | None,
    example_inputs: Sequence[Any] | None,
    loss: Any,
    seed: int,
    options: dict[str, Any],
) -> tuple[LayerCosts, int, int]:
    if isinstance(model, str):
        batch = batch if batch is not None else 32 * c.n
        k = micro_batches if micro_batches is not None else default_micro_batches(batch)
        if k < 1 or batch % k:
            raise ValueError(
                f"batch {batch} does not split into {k} equal micro-batches; choose --micro-batches dividing it"
            )
        return _zoo_costs(model, c, batch, k, layers, seq, seed, options), batch, k
    if isinstance(model, Graph):
        g = model
    else:
        if example_inputs is None:
            raise ValueError(
                "pipeline(model, ...) needs example_inputs=(...) (one micro-batch) to trace an nn.Module; "
                "or pass a zoo name such as 'gpt', or a Graph from hapnb.trace"
            )
        from ..tracing import trace

        g = trace(model, tuple(example_inputs), loss=loss)
    lc = layer_costs(g, c)
    k = micro_batches if micro_batches is not None else 1
    return lc, lc.micro_batch * k, k


def _zoo_costs(
    model: str,
    c: Cluster,
    batch: int,
    k: int,
    layers: int | None,
    seq: int | None,
    seed: int,
    options: dict[str, Any],
) -> LayerCosts:
    """The layer costs of a zoo (or preset) model at ``batch`` cut into ``k`` micro-batches."""
    opts = dict(options)
    for key, v in (("layers", layers), ("seq", seq)):
        if v is not None:
            opts[key] = v
    return model_costs(model, c, micro_batch=batch // k, batch=batch, seed=seed, **opts)


def _place(pricer: Pricer, stages: Sequence[tuple[int, int, tuple[int, ...]]]) -> list[list[str]]:
    """Device names for each stage's devices per class: a stage's devices of one class from one machine
    when one has room (the fullest such machine), else from the machines with the most room."""
    c = pricer.cluster
    free: dict[str, list[str]] = {}
    for d in c.devices:
        free.setdefault(d.machine, []).append(d.name)
    out = []
    for _, _, counts in stages:
        names: list[str] = []
        for cls, x in zip(pricer.classes, counts):
            want = set(cls.devices)
            while x > 0:
                room = [(m, [n for n in ns if n in want]) for m, ns in free.items()]
                room = [(m, ns) for m, ns in room if ns]
                fit = [r for r in room if len(r[1]) >= x]
                m, ns = min(fit, key=lambda r: len(r[1])) if fit else max(room, key=lambda r: len(r[1]))
                take = ns[:x]
                names += take
                free[m] = [n for n in free[m] if n not in take]
                x -= len(take)
        out.append(names)
    return out


def _plan(
    name: str,
    c: Cluster,
    costs: LayerCosts,
    pricer: Pricer,
    rec: Recovered,
    batch: int,
    micro_batches: int,
    schedule: str,
) -> PipelinePlan:
    placed = _place(pricer, rec.stages)
    S = len(rec.stages)
    stages = []
    for k, ((a, b, counts), names) in enumerate(zip(rec.stages, placed)):
        st = pricer.stage(a, b, counts)
        assert st is not None
        samples = [s for per in st.samples for s in per]
        inflight = pricer.inflight(S - 1 - k)
        stages.append(
            PipelineStage(
                index=k,
                units=(a, b),
                devices=tuple(names),
                shares=tuple(s / costs.micro_batch for s in samples),
                forward_s=st.F,
                backward_s=st.B,
                memory_bytes=tuple(int(base + inflight * per) for base, per in st.memory),
            )
        )
    return PipelinePlan(
        name=name,
        model=_freeze(costs.model or {}),
        cluster=c,
        units=costs.names,
        stages=tuple(stages),
        schedule=schedule,
        micro_batches=micro_batches,
        batch=batch,
        iteration_s=rec.iteration_s,
        method=rec.method,
    )


def _no_plan_message(
    name: str, c: Cluster, pricer: Pricer, method: str, reasons: list[str], ex: ExhaustiveResult | None
) -> str:
    if method == "exhaustive" and ex is not None and not ex.finished:
        return (
            f"the exhaustive search for {name} found no pipeline within its {ex.planning_s:.0f} s "
            f"budget (stopped at unit {ex.stopped_at}); raise the budget or use method='dp'"
        )
    strongest = len(pricer.classes) - 1
    whole = [(0, pricer.L, pricer.counts(strongest, min(pricer.classes[-1].count, pricer.b)))]
    why = pricer.why_infeasible(whole)
    return (
        f"no {method} pipeline fits for {name}: {'; '.join(reasons) or 'no plan'}"
        + (f" (e.g. {why})" if why else "")
        + ". Use more micro-batches (smaller ones hold less), GPipe -> 1F1B, or devices with more memory."
    )


def plan_json_summary(plan: PipelinePlan) -> dict[str, Any]:
    """The ``hapnb pipeline --json`` object of a plan."""
    st = plan.stats
    out: dict[str, Any] = {
        "iteration_s": plan.iteration_s,
        "planning_s": plan.planning_s,
        "method": plan.method,
        "schedule": plan.schedule,
        "micro_batches": plan.micro_batches,
        "micro_batch_size": plan.micro_batch_size,
        "batch": plan.batch,
        "units": len(plan.units),
        "stages": [
            {
                "index": s.index,
                "units": list(s.units),
                "first": plan.units[s.units[0]],
                "last": plan.units[s.units[1] - 1],
                "layers": s.units[1] - s.units[0],
                "devices": list(s.devices),
                "shares": list(s.shares),
                "micro_batches": plan.micro_batches,
                "forward_s": s.forward_s,
                "backward_s": s.backward_s,
                "memory_bytes": list(s.memory_bytes),
            }
            for s in plan.stages
        ],
        "devices": list(plan.devices),
        "costs_s": st.get("costs_s"),
        "dp_iteration_s": st.get("dp_iteration_s"),
        "greedy_iteration_s": st.get("greedy_iteration_s"),
        "fold": st.get("fold"),
        "simulated_s": st.get("simulated_s"),
        "schedule_note": st.get("schedule_note"),  # why the schedule or micro-batches differ from the asked
    }
    if plan.exhaustive_planning_s is not None:
        out["exhaustive_iteration_s"] = plan.exhaustive_iteration_s
        out["exhaustive_planning_s"] = plan.exhaustive_planning_s
        out["exhaustive"] = st.get("exhaustive")
    for k, v in out.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
    return out
