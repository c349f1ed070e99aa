"""What a simulation produces (:func:`hapnb.plans.simulation.simulate`): a :class:`Timeline` of
:class:`Span` (one task on one stream of one device), the per-stage :class:`Segment` view, and each
device's memory over the iteration (a step function built from the bytes each task allocates and frees).

>>> Span("v100-0", "compute", 0.0, 1e-3, 3, "forward").duration_s
0.001
>>> _memory([(2.0, -5), (1.0, 10)], 100)
(((0.0, 100), (1.0, 110), (2.0, 105)), 110)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .plan import Plan

__all__ = ["Span", "Segment", "Timeline", "STREAMS", "PHASES", "SPAN_FIELDS"]

#: The streams of a device: computation, feature collectives, gradient all-reduces (Proteus' queues).
STREAMS = ("compute", "feature-comm", "gradient-comm")
PHASES = ("forward", "backward", "optimizer")
#: The order of a span's fields in the JSON (``"spans"``: one compact list per span).
SPAN_FIELDS = ("device", "stream", "start_s", "end_s", "instruction", "phase", "micro_batch", "what")


@dataclass(frozen=True)
class Span:
    """One task on one stream of one device: ``instruction`` indexes ``plan.program`` (-1: none, e.g. a
    gradient bucket of several loads or a stage of a plan without per-instruction costs)."""

    device: str
    stream: str  # one of STREAMS
    start_s: float
    end_s: float
    instruction: int
    phase: str  # one of PHASES
    micro_batch: int = 0
    what: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> list[Any]:
        return [getattr(self, f) for f in SPAN_FIELDS]

    @staticmethod
    def from_json(row: Sequence[Any]) -> Span:
        d, s, a, b, i, p, m, w = row
        return Span(str(d), str(s), float(a), float(b), int(i), str(p), int(m), str(w))


@dataclass(frozen=True)
class Segment:
    """The per-stage view of a device's time (``comm`` / ``comp`` / ``idle``), kept for older readers:
    stage-synchronous timelines have one per stage and kind; overlap timelines one per span (``comm`` may
    then overlap ``comp``) and ``idle`` for the gaps of the compute stream."""

    device: str
    stage: int
    kind: str  # "comm" | "comp" | "idle"
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """A simulated iteration: spans per device and stream, memory over time, peak memory and OOM flags."""

    plan_name: str
    devices: tuple[str, ...]
    segments: tuple[Segment, ...]
    iteration_s: float
    peak_memory_bytes: tuple[int, ...]
    memory_capacity_bytes: tuple[int, ...]
    spans: tuple[Span, ...] = ()
    #: per device: (time, bytes) points, a step function (the value holds until the next point)
    memory: tuple[tuple[tuple[float, int], ...], ...] = ()
    overlap: bool = False
    bandwidth_sharing: bool = False
    slowdown: tuple[float, ...] = ()  # γ per device (overlap mode)
    duplex: bool = False

    @property
    def oom(self) -> tuple[bool, ...]:
        return tuple(m > c for m, c in zip(self.peak_memory_bytes, self.memory_capacity_bytes))

    def busy_fraction(self) -> dict[str, float]:
        """Fraction of the iteration each device's compute stream is busy."""
        out = {d: 0.0 for d in self.devices}
        for s in self.spans:
            if s.stream == "compute":
                out[s.device] += s.duration_s
        return {d: v / self.iteration_s if self.iteration_s else 0.0 for d, v in out.items()}

    def spans_of(self, device: str, stream: str | None = None) -> tuple[Span, ...]:
        """The spans of one device (and stream), by start time."""
        got = [s for s in self.spans if s.device == device and (stream is None or s.stream == stream)]
        return tuple(sorted(got, key=lambda s: (s.start_s, s.end_s)))

    def to_json(self) -> dict[str, Any]:
        """``iteration_s``, ``devices`` [{name, peak_memory_bytes, capacity_bytes, oom, busy_fraction,
        memory: [[t, bytes], ...]}], ``mode`` ("overlap" | "stage"), ``bandwidth_sharing``, ``duplex``,
        ``slowdown`` (γ per device), ``span_fields`` (:data:`SPAN_FIELDS`) and ``spans`` (one list per
        span in that order)."""
        busy = self.busy_fraction()
        mem = self.memory or ((),) * len(self.devices)
        return {
            "iteration_s": self.iteration_s,
            "mode": "overlap" if self.overlap else "stage",
            "bandwidth_sharing": self.bandwidth_sharing,
            "duplex": self.duplex,
            "slowdown": list(self.slowdown),
            "devices": [
                {
                    "name": d,
                    "peak_memory_bytes": m,
                    "capacity_bytes": c,
                    "oom": m > c,
                    "busy_fraction": busy[d],
                    "memory": [[t, b] for t, b in pts],
                }
                for d, m, c, pts in zip(self.devices, self.peak_memory_bytes, self.memory_capacity_bytes, mem)
            ],
            "span_fields": list(SPAN_FIELDS),
            "spans": [s.to_json() for s in self.spans],
        }

    def gantt(self, **kw: Any) -> Any:
        """A bokeh Gantt chart of the spans: a lane per device with a sub-lane per stream (needs bokeh)."""
        from ..display import charts

        return charts.timeline_gantt(self, **kw)

    def memory_chart(self, **kw: Any) -> Any:
        """A bokeh line chart of each device's memory over the iteration (needs bokeh)."""
        from ..display import charts

        return charts.memory_chart(self, **kw)

    def __str__(self) -> str:
        busy = self.busy_fraction()
        mode = "overlap" if self.overlap else "stage-synchronous"
        lines = [f"Timeline of {self.plan_name} ({mode}): {self.iteration_s * 1e3:.3f} ms per iteration"]
        for d, m, c in zip(self.devices, self.peak_memory_bytes, self.memory_capacity_bytes):
            lines.append(
                f"  {d:10s} busy {busy[d] * 100:5.1f}%  memory {m / 2**30:7.2f} / {c / 2**30:.1f} GiB"
                + ("  OUT OF MEMORY" if m > c else "")
            )
        return "\n".join(lines)


# ============================================================================================ memory


def _memory_parts(plan: Plan, j: int) -> tuple[int, int, int]:
    """(persistent, activations, transient) bytes of device j from the plan's breakdown."""
    if j < len(plan.memory_breakdown):
        b = dict(plan.memory_breakdown[j])
        act, tr = int(b.get("activations", 0)), int(b.get("transient", 0))
        return sum(int(v) for v in b.values()) - act - tr, act, tr
    peak = plan.memory_bytes[j] if j < len(plan.memory_bytes) else 0
    return int(peak), 0, 0


def _shares(total: int, k: int) -> list[int]:
    """``total`` bytes in ``k`` integer shares that sum to it exactly."""
    if k <= 0:
        return []
    q, r = divmod(total, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def _memory(events: list[tuple[float, int]], base: int) -> tuple[tuple[tuple[float, int], ...], int]:
    """``events`` (time, bytes delta) in the order they happen on the device's compute stream (a stable
    sort by time keeps that order at equal times) -> ((time, bytes) after each distinct time, peak)."""
    pts = [(0.0, base)]
    cur = peak = base
    for t, delta in sorted(events, key=lambda e: e[0]):
        cur += delta
        peak = max(peak, cur)
        if pts[-1][0] == t:
            pts[-1] = (t, cur)
        else:
            pts.append((t, cur))
    return tuple(pts), peak
