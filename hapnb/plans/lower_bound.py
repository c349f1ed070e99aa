"""A lower bound of the overlap simulation's iteration time from a plan's costs alone
(:func:`iteration_lower_bound`, :func:`plan_lower_bound`): :func:`hapnb.synthesize` skips the candidate
programs whose bound is above the fastest one simulated.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cost.ddp import ddp_buckets
from ..hardware.cluster import Cluster
from .plan import Plan
from .sim_costs import FORWARD_FRACTION, _slowdowns

__all__ = ["iteration_lower_bound", "plan_lower_bound"]


def iteration_lower_bound(
    comp: Sequence[Sequence[float]],
    feature: Sequence[tuple[float, float]],
    gradient_bytes: Sequence[int],
    optimizer: Sequence[float],
    cluster: Cluster,
    duplex: bool = False,
) -> float:
    """A lower bound of :func:`iteration_time` of a plan on its own ``cluster``, from its costs alone:
    ``comp`` the per-device seconds of each compute instruction (``Instruction.comp_s``), ``feature`` each
    instruction's feature communication (forward, backward seconds: the sums of its non-gradient
    ``CommCost`` parts), ``gradient_bytes`` the bytes of each gradient all-reduce in program order and
    ``optimizer`` the optimizer step per device (``plan.optimizer_s``). :func:`hapnb.synthesize` skips the
    candidates whose bound is above the fastest simulated one (:func:`plan_lower_bound`: a plan's).

    Why it holds (the overlap simulation with bandwidth sharing, :func:`iteration_time`): the collectives
    together progress at a rate of at most 1, so they take at least their total work ``C`` (feature parts
    and the gradient buckets); a device's compute tasks run one at a time at a rate of at most 1, and at
    ``1 / (1 + γ)`` while a collective runs, so the iteration lasts at least its compute work
    ``W + C γ / (1 + γ)``; a device runs every forward before any backward, and every backward collective
    and gradient bucket waits for backwards on every device, so they all start after the slowest device's
    forward work ``S``: the iteration lasts at least ``S`` + the backward communication, and ``S`` + the
    gradient buckets + the optimizer step (which waits for the last bucket). A duplex plan's two
    micro-batches each carry half of every step's computation and feature communication. 0 when a γ is
    negative (a rate above 1 would break the bound).

    >>> from hapnb.hardware.cluster import Cluster
    >>> c = Cluster.resolve("2xV100")
    >>> round(iteration_lower_bound([(3e-3, 6e-3), (1e-3, 2e-3)], [], [], (0.0, 1e-3), c), 9)  # compute
    0.009
    >>> round(iteration_lower_bound([(3e-3, 3e-3)], [(0.0, 5e-3)], [], (0.0, 0.0), c), 9)  # fwd, then comm
    0.006
    """
    gamma = _slowdowns(cluster, None)
    if any(g < 0 for g in gamma):
        return 0.0
    k, mbs = (0.5, 2) if duplex else (1.0, 1)
    fwd = [0.0] * cluster.n
    work = [max(0.0, x) for x in optimizer] or [0.0] * cluster.n
    for j, col in enumerate(zip(*comp)):  # the simulator's forward and backward task of each micro-batch
        if min(col) >= 0:
            fwd[j] = mbs * k * FORWARD_FRACTION * sum(col)
            work[j] += mbs * k * sum(col)
        else:
            fwd[j] = sum(mbs * max(0.0, k * FORWARD_FRACTION * x) for x in col)
            work[j] += fwd[j] + sum(mbs * max(0.0, k * (1 - FORWARD_FRACTION) * x) for x in col)
    f_fwd = sum(mbs * max(0.0, k * f) for f, _ in feature)
    f_bwd = sum(mbs * max(0.0, k * b) for _, b in feature)
    ar = cluster.collective("all_reduce")
    ready = [(i, b) for i, b in reversed(list(enumerate(gradient_bytes)))]
    buckets = [sum(gradient_bytes[i] for i in bucket) for bucket in ddp_buckets(ready)]
    grad = sum(max(0.0, ar.latency_s + b / ar.bandwidth_Bps) for b in buckets)
    total = f_fwd + f_bwd + grad
    if (
        duplex and comp
    ):  # the last step's first micro-batch may start its backward gathers before the second's forward
        fwd = [f - max(0.0, k * FORWARD_FRACTION * x) for f, x in zip(fwd, comp[-1])]
    start = max(fwd, default=0.0)
    out = max(total, start + f_bwd + grad)
    if buckets:
        out = max(out, start + grad + max(max(0.0, x) for x in optimizer or (0.0,)))
    return max([out] + [w + total * g / (1 + g) for w, g in zip(work, gamma)])


def plan_lower_bound(plan: Plan) -> float:
    """:func:`iteration_lower_bound` of a costed plan (0 for one without per-instruction costs)."""
    if not plan.costed:
        return 0.0
    comp = [i.comp_s for i in plan.program if i.kind == "compute"]
    feature = [
        (
            sum(c.forward_s for c in i.comm if not c.gradient),
            sum(c.backward_s for c in i.comm if not c.gradient),
        )
        for i in plan.program
    ]
    grads = [c.nbytes for i in plan.program for c in i.comm if c.gradient]
    return iteration_lower_bound(comp, feature, grads, plan.optimizer_s, plan.cluster, plan.duplex)
