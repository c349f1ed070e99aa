"""Session: the state of one interactive synthesis, without any widget.

A :class:`Session` holds what the notebook Explorer (``hapnb.widgets.Explorer``) shows and changes: the
model's graph and theory, the cluster and a draft of edits to it, a step-able search cursor, form pins
per tensor, ratio values and locks per device, the plans made so far (current, previous, the diff between
them) and the verify/launch job. The Explorer is a view over it; scripts and tests drive it directly.

>>> import hapnb
>>> s = hapnb.Session("mlp", "2xV100+2xP100", **hapnb.zoo.TINY["mlp"])
>>> s.step().popped.id  # expand the root
0
>>> s.run().complete  # A* to the end: the best complete node
True
>>> s.set_pin("x", "G0")  # data parallel
'G0'
>>> s.set_ratio("p100-0", 0.1)  # a ratio value, locked
>>> s.resynthesize().cost_s > 0
True
>>> s.diff.pins
(('x', None, 'G0'),)

Methods raise clear exceptions (naming the pin, device or collective); a re-synthesis or a cluster apply
that fails changes nothing (the plan, cluster and cursor stay as they were). Long work takes an optional ``progress`` callback that receives :class:`Progress` values.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import display
from .hardware.cluster import Cluster
from .hardware.parts import Collective, Device
from .ir.forms import Form, Storage, parse_pin
from .plans.explain import WhatIf, rebuild_graph, what_if
from .plans.packaging import make_plan
from .plans.plan import Plan, freeze_mapping
from .plans.planner import Planner
from .plans.synthesis import OutOfMemoryError, replan, synthesize
from .plans.whynot import WhyNot
from .synth.search import NoProgramError, PinError, Search, SearchEvent, SearchNode, resolve_pins
from .synth.spec import pin_choices
from .triples import Theory, theory

if TYPE_CHECKING:  # the run layer loads torch: imported inside the methods that need it
    from .run.launch import Job, JobResult

__all__ = ["Session", "Progress", "PlanDiff", "JobState", "UnknownPinError", "AUTO", "diff_plans"]

AUTO = "auto"
"""The pin value that means "no pin: the search chooses"."""


class UnknownPinError(PinError, KeyError):
    """A pin names no tensor of the program (a :class:`~hapnb.synth.search.PinError` and a ``KeyError``)."""

    __str__ = BaseException.__str__  # the message, not KeyError's quoted repr


# ============================================================================================ values


@dataclass(frozen=True)
class Progress:
    """How far a long call has come: ``done`` of ``total`` units (``total`` 0: unknown), and a line."""

    done: int
    total: int
    text: str


ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True)
class PlanDiff:
    """How plan ``new`` differs from plan ``old``: cost, pins, forms per tensor, ratios per device.

    ``pins``/``forms``/``ratios`` list only what changed: ``(tensor, old pin, new pin)`` (``None`` =
    not pinned), ``(tensor, old forms, new forms)`` in program order, ``(device, old ratio, new ratio)``
    of the first segment (old ``None`` for a device the old cluster lacks).
    """

    old_cost_s: float
    new_cost_s: float
    pins: tuple[tuple[str, str | None, str | None], ...]
    forms: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]
    ratios: tuple[tuple[str, float | None, float], ...]
    cluster: tuple[str, str] | None  # (old name, new name) when the cluster changed
    stages: tuple[int, int]
    instructions: tuple[int, int]
    same_program: bool
    old: Plan = field(compare=False, repr=False)
    new: Plan = field(compare=False, repr=False)

    @property
    def delta_s(self) -> float:
        return self.new_cost_s - self.old_cost_s

    @property
    def names(self) -> tuple[str, ...]:
        """Tensors whose pin or forms changed."""
        return tuple(dict.fromkeys([p[0] for p in self.pins] + [f[0] for f in self.forms]))

    def summary(self) -> str:
        """One line: cost change, then what changed.

        >>> from hapnb.plans.synthesis import synthesize
        >>> a = synthesize("mlp", "2xV100+2xP100", layers=2, hidden=32, input=16, batch=8)
        >>> diff_plans(a, a).summary()  # doctest: +ELLIPSIS
        'cost ... ms -> ... ms (+0 ms, +0.0%); same program'
        """
        rel = self.delta_s / self.old_cost_s if self.old_cost_s else 0.0
        parts = [
            f"cost {self.old_cost_s * 1e3:.4g} ms -> {self.new_cost_s * 1e3:.4g} ms "
            f"({'+' if self.delta_s >= 0 else ''}{self.delta_s * 1e3:.3g} ms, {rel:+.1%})"
        ]
        if self.cluster:
            parts.append(f"cluster {self.cluster[0]} -> {self.cluster[1]}")
        if self.pins:
            parts.append("pins " + ", ".join(f"{t}: {a or AUTO} -> {b or AUTO}" for t, a, b in self.pins))
        if self.ratios:
            parts.append(
                "ratios "
                + ", ".join(f"{d}: {'-' if a is None else f'{a:.3f}'} -> {b:.3f}" for d, a, b in self.ratios)
            )
        if self.forms:
            shown = ", ".join(
                f"{t}: {'/'.join(a) or '-'} -> {'/'.join(b) or '-'}" for t, a, b in self.forms[:8]
            )
            more = f" (+{len(self.forms) - 8} more)" if len(self.forms) > 8 else ""
            parts.append(f"forms {shown}{more}")
        parts.append("same program" if self.same_program else f"stages {self.stages[0]} -> {self.stages[1]}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return display.safe_html(display.plan_diff_html, self.old, self.new)


def diff_plans(old: Plan, new: Plan) -> PlanDiff:
    """The :class:`PlanDiff` from ``old`` to ``new``."""
    po, pn = dict(old.pins), dict(new.pins)
    pins = tuple((t, po.get(t), pn.get(t)) for t in dict.fromkeys([*po, *pn]) if po.get(t) != pn.get(t))
    fo, fn = display.forms_by_tensor(old), display.forms_by_tensor(new)
    forms = tuple(
        (t, fo.get(t, ()), fn.get(t, ())) for t in dict.fromkeys([*fo, *fn]) if fo.get(t) != fn.get(t)
    )
    names_old = old.cluster.names
    ratios = []
    for j, d in enumerate(new.cluster.names):
        a = old.ratios[0][names_old.index(d)] if d in names_old else None
        b = new.ratios[0][j]
        if a is None or abs(a - b) > 5e-4:
            ratios.append((d, a, b))
    return PlanDiff(
        old.cost_s,
        new.cost_s,
        pins,
        forms,
        tuple(ratios),
        (old.cluster.name, new.cluster.name) if old.cluster != new.cluster else None,
        (len(old.stages), len(new.stages)),
        (len(old.program), len(new.program)),
        [str(i) for i in old.program] == [str(i) for i in new.program],
        old,
        new,
    )


@dataclass(frozen=True)
class JobState:
    """A snapshot of the launch: metrics lines so far, per-step times, and the result once it ended.

    ``step_times``: per step, the slowest rank's ``step_s`` (what one iteration took). ``result`` is
    the launch's ``JobResult`` once the job ended, else ``None``.
    """

    running: bool
    metrics: tuple[Mapping[str, Any], ...]
    step_times: tuple[float, ...]
    steps: int  # steps asked for
    predicted_s: float  # the launched plan's cost per iteration
    result: Any = None

    @property
    def started(self) -> bool:
        return self.running or self.result is not None or bool(self.metrics)

    @property
    def mean_step_s(self) -> float | None:
        return sum(self.step_times) / len(self.step_times) if self.step_times else None

    def summary(self) -> str:
        if not self.started:
            return "no launch yet"
        if self.result is not None:
            return f"launch finished: {self.result.summary()}"
        return f"running: {len(self.step_times)}/{self.steps} steps"


def _step_times(metrics: Iterable[Mapping[str, Any]]) -> tuple[float, ...]:
    per_step: dict[Any, float] = {}
    for m in metrics:
        s, t = m.get("step"), m.get("step_s")
        if s is None or isinstance(t, bool) or not isinstance(t, (int, float)):
            continue
        per_step[s] = max(per_step.get(s, float("-inf")), float(t))
    return tuple(per_step[s] for s in sorted(per_step, key=lambda s: (not isinstance(s, (int, float)), s)))


# ============================================================================================ session


class Session:
    """The state of one interactive synthesis (see the module docstring).

    ``model_or_plan``: a :class:`~hapnb.plans.plan.Plan` (its graph is needed for the search; a plan loaded
    from JSON is rebuilt from its recorded zoo model when possible), a Graph or Theory, an ``nn.Module``
    with ``example_inputs`` (and ``loss``), or a zoo name with zoo options (``layers=2, hidden=64``).
    ``pins``: tensor name -> form; ``ratios``: device -> locked ratio. Without a plan, one is
    synthesized.
    """

    def __init__(
        self,
        model_or_plan: Any,
        cluster: Cluster | str | None = None,
        *,
        pins: Mapping[str, Form | str] | None = None,
        example_inputs: Sequence[Any] | None = None,
        ratios: Mapping[str, float] | None = None,
        loss: Any = None,
        max_iterations: int = 10,
        **zoo_options: Any,
    ) -> None:
        self.max_iterations = max_iterations
        #: why the current plan ignores memory (no program fits every device), else ""
        self.memory_note = ""
        self._model_spec: tuple[tuple[str, Any], ...] = ()
        plan = self._resolve(model_or_plan, cluster, example_inputs, loss, zoo_options)
        self._draft: Cluster = self.cluster
        self._pins: dict[str, str] = {}
        for name, form in (pins or (dict(plan.pins) if plan is not None else {})).items():
            self._pins.update(self._checked_pin(name, form))
        self._locks: dict[str, float] = {}
        if ratios is None and plan is not None:
            ratios = {d: lo for d, lo, hi in plan.ratio_pins if lo == hi and d in self.cluster.names}
        for d, v in (ratios or {}).items():
            self._locks[self._device(d)] = self._ratio(d, v)
        self.plan: Plan = plan if plan is not None else self._synthesize(self.cluster)
        self.previous_plan: Plan | None = None
        self.plans: list[Plan] = [self.plan]
        self._values: dict[str, float] = self._plan_ratios(self.plan)
        self._values.update(self._locks)
        self.event: SearchEvent | None = None
        self.current = 0
        self.search: Search = self._new_search()
        self.verify_report: Any = None
        self._job: Job | None = None
        self._job_plan: Plan | None = None
        self._job_steps = 0

    # ============================================================================ model resolution
    def _resolve(
        self, obj: Any, cluster: Any, example_inputs: Any, loss: Any, zoo_options: dict[str, Any]
    ) -> Plan | None:
        plan = None
        if isinstance(obj, Plan):
            plan = obj
            self.cluster = plan.cluster if cluster is None else Cluster.resolve(cluster)
            self._model_spec = plan.model
            graph = plan.graph
            if graph is None:
                try:
                    graph = rebuild_graph(plan)
                except Exception as e:  # noqa: BLE001 - any failure: say what to pass instead
                    raise ValueError(
                        f"plan {plan.name!r} has no traced graph (it was loaded from JSON) and its model could "
                        f"not be rebuilt ({e}); pass the Graph, the nn.Module with example_inputs, or the zoo "
                        "name"
                    ) from None
                plan = dataclasses.replace(plan, graph=graph)  # re-planning reuses the rebuilt graph
            if plan.planner is None:
                plan = dataclasses.replace(plan, planner=Planner.for_plan(plan))
            self.theory = plan.planner.theory  # the plan's own (segmented as it was made)
        else:
            if cluster is None:
                raise ValueError(
                    "a model or graph needs a cluster: e.g. Session(model, '2xV100+2xP100', example_inputs=...)"
                )
            self.cluster = Cluster.resolve(cluster)
            if isinstance(obj, Theory):
                self.theory = obj
            else:
                from .tracing import resolve_model

                graph, spec = resolve_model(obj, self.cluster, example_inputs, loss, **zoo_options)
                self.theory = theory(graph)
                self._model_spec = freeze_mapping(spec) if spec else ()
        self.graph = self.theory.graph
        return plan

    # ============================================================================ helpers
    def _form_pins(self) -> dict[str, Form | Storage]:
        return {k: parse_pin(v) for k, v in self._pins.items()}

    def _synthesize(self, cluster: Cluster, locks: Mapping[str, float] | None = None) -> Plan:
        """The plan for the pins, the locked ratios and ``cluster``: the first one synthesized, every later
        one re-planned from the current plan (:meth:`hapnb.plans.plan.Plan.replan` with ``exact=False``: the Q/B
        loop from the current plan's ratios, reusing what did not change; a fixpoint of the loop that keeps
        every pin and lock, which may differ from a fresh synthesis).

        Memory is checked as ``hapnb plan`` checks it, so the session's plan is the command line's: the
        search keeps to each device's memory. Where no program fits, the plan ignoring memory is kept (a
        view marks the devices over their memory) and :attr:`memory_note` says why."""
        locks = self._locks if locks is None else locks
        plan = getattr(self, "plan", None)

        def make(check_memory: bool) -> Plan:
            if plan is None:
                return synthesize(
                    self.theory,
                    cluster,
                    pins=self._form_pins(),
                    ratios=dict(locks) or None,
                    max_iterations=self.max_iterations,
                    check_memory=check_memory,
                )
            pins: dict[str, Any] = {k: None for k, _ in plan.pins if k not in self._pins}
            pins.update(self._pins)
            ratio_pins: dict[str, Any] = {d: None for d, _, _ in plan.ratio_pins if d not in locks}
            ratio_pins.update(locks)
            return replan(
                plan,
                pins,
                ratio_pins,
                cluster,
                exact=False,
                check_memory=check_memory,
                max_iterations=self.max_iterations,
            )

        try:
            new = make(True)
            self.memory_note = ""
        except OutOfMemoryError as e:
            new = make(False)
            self.memory_note = str(e)
        if self._model_spec:
            new = dataclasses.replace(new, model=self._model_spec)
        return new

    def _new_search(self) -> Search:
        ratios = self.plan.ratios if self.plan.cluster == self.cluster else None
        return Search(self.theory, self.cluster, ratios=ratios, pins=self._form_pins())

    def _plan_ratios(self, plan: Plan) -> dict[str, float]:
        names = self.cluster.names
        if plan.cluster.names == names:
            return dict(zip(names, plan.ratios[0]))
        return {d: 1.0 / len(names) for d in names}

    def _set_plan(self, plan: Plan) -> Plan:
        self.previous_plan = self.plan
        self.plan = plan
        self.plans.append(plan)
        self._values = self._plan_ratios(plan)
        self._values.update(self._locks)
        self.search = self._new_search()
        self.event = None
        self.current = 0
        return plan

    # ============================================================================ search cursor
    @property
    def frontier(self) -> list[SearchNode]:
        """Open partial programs of the search, best score first."""
        return self.search.frontier

    @property
    def stats(self) -> dict[str, Any]:
        """The search's counters (expansions, frontier, nodes, ...)."""
        return self.search.stats

    @property
    def best(self) -> SearchNode | None:
        """The best complete program the search has found so far."""
        return self.search.best

    @property
    def done(self) -> bool:
        return self.search.done

    def _after_step(self, ev: SearchEvent) -> None:
        self.event = ev
        if ev.popped is not None:
            self.current = ev.popped.id

    @property
    def status(self) -> str:
        """One line on the search: ``"12 expansions, frontier 30"`` (``", done"`` once proven optimal)."""
        st = self.search.stats
        return f"{st['expansions']} expansions, frontier {st['frontier']}" + (", done" if self.done else "")

    def step(self) -> SearchEvent:
        """Expand one node (the cheapest open program); the popped node becomes the current node."""
        ev = self.search.step()
        self._after_step(ev)
        return ev

    def step_n(self, n: int, progress: ProgressFn | None = None) -> SearchEvent | None:
        """Expand up to ``n`` nodes (fewer when the search ends); returns the last event."""
        if n < 0:
            raise ValueError(f"step_n needs n >= 0, got {n}")
        ev = None
        for k in range(n):
            if self.search.done:
                break
            ev = self.step()
            if progress is not None and k % 25 == 0:
                progress(Progress(k, n, self.status))
        if progress is not None:
            progress(Progress(n, n, self.status))
        return ev

    def run_to_complete(
        self, max_steps: int = 100_000, progress: ProgressFn | None = None
    ) -> SearchEvent | None:
        """Step until an expansion produces a complete program (or the search is done)."""
        ev = None
        for k in range(max_steps):
            if self.search.done:
                break
            ev = self.step()
            if progress is not None and k % 50 == 0:
                progress(Progress(k, 0, self.status))
            if any(c.complete for c in ev.children):
                break
        if progress is not None:
            progress(Progress(1, 1, self.status))
        return ev

    def run(
        self, chunk: int = 200, max_seconds: float | None = None, progress: ProgressFn | None = None
    ) -> SearchNode | None:
        """Run the search to its end (the best program proven optimal), ``chunk`` expansions at a time;
        the best node becomes the current node. Raises NoProgramError when no program exists."""
        t0 = time.perf_counter()
        while not self.search.done:
            try:
                self.search.run(max_expansions=chunk, dives=0)
            except NoProgramError:
                if self.search.done:
                    raise
            if progress is not None:
                st = self.search.stats
                total = max(st["expansions"] + st["frontier"], 1)
                progress(Progress(min(st["expansions"], total), total, self.status))
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
        if progress is not None:
            progress(Progress(1, 1, self.status))
        self.event = None
        best = self.search.best
        if best is not None:
            self.current = best.id
        return best

    def reset(self) -> Search:
        """A fresh search at the current plan's ratios and the current pins."""
        self.search = self._new_search()
        self.event = None
        self.current = 0
        return self.search

    def select(self, node_id: int) -> SearchNode:
        """Make node ``node_id`` the current node (the tree drawing and triple highlighting follow it)."""
        n = self.search.stats["nodes"]
        if not isinstance(node_id, int) or not 0 <= node_id < n:
            raise IndexError(f"no search node #{node_id}: the search tree has nodes #0..#{n - 1}")
        self.current = node_id
        return self.search.node(node_id)

    def enabled(self) -> set[int]:
        """Ids of the triples enabled at the current node."""
        return display.enabled_triples(self.search, self.search.node(self.current))

    def use_best(self) -> Plan:
        """Make the search's best complete program (at the search's ratios) the current plan."""
        best = self.search.best
        if best is None:
            raise RuntimeError("the search has no complete program yet: run it (or run to the next complete)")
        plan = make_plan(
            self.theory,
            self.cluster,
            self.search.program(best.id),
            self.search.final_conversions(best.id),
            self.search.ratios,
            pins=self._form_pins(),
            stats=self.search.stats,
            model=dict(self._model_spec) if self._model_spec else None,
        )
        # the same model and synthesis settings: it re-plans with the current plan's planner
        return self._set_plan(dataclasses.replace(plan, planner=self.plan.planner))

    # ============================================================================ pins
    @property
    def pins(self) -> dict[str, str]:
        """Pinned forms by tensor name (a copy), e.g. ``{"w0": "G1"}``."""
        return dict(self._pins)

    def pinnable(self) -> dict[str, tuple[str, ...]]:
        """Parameters and inputs that can take more than one form, with their pins: the forms, then for a
        parameter its sharded storages (``zero3(d)``, ``zero2(d)``: :func:`hapnb.synth.spec.pin_choices`)."""
        g, th = self.graph, self.theory
        return {
            t.name: tuple(str(f) for f in pin_choices(th, t.id))
            for t in g.tensors
            if t.role in ("param", "input") and len(th.forms[t.id]) > 1
        }

    def pin_options(self, name: str) -> tuple[str, ...]:
        """``"auto"`` and every pin tensor ``name`` can take: its forms and, for a parameter, its sharded
        storages (``zero3(d)`` / ``zero2(d)``)."""
        try:
            t = self.graph.tensor(name)
        except KeyError:
            raise UnknownPinError(self._unknown_pin(name)) from None
        return (AUTO, *(str(f) for f in pin_choices(self.theory, t.id)))

    def _unknown_pin(self, name: str) -> str:
        some = ", ".join(list(self.pinnable())[:8])
        return f"pin {name}: no tensor of that name; pins name parameters and inputs ({some}, ...)"

    def _checked_pin(self, name: str, form: Form | Storage | str | None) -> dict[str, str]:
        if form is None or form == AUTO:
            return {}
        f = parse_pin(form) if isinstance(form, str) else form
        try:
            resolve_pins(self.theory, {name: f})
        except PinError as e:
            if "no tensor of that name" in str(e):
                raise UnknownPinError(self._unknown_pin(name)) from None
            raise
        return {name: str(f)}

    def set_pin(self, name: str, form: Form | Storage | str | None) -> str:
        """Pin tensor ``name`` to ``form`` (``"G1"``, ``hapnb.Shard(1)``, a parameter storage such as
        ``"zero3(0)"`` / ``hapnb.FullShard(0)``, ...); ``None``/``"auto"`` unpins. Returns the stored
        value. Takes effect at the next :meth:`resynthesize` (the search cursor restarts then). Raises
        :class:`UnknownPinError` (a KeyError) for an unknown tensor and :class:`~hapnb.synth.search.PinError` (a
        ValueError) for a form the tensor cannot take."""
        pin = self._checked_pin(name, form)
        if pin:
            self._pins.update(pin)
            return pin[name]
        if name not in self._pins and name not in self.pinnable():
            self.pin_options(name)  # unknown name: raises
        self._pins.pop(name, None)
        return AUTO

    def clear_pins(self) -> None:
        self._pins.clear()

    # ============================================================================ ratios
    @property
    def ratio_locks(self) -> dict[str, float]:
        """Locked ratios by device (a copy): re-synthesis pins them in the LP."""
        return dict(self._locks)

    @property
    def ratio_values(self) -> dict[str, float]:
        """The ratio shown for each device: the current plan's (first segment), or a value set by hand."""
        return dict(self._values)

    def _device(self, device: str) -> str:
        if device not in self.cluster.names:
            raise KeyError(f"no device {device!r}; devices: {', '.join(self.cluster.names)}")
        return device

    @staticmethod
    def _ratio(device: str, value: Any) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"ratio of {device} must be a number in [0, 1], got {value!r}") from None
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"ratio of {device} must be in [0, 1], got {value}")
        return v

    def set_ratio(self, device: str, value: float, lock: bool = True) -> None:
        """Set a device's ratio and (by default) lock it, so re-synthesis keeps it; ``lock=False``
        removes its lock."""
        self._device(device)
        v = self._ratio(device, value)
        self._values[device] = v
        if lock:
            self._locks[device] = v
        else:
            self._locks.pop(device, None)

    def unlock(self, device: str | None = None) -> None:
        """Remove the lock of ``device`` (all locks when ``None``)."""
        if device is None:
            self._locks.clear()
        else:
            self._locks.pop(self._device(device), None)

    # ============================================================================ plans
    @property
    def diff(self) -> PlanDiff | None:
        """How the current plan differs from the previous one (``None`` before a second plan)."""
        return diff_plans(self.previous_plan, self.plan) if self.previous_plan is not None else None

    def resynthesize(self) -> Plan:
        """Re-plan with the pins, the locked ratios and the cluster (:meth:`hapnb.plans.plan.Plan.replan`, fast:
        from the current plan's ratios, reusing what did not change); the new plan becomes the current one
        (the old one is ``previous_plan``, see :attr:`diff`). On error nothing changes."""
        return self._set_plan(self._synthesize(self.cluster))

    # ============================================================================ tuning
    def why_not(self, pins: Mapping[str, Form | Storage | str]) -> WhyNot:
        """Why the current plan does not use these forms (:meth:`hapnb.plans.plan.Plan.why_not`): the best plan
        with them added to the session's pins and its cost, or where no program satisfies them. The
        current plan does not change."""
        for name, form in pins.items():
            self._checked_pin(name, form)  # an unknown tensor or form: the session's own errors
        return self.plan.why_not(pins)

    def sensitivity(self) -> Any:
        """What bounds the current plan's step (:meth:`hapnb.plans.plan.Plan.sensitivity`)."""
        return self.plan.sensitivity()

    def what_if(
        self,
        *,
        device: str | None = None,
        collective: str | None = None,
        link: bool = False,
        factor: float = 1.1,
    ) -> WhatIf:
        """The current plan re-planned with one device, collective kind or the intra-machine link
        ``factor`` times faster, next to the LP duals' prediction (:func:`hapnb.plans.explain.what_if`); the
        session's cluster and plan do not change (edit the cluster and apply it for that)."""
        return what_if(self.plan, device=device, collective=collective, link=link, factor=factor)

    # ============================================================================ cluster
    @property
    def draft(self) -> Cluster:
        """The cluster being edited (:meth:`apply_cluster` makes it the cluster)."""
        return self._draft

    @property
    def draft_pending(self) -> bool:
        return self._draft != self.cluster

    @property
    def draft_changes(self) -> tuple[str, ...]:
        """What applying the draft would change, one line each (``"v100-0: 15.7 -> 7.85 TFLOP/s"``)."""
        a, b = self.cluster, self._draft
        if a.names != b.names:
            return (f"devices {', '.join(a.names)} -> {', '.join(b.names)}",)
        out = []
        for x, y in zip(a.devices, b.devices):
            if x.flops != y.flops:
                out.append(f"{x.name}: {x.flops / 1e12:.4g} -> {y.flops / 1e12:.4g} TFLOP/s")
            if x.memory_bytes != y.memory_bytes:
                out.append(f"{x.name}: {x.memory_bytes / 2**30:.4g} -> {y.memory_bytes / 2**30:.4g} GiB")
        old = dict(a.collectives)
        for k, y in b.collectives:
            x = old.get(k)
            if x is None:
                out.append(f"{k}: new")
                continue
            if x.bandwidth_Bps != y.bandwidth_Bps:
                out.append(f"{k}: {x.bandwidth_Bps / 1e9:.4g} -> {y.bandwidth_Bps / 1e9:.4g} GB/s")
            if x.latency_s != y.latency_s:
                out.append(f"{k}: {x.latency_s * 1e6:.4g} -> {y.latency_s * 1e6:.4g} us latency")
        for attr, unit in (
            ("intra_machine_Bps", "B/s within a machine"),
            ("dtype_bytes", "bytes per element"),
        ):
            if getattr(a, attr) != getattr(b, attr):
                out.append(f"{getattr(a, attr):g} -> {getattr(b, attr):g} {unit}")
        return tuple(out)

    def load_cluster(self, cluster: Cluster | str) -> Cluster:
        """Put a cluster (object, preset name, JSON path or inline spec) in the draft (not applied)."""
        self._draft = Cluster.resolve(cluster)
        return self._draft

    def set_cluster(self, cluster: Cluster | str, apply: bool = True) -> Cluster:
        """Load ``cluster`` into the draft and, by default, apply it (re-synthesizing)."""
        c = self.load_cluster(cluster)
        if apply:
            self.apply_cluster()
        return c

    def _edited(self, **changes: Any) -> Cluster:
        base = self._draft
        name = base.name if base.name.endswith("(edited)") else f"{base.name} (edited)"
        return base.replace(name=name, **changes)

    def edit_device(
        self, name: str, *, flops: float | None = None, memory_bytes: float | None = None
    ) -> Device:
        """Change a device's throughput (flop/s) or memory (bytes) in the draft; returns the device."""
        devices = list(self._draft.devices)
        if name not in self._draft.names:
            raise KeyError(
                f"no device {name!r} in the draft cluster; devices: {', '.join(self._draft.names)}"
            )
        j = self._draft.names.index(name)
        d = devices[j]
        new = dataclasses.replace(
            d,
            flops=d.flops if flops is None or _close(flops, d.flops) else flops,
            memory_bytes=d.memory_bytes
            if memory_bytes is None or _close(memory_bytes, d.memory_bytes)
            else int(memory_bytes),
        )
        if new != d:
            devices[j] = new
            self._draft = self._edited(devices=tuple(devices))
        return new

    def set_collective(
        self, kind: str, *, bandwidth_Bps: float | None = None, latency_s: float | None = None
    ) -> Collective:
        """Change a collective's bandwidth (bytes/s) or latency (s) in the draft; returns its model."""
        colls = dict(self._draft.collectives)
        if kind not in colls:
            raise KeyError(f"unknown collective {kind!r}; kinds: {', '.join(colls)}")
        old = colls[kind]
        bw = (
            old.bandwidth_Bps
            if bandwidth_Bps is None or _close(bandwidth_Bps, old.bandwidth_Bps)
            else bandwidth_Bps
        )
        lat = old.latency_s if latency_s is None or abs(latency_s - old.latency_s) <= 1e-12 else latency_s
        try:
            new = Collective(lat, bw)
        except ValueError as e:
            raise ValueError(f"collective {kind}: {e}") from None
        if new != old:
            colls[kind] = new
            self._draft = self._edited(collectives=colls)
        return new

    def discard_draft(self) -> Cluster:
        """Forget the draft's edits."""
        self._draft = self.cluster
        return self._draft

    def apply_cluster(self) -> Plan:
        """Make the draft the cluster and re-synthesize on it (locks of devices it lacks are dropped).
        On error (e.g. an unsatisfiable lock) the cluster and the plan stay as they were."""
        c = self._draft
        locks = {k: v for k, v in self._locks.items() if k in c.names}
        plan = self._synthesize(c, locks)
        self.cluster = c
        self._locks = locks
        return self._set_plan(plan)

    # ============================================================================ verify and launch
    def verify(self, nproc: int | None = None, **options: Any) -> Any:
        """Run the current plan on ``nproc`` local ranks and compare loss and gradients with one device
        (:func:`hapnb.run.verify.verify`); returns (and keeps, as ``verify_report``) its report."""
        from .run.verify import verify

        self.verify_report = None
        report = verify(self.plan, nproc=nproc, **options)
        self.verify_report = report
        return report

    @property
    def job(self) -> Job | None:
        """The last launched job (running or ended)."""
        return self._job

    def launch(self, nproc: int | None = None, steps: int = 10, backend: str = "gloo", **options: Any) -> Job:
        """Launch the current plan (:func:`hapnb.run.launch.launch`) and return the running job; follow
        it with :meth:`poll` or :meth:`follow`, end it with :meth:`stop`."""
        from .run.launch import launch

        if self._job is not None and self._job.running:
            raise RuntimeError("a launch is still running: stop it first (stop())")
        job = launch(self.plan, nproc=nproc, backend=backend, steps=steps, **options)
        self._job, self._job_plan, self._job_steps = job, self.plan, steps
        return job

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The launch's metrics lines so far (one dict per rank and step)."""
        return self._job.steps if self._job is not None else []

    @property
    def measured(self) -> list[float]:
        """Per-step times of the last launch, when it ran the current plan (else empty)."""
        if self._job is None or self._job_plan is not self.plan:
            return []
        return list(_step_times(self._job.steps))

    def poll(self) -> JobState:
        """A snapshot of the launch now (never blocks)."""
        job = self._job
        if job is None:
            return JobState(False, (), (), 0, self.plan.cost_s)
        metrics = tuple(job.steps)
        cost = self._job_plan.cost_s if self._job_plan is not None else self.plan.cost_s
        return JobState(job.running, metrics, _step_times(metrics), self._job_steps, cost, job.result)

    def follow(
        self, on_update: Callable[[JobState], None] | None = None, interval_s: float = 0.1
    ) -> JobResult:
        """Block until the launch ends, calling ``on_update`` with a :class:`JobState` as metrics arrive
        (at most every ``interval_s``, and once at the end); returns the job's result."""
        job = self._job
        if job is None:
            raise RuntimeError("nothing launched yet: launch() first")
        last = 0.0
        for _ in job.metrics():
            now = time.monotonic()
            if on_update is not None and now - last >= interval_s:
                last = now
                on_update(self.poll())
        result = job.wait()
        if on_update is not None:
            on_update(self.poll())
        return result

    def stop(self) -> JobResult | None:
        """Stop a running launch (no-op when none runs); returns its result."""
        return self._job.stop() if self._job is not None else None

    # ============================================================================ display
    def __repr__(self) -> str:
        extras = []
        if self._pins:
            extras.append(f"pins {', '.join(f'{k}={v}' for k, v in self._pins.items())}")
        if self._locks:
            extras.append(f"locks {', '.join(f'{k}={v:.3f}' for k, v in self._locks.items())}")
        return (
            f"Session({self.plan.name} on {self.cluster.name}: plan {self.plan.cost_s * 1e3:.4g} ms, "
            f"{len(self.plans)} plans, {self.search!r}" + "".join(f"; {e}" for e in extras) + ")"
        )

    def _repr_html_(self) -> str:
        diff = self.diff
        return (
            f"<div><b>{display.esc(repr(self))}</b></div>"
            + (f"<div>{display.esc(diff.summary())}</div>" if diff is not None else "")
            + display.safe_html(display.search_html, self.search, self.event)
        )


def _close(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) <= 1e-9 * max(abs(float(b)), 1e-300)
