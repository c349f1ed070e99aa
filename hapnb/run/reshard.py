"""Live re-balancing inside a running rank (issue 21): telemetry windows, the decision, and the reshard.

:class:`Trainer` holds what one rank trains with (program, module, optimizer, local batch, gradient
buckets); :class:`LiveRebalancer` is called at the end of every step. Every ``every`` steps it gathers the
window's telemetry (:mod:`hapnb.run.telemetry`), fits the devices' and links' speeds and counts departures
(:mod:`hapnb.run.rebalance`, :mod:`hapnb.run.linkfit`); every rank computes the same fit from the same
gathered table. When a straggler or a slow link is detected, rank 0 re-solves the ratios (and re-plans the
program) and decides, broadcasts the verdict (and the new plan's JSON) to every rank, and every rank then
reshards at this step boundary:

1. every parameter and buffer, and every optimizer state tensor shaped like its parameter (Adam's moments,
   SGD's momentum), is all-gathered to its full tensor with the uneven collectives
   (:func:`hapnb.runtime.collectives.all_gather`); scalar state (Adam's step) is kept;
2. this rank's program for the new plan is generated (:func:`hapnb.runtime.codegen.generate`);
3. its weights, its optimizer state and its share of the global batch are sliced from the full tensors.

The new plan may be another program (:func:`hapnb.run.rebalance.propose`'s second option: the planner's on
the measured cluster), with other forms for the same parameters (replicated in one, sharded in the other):
the same three steps move it, since the full tensors are named by the model and step 3 slices them by the
new program's forms; the gradient buckets are rebuilt for the new program's replicated parameters. Rank 0
makes the decision (the ratio LP and the planner run there once) and broadcasts it, so every rank takes the
same one. The global batch is unchanged, only its split, so the training math is the same. The rank prints a
``reshard`` phase heartbeat first: a rank that dies while resharding is named by the supervisor's error as
failing during the reshard.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..runtime.random_stream import continue_stream
from .linkfit import LinkDetector, fit_links
from .rebalance import Detector, RebalanceOptions, fit_speeds, pool, predicted_compute, propose, variable
from .telemetry import CollectiveClock, Window, table

__all__ = ["Trainer", "LiveRebalancer", "full_state", "load_state"]


@dataclass
class Trainer:
    """What a rank trains with; replaced as a whole by a reshard."""

    plan: Any
    prog: Any
    module: Any
    opt: Any
    batch: Any  # the local inputs (a duplex plan: its two micro-batches)
    buckets: Any = None
    runner: Any = None  # a duplex plan's runner of the two micro-batches
    scale: float = 1.0  # a duplex plan's loss scale


def _tensors(module: Any) -> dict[str, Any]:
    state = dict(module.named_parameters())
    state.update(dict(module.named_buffers()))
    return state


def _full(t: Any, lp: Any) -> Any:
    from ..runtime import collectives as C

    x = t.detach()
    if not lp.sharded:
        return x.clone()
    where = f"the live reshard (the all-gather of {lp.name} to its full tensor)"
    return C.all_gather(x.contiguous(), lp.dim, lp.lengths, where=where).detach()


def full_state(prog: Any, module: Any, opt: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Every weight's full tensor by model name, and each parameter's optimizer state with every tensor
    shaped like the parameter made full (collective: every rank must call it at the same point)."""
    import torch

    tensors = _tensors(module)
    weights: dict[str, Any] = {}
    states: dict[str, dict[str, Any]] = {}
    _check_same_state(prog, tensors, opt)
    with torch.no_grad():
        for lp in prog.unique_params:
            if lp.kind == "const" or lp.local_name not in tensors:
                continue
            t = tensors[lp.local_name]
            weights[lp.name] = _full(t, lp)
            st = opt.state.get(t) if isinstance(t, torch.nn.Parameter) else None
            if st:
                states[lp.name] = {
                    k: _full(v, lp) if torch.is_tensor(v) and v.shape == t.shape and v.dim() > 0 else v
                    for k, v in sorted(st.items())
                }
    return weights, states


def _check_same_state(prog: Any, tensors: Mapping[str, Any], opt: Any) -> None:
    """Every rank holds optimizer state for the same parameters (else the gathers would not pair up): a
    clear error naming the parameters when they differ."""
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    names = [lp.name for lp in prog.unique_params if lp.local_name in tensors and lp.kind != "const"]
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    counts = [float(len(opt.state.get(tensors[prog.param(n).local_name], {}))) for n in names]
    have = torch.tensor(counts, dtype=torch.float64, device=device)
    lo, hi = have.clone(), have.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    odd = [n for n, a, b in zip(names, lo.tolist(), hi.tolist()) if a != b]
    if odd:
        raise RuntimeError(
            f"rank {dist.get_rank()}: cannot reshard live: the ranks hold optimizer state for different "
            f"parameters ({', '.join(odd[:5])}: a parameter without a gradient on some rank); launch without "
            "--rebalance"
        )


def load_state(
    prog: Any, module: Any, opt: Any, weights: Mapping[str, Any], states: Mapping[str, Any]
) -> None:
    """Slice ``weights`` and optimizer ``states`` (from :func:`full_state`) into ``prog``'s module and
    ``opt`` (a fresh optimizer over its parameters)."""
    import torch

    tensors = _tensors(module)
    with torch.no_grad():
        for lp in prog.unique_params:
            if lp.name not in weights or lp.local_name not in tensors:
                continue
            t = tensors[lp.local_name]
            t.copy_(lp.take(weights[lp.name]))
            if lp.name in states and isinstance(t, torch.nn.Parameter):
                full_shape = tuple(weights[lp.name].shape)
                opt.state[t] = {
                    k: lp.take(v).clone().to(t.device)
                    if torch.is_tensor(v) and tuple(v.shape) == full_shape and v.dim() > 0
                    else (v.clone() if torch.is_tensor(v) else v)
                    for k, v in states[lp.name].items()
                }


class LiveRebalancer:
    """Telemetry windows, straggler detection and live resharding for one rank (see the module doc).

    ``make(plan) -> Trainer`` builds this rank's trainer for a plan (program generation, optimizer,
    local batch, buckets); ``emit`` writes a metrics line; ``phase`` a heartbeat; ``fault_rank``: that
    rank exits during the reshard (a test of failure handling); ``slowdown``: this rank's injected
    straggler factor (:class:`hapnb.run.telemetry.CollectiveClock`)."""

    def __init__(
        self,
        options: RebalanceOptions,
        *,
        rank: int,
        graph: Any,
        device: Any,
        compile_s: float,
        make: Callable[[Any], Trainer],
        emit: Callable[[dict[str, Any]], None],
        phase: Callable[..., None],
        rebalance: bool = True,
        fault_rank: int | None = None,
        slowdown: float = 1.0,
    ) -> None:
        self.options = options
        self.rank, self.graph, self.device = rank, graph, device
        self.compile_s = compile_s
        self.make, self.emit, self.phase = make, emit, phase
        self.enabled = rebalance
        self.fault_rank = fault_rank
        self.clock = CollectiveClock(slowdown)
        self.window = Window()
        self.detector = Detector(options)
        self.links = LinkDetector(options.threshold, options.patience)
        self._links0 = self.clock.link_totals()  # the per-kind totals at the last step's end
        self._planner: Any = None
        self.done = 0  # accepted re-balances
        self.last: Any = None  # the last accepted proposal
        self.recent: list[dict[str, list[float]]] = []  # the last `patience` window tables
        self._theory: Any = None

    def __enter__(self) -> LiveRebalancer:
        self.clock.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.clock.__exit__(*exc)

    def end_step(self, step: int, steps: int, m: Mapping[str, Any], trainer: Trainer) -> Trainer:
        """Account step ``step`` (its metrics ``m``); at a window's end, gather, fit and maybe reshard.
        Returns the trainer to go on with (a new one after a reshard)."""
        now = self.clock.link_totals()
        links = {k: tuple(a - b for a, b in zip(v, self._links0[k])) for k, v in now.items()}
        self._links0 = now
        if step >= self.options.warmup:
            self.window.add(
                compute_s=m["compute_s"],
                comm_s=m["comm_s"],
                step_s=m["step_s"],
                memory=m["max_memory_bytes"],
                optimizer_s=m.get("optimizer_s", 0.0),
                links=links,
            )
        if len(self.window) < self.options.every or step == steps - 1:
            return trainer
        tab = table(self.window.gather(self.compile_s, self.device, self.clock))
        fit, lfit = self._fit(trainer, tab)
        if self.rank == 0:
            self.emit(
                {"rank": 0, "event": "telemetry", "step": step, "window": tab, "scale": list(fit.scale),
                 **lfit.record()}
            )  # fmt: skip
        self.recent = (
            [*self.recent[-self.options.patience + 1 :], tab] if self.options.patience > 1 else [tab]
        )
        stragglers = self.detector.update(fit)
        slow_links = self.links.update(lfit) if self.options.links else ()
        if not (
            self.enabled
            and (stragglers or slow_links)
            and self.done < self.options.max_rebalances
            and self._trusted(tab)
        ):
            return trainer
        self.detector.reset()
        # decide on the windows that made the straggler (less noise than the last one alone)
        tab = pool(self.recent[-self.options.patience :])
        fit, lfit = self._fit(trainer, tab)
        verdict = self._decide(trainer, fit, lfit, tab, step, steps, stragglers, slow_links)
        # the links as measured are the reference from now on: the new plan's model, or (rejected) what
        # re-planning was already asked about
        self.links.reset(None if verdict is not None else lfit.links())
        if verdict is None:
            return trainer
        record, plan_json = verdict
        t0 = time.perf_counter()
        new = self._reshard(trainer, plan_json)
        record["reshard_s"] = time.perf_counter() - t0
        self.done += 1
        self.last = record
        self.recent = []  # windows at the old ratios say nothing of the new plan
        self._links0 = self.clock.link_totals()  # the reshard's gathers are no step's
        if self.rank == 0:
            self.emit({"rank": 0, "event": "rebalance", "rebalance": record})
        return new

    def _fit(self, trainer: Trainer, tab: Mapping[str, Any]) -> tuple[Any, Any]:
        """The devices' and the links' fits of a window table against ``trainer``'s plan."""
        fit = fit_speeds(variable(tab), predicted_compute(trainer.plan), tab["compute_rsd"])
        return fit, fit_links(tab, trainer.plan.cluster, fit.k_ref)

    def _trusted(self, tab: Mapping[str, Any]) -> bool:
        """After a re-balance, another only when the last one's prediction held (module doc of
        :mod:`hapnb.run.rebalance`)."""
        if self.last is None:
            return True
        measured = max(tab["step_s"])
        return abs(measured / self.last["predicted_step_s"] - 1.0) <= self.options.trust

    def _decide(
        self,
        trainer: Trainer,
        fit: Any,
        lfit: Any,
        tab: Any,
        step: int,
        steps: int,
        stragglers: tuple[int, ...],
        slow_links: tuple[str, ...],
    ) -> tuple[dict[str, Any], str] | None:
        """Rank 0 proposes (the ratio LP, and the planner on the measured cluster); every rank gets its
        verdict: ``(record, plan JSON)`` when accepted, else None. One decision, made once and broadcast, so
        every rank takes the same."""
        import torch.distributed as dist

        payload: list[Any] = [None]
        if self.rank == 0:
            if self._theory is None:
                from ..triples import theory

                self._theory = theory(self.graph)
            try:
                p = propose(
                    trainer.plan, self._theory, fit, tab, self.options,
                    step=step, steps_left=steps - 1 - step, stragglers=stragglers, codegen_s=self._codegen_s,
                    links=lfit if self.options.links else None, slow_links=slow_links,
                    replan=(lambda c: self._replan(trainer.plan, c)) if self.options.program else None,
                )  # fmt: skip
                rec = p.record()
                payload = [(rec, json.dumps(p.plan.to_json()) if p.accepted else None)]
            except Exception as e:  # noqa: BLE001 - a failed re-solve keeps the job on its ratios
                payload = [({"step": step, "accepted": False, "reason": f"re-solve failed: {e}"}, None)]
            if not payload[0][0]["accepted"]:
                self.emit({"rank": 0, "event": "rebalance", "rebalance": payload[0][0]})
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        rec, plan_json = payload[0]
        return (rec, plan_json) if plan_json is not None else None

    def _replan(self, plan: Any, cluster: Any) -> Any:
        """The planner's plan for the model on ``cluster`` (the measured one), with ``plan``'s pins and
        ratio pins: what a fresh ``hapnb.synthesize`` makes there (deterministic)."""
        import dataclasses

        from ..plans.planner import Planner

        if self._planner is None:
            self._planner = Planner.for_plan(dataclasses.replace(plan, graph=self.graph))
        return self._planner.replan(plan, cluster=cluster)

    def _codegen_s(self, plan: Any) -> float:
        """Seconds to generate this rank's program for ``plan`` (part of the reshard estimate)."""
        from ..runtime.codegen import generate

        t0 = time.perf_counter()
        generate(plan, self.graph, self.rank, inputs="local")
        return time.perf_counter() - t0

    def _reshard(self, trainer: Trainer, plan_json: str) -> Trainer:
        """Move this rank to the plan ``plan_json`` (see the module doc); every rank calls it together."""
        import os

        from ..plans.plan import Plan

        self.phase("reshard")
        if self.fault_rank == self.rank:
            os._exit(17)  # the failure-handling test: a rank that dies mid-reshard
        weights, states = full_state(trainer.prog, trainer.module, trainer.opt)
        if trainer.buckets is not None:
            trainer.buckets.remove()
        plan = Plan.from_json(json.loads(plan_json))
        new = self.make(plan)
        load_state(new.prog, new.module, new.opt, weights, states)
        continue_stream(new.module, trainer.module)  # the random ops go on with their draws
        return new
