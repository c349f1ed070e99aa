"""Profile this machine into a cluster JSON, and calibrate the cost model against a real run.

``hapnb profile`` measures what :mod:`hapnb.hardware.cluster` needs, in the cost model's own units:

* **Device throughput** (:func:`profile_devices`): a fixed benchmark (a few Linear layers, the zoo's
  ``mlp``, and a small transformer block, the zoo's ``gpt``) runs forward + backward + SGD steps; the
  median step time divides the benchmark's *training flops* computed by :func:`training_flops` —
  ``3 x`` the sum of the forward ``flops`` that :func:`hapnb.trace` gives each op, exactly what the cost
  model charges (backward = 2x forward; paper §3.2, hap-reference §3.2). The result is an *effective*
  throughput: the cost model's flops divided by real time, not the hardware's peak.
* **Device model** (:func:`profile_device_model`, in :mod:`hapnb.run.device_profile`): the roofline
  parameters of :class:`~hapnb.hardware.devices.DeviceModel` (matmul and conv efficiency curves over sizes,
  memory bandwidth, per-kernel overhead, attention efficiency, Adam step; on a CPU the vector, pooling
  and scan rates and Adam per parameter tensor), fitted with numpy (:func:`fit_matmul_curve`); its
  ``source`` names the device, the threads and clock, the date and the torch version.
* **Collectives** (:func:`profile_collectives`): ``nproc`` local ranks (gloo on CPU, NCCL on GPUs) time
  each collective kind at several sizes (barrier before each call, median over repeats of the slowest
  rank's time) with the same torch.distributed calls the runtime makes, and :func:`fit_collective`
  fits ``launches * latency_s + nbytes / bandwidth_Bps`` by least squares, where ``nbytes`` and
  ``launches`` follow :mod:`hapnb.hardware.cluster`'s conventions exactly (``full`` = the whole tensor, ``n``
  ranks, each holding a shard of ``full / n``):

  ==================  =======================================  ==================  ==========
  kind                call timed                               nbytes              launches
  ==================  =======================================  ==================  ==========
  ``all_gather``      padded ``all_gather`` (shard -> n bufs)  ``n * shard``       1
  ``reduce_scatter``  padded ``reduce_scatter`` (n pieces)     ``n * shard``       1
  ``all_reduce``      ``all_reduce`` of the full tensor        ``full``            1
  ``all_to_all``      ``all_to_all_single`` of a local shard   bytes one rank sends 1
  ``broadcast``       n ``broadcast`` (one per root, grouped)  ``full``            n
  ``reduce``          n ``reduce`` (one per root, grouped)     ``full``            n
  ==================  =======================================  ==================  ==========

* **Overlap slowdown** (:func:`profile_overlap_slowdown`): Proteus' overlap factor γ, the slowdown of
  a matmul loop while an all-reduce loop runs beside it (a thread of rank 0 and rank 1, gloo on CPU,
  NCCL on GPUs), ``min time beside / min time alone - 1`` (``DeviceModel.overlap_slowdown``, read by
  :mod:`hapnb.plans.simulation`).
* :func:`profile_cluster` combines them into a :class:`~hapnb.hardware.cluster.Cluster` (devices ``cpu-0``, ...
  or named after the GPU, e.g. ``h100-0``) that ``hapnb plan --cluster cluster.json`` reads.

Calibration against a real run is :mod:`hapnb.run.calibrate`.

>>> f = fit_collective("all_reduce", [(1e6, 1, 2e-5 + 1e-3), (4e6, 1, 2e-5 + 4e-3)])
>>> round(f.latency_s * 1e6, 6), round(f.bandwidth_Bps / 1e9, 6)
(20.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..hardware.catalogue import KINDS
from ..hardware.cluster import Cluster
from ..hardware.devices import DeviceModel
from ..hardware.parts import COLLECTIVE_KINDS, Collective, Device
from .device_profile import (
    BANDWIDTH_ELEMENTS,
    CLOCKS,
    CONV_PROBES,
    MATMUL_SIZES,
    POOL_SHAPE,
    SCAN_SHAPE,
    VECTOR_ELEMENTS,
    DeviceModelProfile,
    device_name,
    fit_matmul_curve,
    profile_device_model,
)
from .supervisor import run_local

__all__ = [
    "BANDWIDTH_ELEMENTS",
    "BENCHMARKS",
    "CONV_PROBES",
    "CLOCKS",
    "CollectiveFit",
    "DeviceModelProfile",
    "DeviceProfile",
    "MATMUL_SIZES",
    "measure_saved_bytes",
    "POOL_SHAPE",
    "SCAN_SHAPE",
    "ProfileError",
    "VECTOR_ELEMENTS",
    "collective_sizes",
    "device_name",
    "fit_collective",
    "profile_overlap_slowdown",
    "fit_matmul_curve",
    "measure_step_s",
    "step_times",
    "profile_cluster",
    "profile_collectives",
    "profile_device_model",
    "profile_devices",
    "training_flops",
]

#: Benchmark models per (device type, quick): zoo names and options. Both a plain Linear stack and a
#: transformer block, so the throughput reflects matmuls, attention and element-wise ops together.
BENCHMARKS: Mapping[tuple[str, bool], tuple[tuple[str, Mapping[str, Any]], ...]] = {
    ("cpu", True): (
        ("mlp", dict(layers=3, hidden=128, input=128, batch=32)),
        ("gpt", dict(layers=1, hidden=64, heads=4, vocab=128, seq=32, batch=4, dropout=0.0)),
    ),
    ("cpu", False): (
        ("mlp", dict(layers=3, hidden=512, input=512, batch=128)),
        ("gpt", dict(layers=1, hidden=256, heads=4, vocab=512, seq=128, batch=8, dropout=0.0)),
    ),
    ("cuda", True): (
        ("mlp", dict(layers=3, hidden=2048, input=2048, batch=512)),
        ("gpt", dict(layers=1, hidden=1024, heads=16, vocab=4096, seq=256, batch=8, dropout=0.0)),
    ),
    ("cuda", False): (
        ("mlp", dict(layers=4, hidden=4096, input=4096, batch=2048)),
        ("gpt", dict(layers=2, hidden=2048, heads=16, vocab=8192, seq=512, batch=8, dropout=0.0)),
    ),
}

_FLOAT_BYTES = 4  # collectives are timed on float32 tensors


class ProfileError(RuntimeError):
    """Profiling failed (a rank crashed or got stuck, or no usable measurement)."""


# ----------------------------------------------------------------------------------------------------
# Device throughput


def training_flops(model: Any, inputs: Sequence[Any]) -> float:
    """Training flops of one fwd+bwd step in the cost model's units: ``3 x sum(op.flops)`` of
    ``hapnb.trace(model, inputs)`` (backward = 2x forward, as the rules' replicated strategy charges)."""
    from ..tracing import trace

    graph = trace(model, tuple(inputs))
    total = math.fsum(float(op.flops) for op in graph.ops)
    if not total > 0:
        raise ProfileError(f"tracing {type(model).__name__} found no flops; pick another benchmark model")
    return 3.0 * total


def measure_saved_bytes(model: Any, inputs: Sequence[Any]) -> int:
    """Bytes autograd keeps for the backward of one training forward of ``model(*inputs)`` (a scalar loss):
    every tensor saved by a node of the autograd graph, each storage once, parameters, buffers and the
    inputs left out (the memory model counts them apart) — the ground truth of :func:`hapnb.cost.memory.saved_bytes`."""
    import torch

    if hasattr(model, "train"):
        model.train()
    state = [*getattr(model, "parameters", list)(), *getattr(model, "buffers", list)()]
    params = {p.untyped_storage().data_ptr() for p in state}
    params.update(x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor))
    loss = model(*inputs)
    sizes: dict[int, int] = {}
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed or not a tensor attribute
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in params:
                        sizes[ptr] = t.untyped_storage().nbytes()
        todo.extend(nxt for nxt, _ in node.next_functions)
    return sum(sizes.values())


def step_times(
    model: Any, inputs: Sequence[Any], optimizer: Any, steps: int = 10, warmup: int = 2
) -> tuple[list[float], float]:
    """Seconds of each of ``steps`` timed training steps (``zero_grad; loss = model(*inputs);
    loss.backward(); optimizer.step()``, CUDA synchronised) after ``warmup`` untimed ones, and the last
    step's loss."""
    import torch

    params = [p for g in optimizer.param_groups for p in g["params"]]
    dev = next((t.device for t in list(inputs) + params if isinstance(t, torch.Tensor)), torch.device("cpu"))
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    times, loss = [], None
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        optimizer.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, float(loss.detach()) if loss is not None else float("nan")


def measure_step_s(
    model: Any, inputs: Sequence[Any], steps: int = 10, warmup: int = 2, lr: float = 1e-4
) -> float:
    """Median seconds of one ``loss = model(*inputs); loss.backward(); SGD step`` (:func:`step_times`)."""
    import torch

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    return statistics.median(step_times(model, inputs, opt, steps, warmup)[0])


@dataclass(frozen=True)
class DeviceProfile:
    """A measured device: effective ``flops`` = ``training_flops / step_s`` of the benchmark."""

    name: str
    kind: str
    flops: float
    memory_bytes: int
    machine: str
    step_s: float  # median fwd+bwd+SGD seconds, summed over the benchmark models
    training_flops: float  # cost-model flops of one step, summed over the benchmark models
    details: tuple[tuple[str, float, float], ...] = ()  # (model, training flops, median step s)
    model: DeviceModel | None = None  # the measured roofline model (profile_device_model), if asked

    def device(self) -> Device:
        return Device(self.name, self.kind, self.flops, self.memory_bytes, self.machine, model=self.model)

    def __str__(self) -> str:
        rate = f"{self.flops / 1e9:.4g} GFLOP/s effective"
        return f"{self.name} ({self.kind}): {rate}, benchmark step {self.step_s * 1e3:.3g} ms"


def _gpu_kind(name: str) -> str:
    key = "".join(c for c in name.upper() if c.isalnum())
    for kind in sorted((k for k in KINDS if not k.endswith("-TF32")), key=len, reverse=True):
        if "".join(c for c in kind.upper() if c.isalnum()) in key:
            return kind
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name).strip("-") or "GPU"


def _machine() -> str:
    return socket.gethostname() or "m0"


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def _benchmark(device: Any, models: Sequence[tuple[str, Mapping[str, Any]]], steps: int, warmup: int):
    from .. import zoo

    details = []
    for name, options in models:
        model, inputs, _ = zoo.build(name, devices=1, **dict(options))
        flops = training_flops(model, inputs)  # traced on CPU, before moving
        model = model.to(device)
        inputs = tuple(x.to(device) for x in inputs)
        details.append((name, flops, measure_step_s(model, inputs, steps=steps, warmup=warmup)))
    return tuple(details)


def profile_devices(
    nproc: int = 1,
    device: str | None = None,
    *,
    quick: bool = False,
    steps: int | None = None,
    warmup: int = 2,
    models: Sequence[tuple[str, Mapping[str, Any]]] | None = None,
    threads: int | None = None,
    device_model: bool = False,
) -> tuple[DeviceProfile, ...]:
    """Effective training throughput of ``nproc`` local devices (``device``: "cpu", "cuda" or None =
    CUDA when available); with ``device_model``, also each device's roofline parameters
    (:func:`profile_device_model`, same ``quick`` and threads), carried by the profiles' devices.

    CUDA: GPUs ``0..nproc-1`` are measured one by one (named after their kind, e.g. ``a100-0``). CPU:
    the ``nproc`` ranks share this CPU, so the benchmark runs once with ``threads`` = cores / nproc
    (default) and every ``cpu-i`` gets that throughput and ``1/nproc`` of the RAM.
    """
    import torch

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    steps = steps or (5 if quick else 20)
    models = tuple(models) if models is not None else BENCHMARKS[(device, quick)]
    machine = _machine()
    out = []
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
        if nproc > torch.cuda.device_count():
            raise ValueError(f"nproc={nproc} GPUs requested but only {torch.cuda.device_count()} are visible")
        for i in range(nproc):
            props = torch.cuda.get_device_properties(i)
            kind = _gpu_kind(props.name)
            details = _benchmark(torch.device("cuda", i), models, steps, warmup)
            dm = profile_device_model(f"cuda:{i}", quick=quick).model if device_model else None
            out.append(_profile(f"{kind.lower()}-{i}", kind, int(props.total_memory), machine, details, dm))
        return tuple(out)
    old = torch.get_num_threads()
    nthreads = threads or max(1, (os.cpu_count() or 1) // nproc)
    torch.set_num_threads(nthreads)
    try:
        details = _benchmark(torch.device("cpu"), models, steps, warmup)
        dm = profile_device_model("cpu", quick=quick, threads=nthreads).model if device_model else None
    finally:
        torch.set_num_threads(old)
    mem = max(1, _ram_bytes() // nproc)
    return tuple(_profile(f"cpu-{i}", "CPU", mem, machine, details, dm) for i in range(nproc))


def _profile(
    name: str, kind: str, mem: int, machine: str, details: tuple, model: DeviceModel | None = None
) -> DeviceProfile:
    flops = math.fsum(d[1] for d in details)
    step_s = math.fsum(d[2] for d in details)
    return DeviceProfile(name, kind, flops / step_s, mem, machine, step_s, flops, details, model)


# ----------------------------------------------------------------------------------------------------
# Collective fits


@dataclass(frozen=True)
class CollectiveFit:
    """``time = launches * latency_s + nbytes / bandwidth_Bps`` fitted to ``points`` (nbytes, launches,
    seconds). ``r2`` is the coefficient of determination; ``clamped`` says a coefficient hit its bound
    (latency >= 0, bandwidth <= 1e15 B/s), which happens when the timings are noise-dominated."""

    kind: str
    latency_s: float
    bandwidth_Bps: float
    points: tuple[tuple[float, int, float], ...]
    r2: float
    clamped: bool = False

    @property
    def collective(self) -> Collective:
        return Collective(self.latency_s, self.bandwidth_Bps)

    def predict(self, nbytes: float, launches: int = 1) -> float:
        return launches * self.latency_s + nbytes / self.bandwidth_Bps

    def __str__(self) -> str:
        return (
            f"{self.kind}: {self.latency_s * 1e6:.3g} us + bytes / {self.bandwidth_Bps / 1e9:.4g} GB/s "
            f"(r2 {self.r2:.3f}, {len(self.points)} sizes{', clamped' if self.clamped else ''})"
        )


_MAX_BANDWIDTH = 1e15


def fit_collective(kind: str, points: Sequence[tuple[float, int, float]]) -> CollectiveFit:
    """Least-squares fit of ``seconds = launches * latency_s + nbytes * (1 / bandwidth_Bps)``.

    Needs at least two distinct ``nbytes``. Constrained to ``latency_s >= 0`` and a positive slope
    (bandwidth at most 1e15 B/s); when the unconstrained optimum violates a bound, the other coefficient
    is refitted with that one at its bound.
    """
    pts = tuple((float(x), int(n), float(t)) for x, n, t in points)
    if len({x for x, _, _ in pts}) < 2:
        raise ValueError(f"fitting {kind} needs timings at >= 2 different sizes, got {len(pts)} point(s)")
    if any(not (x >= 0 and n >= 0 and t >= 0 and math.isfinite(t)) for x, n, t in pts):
        raise ValueError(f"fitting {kind}: sizes, launches and times must be finite and >= 0: {pts}")
    sll = math.fsum(n * n for _, n, _ in pts)
    sxx = math.fsum(x * x for x, _, _ in pts)
    slx = math.fsum(n * x for x, n, _ in pts)
    slt = math.fsum(n * t for _, n, t in pts)
    sxt = math.fsum(x * t for x, _, t in pts)
    det = sll * sxx - slx * slx
    lat, slope = -1.0, -1.0
    if det > 1e-12 * sll * sxx and sll > 0:
        lat = (slt * sxx - slx * sxt) / det
        slope = (sll * sxt - slx * slt) / det
    clamped = lat < 0 or slope < 1 / _MAX_BANDWIDTH
    if clamped:
        # the constrained optimum lies on a bound: try both (each refitted) and keep the better one
        candidates = []
        s0 = max(sxt / sxx, 1 / _MAX_BANDWIDTH) if sxx > 0 else 1 / _MAX_BANDWIDTH
        candidates.append((0.0, s0))  # latency at its bound, slope through the origin
        s1 = 1 / _MAX_BANDWIDTH
        candidates.append((max(0.0, (slt - s1 * slx) / sll) if sll > 0 else 0.0, s1))  # pure latency
        lat, slope = min(candidates, key=lambda c: _sse(pts, *c))
    pred = [n * lat + x * slope for x, n, _ in pts]
    mean = statistics.fmean(t for _, _, t in pts)
    ss_tot = math.fsum((t - mean) ** 2 for _, _, t in pts)
    ss_res = math.fsum((t - p) ** 2 for (_, _, t), p in zip(pts, pred))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return CollectiveFit(kind, lat, min(1 / slope, _MAX_BANDWIDTH), pts, r2, clamped)


def _sse(pts: Sequence[tuple[float, int, float]], lat: float, slope: float) -> float:
    return math.fsum((t - n * lat - x * slope) ** 2 for x, n, t in pts)


def collective_sizes(backend: str, quick: bool = False) -> tuple[int, ...]:
    """Default full-tensor sizes in bytes: small on CPU/gloo, up to 256 MiB on NCCL."""
    if backend == "nccl":
        return (1 << 20, 16 << 20, 64 << 20) if quick else (1 << 20, 8 << 20, 64 << 20, 256 << 20)
    return (16 << 10, 256 << 10, 1 << 20) if quick else (16 << 10, 256 << 10, 1 << 20, 4 << 20)


def _collective_call(kind: str, shard: int, n: int, rank: int, device: Any) -> tuple[Any, int, int]:
    """(callable running one timed collective, nbytes, launches) per the cluster conventions."""
    import torch
    import torch.distributed as dist

    def z(k: int) -> torch.Tensor:
        return torch.zeros(k, dtype=torch.float32, device=device)

    full = n * shard * _FLOAT_BYTES
    if kind == "all_gather":  # padded: every rank sends its (max-size) shard
        send, bufs = z(shard), [z(shard) for _ in range(n)]
        return (lambda: dist.all_gather(bufs, send)), full, 1
    if kind == "reduce_scatter":
        pieces, out = [z(shard) for _ in range(n)], z(shard)
        return (lambda: dist.reduce_scatter(out, pieces)), full, 1
    if kind == "all_reduce":
        buf = z(n * shard)
        return (lambda: dist.all_reduce(buf)), full, 1
    if kind == "all_to_all":  # a rank's local shard (n * shard elements) is split among the ranks
        a, b = z(n * shard), z(n * shard)
        return (lambda: dist.all_to_all_single(b, a)), full, 1
    if kind in ("broadcast", "reduce"):  # grouped: one call per root, each moving full / n
        bufs = [z(shard) for _ in range(n)]
        if kind == "broadcast":
            calls = [lambda j=j: dist.broadcast(bufs[j], src=j, async_op=True) for j in range(n)]
        else:
            calls = [lambda j=j: dist.reduce(bufs[j], dst=j, async_op=True) for j in range(n)]

        def grouped() -> None:
            for w in [c() for c in calls]:
                w.wait()

        return grouped, full, n
    raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {', '.join(COLLECTIVE_KINDS)}")


def _collective_worker(cfg: Mapping[str, Any]) -> None:
    """Rank body of :func:`profile_collectives` (``python -m hapnb.run.profile --collective-worker CFG``);
    prints one JSON line per timing, which is also its heartbeat."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = cfg["backend"]
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=float(cfg["timeout_s"])))
    n = dist.get_world_size()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def barrier() -> None:
        if backend == "nccl":
            dist.barrier(device_ids=[local])
        else:
            dist.barrier()

    try:
        for kind in cfg["kinds"]:
            for size in cfg["sizes"]:
                shard = max(1, int(size) // (_FLOAT_BYTES * n))
                call, nbytes, launches = _collective_call(kind, shard, n, rank, device)
                # small sizes: several back-to-back calls per timing, so the barrier's release skew
                # between ranks (tens of us to ms on a busy CPU) does not swamp the collective itself
                inner = max(1, min(int(cfg.get("max_inner", 16)), (1 << 20) // max(1, nbytes)))
                for rep in range(-int(cfg["warmup"]), int(cfg["repeats"])):
                    barrier()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        call()
                    sync()
                    dt = (time.perf_counter() - t0) / inner
                    if rep >= 0:
                        rec = dict(
                            kind=kind, size=size, nbytes=nbytes, launches=launches, repeat=rep, time_s=dt
                        )
                        print(json.dumps({"rank": rank, **rec}), flush=True)
        barrier()
    finally:
        dist.destroy_process_group()


def profile_collectives(
    nproc: int = 2,
    backend: str = "gloo",
    sizes: Sequence[int] | None = None,
    repeats: int | None = None,
    *,
    kinds: Sequence[str] = COLLECTIVE_KINDS,
    warmup: int = 2,
    quick: bool = False,
    timeout_s: float = 120.0,
    stat: str = "median",
) -> dict[str, CollectiveFit]:
    """Time every collective kind on ``nproc`` local ranks and fit latency/bandwidth per kind.

    ``sizes``: full-tensor sizes in bytes (default :func:`collective_sizes`); each point is the median over
    ``repeats`` of the slowest rank's time (``stat="min"``: the fastest repeat, more robust on a shared,
    noisy machine). Ranks run as separate processes under :mod:`hapnb.run.supervisor` (crash and stall
    handling, no leftovers); ``timeout_s`` bounds the whole run and the time without a new timing.
    Raises :class:`ProfileError` when a rank fails.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    unknown = [k for k in kinds if k not in COLLECTIVE_KINDS]
    if unknown:
        raise ValueError(f"unknown collective kind(s) {unknown}; valid kinds: {', '.join(COLLECTIVE_KINDS)}")
    sizes = tuple(int(s) for s in (sizes or collective_sizes(backend, quick)))
    if len(set(sizes)) < 2 or min(sizes) <= 0:
        raise ValueError(f"need at least two different positive sizes (bytes) to fit, got {sizes}")
    repeats = repeats or (3 if quick else 5)
    reduce_fn = {"median": statistics.median, "min": min}.get(stat)
    if reduce_fn is None:
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    cfg = dict(backend=backend, kinds=list(kinds), sizes=list(sizes), repeats=repeats, warmup=warmup)
    cfg["timeout_s"] = timeout_s
    lines: list[dict[str, Any]] = []
    outcome = run_local(
        nproc,
        ["-m", "hapnb.run.profile", "--collective-worker", json.dumps(cfg)],
        stall_s=timeout_s,
        wall_s=timeout_s,
        on_heartbeat=lambda _rank, rec: lines.append(rec),
        limit_names=("timeout_s (--timeout)", "timeout_s (--timeout)"),
    )
    if not outcome.ok:
        raise ProfileError(
            f"collective profiling on {nproc} {backend} ranks {outcome.status}: {outcome.error}"
        )
    slowest: dict[tuple[str, int, int], float] = {}
    meta: dict[tuple[str, int], tuple[int, int]] = {}
    for m in lines:
        key = (m["kind"], m["size"], m["repeat"])
        slowest[key] = max(slowest.get(key, 0.0), float(m["time_s"]))
        meta[(m["kind"], m["size"])] = (int(m["nbytes"]), int(m["launches"]))
    fits = {}
    for kind in kinds:
        pts = []
        for size in sizes:
            times = [t for (k, s, _), t in slowest.items() if k == kind and s == size]
            if not times:
                raise ProfileError(f"no timings came back for {kind} at {size} bytes (ranks' output lost?)")
            nbytes, launches = meta[(kind, size)]
            pts.append((nbytes, launches, reduce_fn(times)))
        fits[kind] = fit_collective(kind, pts)
    return fits


def _overlap_worker(cfg: Mapping[str, Any]) -> None:
    """Rank body of :func:`profile_overlap_slowdown` (``--overlap-worker CFG``): rank 0 times a matmul
    loop alone, then while a thread all-reduces in a loop with rank 1's, and prints one JSON line."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = cfg["backend"]
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=float(cfg["timeout_s"])))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    m = int(cfg["matmul"])
    a, b, c = (torch.randn(m, m, device=device) for _ in range(3))
    buf = torch.ones(int(cfg["nbytes"]) // _FLOAT_BYTES, device=device)
    stop = threading.Event()

    def timed() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(int(cfg["inner"])):
            torch.mm(a, b, out=c)
        sync()
        return time.perf_counter() - t0

    def communicate() -> None:
        flag = torch.zeros(1, device=device)
        while True:
            dist.all_reduce(buf)
            flag.fill_(1.0 if stop.is_set() else 0.0)
            dist.all_reduce(flag)
            if flag.item() > 0:
                return

    try:
        alone = [timed() for _ in range(int(cfg["repeats"]))] if rank == 0 else []
        dist.barrier()
        comm = threading.Thread(target=communicate, daemon=True)
        comm.start()
        beside = []
        if rank == 0:
            time.sleep(0.05)  # let the all-reduce loop get going
            beside = [timed() for _ in range(int(cfg["repeats"]))]
            stop.set()
        comm.join()
        if rank == 0:
            alone += [timed() for _ in range(int(cfg["repeats"]))]
            print(json.dumps({"rank": 0, "alone_s": min(alone), "beside_s": min(beside)}), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def profile_overlap_slowdown(
    backend: str | None = None, *, quick: bool = False, threads: int | None = None, timeout_s: float = 120.0
) -> float:
    """Proteus' overlap factor γ on this machine: how much longer a matmul loop takes while an all-reduce
    loop (2 local ranks; ``backend``: NCCL when 2 GPUs are visible, else gloo on CPU) runs beside it
    (``>= 0``). CPU ranks use ``threads`` torch threads (default cores / 2)."""
    import torch

    backend = backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    gpu = backend == "nccl"
    cfg = dict(
        backend=backend,
        matmul=(2048 if gpu else 256) if not quick else (1024 if gpu else 128),
        inner=(50 if gpu else 20) if not quick else 10,
        nbytes=(64 if gpu else 4) * 2**20 // (4 if quick else 1),
        repeats=3 if quick else 7,
        threads=None if gpu else (threads or max(1, (os.cpu_count() or 2) // 2)),
        timeout_s=timeout_s,
    )
    got: list[dict[str, Any]] = []
    outcome = run_local(
        2,
        ["-m", "hapnb.run.profile", "--overlap-worker", json.dumps(cfg)],
        stall_s=timeout_s,
        wall_s=timeout_s,
        on_heartbeat=lambda _rank, rec: got.append(rec),
        limit_names=("timeout_s (--timeout)", "timeout_s (--timeout)"),
    )
    if not outcome.ok or not got:
        raise ProfileError(
            f"overlap profiling on 2 {backend} ranks {outcome.status}: {outcome.error or 'no timing'}"
        )
    rec = got[-1]
    return max(0.0, float(rec["beside_s"]) / float(rec["alone_s"]) - 1.0)


def profile_cluster(
    nproc: int | None = None,
    backend: str | None = None,
    name: str | None = None,
    *,
    quick: bool = False,
    sizes: Sequence[int] | None = None,
    repeats: int | None = None,
    timeout_s: float = 300.0,
    threads: int | None = None,
    device_model: bool = True,
    overlap_slowdown: bool = True,
) -> Cluster:
    """Profile ``nproc`` local devices and their collectives into a :class:`Cluster`.

    Defaults: all visible GPUs with NCCL, else 2 CPU ranks with gloo. The cluster's
    ``intra_machine_Bps`` is the measured all-reduce bandwidth. With ``device_model`` (default) every
    device carries its measured :class:`~hapnb.hardware.devices.DeviceModel` (JSON key ``model``), so the cost
    model prices it as a roofline; ``threads``: torch threads per CPU rank (default cores / nproc).
    With ``overlap_slowdown`` (and ``device_model``) the models also carry the measured γ
    (:func:`profile_overlap_slowdown`; on CUDA only with 2 or more GPUs).
    """
    import torch

    cuda = torch.cuda.is_available()
    if nproc is None:
        nproc = torch.cuda.device_count() if cuda else 2
    backend = backend or ("nccl" if cuda else "gloo")
    device = "cuda" if backend == "nccl" or (cuda and torch.cuda.device_count() >= nproc) else "cpu"
    devices = profile_devices(nproc, device, quick=quick, threads=threads, device_model=device_model)
    fits = profile_collectives(nproc, backend, sizes, repeats, quick=quick, timeout_s=timeout_s)
    kind = devices[0].kind
    devs = tuple(d.device() for d in devices)
    if overlap_slowdown and device_model and (device == "cpu" or nproc >= 2):
        g = profile_overlap_slowdown(backend, quick=quick, threads=threads, timeout_s=timeout_s)
        devs = tuple(dataclasses.replace(d, model=dataclasses.replace(d.model, overlap_slowdown=g)) if d.model else d for d in devs)  # fmt: skip
    return Cluster(
        name or f"profiled-{_machine()}-{nproc}x{kind}",
        devs,
        {k: f.collective for k, f in fits.items()},
        intra_machine_Bps=fits["all_reduce"].bandwidth_Bps,
        dtype_bytes=4,
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--collective-worker":
        _collective_worker(json.loads(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--overlap-worker":
        _overlap_worker(json.loads(sys.argv[2]))
    else:
        raise SystemExit(
            "usage: python -m hapnb.run.profile --collective-worker CONFIG_JSON (use `hapnb profile`)"
        )
