"""Explaining a plan: what bounds the step, what a change would save, and the helpers every explanation
reads a plan with (its program as the search's steps, its model rebuilt). Why the search did not choose
some forms is :mod:`hapnb.plans.whynot`.

* :func:`sensitivity` (``plan.sensitivity()``): the ratio LP of the plan's program, solved with its dual
  values: the devices whose computation is tight in each stage, and what a faster device (+10 % flop/s),
  a faster collective kind (+10 % bandwidth) or a faster intra-machine link would save, to first order
  (:func:`hapnb.synth.balance.lp_changes`: the LP's dual that is right for each change, the LP being degenerate).
  A plan whose ratios the memory caps moved (the plain LP's optimum overflows a device) is read from the
  memory-capped LP (:func:`hapnb.synth.balance.memory_lp`): the devices whose memory binds, and what ``factor``
  times their memory would save, are its ``memory``.
  A plan whose ratios are not the LP's optimum (fixed ratios, a baseline program at its own ratios, a
  duplex plan's even micro-batches) is priced at its own ratios instead (``basis="fixed ratios"``).
* :func:`what_if`: one such change applied and the plan re-planned (``plan.replan(cluster=...)``), the
  re-planned cost next to the dual's prediction.

Savings are of ``plan.cost_s`` (the stage model, or the duplex time), the number the search and the LP
optimise. The values render as text and HTML (:mod:`hapnb.display`). This module reaches synthesis only
through a :class:`~hapnb.plans.planner.Planner` it is handed (the plan's own by default), never by import.

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=32, input=16, batch=8)
>>> s = plan.sensitivity()
>>> s.basis, len(s.devices) == 4
('lp', True)
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..cost.memory import overflow
from ..cost.model import Conversion, CostModel, Load, Step
from ..hardware.cluster import Cluster
from ..hardware.parts import Collective
from ..ir.graph import Graph
from ..synth.balance import (
    MemoryCapError,
    device_classes,
    lp_changes,
    memory_lp,
    parse_ratio_pins,
    ratio_lp,
    row_role,
    solve_lp,
)
from ..synth.duplex import duplex_cost
from ..synth.optimize import without_gc
from ..triples import Theory
from .plan import Plan

__all__ = [
    "Sensitivity",
    "DeviceBound",
    "LinkBound",
    "MemoryBound",
    "StageBound",
    "WhatIf",
    "sensitivity",
    "what_if",
    "faster",
    "program_steps",
    "rebuild_graph",
    "INTRA_MACHINE",
]

#: the name of the intra-machine link (virtual devices' inner gradient sync) in sensitivity reports
INTRA_MACHINE = "intra-machine"

_TIGHT = 1e-9  # relative slack under which a row counts as tight


# ============================================================================================ helpers


def rebuild_graph(plan: Plan) -> Graph:
    """The plan's traced program, rebuilt from its recorded model spec (the zoo name or factory and its
    options); raises ValueError when the plan records none, or the rebuilt program is not the one the
    plan was made for (its graph fingerprint differs)."""
    from .. import zoo
    from ..tracing import trace

    missing = ValueError(
        f"plan {plan.name!r} records no model to rebuild (made from a Graph or an nn.Module): re-plan "
        "the plan object synthesize returned, or synthesize again from the model"
    )
    model, inputs = zoo.rebuild(plan.model_spec, missing)
    g = trace(model, inputs, name=plan.name)
    if g.fingerprint != plan.graph_fingerprint:
        raise ValueError(
            f"plan {plan.name!r}: the model rebuilt from its spec {plan.model_spec} traces to a different program "
            f"(fingerprint {g.fingerprint} instead of {plan.graph_fingerprint}); was it made by another "
            "version of the model? Synthesize it again"
        )
    return g


def _planner(plan: Plan, planner: Any, verb: str) -> Any:
    """``planner``, else the plan's own (:class:`~hapnb.plans.planner.Planner`; a clear error without one)."""
    return planner if planner is not None else plan.require_planner(verb)


def program_steps(plan: Plan, th: Theory) -> tuple[tuple[Step, ...], tuple[Conversion, ...]]:
    """The plan's program as the search's steps (and the collectives after the last one), read back from
    its instructions: loads and collectives belong to the computation that follows them, which runs the
    strategy of that name. Inverse of :func:`hapnb.plans.plan.make_plan`."""
    g = th.graph
    ops = {op.name: op for op in g.ops}
    tid = {t.name: t.id for t in g.tensors}
    steps: list[Step] = []
    loads: list[Load] = []
    convs: list[Conversion] = []
    for ins in plan.program:
        if ins.kind == "load":
            zero = _zero_level(ins.name)
            stored = ins.src_value if zero else None  # a ZeRO load: kept sharded as src
            loads.append(Load(tid[ins.tensor], ins.form_value, ins.name == "load_sfb", zero, stored))
        elif ins.kind == "collective":
            seg = {} if ins.segment is None else {"segment": ins.segment}  # a reshard's target segment
            convs.append(Conversion(tid[ins.tensor], ins.name, ins.src_value, ins.form_value, **seg))
        else:
            op = ops[ins.op]
            outs = tuple(f for _, f in ins.output_forms)
            strategy = next(s for s in th.strategies[op.id] if s.name == ins.name and s.outputs == outs)
            steps.append(Step(op.id, strategy, tuple(loads), tuple(convs)))
            loads, convs = [], []
    return tuple(steps), tuple(convs)


def faster(
    cluster: Cluster,
    *,
    device: str | None = None,
    collective: str | None = None,
    link: bool = False,
    memory: str | None = None,
    factor: float = 1.1,
) -> Cluster:
    """``cluster`` with one thing ``factor`` times faster: a device's throughput (its ``flops`` and, with a
    device model, the model's peak and vector flop/s), a collective kind's bandwidth, or the intra-machine
    link (``link=True``); or ``factor`` times more memory on device ``memory``.

    >>> c = faster(Cluster.parse("2xV100"), device="v100-0", factor=2.0)
    >>> c.devices[0].flops / c.devices[1].flops
    2.0
    >>> faster(Cluster.parse("2xV100"), memory="v100-1", factor=1.5).devices[1].memory_bytes / 2**30
    24.0
    """
    if sum(x is not None and x is not False for x in (device, collective, link or None, memory)) != 1:
        raise ValueError("faster: name exactly one of device=, collective=, link=True, memory=")
    if not factor > 0:
        raise ValueError(f"faster: factor must be > 0, got {factor}")
    name = f"{cluster.name} ({_change_label(device, collective, link, factor, memory)})"
    if memory is not None:
        j = cluster.index(memory)
        devices = list(cluster.devices)
        devices[j] = dataclasses.replace(devices[j], memory_bytes=int(devices[j].memory_bytes * factor))
        return cluster.replace(name=name, devices=tuple(devices))
    if device is not None:
        j = cluster.index(device)
        d = cluster.devices[j]
        model = d.model
        if model is not None:
            model = dataclasses.replace(
                model,
                peak_flops=model.peak_flops * factor,
                vector_flops=None if model.vector_flops is None else model.vector_flops * factor,
                pool_flops=None if model.pool_flops is None else model.pool_flops * factor,
            )
        devices = list(cluster.devices)
        devices[j] = dataclasses.replace(d, flops=d.flops * factor, model=model)
        return cluster.replace(name=name, devices=tuple(devices))
    if collective is not None:
        old = cluster.collective(collective)
        return cluster.with_collectives(
            {collective: Collective(old.latency_s, old.bandwidth_Bps * factor)}
        ).replace(name=name)
    return cluster.replace(name=name, intra_machine_Bps=cluster.intra_machine_Bps * factor)


def _change_label(
    device: str | None, collective: str | None, link: bool, factor: float, memory: str | None = None
) -> str:
    pct = f"{(factor - 1) * 100:+.3g} %"
    if memory is not None:
        return f"{memory} memory {pct}"
    if device is not None:
        return f"{device} flop/s {pct}"
    if collective is not None:
        return f"{collective} bandwidth {pct}"
    return f"{INTRA_MACHINE} bandwidth {pct}"


class _Shown(abc.ABC):
    """A tuning answer: ``str()`` is its :meth:`summary`, a notebook shows its renderer's HTML."""

    _renderer: ClassVar[str] = ""

    @abc.abstractmethod
    def summary(self) -> str:
        """A few lines of text for the terminal."""

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        from .. import display

        return display.safe_html(getattr(display, self._renderer), self)


# ============================================================================================ sensitivity


@dataclass(frozen=True)
class DeviceBound:
    """One device in a :class:`Sensitivity`: ``saving_s``, what ``factor`` x its flop/s would save;
    ``tight_stages``, the stages whose computation maximum it attains; ``binding_s``, its computation in
    those stages."""

    device: str
    saving_s: float
    tight_stages: tuple[int, ...]
    binding_s: float


@dataclass(frozen=True)
class LinkBound:
    """One collective kind (or the intra-machine link) in a :class:`Sensitivity`: ``time_s``, its
    communication in the plan's step; ``saving_s``, what ``factor`` x its bandwidth would save."""

    name: str
    time_s: float
    saving_s: float


@dataclass(frozen=True)
class MemoryBound:
    """A device whose memory caps its ratio in a :class:`Sensitivity` (the plan's ratios come from the
    memory-capped LP, :func:`hapnb.synth.balance.memory_lp`, and more memory on the device would save time):
    ``phase``, the peak that binds (``"backward"`` or ``"optimizer step"``); ``capacity_bytes``;
    ``saving_s``, what ``factor`` x its memory would save (first order)."""

    device: str
    phase: str
    capacity_bytes: int
    saving_s: float


@dataclass(frozen=True)
class StageBound:
    """One stage in a :class:`Sensitivity`: its communication and computation maximum, the devices
    whose computation attains the maximum (``tight``), and the devices whose shard sets the time of a
    ratio-dependent collective (``comm_tight``)."""

    stage: int
    comm_s: float
    comp_s: float
    tight: tuple[str, ...]
    comm_tight: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sensitivity(_Shown):
    """What bounds a plan's step (:func:`sensitivity`). ``basis``: ``"lp"`` (first order by the ratio LP's
    duals: the ratios re-balance with the change) or ``"fixed ratios"`` (the plan's ratios are not the
    LP's optimum: its cost re-priced at those ratios). ``factor``: the speed-up each saving is for.
    ``other``: other tight LP rows with their dual values (seconds per unit of the row), e.g. ratio
    pins or constraints a later LP adds."""

    _renderer: ClassVar[str] = "sensitivity_html"

    plan: str
    cluster: str
    cost_s: float
    factor: float
    basis: str
    devices: tuple[DeviceBound, ...]
    links: tuple[LinkBound, ...]
    stages: tuple[StageBound, ...] = ()
    other: tuple[tuple[str, float], ...] = ()
    solver: str = ""
    memory: tuple[MemoryBound, ...] = ()

    def saving(
        self,
        device: str | None = None,
        collective: str | None = None,
        link: bool = False,
        memory: str | None = None,
    ) -> float:
        """The predicted saving (seconds) of one change, as :func:`faster` names it (``memory``: a device
        whose memory is not binding saves 0)."""
        if memory is not None:
            return next((m.saving_s for m in self.memory if m.device == memory), 0.0)
        if device is not None:
            return next(d.saving_s for d in self.devices if d.device == device)
        name = INTRA_MACHINE if link else collective
        for x in self.links:
            if x.name == name:
                return x.saving_s
        return 0.0  # a collective the plan does not use

    @property
    def binding(self) -> tuple[str, ...]:
        """Devices and links by predicted saving, largest first (those that save anything)."""
        items = [(d.saving_s, d.device) for d in self.devices] + [(x.saving_s, x.name) for x in self.links]
        items += [(m.saving_s, f"{m.device} memory") for m in self.memory]
        return tuple(n for s, n in sorted(items, key=lambda t: (-t[0], t[1])) if s > 1e-12 * self.cost_s)

    def lines(self, limit: int = 4) -> list[str]:
        """A few lines for :meth:`hapnb.plans.plan.Plan.summary`: what saves most per +10 %."""
        pct = f"+{(self.factor - 1) * 100:.3g} %"
        devs = sorted(self.devices, key=lambda d: (-d.saving_s, d.device))[:limit]
        links = sorted(self.links, key=lambda x: (-x.saving_s, x.name))[:limit]
        out = [
            f"  what bounds the step ({'first order by the ratio LP duals' if self.basis == 'lp' else 'at fixed ratios'}):",
            f"    {pct} flop/s saves: " + ", ".join(f"{d.device} {d.saving_s * 1e3:.3g} ms" for d in devs),
        ]
        if links:
            out.append(
                f"    {pct} bandwidth saves: "
                + ", ".join(f"{x.name} {x.saving_s * 1e3:.3g} ms" for x in links)
            )
        if self.memory:
            mem = sorted(self.memory, key=lambda m: (-m.saving_s, m.device))[:limit]
            out.append(
                f"    memory binds; {pct} memory saves: "
                + ", ".join(f"{m.device} {m.saving_s * 1e3:.3g} ms" for m in mem)
            )
        return out

    def summary(self) -> str:
        pct = f"+{(self.factor - 1) * 100:.3g} %"
        lines = [
            f"What bounds the step of {self.plan} on {self.cluster} ({self.cost_s * 1e3:.4g} ms; "
            + (
                "first order by the ratio LP's duals, ratios re-balanced"
                if self.basis == "lp"
                else "at the plan's fixed ratios"
            )
            + ")",
            f"  {'device':<14} {'saves per ' + pct + ' flop/s':>26} {'tight in stages':>16} {'binding computation':>20}",
        ]
        for d in self.devices:
            lines.append(
                f"  {d.device:<14} {d.saving_s * 1e3:>23.4g} ms {len(d.tight_stages):>9}/{len(self.stages) or '-':<6}"
                f" {d.binding_s * 1e3:>17.4g} ms"
            )
        if self.links:
            lines.append(f"  {'link':<14} {'saves per ' + pct + ' bandwidth':>26} {'time in step':>16}")
            for x in self.links:
                lines.append(f"  {x.name:<14} {x.saving_s * 1e3:>23.4g} ms {x.time_s * 1e3:>13.4g} ms")
        for m in self.memory:
            lines.append(
                f"  memory of {m.device} ({m.capacity_bytes / 2**30:.4g} GiB) binds in the {m.phase}: "
                f"{pct} memory saves {m.saving_s * 1e3:.4g} ms"
            )
        for name, pi in self.other:
            lines.append(f"  tight row {name}: dual {pi:.4g}")
        return "\n".join(lines)


@without_gc
def sensitivity(plan: Plan, factor: float = 1.1, *, planner: Any = None) -> Sensitivity:
    """What bounds ``plan``'s step (see the module docstring); kept in the planner's memo. ``planner``: the
    :class:`~hapnb.plans.planner.Planner` to use (default: the plan's own)."""
    p = _planner(plan, planner, "sensitivity")
    key = sensitivity_key(plan, factor, p.args)
    fixed, check_memory = key[-2], key[-1]
    return p.memo.get(
        "sensitivity", key, lambda: _sensitivity(plan, p.theory, float(factor), fixed, check_memory)
    )


def sensitivity_key(plan: Plan, factor: float, args: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a plan's sensitivity depends on (its memo key), under synthesize's arguments ``args``; the last
    two entries: whether the ratios were fixed (``ratios=[...]``: no LP re-balances them) and whether
    memory was checked."""
    r = args.get("ratios")
    fixed = r is not None and not isinstance(r, Mapping)
    check_memory = bool(args.get("check_memory", True))
    return (plan.cluster, plan.program, plan.ratios, plan.ratio_pins, plan.duplex, plan.cost_s, float(factor),
            fixed, check_memory)  # fmt: skip


def _twins(plan: Plan, steps: Sequence[Step]) -> dict[str, str]:
    """Device -> the first device the LP cannot tell it from: of one class of
    :func:`hapnb.synth.balance.device_classes` (the same flop/s, device model, GPUs and memory) and with the same
    ratio pin (the LP is then symmetric in the two, so a change to either saves the same), unless the
    program re-cuts tensors between ratio segments (a reshard's cost depends on the devices' order)."""
    names = plan.cluster.names
    if any(cv.name == "reshard" for st in steps for cv in st.conversions):
        return {d: d for d in names}
    pins = {d: (lo, hi) for d, lo, hi in plan.ratio_pins}
    out = {}
    for cls in device_classes(plan.cluster):
        first: dict[Any, str] = {}
        for j in cls:
            out[names[j]] = first.setdefault(pins.get(names[j]), names[j])
    return out


def _changes(
    plan: Plan, twins: Mapping[str, str], memory: Sequence[str] = ()
) -> list[tuple[str, dict[str, Any]]]:
    """The changes a sensitivity prices: a device of each kind the LP can tell apart (:func:`_twins`),
    every collective kind the plan uses, the intra-machine link when a device is a machine of several
    GPUs, and more memory on each device in ``memory`` (those whose memory cap binds)."""
    out: list[tuple[str, dict[str, Any]]] = [(d, {"device": d}) for d in plan.cluster.names if twins[d] == d]
    out += [(f"{d} memory", {"memory": d}) for d in memory]
    used = _link_times(plan)
    out += [(k, {"collective": k}) for k, _ in plan.cluster.collectives if used.get(k, 0.0) > 0]
    if any(d.gpus > 1 for d in plan.cluster.devices):
        out.append((INTRA_MACHINE, {"link": True}))
    return out


def _link_times(plan: Plan) -> dict[str, float]:
    """Seconds of communication per collective kind in the plan's step (from its priced instructions)."""
    out: dict[str, float] = {}
    for ins in plan.program:
        for cc in ins.comm:
            out[cc.kind] = out.get(cc.kind, 0.0) + cc.time_s
    return out


def _cost_at(cm: CostModel, steps: Sequence[Step], ratios: Any, duplex: bool) -> float:
    return duplex_cost(cm, steps, ratios) if duplex else cm.evaluate(steps, ratios).cost_s


def _sensitivity(
    plan: Plan, th: Theory, factor: float, fixed: bool, check_memory: bool = True
) -> Sensitivity:
    steps, convs = program_steps(plan, th)
    c = plan.cluster
    cm = CostModel(th, c)
    pins = parse_ratio_pins({d: (lo, hi) for d, lo, hi in plan.ratio_pins}, c.names)
    twins = _twins(plan, steps)
    lp = ratio_lp(cm, steps, pins, duplex=plan.duplex)
    sol = solve_lp(lp, pins)
    if check_memory and not fixed and not plan.duplex and max(overflow(cm, steps, convs, sol.ratios)) > 0:
        # the plain LP's ratios overflow a device: the plan's ratios come from the memory-capped LP
        with contextlib.suppress(MemoryCapError):
            lp, sol = memory_lp(cm, steps, convs, pins, symmetric=False)
    # the plan's ratios are the LP's optimum (to the solvers' precision: CBC's goes through a file)
    at_lp = not fixed and abs(sol.cost - plan.cost_s) <= 1e-5 * max(abs(plan.cost_s), 1e-15)
    capped = at_lp and lp.memory is not None  # memory caps in the LP: price more memory on each device
    changes = _changes(plan, twins, [d for d in c.names if twins[d] == d] if capped else [])
    clusters = [faster(c, factor=factor, **kw) for _, kw in changes]
    if at_lp:
        others = [
            ratio_lp(CostModel(th, c2), steps, pins, duplex=plan.duplex, unit=lp.unit, memory=lp.memory,
                     memory_slack=lp.memory_slack)
            for c2 in clusters
        ]  # fmt: skip
        changed = lp_changes(lp, sol, others)
        savings = []
        for ch, other in zip(changed, others):
            if ch is None:  # the LP's structure changed with the edit: re-solve it (exact)
                ch = solve_lp(other, pins).cost - sol.cost
            savings.append(-ch)
    else:
        savings = [
            plan.cost_s - _cost_at(CostModel(th, c2), steps, plan.ratios, plan.duplex) for c2 in clusters
        ]
    # a faster device or link never makes the optimum worse: what is below zero is the solver's rounding
    tiny = 1e-9 * abs(plan.cost_s)
    saving = {name: 0.0 if abs(s) <= tiny else s for (name, _), s in zip(changes, savings)}
    saving.update({d: saving[t] for d, t in twins.items()})
    if capped:
        saving.update({f"{d} memory": saving[f"{t} memory"] for d, t in twins.items()})
    stages, tight_of = _stage_bounds(plan, steps, cm, lp, sol, at_lp)
    devices = tuple(
        DeviceBound(
            d,
            saving[d],
            tuple(k for k, names in tight_of.items() if d in names),
            sum(
                plan.stages[k].comp_s[j]
                for k, names in tight_of.items()
                if d in names and k < len(plan.stages)
            ),
        )
        for j, d in enumerate(c.names)
    )
    times = _link_times(plan)
    links = tuple(
        LinkBound(name, times.get(name, 0.0) if name != INTRA_MACHINE else 0.0, saving[name])
        for name, kw in changes
        if "collective" in kw or "link" in kw
    )
    memory = tuple(
        MemoryBound(d, _memory_phase(sol, j), c.devices[j].memory_bytes, saving[f"{d} memory"])
        for j, d in enumerate(c.names)
        if capped and saving[f"{d} memory"] > 0
    )
    other = ()
    if at_lp and not plan.duplex:
        other = tuple(
            (name, pi)
            for name, pi in sorted(sol.duals.items())
            if row_role(name)[0] == "other" and abs(pi) > 1e-12
        )
    return Sensitivity(plan.name, c.name, plan.cost_s, factor, "lp" if at_lp else "fixed ratios", devices, links,
                       stages, other, sol.solver, memory)  # fmt: skip


def _memory_phase(sol: Any, j: int) -> str:
    """Which of device j's memory caps binds: the one with the larger dual value (``mem_bwd_j``: the
    backward's peak, ``mem_opt_j``: the optimizer step's)."""
    bwd, opt = (abs(sol.duals.get(f"mem_{k}_{j}", 0.0)) for k in ("bwd", "opt"))
    return "optimizer step" if opt > bwd else "backward"


def _stage_bounds(
    plan: Plan, steps: Sequence[Step], cm: CostModel, lp: Any, sol: Any, at_lp: bool
) -> tuple[tuple[StageBound, ...], dict[int, tuple[str, ...]]]:
    """Per plan stage: the devices whose computation is tight (the LP's rows where the plan is the LP's
    optimum and the LP is the plain one, else the stage's own maximum)."""
    names = plan.cluster.names
    stage_of_step = {}
    for sc in cm.evaluate(steps, plan.ratios).stages:
        for i in sc.steps:
            stage_of_step[i] = sc.index
    tight: dict[int, set[str]] = {}
    comm: dict[int, set[str]] = {}
    if at_lp and not plan.duplex:
        groups = cm.stages(steps)
        rows = lp.rows()
        for name, slack in sol.slacks.items():
            role, k, j, _ = row_role(name)
            if role not in ("comp", "comm") or k >= len(groups):
                continue
            row = rows[name]
            scale = max(1.0, abs(sum(abs(a) * sol.values.get(v.name, 0.0) for v, a in row.items())))
            if abs(slack) <= _TIGHT * scale:
                stage = stage_of_step[groups[k][0]]
                (tight if role == "comp" else comm).setdefault(stage, set()).add(names[j])
    else:
        for st in plan.stages:
            mx = max(st.comp_s) if st.comp_s else 0.0
            tight[st.index] = {names[j] for j, x in enumerate(st.comp_s) if mx > 0 and x >= mx * (1 - _TIGHT)}
    tight_of = {k: tuple(d for d in names if d in v) for k, v in tight.items()}
    stages = tuple(
        StageBound(
            st.index,
            st.comm_s,
            max(st.comp_s) if st.comp_s else 0.0,
            tight_of.get(st.index, ()),
            tuple(d for d in names if d in comm.get(st.index, set())),
        )
        for st in plan.stages
    )
    return stages, tight_of


# ============================================================================================ what if


@dataclass(frozen=True)
class WhatIf(_Shown):
    """One "what if" edit (:func:`what_if`): ``predicted_s``, the saving the LP's duals predict (None when
    the change is not one :func:`sensitivity` prices), and the plan re-planned on the edited cluster."""

    _renderer: ClassVar[str] = "what_if_html"

    change: str
    cost_s: float
    predicted_s: float | None
    replanned: Plan = field(compare=False, repr=False)

    @property
    def replanned_s(self) -> float:
        """The saving the re-plan achieves (it may also change the program)."""
        return self.cost_s - self.replanned.cost_s

    def summary(self) -> str:
        pred = "-" if self.predicted_s is None else f"{self.predicted_s * 1e3:.4g} ms"
        return (
            f"{self.change}: re-planned {self.replanned.cost_s * 1e3:.4g} ms (saves {self.replanned_s * 1e3:.4g} ms); "
            f"the duals predicted {pred}"
        )


@without_gc
def what_if(
    plan: Plan,
    *,
    device: str | None = None,
    collective: str | None = None,
    link: bool = False,
    memory: str | None = None,
    factor: float = 1.1,
    planner: Any = None,
) -> WhatIf:
    """Apply one change (:func:`faster`) and re-plan: the re-planned cost next to the dual's prediction
    (the prediction comes from :func:`sensitivity` at the same factor). ``planner``: the
    :class:`~hapnb.plans.planner.Planner` to use (default: the plan's own)."""
    p = _planner(plan, planner, "what_if")
    c2 = faster(plan.cluster, device=device, collective=collective, link=link, memory=memory, factor=factor)
    new = p.replan(plan, cluster=c2)
    pred = sensitivity(plan, factor, planner=p).saving(
        device=device, collective=collective, link=link, memory=memory
    )
    return WhatIf(_change_label(device, collective, link, factor, memory), plan.cost_s, pred, new)


def _zero_level(load_name: str) -> int:
    """The ZeRO level of a load instruction's name (``load_zero3`` -> 3; ``load``, ``load_sfb`` -> 0), as
    :func:`hapnb.plans.plan.make_plan` names them."""
    return int(load_name.removeprefix("load_zero")) if load_name.startswith("load_zero") else 0
