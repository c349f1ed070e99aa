"""Per-step telemetry of a training rank (issue 21): compute seconds, seconds blocked in collectives, peak
memory; and one small all-gather per window of ``every`` steps that gives every rank the whole table.

:class:`CollectiveClock` times every collective the rank runs by wrapping torch.distributed's collective
functions for as long as it is installed (the rank program's collectives, their autograd duals in the
backward and the gradient buckets all call them by attribute at call time); an asynchronous collective is
timed in its ``wait()``. No extra synchronisation: the wrappers only read the clock. A rank's compute is
its step time minus the time it was blocked in collectives, so a rank that waits for a straggler shows
the wait as communication, not compute. ``slowdown`` (an injected straggler, ``--slowdown``) stretches
the compute between collectives: before each collective or wait the rank sleeps ``slowdown - 1`` times the
compute since the last one, so it is slower all through the step, as a slower device is.

:class:`Window` sums a rank's steps; :meth:`Window.gather` all-gathers one row of floats per rank
(``FIELDS``) every window, outside the clock.

>>> w = Window()
>>> w.add(compute_s=1.0, comm_s=0.5, step_s=1.5, memory=10)
>>> w.add(compute_s=3.0, comm_s=0.5, step_s=3.5, memory=20)
>>> [round(x, 3) for x in w.row(0.25)]
[2.0, 0.5, 0.5, 2.5, 3.5, 20.0, 0.25, 2.0, 0.0]
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CollectiveClock", "Window", "FIELDS", "table"]

#: one rank's row in the window table: median compute per step, its relative standard deviation, median
#: time blocked in collectives, median and max step time, peak memory (bytes), program generation time, steps,
#: median optimizer step (the part of the compute that does not shrink with a rank's share of the batch)
FIELDS = (
    "compute_s", "compute_rsd", "comm_s", "step_s", "step_max_s", "memory", "compile_s", "steps", "optimizer_s",
)  # fmt: skip

#: torch.distributed functions that communicate (what the rank program, its duals and buckets call)
_TIMED = (
    "all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "all_to_all_single", "all_to_all", "barrier",
)  # fmt: skip


class _TimedWork:
    """An async collective's work handle whose ``wait()`` is timed (everything else is forwarded)."""

    def __init__(self, work: Any, clock: CollectiveClock) -> None:
        self._work, self._clock = work, clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.timed(self._work.wait, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveClock:
    """Seconds this process spent blocked in torch.distributed collectives since it was installed
    (:attr:`seconds`); a context manager that installs and removes the wrappers."""

    def __init__(self, slowdown: float = 1.0) -> None:
        self.seconds = 0.0
        self.slowdown = float(slowdown)
        self._last = time.perf_counter()
        self._saved: dict[str, Callable[..., Any]] = {}

    def mark(self) -> None:
        """Start counting compute from now (a step's start)."""
        self._last = time.perf_counter()

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a collective or a wait, timed as blocked; with ``slowdown`` > 1 the
        compute since the last collective first takes ``slowdown`` times as long (a sleep)."""
        t0 = time.perf_counter()
        if self.slowdown != 1.0:
            time.sleep(max(0.0, (self.slowdown - 1.0) * (t0 - self._last)))
            t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._last = time.perf_counter()
            self.seconds += self._last - t0

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            out = self.timed(fn, *args, **kwargs)
            return _TimedWork(out, self) if out is not None and hasattr(out, "wait") else out

        return timed

    def original(self, name: str) -> Callable[..., Any]:
        """The unwrapped torch.distributed function ``name`` (for the telemetry's own gathers)."""
        import torch.distributed as dist

        return self._saved.get(name) or getattr(dist, name)

    def __enter__(self) -> CollectiveClock:
        import torch.distributed as dist

        for name in _TIMED:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._saved:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}


class Window:
    """One rank's steps since the last gather."""

    def __init__(self) -> None:
        self.compute: list[float] = []
        self.comm: list[float] = []
        self.step: list[float] = []
        self.optimizer: list[float] = []
        self.memory = 0

    def add(
        self, *, compute_s: float, comm_s: float, step_s: float, memory: int, optimizer_s: float = 0.0
    ) -> None:
        self.optimizer.append(float(optimizer_s))
        self.compute.append(float(compute_s))
        self.comm.append(float(comm_s))
        self.step.append(float(step_s))
        self.memory = max(self.memory, int(memory))

    def __len__(self) -> int:
        return len(self.step)

    def row(self, compile_s: float) -> list[float]:
        """This rank's row of :data:`FIELDS`."""
        n = len(self.step)
        if n == 0:
            return [0.0] * len(FIELDS)
        comp = statistics.median(self.compute)
        rsd = statistics.pstdev(self.compute) / comp if n > 1 and comp > 0 else 0.0
        step = statistics.median(self.step)
        comm = statistics.median(self.comm)
        opt = statistics.median(self.optimizer)
        return [comp, rsd, comm, step, max(self.step), float(self.memory), float(compile_s), float(n), opt]

    def gather(
        self, compile_s: float, device: Any, clock: CollectiveClock | None = None
    ) -> list[list[float]]:
        """Every rank's :meth:`row` (one all-gather of a few float64 values, not timed by ``clock``),
        then start a new window."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor(self.row(compile_s), dtype=torch.float64, device=device)
        rows = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            gather = clock.original("all_gather") if clock is not None else dist.all_gather
            gather(rows, mine)
        self.__init__()  # type: ignore[misc]
        return [[float(x) for x in r.cpu()] for r in rows]


def table(rows: list[list[float]]) -> dict[str, list[float]]:
    """The gathered rows as ``{field: [value per rank]}``.

    >>> table([[1, 0, 2, 3, 3, 5, 0.1, 4, 0], [2, 0, 1, 3, 3, 6, 0.1, 4, 0]])["compute_s"]
    [1, 2]
    """
    return {f: [r[i] for r in rows] for i, f in enumerate(FIELDS)}
