"""One training rank of a plan, run from a bundle (no user source code needed).

Command line (under ``torchrun``, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)::

    torchrun --nproc-per-node 4 -m hapnb.run.worker BUNDLE [--steps N] [--backend gloo|nccl] [--lr LR]
        [--optimizer adam|sgd] [--inputs local|full] [--metrics FILE | --metrics-fd FD] [--no-dropout]
        [--grad-sync buckets|sync] [--bucket-cap-bytes N] [--first-bucket-cap-bytes N] [--no-interleave]

Every rank prints one JSON line per step (to stdout, or appended to ``--metrics FILE`` — ``{rank}`` in the
name is replaced by the rank — or written to the inherited file descriptor ``--metrics-fd``)::

    {"rank": 0, "step": 0, "loss": 1.15, "global_loss": 2.30, "step_s": 0.012, "max_memory_bytes": 123456}

``loss`` is the rank's partial loss (R form), ``global_loss`` (rank 0 only, ``null`` elsewhere) the
sum over ranks, i.e. the single-device loss; ``max_memory_bytes`` the peak CUDA memory (a GPU rank) or the
process's peak resident memory (CPU). Every step trains on the bundle's example batch.

With ``--rebalance`` / ``--telemetry`` / ``--slowdown RANK=FACTOR`` (issue 21) each step's line also has
``compute_s``, ``comm_s`` (seconds blocked in collectives) and ``optimizer_s``, and rank 0 adds
``{"event": "telemetry", ...}`` lines (every rank's window, one small all-gather every few steps) and
``{"event": "rebalance", "rebalance": {...}}`` lines (each decision; :mod:`hapnb.run.reshard`).

Progress: the command line also prints a *phase* heartbeat on stdout whenever the rank starts a phase
(``load``, ``connect``, ``compile``, then ``forward`` and ``backward`` of every step, ``save``)::

    {"rank": 0, "phase": "backward", "step": 2, "t": 4.51}

so :mod:`hapnb.run.supervisor` can tell a slow rank (heartbeats keep coming) from a stuck one. Lines with
a ``"phase"`` key are heartbeats, not metrics. A collective that waits longer than ``--timeout`` seconds
for its peers (one stalled or died) raises
:class:`~hapnb.runtime.collective_errors.CollectiveError`, naming the rank and the instruction; the
traceback's last line is what the supervisor quotes.

Python entry (for :mod:`hapnb.run.launch` and tests)::

    from hapnb.run.worker import run_worker
    metrics = run_worker("bundle/", rank, world_size, "gloo", steps=10, metrics_out="m{rank}.jsonl")

``run_worker`` initialises the default process group from the environment (``env://``) unless one is
already initialised (then ``rank``/``world_size`` must agree with it), and destroys it again only if it
created it. ``metrics_out``: None (stdout), a path, an int file descriptor, a writable text file or a
callable taking each metrics dict; ``heartbeat``: None or a callable taking each phase dict. Returns the
list of metrics dicts of this rank.

Replicated gradients are all-reduced by default in DDP-like buckets that gradient hooks start
asynchronously during the backward, on a process group of their own, and are waited for before the
gradients are read or the optimizer steps (``--grad-sync buckets``, :mod:`hapnb.run.buckets`);
``--grad-sync sync`` all-reduces each inside autograd instead. A duplex plan (``"duplex": true``) runs
each step as two half-batch micro-batches, one's collectives in flight while the other computes
(:mod:`hapnb.run.duplex`; ``--no-interleave``: one after the other); its ``loss`` is the scaled sum of
both, so the metrics read as for a plain plan.

Verification mode (``verify_out=DIR`` / ``--verify-out DIR``, used by :func:`hapnb.run.verify.verify`) also
saves ``DIR/rank<r>.pt``: partial and global losses per step, every local gradient after the first
backward and every local weight after the last step (plain tensors, readable with ``weights_only=True``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "WORKER_ARGV", "DEVICES", "device_kind", "rank_device", "runtime_argv", "duplex_program", "run_worker", "make_optimizer", "main", "rank_main",
    "rank_options", "init_group",
]  # fmt: skip

#: How to start this worker: ``python *WORKER_ARGV BUNDLE ...``.
WORKER_ARGV: tuple[str, ...] = ("-m", "hapnb.run.worker")


def runtime_argv(
    grad_sync: str = "buckets",
    bucket_cap: int | None = None,
    first_bucket_cap: int | None = None,
    interleave: bool = True,
    device: str = "auto",
) -> list[str]:
    """The worker arguments for how ranks sync gradients, run duplex plans and where their tensors live
    (only non-defaults).

    >>> runtime_argv("sync", 4096, interleave=False, device="cuda")
    ['--grad-sync', 'sync', '--bucket-cap-bytes', '4096', '--no-interleave', '--device', 'cuda']
    """
    out = [] if grad_sync == "buckets" else ["--grad-sync", grad_sync]
    if bucket_cap is not None:
        out += ["--bucket-cap-bytes", str(int(bucket_cap))]
    if first_bucket_cap is not None:
        out += ["--first-bucket-cap-bytes", str(int(first_bucket_cap))]
    out += [] if interleave else ["--no-interleave"]
    return out + ([] if device == "auto" else ["--device", device])


#: where a rank's tensors live: ``auto`` is the backend's own (nccl: the rank's GPU, gloo: the CPU);
#: ``cuda`` with gloo runs several ranks on the GPUs of one machine (rank r on GPU r mod count)
DEVICES = ("auto", "cpu", "cuda")


def device_kind(backend: str, device: str, where: str) -> str:
    """``"cpu"`` or ``"cuda"``: where ranks of ``backend`` asked for ``device`` (see :data:`DEVICES`) keep
    their tensors; a clear error, naming ``where``, for a combination that cannot run (nccl on the CPU,
    CUDA where torch sees no GPU)."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if backend == "nccl" else "cpu"
    if device == "cpu" and backend == "nccl":
        raise ValueError("backend nccl runs on CUDA tensors only; use --backend gloo for CPU ranks")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where}: device cuda, but torch sees no CUDA device; use --device cpu")
    return device


def rank_device(backend: str, device: str, rank: int) -> Any:
    """The torch device of ``rank`` (:func:`device_kind`; rank r on GPU r mod count), made current when
    it is a GPU."""
    import torch

    if device_kind(backend, device, f"rank {rank}") == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    return dev


def make_optimizer(name: str, params: Sequence[Any], lr: float | None = None) -> Any:
    """``adam`` (default lr 1e-3) or ``sgd`` (default lr 0.05) over ``params``."""
    import torch

    name = name.lower()
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3 if lr is None else lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05 if lr is None else lr)
    raise ValueError(f"unknown optimizer {name!r}: use 'adam' or 'sgd'")


class _Sink:
    """Where metrics lines go (see the module docstring)."""

    def __init__(self, out: Any, rank: int) -> None:
        self.close_me: TextIO | None = None
        self.fn: Callable[[dict], None]
        if out is None:
            self.fn = lambda d: _write_line(sys.stdout, d)
        elif callable(out) and not hasattr(out, "write"):
            self.fn = out
        elif isinstance(out, int):
            f = os.fdopen(os.dup(out), "a", buffering=1)
            self.close_me = f
            self.fn = lambda d: _write_line(f, d)
        elif isinstance(out, (str, os.PathLike)):
            p = Path(str(out).replace("{rank}", str(rank)))
            p.parent.mkdir(parents=True, exist_ok=True)
            f = open(p, "a", buffering=1)  # noqa: SIM115 - closed in close()
            self.close_me = f
            self.fn = lambda d: _write_line(f, d)
        elif hasattr(out, "write"):
            self.fn = lambda d: _write_line(out, d)
        else:
            raise TypeError(
                f"metrics_out must be None, a path, a file descriptor, a file or a callable, not {out!r}"
            )

    def __call__(self, d: dict) -> None:
        self.fn(d)

    def close(self) -> None:
        if self.close_me is not None:
            self.close_me.close()


def _write_line(f: Any, d: dict) -> None:
    f.write(json.dumps(d) + "\n")
    f.flush()


def _peak_memory(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # pragma: no cover - non-Unix
        return 0


def run_worker(
    bundle_dir: str | os.PathLike[str],
    rank: int | None = None,
    world_size: int | None = None,
    backend: str = "gloo",
    steps: int = 10,
    metrics_out: Any = None,
    *,
    lr: float | None = None,
    optimizer: str = "adam",
    inputs: str = "local",
    dropout: bool = True,
    dtype: str | None = None,
    verify_out: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
    heartbeat: Callable[[dict[str, Any]], None] | None = None,
    grad_sync: str = "buckets",
    bucket_cap: int | None = None,
    first_bucket_cap: int | None = None,
    interleave: bool = True,
    device: str = "auto",
    rebalance: Mapping[str, Any] | None = None,
    telemetry: bool = False,
    slowdown: float = 1.0,
    fault_rank: int | None = None,
    seed: int | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` training steps of the bundle's plan as ``rank`` of ``world_size`` (see module doc).

    ``grad_sync``: ``"buckets"`` (default) all-reduces replicated gradients in DDP-like buckets started
    asynchronously by gradient hooks during the backward (:mod:`hapnb.run.buckets`; caps in bytes,
    default 25 MiB and 1 MiB for the first) and waits before the gradients are read or the optimizer
    steps; ``"sync"`` all-reduces each inside autograd. A duplex plan runs as two micro-batches
    (:mod:`hapnb.run.duplex`; ``interleave=False`` runs them one after the other). ``device``: see
    :data:`DEVICES`.

    Live re-balancing (issue 21, :mod:`hapnb.run.reshard`): ``rebalance`` (a mapping of
    :class:`hapnb.run.rebalance.RebalanceOptions` fields, ``{}`` for the defaults) measures the ranks and
    reshards to new ratios when a straggler's slowdown pays for it; ``telemetry=True`` only measures.
    Either adds ``compute_s``, ``comm_s`` and ``optimizer_s`` (the optimizer step, part of the compute)
    to each step's metrics line, and rank 0 writes an ``"event": "telemetry"`` line per window and an
    ``"event": "rebalance"`` line per decision. ``slowdown``: this rank's compute takes that many times as
    long (it sleeps in proportion before each collective: a straggler on local ranks). ``fault_rank``:
    that rank exits during a reshard (tests the failure handling). ``seed``: the seed of the program's
    random ops (:mod:`hapnb.runtime.random_stream`; default rank 0's ``torch.initial_seed()``)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    t_start = time.perf_counter()

    def phase(name: str, step: int | None = None) -> None:
        if heartbeat is not None:
            rec: dict[str, Any] = {"rank": rank, "phase": name}
            if step is not None:
                rec["step"] = step
            rec["t"] = round(time.perf_counter() - t_start, 3)
            heartbeat(rec)

    phase("load")
    import torch
    import torch.distributed as dist

    from ..runtime.expand import physical_plan
    from .bundle import load_bundle
    from .training import rank0_seed

    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    bundle = load_bundle(bundle_dir)
    plan = physical_plan(bundle.plan, bundle.graph)  # virtual devices: one rank per physical GPU
    if world_size != plan.cluster.n:
        raise ValueError(
            f"the plan in {bundle_dir} is for {plan.cluster.n} GPUs ({', '.join(plan.devices)}) "
            f"but the job has {world_size} ranks; start it with --nproc-per-node {plan.cluster.n}"
        )
    phase("connect")
    created = init_group(backend, rank, world_size, timeout_s)
    sink = _Sink(metrics_out, rank)
    try:
        device = rank_device(backend, device, rank)
        tdtype = getattr(torch, dtype) if dtype else None
        if tdtype is not None:
            torch.set_default_dtype(tdtype)
        phase("compile")
        t_compile = time.perf_counter()
        full = tuple(
            x.to(tdtype) if tdtype is not None and x.is_floating_point() else x for x in bundle.inputs
        )
        gen = dict(inputs=inputs, dropout=dropout, dtype=tdtype, grad_sync=grad_sync, seed=rank0_seed(seed))

        def make(p: Any) -> Any:
            return _make_trainer(
                p,
                bundle,
                rank,
                device,
                full,
                gen,
                (optimizer, lr),
                (bucket_cap, first_bucket_cap),
                interleave,
            )

        trainer = make(plan)
        live = None
        if rebalance is not None or telemetry or slowdown != 1.0:
            live = _live_rebalancer(
                rebalance, plan, bundle, rank, device, make, sink, phase, fault_rank, slowdown
            )
            live.compile_s = time.perf_counter() - t_compile
        with live if live is not None else contextlib.nullcontext():
            out, losses, global_losses, grads, trainer = _train(
                trainer, steps, rank, device, sink, phase, verify_out is not None, live, slowdown
            )
        prog, module = trainer.prog, trainer.module
        if verify_out is not None:
            phase("save")
            _save_verify_record(verify_out, rank, prog, module, losses, global_losses, grads)
        if created:
            dist.barrier()  # no rank tears the group down while a peer still uses it
        return out
    finally:
        sink.close()
        if created:
            from .buckets import destroy_groups

            destroy_groups()


def _make_trainer(
    plan: Any,
    bundle: Any,
    rank: int,
    device: Any,
    full: tuple[Any, ...],
    gen: dict[str, Any],
    opt_args: tuple[str, float | None],
    caps: tuple[int | None, int | None],
    interleave: bool,
) -> Any:
    """This rank's :class:`hapnb.run.reshard.Trainer` for ``plan`` (physical): its program on ``device``,
    the optimizer, its local batch (a duplex plan: the runner and its two micro-batches), the buckets."""
    from ..runtime.codegen import generate
    from .buckets import program_buckets
    from .reshard import Trainer

    runner, scale = None, 1.0
    if plan.duplex:
        prog, runner, scale, micro = duplex_program(plan, bundle, rank, interleave=interleave, **gen)
        module = prog.module.to(device)
        batch: Any = [tuple(x.to(device) for x in prog.local_inputs(*mb)) for mb in micro]
    else:
        prog = generate(plan, bundle.graph, rank, **gen)
        module = prog.module.to(device)
        batch = tuple(x.to(device) for x in prog.local_inputs(*full))
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(opt_args[0], params, opt_args[1])
    buckets = None
    if gen["grad_sync"] == "buckets":
        buckets = program_buckets(module, prog.grad_sync, cap=caps[0], first_cap=caps[1])
    return Trainer(plan, prog, module, opt, batch, buckets, runner, scale)


def _live_rebalancer(
    rebalance: Mapping[str, Any] | None,
    plan: Any,
    bundle: Any,
    rank: int,
    device: Any,
    make: Callable[[Any], Any],
    sink: Callable[[dict], None],
    phase: Callable[..., None],
    fault_rank: int | None,
    slowdown: float,
) -> Any:
    """The :class:`hapnb.run.reshard.LiveRebalancer` of this rank (telemetry only when ``rebalance`` is
    None); a clear error for a plan that cannot be resharded live."""
    from .rebalance import RebalanceOptions
    from .reshard import LiveRebalancer

    if rebalance is not None and (plan.duplex or plan is not bundle.plan):
        what = "a duplex plan" if plan.duplex else "a plan with virtual devices (gpus > 1)"
        raise ValueError(
            f"rank {rank}: live re-balancing does not support {what} ({plan.name}); launch without "
            "--rebalance, or plan one rank per device without duplex"
        )
    return LiveRebalancer(
        RebalanceOptions.from_json(rebalance or {}),
        rank=rank,
        graph=bundle.graph,
        device=device,
        compile_s=0.0,
        make=make,
        emit=sink,
        phase=phase,
        rebalance=rebalance is not None,
        fault_rank=fault_rank,
        slowdown=slowdown,
    )


def _train(
    tr: Any,
    steps: int,
    rank: int,
    device: Any,
    sink: Callable[[dict], None],
    phase: Callable[..., None],
    keep_grads: bool,
    live: Any,
    slowdown: float,
) -> tuple[list[dict[str, Any]], list[float], list[float], dict[str, Any], Any]:
    """The training steps: (metrics, partial losses, global losses, first-step gradients, final trainer).
    With ``live`` (:class:`hapnb.run.reshard.LiveRebalancer`) each step also reports its compute and
    collective seconds, and may end in a reshard (``slowdown`` is the rank's injected straggler factor, applied
    by the live clock; :class:`hapnb.run.telemetry.CollectiveClock`)."""
    import torch

    from ..runtime import collectives as C

    out: list[dict[str, Any]] = []
    losses: list[float] = []
    global_losses: list[float] = []
    grads: dict[str, Any] = {}
    for step in range(steps):
        t0 = time.perf_counter()
        c0 = live.clock.seconds if live is not None else 0.0
        if live is not None:
            live.clock.mark()
        phase("forward", step)
        tr.opt.zero_grad(set_to_none=True)
        if tr.runner is not None:
            loss0, loss1 = tr.runner(*tr.batch)
            loss = (loss0 + loss1) * tr.scale
        else:
            loss = tr.module(*tr.batch)
        phase("backward", step)
        loss.backward()
        if tr.buckets is not None:
            tr.buckets.wait()  # every replicated gradient is complete from here on
        if step == 0 and keep_grads:
            for p in tr.prog.params:
                gr = tr.module.get_parameter(p.local_name).grad if p.kind == "param" else None
                if gr is not None:
                    grads[p.local_name] = gr.detach().cpu().clone()
        t_opt = time.perf_counter()
        tr.opt.step()
        opt_s = (time.perf_counter() - t_opt) * slowdown  # slowed, at the next collective, like the rest
        total = C.all_reduce(loss.detach().clone(), where=f"the global loss of step {step}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        global_losses.append(float(total))
        m = {
            "rank": rank,
            "step": step,
            "loss": losses[-1],
            "global_loss": global_losses[-1] if rank == 0 else None,
            "step_s": dt,
            "max_memory_bytes": _peak_memory(device),
        }
        if live is not None:
            comm = live.clock.seconds - c0
            m.update(compute_s=max(0.0, dt - comm), comm_s=comm, optimizer_s=opt_s)
        out.append(m)
        sink(m)
        if live is not None:
            tr = live.end_step(step, steps, m, tr)
    return out, losses, global_losses, grads, tr


def _save_verify_record(
    verify_out: str | os.PathLike[str],
    rank: int,
    prog: Any,
    module: Any,
    losses: list[float],
    global_losses: list[float],
    grads: dict[str, Any],
) -> None:
    """Write ``rank<r>.pt`` for :func:`hapnb.verify`: the losses per step, the first step's gradients, the
    weights and buffers after the last step, and how each local parameter maps to the model's."""
    import torch

    state = dict(module.named_parameters())
    state.update(dict(module.named_buffers()))
    weights = {p.local_name: state[p.local_name].detach().cpu().clone() for p in prog.params}
    rec = {
        "rank": rank,
        "losses": losses,
        "global_losses": global_losses,
        "grads": grads,
        "weights": weights,
        "params": [
            [p.local_name, p.name, p.kind, p.dim, p.start, p.length, list(p.lengths)] for p in prog.params
        ],
    }
    d = Path(verify_out)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".rank{rank}.pt.tmp"
    torch.save(rec, tmp)
    tmp.replace(d / f"rank{rank}.pt")


def init_group(backend: str, rank: int, world_size: int, timeout_s: float) -> bool:
    """Join the default process group from the environment (``env://``, as torchrun sets it) unless one
    is initialised already (then it must be ``rank`` of ``world_size``); True when this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise ValueError(
                f"the initialised process group is rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"not {rank}/{world_size}"
            )
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise RuntimeError("MASTER_PORT is not set: run the rank under torchrun (or set MASTER_ADDR/PORT)")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return True


def duplex_program(plan: Any, bundle: Any, rank: int, *, interleave: bool = True, **gen: Any) -> Any:
    """Rank ``rank``'s half-batch program of the duplex ``plan`` (physical) from ``bundle``:
    ``(program, runner, loss_scale, (micro_batch0, micro_batch1))`` with the micro-batches as full
    global inputs (cut them with ``program.local_inputs``); ``gen`` goes to
    :func:`hapnb.runtime.codegen.generate` (``dtype`` also casts the inputs)."""
    from ..runtime.codegen import generate
    from ..runtime.program import program_weights
    from .duplex import DuplexRunner, half_plan, loss_scale, split_batch

    if bundle.half_graph is None:
        raise ValueError(f"plan {plan.name} is duplex but its bundle has no half-batch program")
    dtype = gen.get("dtype")
    full = tuple(x.to(dtype) if dtype is not None and x.is_floating_point() else x for x in bundle.inputs)
    _, micro = split_batch(plan, bundle.graph, full)
    half = half_plan(plan, bundle.graph, bundle.half_graph)
    weights = program_weights(bundle.graph)  # the model's weights (the half trace gives only shapes)
    prog = generate(half, bundle.half_graph, rank, weights=weights, **gen)
    return prog, DuplexRunner(prog.module, interleave=interleave), loss_scale(bundle.graph), micro


def rank_options(ap: argparse.ArgumentParser) -> None:
    """The options every hapnb rank command takes (this worker and :mod:`hapnb.run.pipelined`)."""
    ap.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--lr", type=float, default=None, help="learning rate (adam 1e-3, sgd 0.05)")
    ap.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    ap.add_argument("--no-dropout", action="store_true", help="replace dropout by identity")
    ap.add_argument("--dtype", default=None, help="cast weights and inputs (e.g. float64)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--metrics", default=None, help="append JSON lines to this file ({rank} is replaced)")
    g.add_argument("--metrics-fd", type=int, default=None, help="write JSON lines to this file descriptor")
    ap.add_argument("--verify-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="collective timeout in seconds: a collective that waits longer for its peers fails, naming the "
        "rank and the instruction (default 300)",
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hapnb.run.worker",
        description="Run one rank of a hapnb plan bundle (start it under torchrun).",
    )
    ap.add_argument("bundle", help="bundle folder (plan.json + program.pt2 + inputs.pt)")
    rank_options(ap)
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the program's random ops, the same on every rank (default: rank 0's torch seed)",
    )
    ap.add_argument(
        "--inputs", default="local", choices=("local", "full"), help="feed local slices or the full batch"
    )
    ap.add_argument(
        "--grad-sync",
        default="buckets",
        choices=("buckets", "sync"),
        help="replicated gradients: async DDP-like buckets during the backward (default) or in-graph sync",
    )
    ap.add_argument("--bucket-cap-bytes", type=int, default=None, help="gradient bucket cap (25 MiB)")
    ap.add_argument(
        "--first-bucket-cap-bytes", type=int, default=None, help="first gradient bucket cap (1 MiB)"
    )
    ap.add_argument(
        "--no-interleave", action="store_true", help="duplex plans: run the two micro-batches one by one"
    )
    ap.add_argument(
        "--device", default="auto", choices=DEVICES, help="auto: nccl on the rank's GPU, gloo on the CPU"
    )
    live_options(ap)
    return ap


def live_options(ap: argparse.ArgumentParser) -> None:
    """The worker's live re-balancing options (issue 21; :func:`run_worker`'s ``rebalance``,
    ``telemetry``, ``slowdown``)."""
    ap.add_argument(
        "--rebalance",
        nargs="?",
        const="{}",
        default=None,
        metavar="JSON",
        help="re-balance live when a rank straggles; optional JSON of hapnb.run.rebalance.RebalanceOptions",
    )
    ap.add_argument("--telemetry", action="store_true", help="report compute and collective seconds per step")
    ap.add_argument(
        "--slowdown",
        action="append",
        default=[],
        metavar="RANK=FACTOR",
        help="make RANK's compute FACTOR times slower (it sleeps in proportion); repeatable",
    )
    ap.add_argument("--fault-reshard-rank", type=int, default=None, help=argparse.SUPPRESS)


def rank_main(entry: str, run: Callable[[], Any]) -> int:
    """Run a rank command's body: exit status 0, or 1 with ``entry``'s name, the rank and the traceback
    on stderr (what the process supervisor quotes)."""
    try:
        run()
    except Exception:
        rank = os.environ.get("RANK", "?")
        sys.stderr.write(f"{entry} rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: ``python -m hapnb.run.worker BUNDLE ...``; exit status 1 on any error."""
    from .rebalance import parse_slowdown

    args = _parser().parse_args(argv)
    metrics: Any = args.metrics if args.metrics is not None else args.metrics_fd
    rebalance = json.loads(args.rebalance) if args.rebalance is not None else None
    slow = parse_slowdown(args.slowdown).get(int(os.environ.get("RANK", 0)), 1.0)
    return rank_main(
        "hapnb.run.worker",
        lambda: run_worker(
            args.bundle,
            None,
            None,
            args.backend,
            args.steps,
            metrics,
            lr=args.lr,
            optimizer=args.optimizer,
            inputs=args.inputs,
            dropout=not args.no_dropout,
            dtype=args.dtype,
            verify_out=args.verify_out,
            timeout_s=args.timeout,
            heartbeat=lambda d: _write_line(sys.stdout, d),  # heartbeats always go to stdout
            grad_sync=args.grad_sync,
            bucket_cap=args.bucket_cap_bytes,
            first_bucket_cap=args.first_bucket_cap_bytes,
            interleave=not args.no_interleave,
            device=args.device,
            rebalance=rebalance,
            telemetry=args.telemetry,
            slowdown=slow,
            fault_rank=args.fault_reshard_rank,
            seed=args.seed,
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
