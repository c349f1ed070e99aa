"""The roofline device model of one GPU kind (a value; :mod:`hapnb.cost` prices it, :mod:`hapnb.cluster`
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
    """Model of one GPU running eager PyTorch (fp32), priced by :mod:`hapnb.cost`.

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
    ``vector_flops`` (flop/s in the rules' units) prices the vector families of :mod:`hapnb.cost`
    (transcendental pointwise ops, pooling, losses, ops without a rule) as
    ``max(flops / vector_flops, bytes / bandwidth)`` instead of memory bound; ``pool_flops``, when set,
    replaces ``vector_flops`` for pooling (a CPU's max-pool with indices runs far below either).

    ``overlap_slowdown`` (Proteus' overlap factor γ, optional): a computation runs ``1 + γ`` times
    longer while a collective runs beside it; only :mod:`hapnb.simulation` reads it (``hapnb profile``
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

    def __post_init__(self) -> None:
        for flag in ("overlap", "optimizer_per_tensor"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"device model: {flag} must be true or false, got {getattr(self, flag)!r}")
        for rate in ("vector_flops", "pool_flops"):
            if getattr(self, rate) is not None:
                object.__setattr__(self, rate, _positive(getattr(self, rate), f"device model: {rate}"))
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

    def efficiency(self, kernel_flops: float) -> float:
        """Fraction of ``peak_flops`` a matmul-like kernel of ``kernel_flops`` flops reaches."""
        w = max(0.0, kernel_flops)
        return self.matmul_eff * w / (w + self.matmul_half_flops) if w > 0 else self.matmul_eff

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
_OPTIONAL = ("optimizer_per_tensor", "vector_flops", "pool_flops", "overlap_slowdown")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DeviceModel)}


def device_model_or_none(value: object, what: str = "model") -> DeviceModel | None:
    """Parse an optional ``model`` object of a cluster JSON device (None stays None)."""
    return None if value is None else DeviceModel.from_json(value, what)
