"""Measure the local device's roofline model (:class:`~hapnb.hardware.devices.DeviceModel`), for ``hapnb profile``.

:func:`profile_device_model` times small probes on the device, in the cost model's own units: square
``mm``/``addmm`` for the peak, chains of Linear layers and of 3x3 convolutions for the matmul and conv
efficiency curves (:func:`fit_matmul_curve`), ``c = a + b`` for the bandwidth, a chain of one-element
ops for the per-kernel time, SDPA, Adam steps, and on a CPU the vector, pooling and scan rates. On a CPU
with one torch thread it times the process's CPU clock (:data:`CLOCKS`). :mod:`hapnb.run.profile`
re-exports everything here and adds the throughput benchmark, the collectives and the cluster.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..cost.model import FAMILY_KERNELS
from ..hardware.devices import DeviceModel

__all__ = [
    "BANDWIDTH_ELEMENTS",
    "CLOCKS",
    "CONV_PROBES",
    "DeviceModelProfile",
    "MATMUL_SIZES",
    "POOL_SHAPE",
    "SCAN_SHAPE",
    "VECTOR_ELEMENTS",
    "device_name",
    "fit_matmul_curve",
    "profile_device_model",
]

#: Square matmul sizes ``n`` (``n x n @ n x n``) timed for the efficiency curve, per (device type, quick).
MATMUL_SIZES: Mapping[tuple[str, bool], tuple[int, ...]] = {
    ("cpu", True): (16, 32, 64, 128),
    ("cpu", False): (16, 32, 64, 128, 192, 256, 384, 512),
    ("cuda", True): (64, 256, 1024, 2048),
    ("cuda", False): (64, 128, 256, 512, 1024, 2048, 4096, 8192),
}
#: Layers a chain adds to measure a Linear / conv layer's time per layer (deep minus one-layer chain).
_CHAIN = 4
#: (batch, channels, side) of the 3x3 conv chains that measure the conv efficiency curve, per (device
#: type, quick): channel counts doubling at one image size, as the square matmul sizes do.
CONV_PROBES: Mapping[tuple[str, bool], tuple[tuple[int, int, int], ...]] = {
    ("cpu", True): ((4, 8, 16), (4, 16, 16), (4, 32, 16)),
    ("cpu", False): ((8, 8, 16), (8, 16, 16), (8, 32, 16), (8, 64, 16)),
    ("cuda", True): ((16, 32, 32), (16, 128, 32), (16, 512, 32)),
    ("cuda", False): ((32, 32, 32), (32, 64, 32), (32, 128, 32), (32, 256, 32), (32, 512, 32)),
}
#: Elements per tensor of the GELU / tanh forward + backward that measure ``vector_flops`` (CPU, quick).
VECTOR_ELEMENTS: Mapping[bool, int] = {True: 1 << 16, False: 1 << 18}
#: Input shape of the ``max_pool2d`` forward + backward that measures ``pool_flops`` (CPU, quick).
POOL_SHAPE: Mapping[bool, tuple[int, ...]] = {True: (8, 16, 16, 16), False: (16, 32, 32, 32)}
#: Shape of the ``logcumsumexp`` (along dim 1) forward + backward that measures ``scan_flops`` (CPU, quick).
SCAN_SHAPE: Mapping[bool, tuple[int, ...]] = {True: (4, 32, 64), False: (8, 64, 128)}
#: Elements per tensor of the elementwise ``c = a + b`` that measures memory bandwidth (3 tensors move).
BANDWIDTH_ELEMENTS: Mapping[tuple[str, bool], int] = {
    ("cpu", True): 1 << 21, ("cpu", False): 1 << 23, ("cuda", True): 1 << 24, ("cuda", False): 1 << 26,
}  # fmt: skip


@dataclass(frozen=True)
class DeviceModelProfile:
    """What :func:`profile_device_model` measured: the :class:`~hapnb.hardware.devices.DeviceModel` and the raw
    timings it was fitted from (``matmul``: (flops, seconds) per ``mm``/``addmm`` call; ``linear``:
    (forward flops, seconds / 3) of a Linear forward + backward; ``kernel_s``: per kernel of a
    fwd+bwd chain of one-element ops; ``bandwidth``: (bytes, seconds) of ``c = a + b``; ``attention``:
    (training flops, seconds) of one SDPA fwd+bwd; ``adam``: (parameter bytes, seconds) of an Adam step;
    ``vector``, ``pool``, ``scan``, CPU only: (training flops in the rules' units, seconds) of GELU and
    tanh, of max-pool and of logcumsumexp, fwd+bwd)."""

    model: DeviceModel
    matmul: tuple[tuple[float, float], ...]
    linear: tuple[tuple[float, float], ...]
    kernel_s: float
    bandwidth: tuple[float, float]
    attention: tuple[float, float] | None
    adam: tuple[float, float] | None
    vector: tuple[float, float] | None = None  # CPU: (rules' training flops, seconds) of GELU + tanh
    pool: tuple[float, float] | None = None  # CPU: (rules' training flops, seconds) of max-pool fwd+bwd
    scan: tuple[float, float] | None = None  # CPU: (rules' training flops, seconds) of logcumsumexp

    def __str__(self) -> str:
        return f"device model: {self.model}"


def fit_matmul_curve(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(rate, half_flops)`` of the curve ``achieved = rate * w / (w + half_flops)`` fitted to ``points``
    of (``w`` flops per call, seconds per call).

    The curve means ``seconds = (w + half_flops) / rate``, a line in ``w``; it is fitted by least squares
    on the *relative* residual ``(c + s w) / t - 1`` (every size counts alike), then ``rate = 1 / s`` and
    ``half_flops = c / s`` (0 when the intercept comes out negative: refitted through the origin).

    >>> pts = [(w, (w + 1e6) / 1e11) for w in (1e5, 1e6, 1e7, 1e8)]
    >>> rate, half = fit_matmul_curve(pts)
    >>> round(rate / 1e9, 6), round(half / 1e6, 6)
    (100.0, 1.0)
    """
    import numpy as np

    pts = [(float(w), float(t)) for w, t in points]
    if len({w for w, _ in pts}) < 2:
        raise ValueError(f"fitting the matmul curve needs timings at >= 2 sizes, got {len(pts)} point(s)")
    if any(not (w > 0 and t > 0 and math.isfinite(w) and math.isfinite(t)) for w, t in pts):
        raise ValueError(f"fitting the matmul curve: flops and seconds must be finite and > 0: {pts}")
    w = np.array([p[0] for p in pts])
    t = np.array([p[1] for p in pts])
    a = np.stack([1 / t, w / t], axis=1)
    (c, s), *_ = np.linalg.lstsq(a, np.ones(len(pts)), rcond=None)
    if c < 0 or s <= 0:  # through the origin: seconds = w / rate
        c, s = 0.0, float(np.sum(w / t) / np.sum((w / t) ** 2))
    return float(1 / s), float(c / s)


#: Clocks of :func:`profile_device_model`: ``wall`` (``time.perf_counter``) or ``cpu`` (the process's
#: CPU time, ``time.process_time``: on a one-thread CPU it equals the wall time of a run that is never
#: descheduled, so other work on a shared machine does not add to it).
CLOCKS: Mapping[str, Any] = {"wall": time.perf_counter, "cpu": time.process_time}


def _clock(device: Any, clock: str | None) -> str:
    """The clock to time ``device`` with: ``clock``, or by default ``cpu`` on a CPU running one torch
    thread (CPU time = busy time of that one thread) and ``wall`` otherwise (GPUs, several threads)."""
    import torch

    if clock is None:
        return "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and device.type != "cpu":
        raise ValueError(f"clock='cpu' times the host's CPU; {device} runs on a GPU: use clock='wall'")
    return clock


def _timer(device: Any, stat: str = "min", clock: str = "wall") -> Any:
    """``time(fn, inner, repeats) -> seconds per call`` on ``device`` (CUDA synchronised) with ``clock``
    (:data:`CLOCKS`): the ``stat`` ("min" or "median") over the repeats."""
    import torch

    reduce_fn = {"median": statistics.median, "min": min}.get(stat)
    if reduce_fn is None:
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    now = CLOCKS[clock]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def time_it(fn: Any, inner: int = 1, repeats: int = 5, warmup: int = 1) -> float:
        times = []
        for i in range(warmup + repeats):
            sync()
            t0 = now()
            for _ in range(inner):
                fn()
            sync()
            if i >= warmup:
                times.append((now() - t0) / inner)
        return reduce_fn(times)

    return time_it


def _inner(seconds_per_call: float, budget_s: float) -> int:
    return max(1, min(10_000, int(budget_s / max(seconds_per_call, 1e-9))))


def device_name(device: Any) -> str:
    """A human name of a torch device: the GPU's name, or the CPU's model name from /proc/cpuinfo."""
    import platform

    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} (CPU)"
    except OSError:  # pragma: no cover - not Linux
        pass
    return f"{platform.processor() or platform.machine() or 'unknown'} (CPU)"


def profile_device_model(
    device: str | None = None,
    *,
    quick: bool = False,
    threads: int | None = None,
    repeats: int | None = None,
    sizes: Sequence[int] | None = None,
    stat: str = "min",
    clock: str | None = None,
) -> DeviceModelProfile:
    """Measure the local device's :class:`~hapnb.hardware.devices.DeviceModel` parameters (``device``: "cpu",
    "cuda", "cuda:1" or None = CUDA when available; ``threads``: torch threads on CPU, default unchanged).

    * ``peak_flops``: the best rate of ``torch.mm`` / ``torch.addmm`` of ``n x n`` matrices (``sizes``,
      default :data:`MATMUL_SIZES`; ``2 n^3`` flops each);
    * matmul efficiency: a Linear layer's forward + backward as training runs it (``4n x n`` inputs to
      ``n`` and to ``4n`` outputs: addmm, the two gradient mm with transposed operands, the bias sum),
      a third of its time per forward flop; :func:`fit_matmul_curve` gives the asymptotic rate
      (``matmul_eff`` = rate / peak) and ``matmul_half_flops``. The cost model applies the curve to
      forward + backward flops, so it must see the training pattern, which on a CPU runs well below
      square ``mm``;
    * ``bandwidth_Bps``: ``c = a + b`` on :data:`BANDWIDTH_ELEMENTS` floats (``3 x`` the tensor bytes move);
    * ``kernel_s``: a chain of 200 multiplications of one-element tensors, forward + backward (2 kernels
      per op), so it includes autograd's per-op cost as the cost model's kernel counts do;
    * ``attention_eff``: ``F.scaled_dot_product_attention`` forward + backward, the rules' flops (x3 for
      training) over time, as a fraction of ``peak_flops``;
    * ``optimizer_passes``: a ``torch.optim.Adam`` step over one large parameter, seconds x bandwidth over
      the parameter bytes; ``optimizer_kernels``: an Adam step over one one-element parameter, in kernels
      (CUDA: foreach Adam, once per step); on a CPU (single-tensor Adam, ``optimizer_per_tensor``) the
      extra time per extra one-element parameter tensor (steps over 1 and 33 tensors), in kernels;
    * ``vector_flops`` (CPU only; None on CUDA, where elementwise ops are memory bound): GELU and tanh
      forward + backward on :data:`VECTOR_ELEMENTS` floats, the rules' flops (4 per element, x3 for
      training) over time: transcendentals are compute bound on a CPU core; ``pool_flops`` likewise
      from ``max_pool2d`` (2x2, with indices for the backward) forward + backward on
      :data:`POOL_SHAPE` (the rules: 1 flop per input element), and ``scan_flops`` from ``logcumsumexp``
      forward + backward on :data:`SCAN_SHAPE` (the rules: 12 flops per element; a CPU runs this scan
      one scalar exp and log1p at a time, ~30x below the vectorised transcendentals).

    ``overlap``: true on CUDA (the host runs ahead of the GPU), false on a CPU (one thread dispatches
    and computes, so the cost model adds launch and work per op). Memory overhead and constant stay 0 (``hapnb calibrate --measured`` fits them from measured peaks).
    Each timing repeats short calls to ~20 ms (5 ms quick) and takes the ``stat`` over ``repeats``
    (default 3 quick, 7 otherwise): the fastest (``"min"``, the default: on a shared machine other work
    only ever adds time) or the median. ``clock`` (:data:`CLOCKS`): ``"cpu"`` times the process's CPU
    time, the default on a CPU with one torch thread (a shared machine's other processes then neither
    add to a timing nor to its spread; several threads would sum their CPU times), else ``"wall"``.
    """
    import datetime

    import torch

    dev = _device(device)
    repeats = repeats or (3 if quick else 7)
    budget = 0.005 if quick else 0.02
    old_threads = torch.get_num_threads()
    if threads is not None and dev.type == "cpu":
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        clock_used = _clock(dev, clock)
        time_it = _timer(dev, stat, clock_used)

        def timed(fn: Any) -> float:
            return time_it(fn, _inner(time_it(fn, 1, 1, 1), budget), repeats)

        kernel_s = _kernel_seconds(dev, timed)
        mm_points, train_points, conv_points = _matmul_points(dev, quick, sizes, timed, kernel_s)
        peak = max(w / t for w, t in mm_points)
        rate, half = fit_matmul_curve(train_points)
        conv_rate, conv_half = fit_matmul_curve(conv_points)
        peak = max(peak, rate, conv_rate)
        bw_point = _bandwidth_point(dev, quick, timed)
        bandwidth = bw_point[0] / bw_point[1]
        att_flops, att_t = _attention_point(dev, quick, timed)
        attention_eff = min(1.0, max(1e-3, att_flops / att_t / peak))
        adam_point, adam_one = _adam_points(dev, BANDWIDTH_ELEMENTS[(dev.type, quick)] // 4, timed)
        passes = max(1.0, adam_point[1] * bandwidth / adam_point[0])
        opt_kernels = max(1.0, adam_one / kernel_s)
        vector_flops, vec_point, pool_flops, pool_point, scan_flops, scan_point = (None,) * 6
        if dev.type == "cpu":  # single-tensor Adam: its kernels per parameter tensor
            opt_kernels = max(1.0, _adam_per_tensor(timed, adam_one) / kernel_s)
            vec_point, pool_point, scan_point = _cpu_rate_points(quick, timed)
            vector_flops = vec_point[0] / vec_point[1]
            pool_flops = pool_point[0] / pool_point[1]
            scan_flops = scan_point[0] / scan_point[1]
    finally:
        torch.set_num_threads(old_threads)
    date = datetime.date.today().isoformat()
    nthreads = f", {threads or old_threads} threads, {clock_used} clock" if dev.type == "cpu" else ""
    model = DeviceModel(
        peak_flops=peak,
        bandwidth_Bps=bandwidth,
        kernel_s=kernel_s,
        matmul_eff=min(1.0, rate / peak),
        matmul_half_flops=half,
        conv_eff=min(1.0, conv_rate / peak),
        conv_half_flops=conv_half,
        attention_eff=attention_eff,
        optimizer_passes=passes,
        optimizer_kernels=opt_kernels,
        overlap=dev.type != "cpu",  # a CPU runs its own kernels: dispatch and work add up per op
        optimizer_per_tensor=dev.type == "cpu",  # CPU Adam is single-tensor (not foreach)
        vector_flops=vector_flops,
        pool_flops=pool_flops,
        scan_flops=scan_flops,
        source=f"profile: {device_name(dev)}{nthreads}, {date}, torch {torch.__version__}",
    )
    return DeviceModelProfile(
        model,
        tuple(mm_points),
        tuple(train_points),
        kernel_s,
        bw_point,
        (att_flops, att_t),
        adam_point,
        vec_point,
        pool_point,
        scan_point,
    )


# -------------------------------------------------------------------------------- the probes
# Each probe builds its tensors on the device and times them with ``timed(fn) -> seconds per call``.


def _device(device: str | None) -> Any:
    """The torch device to profile: ``device``, or CUDA when available, else the CPU."""
    import torch

    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:i]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
    return dev


def _kernel_seconds(dev: Any, timed: Callable[[Any], float]) -> float:
    """Seconds per kernel: a chain of 200 multiplications of one-element tensors, forward + backward (2
    kernels per op), so autograd's per-op cost is included as in the cost model's kernel counts."""
    import torch

    chain = 200
    x = torch.ones(1, device=dev, requires_grad=True)

    def tiny_chain() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.backward()

    return timed(tiny_chain) / (2 * chain)


_Points = list[tuple[float, float]]


def _matmul_points(
    dev: Any, quick: bool, sizes: Sequence[int] | None, timed: Callable[[Any], float], kernel_s: float
) -> tuple[_Points, _Points, _Points]:
    """(flops, seconds) of square ``mm`` / ``addmm`` calls (for the peak), and (forward flops, seconds / 3)
    of a Linear layer and of a 3x3 convolution in training (the matmul and conv efficiency curves)."""
    import torch

    from .. import rules

    def per_layer(make: Any, family: str) -> float:
        """Seconds per layer of a chain: deep minus shallow (one ``backward()`` call each, so its
        fixed cost cancels), less the layer's launches on a CPU (the cost model adds them apart)."""
        t = (timed(make(1 + _CHAIN)) - timed(make(1))) / _CHAIN
        launches = sum(FAMILY_KERNELS[family]) * kernel_s if dev.type == "cpu" else 0.0
        return max(t - launches, 0.1 * t, 1e-9)

    mm_points, train_points, conv_points = [], [], []
    for n in sizes or MATMUL_SIZES[(dev.type, quick)]:
        with torch.no_grad():
            a, b, c = (torch.randn(n, n, device=dev) for _ in range(3))
            bias = torch.randn(n, device=dev)
            mm_points.append((2.0 * n**3, timed(lambda a=a, b=b, c=c: torch.mm(a, b, out=c))))
            addmm = lambda a=a, b=b, c=c, bias=bias: torch.addmm(bias, a, b, out=c)  # noqa: E731
            mm_points.append((2.0 * n**3, timed(addmm)))
        for rows, out in ((4 * n, n), (4 * n, 4 * n)):  # tokens x hidden -> hidden, -> 4 hidden
            step = lambda depth, rows=rows, n=n, out=out: _linear_step(rows, n, out, dev, depth)  # noqa: E731
            w = rules.flops("aten.linear.default", [(rows, n), (out, n), (out,)], [(rows, out)])
            train_points.append((w, per_layer(step, "linear") / 3))
    for batch, channels, side in CONV_PROBES[(dev.type, quick)]:
        step = lambda depth, b=batch, c=channels, s=side: _conv_step(b, c, s, dev, depth)  # noqa: E731
        x_shape, w_shape = (batch, channels, side, side), (channels, channels, 3, 3)
        w = rules.flops("aten.conv2d.default", [x_shape, w_shape, (channels,)], [x_shape])
        conv_points.append((w, per_layer(step, "conv") / 3))
    return mm_points, train_points, conv_points


def _bandwidth_point(dev: Any, quick: bool, timed: Callable[[Any], float]) -> tuple[float, float]:
    """(bytes, seconds) of ``c = a + b`` on :data:`BANDWIDTH_ELEMENTS` floats (3 tensors move)."""
    import torch

    with torch.no_grad():
        n = BANDWIDTH_ELEMENTS[(dev.type, quick)]
        x, y, z = (torch.randn(n, device=dev) for _ in range(3))
        return (3.0 * 4 * n, timed(lambda: torch.add(x, y, out=z)))


def _attention_point(dev: Any, quick: bool, timed: Callable[[Any], float]) -> tuple[float, float]:
    """(training flops in the rules' units, seconds) of one ``scaled_dot_product_attention`` forward +
    backward."""
    import torch
    import torch.nn.functional as F

    from .. import rules

    shape = (2, 4, 64, 32) if quick else (4, 8, 128, 64)  # batch, heads, seq, head dim
    q, k, v = (torch.randn(shape, device=dev, requires_grad=True) for _ in range(3))

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    att_flops = 3.0 * rules.flops("aten.scaled_dot_product_attention.default", [shape] * 3, [shape])
    return att_flops, timed(attention)


def _adam_points(dev: Any, n: int, timed: Callable[[Any], float]) -> tuple[tuple[float, float], float]:
    """(parameter bytes, seconds) of an Adam step over one ``n``-element parameter, and the seconds of an
    Adam step over one one-element parameter."""
    import torch

    big = torch.nn.Parameter(torch.zeros(n, device=dev))
    big.grad = torch.randn_like(big)  # not zeros: Adam on zero gradients runs ~2x slower on a CPU
    opt = torch.optim.Adam([big], lr=1e-4)
    adam_big = timed(opt.step)
    one = torch.nn.Parameter(torch.zeros(1, device=dev))
    one.grad = torch.randn_like(one)
    opt1 = torch.optim.Adam([one], lr=1e-4)
    adam_one = timed(opt1.step)
    return (4.0 * big.numel(), adam_big), adam_one


def _adam_per_tensor(timed: Callable[[Any], float], adam_one: float) -> float:
    """CPU (single-tensor Adam): the extra seconds of a step per extra one-element parameter tensor, from
    steps over 33 tensors and over one (``adam_one``)."""
    import torch

    many = [torch.nn.Parameter(torch.zeros(1)) for _ in range(33)]
    for p in many:
        p.grad = torch.randn_like(p)
    return (timed(torch.optim.Adam(many, lr=1e-4).step) - adam_one) / 32


def _cpu_rate_points(
    quick: bool, timed: Callable[[Any], float]
) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
    """CPU: (training flops in the rules' units, seconds) of GELU + tanh on :data:`VECTOR_ELEMENTS`
    floats, of ``max_pool2d`` on :data:`POOL_SHAPE` and of ``logcumsumexp`` on :data:`SCAN_SHAPE`, each
    forward + backward."""
    import torch
    import torch.nn.functional as F

    from .. import rules

    v = torch.randn(VECTOR_ELEMENTS[quick], requires_grad=True)
    ones = torch.ones_like(v)

    def transcendental() -> None:
        v.grad = None
        F.gelu(v).backward(ones)
        torch.tanh(v).backward(ones)

    vec_point = (2 * 3.0 * 4 * v.numel(), timed(transcendental))  # the rules: 4 flops/element
    img = torch.randn(POOL_SHAPE[quick], requires_grad=True)

    def pool() -> None:
        img.grad = None
        F.max_pool2d(img, 2).sum().backward()

    pool_point = (3.0 * img.numel(), timed(pool))
    seq = torch.randn(SCAN_SHAPE[quick], requires_grad=True)
    seq_grad = torch.randn_like(seq)

    def scan() -> None:
        seq.grad = None
        torch.logcumsumexp(seq, 1).backward(seq_grad)

    scan_fwd = rules.flops("aten.logcumsumexp.default", [seq.shape], [seq.shape], (1,))
    scan_point = (3.0 * scan_fwd, timed(scan))
    return vec_point, pool_point, scan_point


def _linear_step(rows: int, inner: int, out: int, dev: Any, depth: int = 1) -> Any:
    """A chain of ``depth`` ``F.linear`` layers, forward + one backward as training runs them (addmm, two
    mm for the gradients, the bias-gradient sum; gradients reset to None first, as
    ``zero_grad(set_to_none=True)`` does); layers alternate ``inner -> out`` and ``out -> inner``, so
    each does the same flops."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(rows, inner, device=dev, requires_grad=True)
    dims = [(out, inner) if k % 2 == 0 else (inner, out) for k in range(depth)]
    ws = [torch.randn(o, i, device=dev, requires_grad=True) for o, i in dims]
    bs = [torch.randn(o, device=dev, requires_grad=True) for o, _ in dims]
    g = torch.randn(rows, dims[-1][0], device=dev)

    def step() -> None:
        x.grad = None
        h = x
        for w, b in zip(ws, bs):
            w.grad = b.grad = None
            h = F.linear(h, w, b)
        h.backward(g)

    return step


def _conv_step(batch: int, channels: int, side: int, dev: Any, depth: int = 1) -> Any:
    """A chain of ``depth`` 3x3 convolutions ``channels -> channels`` (padding 1, bias) on ``batch x
    channels x side x side``, forward + one backward (input, weight and bias gradients)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(batch, channels, side, side, device=dev, requires_grad=True)
    ws = [torch.randn(channels, channels, 3, 3, device=dev, requires_grad=True) for _ in range(depth)]
    bs = [torch.randn(channels, device=dev, requires_grad=True) for _ in range(depth)]
    g = torch.randn_like(x)

    def step() -> None:
        x.grad = None
        h = x
        for w, b in zip(ws, bs):
            w.grad = b.grad = None
            h = F.conv2d(h, w, b, padding=1)
        h.backward(g)

    return step
