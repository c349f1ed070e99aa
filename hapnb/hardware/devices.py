"""The roofline device model of one GPU kind (a value; :mod:`hapnb.cost.model` prices it, :mod:`hapnb.hardware.cluster`
holds the parameters of the known kinds)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceModel", "device_model_or_none"]


def _positive(value: object, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _nonnegative(value: object, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{what} must be a number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DeviceModel:
    """Model of one GPU running eager PyTorch (fp32), priced by :mod:`hapnb.cost.model`.

    Per op: a launch time ``kernels * kernel_s`` (the host's dispatch of its forward and backward
    kernels) and a GPU work time ``max(flops / (peak_flops * eff), bytes / bandwidth_Bps)`` with
    ``eff = matmul_eff * w / (w + matmul_half_flops)`` for matmul-like kernels of ``w`` flops,
    ``attention_eff`` for fused attention and 1 for the memory-bound rest. With ``overlap`` (a GPU: the
    host runs ahead of the device) a step costs the larger of the two sums (launch bound or GPU bound);
    without (a CPU runs its own kernels) their sum. Adam's step adds
    ``optimizer_kernels`` launches and ``optimizer_passes`` x the parameter bytes of memory traffic. Peak
    memory = ``(1 + memory_overhead) * modelled + memory_const_bytes``. ``source``: where the numbers
    come from (datasheet, profile, fit).

    CPU refinements, off by default (every datasheet and fitted GPU kind prices as without them):
    ``optimizer_per_tensor`` charges the ``optimizer_kernels`` launches once per local parameter tensor
    (single-tensor Adam, PyTorch's default on a CPU) instead of once per step (foreach Adam);
    ``vector_flops`` (flop/s in the rules' units) prices the vector families of :mod:`hapnb.cost.model`
    (transcendental pointwise ops, pooling, scans, losses, ops without a rule) as
    ``max(flops / vector_flops, bytes / bandwidth)`` instead of memory bound; ``pool_flops`` and
    ``scan_flops``, when set, replace ``vector_flops`` for pooling (a CPU's max-pool with indices runs far
    below either) and for transcendental scans (``logcumsumexp``: one scalar exp and log1p per element in
    sequence, no SIMD); :meth:`vector_rate` picks the rate. ``conv_eff`` and ``conv_half_flops`` (both or
    neither; None: convolutions on the matmul curve) give convolutions their own efficiency curve
    ``conv_eff * w / (w + conv_half_flops)`` (:meth:`efficiency`): ``hapnb profile`` measures it on 3x3
    conv chains, which on a CPU run well below a Linear layer of the same flops. ``sm_count`` and
    ``gemm_tile`` (both or neither; a GPU) add GEMM wave quantization (:meth:`gemm_wave_factor`): a GEMM's
    output tiles run in waves over the multiprocessors and a part-full last wave wastes the rest.

    ``overlap_slowdown`` (Proteus' overlap factor γ, optional): a computation runs ``1 + γ`` times
    longer while a collective runs beside it; only :mod:`hapnb.plans.simulation` reads it (``hapnb profile``
    measures it; None: the simulator's default)."""

    peak_flops: float
    bandwidth_Bps: float
    kernel_s: float
    matmul_eff: float
    matmul_half_flops: float
    attention_eff: float = 0.5
    optimizer_passes: float = 16.0
    optimizer_kernels: float = 12.0
    memory_overhead: float = 0.0
    memory_const_bytes: float = 0.0
    source: str = "datasheet"
    overlap: bool = True
    optimizer_per_tensor: bool = False
    vector_flops: float | None = None
    pool_flops: float | None = None
    overlap_slowdown: float | None = None
    scan_flops: float | None = None
    conv_eff: float | None = None
    conv_half_flops: float | None = None
    sm_count: int | None = None
    gemm_tile: int | None = None

    def __post_init__(self) -> None:
        for flag in ("overlap", "optimizer_per_tensor"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"device model: {flag} must be true or false, got {getattr(self, flag)!r}")
        for rate in ("vector_flops", "pool_flops", "scan_flops", "conv_eff"):
            if getattr(self, rate) is not None:
                object.__setattr__(self, rate, _positive(getattr(self, rate), f"device model: {rate}"))
        if (self.conv_eff is None) != (self.conv_half_flops is None):
            raise ValueError(
                "device model: conv_eff and conv_half_flops go together (the conv efficiency curve); "
                f"got conv_eff={self.conv_eff!r}, conv_half_flops={self.conv_half_flops!r}"
            )
        if self.conv_half_flops is not None:
            half = _nonnegative(self.conv_half_flops, "device model: conv_half_flops")
            object.__setattr__(self, "conv_half_flops", half)
        if (self.sm_count is None) != (self.gemm_tile is None):
            raise ValueError(
                "device model: sm_count and gemm_tile go together (GEMM wave quantization); "
                f"got sm_count={self.sm_count!r}, gemm_tile={self.gemm_tile!r}"
            )
        for count in ("sm_count", "gemm_tile"):
            v = getattr(self, count)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"device model: {count} must be a whole number >= 1, got {v!r}")
        if self.overlap_slowdown is not None:
            g = _nonnegative(self.overlap_slowdown, "device model: overlap_slowdown")
            object.__setattr__(self, "overlap_slowdown", g)
        for f in dataclasses.fields(self):
            if f.name in ("source", "overlap", *_OPTIONAL):
                continue
            pos = f.name in ("peak_flops", "bandwidth_Bps", "matmul_eff", "attention_eff")
            check = _positive if pos else _nonnegative
            object.__setattr__(self, f.name, check(getattr(self, f.name), f"device model: {f.name}"))
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"device model: source must be a non-empty string, got {self.source!r}")

    def efficiency(self, kernel_flops: float, family: str = "matmul") -> float:
        """Fraction of ``peak_flops`` a matmul-like kernel of ``kernel_flops`` flops reaches: the conv
        curve (``conv_eff``, ``conv_half_flops``) for a ``"conv"`` when the model has one, else the
        matmul curve.

        >>> m = DeviceModel(1e11, 1e10, 1e-6, 0.9, 1e6, conv_eff=0.6, conv_half_flops=3e6)
        >>> round(m.efficiency(1e6), 6), round(m.efficiency(3e6, "conv"), 6)
        (0.45, 0.3)
        """
        e, half = self.matmul_eff, self.matmul_half_flops
        if family == "conv" and self.conv_eff is not None and self.conv_half_flops is not None:
            e, half = self.conv_eff, self.conv_half_flops
        w = max(0.0, kernel_flops)
        return e * w / (w + half) if w > 0 else e

    def wave_efficiency(self, batch: float, rows: float, cols: float) -> float:
        """Fraction of the GPU's multiprocessors a GEMM with a ``rows x cols`` output (``batch`` of them in
        one launch) keeps busy: ``tiles / (waves * sm_count)`` with ``gemm_tile``-square output tiles,
        ``tiles = batch * ceil(rows / gemm_tile) * ceil(cols / gemm_tile)`` and ``waves = ceil(tiles /
        sm_count)``: the last wave runs part-full (wave quantization). 1 without ``sm_count``.

        >>> m = DeviceModel(5e13, 3e12, 7e-5, 0.9, 1e9, sm_count=132, gemm_tile=128)
        >>> round(m.wave_efficiency(1, 2048, 768), 4), m.wave_efficiency(1, 4096, 512)
        (0.7273, 0.9696969696969697)
        """
        if self.sm_count is None or self.gemm_tile is None:
            return 1.0
        t = self.gemm_tile
        tiles = max(1, math.ceil(batch)) * max(1, math.ceil(rows / t)) * max(1, math.ceil(cols / t))
        return tiles / (math.ceil(tiles / self.sm_count) * self.sm_count)

    def gemm_wave_factor(self, dims: tuple[float, float, float, float] | None) -> float:
        """How much of :meth:`efficiency` a matmul-like op (forward, input-gradient and weight-gradient
        GEMMs of equal flops) keeps on a GPU that runs GEMM tiles in waves: 3 over the sum over the three
        GEMMs of ``1 / wave_efficiency`` of their outputs, ``M x N`` forward and ``M x K`` input gradient,
        for ``dims = (batch, M, N, K)``; the weight gradient (output the weight's shape, a reduction over
        every row) counts 1: cuBLAS runs such long-reduction GEMMs split-K. 1 without ``sm_count`` or
        ``dims``.

        >>> m = DeviceModel(5e13, 3e12, 7e-5, 1.0, 0.0, sm_count=132, gemm_tile=128)
        >>> round(m.gemm_wave_factor((1, 2048, 768, 768)), 4), round(m.gemm_wave_factor((1, 4096, 512, 2048)), 4)
        (0.8, 0.9796)
        """
        if dims is None or self.sm_count is None:
            return 1.0
        b, rows, n, k = dims
        return 3.0 / (1 / self.wave_efficiency(b, rows, n) + 1 / self.wave_efficiency(b, rows, k) + 1.0)

    def vector_rate(self, family: str) -> float | None:
        """The flop rate of a vector-family op of ``family`` (``pool_flops`` for pooling, ``scan_flops``
        for scans, when set; else ``vector_flops``); None: no vector rate, the op is memory bound.

        >>> DeviceModel(1e11, 1e10, 1e-6, 0.9, 1e6, vector_flops=4e9, pool_flops=5e8).vector_rate("pool")
        500000000.0
        >>> DeviceModel(1e11, 1e10, 1e-6, 0.9, 1e6, vector_flops=4e9).vector_rate("scan")
        4000000000.0
        """
        own = {"pool": self.pool_flops, "scan": self.scan_flops}.get(family)
        return own if own is not None else self.vector_flops

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object; the CPU refinements only when set (older readers, same bytes)."""
        out = dataclasses.asdict(self)
        for name in _OPTIONAL:
            if out[name] == _DEFAULTS[name]:
                del out[name]
        return out

    @classmethod
    def from_json(cls, data: object, where: str = "model") -> DeviceModel:
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) - set(names):
            raise ValueError(
                f"{where}: expected an object with keys among {', '.join(names)}, got {data!r:.80}"
            )
        return cls(**data)

    def __str__(self) -> str:
        extra = f", vector {self.vector_flops / 1e9:.3g} GFLOP/s" if self.vector_flops else ""
        extra += f", pooling {self.pool_flops / 1e9:.3g} GFLOP/s" if self.pool_flops else ""
        extra += f", scan {self.scan_flops / 1e9:.3g} GFLOP/s" if self.scan_flops else ""
        if self.conv_eff is not None:
            extra += f", conv x {self.conv_eff:.3g} (half at {self.conv_half_flops:.3g} flops)"
        if self.sm_count is not None:
            extra += f", {self.sm_count} SMs, {self.gemm_tile}-square GEMM tiles"
        extra += ", Adam per tensor" if self.optimizer_per_tensor else ""
        extra += (
            f", overlap slowdown {self.overlap_slowdown:.3g}" if self.overlap_slowdown is not None else ""
        )
        return (
            f"{self.peak_flops / 1e12:.3g} TFLOP/s x {self.matmul_eff:.3g} (half at "
            f"{self.matmul_half_flops:.3g} flops), {self.bandwidth_Bps / 1e9:.4g} GB/s, "
            f"{self.kernel_s * 1e6:.3g} us/kernel{extra} [{self.source}]"
        )


#: Fields left out of :meth:`DeviceModel.to_json` at their defaults (JSON without them still loads).
_OPTIONAL = (
    "optimizer_per_tensor",
    "vector_flops",
    "pool_flops",
    "overlap_slowdown",
    "scan_flops",
    "conv_eff",
    "conv_half_flops",
    "sm_count",
    "gemm_tile",
)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DeviceModel)}


def device_model_or_none(value: object, what: str = "model") -> DeviceModel | None:
    """Parse an optional ``model`` object of a cluster JSON device (None stays None)."""
    return None if value is None else DeviceModel.from_json(value, what)
