"""Launch a plan on ranks and stream their per-step metrics (``hapnb launch``).

:func:`launch` starts one worker process per rank, by default ``python -m hapnb.run.worker BUNDLE --steps N
--backend B``, which prints one JSON line per training step on stdout::

    {"rank": 0, "step": 3, "loss": 2.31, "global_loss": 2.30, "step_s": 0.012, "max_memory_bytes": 1048576}

and returns a :class:`Job` that collects those lines as they arrive.

How ranks are started
---------------------
Local runs **spawn the K rank processes directly** with the environment ``torchrun`` would give them
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT`` = a free port, ``OMP_NUM_THREADS``, ``PYTHONUNBUFFERED=1``), so workers use
``init_process_group(init_method="env://")`` exactly as under torchrun. Spawning directly rather than
through torchrun is deliberate: the launcher owns one process (and one process group) per rank, so it
reads each rank's stdout and stderr separately, knows which rank crashed or went silent, and can kill a
rank's whole process tree. A multi-node run with :func:`launch` does the same on every node with a
static rendezvous (``rdzv`` = node 0's ``HOST:PORT``, global rank = ``node_rank * nproc + local_rank``).
For clusters where torchrun is preferred, :func:`launch_commands` prints one torchrun command per node
(c10d rendezvous) and :func:`slurm_script` an sbatch script (srun + torchrun).

Failure handling
----------------
* A rank that exits with a non-zero code stops the whole job at once; :attr:`JobResult.error` names the
  rank, its exit code, the last step it reported and the last lines of its stderr (its traceback).
* A rank that prints nothing for ``timeout_s`` seconds (or a job that runs past ``wall_timeout_s``) is
  stopped; the error names the silent rank(s) and the last step each reported.
* Stopping sends SIGTERM to every rank's process group (and to descendants that left it), waits
  ``kill_grace_s``, then SIGKILLs what is left: no orphans. ``Ctrl-C`` during :meth:`Job.wait` or
  :meth:`Job.metrics` stops the job before re-raising, and so does leaving a ``with`` block.

>>> job = launch("plan.bundle", nproc=2, steps=5)          # doctest: +SKIP
>>> for m in job.metrics():                                 # doctest: +SKIP
...     print(m["rank"], m["step"], m["loss"])
>>> job.wait(check=True).median_step_s                      # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_WORKER",
    "Job",
    "JobResult",
    "LaunchError",
    "add_launch_args",
    "free_port",
    "launch",
    "launch_commands",
    "launch_main",
    "rank_envs",
    "slurm_script",
    "step_times",
]

#: The per-rank worker: ``python -m hapnb.run.worker BUNDLE --steps N --backend B``.
DEFAULT_WORKER: tuple[str, ...] = ("-m", "hapnb.run.worker")
_TAIL_LINES = 40
_BACKENDS = ("gloo", "nccl", "mpi", "ucc")
# stderr markers of a rank that failed only because a peer died first (not the root cause)
_SECONDARY = (
    "Connection closed by peer",
    "Connection reset by peer",
    "recvBytes",
    "DistNetworkError",
    "DistBackendError",
    "ProcessGroupNCCL",
    "ProcessGroupGloo",
    "SIGTERM",
)


class LaunchError(RuntimeError):
    """A launched job failed (a rank crashed or hung); ``.result`` is its :class:`JobResult`."""

    def __init__(self, message: str, result: JobResult | None = None) -> None:
        super().__init__(message)
        self.result = result


# ----------------------------------------------------------------------------------------------------
# Results


def step_times(metrics: Sequence[Mapping[str, Any]], warmup: int = 0) -> list[float]:
    """Per-step iteration times: for each step, the slowest rank's ``step_s``; the first ``warmup``
    steps (in step order) are dropped unless that would leave none.

    >>> step_times([{"rank": 0, "step": 0, "step_s": 1.0}, {"rank": 1, "step": 0, "step_s": 3.0},
    ...             {"rank": 0, "step": 1, "step_s": 2.0}])
    [3.0, 2.0]
    """
    per_step: dict[Any, float] = {}
    for m in metrics:
        s, t = m.get("step"), m.get("step_s")
        if s is None or not isinstance(t, (int, float)) or isinstance(t, bool):
            continue
        per_step[s] = max(per_step.get(s, -math.inf), float(t))
    order = sorted(per_step, key=lambda s: (not isinstance(s, (int, float)), s))
    times = [per_step[s] for s in order]
    return times[warmup:] if len(times) > warmup else times


@dataclass(frozen=True)
class JobResult:
    """What a finished job left: exit status, metrics lines, stderr tails and the error, if any.

    ``returncode`` is 0 when every rank exited 0; the failing rank's code after a crash (128 + signal
    number when it was killed by a signal); 124 after a timeout (silent rank or wall limit); 130 when
    stopped by :meth:`Job.stop` or Ctrl-C.
    """

    returncode: int
    metrics: tuple[dict[str, Any], ...]
    stderr_tails: tuple[str, ...]  # per rank (last lines of its stderr)
    error: str | None = None
    returncodes: tuple[int | None, ...] = ()  # per rank, as the OS reported them (negative: signal)
    failed_rank: int | None = None
    wall_s: float = 0.0
    stdout_tails: tuple[str, ...] = field(default=(), repr=False)  # per rank, non-JSON stdout lines

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None

    def step_times(self, warmup: int = 1) -> list[float]:
        """Slowest-rank time of each step, without the first ``warmup`` steps (see :func:`step_times`)."""
        return step_times(self.metrics, warmup)

    @property
    def median_step_s(self) -> float | None:
        """Median over steps (first one skipped as warm-up) of the slowest rank's step time."""
        times = self.step_times(1)
        return statistics.median(times) if times else None

    @property
    def final_loss(self) -> float | None:
        """``global_loss`` (else ``loss``) of the last step reported (rank 0's line when there is one)."""
        best: tuple[Any, ...] | None = None
        for m in self.metrics:
            loss = m.get("global_loss", m.get("loss"))
            if loss is None or "step" not in m:
                continue
            key = (m["step"], m.get("rank") == 0)
            if best is None or key >= best[0]:
                best = (key, loss)
        return None if best is None else float(best[1])

    def summary(self) -> str:
        """One line: steps, median step time, final loss, and the error if any."""
        steps = len({m.get("step") for m in self.metrics if "step" in m})
        med, loss = self.median_step_s, self.final_loss
        parts = [f"{steps} step{'s' * (steps != 1)}"]
        parts.append(f"median step {med * 1e3:.3f} ms" if med is not None else "no step times")
        if loss is not None:
            parts.append(f"final loss {loss:.6g}")
        parts.append(f"wall {self.wall_s:.1f} s")
        text = ", ".join(parts)
        return text if self.ok else f"{text}; FAILED (exit {self.returncode}): {self.error}"


# ----------------------------------------------------------------------------------------------------
# Process helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _children_proc(pid: int) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ..." — comm may contain spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            kids[int(fields[1])].append(int(entry))
    return kids


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (psutil when installed, else /proc; empty elsewhere)."""
    try:
        import psutil

        try:
            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    except ImportError:
        pass
    if not os.path.isdir("/proc"):
        return []
    kids = _children_proc(pid)
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal(pid: int, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


class _Rank:
    """Mutable bookkeeping of one rank process (owned by a :class:`Job`)."""

    def __init__(self, rank: int, proc: Any, started: float) -> None:
        self.rank = rank
        self.proc = proc
        self.last_output = started
        self.last_step: Any = None
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.stderr: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.stdout: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.readers: list[threading.Thread] = []

    def stderr_tail(self, lines: int = 15) -> str:
        return "\n".join(list(self.stderr)[-lines:])


_LIVE_JOBS: weakref.WeakSet[Job] = weakref.WeakSet()


@atexit.register
def _stop_live_jobs() -> None:  # pragma: no cover - interpreter shutdown
    for job in list(_LIVE_JOBS):
        with contextlib.suppress(Exception):
            job.stop()


# ----------------------------------------------------------------------------------------------------
# Job


class Job:
    """Running rank processes: streams their JSON metrics lines, watches for crashes and hangs.

    Usually made by :func:`launch`; build one directly to run any command per rank::

        job = Job([[sys.executable, "worker.py"]] * 2, [env0, env1], timeout_s=60)

    ``argvs[i]`` / ``envs[i]`` start rank ``ranks[i]`` (default ``i``). Every stdout line that parses as
    a JSON object is a metrics dict (``"rank"`` added when missing); other lines are kept as text.
    ``timeout_s``: a rank silent (no stdout/stderr line) that long stops the job; ``wall_timeout_s``:
    limit on the whole job. ``cleanup``: paths removed when the job ends (a temporary bundle).
    """

    def __init__(
        self,
        argvs: Sequence[Sequence[str]],
        envs: Sequence[Mapping[str, str]],
        *,
        ranks: Sequence[int] | None = None,
        timeout_s: float | None = 300.0,
        wall_timeout_s: float | None = None,
        kill_grace_s: float = 3.0,
        cwd: str | os.PathLike[str] | None = None,
        cleanup: Sequence[str | os.PathLike[str]] = (),
        poll_s: float = 0.05,
    ) -> None:
        import subprocess

        if not argvs:
            raise ValueError("a Job needs at least one rank command")
        if len(envs) != len(argvs):
            raise ValueError(f"{len(argvs)} rank commands but {len(envs)} environments")
        for what, v in (("timeout_s", timeout_s), ("wall_timeout_s", wall_timeout_s)):
            if v is not None and not v > 0:
                raise ValueError(f"{what} must be positive or None, got {v!r}")
        self.timeout_s = timeout_s
        self.wall_timeout_s = wall_timeout_s
        self.kill_grace_s = kill_grace_s
        self._poll_s = poll_s
        self._cleanup = [Path(p) for p in cleanup]
        self._cond = threading.Condition()
        self._metrics: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._stop_requested = False
        self._result: JobResult | None = None
        self._ranks: list[_Rank] = []
        self._kill_lock = threading.Lock()
        self.started = time.monotonic()
        rank_ids = list(ranks) if ranks is not None else list(range(len(argvs)))
        _LIVE_JOBS.add(self)
        try:
            for r, argv, env in zip(rank_ids, argvs, envs):
                proc = subprocess.Popen(
                    list(argv),
                    env=dict(env),
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    encoding="utf-8",
                    errors="replace",
                    bufsize=1,
                    start_new_session=True,  # own process group: stop() kills the rank's whole tree
                )
                self._ranks.append(_Rank(r, proc, time.monotonic()))
        except BaseException:
            self._kill_all()
            self._remove_cleanup()
            raise
        for st in self._ranks:
            for stream, is_err in ((st.proc.stdout, False), (st.proc.stderr, True)):
                t = threading.Thread(
                    target=self._read, args=(st, stream, is_err), daemon=True, name=f"hapnb-rank{st.rank}"
                )
                st.readers.append(t)
                t.start()
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="hapnb-job-monitor")
        self._monitor.start()

    # -- public ----------------------------------------------------------------------------------------

    @property
    def nproc(self) -> int:
        return len(self._ranks)

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the rank processes, in rank order."""
        return tuple(st.proc.pid for st in self._ranks)

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The metrics lines collected so far (a copy)."""
        with self._cond:
            return list(self._metrics)

    @property
    def result(self) -> JobResult | None:
        """The :class:`JobResult` once the job has ended, else None."""
        return self._result

    def metrics(self) -> Iterator[dict[str, Any]]:
        """Yield each metrics dict as it arrives (from the start), until the job ends.

        Ctrl-C while waiting for the next line stops the job and re-raises.
        """
        i = 0
        try:
            while True:
                with self._cond:
                    while i >= len(self._metrics) and not self._done.is_set():
                        self._cond.wait(0.1)
                    batch = self._metrics[i:]
                    i = len(self._metrics)
                    finished = self._done.is_set()
                if not batch and finished:
                    return
                yield from batch
        except KeyboardInterrupt:
            self.stop()
            raise

    def wait(self, timeout: float | None = None, *, check: bool = False) -> JobResult:
        """Block until the job ends and return its :class:`JobResult`.

        ``timeout``: raise :class:`TimeoutError` if it is still running then (the job keeps running;
        its own ``timeout_s``/``wall_timeout_s`` are what stop it). ``check``: raise :class:`LaunchError`
        when it failed. Ctrl-C stops the job and re-raises.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job still running after wait({timeout}); call job.stop() to end it")
        except KeyboardInterrupt:
            self.stop()
            raise
        assert self._result is not None
        if check and not self._result.ok:
            raise LaunchError(
                self._result.error or f"job exited with {self._result.returncode}", self._result
            )
        return self._result

    def stop(self, timeout: float | None = 30.0) -> JobResult | None:
        """Stop every rank (SIGTERM to its process group, SIGKILL after ``kill_grace_s``); returns the
        result. Safe to call more than once and after the job ended."""
        if not self._done.is_set():
            self._stop_requested = True
            self._kill_all()
            self._done.wait(timeout)
        return self._result

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exit {self._result.returncode if self._result else '?'}"
        return f"<hapnb Job: {self.nproc} ranks, {len(self._metrics)} metrics lines, {state}>"

    # -- internals -------------------------------------------------------------------------------------

    def _read(self, st: _Rank, stream: Any, is_err: bool) -> None:
        try:
            for raw in stream:
                line = raw.rstrip("\r\n")
                st.last_output = time.monotonic()
                if is_err:
                    st.stderr.append(line)
                    continue
                rec = _parse_metrics(line)
                if rec is None:
                    st.stdout.append(line)
                    continue
                rec.setdefault("rank", st.rank)
                if "step" in rec:
                    st.last_step = rec["step"]
                with self._cond:
                    self._metrics.append(rec)
                    self._cond.notify_all()
        except (OSError, ValueError):  # stream closed under us during a kill
            pass

    def _watch(self) -> None:
        error: str | None = None
        code = 0
        failed: int | None = None
        try:
            while True:
                time.sleep(self._poll_s)
                now = time.monotonic()
                if self._stop_requested:
                    error, code = "stopped by the user (Job.stop or Ctrl-C)", 130
                    break
                newly = []
                for st in self._ranks:
                    if st.returncode is None:
                        rc = st.proc.poll()
                        if rc is not None:
                            st.returncode, st.exited_at = rc, now
                            if rc != 0:
                                newly.append(st)
                if newly and self._stop_requested:  # our own SIGTERM, not a crash
                    error, code = "stopped by the user (Job.stop or Ctrl-C)", 130
                    break
                if newly:
                    # let the crashed ranks' readers drain their stderr (the traceback) first
                    for st in newly:
                        for t in st.readers:
                            t.join(0.5)
                    newly.sort(key=lambda s: (_is_secondary(s), s.rank))
                    first = newly[0]
                    error, code, failed = (
                        self._crash_message(first, newly[1:]),
                        _exit_code(first.returncode),
                        first.rank,
                    )
                    break
                if all(st.returncode is not None for st in self._ranks):
                    break
                if self.wall_timeout_s is not None and now - self.started > self.wall_timeout_s:
                    error, code = self._timeout_message(now, wall=True), 124
                    break
                if self.timeout_s is not None:
                    silent = [
                        st
                        for st in self._ranks
                        if st.returncode is None and now - st.last_output > self.timeout_s
                    ]
                    if silent:
                        error, code = self._timeout_message(now, wall=False), 124
                        failed = min(silent, key=lambda s: s.last_output).rank
                        break
        except Exception as exc:  # noqa: BLE001 - never leave processes behind because of a bug here
            error, code = f"internal error in the job monitor: {exc!r}", 1
        finally:
            self._kill_all()
            for st in self._ranks:
                for t in st.readers:
                    t.join(2.0)
            self._remove_cleanup()
            self._result = JobResult(
                returncode=code,
                metrics=tuple(self._metrics),
                stderr_tails=tuple(st.stderr_tail(_TAIL_LINES) for st in self._ranks),
                error=error,
                returncodes=tuple(st.proc.returncode for st in self._ranks),
                failed_rank=failed,
                wall_s=time.monotonic() - self.started,
                stdout_tails=tuple("\n".join(st.stdout) for st in self._ranks),
            )
            _LIVE_JOBS.discard(self)
            with self._cond:
                self._done.set()
                self._cond.notify_all()

    def _crash_message(self, st: _Rank, others: list[_Rank]) -> str:
        rc = st.returncode or 0
        how = f"exited with code {rc}"
        if rc < 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by {signal.Signals(-rc).name}"
            if -rc == signal.SIGKILL:
                how += " (often the out-of-memory killer)"
        step = "before reporting any step" if st.last_step is None else f"after step {st.last_step}"
        tail = st.stderr_tail() or "(no stderr output)"
        msg = f"rank {st.rank} {how} {step}; the job was stopped. Last lines of its stderr:\n{_indent(tail)}"
        if others:
            msg += (
                "\n(also failed at the same time: "
                + ", ".join(f"rank {o.rank} code {o.returncode}" for o in others)
                + ")"
            )
        return msg

    def _timeout_message(self, now: float, wall: bool) -> str:
        alive = [st for st in self._ranks if st.returncode is None]
        steps = ", ".join(f"rank {st.rank}: {_step_text(st.last_step)}" for st in self._ranks)
        if wall:
            head = f"the job ran past its wall-clock limit of {self.wall_timeout_s:g} s"
        else:
            silent = sorted(
                (st for st in alive if now - st.last_output > (self.timeout_s or 0)),
                key=lambda s: s.last_output,
            )
            who = ", ".join(f"rank {st.rank} ({now - st.last_output:.1f} s)" for st in silent)
            head = (
                f"rank {silent[0].rank} printed nothing for {self.timeout_s:g} s (timeout_s) and looks hung; "
                f"silent: {who}"
            )
        msg = f"{head}. The job was stopped. Last step per rank: {steps}."
        tails = [f"rank {st.rank}:\n{_indent(st.stderr_tail(5))}" for st in alive if st.stderr]
        if tails:
            msg += " Last stderr lines:\n" + "\n".join(tails)
        if not wall:
            msg += "\nIf the ranks are just slow (first step, big model), raise timeout_s (--timeout)."
        return msg

    def _kill_all(self) -> None:
        with self._kill_lock:
            procs = [st.proc for st in self._ranks]
            extra: set[int] = set()
            for p in procs:
                if p.poll() is None:
                    extra.update(_descendants(p.pid))
            for p in procs:
                _signal(p.pid, signal.SIGTERM, group=True)
            for pid in extra:
                _signal(pid, signal.SIGTERM, group=False)
            deadline = time.monotonic() + self.kill_grace_s
            for p in procs:
                with contextlib.suppress(Exception):
                    p.wait(max(0.0, deadline - time.monotonic()))
            for p in procs:
                _signal(p.pid, signal.SIGKILL, group=True)  # leftovers in the rank's group, if any
                if p.poll() is None:
                    _signal(p.pid, signal.SIGKILL, group=False)
            for pid in extra:
                _signal(pid, signal.SIGKILL, group=False)
            for p in procs:
                with contextlib.suppress(Exception):
                    p.wait(5.0)

    def _remove_cleanup(self) -> None:
        for p in self._cleanup:
            shutil.rmtree(p, ignore_errors=True)
        self._cleanup = []


def _exit_code(rc: int | None) -> int:
    """A shell-style exit status: negative (killed by signal k) becomes 128 + k; never 0 for a crash."""
    if rc is None or rc == 0:
        return 1
    return 128 - rc if rc < 0 else rc


def _parse_metrics(line: str) -> dict[str, Any] | None:
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _is_secondary(st: _Rank) -> bool:
    tail = st.stderr_tail(_TAIL_LINES)
    return any(m in tail for m in _SECONDARY)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _step_text(step: Any) -> str:
    return "no step yet" if step is None else f"step {step}"


# ----------------------------------------------------------------------------------------------------
# Bundles


def _plan_devices(path: Path) -> int | None:
    """Ranks a plan JSON needs: its GPUs, a virtual device counting its ``gpus`` (None if unreadable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return sum(int(d.get("gpus", 1)) for d in data["cluster"]["devices"])  # one rank per GPU
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _prepare_bundle(
    plan_or_bundle: Any, bundle_dir: str | os.PathLike[str] | None
) -> tuple[Path, Path | None, int | None]:
    """(bundle directory, temporary dir to remove afterwards or None, devices of its plan or None)."""
    from ..plan import Plan
    from .runtime import write_bundle

    if isinstance(plan_or_bundle, Plan):
        tmp = None
        if bundle_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="hapnb-bundle-"))
            target = tmp / "bundle"
        else:
            target = Path(bundle_dir)
        out = Path(write_bundle(plan_or_bundle, target))
        return out, tmp, plan_or_bundle.cluster.gpus
    if not isinstance(plan_or_bundle, (str, os.PathLike)):
        raise TypeError(
            "launch needs a Plan, a bundle directory or a plan JSON path, "
            f"got {type(plan_or_bundle).__name__}"
        )
    path = Path(plan_or_bundle).expanduser()
    if path.is_dir():
        return path, None, _plan_devices(path / "plan.json")
    if path.is_file():
        plan = Plan.load(path)
        if bundle_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="hapnb-bundle-"))
            out = Path(write_bundle(plan, tmp / "bundle"))
            return out, tmp, plan.cluster.gpus
        out = Path(write_bundle(plan, Path(bundle_dir)))
        return out, None, plan.cluster.gpus
    raise FileNotFoundError(
        f"{str(path)!r} is neither a bundle directory nor a plan JSON file; make one with "
        "`hapnb plan ... -o plan.json` or hapnb.run.bundle.write_bundle(plan, dir)"
    )


def _split_rdzv(rdzv: str) -> tuple[str, int]:
    host, sep, port = str(rdzv).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rdzv must be HOST:PORT (node 0's address and a free port), got {rdzv!r}")
    return host.strip("[]"), int(port)


def _check_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(_BACKENDS)} (gloo on CPU)")
    return backend


# ----------------------------------------------------------------------------------------------------
# launch


def rank_envs(
    nproc: int,
    master_addr: str,
    master_port: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    env: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """The environment of each local rank, as torchrun would set it (plus ``PYTHONUNBUFFERED=1`` so lines
    stream, ``OMP_NUM_THREADS`` = cores / ranks unless set, and hapnb's folder on ``PYTHONPATH`` so
    ``-m hapnb....`` workers import the same hapnb as the launcher)."""
    world = nnodes * nproc
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    base["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p != root]])
    base.update(env or {})
    base["PYTHONUNBUFFERED"] = "1"
    envs = []
    for local in range(nproc):
        rank = node_rank * nproc + local
        e = dict(base)
        e.update(
            RANK=str(rank),
            LOCAL_RANK=str(local),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK=str(node_rank),
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        envs.append(e)
    return envs


def launch(
    plan_or_bundle: Any,
    nproc: int | None = None,
    backend: str = "gloo",
    steps: int = 10,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv: str | None = None,
    timeout_s: float | None = 300.0,
    wall_timeout_s: float | None = None,
    worker: Sequence[str] = DEFAULT_WORKER,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    bundle_dir: str | os.PathLike[str] | None = None,
    python: str = sys.executable,
    kill_grace_s: float = 3.0,
) -> Job:
    """Start ``nproc`` ranks of ``plan_or_bundle`` on this node and return the running :class:`Job`.

    ``plan_or_bundle``: a :class:`~hapnb.plan.Plan` (written as a bundle first, to ``bundle_dir`` or a
    temporary folder removed when the job ends), a bundle directory, or a plan JSON file. ``nproc``
    defaults to the plan's devices (divided by ``nnodes``). Each rank runs ``python *worker BUNDLE
    --steps N --backend B *extra_args`` with torchrun's environment variables (see the module
    docstring). ``env`` adds/overrides environment variables of every rank. Multi-node: run the same
    call on each node with ``nnodes``, its ``node_rank`` and ``rdzv="HOST:PORT"`` of node 0.
    ``timeout_s``: a rank silent that long is considered hung and the job is stopped.
    """
    backend = _check_backend(backend)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"need nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes={nnodes}, node_rank={node_rank}"
        )
    if nnodes > 1 and rdzv is None:
        raise ValueError(f"a {nnodes}-node launch needs rdzv='HOST:PORT' (node 0's address and a free port)")
    bundle, tmp, devices = _prepare_bundle(plan_or_bundle, bundle_dir)
    try:
        if nproc is None:
            if devices is None:
                raise ValueError(f"cannot tell how many ranks {str(bundle)!r} needs; pass nproc (--nproc)")
            if devices % nnodes:
                raise ValueError(f"the plan has {devices} devices, not divisible by nnodes={nnodes}")
            nproc = devices // nnodes
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
        world = nnodes * nproc
        if devices is not None and devices != world:
            raise ValueError(
                f"the plan is for {devices} devices but the launch has nnodes x nproc = {nnodes} x {nproc} = "
                f"{world} ranks; launch {devices} ranks in all (e.g. --nproc {devices // nnodes or 1})"
            )
        if rdzv is None:
            addr, port = "127.0.0.1", free_port()
        else:
            addr, port = _split_rdzv(rdzv)
        argv = [python, *worker, str(bundle), "--steps", str(steps), "--backend", backend, *extra_args]
        envs = rank_envs(nproc, addr, port, nnodes=nnodes, node_rank=node_rank, env=env)
        ranks = [node_rank * nproc + local for local in range(nproc)]
        return Job(
            [argv] * nproc,
            envs,
            ranks=ranks,
            timeout_s=timeout_s,
            wall_timeout_s=wall_timeout_s,
            kill_grace_s=kill_grace_s,
            cleanup=[tmp] if tmp is not None else (),
        )
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------------------------
# Multi-node commands


def _worker_tail(
    bundle: str | os.PathLike[str], steps: int, backend: str, worker: Sequence[str], extra_args: Sequence[str]
) -> list[str]:
    return [*worker, str(bundle), "--steps", str(steps), "--backend", backend, *extra_args]


def launch_commands(
    bundle: str | os.PathLike[str],
    nnodes: int,
    nproc_per_node: int,
    rdzv: str | None = None,
    *,
    steps: int = 10,
    backend: str = "nccl",
    worker: Sequence[str] = DEFAULT_WORKER,
    extra_args: Sequence[str] = (),
    python: str = "python",
    rdzv_id: str = "hapnb",
) -> list[str]:
    """One torchrun command line per node (run command ``i`` on node ``i``).

    Multi-node commands use the c10d rendezvous at ``rdzv`` (``HOST:PORT``, normally node 0). With
    ``nnodes == 1`` and no ``rdzv`` the command is a single-node run on 127.0.0.1 and a free port.

    >>> launch_commands("b", 2, 4, "node0:29500")[1]  # doctest: +NORMALIZE_WHITESPACE
    'python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 --node-rank 1 --rdzv-backend c10d
    --rdzv-endpoint node0:29500 --rdzv-id hapnb -m hapnb.run.worker b --steps 10 --backend nccl'
    """
    _check_backend(backend)
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"need nnodes >= 1 and nproc_per_node >= 1, got {nnodes}, {nproc_per_node}")
    tail = _worker_tail(bundle, steps, backend, worker, extra_args)
    run = [python, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv is None:
        cmd = [*run, "--nnodes", "1", "--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1"]
        return [shlex.join([*cmd, "--master-port", str(free_port()), *tail])]
    if rdzv is None:
        raise ValueError(f"{nnodes} nodes need rdzv='HOST:PORT' (node 0's address and a free port)")
    _split_rdzv(rdzv)
    out = []
    for node in range(nnodes):
        cmd = [
            *run,
            "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc_per_node),
            "--node-rank", str(node),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rdzv,
            "--rdzv-id", rdzv_id,
        ]  # fmt: skip
        out.append(shlex.join([*cmd, *tail]))
    return out


def slurm_script(
    bundle: str | os.PathLike[str],
    nnodes: int,
    nproc_per_node: int,
    *,
    steps: int = 10,
    backend: str = "nccl",
    job_name: str = "hapnb",
    time_limit: str = "01:00:00",
    partition: str | None = None,
    account: str | None = None,
    gpus_per_node: int | None = None,
    cpus_per_task: int | None = None,
    port: int = 29500,
    worker: Sequence[str] = DEFAULT_WORKER,
    extra_args: Sequence[str] = (),
    python: str = "python",
) -> str:
    """An sbatch script: one task per node, each running torchrun with the c10d rendezvous on the first
    node of the allocation (``--rdzv-id`` = the Slurm job id). ``gpus_per_node`` defaults to
    ``nproc_per_node`` for NCCL and to none for gloo. Submit with ``sbatch script.sh``.
    """
    _check_backend(backend)
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"need nnodes >= 1 and nproc_per_node >= 1, got {nnodes}, {nproc_per_node}")
    if gpus_per_node is None and backend == "nccl":
        gpus_per_node = nproc_per_node
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={time_limit}",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    run = shlex.join(
        [
            python, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d",
        ]
    )  # fmt: skip
    tail = shlex.join(_worker_tail(bundle, steps, backend, worker, extra_args))
    lines += [
        "",
        "# generated by hapnb (hapnb.launch.slurm_script)",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'rdzv="${{head_node}}:{port}"',
        'echo "hapnb: ${SLURM_JOB_NUM_NODES} nodes, rendezvous at ${rdzv}"',
        "srun --kill-on-bad-exit=1 \\",
        f"  {run} \\",
        '  --rdzv-endpoint "$rdzv" --rdzv-id "$SLURM_JOB_ID" \\',
        f"  {tail}",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# CLI


def add_launch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``hapnb launch`` arguments to ``parser`` (the lead wires the subcommand)."""
    parser.add_argument("plan", metavar="PLAN_OR_BUNDLE", help="a plan JSON file or a bundle directory")
    parser.add_argument("--nproc", type=int, default=None, help="ranks on this node (default: the plan's)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument(
        "--backend", choices=_BACKENDS, default=None, help="default: nccl with CUDA, else gloo"
    )
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--rdzv", metavar="HOST:PORT", default=None, help="node 0's address and a free port")
    parser.add_argument("--print-commands", action="store_true", help="print one torchrun command per node")
    parser.add_argument("--slurm", action="store_true", help="print an sbatch script (srun + torchrun)")
    parser.add_argument("--bundle-dir", default=None, help="where to write the bundle of a plan JSON")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a rank may stay silent")
    parser.add_argument("--wall-timeout", type=float, default=None, help="limit on the whole run (s)")
    parser.add_argument("--worker", default="hapnb.run.worker", help="worker module (or a .py file)")
    parser.add_argument("--json", action="store_true", help="print raw JSON lines and a JSON summary")
    return parser


def _default_backend() -> str:
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:  # pragma: no cover
        return "gloo"


def _worker_argv(worker: str) -> tuple[str, ...]:
    return (worker,) if worker.endswith(".py") else ("-m", worker)


def _format_metric(m: Mapping[str, Any]) -> str:
    parts = [f"rank {m.get('rank', '?')}", f"step {m.get('step', '?')}"]
    for key, label in (("loss", "loss"), ("global_loss", "global")):
        if isinstance(m.get(key), (int, float)):
            parts.append(f"{label} {m[key]:.6g}")
    if isinstance(m.get("step_s"), (int, float)):
        parts.append(f"{m['step_s'] * 1e3:.2f} ms")
    if isinstance(m.get("max_memory_bytes"), (int, float)):
        parts.append(f"mem {m['max_memory_bytes'] / 2**20:.1f} MiB")
    return "  ".join(parts)


def launch_main(ns: argparse.Namespace) -> int:
    """Run ``hapnb launch`` from parsed arguments; returns the exit code."""
    backend = ns.backend or _default_backend()
    worker = _worker_argv(ns.worker)
    if ns.print_commands or ns.slurm:
        src = Path(ns.plan)
        if src.is_file():
            bundle = Path(ns.bundle_dir) if ns.bundle_dir else src.with_suffix(".bundle")
            bundle, _, devices = _prepare_bundle(src, bundle)
        else:
            bundle, _, devices = _prepare_bundle(src, None)
        per_node = ns.nproc or (devices // ns.nnodes if devices else None)
        if not per_node:
            print("hapnb launch: pass --nproc (cannot read the plan's device count)", file=sys.stderr)
            return 2
        if ns.slurm:
            print(slurm_script(bundle, ns.nnodes, per_node, steps=ns.steps, backend=backend, worker=worker))
        else:
            rdzv = ns.rdzv if (ns.rdzv or ns.nnodes == 1) else "NODE0_HOST:29500"
            for cmd in launch_commands(bundle, ns.nnodes, per_node, rdzv, steps=ns.steps, backend=backend,
                                       worker=worker):  # fmt: skip
                print(cmd)
        return 0
    try:
        job = launch(
            ns.plan,
            ns.nproc,
            backend,
            ns.steps,
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            rdzv=ns.rdzv,
            timeout_s=ns.timeout,
            wall_timeout_s=ns.wall_timeout,
            worker=worker,
            bundle_dir=ns.bundle_dir,
        )
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"hapnb launch: {e}", file=sys.stderr)
        return 2
    with job:
        for m in job.metrics():
            print(json.dumps(m) if ns.json else _format_metric(m), flush=True)
        result = job.wait()
    if ns.json:
        print(
            json.dumps(
                {
                    "ok": result.ok,
                    "returncode": result.returncode,
                    "median_step_s": result.median_step_s,
                    "final_loss": result.final_loss,
                    "steps": len(result.step_times(0)),
                    "wall_s": result.wall_s,
                    "error": result.error,
                }
            )
        )
    else:
        print(result.summary())
    if not result.ok:
        print(f"hapnb launch: {result.error}", file=sys.stderr)
        return result.returncode or 1
    return 0
