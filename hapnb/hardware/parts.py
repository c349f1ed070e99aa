"""The hardware values: a :class:`Device` (one GPU, or a virtual device of several) and a
:class:`Collective` (the linear model of one collective kind), with the kinds every cluster describes and
how a kind missing from a description is derived from the ones given.

Units are bytes and seconds everywhere. A :class:`Device` has an *effective training throughput*
``flops`` in the cost model's own flop units (the same per-op formulas the cost model uses, divided by
measured fwd+bwd time; paper §3.2, hap-reference §3.2), so ``time = flops_of_stage / device.flops``.
A device with ``gpus > 1`` is a *virtual device*: one machine of ``gpus`` identical GPUs running data
parallelism inside (paper §3, §6).

A :class:`Collective` is the linear model ``launches * latency_s + nbytes / bandwidth_Bps``. How the
cost model picks ``nbytes`` for each collective kind (so bandwidths mean "bytes the slowest participant
moves per second" for that collective):

==================  ==========================================================================
kind                 call made by the cost model
==================  ==========================================================================
``all_gather``       padded all-gather: ``time(n * max_shard_bytes)``
``reduce_scatter``   padded reduce-scatter: ``time(n * max_shard_bytes)``
``broadcast``        grouped all-gather (n broadcasts): ``time(full_bytes, launches=n)``
``reduce``           grouped reduce-scatter (n reduces): ``time(full_bytes, launches=n)``
``all_reduce``       ``time(full_bytes)``
``all_to_all``       ``time(max over devices of the bytes one device sends or receives)``
==================  ==========================================================================

>>> Collective(latency_s=1e-5, bandwidth_Bps=1e9).time(1e9, launches=2)
1.00002
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .devices import DeviceModel

__all__ = [
    "COLLECTIVE_KINDS", "DERIVED_COLLECTIVES", "GiB", "Collective", "Device", "complete_collectives",
    "is_number", "positive_float", "nonnegative_float", "positive_int", "nonempty_str",
]  # fmt: skip


GiB = 1 << 30

#: The collective kinds every cluster describes (JSON keys of ``"collectives"``), sorted.
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "reduce_scatter",
)


# ----------------------------------------------------------------------------------------------------
# Validation helpers (the cluster JSON reader uses them too)


def is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def positive_float(value: object, what: str) -> float:
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def nonnegative_float(value: object, what: str) -> float:
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a non-negative finite number, got {value!r}")
    return float(value)


def positive_int(value: object, what: str) -> int:
    # JSON writers sometimes emit 17179869184.0; accept integral floats, reject 1.5, True, "4".
    if is_number(value) and math.isfinite(value) and float(value).is_integer() and value >= 1:
        return int(value)
    raise ValueError(f"{what} must be a positive integer, got {value!r}")


def nonempty_str(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class Device:
    """One device the program is sharded over: a GPU, or a virtual device (a machine of ``gpus`` GPUs).

    ``flops`` is the effective training throughput in the cost model's flop units (for a virtual device:
    the sum over its GPUs); ``memory_bytes`` likewise (sum for a virtual device).

    >>> d = Device("v100-0", "V100", 3.86e12, 16 * GiB, "m0")
    >>> str(d)
    'v100-0 (V100, 3.86 TFLOP/s, 16 GiB, m0)'
    """

    name: str
    kind: str
    flops: float
    memory_bytes: int
    machine: str
    gpus: int = 1
    model: DeviceModel | None = None  # None: flops-only (time = flops / self.flops)

    def __post_init__(self) -> None:
        who = f"device {self.name!r}"
        if self.model is not None and not isinstance(self.model, DeviceModel):
            raise ValueError(f"{who}: model must be a DeviceModel or None, got {self.model!r:.80}")
        nonempty_str(self.name, "device name")
        nonempty_str(self.kind, f"{who}: kind")
        nonempty_str(self.machine, f"{who}: machine")
        object.__setattr__(self, "flops", positive_float(self.flops, f"{who}: flops"))
        object.__setattr__(self, "memory_bytes", positive_int(self.memory_bytes, f"{who}: memory_bytes"))
        object.__setattr__(self, "gpus", positive_int(self.gpus, f"{who}: gpus"))

    @property
    def flops_per_gpu(self) -> float:
        """Throughput of one of its GPUs (``flops / gpus``)."""
        return self.flops / self.gpus

    def __str__(self) -> str:
        gpus = f", {self.gpus} GPUs" if self.gpus > 1 else ""
        return (
            f"{self.name} ({self.kind}{gpus}, {self.flops / 1e12:.3g} TFLOP/s, "
            f"{self.memory_bytes / GiB:.3g} GiB, {self.machine})"
        )


@dataclass(frozen=True)
class Collective:
    """Linear time model of one collective kind: ``launches * latency_s + nbytes / bandwidth_Bps``.

    >>> Collective(2e-5, 1e9).time(5e8)
    0.50002
    """

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", nonnegative_float(self.latency_s, "latency_s"))
        object.__setattr__(self, "bandwidth_Bps", positive_float(self.bandwidth_Bps, "bandwidth_Bps"))

    def time(self, nbytes: float, launches: int = 1) -> float:
        """Seconds to move ``nbytes`` (see the module docstring for what ``nbytes`` is per kind)."""
        if nbytes < 0 or launches < 0:
            raise ValueError(f"Collective.time needs nbytes >= 0 and launches >= 0, got {nbytes}, {launches}")
        return launches * self.latency_s + nbytes / self.bandwidth_Bps

    def __str__(self) -> str:
        return f"{self.latency_s * 1e6:.3g} us + bytes / {self.bandwidth_Bps / 1e9:.4g} GB/s"


#: How a collective kind missing from a cluster description is derived from the kinds given: the first
#: rule whose source kind is known wins, as ``(source, latency factor, bandwidth factor)``; rules are
#: applied until nothing changes, so one of all_gather / reduce_scatter / all_reduce is enough.
#: all_gather ⇄ reduce_scatter are duals (same bytes, same links); a ring all-reduce is a
#: reduce-scatter followed by an all-gather (twice the latency, half the bandwidth); all-to-all moves
#: about what an all-gather does; the grouped broadcast ⇄ grouped reduce are duals, and without them
#: each takes its padded counterpart's numbers.
DERIVED_COLLECTIVES: Mapping[str, tuple[tuple[str, float, float], ...]] = {
    "all_gather": (("reduce_scatter", 1.0, 1.0), ("all_reduce", 0.5, 2.0)),
    "reduce_scatter": (("all_gather", 1.0, 1.0), ("all_reduce", 0.5, 2.0)),
    "all_reduce": (("reduce_scatter", 2.0, 0.5), ("all_gather", 2.0, 0.5)),
    "all_to_all": (("all_gather", 1.0, 1.0), ("reduce_scatter", 1.0, 1.0)),
    "broadcast": (("reduce", 1.0, 1.0), ("all_gather", 1.0, 1.0)),
    "reduce": (("broadcast", 1.0, 1.0), ("reduce_scatter", 1.0, 1.0)),
}


def complete_collectives(given: Mapping[str, Collective]) -> dict[str, Collective]:
    """Every kind of :data:`COLLECTIVE_KINDS`: the ones given, the rest by :data:`DERIVED_COLLECTIVES`.

    >>> c = complete_collectives({"all_reduce": Collective(2e-5, 1e9)})
    >>> c["all_gather"].bandwidth_Bps, c["reduce"].latency_s
    (2000000000.0, 1e-05)
    """
    out = dict(given)
    changed = True
    while changed:
        changed = False
        for kind, rules in DERIVED_COLLECTIVES.items():
            if kind in out:
                continue
            for src, lat, bw in rules:
                if src in out:
                    out[kind] = Collective(out[src].latency_s * lat, out[src].bandwidth_Bps * bw)
                    changed = True
                    break
    missing = [k for k in COLLECTIVE_KINDS if k not in out]
    if missing:
        raise ValueError(
            f"missing collective kinds: {', '.join(missing)}: give at least one of all_gather, "
            "reduce_scatter or all_reduce (the others default from it; see DERIVED_COLLECTIVES)"
        )
    return out
