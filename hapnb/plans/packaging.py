"""Packaging: a searched program and its ratios as a :class:`~hapnb.plans.plan.Plan` value.

:func:`make_plan` prices every step under the cost model once, cuts the program into stages, writes one
:class:`~hapnb.plans.plan.Instruction` per load, collective and computation (each with the terms the cost
model charges to it; the buffer updates' collectives, :mod:`hapnb.cost.buffers`, go to the last
computation) and records the shard lengths every sharded form needs, the predicted memory per
device and the ops that run replicated for lack of a rule. It is the only place that turns the search's
steps into a plan; :func:`hapnb.plans.explain.program_steps` reads them back.

>>> import hapnb
>>> from hapnb.synth.search import Search
>>> model, inputs, _ = hapnb.zoo.build("mlp", layers=1, hidden=16, input=8, batch=4)
>>> th = hapnb.theory(hapnb.trace(model, inputs))
>>> c = hapnb.Cluster.parse("2xV100")
>>> s = Search(th, c)
>>> plan = make_plan(th, c, s.run().program, s.final_conversions(), s.ratios)
>>> plan.cost_s > 0 and len(plan.stages) >= 1
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..cost.model import Conversion, CostModel, Step
from ..hardware.cluster import Cluster
from ..ir.forms import Form
from ..synth.history import Round
from ..triples import Theory, coverage
from .plan import CommCost, Instruction, Plan, Stage, freeze_mapping

__all__ = ["make_plan"]


def make_plan(
    th: Theory,
    cluster: Cluster,
    program: Sequence[Step],
    extra: Sequence[Conversion],
    ratios: tuple[tuple[float, ...], ...],
    *,
    history: tuple[Round, ...] = (),
    pins: Mapping[str, Form] | None = None,
    ratio_pins: Sequence[Any] = (),
    stats: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    synthesis_s: float = 0.0,
    cost_model: CostModel | None = None,
) -> Plan:
    """Turn a searched program and its ratios into a :class:`Plan` (instructions, lengths, stages).
    ``cost_model``: a :class:`~hapnb.cost.model.CostModel` of ``th`` on ``cluster`` to reuse (its caches), e.g.
    when packaging several programs."""
    g = th.graph
    if cost_model is not None and (cost_model.theory is not th or cost_model.cluster != cluster):
        raise ValueError("make_plan: cost_model must be a CostModel of the same theory and cluster")
    cm = cost_model if cost_model is not None else CostModel(th, cluster)
    # each load's, conversion's and SFB step's terms and each step's computation, computed once: the
    # evaluation (stages, cost) and the instructions (their priced terms) both use them
    parts = [cm.step_parts(st) for st in program]
    step_terms = [cm.step_terms(st, p) for st, p in zip(program, parts)]
    comps = [cm.step_comp(st, ratios) for st in program]
    ev = cm.evaluate(program, ratios, terms=step_terms, comps=comps)
    stage_of_step = {i: sc.index for sc in ev.stages for i in sc.steps}
    out = _Program(th, cm, ratios)
    for k, st in enumerate(program):
        out.step(st, stage_of_step[k], parts[k], comps[k])
    last_stage = ev.stages[-1].index if ev.stages else 0
    out.buffer_updates(cm.update_terms(program), last_stage)
    for cv in extra:
        out.emit(Instruction("collective", cv.name, last_stage, tensor=out.name(cv.tensor), src=str(cv.src),
                             form=str(cv.dst)))  # fmt: skip
    stages = tuple(
        Stage(sc.index, sc.comm_s, sc.comp_s, tuple(out.stage_instrs.get(sc.index, ())),
              tuple(out.stage_comm.get(sc.index, ())))
        for sc in ev.stages
    )  # fmt: skip
    plan = Plan(
        name=g.name,
        graph_fingerprint=g.fingerprint,
        cluster=cluster,
        ratios=tuple(tuple(float(x) for x in r) for r in ratios),
        program=tuple(out.instrs),
        lengths=out.lengths(),
        stages=stages,
        cost_s=ev.cost_s,
        lower_bound_s=cm.lower_bound(),
        history=history,
        pins=tuple(sorted((k, str(v)) for k, v in (pins or {}).items())),
        ratio_pins=tuple((p.device, p.lo, p.hi) for p in ratio_pins),
        search=freeze_mapping(stats),
        fallback_ops=tuple((r.op, r.target) for r in coverage(th).fallback),
        model=freeze_mapping(model),
        options=freeze_mapping(
            {
                **(options or {}),
                "inputs": [t.name for t in g.tensors if t.role == "input"],
                "params": [t.name for t in g.tensors if t.role == "param"],
            }
        ),
        synthesis_s=synthesis_s,
        graph=g,
        optimizer_s=tuple(
            float(x) for x in (cm.optimizer_comp(program, ratios) if any(cm.models) else (0.0,) * cm.n)
        ),
    )
    breakdown = cm.memory_breakdown(program, extra, ratios)
    return replace(
        plan,
        memory_bytes=tuple(sum(b.values()) for b in breakdown),
        memory_breakdown=tuple(tuple(b.items()) for b in breakdown),
    )


@dataclass
class _Program:
    """The instructions being written: in order, by stage, what each stage communicates, and every
    (tensor, dim) a sharded form uses (each needs its shard lengths in the plan)."""

    th: Theory
    cm: CostModel
    ratios: tuple[tuple[float, ...], ...]
    instrs: list[Instruction] = field(default_factory=list)
    stage_instrs: dict[int, list[int]] = field(default_factory=dict)
    stage_comm: dict[int, list[str]] = field(default_factory=dict)
    used: set[tuple[int, int]] = field(default_factory=set)

    def name(self, t: int) -> str:
        return self.th.graph.tensors[t].name

    def emit(self, ins: Instruction) -> None:
        self.stage_instrs.setdefault(ins.stage, []).append(len(self.instrs))
        self.instrs.append(ins)

    def use(self, tensor: int, form: Form) -> None:
        if form.kind == "G":
            self.used.add((tensor, form.dim))

    def communicates(self, stage: int, terms: Sequence[Any]) -> None:
        for tm in terms:
            self.stage_comm.setdefault(stage, []).append(tm.what)

    def priced(self, terms: Sequence[Any], nbytes: int = 0) -> tuple[CommCost, ...]:
        """The cost model's terms at the plan's ratios (none on one device: nothing to talk to)."""
        if self.cm.n == 1:
            return ()
        out = []
        for tm in terms:
            total, bwd = tm.time(self.ratios), tm.backward_time(self.ratios)
            out.append(
                CommCost(tm.what, tm.kind, total - bwd, bwd, tm.gradient, nbytes if tm.gradient else 0)
            )
        return tuple(out)

    def buffer_updates(self, terms: Sequence[Any], stage: int) -> None:
        """The buffer updates' collectives (batch norm's running statistics, :mod:`hapnb.cost.buffers`),
        charged to the last computation, which they follow in every rank's forward, and to its stage."""
        last = max((k for k, ins in enumerate(self.instrs) if ins.kind == "compute"), default=None)
        if not terms or last is None:
            return
        ins = self.instrs[last]
        self.instrs[last] = replace(ins, comm=ins.comm + self.priced(terms))
        self.communicates(stage, terms)

    def step(self, st: Step, stage: int, parts: Any, comp: Sequence[float]) -> None:
        """One search step: its loads, its conversions, then its computation."""
        load_terms, conv_terms, sfb_terms = parts
        for ld, lterms in zip(st.loads, load_terms):
            kind = f"load_zero{ld.zero}" if ld.zero > 0 else "load_sfb" if ld.sfb else "load"
            self.emit(
                Instruction("load", kind, stage, tensor=self.name(ld.tensor),
                            src=str(ld.storage) if ld.zero > 0 else "", form=str(ld.form),
                            comm=self.priced(lterms, self.th.graph.tensors[ld.tensor].nbytes))
            )  # fmt: skip
            self.use(ld.tensor, ld.storage)
            self.communicates(stage, lterms)
        resharded = self.conversions(st, stage, conv_terms)
        self.communicates(stage, sfb_terms)
        op, s = self.th.graph.ops[st.op], st.strategy
        for t, f in list(zip(op.inputs, s.inputs)) + list(zip(op.outputs, s.outputs)):
            self.use(t, f)
        self.emit(
            Instruction(
                "compute",
                s.name,
                stage,
                op=op.name,
                target=op.target,
                inputs=tuple(
                    (self.name(t), resharded[t] if f.kind == "G" and t in resharded else str(f))
                    for t, f in zip(op.inputs, s.inputs)
                ),
                outputs=tuple((self.name(t), str(f)) for t, f in zip(op.outputs, s.outputs)),
                comp_s=tuple(float(x) for x in comp),
                comm=self.priced(sfb_terms),
            )
        )

    def conversions(self, st: Step, stage: int, conv_terms: Sequence[Any]) -> dict[int, str]:
        """The step's collectives; returns tensor -> ``G<d>@<segment>`` for those re-cut to another ratio
        segment (the computation reads them in that form)."""
        resharded = {}
        for cv, cterms in zip(st.conversions, conv_terms):
            if cv.name == "reshard":
                dst = f"{cv.dst}@{cv.segment}"
                resharded[cv.tensor] = dst
                lengths = self.th.lengths(cv.tensor, cv.dst.dim, self.ratios[cv.segment])
            else:
                dst, lengths = str(cv.dst), ()
            self.emit(
                Instruction("collective", cv.name, stage, tensor=self.name(cv.tensor), src=str(cv.src),
                            form=dst, lengths=lengths, comm=self.priced(cterms))
            )  # fmt: skip
            self.use(cv.tensor, cv.src)
            self.use(cv.tensor, cv.dst)
            self.communicates(stage, cterms)
        return resharded

    def lengths(self) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
        """(tensor, dim, per-rank lengths) of every sharded form the program uses."""
        return tuple(
            (self.name(t), d, self.th.lengths(t, d, self.ratios[self.cm.segment_of[t]]))
            for t, d in sorted(self.used)
        )
