"""Simulate: a plan's iteration as a timeline of spans per device and stream (Proteus-style).

Two modes (:func:`simulate`):

* **Stage-synchronous** (``overlap=False``): the cost model's stage model laid out in time. Stage by
  stage, the stage's communication (every term of its instructions, forward then backward part, all
  devices), then each device computes its instructions (forward then backward part of each), and the next
  stage starts when the slowest device is done; the optimizer step runs in the last stage, as the cost
  model charges it. ``iteration_s`` equals ``plan.cost_s``.
* **Overlap** (``overlap=True``): a discrete-event run of forward, backward and optimizer step over the
  program's dependencies, in a fluid model (every running task progresses at a rate; the next event is
  the first task to finish). Three streams per device, as Proteus' executor has: ``compute``,
  ``feature-comm`` and ``gradient-comm``; each runs its tasks one at a time in issue order.

  - Forward: the compute steps in program order, each its forward share :data:`FORWARD_FRACTION` of the
    step's computation (the rules count backward = 2x forward). A feature collective is issued once its
    input is produced on every device (HAP's collectives span all devices) and blocks only the step that
    consumes it (the step it is fused in front of).
  - Backward: the steps in reverse order; a collective's backward runs after its consumer's backward and
    before its producer's; an SFB step's gathers run before the step's backward.
  - Gradients of replicated parameters are all-reduced on the gradient-comm stream in DDP buckets
    (:func:`hapnb.cost.ddp.ddp_buckets`; ready in reverse order of first use), a bucket once every device
    has all its gradients; a bucket costs the cluster's ``all_reduce`` ``latency + bytes/bandwidth``.
    Each device's optimizer step runs after the last bucket.
  - Comp-comm overlap (Proteus' overlap factor γ): a compute task runs at ``1/(1+γ)`` while any
    collective runs (every collective spans every device). γ: ``slowdown=`` if given, else the device
    model's ``overlap_slowdown``, else :data:`DEFAULT_OVERLAP_SLOWDOWN`.
  - Bandwidth sharing (``bandwidth_sharing=True``): every HAP collective spans every device, so any two
    running collectives cross the same links (each machine's NIC when the cluster has several machines,
    the machine's NVLink/PCIe fabric when it has one): ``k`` running collectives each progress at
    ``1/k`` (Proteus' fair share). Without it, feature and gradient collectives run side by side at full
    speed.
  - Duplex plans (HiDup, ``plan.duplex``): two micro-batches, each with half of every step's
    computation and half of every feature collective, interleaved per step on each stream (mb 0 step i,
    mb 1 step i, ...); gradients all-reduced once per iteration, one optimizer step.

Memory per device (``Timeline.memory``, (time, bytes) points at task boundaries): the plan's
persistent bytes (parameters, gradients, optimizer states, inputs, overhead of ``memory_breakdown``),
activations allocated in equal shares as each step's forward ends (the plan keeps no per-step split)
and freed as its backward ends (stage-synchronous: at the end of the iteration), the breakdown's
transient during every backward and optimizer task. The peak equals the plan's ``memory_bytes``.

The modules: :mod:`.timeline` (the result: spans, segments, memory over time), :mod:`.sim_costs` (the
costs simulated, re-priced for another cluster; γ), :mod:`.sim_stages` and :mod:`.sim_overlap` (the two
modes), :mod:`.lower_bound` (a bound of the overlap mode's iteration time). This module holds the entry
points and re-exports the public names.

>>> Span("v100-0", "compute", 0.0, 1e-3, 3, "forward").duration_s
0.001
"""

from __future__ import annotations

from typing import Any

from ..hardware.cluster import Cluster
from .lower_bound import iteration_lower_bound, plan_lower_bound
from .plan import Plan
from .sim_costs import (
    DEFAULT_OVERLAP_SLOWDOWN,
    FORWARD_FRACTION,
    _check_cluster,
    _Costs,
    _costs,
    _slowdowns,
)
from .sim_costs import _kinds as _kinds  # re-exported: the collective table's readers find it here
from .sim_overlap import _Overlap
from .sim_stages import _stage_only, _stage_sync
from .timeline import PHASES, SPAN_FIELDS, STREAMS, Segment, Span, Timeline

__all__ = [
    "Span",
    "Segment",
    "iteration_time",
    "iteration_lower_bound",
    "plan_lower_bound",
    "Timeline",
    "simulate",
    "STREAMS",
    "PHASES",
    "FORWARD_FRACTION",
    "DEFAULT_OVERLAP_SLOWDOWN",
    "SPAN_FIELDS",
]


def simulate(
    plan: Plan,
    cluster: Cluster | None = None,
    overlap: bool = True,
    bandwidth_sharing: bool = True,
    slowdown: float | None = None,
) -> Timeline:
    """Simulate one training iteration of ``plan`` (see the module docstring for the two modes).

    ``cluster``: None (the plan's) or a cluster with the same device names: flops-only devices are
    re-priced by their flops, collectives by their kinds' latency and bandwidth; a device whose device
    model or GPU count differs cannot be re-priced (ValueError). ``slowdown``: γ for every device
    (default: each device model's ``overlap_slowdown``, else :data:`DEFAULT_OVERLAP_SLOWDOWN`).
    ``overlap=False`` is the stage model (``bandwidth_sharing`` has nothing to share there). A plan made
    before per-instruction costs (``not plan.costed``) supports only ``overlap=False``.
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"simulate needs a hapnb Plan, got {type(plan).__name__}")
    c = _check_cluster(plan, cluster)
    caps = tuple(int(d.memory_bytes / max(1, d.gpus)) for d in c.devices)
    if not plan.costed:
        if overlap:
            raise ValueError(
                f"plan {plan.name!r} carries no per-instruction costs (made by an older hapnb), so only the "
                "stage model can be simulated: call simulate(plan, overlap=False) (hapnb simulate "
                "--no-overlap), or re-synthesize the plan"
            )
        if c != plan.cluster:
            raise ValueError(
                f"plan {plan.name!r} carries no per-instruction costs (made by an older hapnb), so it "
                "cannot be re-priced for another cluster; re-synthesize it"
            )
        return _stage_only(plan, caps)
    costs = _costs(plan, c)
    if not overlap:
        return _stage_sync(plan, costs, caps)
    return _Overlap(plan, c, costs, bandwidth_sharing, _slowdowns(c, slowdown)).run(caps)


def iteration_time(plan: Plan, slowdown: float | None = None) -> float:
    """The overlap simulation's iteration time of ``plan`` on its own cluster — ``simulate(plan).iteration_s``
    without building the timeline (spans, segments, memory over time): what :func:`hapnb.synthesize`
    ranks its candidate programs by."""
    if not isinstance(plan, Plan) or not plan.costed:
        return simulate(plan, slowdown=slowdown).iteration_s
    c = plan.cluster
    costs, gamma = _costs(plan, c), _slowdowns(c, slowdown)
    # devices with the same computation per instruction, optimizer step and slowdown run the same
    # timeline (they meet the others only in collectives, which span every device): simulate one of each
    reps: dict[Any, int] = {}
    for j in range(c.n):
        key = (tuple(row[j] if row else None for row in costs.comp), costs.optimizer[j], gamma[j])
        reps.setdefault(key, j)
    keep = list(reps.values())
    if len(keep) < c.n:
        comp = tuple(tuple(row[j] for j in keep) if row else row for row in costs.comp)
        costs = _Costs(comp, costs.comm, tuple(costs.optimizer[j] for j in keep))
        gamma = tuple(gamma[j] for j in keep)
    sim = _Overlap(plan, c, costs, True, gamma)
    sim.n = len(keep)
    sim.labels = False
    sim.build()
    return sim.loop()
