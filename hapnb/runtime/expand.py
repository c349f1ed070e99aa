"""Run plans made for virtual devices on the physical GPUs: :func:`expand_virtual`.

A virtual device (:class:`hapnb.hardware.parts.Device` with ``gpus = k > 1``, see ``Cluster.virtual()``) stands
for one machine of ``k`` identical GPUs running data parallelism inside (paper §3, §6). The synthesized
program is the same SPMD program on every rank, so a plan over virtual devices becomes an *equivalent*
plan over the physical GPUs by cutting each virtual device's share of every sharded dim into ``k`` equal
parts:

* device ``j`` (``gpus = k``) becomes ``k`` devices ``"<name>.g0"`` .. ``"<name>.g{k-1}"`` on the same
  machine, ``gpus = 1``, with ``flops / k`` and ``memory_bytes // k``;
* every segment's ratio ``r_j`` becomes ``k`` ratios ``r_j / k``;
* every ``G``-form cut (``plan.lengths`` and the ``lengths`` of reshard instructions) splits device
  ``j``'s length ``L_j`` into ``k`` sub-lengths that are multiples of the dim's unit (the theory's
  granularity, ``theory.units[(tensor, dim)]``): ``unit * shard_lengths(L_j / unit, [1] * k)``. Dims of
  one partition class share the same ``L_j / unit`` counts, so they stay cut alike;
* ``I`` and ``R`` forms need nothing: a replicated tensor stays replicated on every GPU, and a partial
  (``R``) tensor is still a sum over all ranks.

The program (its instructions) is unchanged. Stages, costs, memory and history are the *virtual* plan's
estimates, copied (per-device entries repeated for each of a virtual device's GPUs; a GPU doing ``1/k``
of the work at ``1/k`` of the throughput takes the same time); collectives keep the virtual cluster's
models. :func:`hapnb.run.verify.verify`, :func:`hapnb.run.launch.launch`, the worker and
:func:`hapnb.distribute` expand a virtual plan themselves.

>>> import hapnb
>>> c = hapnb.Cluster.parse("2xV100+2xP100").virtual()
>>> plan = hapnb.synthesize("mlp", c, **hapnb.zoo.TINY["mlp"])  # doctest: +SKIP
>>> expand_virtual(plan, plan.graph).devices  # doctest: +SKIP
('m0.g0', 'm0.g1', 'm1.g0', 'm1.g1')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..hardware.cluster import Cluster
from ..hardware.parts import Device
from ..ir.forms import shard_lengths
from ..ir.graph import Graph
from ..plans.plan import Plan

__all__ = ["ExpandError", "expand_cluster", "expand_virtual", "has_virtual", "physical_plan"]


class ExpandError(ValueError):
    """A virtual plan cannot be expanded (its lengths do not fit the graph or the cluster)."""


def has_virtual(plan_or_cluster: Plan | Cluster) -> bool:
    """Whether any device of the plan's cluster (or of the cluster) has ``gpus > 1``."""
    c = plan_or_cluster.cluster if isinstance(plan_or_cluster, Plan) else plan_or_cluster
    return any(d.gpus > 1 for d in c.devices)


def expand_cluster(cluster: Cluster) -> Cluster:
    """The cluster with every virtual device replaced by its ``gpus`` physical GPUs (see module doc).

    >>> Cluster.parse("2xV100+2xP100").virtual().n, expand_cluster(Cluster.parse("2xV100").virtual()).names
    (2, ('m0.g0', 'm0.g1'))
    """
    if not has_virtual(cluster):
        return cluster
    devices: list[Device] = []
    for d in cluster.devices:
        if d.gpus == 1:
            devices.append(d)
            continue
        k = d.gpus
        for i in range(k):
            devices.append(
                Device(
                    name=f"{d.name}.g{i}",
                    kind=d.kind,
                    flops=d.flops / k,
                    memory_bytes=max(1, d.memory_bytes // k),
                    machine=d.machine,
                    gpus=1,
                )
            )
    return cluster.replace(name=f"{cluster.name}/gpus", devices=tuple(devices))


def _repeat(values: Sequence[Any], gpus: Sequence[int]) -> tuple[Any, ...]:
    """Each per-device value repeated for each of the device's GPUs."""
    return tuple(v for v, k in zip(values, gpus) for _ in range(k))


def _split_ratios(row: Sequence[float], gpus: Sequence[int]) -> tuple[float, ...]:
    return tuple(r / k for r, k in zip(row, gpus) for _ in range(k))


def expand_virtual(
    plan: Plan,
    graph: Graph | None = None,
    *,
    theory: Any = None,
    strategies: Callable[..., Any] | None = None,
) -> Plan:
    """The plan over the physical GPUs equivalent to ``plan`` over virtual devices (see module doc).

    ``graph`` (default ``plan.graph``) gives the dims' units through ``hapnb.theory(graph)``; pass a
    prebuilt ``theory`` (or the ``strategies`` the plan was synthesized with, for hand-built graphs) to
    skip or steer that. A plan without virtual devices is returned unchanged. The result carries
    ``graph`` when one was given. Raises :class:`ExpandError` when a cut does not fit the plan's devices
    or is not a multiple of its dim's unit.
    """
    if not has_virtual(plan):
        return plan
    g = graph if graph is not None else plan.graph
    if theory is None:
        if g is None:
            raise ExpandError(
                f"plan {plan.name} has virtual devices; expanding it needs the graph it was made for "
                "(pass graph=..., or use hapnb.run.bundle.resolve_graph(plan))"
            )
        from ..triples import theory as build_theory

        theory = build_theory(g, strategies)
    g = theory.graph
    gpus = tuple(d.gpus for d in plan.cluster.devices)
    n = len(gpus)
    names = {t.name: t for t in g.tensors}

    def split(tensor: str, dim: int, lengths: Sequence[int], where: str) -> tuple[int, ...]:
        if len(lengths) != n:
            raise ExpandError(
                f"plan {plan.name}: {where}: {tensor} dim {dim} has {len(lengths)} shard lengths but the "
                f"cluster {plan.cluster.name} has {n} devices; the plan is corrupt"
            )
        t = names.get(tensor)
        if t is None:
            raise ExpandError(f"plan {plan.name}: {where}: the graph has no tensor {tensor!r}")
        size = t.shape[dim]
        if sum(lengths) != size:
            raise ExpandError(
                f"plan {plan.name}: {where}: the shard lengths {tuple(lengths)} of {tensor} dim {dim} sum to "
                f"{sum(lengths)}, not its size {size}"
            )
        unit, _ = theory.units.get((t.id, dim), (1, size))
        out: list[int] = []
        for j, (length, k) in enumerate(zip(lengths, gpus)):
            if k == 1:
                out.append(int(length))
                continue
            if length % unit:
                raise ExpandError(
                    f"plan {plan.name}: {where}: device {plan.cluster.devices[j].name} holds {length} of "
                    f"{tensor} dim {dim}, not a multiple of the dim's unit {unit}; cannot split it over "
                    f"its {k} GPUs"
                )
            out.extend(unit * x for x in shard_lengths(length // unit, [1.0] * k))
        return tuple(out)

    lengths = tuple((t, d, split(t, d, ls, "lengths")) for t, d, ls in plan.lengths)
    program = tuple(
        dataclasses.replace(ins, lengths=split(ins.tensor, _dim(ins.form), ins.lengths, f"instruction {i}"))
        if ins.lengths
        else ins
        for i, ins in enumerate(plan.program)
    )
    cluster = expand_cluster(plan.cluster)
    stages = tuple(dataclasses.replace(s, comp_s=_repeat(s.comp_s, gpus)) for s in plan.stages)
    history = tuple(
        dataclasses.replace(r, ratios=tuple(_split_ratios(row, gpus) for row in r.ratios))
        if all(len(row) == n for row in r.ratios)
        else r
        for r in plan.history
    )
    ratio_pins = []
    for name, lo, hi in plan.ratio_pins:
        try:
            j = plan.cluster.index(name)
        except KeyError:
            ratio_pins.append((name, lo, hi))
            continue
        k = gpus[j]
        subs = [name] if k == 1 else [f"{name}.g{i}" for i in range(k)]
        ratio_pins.extend((s, lo / k, hi / k) for s in subs)
    memory = _repeat([m // k for m, k in zip(plan.memory_bytes, gpus)], gpus) if plan.memory_bytes else ()
    return dataclasses.replace(
        plan,
        cluster=cluster,
        ratios=tuple(_split_ratios(row, gpus) for row in plan.ratios),
        program=program,
        lengths=lengths,
        stages=stages,
        history=history,
        ratio_pins=tuple(ratio_pins),
        memory_bytes=memory,
        graph=g,
    )


def _dim(form: str) -> int:
    from ..ir.forms import parse_recut

    f = parse_recut(form)[0]
    if f.kind != "G":
        raise ExpandError(f"an instruction with shard lengths has form {form}, not a G form")
    return int(f.dim)


def physical_plan(plan: Plan, graph: Graph | None = None) -> Plan:
    """``plan`` itself when it has no virtual devices, else :func:`expand_virtual` of it."""
    return expand_virtual(plan, graph) if has_virtual(plan) else plan
