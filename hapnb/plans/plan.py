"""The Plan: a synthesized distributed program with its ratios, stages, history and provenance.

A plan is a frozen value and saves to a versioned, self-contained JSON (``"format": 1``; docs/architecture.md §4):
cluster, ratios, program (instructions with their tensors, forms, collective kinds and static shard
lengths), per-stage costs, pins, search stats and the graph fingerprint it was made for. Loading never
executes code.

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)  # doctest: +SKIP
>>> hapnb.Plan.from_json(plan.to_json()) == plan  # doctest: +SKIP
True

Tuning (``plan.replan(...)``, ``plan.why_not(pins)``, ``plan.sensitivity()``) is the
:class:`~hapnb.plans.planner.Planner`'s: a plan a planner made carries it (``plan.planner``: not compared,
not in JSON) and these methods hand the plan back to it. A plan loaded from JSON is data only and carries
none: ``hapnb.Planner.for_plan(plan)`` rebuilds its model once and tunes it. Displaying a plan never
computes anything: its summary shows what bounds the step only when the planner already knows it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from ..hardware.cluster import Cluster
from ..ir.collective_table import FREE
from ..ir.forms import Form, parse_recut
from ..synth.history import Round

#: ``Plan.search`` entries that hold timings or how the graph was traced (not the plan itself)
TIMING_STATS = ("search_s", "balance_s", "build_s", "trace_s", "trace_path")

__all__ = [
    "CommCost", "Instruction", "Stage", "Round", "Plan", "PLAN_FORMAT", "freeze_mapping", "save_json",
    "load_json", "NoPlannerError",
]  # fmt: skip

PLAN_FORMAT = 1


class NoPlannerError(ValueError):
    """A plan that carries no :class:`~hapnb.plans.planner.Planner` (loaded from JSON, or made by
    :func:`~hapnb.plans.packaging.make_plan` directly) was asked to re-plan or explain itself."""


@dataclass(frozen=True)
class CommCost:
    """One communication term of an instruction at the plan's ratios (a :class:`hapnb.cost.model.Term` priced):
    ``forward_s`` + ``backward_s`` seconds (the backward's part runs in the backward pass); a gradient
    all-reduce of a replicated parameter has ``gradient`` set and its gradient's ``nbytes`` (for DDP
    bucketing). JSON: ``{"what", "kind", "forward_s", "backward_s"[, "gradient_bytes"]}``.

    >>> c = CommCost("all_gather h", "all_gather", 1e-3, 2e-3)
    >>> CommCost.from_json(c.to_json()) == c, c.time_s
    (True, 0.003)
    """

    what: str
    kind: str
    forward_s: float
    backward_s: float
    gradient: bool = False
    nbytes: int = 0

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "what": self.what,
            "kind": self.kind,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
        }
        if self.gradient:
            d["gradient_bytes"] = self.nbytes
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> CommCost:
        grad = "gradient_bytes" in d
        return CommCost(
            str(d["what"]),
            str(d["kind"]),
            float(d["forward_s"]),
            float(d["backward_s"]),
            grad,
            int(d["gradient_bytes"]) if grad else 0,
        )


@dataclass(frozen=True)
class Instruction:
    """One instruction of the distributed program, by names (self-contained, JSON-able).

    ``kind``: ``load`` (``tensor`` loaded in ``form``; ``name`` is ``load``, ``load_sfb``, or ``load_zero2`` /
    ``load_zero3`` for a parameter stored sharded in ``src`` (``G<d>``) and all-gathered to ``form`` ``I``
    before use, see :class:`hapnb.cost.model.Load`),
    ``collective`` (``name`` from theory.COLLECTIVES, ``tensor`` from ``src`` to ``form``) or
    ``compute`` (``op`` run with strategy ``name``; ``inputs``/``outputs`` are (tensor, form) pairs).

    Costs at the plan's ratios, for :mod:`hapnb.plans.simulation` (empty in plans made before them):
    ``comp_s`` (compute only) the seconds per device of forward + backward (the cost model's step
    computation, so a stage's sum is ``Stage.comp_s``); ``comm`` the communication terms the cost model
    charges to this instruction (a load: its gradient all-reduce; a collective: its forward and backward;
    a compute step with SFB: the sufficient-factor gathers).
    """

    kind: str
    name: str
    stage: int
    tensor: str = ""
    src: str = ""
    form: str = ""
    op: str = ""
    target: str = ""
    inputs: tuple[tuple[str, str], ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()
    lengths: tuple[int, ...] = ()  # reshard only: the per-rank lengths after the re-cut
    comp_s: tuple[float, ...] = ()
    comm: tuple[CommCost, ...] = ()

    def __str__(self) -> str:
        if self.kind == "compute":
            ins = ", ".join(f"{t}:{f}" for t, f in self.inputs)
            outs = ", ".join(f"{t}:{f}" for t, f in self.outputs)
            return f"{outs} = {self.target.replace('aten.', '').replace('.default', '')}[{self.name}]({ins})"
        if self.kind == "load":
            stored = f":{self.src}" if self.src else ""
            return f"{self.tensor}:{self.form} = {self.name}({self.tensor}{stored})"
        return f"{self.tensor}:{self.form} = {self.name}({self.tensor}:{self.src})"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "name": self.name, "stage": self.stage}
        for k in ("tensor", "src", "form", "op", "target"):
            v = getattr(self, k)
            if v:
                d[k] = v
        if self.inputs:
            d["inputs"] = [list(p) for p in self.inputs]
        if self.outputs:
            d["outputs"] = [list(p) for p in self.outputs]
        if self.lengths:
            d["lengths"] = list(self.lengths)
        if self.comp_s:
            d["comp_s"] = list(self.comp_s)
        if self.comm:
            d["comm"] = [c.to_json() for c in self.comm]
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Instruction:
        return Instruction(
            kind=str(d["kind"]),
            name=str(d["name"]),
            stage=int(d["stage"]),
            tensor=str(d.get("tensor", "")),
            src=str(d.get("src", "")),
            form=str(d.get("form", "")),
            op=str(d.get("op", "")),
            target=str(d.get("target", "")),
            inputs=tuple((str(a), str(b)) for a, b in d.get("inputs", ())),
            outputs=tuple((str(a), str(b)) for a, b in d.get("outputs", ())),
            lengths=tuple(int(x) for x in d.get("lengths", ())),
            comp_s=tuple(float(x) for x in d.get("comp_s", ())),
            comm=tuple(CommCost.from_json(c) for c in d.get("comm", ())),
        )

    @property
    def communicates(self) -> bool:
        return self.kind == "collective" and self.name not in FREE

    # -- the forms as values (parsed once from the paper's notation the fields and the JSON keep) --
    @cached_property
    def form_value(self) -> Form | None:
        """``form`` as a :class:`~hapnb.ir.forms.Form` (a re-cut's segment is :attr:`segment`); None when empty."""
        return parse_recut(self.form)[0] if self.form else None

    @cached_property
    def segment(self) -> int | None:
        """The ratio segment a ``reshard`` re-cuts its tensor for (``form`` ``"G1@2"``), else None."""
        return parse_recut(self.form)[1] if self.form else None

    @cached_property
    def src_value(self) -> Form | None:
        """``src`` as a Form: a collective's source form, a ZeRO load's stored shard; None when empty."""
        return parse_recut(self.src)[0] if self.src else None

    @cached_property
    def src_segment(self) -> int | None:
        """The ratio segment ``src`` was re-cut for (``"G1@2"``), else None."""
        return parse_recut(self.src)[1] if self.src else None

    @cached_property
    def input_forms(self) -> tuple[tuple[str, Form, int | None], ...]:
        """A computation's inputs as (tensor, form, segment of a re-cut input or None)."""
        return tuple((t, *parse_recut(f)) for t, f in self.inputs)

    @cached_property
    def output_forms(self) -> tuple[tuple[str, Form], ...]:
        """A computation's outputs as (tensor, form)."""
        return tuple((t, parse_recut(f)[0]) for t, f in self.outputs)


@dataclass(frozen=True)
class Stage:
    """A stage: communication first (all devices synchronise), then computation until the next one."""

    index: int
    comm_s: float
    comp_s: tuple[float, ...]  # per device
    instructions: tuple[int, ...]  # indices into Plan.program
    comm: tuple[str, ...] = ()  # what communicates, e.g. "all_gather h (padded)"

    @property
    def time_s(self) -> float:
        return self.comm_s + (max(self.comp_s) if self.comp_s else 0.0)

    def idle_s(self) -> tuple[float, ...]:
        m = max(self.comp_s) if self.comp_s else 0.0
        return tuple(m - c for c in self.comp_s)


def _tuplify(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    return x


@dataclass(frozen=True)
class Plan:
    """A synthesized plan (program Q paired with the ratios B optimised for it)."""

    name: str
    graph_fingerprint: str
    cluster: Cluster
    ratios: tuple[tuple[float, ...], ...]
    program: tuple[Instruction, ...]
    lengths: tuple[tuple[str, int, tuple[int, ...]], ...]  # (tensor, dim, per-rank lengths)
    stages: tuple[Stage, ...]
    cost_s: float
    lower_bound_s: float
    history: tuple[Round, ...] = ()
    pins: tuple[tuple[str, str], ...] = ()
    ratio_pins: tuple[tuple[str, float, float], ...] = ()
    search: tuple[tuple[str, Any], ...] = ()
    fallback_ops: tuple[tuple[str, str], ...] = ()
    memory_bytes: tuple[int, ...] = ()
    model: tuple[tuple[str, Any], ...] = ()  # how to rebuild: {"name": zoo name or factory, "options": {...}}
    options: tuple[tuple[str, Any], ...] = ()
    synthesis_s: float = 0.0
    graph: Any = field(default=None, compare=False, repr=False)
    # per device: (category, bytes) pairs of the predicted peak (hapnb.cost.memory.MEMORY_CATEGORIES)
    memory_breakdown: tuple[tuple[tuple[str, int], ...], ...] = ()
    #: HiDup's duplex schedule: the batch runs as two micro-batches, one computing while the other
    #: communicates, gradients accumulated before the update (``cost_s`` is then the duplex cost)
    duplex: bool = False
    #: seconds of the optimizer step per device at the plan's ratios (the cost model charges it to the
    #: last stage; zeros on flops-only clusters; empty in plans made before it)
    optimizer_s: tuple[float, ...] = ()
    #: the iteration time the overlap simulator gives (:func:`hapnb.simulate`: DDP-bucketed gradient
    #: all-reduces behind the backward, feature collectives beside unrelated computation); None when not
    #: simulated. ``cost_s`` stays the stage model's (or the duplex ψ) cost, the number the search optimises.
    simulated_s: float | None = None
    #: the :class:`~hapnb.plans.planner.Planner` that made the plan (its theory, arguments and caches;
    #: not compared, not in JSON): what :meth:`replan`, :meth:`why_not` and :meth:`sensitivity` hand the
    #: plan to. None for a plan loaded from JSON.
    planner: Any = field(default=None, compare=False, repr=False)

    @property
    def costed(self) -> bool:
        """Whether the plan carries per-instruction costs (what :mod:`hapnb.plans.simulation` overlaps)."""
        return bool(self.optimizer_s) and all(i.comp_s for i in self.program if i.kind == "compute")

    # ------------------------------------------------------------------ views
    @property
    def devices(self) -> tuple[str, ...]:
        return self.cluster.names

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self.search)

    @property
    def model_spec(self) -> dict[str, Any] | None:
        """How to rebuild the model, as ``zoo.ModelSpec`` JSON (options as an object, however stored)."""
        if not self.model:
            return None
        out = _jsonable(dict(self.model))
        opts = out.get("options")
        if isinstance(opts, list):  # pairs, as a loaded plan may hold them
            out["options"] = {str(k): v for k, v in opts}
        return out

    def lengths_of(self, tensor: str, dim: int) -> tuple[int, ...]:
        for t, d, ls in self.lengths:
            if t == tensor and d == dim:
                return ls
        raise KeyError(f"plan has no shard lengths for {tensor} dim {dim}")

    def form_of(self, tensor: str) -> list[str]:
        """Every form the program gives ``tensor`` (in program order)."""
        out = []
        for ins in self.program:
            if ins.kind in ("load", "collective") and ins.tensor == tensor:
                out.append(ins.form)
            for t, f in ins.outputs:
                if t == tensor:
                    out.append(f)
        return out

    def batch_slice(self, rank: int, input_name: str | None = None) -> slice:
        """The slice of the global batch that ``rank`` loads for a G-loaded input (full batch if I)."""
        for ins in self.program:
            if ins.kind == "load" and (input_name is None or ins.tensor == input_name):
                if input_name is None and not self._is_input(ins.tensor):
                    continue
                f = ins.form_value
                if f is None or f.kind != "G":
                    return slice(None)
                ls = self.lengths_of(ins.tensor, f.dim)
                start = sum(ls[:rank])
                return slice(start, start + ls[rank])
        return slice(None)

    def _is_input(self, name: str) -> bool:
        return name in dict(self.options).get("inputs", ())

    def without_timings(self) -> Plan:
        """This plan with its timings zeroed and how its graph was traced dropped: the only fields in which
        two runs of the same synthesis may differ, so ``a.without_timings() == b.without_timings()`` says
        two plans are the same plan."""
        return replace(
            self,
            synthesis_s=0.0,
            history=tuple(replace(r, search_s=0.0, balance_s=0.0) for r in self.history),
            search=tuple((k, v) for k, v in self.search if k not in TIMING_STATS),
        )

    # ------------------------------------------------------------------ tuning
    def replan(
        self,
        pins: Mapping[str, Any] | None = None,
        ratio_pins: Mapping[str, Any] | None = None,
        cluster: Any = None,
        *,
        exact: bool = True,
    ) -> Plan:
        """This plan re-planned with these pins / ratio pins merged into its own (``None`` removes one) and
        on ``cluster`` (default: this plan's), reusing every search, LP and simulation that did not change
        (:func:`hapnb.plans.synthesis.replan`). ``exact=True`` (default): the plan a fresh ``hapnb.synthesize``
        makes with the merged inputs. ``exact=False`` (fast): the Q/B loop from this plan's ratios without
        the baseline seeds: a fixpoint of the loop that keeps every pin, but maybe not the fresh plan
        (``stats["replan"] == "fast"``; the contract is :func:`hapnb.plans.synthesis.replan`'s)."""
        return self.require_planner("replan").replan(
            self, pins=pins, ratio_pins=ratio_pins, cluster=cluster, exact=exact
        )

    def why_not(self, pins: Mapping[str, Any]) -> Any:
        """Why the search did not choose these forms: the best plan with ``pins`` added, its cost and the
        difference per stage block, or where no program satisfies them (:class:`hapnb.plans.whynot.WhyNot`)."""
        return self.require_planner("why_not").why_not(self, pins)

    def sensitivity(self, factor: float = 1.1) -> Any:
        """What bounds the step: binding devices per stage and what a device or collective ``factor``
        times faster (or a device whose memory caps its ratio, ``factor`` times larger) would save, from
        the ratio LP's dual values (:class:`hapnb.plans.explain.Sensitivity`)."""
        return self.require_planner("sensitivity").sensitivity(self, factor)

    def gantt(self, **kw: Any) -> Any:
        """A bokeh Gantt chart of the stages per device (needs bokeh)."""
        from .. import display

        return display.gantt(self, **kw)

    def same_program(self, other: Plan) -> bool:
        """Whether ``other`` runs the same instructions (loads, collectives and strategies, in the same
        order), whatever its ratios and costs."""
        return [str(i) for i in self.program] == [str(i) for i in other.program]

    def summary(self) -> str:
        lines = [
            f"Plan for {self.name} on {self.cluster.name} ({self.cluster.n} devices)",
            f"  cost {self.cost_s * 1e3:.3f} ms/iteration{' (duplex)' if self.duplex else ''} (lower bound "
            f"{self.lower_bound_s * 1e3:.3f} ms), {len(self.stages)} stages, {len(self.program)} instructions"
            + (
                f"; simulated with overlap {self.simulated_s * 1e3:.3f} ms"
                if self.simulated_s is not None
                else ""
            ),
            "  ratios: " + "; ".join(", ".join(f"{x:.3f}" for x in row) for row in self.ratios),
        ]
        if self.history:
            lines.append(
                "  Q/B rounds (ms): "
                + " -> ".join(
                    ("" if r.source == "search" else f"[{r.source}] ")
                    + f"{r.balanced_cost_s * 1e3:.3f}"
                    + (" *" if r.accepted else "")
                    for r in self.history
                )
                + "   (* = new best)"
            )
        comm = sum(1 for i in self.program if i.communicates)
        updates = sum(1 for i in self.program for c in i.comm if c.what.startswith("buffer update "))
        params = dict(self.options).get("params", ())
        loads = [i for i in self.program if i.kind == "load" and i.tensor in params]
        synced = sum(1 for i in loads if i.name == "load" and i.form == "I")
        zero = {z: sum(1 for i in loads if i.name == f"load_zero{z}") for z in (2, 3)}
        lines.append(
            f"  {comm} collectives in the program"
            + (f" (+{updates} for buffer updates)" if updates else "")
            + f", {synced} replicated parameters (gradient all-reduce); "
            + "".join(f"{v} stored sharded (ZeRO-{z}); " for z, v in zero.items() if v)
            + f"synthesis {self.synthesis_s:.2f} s"
        )
        if self.stats.get("optimal") is False:  # a search stopped at its budget: its proven gap
            lines.append(
                f"  not proven optimal: optimal_gap {self.stats.get('gap', 0.0):.2%} (to the A* bound)"
            )
            lines.append("    " + _budget_note(self.stats))
        if self.fallback_ops:
            lines.append(
                f"  ops without a rule (run replicated): {', '.join(n for n, _ in self.fallback_ops)}"
            )
        if self.pins:
            lines.append("  pins: " + ", ".join(f"{t}={f}" for t, f in self.pins))
        sens = self.known_sensitivity()
        if sens is not None:
            lines += sens.lines()
        elif self.planner is not None:
            lines.append("  what bounds the step: plan.sensitivity()")
        return "\n".join(lines)

    def known_sensitivity(self) -> Any:
        """:meth:`sensitivity` when the plan's planner has already computed it, else None (a display
        never solves an LP)."""
        return None if self.planner is None else self.planner.known_sensitivity(self)

    def require_planner(self, verb: str) -> Any:
        """The plan's planner, or :class:`NoPlannerError` saying that ``verb`` needs one and how to get it."""
        if self.planner is None:
            raise NoPlannerError(
                f"plan {self.name!r} carries no planner (a plan loaded from JSON is data: it never rebuilds "
                f"its model by itself), so it cannot {verb.replace('_', ' ')}: "
                f"planner = hapnb.Planner.for_plan(plan) rebuilds the model from the plan's recorded spec "
                f"once, then planner.{verb}(plan, ...)"
            )
        return self.planner

    def __str__(self) -> str:
        return self.summary() + "\n" + "\n".join(f"  [{i.stage:3d}] {i}" for i in self.program)

    def _repr_html_(self) -> str:
        from .. import display

        sens = self.known_sensitivity()
        extra = "" if sens is None else display.safe_html(display.sensitivity_html, sens)
        return display.safe_html(display.plan_html, self) + extra

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "name": self.name,
            "graph_fingerprint": self.graph_fingerprint,
            "model": _jsonable(self.model) if self.model else None,
            "cluster": self.cluster.to_json(),
            "ratios": [list(r) for r in self.ratios],
            "program": [i.to_json() for i in self.program],
            "lengths": [[t, d, list(ls)] for t, d, ls in self.lengths],
            "stages": [
                {
                    "index": s.index,
                    "comm_s": s.comm_s,
                    "comp_s": list(s.comp_s),
                    "instructions": list(s.instructions),
                    "comm": list(s.comm),
                }
                for s in self.stages
            ],
            "cost_s": self.cost_s,
            "lower_bound_s": self.lower_bound_s,
            "history": [
                {**{f.name: getattr(r, f.name) for f in fields(Round)}, "ratios": [list(x) for x in r.ratios]}
                for r in self.history
            ],
            "pins": {t: f for t, f in self.pins},
            "ratio_pins": [[d, lo, hi] for d, lo, hi in self.ratio_pins],
            "search": dict(self.search),
            "fallback_ops": [list(p) for p in self.fallback_ops],
            "memory_bytes": list(self.memory_bytes),
            "memory_breakdown": [dict(b) for b in self.memory_breakdown],
            "options": _jsonable(dict(self.options)),
            "synthesis_s": self.synthesis_s,
            "duplex": self.duplex,
            **({"optimizer_s": list(self.optimizer_s)} if self.optimizer_s else {}),
            "simulated_s": self.simulated_s,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any], source: str = "<plan JSON>") -> Plan:
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: a plan is a JSON object, got {type(d).__name__}")
        if d.get("kind") == "pipeline":
            raise ValueError(
                f'{source}: this is a pipeline plan ("kind": "pipeline"), not an SPMD plan; load it with '
                "hapnb.PipelinePlan.load"
            )
        fmt = d.get("format")
        if fmt != PLAN_FORMAT:
            raise ValueError(
                f"{source}: plan format {fmt!r} is not supported (this hapnb reads format {PLAN_FORMAT})"
            )
        try:
            return Plan(
                name=str(d["name"]),
                graph_fingerprint=str(d["graph_fingerprint"]),
                cluster=Cluster.from_json(d["cluster"], source=source),
                ratios=tuple(tuple(float(x) for x in r) for r in d["ratios"]),
                program=tuple(Instruction.from_json(i) for i in d["program"]),
                lengths=tuple((str(t), int(dm), tuple(int(x) for x in ls)) for t, dm, ls in d["lengths"]),
                stages=tuple(
                    Stage(
                        int(s["index"]),
                        float(s["comm_s"]),
                        tuple(float(x) for x in s["comp_s"]),
                        tuple(int(x) for x in s["instructions"]),
                        tuple(str(x) for x in s.get("comm", ())),
                    )
                    for s in d["stages"]
                ),
                cost_s=float(d["cost_s"]),
                lower_bound_s=float(d["lower_bound_s"]),
                history=tuple(
                    Round(
                        **{
                            **{k: v for k, v in r.items() if k != "ratios"},
                            "ratios": tuple(tuple(float(x) for x in row) for row in r["ratios"]),
                        }
                    )
                    for r in d.get("history", ())
                ),
                pins=tuple((str(k), str(v)) for k, v in d.get("pins", {}).items()),
                ratio_pins=tuple((str(a), float(b), float(c)) for a, b, c in d.get("ratio_pins", ())),
                search=tuple(sorted((str(k), _tuplify(v)) for k, v in d.get("search", {}).items())),
                fallback_ops=tuple((str(a), str(b)) for a, b in d.get("fallback_ops", ())),
                memory_bytes=tuple(int(x) for x in d.get("memory_bytes", ())),
                memory_breakdown=tuple(
                    tuple((str(k), int(v)) for k, v in b.items()) for b in d.get("memory_breakdown", ())
                ),
                model=tuple(sorted((str(k), _freeze(v)) for k, v in (d.get("model") or {}).items())),
                options=tuple(sorted((str(k), _freeze(v)) for k, v in d.get("options", {}).items())),
                synthesis_s=float(d.get("synthesis_s", 0.0)),
                duplex=bool(d.get("duplex", False)),
                optimizer_s=tuple(float(x) for x in d.get("optimizer_s", ())),
                simulated_s=None if d.get("simulated_s") is None else float(d["simulated_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValueError) and str(e).startswith(source):
                raise
            raise ValueError(f"{source}: malformed plan ({type(e).__name__}: {e})") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        return save_json(path, self.to_json())

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        return Plan.from_json(load_json(path, "plan"), source=str(path))


def save_json(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON (a plan file); returns the path."""
    p = Path(path)
    p.write_text(json.dumps(data, indent=1) + "\n")
    return p


def load_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON object in a ``what`` file (e.g. "plan"), with errors that name the file."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} file at {p}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _jsonable(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, tuple):
        # frozen dicts are tuples of (str, value) pairs
        if v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
            return {k: _jsonable(x) for k, x in v}
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def freeze_mapping(m: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """A mapping as sorted (key, frozen value) pairs, the way plans store options."""
    return tuple(sorted((str(k), _freeze(v)) for k, v in (m or {}).items()))


def _budget_note(stats: Mapping[str, Any]) -> str:
    """Why a plan is not proven optimal and how to search further: the budget its searches stopped at
    (``stats["max_expansions"]``, and ``stats["memory_budget"]`` where memory-aware searches ran).

    >>> print(_budget_note({"max_expansions": 30000, "memory_budget": 3800}))
    a search stopped at its budget (30,000 expansions per search; memory-aware searches 3,800, ...): --max-expansions 120000 ...
    """
    if "max_expansions" not in stats:  # a plan written before the budget was recorded
        return "a search stopped at its budget: a larger max_expansions (--max-expansions) searches further"
    n, sec = stats["max_expansions"], stats.get("max_seconds")
    if n is None:
        return f"a search stopped at its time limit ({sec} s per search): --max-seconds (hapnb plan) or synthesize(..., max_seconds=) longer searches further"
    mem = stats.get("memory_budget")
    more = 4 * n
    return (
        f"a search stopped at its budget ({n:,} expansions per search"
        + (f"; memory-aware searches {mem:,}, scaled by the same factor" if mem else "")
        + f"): --max-expansions {more} (hapnb plan) or synthesize(..., max_expansions={more}) searches further"
    )
