"""The costs a simulation runs on: the per-instruction computation and communication the cost model
wrote into the plan, re-priced when the plan is simulated on another cluster with the same device names
(flops-only devices by their flops, collectives by their kinds' latency and bandwidth, :func:`_kinds`
being a copy of the cost model's kind mapping), and the comp-comm overlap factor γ per device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..hardware.cluster import Cluster
from ..ir.collective_table import COLLECTIVES
from .plan import CommCost, Plan

#: The forward's share of a step's computation: the rules charge forward + backward as 3x the forward
#: flops (backward = 2x forward), so the forward is a third.
FORWARD_FRACTION = 1.0 / 3.0
#: Proteus' overlap factor γ: a computation slows by ``1 + γ`` while a collective runs beside it (the
#: collective's kernels take SMs and memory bandwidth). Proteus profiles γ per machine and model (the
#: backward pass of data-parallel training with and without overlap) and publishes no single value; 0.1
#: (10 %) is our default for a GPU running NCCL until ``hapnb profile`` measures the local device
#: (``DeviceModel.overlap_slowdown``).
DEFAULT_OVERLAP_SLOWDOWN = 0.1


def _kinds(kind: str, n: int, on_compute: bool) -> tuple[tuple[str, int], tuple[str, int]]:
    """The collective kinds and launches of a term's forward and backward part (cost/model.py's pricing)."""
    if on_compute:  # SFB's all-gathers (input, output gradient); a buffer update's collective (forward)
        return (kind, 1), (kind, 1)
    spec = COLLECTIVES.get(kind)
    if spec is None or spec.forward is None:  # a gradient all-reduce, a ZeRO gather: one kind both ways
        return (kind, 1), (kind, 1)
    launches = n if spec.launches_per_device else 1
    return (spec.forward, launches), (spec.backward or spec.forward, launches)


def _reprice_time(t: float, kind: str, launches: int, old: Cluster, new: Cluster) -> float:
    if t <= 0:
        return t
    a, b = old.collective(kind), new.collective(kind)
    return launches * b.latency_s + max(0.0, t - launches * a.latency_s) * a.bandwidth_Bps / b.bandwidth_Bps


@dataclass(frozen=True)
class _Costs:
    """Per-instruction costs of a plan on the cluster simulated."""

    comp: tuple[tuple[float, ...], ...]  # per instruction, per device (empty: not compute)
    comm: tuple[tuple[CommCost, ...], ...]
    optimizer: tuple[float, ...]


def _costs(plan: Plan, cluster: Cluster) -> _Costs:
    """The plan's per-instruction costs, re-priced for ``cluster`` when it is not the plan's."""
    old = plan.cluster
    n = old.n
    comp = tuple(tuple(i.comp_s) for i in plan.program)
    comm = tuple(tuple(i.comm) for i in plan.program)
    opt = tuple(plan.optimizer_s) or (0.0,) * n
    if cluster == old:
        return _Costs(comp, comm, opt)
    scale = []
    for a, b in zip(old.devices, cluster.devices):
        if a.model != b.model or a.gpus != b.gpus:
            raise ValueError(
                f"cannot re-price the plan for cluster {cluster.name!r}: device {a.name} has a different "
                f"{'device model' if a.model != b.model else 'number of GPUs'} than in the plan's cluster "
                f"{old.name!r}; only flops-only devices' flops and the collectives can change. Synthesize a "
                "plan for that cluster instead (hapnb.synthesize(model, cluster))"
            )
        scale.append(a.flops / b.flops if a.model is None else 1.0)
    comp = tuple(tuple(x * s for x, s in zip(row, scale)) for row in comp)
    out = []
    for ins, row in zip(plan.program, comm):
        new_row = []
        for c in row:
            (kf, lf), (kb, lb) = _kinds(c.kind, n, ins.kind == "compute")
            new_row.append(
                dataclasses.replace(
                    c,
                    forward_s=_reprice_time(c.forward_s, kf, lf, old, cluster),
                    backward_s=_reprice_time(c.backward_s, kb, lb, old, cluster),
                )
            )
        out.append(tuple(new_row))
    return _Costs(comp, tuple(out), opt)


def _check_cluster(plan: Plan, cluster: Cluster | None) -> Cluster:
    if cluster is None:
        return plan.cluster
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a hapnb Cluster or None, got {type(cluster).__name__}")
    if cluster.names != plan.cluster.names:
        raise ValueError(
            f"cluster {cluster.name!r} has devices {', '.join(cluster.names)} but the plan was made for "
            f"{', '.join(plan.cluster.names)}; simulate on a cluster with the same device names (or "
            "synthesize a plan for that cluster)"
        )
    return cluster


def _slowdowns(cluster: Cluster, slowdown: float | None) -> tuple[float, ...]:
    if slowdown is not None:
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not slowdown >= 0:
            raise ValueError(f"slowdown (γ) must be a number >= 0, got {slowdown!r}")
        return (float(slowdown),) * cluster.n
    out = []
    for d in cluster.devices:
        g = getattr(d.model, "overlap_slowdown", None) if d.model is not None else None
        out.append(DEFAULT_OVERLAP_SLOWDOWN if g is None else float(g))
    return tuple(out)
