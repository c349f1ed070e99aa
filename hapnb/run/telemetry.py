"""Per-step telemetry of a training rank (issue 21): compute seconds, seconds blocked in collectives (in
all and per collective kind, with the bytes and calls), peak memory; and one small all-gather per window of
``every`` steps that gives every rank the whole table.

:class:`CollectiveClock` times every collective the rank runs by wrapping torch.distributed's collective
functions for as long as it is installed (the rank program's collectives, their autograd duals in the
backward and the gradient buckets all call them by attribute at call time); an asynchronous collective is
timed in its ``wait()``. No extra synchronisation: the wrappers only read the clock and the tensors' sizes.
A rank's compute is its step time minus the time it was blocked in collectives, so a rank that waits for a
straggler shows the wait as communication, not compute. ``slowdown`` (an injected straggler,
``--slowdown``) stretches the compute between collectives: before each collective or wait the rank sleeps
``slowdown - 1`` times the compute since the last one, so it is slower all through the step, as a slower
device is.

Per collective kind (:data:`hapnb.hardware.parts.COLLECTIVE_KINDS`, :data:`KIND_OF`) the clock also keeps
the seconds blocked, the bytes and the calls (:attr:`CollectiveClock.links`), with the bytes counted as the
cost model counts them for that kind (:mod:`hapnb.hardware.parts`: an all-gather its output, a
reduce-scatter its input, a broadcast or reduce its tensor, an all-to-all what this rank sends), so the
link fit (:mod:`hapnb.run.linkfit`) can price them with the cluster's collective model. An asynchronous
collective (a gradient bucket) counts its bytes and call when it starts and its seconds in ``wait()``:
only the part the rank was blocked, not the part hidden behind compute. ``barrier`` counts as blocked time
but as no link.

:class:`Window` sums a rank's steps; :meth:`Window.gather` all-gathers one row of floats per rank
(``FIELDS``) every window, outside the clock.

>>> w = Window()
>>> w.add(compute_s=1.0, comm_s=0.5, step_s=1.5, memory=10, links={"all_reduce": (0.4, 800.0, 2.0)})
>>> w.add(compute_s=3.0, comm_s=0.5, step_s=3.5, memory=20, links={"all_reduce": (0.2, 800.0, 2.0)})
>>> [round(x, 3) for x in w.row(0.25)[:9]]
[2.0, 0.5, 0.5, 2.5, 3.5, 20.0, 0.25, 2.0, 0.0]
>>> t = table([w.row(0.25)])
>>> t["all_reduce_s"], t["all_reduce_bytes"], t["all_reduce_calls"], t["all_gather_calls"]
([0.30000000000000004], [800.0], [2.0], [0.0])
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..hardware.parts import COLLECTIVE_KINDS

__all__ = ["CollectiveClock", "Window", "Streaks", "FIELDS", "LINK_FIELDS", "KIND_OF", "table"]

#: per collective kind, the fields of a rank's row: median seconds blocked per step, their relative
#: standard deviation over the window, median bytes per step (as the cost model counts them), median calls
LINK_FIELDS = ("s", "rsd", "bytes", "calls")

#: one rank's row in the window table: median compute per step, its relative standard deviation, median
#: time blocked in collectives, median and max step time, peak memory (bytes), program generation time, steps,
#: median optimizer step (the part of the compute that does not shrink with a rank's share of the batch);
#: then per collective kind ``<kind>_s``, ``<kind>_rsd``, ``<kind>_bytes``, ``<kind>_calls`` (:data:`LINK_FIELDS`)
FIELDS = (
    "compute_s", "compute_rsd", "comm_s", "step_s", "step_max_s", "memory", "compile_s", "steps", "optimizer_s",
    *(f"{k}_{f}" for k in COLLECTIVE_KINDS for f in LINK_FIELDS),
)  # fmt: skip

#: torch.distributed functions that communicate (what the rank program, its duals and buckets call)
_TIMED = (
    "all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "all_to_all_single", "all_to_all", "barrier",
)  # fmt: skip

#: torch.distributed function -> the cost model's collective kind (``barrier`` is none)
KIND_OF = {
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast",
    "reduce": "reduce", "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
}  # fmt: skip

#: which argument holds the bytes the cost model counts (0: the first, 1: the second; a list is summed)
_BYTES_ARG = {"all_gather": 0, "all_gather_into_tensor": 0, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
              "all_to_all": 1, "all_to_all_single": 1}  # fmt: skip


#: the same argument passed by keyword (default ``tensor``)
_BYTES_KWARG = {"all_gather": "tensor_list", "all_gather_into_tensor": "output_tensor", "reduce_scatter": "input_list",
                "reduce_scatter_tensor": "input", "all_to_all": "input_tensor_list", "all_to_all_single": "input"}  # fmt: skip


def _nbytes(x: Any) -> int:
    """Bytes of a tensor or a list of tensors (0 for anything else)."""
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    try:
        return int(x.numel()) * int(x.element_size())
    except AttributeError:
        return 0


def _call_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The bytes a call of torch.distributed's ``name`` moves, as the cost model counts its kind."""
    i = _BYTES_ARG.get(name, 0)
    if len(args) > i:
        return _nbytes(args[i])
    return _nbytes(kwargs.get(_BYTES_KWARG.get(name, "tensor")))


class _TimedWork:
    """An async collective's work handle whose ``wait()`` is timed (everything else is forwarded)."""

    def __init__(self, work: Any, clock: CollectiveClock, kind: str | None = None) -> None:
        self._work, self._clock, self._kind = work, clock, kind

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.timed(self._work.wait, *args, kind=self._kind, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveClock:
    """Seconds this process spent blocked in torch.distributed collectives since it was installed
    (:attr:`seconds`), and per collective kind ``[seconds, bytes, calls]`` (:attr:`links`, cumulative);
    a context manager that installs and removes the wrappers."""

    def __init__(self, slowdown: float = 1.0) -> None:
        self.seconds = 0.0
        self.links: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in COLLECTIVE_KINDS}
        self.slowdown = float(slowdown)
        self._last = time.perf_counter()
        self._saved: dict[str, Callable[..., Any]] = {}

    def mark(self) -> None:
        """Start counting compute from now (a step's start)."""
        self._last = time.perf_counter()

    def timed(self, fn: Callable[..., Any], *args: Any, kind: str | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a collective or a wait, timed as blocked (and counted to collective
        ``kind`` when given); with ``slowdown`` > 1 the compute since the last collective first takes
        ``slowdown`` times as long (a sleep)."""
        t0 = time.perf_counter()
        if self.slowdown != 1.0:
            time.sleep(max(0.0, (self.slowdown - 1.0) * (t0 - self._last)))
            t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._last = time.perf_counter()
            self.seconds += self._last - t0
            if kind is not None:
                self.links[kind][0] += self._last - t0

    def link_totals(self) -> dict[str, tuple[float, float, float]]:
        """A copy of :attr:`links` (subtract two to get a step's)."""
        return {k: (v[0], v[1], v[2]) for k, v in self.links.items()}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind = KIND_OF.get(name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if kind is not None:
                acc = self.links[kind]
                acc[1] += _call_bytes(name, args, kwargs)
                acc[2] += 1
            out = self.timed(fn, *args, kind=kind, **kwargs)
            return _TimedWork(out, self, kind) if out is not None and hasattr(out, "wait") else out

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
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}


class Streaks:
    """Per key (a device, a collective kind), how many windows in a row it departed from the plan: what
    the straggler and link detectors count. :meth:`update` takes the keys that departed in this window and
    returns, in ``order``, those that departed for ``patience`` windows in a row.

    >>> s = Streaks(2)
    >>> s.update({1}, range(3)), s.update({1, 2}, range(3)), s.update({2}, range(3))
    ((), (1,), (2,))
    """

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.count: dict[Any, int] = {}

    def update(self, departed: Any, order: Any) -> tuple[Any, ...]:
        self.count = {k: self.count.get(k, 0) + 1 for k in departed}
        return tuple(k for k in order if self.count.get(k, 0) >= self.patience)

    def reset(self) -> None:
        self.count = {}


class Window:
    """One rank's steps since the last gather."""

    def __init__(self) -> None:
        self.compute: list[float] = []
        self.comm: list[float] = []
        self.step: list[float] = []
        self.optimizer: list[float] = []
        self.links: dict[str, list[tuple[float, float, float]]] = {k: [] for k in COLLECTIVE_KINDS}
        self.memory = 0

    def add(
        self,
        *,
        compute_s: float,
        comm_s: float,
        step_s: float,
        memory: int,
        optimizer_s: float = 0.0,
        links: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        """One step; ``links``: per collective kind this step's ``(seconds blocked, bytes, calls)``."""
        self.optimizer.append(float(optimizer_s))
        self.compute.append(float(compute_s))
        self.comm.append(float(comm_s))
        self.step.append(float(step_s))
        self.memory = max(self.memory, int(memory))
        for k, acc in self.links.items():
            s, b, c = (links or {}).get(k, (0.0, 0.0, 0.0))
            acc.append((float(s), float(b), float(c)))

    def __len__(self) -> int:
        return len(self.step)

    def row(self, compile_s: float) -> list[float]:
        """This rank's row of :data:`FIELDS`."""
        n = len(self.step)
        if n == 0:
            return [0.0] * len(FIELDS)
        comp, rsd = _median_rsd(self.compute)
        step = statistics.median(self.step)
        comm = statistics.median(self.comm)
        opt = statistics.median(self.optimizer)
        out = [comp, rsd, comm, step, max(self.step), float(self.memory), float(compile_s), float(n), opt]
        for k in COLLECTIVE_KINDS:  # every step adds a row for every kind (zeros where it ran none)
            secs, nbytes, calls = zip(*self.links[k])
            out += [*_median_rsd(secs), float(statistics.median(nbytes)), float(statistics.median(calls))]
        return out

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


def _median_rsd(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and their relative standard deviation (0 for one value or a zero median)."""
    med = statistics.median(values)
    return med, statistics.pstdev(values) / med if len(values) > 1 and med > 0 else 0.0


def table(rows: list[list[float]]) -> dict[str, list[float]]:
    """The gathered rows as ``{field: [value per rank]}`` (a short row, from an older rank, leaves the
    fields it lacks out).

    >>> table([[1, 0, 2, 3, 3, 5, 0.1, 4, 0], [2, 0, 1, 3, 3, 6, 0.1, 4, 0]])["compute_s"]
    [1, 2]
    """
    width = min(len(r) for r in rows)
    return {f: [r[i] for r in rows] for i, f in enumerate(FIELDS[:width])}
