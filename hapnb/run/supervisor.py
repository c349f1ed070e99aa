"""The one process supervisor of the run layer: verify, launch and profile start their ranks here.

A :class:`Supervisor` starts one process per rank (its argv and environment; :func:`rank_envs` gives
torchrun's variables), reads each rank's stdout and stderr line by line on its own threads and hands
them to callbacks, and watches the ranks until they all exit:

* **Progress.** Every stdout line that is a JSON object is a *heartbeat* (workers print one per step and
  per phase). The supervisor keeps the time of each rank's last heartbeat; the job is **stuck** when no
  running rank has sent one for ``stall_s`` seconds (ranks blocked in a collective behind a slow peer
  are not stuck while that peer reports progress). A job that is still progressing when it passes
  ``wall_s`` is **slow**. Either way it is stopped and the error says which, and where each rank was.
* **Crashes.** The first rank that exits non-zero stops the job. Ranks whose output says they only lost
  a peer (:data:`PEER_LOSS_MARKERS`) are *secondary*; the error names the root rank, its exit code or
  signal, its last step and the tail of its stderr. A rank whose collective timed out or lost a peer
  ends its traceback with a :data:`COLLECTIVE_ERROR_MARKER` line naming the rank and the instruction: the
  error quotes it first and says where each rank still running was (the one that stalled, usually).
* **Cleanup.** Stopping sends SIGTERM to every rank's process group and to its descendants, waits
  ``kill_grace_s``, then SIGKILLs what is left. It happens on failure, stall, wall limit,
  :meth:`Supervisor.stop`, Ctrl-C in :meth:`Supervisor.wait`, leaving a ``with`` block and interpreter
  exit. Every wait has a timeout: nothing here hangs.

>>> parse_json_line('{"rank": 0, "step": 3}')
{'rank': 0, 'step': 3}
>>> is_peer_loss("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
True
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "COLLECTIVE_ERROR_MARKER",
    "PEER_LOSS_MARKERS",
    "Outcome",
    "Supervisor",
    "free_port",
    "is_peer_loss",
    "parse_json_line",
    "rank_envs",
    "run_local",
]

#: Output of a rank that failed only because a peer died first (it is not the root cause).
PEER_LOSS_MARKERS: tuple[str, ...] = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "recvBytes",
    "DistNetworkError",
    "DistBackendError",
    "ProcessGroupNCCL",
    "ProcessGroupGloo",
    "SIGTERM",
)
#: How a rank's traceback ends when one of its collectives timed out or lost a peer
#: (:class:`hapnb.runtime.collective_errors.CollectiveError`): the line names the rank and the instruction.
COLLECTIVE_ERROR_MARKER = "CollectiveError: "
_TAIL_LINES = 40  # lines of stdout/stderr kept per rank
_MESSAGE_LINES = 20  # lines of the root rank's stderr quoted in an error


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_peer_loss(text: str) -> bool:
    """Whether a rank's output says it failed only because a peer went away."""
    return any(m in text for m in PEER_LOSS_MARKERS)


def parse_json_line(line: str) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when the line is not one."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def rank_envs(
    nproc: int,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    env: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """The environment of each local rank, as torchrun would set it (``master_port`` defaults to a free
    port), plus ``PYTHONUNBUFFERED=1`` so lines stream, ``OMP_NUM_THREADS`` = cores / ranks unless set,
    and hapnb's folder first on ``PYTHONPATH`` so ``-m hapnb...`` workers import the caller's hapnb.
    ``env`` adds or overrides variables of every rank."""
    world = nnodes * nproc
    port = free_port() if master_port is None else master_port
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    base["PYTHONPATH"] = os.pathsep.join([root, *paths])
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
            MASTER_PORT=str(port),
        )
        envs.append(e)
    return envs


@dataclass(frozen=True)
class Outcome:
    """How a supervised run ended.

    ``status``: ``"ok"`` (every rank exited 0), ``"failed"`` (a rank exited non-zero), ``"stuck"`` (no
    progress for ``stall_s``), ``"slow"`` (past ``wall_s`` while progressing), ``"stopped"``
    (:meth:`Supervisor.stop` or Ctrl-C) or ``"error"`` (a callback or the supervisor itself failed).
    ``returncode`` is shell-style: 0; the root rank's code (128 + signal when killed by one); 124 when
    stuck or slow; 130 when stopped. ``failed_rank`` is the root rank (or the stuck one), ``secondary``
    the ranks that failed only because a peer died. Per rank, in start order: ``returncodes`` (as the OS
    gave them, negative for a signal), ``last_steps`` (last completed step reported, or None),
    ``stderr_tails`` and ``stdout_tails`` (last lines).
    """

    status: str
    returncode: int
    error: str | None
    ranks: tuple[int, ...]
    returncodes: tuple[int | None, ...]
    failed_rank: int | None = None
    secondary: tuple[int, ...] = ()
    last_steps: tuple[Any, ...] = ()
    stderr_tails: tuple[str, ...] = ()
    stdout_tails: tuple[str, ...] = field(default=(), repr=False)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Rank:
    """Bookkeeping of one rank process (owned by a :class:`Supervisor`)."""

    def __init__(self, rank: int, proc: subprocess.Popen, now: float, log: TextIO | None) -> None:
        self.rank = rank
        self.proc = proc
        self.last_output = now
        self.last_heartbeat = now
        self.heartbeats = 0
        self.last_step: Any = None
        self.last_phase: Any = None  # the phase of its last heartbeat (a reshard is named in errors)
        self.phase_step: Any = None  # the step of its last phase heartbeat
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.stderr: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.stdout: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.readers: list[threading.Thread] = []
        self.log = log

    def tail(self, lines: int = _MESSAGE_LINES) -> str:
        return "\n".join(list(self.stderr)[-lines:])

    def secondary(self) -> bool:
        return is_peer_loss("\n".join(self.stderr) + "\n" + "\n".join(self.stdout))

    def collective_error(self) -> str | None:
        """The message of the :data:`COLLECTIVE_ERROR_MARKER` line of its stderr (the last one), or None."""
        for line in reversed(self.stderr):
            k = line.find(COLLECTIVE_ERROR_MARKER)
            if k >= 0:
                return line[k + len(COLLECTIVE_ERROR_MARKER) :].strip()
        return None

    def where(self, now: float) -> str:
        """Where its last heartbeat left it, e.g. ``last heartbeat: forward of step 3, 4.2 s ago``."""
        if self.heartbeats == 0:
            return "no heartbeat yet"
        if self.last_phase:
            what = str(self.last_phase) + ("" if self.phase_step is None else f" of step {self.phase_step}")
        else:
            what = f"reported step {self.last_step}"
        return f"last heartbeat: {what}, {now - self.last_heartbeat:.1f} s ago"


_LIVE: weakref.WeakSet[Supervisor] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - interpreter shutdown
    for sup in list(_LIVE):
        with contextlib.suppress(Exception):
            sup.stop(timeout=10)


class Supervisor:
    """Rank processes under watch (see the module docstring).

    ``argvs[i]`` / ``envs[i]`` start rank ``ranks[i]`` (default ``i``). Callbacks run on reader threads:
    ``on_line(rank, stream, line)`` for every line (``stream`` is ``"stdout"`` or ``"stderr"``),
    ``on_heartbeat(rank, record)`` for every JSON object on stdout (``"rank"`` filled in when missing),
    ``on_done(outcome)`` once, after every process is gone. A callback that raises stops the run
    (status ``"error"``). ``log_dir``: also write rank *r*'s lines to ``log_dir/rank<r>.log``.
    ``limit_names``: how the stall and wall limits are called in error messages (the caller's flags).
    """

    def __init__(
        self,
        argvs: Sequence[Sequence[str]],
        envs: Sequence[Mapping[str, str]],
        *,
        ranks: Sequence[int] | None = None,
        stall_s: float | None = 300.0,
        wall_s: float | None = None,
        kill_grace_s: float = 3.0,
        crash_grace_s: float = 1.5,
        cwd: str | os.PathLike[str] | None = None,
        on_line: Callable[[int, str, str], None] | None = None,
        on_heartbeat: Callable[[int, dict[str, Any]], None] | None = None,
        on_done: Callable[[Outcome], None] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        limit_names: tuple[str, str] = ("stall_s", "wall_s"),
        poll_s: float = 0.05,
    ) -> None:
        if not argvs:
            raise ValueError("a Supervisor needs at least one rank command")
        if len(envs) != len(argvs):
            raise ValueError(f"{len(argvs)} rank commands but {len(envs)} environments")
        for what, v in (("stall_s", stall_s), ("wall_s", wall_s)):
            if v is not None and not v > 0:
                raise ValueError(f"{what} must be positive or None, got {v!r}")
        rank_ids = list(ranks) if ranks is not None else list(range(len(argvs)))
        if len(rank_ids) != len(argvs):
            raise ValueError(f"{len(argvs)} rank commands but {len(rank_ids)} rank ids")
        self.stall_s, self.wall_s = stall_s, wall_s
        self.kill_grace_s, self.crash_grace_s = kill_grace_s, crash_grace_s
        self.limit_names = limit_names
        self._on_line, self._on_heartbeat, self._on_done = on_line, on_heartbeat, on_done
        self._poll_s = poll_s
        self._ranks: list[_Rank] = []
        self._done = threading.Event()
        self._stop_requested = False
        self._callback_error: BaseException | None = None
        self._kill_lock = threading.Lock()
        self._outcome: Outcome | None = None
        self.started = time.monotonic()
        logs = Path(log_dir) if log_dir is not None else None
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
        _LIVE.add(self)
        try:
            for r, argv, env in zip(rank_ids, argvs, envs):
                log = open(logs / f"rank{r}.log", "a", encoding="utf-8") if logs else None  # noqa: SIM115
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
                    start_new_session=True,  # its own process group: a kill reaches the rank's whole tree
                )
                self._ranks.append(_Rank(r, proc, time.monotonic(), log))
        except BaseException:
            self._kill_all()
            self._close_logs()
            _LIVE.discard(self)
            raise
        for st in self._ranks:
            for stream, name in ((st.proc.stdout, "stdout"), (st.proc.stderr, "stderr")):
                t = threading.Thread(target=self._read, args=(st, stream, name), daemon=True)
                t.name = f"hapnb-rank{st.rank}-{name}"
                st.readers.append(t)
                t.start()
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="hapnb-supervisor")
        self._monitor.start()

    # -- public ----------------------------------------------------------------------------------------

    @property
    def nproc(self) -> int:
        return len(self._ranks)

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the rank processes, in start order."""
        return tuple(st.proc.pid for st in self._ranks)

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def outcome(self) -> Outcome | None:
        """The :class:`Outcome` once every rank is gone, else None."""
        return self._outcome

    def wait(self, timeout: float | None = None) -> Outcome:
        """Block until the run ends and return its :class:`Outcome`.

        ``timeout``: raise :class:`TimeoutError` if it is still running then (it keeps running; its own
        ``stall_s``/``wall_s`` are what stop it). Ctrl-C stops the run and re-raises.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"still running after wait({timeout}); call stop() to end it")
        except KeyboardInterrupt:
            self.stop()
            raise
        assert self._outcome is not None
        return self._outcome

    def stop(self, timeout: float | None = 30.0) -> Outcome | None:
        """Stop every rank (SIGTERM to its process tree, SIGKILL after ``kill_grace_s``) and return the
        outcome. Safe to call more than once and after the run ended."""
        if not self._done.is_set():
            self._stop_requested = True
            self._kill_all()
            self._done.wait(timeout)
        return self._outcome

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else (self._outcome.status if self._outcome else "?")
        return f"<hapnb Supervisor: {self.nproc} ranks, {state}>"

    # -- reading ---------------------------------------------------------------------------------------

    def _read(self, st: _Rank, stream: Any, name: str) -> None:
        try:
            for raw in stream:
                line = raw.rstrip("\r\n")
                now = time.monotonic()
                st.last_output = now
                if st.log is not None:
                    with contextlib.suppress(OSError, ValueError):
                        st.log.write(f"{line}\n")
                        st.log.flush()
                rec = parse_json_line(line) if name == "stdout" else None
                if rec is None:
                    (st.stdout if name == "stdout" else st.stderr).append(line)
                else:
                    rec.setdefault("rank", st.rank)
                    st.last_heartbeat = now
                    st.heartbeats += 1
                    if "step" in rec and "phase" not in rec:
                        st.last_step = rec["step"]
                    if "phase" in rec or "step" in rec:
                        st.last_phase = rec.get("phase")
                        st.phase_step = rec.get("step") if "phase" in rec else None
                self._call(self._on_line, st.rank, name, line)
                if rec is not None:
                    self._call(self._on_heartbeat, st.rank, rec)
        except (OSError, ValueError):  # the stream closed under us during a kill
            pass

    def _call(self, fn: Callable[..., None] | None, *args: Any) -> None:
        if fn is None or self._callback_error is not None:
            return
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported as the run's error, never lost
            self._callback_error = e

    # -- watching --------------------------------------------------------------------------------------

    def _watch(self) -> None:
        status, code, error, failed, secondary = "ok", 0, None, None, ()
        try:
            while True:
                time.sleep(self._poll_s)
                now = time.monotonic()
                if self._stop_requested:
                    status, code, error = "stopped", 130, "stopped by the user (stop() or Ctrl-C)"
                    break
                if self._callback_error is not None:
                    e = self._callback_error
                    status, code, error = "error", 1, f"a callback failed: {type(e).__name__}: {e}"
                    break
                self._poll(now)
                if any(st.returncode not in (None, 0) for st in self._ranks):
                    if self._stop_requested:  # our own SIGTERM, not a crash
                        continue
                    status, code, error, failed, secondary = self._crash()
                    break
                if all(st.returncode is not None for st in self._ranks):
                    break
                if self.wall_s is not None and now - self.started > self.wall_s:
                    status, failed, error = self._limit_message(now, wall=True)
                    code = 124
                    break
                alive = [st for st in self._ranks if st.returncode is None]
                if self.stall_s is not None and all(now - st.last_heartbeat > self.stall_s for st in alive):
                    status, failed, error = self._limit_message(now, wall=False)
                    code = 124
                    break
        except Exception as exc:  # noqa: BLE001 - never leave processes behind because of a bug here
            status, code, error = "error", 1, f"internal error in the process supervisor: {exc!r}"
        finally:
            self._kill_all()
            for st in self._ranks:
                for t in st.readers:
                    t.join(2.0)
            self._close_logs()
            self._outcome = Outcome(
                status=status,
                returncode=code,
                error=error,
                ranks=tuple(st.rank for st in self._ranks),
                returncodes=tuple(st.proc.returncode for st in self._ranks),
                failed_rank=failed,
                secondary=tuple(secondary),
                last_steps=tuple(st.last_step for st in self._ranks),
                stderr_tails=tuple("\n".join(st.stderr) for st in self._ranks),
                stdout_tails=tuple("\n".join(st.stdout) for st in self._ranks),
                wall_s=time.monotonic() - self.started,
            )
            _LIVE.discard(self)
            if self._on_done is not None:
                with contextlib.suppress(Exception):
                    self._on_done(self._outcome)
            self._done.set()

    def _poll(self, now: float) -> None:
        for st in self._ranks:
            if st.returncode is None:
                rc = st.proc.poll()
                if rc is not None:
                    st.returncode, st.exited_at = rc, now

    def _crash(self) -> tuple[str, int, str, int, tuple[int, ...]]:
        """Blame a rank: wait briefly for the peers a crash takes down, then pick the first failed rank
        whose output is not a lost peer (else the first to fail)."""
        deadline = time.monotonic() + self.crash_grace_s
        while time.monotonic() < deadline and any(st.returncode is None for st in self._ranks):
            time.sleep(self._poll_s)
            self._poll(time.monotonic())
        failed = [st for st in self._ranks if st.returncode not in (None, 0)]
        running = [st for st in self._ranks if st.returncode is None]
        for st in failed:  # let the readers drain the traceback
            for t in st.readers:
                t.join(0.5)
        failed.sort(key=lambda s: (s.secondary(), s.exited_at or 0.0, s.rank))
        root = failed[0]
        secondary = tuple(s.rank for s in failed[1:] if s.secondary())
        others = [s for s in failed[1:] if s.rank not in secondary]
        rc = root.returncode or 0
        how = f"exited with code {rc}"
        if rc < 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by {signal.Signals(-rc).name}"
            if -rc == signal.SIGKILL:
                how += " (often the out-of-memory killer)"
        during = " while resharding to new ratios (live re-balancing)" if root.last_phase == "reshard" else ""
        named = root.collective_error()  # a collective that timed out or lost a peer names its instruction
        msg = f"rank {root.rank} {how} {_after(root.last_step)}{during}" + (f": {named}" if named else "")
        if named and running:
            now = time.monotonic()
            msg += ". Ranks still running then: " + "; ".join(
                f"rank {s.rank} ({s.where(now)})" for s in running
            )
        msg += f"; the job was stopped. Last lines of its stderr:\n{_indent(root.tail() or '(no stderr output)')}"
        if secondary:
            msg += f"\n(ranks {_list(secondary)} failed after it because they lost a peer: secondary)"
        if others:
            msg += "\n(also failed: " + ", ".join(f"rank {o.rank} code {o.returncode}" for o in others) + ")"
        code = 128 - rc if rc < 0 else rc or 1
        return "failed", code, msg, root.rank, secondary

    def _limit_message(self, now: float, wall: bool) -> tuple[str, int | None, str]:
        alive = [st for st in self._ranks if st.returncode is None]
        quiet = {st.rank: now - st.last_heartbeat for st in alive}
        steps = ", ".join(f"rank {st.rank}: {_step_text(st.last_step)}" for st in self._ranks)
        stall_name, wall_name = self.limit_names
        # the rank furthest behind: least progress reported, then silent longest
        behind = min(alive, key=lambda s: (s.heartbeats > 0, _order(s.last_step), s.last_heartbeat, s.rank))
        progressing = self.stall_s is None or min(quiet.values()) <= self.stall_s
        failed: int | None = behind.rank
        if wall:
            head = f"the job ran past its wall-clock limit of {self.wall_s:g} s ({wall_name})"
            if progressing:
                status, failed = "slow", None
                head += " while still progressing: it is slow, not stuck"
                hint = f"Give it more time: raise {wall_name}."
            else:
                status = "stuck"
                head += f"; no rank has made progress for {min(quiet.values()):.1f} s: it looks stuck"
                hint = "See where each rank stopped."
        else:
            status = "stuck"
            what = "printed nothing" if now - behind.last_output > self.stall_s else "reported no progress"
            head = (
                f"rank {behind.rank} {what} for {self.stall_s:g} s ({stall_name}) and no running rank made "
                "progress meanwhile: the job looks stuck (a collective not every rank reached, a deadlock?)"
            )
            hint = f"If the ranks are only slow (a step takes longer than {self.stall_s:g} s), raise {stall_name}."
        quiet_text = ", ".join(f"rank {r} {q:.1f} s" for r, q in sorted(quiet.items()))
        msg = f"{head}. The job was stopped. Last step per rank: {steps}. Time since last progress: {quiet_text}."
        tails = [f"rank {st.rank}:\n{_indent(st.tail(5))}" for st in alive if st.stderr]
        if tails:
            msg += " Last stderr lines:\n" + "\n".join(tails)
        return status, failed, f"{msg}\n{hint}"

    # -- stopping --------------------------------------------------------------------------------------

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

    def _close_logs(self) -> None:
        for st in self._ranks:
            if st.log is not None:
                with contextlib.suppress(OSError):
                    st.log.close()


def run_local(
    nproc: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    **kwargs: Any,
) -> Outcome:
    """Run ``python *argv`` as ranks 0..nproc-1 on this machine (torchrun's environment on a free port)
    under a :class:`Supervisor` (``kwargs``: its options) and return the :class:`Outcome`."""
    import sys

    cmd = [python or sys.executable, *argv]
    with Supervisor([cmd] * nproc, rank_envs(nproc, env=env), **kwargs) as sup:
        return sup.wait()


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (psutil when installed, else /proc; empty elsewhere)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    if not os.path.isdir("/proc"):
        return []
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()  # "pid (comm) state ppid ...": comm may hold spaces
            if len(fields) > 1:
                kids[int(fields[1])].append(int(entry))
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


def _after(step: Any) -> str:
    return "before reporting any step" if step is None else f"after step {step}"


def _step_text(step: Any) -> str:
    return "no step yet" if step is None else f"step {step}"


def _order(step: Any) -> tuple[int, Any]:
    return (0, 0) if not isinstance(step, (int, float)) else (1, step)


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
