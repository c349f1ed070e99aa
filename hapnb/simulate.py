"""Simulate: a plan's timeline per device (stages of communication, computation and idle time).

This is the stage model of the cost model laid out in time: every stage starts when all devices are
synchronised, runs its communication, then each device computes for ``comp_s[j]`` and waits for the
slowest one. Memory per device comes from the plan's estimate (parameters, gradients, Adam state,
inputs and activations kept for the backward).

>>> from hapnb.simulate import Segment
>>> Segment("v100-0", 0, "comm", 0.0, 1e-3).duration_s
0.001
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .plan import Plan

__all__ = ["Segment", "Timeline", "simulate"]


@dataclass(frozen=True)
class Segment:
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
    plan_name: str
    devices: tuple[str, ...]
    segments: tuple[Segment, ...]
    iteration_s: float
    peak_memory_bytes: tuple[int, ...]
    memory_capacity_bytes: tuple[int, ...]

    @property
    def oom(self) -> tuple[bool, ...]:
        return tuple(m > c for m, c in zip(self.peak_memory_bytes, self.memory_capacity_bytes))

    def busy_fraction(self) -> dict[str, float]:
        """Fraction of the iteration each device computes."""
        out = {d: 0.0 for d in self.devices}
        for s in self.segments:
            if s.kind == "comp":
                out[s.device] += s.duration_s
        return {d: v / self.iteration_s if self.iteration_s else 0.0 for d, v in out.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration_s": self.iteration_s,
            "devices": [
                {
                    "name": d,
                    "peak_memory_bytes": m,
                    "capacity_bytes": c,
                    "oom": m > c,
                    "busy_fraction": self.busy_fraction()[d],
                }
                for d, m, c in zip(self.devices, self.peak_memory_bytes, self.memory_capacity_bytes)
            ],
            "segments": [[s.device, s.stage, s.kind, s.start_s, s.end_s] for s in self.segments],
        }

    def __str__(self) -> str:
        busy = self.busy_fraction()
        lines = [f"Timeline of {self.plan_name}: {self.iteration_s * 1e3:.3f} ms per iteration"]
        for d, m, c in zip(self.devices, self.peak_memory_bytes, self.memory_capacity_bytes):
            lines.append(
                f"  {d:10s} busy {busy[d] * 100:5.1f}%  memory {m / 2**30:7.2f} / {c / 2**30:.1f} GiB"
                + ("  OUT OF MEMORY" if m > c else "")
            )
        return "\n".join(lines)


def simulate(plan: Plan) -> Timeline:
    """Lay the plan's stages out in time per device."""
    names = plan.cluster.names
    segs: list[Segment] = []
    t = 0.0
    for st in plan.stages:
        comp_end = t + st.comm_s
        stage_end = comp_end + (max(st.comp_s) if st.comp_s else 0.0)
        for j, d in enumerate(names):
            if st.comm_s > 0:
                segs.append(Segment(d, st.index, "comm", t, comp_end))
            c = st.comp_s[j] if j < len(st.comp_s) else 0.0
            if c > 0:
                segs.append(Segment(d, st.index, "comp", comp_end, comp_end + c))
            if comp_end + c < stage_end:
                segs.append(Segment(d, st.index, "idle", comp_end + c, stage_end))
        t = stage_end
    caps = tuple(int(d.memory_bytes / max(1, d.gpus)) for d in plan.cluster.devices)
    mem = plan.memory_bytes or (0,) * len(names)
    return Timeline(plan.name, names, tuple(segs), t, tuple(mem), caps)
