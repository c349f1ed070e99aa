"""A launched job replayed from recorded metrics lines, for tests of the views of a live re-balancing job
(hapnb.session.Session.follow, the Explorer's launch panel) without rank processes: two ranks, a telemetry
window and an accepted re-balance after step 1, as rank 0 prints them (hapnb.run.worker, hapnb.run.reshard)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hapnb.run.launch import JobResult


class ReplayJob:
    """What a view reads of a launched :class:`hapnb.run.launch.Job` (``running``, ``steps``, ``metrics()``,
    ``wait()``, ``stop()``, ``result``), replaying ``lines``; it ends, ok, once they are read."""

    def __init__(self, lines: Sequence[Mapping[str, Any]]) -> None:
        self.lines, self.steps = list(lines), []
        self.result: JobResult | None = None

    @property
    def running(self) -> bool:
        return self.result is None

    def metrics(self) -> Iterator[Mapping[str, Any]]:
        for m in self.lines:
            self.steps.append(m)
            yield m

    def wait(self) -> JobResult:
        self.result = JobResult(returncode=0, metrics=tuple(self.steps), stderr_tails=())
        return self.result

    def stop(self) -> JobResult:
        return self.wait()


DECISION = {"step": 1, "accepted": True, "reason": "straggler: rank 2 at 3.00x the plan's time",
            "old_ratios": [[0.5, 0.5]], "new_ratios": [[0.8, 0.2]], "step_s": 0.03, "predicted_step_s": 0.02,
            "predicted_gain": 0.01, "reshard_s_estimate": 0.1}  # fmt: skip
REPLAY = [
    *({"rank": r, "step": s, "step_s": 0.03, "compute_s": 0.01, "comm_s": 0.02} for s in range(2) for r in range(2)),
    {"rank": 0, "event": "telemetry", "step": 1, "window": {"compute_s": [0.01, 0.03], "comm_s": [0.02, 0.0]},
     "scale": [1.0, 3.0]},
    {"rank": 0, "event": "rebalance", "rebalance": DECISION},
    *({"rank": r, "step": 2, "step_s": 0.02} for r in range(2)),
]  # fmt: skip
