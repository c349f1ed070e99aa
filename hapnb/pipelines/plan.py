"""The pipeline plan value (:class:`PipelinePlan`) and its JSON: what ``hapnb pipeline -o`` writes and
``hapnb verify --plan`` / ``hapnb launch`` read for a pipeline.

JSON (``"kind": "pipeline"`` tells it from an SPMD plan, which has no ``kind``)::

    {"format": 1, "kind": "pipeline", "name": "...", "model": {"name": "gpt", "options": {...}},
     "cluster": {...cluster JSON...},
     "units": ["(input)", "blocks.0", "blocks.1", ..., "norm"],
     "stages": [{"index": 0, "units": [0, 13], "devices": ["v100-0", "v100-1"], "shares": [0.5, 0.5],
                 "forward_s": ..., "backward_s": ..., "memory_bytes": [...]}, ...],
     "schedule": "1F1B", "micro_batches": 8, "batch": 32,
     "iteration_s": ..., "planning_s": ..., "method": "dp",
     "exhaustive_iteration_s": null, "exhaustive_planning_s": null, "search": {...}}

* ``units``: the model's cut points in execution order. ``units[0]`` names what runs before the first
  cut (any label); every later entry is the fully qualified name of a submodule that is called exactly
  once per forward, and a unit begins where that submodule's call begins. A stage is a contiguous range
  ``[start, stop)`` of units; the stages cover all units in order.
* ``devices``: the stage's devices (names from ``cluster``), each used by one stage at most. Several
  devices run the stage data parallel: each micro-batch's samples are split by ``shares`` (fractions,
  summing to 1) and the stage's gradients are summed over its devices.
* ``forward_s``/``backward_s``: the predicted time of one micro-batch through the stage (its slowest
  device, communication between stages excluded); ``memory_bytes``: predicted peak per stage device.

>>> from hapnb.hardware.cluster import Cluster
>>> c = Cluster.parse("2xV100")
>>> p = PipelinePlan(name="demo", model=(("name", "gpt"),), cluster=c, units=("(input)", "blocks.0", "blocks.1"),
...     stages=(PipelineStage(0, (0, 2), ("v100-0",)), PipelineStage(1, (2, 3), ("v100-1",))),
...     schedule="1F1B", micro_batches=4, batch=8)
>>> PipelinePlan.from_json(p.to_json()) == p
True
>>> p.stage_of_unit(2), p.micro_batch_size
(1, 2)
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..hardware.cluster import Cluster
from ..plans.plan import load_json, save_json

__all__ = [
    "PIPELINE_FORMAT",
    "SCHEDULES",
    "PipelineStage",
    "PipelinePlan",
    "ScheduleSpan",
    "PipelineTimeline",
    "is_pipeline_json",
]

PIPELINE_FORMAT = 1
#: the schedules a pipeline plan may name (torch.distributed.pipelining's GPipe and 1F1B)
SCHEDULES = ("GPipe", "1F1B")


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw_pairs(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    def thaw(v: Any) -> Any:
        if (
            isinstance(v, tuple)
            and v
            and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v)
        ):
            return {k: thaw(x) for k, x in v}
        if isinstance(v, tuple):
            return [thaw(x) for x in v]
        return v

    return {k: thaw(v) for k, v in pairs}


@dataclass(frozen=True)
class PipelineStage:
    """One stage: units ``[start, stop)`` on ``devices`` (data parallel inside when several)."""

    index: int
    units: tuple[int, int]
    devices: tuple[str, ...]
    shares: tuple[float, ...] = ()  # fraction of each micro-batch per device; empty: even
    forward_s: float = 0.0
    backward_s: float = 0.0
    memory_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        a, b = self.units
        if not 0 <= a < b:
            raise ValueError(f"stage {self.index}: units [{a}, {b}) is empty or negative")
        if not self.devices:
            raise ValueError(f"stage {self.index}: no devices")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"stage {self.index}: a device is listed twice in {list(self.devices)}")
        if not self.shares:
            object.__setattr__(self, "shares", tuple(1.0 / len(self.devices) for _ in self.devices))
        else:
            if len(self.shares) != len(self.devices):
                raise ValueError(
                    f"stage {self.index}: {len(self.shares)} shares for {len(self.devices)} devices"
                )
            if any(s < 0 for s in self.shares) or not math.isclose(sum(self.shares), 1.0, abs_tol=1e-6):
                raise ValueError(
                    f"stage {self.index}: shares {list(self.shares)} must be non-negative and sum to 1"
                )
        if self.memory_bytes and len(self.memory_bytes) != len(self.devices):
            raise ValueError(
                f"stage {self.index}: {len(self.memory_bytes)} memory figures for {len(self.devices)} devices"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "units": list(self.units),
            "devices": list(self.devices),
            "shares": list(self.shares),
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "memory_bytes": list(self.memory_bytes),
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> PipelineStage:
        a, b = d["units"]
        return PipelineStage(
            index=int(d["index"]),
            units=(int(a), int(b)),
            devices=tuple(str(x) for x in d["devices"]),
            shares=tuple(float(x) for x in d.get("shares", ())),
            forward_s=float(d.get("forward_s", 0.0)),
            backward_s=float(d.get("backward_s", 0.0)),
            memory_bytes=tuple(int(x) for x in d.get("memory_bytes", ())),
        )


@dataclass(frozen=True)
class ScheduleSpan:
    """One operation of a pipeline's schedule on one lane (a stage, or the transfer across a cut):
    ``kind`` is ``forward``/``backward`` (a stage's micro-batch), ``send``/``send grad`` (a boundary
    transfer of a micro-batch's activations / their gradient) or ``sync`` (a stage's gradient all-reduce
    and optimizer step, once per iteration; ``micro_batch`` -1)."""

    lane: str
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineTimeline:
    """A pipeline plan's iteration replayed operation by operation (:meth:`PipelinePlan.timeline`):
    ``lanes`` top to bottom (stages and the transfers between them), ``spans``, and ``iteration_s`` (the
    schedule's makespan plus the tail: the plan's ``stats["simulated_s"]``). ``exact`` is False for a
    plan that does not record its boundary and tail times (made by hand or by an older planner): its
    transfers and tails are then left out."""

    name: str
    schedule: str
    micro_batches: int
    lanes: tuple[str, ...]
    spans: tuple[ScheduleSpan, ...]
    iteration_s: float
    exact: bool = True

    def gantt(self, **kw: Any) -> Any:
        """A bokeh Gantt chart of the schedule (:func:`hapnb.display.pipeline_gantt`)."""
        from .. import display

        return display.pipeline_gantt(self, **kw)

    def __str__(self) -> str:
        busy = {lane: sum(s.end_s - s.start_s for s in self.spans if s.lane == lane) for lane in self.lanes}
        rows = [f"  {lane}: busy {busy[lane] * 1e3:.3f} ms" for lane in self.lanes]
        return "\n".join(
            [f"pipeline timeline {self.name}: {self.schedule}, {self.micro_batches} micro-batches, "
             f"{self.iteration_s * 1e3:.3f} ms", *rows]
        )  # fmt: skip


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline template on a cluster: units, stages, schedule and its predicted time."""

    name: str
    model: tuple[tuple[str, Any], ...]  # how to rebuild: {"name": zoo name or factory, "options": {...}}
    cluster: Cluster
    units: tuple[str, ...]
    stages: tuple[PipelineStage, ...]
    schedule: str
    micro_batches: int
    batch: int
    iteration_s: float = 0.0
    planning_s: float = 0.0
    method: str = ""  # "dp", "greedy", "exhaustive", or "manual"
    exhaustive_iteration_s: float | None = None
    exhaustive_planning_s: float | None = None
    search: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {self.micro_batches}")
        if self.batch % self.micro_batches:
            raise ValueError(
                f"batch {self.batch} does not split into {self.micro_batches} equal micro-batches; "
                "choose micro_batches dividing the batch"
            )
        if not self.stages:
            raise ValueError("a pipeline plan needs at least one stage")
        at = 0
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise ValueError(f"stage {i} carries index {s.index}; stages must be listed in order")
            if s.units[0] != at:
                raise ValueError(
                    f"stage {i} starts at unit {s.units[0]}, expected {at}: stages must be contiguous"
                )
            at = s.units[1]
        if at != len(self.units):
            raise ValueError(f"the stages cover units [0, {at}) of {len(self.units)}; they must cover all")
        known = set(self.cluster.names)
        used: dict[str, int] = {}
        for s in self.stages:
            for d in s.devices:
                if d not in known:
                    raise ValueError(f"stage {s.index}: device {d!r} is not in cluster {self.cluster.name}")
                if d in used:
                    raise ValueError(
                        f"device {d!r} is in stages {used[d]} and {s.index}; a device runs one stage"
                    )
                used[d] = s.index

    # ------------------------------------------------------------------ views
    @property
    def micro_batch_size(self) -> int:
        return self.batch // self.micro_batches

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices the plan uses, stage by stage (the rank order of a run)."""
        return tuple(d for s in self.stages for d in s.devices)

    @property
    def model_spec(self) -> dict[str, Any] | None:
        """How to rebuild the model, as ``zoo.ModelSpec`` JSON."""
        return _thaw_pairs(self.model) if self.model else None

    @property
    def stats(self) -> dict[str, Any]:
        return _thaw_pairs(self.search)

    def stage_of_unit(self, unit: int) -> int:
        for s in self.stages:
            if s.units[0] <= unit < s.units[1]:
                return s.index
        raise IndexError(f"unit {unit} is outside the plan's {len(self.units)} units")

    def split_points(self) -> tuple[str, ...]:
        """The module names where stages 1, 2, ... begin (what a runtime splits the model at)."""
        return tuple(self.units[s.units[0]] for s in self.stages[1:])

    def timeline(self) -> PipelineTimeline:
        """The schedule replayed operation by operation: every micro-batch's forward and backward on each
        stage, the transfers across the cuts (asynchronous, a lane each) and each stage's tail after the
        last backward, from the plan's per-stage times and the boundary and tail times the planner records
        (``stats["boundary_s"]``, ``stats["tail_s"]``); the same simulation as ``stats["simulated_s"]``."""
        from .timing import schedule_events

        st = self.stats
        links = list(st.get("boundary_s") or ())
        tails = list(st.get("tail_s") or ())
        S = len(self.stages)
        exact = len(links) == S - 1 and len(tails) == S
        if not exact:
            links, tails = [0.0] * (S - 1), [0.0] * S
        lanes: list[str] = []
        stage_lanes: list[str] = []
        kinds: list[tuple[str, str]] = []
        F: list[float] = []
        B: list[float] = []
        for k, s in enumerate(self.stages):
            stage_lanes.append(f"stage {k}: {_device_span(s.devices)}")
            lanes.append(stage_lanes[-1])
            kinds.append(("forward", "backward"))
            F.append(s.forward_s)
            B.append(s.backward_s)
            if k < S - 1 and exact:  # as the planner simulates it: a transfer is a stage of its own
                lanes.append(f"{k} \u2192 {k + 1}")
                kinds.append(("send", "send grad"))
                F.append(links[k])
                B.append(links[k])
        events = schedule_events(F, B, self.micro_batches, self.schedule)
        spans = [
            ScheduleSpan(lanes[j], kinds[j][0 if kind == "F" else 1], m, a, b) for kind, j, m, a, b in events
        ]
        end = max((s.end_s for s in spans), default=0.0)
        for lane, a in zip(stage_lanes, tails):
            if a > 0:
                spans.append(ScheduleSpan(lane, "sync", -1, end, end + a))
        total = end + max(tails, default=0.0)
        return PipelineTimeline(
            self.name, self.schedule, self.micro_batches, tuple(lanes), tuple(spans), total, exact
        )

    def gantt(self, **kw: Any) -> Any:
        """A bokeh Gantt chart of the plan's schedule (:meth:`timeline`; micro-batches' forward and backward
        per stage over time)."""
        return self.timeline().gantt(**kw)

    def _repr_html_(self) -> str:
        from .. import display

        return display.safe_html(display.pipeline_html, self)

    def __str__(self) -> str:
        head = (
            f"pipeline plan {self.name}: {len(self.stages)} stages, {self.schedule}, {self.micro_batches} "
            f"micro-batches of {self.micro_batch_size}, iteration {self.iteration_s * 1e3:.3f} ms "
            f"(planned by {self.method or '?'} in {self.planning_s:.3f} s)"
        )
        rows = [
            f"  stage {s.index}: units {self.units[s.units[0]]}..{self.units[s.units[1] - 1]} "
            f"({s.units[1] - s.units[0]}) on {', '.join(s.devices)}; fwd {s.forward_s * 1e3:.3f} ms, "
            f"bwd {s.backward_s * 1e3:.3f} ms per micro-batch"
            for s in self.stages
        ]
        return "\n".join([head, *rows])

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": PIPELINE_FORMAT,
            "kind": "pipeline",
            "name": self.name,
            "model": self.model_spec,
            "cluster": self.cluster.to_json(),
            "units": list(self.units),
            "stages": [s.to_json() for s in self.stages],
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "batch": self.batch,
            "iteration_s": self.iteration_s,
            "planning_s": self.planning_s,
            "method": self.method,
            "exhaustive_iteration_s": self.exhaustive_iteration_s,
            "exhaustive_planning_s": self.exhaustive_planning_s,
            "search": self.stats,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any], source: str = "<pipeline plan JSON>") -> PipelinePlan:
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: a pipeline plan is a JSON object, got {type(d).__name__}")
        if not is_pipeline_json(d):
            raise ValueError(
                f'{source}: not a pipeline plan (no "kind": "pipeline"); load it with hapnb.Plan'
            )
        if d.get("format") != PIPELINE_FORMAT:
            raise ValueError(
                f"{source}: pipeline plan format {d.get('format')!r} is not supported "
                f"(this hapnb reads format {PIPELINE_FORMAT})"
            )
        try:
            opt = lambda k: None if d.get(k) is None else float(d[k])  # noqa: E731
            return PipelinePlan(
                name=str(d["name"]),
                model=_freeze(d.get("model") or {}),
                cluster=Cluster.from_json(d["cluster"], source=source),
                units=tuple(str(u) for u in d["units"]),
                stages=tuple(PipelineStage.from_json(s) for s in d["stages"]),
                schedule=str(d["schedule"]),
                micro_batches=int(d["micro_batches"]),
                batch=int(d["batch"]),
                iteration_s=float(d.get("iteration_s", 0.0)),
                planning_s=float(d.get("planning_s", 0.0)),
                method=str(d.get("method", "")),
                exhaustive_iteration_s=opt("exhaustive_iteration_s"),
                exhaustive_planning_s=opt("exhaustive_planning_s"),
                search=_freeze(d.get("search") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValueError) and str(e).startswith(source):
                raise
            raise ValueError(f"{source}: malformed pipeline plan ({type(e).__name__}: {e})") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        return save_json(path, self.to_json())

    @staticmethod
    def load(path: str | os.PathLike[str]) -> PipelinePlan:
        return PipelinePlan.from_json(load_json(path, "pipeline plan"), source=str(path))


def _device_span(devices: Sequence[str]) -> str:
    """``v100-0, v100-1`` or, for many, ``v100-0 .. p100-5 (12)``."""
    if len(devices) <= 3:
        return ", ".join(devices)
    return f"{devices[0]} .. {devices[-1]} ({len(devices)})"


def is_pipeline_json(d: Any) -> bool:
    """Whether a loaded plan JSON object is a pipeline plan (``"kind": "pipeline"``)."""
    return isinstance(d, Mapping) and d.get("kind") == "pipeline"
