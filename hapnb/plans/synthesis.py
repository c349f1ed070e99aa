"""Synthesis: the public entry points that turn a model and a cluster into :class:`~hapnb.plans.plan.Plan` values.

:func:`synthesize` resolves the model (a Graph, a Theory, an nn.Module with example inputs, a zoo name or
``package.module:factory``), runs the Q/B loop of :mod:`hapnb.synth.optimize`, packages the best program with
its ratios as a Plan and checks that it fits in memory. :func:`baselines` packages the data-parallel and
tensor-parallel programs under the same cost model, for comparison.

Every plan :func:`synthesize` returns carries the :class:`~hapnb.plans.planner.Planner` that made it
(``plan.planner``: the theory, the model spec, synthesize's arguments and the memo of searches, LPs and
simulated times), which re-plans and explains it (``plan.replan(...)``, :mod:`hapnb.plans.planner`).

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)
>>> plan.cost_s >= plan.lower_bound_s
True
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from ..cost.model import Step
from ..hardware.cluster import Cluster
from ..ir.graph import Graph
from ..synth.balance import solver_name
from ..synth.optimize import assign_segments, parse_pins, without_gc
from ..synth.search import NoProgramError, Search
from ..synth.seeds import baseline_specs, batch_replicated, data_parallel_program
from ..tracing import resolve_model
from ..triples import Theory, coverage, theory
from .fit import OutOfMemoryError, out_of_memory
from .packaging import make_plan
from .plan import Plan
from .planner import FINAL_CANDIDATES, Planner, even_batch_ratios
from .simulation import iteration_time

__all__ = [
    "synthesize",
    "baselines",
    "fixed_plan",
    "replan",
    "Planner",
    "OutOfMemoryError",
    "out_of_memory",
    "even_batch_ratios",
    "FINAL_CANDIDATES",
]


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
    return Planner(th, c, spec, args, traced).synthesize(pins, started=t0)


def replan(plan: Plan, *args: Any, **kw: Any) -> Plan:
    """``plan`` re-planned by its planner (:meth:`hapnb.plans.planner.Planner.replan`); a plan without one
    (loaded from JSON) gets :meth:`~hapnb.plans.planner.Planner.for_plan`'s, its model rebuilt once."""
    return Planner.for_plan(plan).replan(plan, *args, **kw)


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
) -> Baselines:
    """Data parallel with even (``dp_ev``) and throughput-proportional (``dp_cp``) ratios, and Megatron-style
    tensor parallel (``tp_ev``: the batch whole on every device, weights split by the search, even ratios;
    :func:`hapnb.synth.seeds.batch_replicated`), all under the
    same cost model. A baseline that cannot be built for this model is left out; the result's
    ``unavailable`` says which and why (:class:`Baselines`)."""
    c = cluster if isinstance(cluster, Cluster) else Cluster.resolve(cluster)
    graph, spec = _graph_of(model_or_graph, c, example_inputs, **zoo_options)
    th = model_or_graph if isinstance(model_or_graph, Theory) else theory(graph)
    out = Baselines()
    for name, pins, ratios, opts in baseline_specs(th, c, {}):
        try:
            space = batch_replicated(th) if name == "tp_ev" else th  # tensor parallel: the batch whole
            # data parallel, stopped at its budget: never worse than textbook data parallelism
            textbook = partial(data_parallel_program, th, c, pins, ratios, opts, max_expansions)
            out[name] = fixed_plan(
                space, c, pins, ratios, opts, name=name, model=spec, max_expansions=max_expansions,
                fallback=None if name == "tp_ev" else textbook,
            )  # fmt: skip
        except (NoProgramError, ValueError) as e:
            out.unavailable[name] = _unavailable(th, e)
    if "tp_ev" in out and not any(
        i.kind == "load" and i.form_value.kind == "G" and _is_param(th, i.tensor)
        for i in out["tp_ev"].program
    ):
        del out["tp_ev"]  # its best program splits no weight: tensor parallelism does not apply or pay
        out.unavailable["tp_ev"] = (
            "the best program found with the batch whole splits no weight: tensor parallelism does not apply "
            "or does not pay here"
        )
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
    fallback: Callable[[], Sequence[Step] | None] | None = None,
) -> Plan:
    """The plan of one A* search at fixed ``ratios`` (one row per segment; no LP) with form ``pins`` and
    search ``options``, with its simulated time: how :func:`baselines` (and the strategies of
    :func:`hapnb.compare`) package a fixed strategy. ``name`` is recorded as ``options["baseline"]``.
    ``fallback``: a program walked in (:meth:`~hapnb.synth.search.Search.seed`) where the search stops at its
    budget: the plan is then never costlier than it.
    Raises :class:`~hapnb.synth.search.NoProgramError` (or ValueError for bad pins) when no program exists."""
    t0 = time.perf_counter()
    opts = dict(options or {})
    s = Search(th, c, ratios=ratios, pins=pins, options=opts)
    res = s.run(max_expansions=max_expansions)
    if fallback is not None:
        res = s.fall_back(res, fallback)
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
