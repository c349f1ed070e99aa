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

Views listen: ``s.subscribe(fn)`` calls ``fn(change)`` with a :class:`Change` after every change of the
session's state (``kind`` one of :data:`CHANGES`: the search cursor moved, a new plan, pins, ratios,
the draft or the applied cluster changed, a verify report or the launch moved on), before long work
(``"busy"``, with a line to show) and as it progresses (``"progress"``, when no ``progress`` callback is
given; a launch followed with :meth:`Session.follow` reports each telemetry window so), and when a launched
job decided on a live re-balance (``"rebalance"``, the decision in ``change.rebalance``). The Explorer is
such a view.

>>> seen = []
>>> unsubscribe = s.subscribe(lambda change: seen.append(change.kind))
>>> _ = s.step(); _ = s.set_pin("x", None); unsubscribe(); _ = s.step()
>>> seen
['search', 'pins']
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import display
from .hardware.cluster import Cluster
from .hardware.parts import Collective, Device
from .ir.forms import Form, Storage, parse_pin
from .plans.diff import AUTO, PlanDiff, diff_plans
from .plans.explain import WhatIf, rebuild_graph, what_if
from .plans.packaging import make_plan
from .plans.plan import Plan, freeze_mapping
from .plans.planner import Planner
from .plans.synthesis import OutOfMemoryError, replan, synthesize
from .plans.whynot import WhyNot
from .synth.search import NoProgramError, PinError, Search, SearchEvent, SearchNode, resolve_pins
from .synth.spec import pin_choices
from .triples import Theory, theory

if TYPE_CHECKING:  # the run layer starts processes: imported inside the methods that need it
    from .run.launch import Job, JobResult, JobState

__all__ = ["Session", "Progress", "Change", "CHANGES", "UnknownPinError", "AUTO", "PlanDiff", "diff_plans"]

#: what a :class:`Change` says happened: the search cursor moved (``search``), a new current plan
#: (``plan``), the pins / the ratio values or locks / the draft cluster / the applied cluster changed,
#: a verify report (``verify``), the launch moved on (``job``) or decided on a live re-balance (``rebalance``);
#: long work is starting (``busy``) or progressing (``progress``)
CHANGES = ("search", "plan", "pins", "ratios", "draft", "cluster", "verify", "job", "rebalance", "busy",
           "progress")  # fmt: skip
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
class Change:
    """What changed in a :class:`Session` (``kind``, one of :data:`CHANGES`); ``progress`` for
    ``"progress"``, ``text`` (a line to show) for ``"busy"`` and ``"rebalance"``; ``rebalance`` for
    ``"rebalance"``: the decision's record (accepted or not, ``reason``, ``old_ratios``, ``new_ratios``,
    ``predicted_gain``, ...: :meth:`hapnb.run.rebalance.Proposal.record`)."""

    kind: str
    progress: Progress | None = None
    text: str = ""
    rebalance: Mapping[str, Any] | None = None


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
        self._listeners: list[Callable[[Change], None]] = []
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
        self._emit("plan")
        return plan

    # ============================================================================ change events
    def subscribe(self, listener: Callable[[Change], None]) -> Callable[[], None]:
        """Call ``listener(change)`` after every change (see the module docstring); returns a function
        that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _emit(
        self, kind: str, progress: Progress | None = None, text: str = "", rebalance: Any = None
    ) -> None:
        change = Change(kind, progress, text, rebalance)
        for listener in list(self._listeners):
            listener(change)

    @contextlib.contextmanager
    def _busy(self, text: str) -> Iterator[None]:
        """``"busy"`` with ``text`` before long work, and with ``""`` after it (done or failed)."""
        self._emit("busy", text=text)
        try:
            yield
        finally:
            self._emit("busy")

    def _progress(self, progress: ProgressFn | None) -> ProgressFn | None:
        """The callback long work reports to: the caller's, else the listeners' (``"progress"``)."""
        if progress is not None or not self._listeners:
            return progress
        return lambda p: self._emit("progress", p)

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
        self._emit("search")
        return ev

    def step_n(self, n: int, progress: ProgressFn | None = None) -> SearchEvent | None:
        """Expand up to ``n`` nodes (fewer when the search ends); returns the last event."""
        if n < 0:
            raise ValueError(f"step_n needs n >= 0, got {n}")
        progress = self._progress(progress)
        ev = None
        for k in range(n):
            if self.search.done:
                break
            ev = self.search.step()
            self._after_step(ev)
            if progress is not None and k % 25 == 0:
                progress(Progress(k, n, self.status))
        if progress is not None:
            progress(Progress(n, n, self.status))
        self._emit("search")
        return ev

    def run_to_complete(
        self, max_steps: int = 100_000, progress: ProgressFn | None = None
    ) -> SearchEvent | None:
        """Step until an expansion produces a complete program (or the search is done)."""
        progress = self._progress(progress)
        ev = None
        for k in range(max_steps):
            if self.search.done:
                break
            ev = self.search.step()
            self._after_step(ev)
            if progress is not None and k % 50 == 0:
                progress(Progress(k, 0, self.status))
            if any(c.complete for c in ev.children):
                break
        if progress is not None:
            progress(Progress(1, 1, self.status))
        self._emit("search")
        return ev

    def run(
        self, chunk: int = 200, max_seconds: float | None = None, progress: ProgressFn | None = None
    ) -> SearchNode | None:
        """Run the search to its end (the best program proven optimal), ``chunk`` expansions at a time;
        the best node becomes the current node. Raises NoProgramError when no program exists."""
        t0 = time.perf_counter()
        progress = self._progress(progress)
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
        self._emit("search")
        return best

    def reset(self) -> Search:
        """A fresh search at the current plan's ratios and the current pins."""
        self.search = self._new_search()
        self.event = None
        self.current = 0
        self._emit("search")
        return self.search

    def select(self, node_id: int) -> SearchNode:
        """Make node ``node_id`` the current node (the tree drawing and triple highlighting follow it)."""
        n = self.search.stats["nodes"]
        if not isinstance(node_id, int) or not 0 <= node_id < n:
            raise IndexError(f"no search node #{node_id}: the search tree has nodes #0..#{n - 1}")
        self.current = node_id
        self._emit("search")
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
            self._emit("pins")
            return pin[name]
        if name not in self._pins and name not in self.pinnable():
            self.pin_options(name)  # unknown name: raises
        self._pins.pop(name, None)
        self._emit("pins")
        return AUTO

    def clear_pins(self) -> None:
        """Unpin every tensor."""
        self._pins.clear()
        self._emit("pins")

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
        self._emit("ratios")

    def unlock(self, device: str | None = None) -> None:
        """Remove the lock of ``device`` (all locks when ``None``)."""
        if device is None:
            self._locks.clear()
        else:
            self._locks.pop(self._device(device), None)
        self._emit("ratios")

    # ============================================================================ plans
    @property
    def diff(self) -> PlanDiff | None:
        """How the current plan differs from the previous one (``None`` before a second plan)."""
        return diff_plans(self.previous_plan, self.plan) if self.previous_plan is not None else None

    def resynthesize(self) -> Plan:
        """Re-plan with the pins, the locked ratios and the cluster (:meth:`hapnb.plans.plan.Plan.replan`, fast:
        from the current plan's ratios, reusing what did not change); the new plan becomes the current one
        (the old one is ``previous_plan``, see :attr:`diff`). On error nothing changes."""
        with self._busy("synthesizing..."):
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
        return self.cluster.changes_to(self._draft)

    def load_cluster(self, cluster: Cluster | str) -> Cluster:
        """Put a cluster (object, preset name, JSON path or inline spec) in the draft (not applied)."""
        self._draft = Cluster.resolve(cluster)
        self._emit("draft")
        return self._draft

    def set_cluster(self, cluster: Cluster | str, apply: bool = True) -> Cluster:
        """Load ``cluster`` into the draft and, by default, apply it (re-synthesizing)."""
        c = self.load_cluster(cluster)
        if apply:
            self.apply_cluster()
        return c

    def _set_draft(self, draft: Cluster) -> None:
        if draft is not self._draft:
            self._draft = draft
            self._emit("draft")

    def edit_device(
        self, name: str, *, flops: float | None = None, memory_bytes: float | None = None
    ) -> Device:
        """Change a device's throughput (flop/s) or memory (bytes) in the draft; returns the device."""
        self._set_draft(self._draft.with_device(name, flops=flops, memory_bytes=memory_bytes))
        return self._draft.devices[self._draft.index(name)]

    def set_collective(
        self, kind: str, *, bandwidth_Bps: float | None = None, latency_s: float | None = None
    ) -> Collective:
        """Change a collective's bandwidth (bytes/s) or latency (s) in the draft; returns its model."""
        self._set_draft(self._draft.with_collective(kind, bandwidth_Bps=bandwidth_Bps, latency_s=latency_s))
        return self._draft.collective(kind)

    def discard_draft(self) -> Cluster:
        """Forget the draft's edits."""
        self._draft = self.cluster
        self._emit("draft")
        return self._draft

    def apply_cluster(self) -> Plan:
        """Make the draft the cluster and re-synthesize on it (locks of devices it lacks are dropped).
        On error (e.g. an unsatisfiable lock) the cluster and the plan stay as they were."""
        c = self._draft
        locks = {k: v for k, v in self._locks.items() if k in c.names}
        with self._busy("synthesizing..."):
            plan = self._synthesize(c, locks)
        self.cluster = c
        self._locks = locks
        self._set_plan(plan)
        self._emit("cluster")
        return plan

    # ============================================================================ verify and launch
    def verify(self, nproc: int | None = None, **options: Any) -> Any:
        """Run the current plan on ``nproc`` local ranks and compare loss and gradients with one device
        (:func:`hapnb.run.verify.verify`); returns (and keeps, as ``verify_report``) its report."""
        from .run.verify import verify

        self.verify_report = None
        try:
            with self._busy(f"verifying on {nproc or self.cluster.gpus} local ranks..."):
                self.verify_report = verify(self.plan, nproc=nproc, **options)
        finally:
            self._emit("verify")  # verify_report None: it failed
        report = self.verify_report
        return report

    @property
    def job(self) -> Job | None:
        """The last launched job (running or ended)."""
        return self._job

    def launch(
        self,
        nproc: int | None = None,
        steps: int = 10,
        backend: str = "gloo",
        *,
        rebalance: bool | Mapping[str, Any] = False,
        slowdown: Mapping[int, float] | None = None,
        **options: Any,
    ) -> Job:
        """Launch the current plan (:func:`hapnb.run.launch.launch`) and return the running job; follow
        it with :meth:`poll` or :meth:`follow`, end it with :meth:`stop`. ``rebalance=True`` (or a mapping
        of :class:`hapnb.run.rebalance.RebalanceOptions` fields) re-balances the ratios live when a rank
        straggles; ``slowdown={rank: factor}`` makes a rank that many times slower (a straggler for a
        demo); other ``options`` (``telemetry``, ``dtype``, ``timeout_s``, ...) go to the launch."""
        from .run.launch import launch

        if self._job is not None and self._job.running:
            raise RuntimeError("a launch is still running: stop it first (stop())")
        options.update(rebalance=rebalance, slowdown=slowdown)
        job = launch(self.plan, nproc=nproc, backend=backend, steps=steps, **options)
        self._job, self._job_plan, self._job_steps = job, self.plan, steps
        self._emit("job")
        return job

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The launch's metrics lines so far (one dict per rank and step)."""
        return self._job.steps if self._job is not None else []

    @property
    def rebalances(self) -> list[dict[str, Any]]:
        """The launch's re-balance decisions so far (accepted or declined, in order; see :class:`Change`)."""
        return display.decisions(self.metrics)

    @property
    def measured(self) -> list[float]:
        """Per-step times of the last launch, when it ran the current plan (else empty)."""
        if self._job is None or self._job_plan is not self.plan:
            return []
        from .run.launch import step_times

        return step_times(self._job.steps)

    def poll(self) -> JobState:
        """A snapshot of the launch now (never blocks)."""
        from .run.launch import JobState, step_times

        job = self._job
        if job is None:
            return JobState(False, (), (), 0, self.plan.cost_s)
        metrics = tuple(job.steps)
        cost = self._job_plan.cost_s if self._job_plan is not None else self.plan.cost_s
        return JobState(job.running, metrics, tuple(step_times(metrics)), self._job_steps, cost, job.result)

    def follow(
        self, on_update: Callable[[JobState], None] | None = None, interval_s: float = 0.1
    ) -> JobResult:
        """Block until the launch ends, calling ``on_update`` with a :class:`JobState` (and the listeners
        with a ``"job"`` change) as metrics arrive (at most every ``interval_s``, and once at the end);
        returns the job's result. The listeners also get a ``"progress"`` change per telemetry window and a
        ``"rebalance"`` change per re-balance decision, as they arrive."""
        job = self._job
        if job is None:
            raise RuntimeError("nothing launched yet: launch() first")
        last = 0.0
        for m in job.metrics():
            if m.get("event") == "telemetry":
                self._emit(
                    "progress", Progress(int(m["step"]) + 1, self._job_steps, display.telemetry_text(m))
                )
            elif m.get("event") == "rebalance":
                self._emit("rebalance", text=display.rebalance_text(m["rebalance"]), rebalance=m["rebalance"])
            now = time.monotonic()
            if now - last >= interval_s:
                last = now
                self._job_moved(on_update)
        result = job.wait()
        self._job_moved(on_update)
        return result

    def _job_moved(self, on_update: Callable[[JobState], None] | None) -> None:
        if on_update is not None:
            on_update(self.poll())
        self._emit("job")

    def stop(self) -> JobResult | None:
        """Stop a running launch (no-op when none runs); returns its result."""
        result = self._job.stop() if self._job is not None else None
        self._emit("job")
        return result

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
