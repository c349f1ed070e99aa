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

Failure handling (:mod:`hapnb.run.supervisor` watches the ranks)
-----------------------------------------------------------------
* A rank that exits with a non-zero code stops the whole job at once; :attr:`JobResult.error` names the
  rank, its exit code, the last step it reported and the last lines of its stderr (its traceback); ranks
  that died only because they lost that peer are listed as secondary.
* Workers print a heartbeat per phase and step. When no running rank reports progress for ``timeout_s``
  seconds the job is stuck; a job still progressing past ``wall_timeout_s`` is slow. Either stops it;
  the error says which, and names the rank furthest behind and the last step each reported.
* hapnb's workers wait at most ``timeout_s`` in a collective: a rank whose peer stalled or died fails
  with an error naming it and the instruction (``rank 0 waited more than 3 s ... in the forward of
  instruction 7 (...)``), which the job's error quotes with where each rank still running was.
* Stopping sends SIGTERM to every rank's process group (and to descendants that left it), waits
  ``kill_grace_s``, then SIGKILLs what is left: no orphans. ``Ctrl-C`` during :meth:`Job.wait` or
  :meth:`Job.metrics` stops the job before re-raising, and so does leaving a ``with`` block.

>>> job = launch("plan.bundle", nproc=2, steps=5)          # doctest: +SKIP
>>> for m in job.metrics():                                 # doctest: +SKIP
...     print(m["rank"], m["step"], m["loss"])
>>> job.wait(check=True).median_step_s                      # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..pipelines import PipelinePlan, is_pipeline_json
from ..plans.plan import Plan
from .bundle import write_bundle
from .pipelined import PIPELINE_WORKER_ARGV, prepare
from .supervisor import Outcome, Supervisor, free_port, rank_envs
from .worker import WORKER_ARGV

__all__ = [
    "BACKENDS",
    "COLLECTIVE_ERROR_GRACE_S",
    "DEFAULT_WORKER",
    "Job",
    "JobResult",
    "JobState",
    "LaunchError",
    "default_backend",
    "launch",
    "launch_commands",
    "live_argv",
    "plan_bundle",
    "slurm_script",
    "step_times",
    "worker_for",
]

#: The per-rank worker: ``python -m hapnb.run.worker BUNDLE --steps N --backend B``.
DEFAULT_WORKER: tuple[str, ...] = WORKER_ARGV
#: torch.distributed backends a launch accepts (gloo on CPU, nccl on GPUs).
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
#: Seconds past ``timeout_s`` before a job of hapnb's own workers is called stuck: their collectives wait
#: at most ``timeout_s`` and then raise an error naming the rank and the instruction, which must arrive first.
COLLECTIVE_ERROR_GRACE_S = 10.0


class LaunchError(RuntimeError):
    """A launched job failed (a rank crashed, or the job was stuck or slow); ``.result`` is its
    :class:`JobResult`."""

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


@dataclass(frozen=True)
class JobResult:
    """What a finished job left: exit status, metrics lines, stderr tails and the error, if any.

    ``returncode`` is 0 when every rank exited 0; the failing rank's code after a crash (128 + signal
    number when it was killed by a signal); 124 after a timeout (stuck, or slow past the wall limit); 130
    when stopped by :meth:`Job.stop` or Ctrl-C. ``status`` says which in words (``ok``, ``failed``,
    ``stuck``, ``slow``, ``stopped``); ``secondary_ranks`` failed only because they lost a peer.
    """

    returncode: int
    metrics: tuple[dict[str, Any], ...]
    stderr_tails: tuple[str, ...]  # per rank (last lines of its stderr)
    error: str | None = None
    returncodes: tuple[int | None, ...] = ()  # per rank, as the OS reported them (negative: signal)
    failed_rank: int | None = None
    wall_s: float = 0.0
    stdout_tails: tuple[str, ...] = field(default=(), repr=False)  # per rank, non-JSON stdout lines
    status: str = ""
    secondary_ranks: tuple[int, ...] = ()

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
# Job


class Job:
    """Running rank processes (under :class:`~hapnb.run.supervisor.Supervisor`) and their metrics lines.

    Usually made by :func:`launch`; build one directly to run any command per rank::

        job = Job([[sys.executable, "worker.py"]] * 2, rank_envs(2), timeout_s=60)

    ``argvs[i]`` / ``envs[i]`` start rank ``ranks[i]`` (default ``i``). Every stdout line that parses as
    a JSON object is a heartbeat; those without a ``"phase"`` key are metrics dicts (``"rank"`` added
    when missing); other lines are kept as text. ``timeout_s``: the job is stuck (and stopped) when no
    running rank reports progress for that long; ``wall_timeout_s``: limit on the whole job.
    ``cleanup``: paths removed when the job ends (a temporary bundle).
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
        self._cleanup = [Path(p) for p in cleanup]
        self._cond = threading.Condition()
        self._metrics: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._result: JobResult | None = None
        try:
            self._sup = Supervisor(
                argvs,
                envs,
                ranks=ranks,
                stall_s=timeout_s,
                wall_s=wall_timeout_s,
                kill_grace_s=kill_grace_s,
                cwd=cwd,
                on_heartbeat=self._on_heartbeat,
                on_done=self._on_done,
                limit_names=("timeout_s (--timeout)", "wall_timeout_s (--wall-timeout)"),
                poll_s=poll_s,
            )
        except BaseException:
            self._remove_cleanup()
            raise

    # -- public ----------------------------------------------------------------------------------------

    @property
    def nproc(self) -> int:
        return self._sup.nproc

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the rank processes, in rank order."""
        return self._sup.pids

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
        self._sup.wait(timeout)  # the supervisor's on_done has set the result before it returns
        assert self._result is not None
        if check and not self._result.ok:
            raise LaunchError(
                self._result.error or f"job exited with {self._result.returncode}", self._result
            )
        return self._result

    def stop(self, timeout: float | None = 30.0) -> JobResult | None:
        """Stop every rank (SIGTERM to its process tree, SIGKILL after ``kill_grace_s``); returns the
        result. Safe to call more than once and after the job ended."""
        self._sup.stop(timeout)
        return self._result

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exit {self._result.returncode if self._result else '?'}"
        return f"<hapnb Job: {self.nproc} ranks, {len(self._metrics)} metrics lines, {state}>"

    # -- supervisor callbacks --------------------------------------------------------------------------

    def _on_heartbeat(self, rank: int, rec: dict[str, Any]) -> None:
        if "phase" in rec:
            return
        with self._cond:
            self._metrics.append(rec)
            self._cond.notify_all()

    def _on_done(self, out: Outcome) -> None:
        self._remove_cleanup()
        error = out.error
        if out.status == "stopped":
            error = "stopped by the user (Job.stop or Ctrl-C)"
        self._result = JobResult(
            returncode=out.returncode,
            metrics=tuple(self._metrics),
            stderr_tails=out.stderr_tails,
            error=error,
            returncodes=out.returncodes,
            failed_rank=out.failed_rank,
            wall_s=out.wall_s,
            stdout_tails=out.stdout_tails,
            status=out.status,
            secondary_ranks=out.secondary,
        )
        with self._cond:
            self._done.set()
            self._cond.notify_all()

    def _remove_cleanup(self) -> None:
        for p in self._cleanup:
            shutil.rmtree(p, ignore_errors=True)
        self._cleanup = []


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
    """(bundle directory, temporary dir to remove afterwards or None, devices of its plan or None).
    A pipeline plan needs no bundle (its ranks rebuild the model from its spec): its JSON file stands in."""
    pipe = _pipeline_plan(plan_or_bundle)
    if pipe is not None:
        prepare(pipe, trace=False)  # a plan that cannot run fails here, before any rank starts
        if not isinstance(plan_or_bundle, PipelinePlan):
            return Path(plan_or_bundle).expanduser(), None, len(pipe.devices)
        tmp = Path(tempfile.mkdtemp(prefix="hapnb-pipeline-")) if bundle_dir is None else None
        folder = Path(bundle_dir) if bundle_dir is not None else tmp
        assert folder is not None
        folder.mkdir(parents=True, exist_ok=True)
        return pipe.save(folder / "pipeline.json"), tmp, len(pipe.devices)
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


def _pipeline_plan(plan_or_bundle: Any) -> PipelinePlan | None:
    """The pipeline plan ``plan_or_bundle`` is or names (a JSON file with ``"kind": "pipeline"``), else None."""
    if isinstance(plan_or_bundle, PipelinePlan):
        return plan_or_bundle
    if isinstance(plan_or_bundle, (str, os.PathLike)):
        path = Path(plan_or_bundle).expanduser()
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            if is_pipeline_json(data):
                return PipelinePlan.from_json(data, source=str(path))
    return None


def worker_for(plan_or_bundle: Any, worker: Sequence[str] = DEFAULT_WORKER) -> tuple[str, ...]:
    """The rank command for ``plan_or_bundle``: ``worker``, except that a pipeline plan replaces the
    default SPMD worker by :data:`hapnb.run.pipelined.PIPELINE_WORKER_ARGV`."""
    if tuple(worker) == DEFAULT_WORKER and _pipeline_plan(plan_or_bundle) is not None:
        return PIPELINE_WORKER_ARGV
    return tuple(worker)


def plan_bundle(
    plan_or_bundle: Plan | str | os.PathLike[str], bundle_dir: str | os.PathLike[str] | None = None
) -> tuple[Path, int | None]:
    """The bundle directory of ``plan_or_bundle`` and how many ranks its plan needs (None if unreadable).

    A bundle directory is used as it is; a Plan or a plan JSON file is written as a bundle to
    ``bundle_dir`` first (needed then: this is the bundle other nodes or a Slurm job will read).
    """
    is_path = isinstance(plan_or_bundle, (str, os.PathLike))
    if bundle_dir is None and (not is_path or Path(plan_or_bundle).expanduser().is_file()):
        raise ValueError(
            f"{plan_or_bundle!r} is a plan, not a bundle directory: pass bundle_dir to write its bundle"
        )
    out, _, devices = _prepare_bundle(plan_or_bundle, bundle_dir)
    return out, devices


def _split_rdzv(rdzv: str) -> tuple[str, int]:
    host, sep, port = str(rdzv).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rdzv must be HOST:PORT (node 0's address and a free port), got {rdzv!r}")
    return host.strip("[]"), int(port)


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)} (gloo on CPU)")
    return backend


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:  # pragma: no cover
        return "gloo"


# ----------------------------------------------------------------------------------------------------
# launch


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
    rebalance: bool | Mapping[str, Any] = False,
    slowdown: Mapping[int, float] | Sequence[str] | None = None,
    telemetry: bool = False,
    dtype: str | None = None,
) -> Job:
    """Start ``nproc`` ranks of ``plan_or_bundle`` on this node and return the running :class:`Job`.

    ``plan_or_bundle``: a :class:`~hapnb.plans.plan.Plan` (written as a bundle first, to ``bundle_dir`` or a
    temporary folder removed when the job ends), a bundle directory, or a plan JSON file; or a pipeline
    plan (:class:`~hapnb.pipelines.PipelinePlan` or its JSON file), whose ranks run
    :mod:`hapnb.run.pipelined` (one per plan device; the worker's metrics lines also carry ``stage``). ``nproc``
    defaults to the plan's devices (divided by ``nnodes``). Each rank runs ``python *worker BUNDLE
    --steps N --backend B *extra_args`` with torchrun's environment variables (see the module
    docstring). ``env`` adds/overrides environment variables of every rank. Multi-node: run the same
    call on each node with ``nnodes``, its ``node_rank`` and ``rdzv="HOST:PORT"`` of node 0.
    ``timeout_s``: when no running rank reports progress (a heartbeat) for that long the job is stuck and
    is stopped; ``wall_timeout_s``: limit on the whole run (a job still progressing then is slow). hapnb's
    own workers also get ``--timeout timeout_s``: a collective that waits that long for a peer fails with
    an error naming the rank, the instruction, forward or backward, and the job's error quotes it (so the
    job is called stuck only :data:`COLLECTIVE_ERROR_GRACE_S` later). ``extra_args`` end the worker's
    command line: a worker script's own arguments (``hapnb launch ... -- ARGS``).

    Live re-balancing (issue 21): ``rebalance=True`` (or a mapping of
    :class:`hapnb.run.rebalance.RebalanceOptions` fields) lets the ranks measure themselves and reshard to
    new ratios when a straggler's slowdown pays for it; ``telemetry=True`` only measures; ``slowdown``
    ``{rank: factor}`` (or ``["RANK=FACTOR", ...]``) makes a rank's compute ``factor`` times slower, to try
    it on local ranks. :func:`hapnb.run.rebalance.summarize` reads the result's metrics (losses, step times,
    re-balances). ``dtype``: the ranks' floating dtype (e.g. ``"float64"``).
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
    worker = worker_for(plan_or_bundle, worker)
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
        live = live_argv(rebalance, slowdown, telemetry, dtype, world)
        stall = timeout_s
        if worker in (DEFAULT_WORKER, PIPELINE_WORKER_ARGV) and timeout_s is not None:
            live += ["--timeout", f"{timeout_s:g}"]  # the collective timeout of hapnb's own workers
            stall = timeout_s + COLLECTIVE_ERROR_GRACE_S
        if worker == PIPELINE_WORKER_ARGV and (rebalance or slowdown or telemetry):
            raise ValueError(
                "live re-balancing, --slowdown and telemetry run SPMD plans; this is a pipeline plan "
                "(its stages are re-planned with hapnb pipeline): launch it without them"
            )
        argv = [python, *worker, str(bundle), "--steps", str(steps), "--backend", backend, *live, *extra_args]
        envs = rank_envs(nproc, addr, port, nnodes=nnodes, node_rank=node_rank, env=env)
        ranks = [node_rank * nproc + local for local in range(nproc)]
        return Job(
            [argv] * nproc,
            envs,
            ranks=ranks,
            timeout_s=stall,
            wall_timeout_s=wall_timeout_s,
            kill_grace_s=kill_grace_s,
            cleanup=[tmp] if tmp is not None else (),
        )
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def live_argv(
    rebalance: bool | Mapping[str, Any],
    slowdown: Mapping[int, float] | Sequence[str] | None,
    telemetry: bool,
    dtype: str | None,
    world: int,
) -> list[str]:
    """The worker arguments of :func:`launch`'s re-balancing, slowdown, telemetry and dtype options (a
    clear error for a bad option or a slowed rank outside the ``world`` ranks).

    >>> live_argv(True, {2: 3.0}, False, "float64", 3)
    ['--dtype', 'float64', '--rebalance', '{}', '--slowdown', '2=3.0']
    """
    from .rebalance import RebalanceOptions, parse_slowdown

    out: list[str] = [] if dtype is None else ["--dtype", str(dtype)]
    if rebalance is not False and rebalance is not None:
        opts = {} if rebalance is True else dict(rebalance)
        RebalanceOptions.from_json(opts)  # a bad option fails here, before any rank starts
        out += ["--rebalance", json.dumps(opts)]
    slow = parse_slowdown(slowdown)
    for rank, factor in sorted(slow.items()):
        if rank >= world:
            raise ValueError(f"slowdown names rank {rank}, but the job has ranks 0..{world - 1}")
        out += ["--slowdown", f"{rank}={factor!r}"]
    return out + (["--telemetry"] if telemetry else [])


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
        "# generated by hapnb (hapnb.run.launch.slurm_script)",
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
