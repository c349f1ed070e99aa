"""Devices, collectives and clusters: what the cost model knows about the hardware.

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

>>> c = Cluster.parse("2xV100+6xP100")
>>> c.n, c.names[:3], c.machines
(8, ('v100-0', 'v100-1', 'p100-0'), ('m0', 'm1'))
>>> Cluster.preset("paper-hetero-64").virtual().n
8
>>> Collective(latency_s=1e-5, bandwidth_Bps=1e9).time(1e9, launches=2)
1.00002
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .devices import DeviceModel, device_model_or_none

__all__ = [
    "COLLECTIVE_KINDS",
    "DERIVED_COLLECTIVES",
    "complete_collectives",
    "DITTO_RELATIVE_THROUGHPUT",
    "KINDS",
    "PRESETS",
    "TRAINING_EFFICIENCY",
    "Cluster",
    "Collective",
    "Device",
    "DeviceKind",
    "DeviceModel",
    "DEVICE_MODELS",
    "GiB",
]

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
# Validation helpers


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _positive_float(value: object, what: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _nonnegative_float(value: object, what: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a non-negative finite number, got {value!r}")
    return float(value)


def _positive_int(value: object, what: str) -> int:
    # JSON writers sometimes emit 17179869184.0; accept integral floats, reject 1.5, True, "4".
    if _is_number(value) and math.isfinite(value) and float(value).is_integer() and value >= 1:
        return int(value)
    raise ValueError(f"{what} must be a positive integer, got {value!r}")


def _nonempty_str(value: object, what: str) -> str:
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
        _nonempty_str(self.name, "device name")
        _nonempty_str(self.kind, f"{who}: kind")
        _nonempty_str(self.machine, f"{who}: machine")
        object.__setattr__(self, "flops", _positive_float(self.flops, f"{who}: flops"))
        object.__setattr__(self, "memory_bytes", _positive_int(self.memory_bytes, f"{who}: memory_bytes"))
        object.__setattr__(self, "gpus", _positive_int(self.gpus, f"{who}: gpus"))

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
        object.__setattr__(self, "latency_s", _nonnegative_float(self.latency_s, "latency_s"))
        object.__setattr__(self, "bandwidth_Bps", _positive_float(self.bandwidth_Bps, "bandwidth_Bps"))

    def time(self, nbytes: float, launches: int = 1) -> float:
        """Seconds to move ``nbytes`` (see the module docstring for what ``nbytes`` is per kind)."""
        if nbytes < 0 or launches < 0:
            raise ValueError(f"Collective.time needs nbytes >= 0 and launches >= 0, got {nbytes}, {launches}")
        return launches * self.latency_s + nbytes / self.bandwidth_Bps

    def __str__(self) -> str:
        return f"{self.latency_s * 1e6:.3g} us + bytes / {self.bandwidth_Bps / 1e9:.4g} GB/s"


# ----------------------------------------------------------------------------------------------------
# Device kinds
#
# Effective throughput. V100 and P100 are HAP's profiled values (hap-reference §7, 2023-07-01 run):
# 3.858755112937e12 and 2.149250936815e12 "flops"/s, i.e. 3 x (sum of HAP's per-op formulas) divided by
# the measured time of one fwd+bwd+step. Every other kind is derived as
#     effective = peak * (V100 effective / V100 peak) = peak * 3.858755e12 / 15.7e12  (= 0.2458 * peak)
# i.e. we assume the same fraction of peak is reached in training as on the V100 (a rough but
# documented assumption; replace with a profiled cluster JSON for real work). Sanity check: the P100's
# profiled value is 0.231 x its 9.3 TFLOP/s PCIe peak, close to the V100's 0.246.
#
# Precision: default kinds use the *fp32* (non-tensor-core) peak, because the cost model's clusters are
# fp32 (dtype_bytes = 4) and PyTorch leaves TF32 off for matmuls by default
# (torch.backends.cuda.matmul.allow_tf32 = False since 1.12). Ampere and newer GPUs also get a "-TF32"
# kind using the dense (no sparsity) TF32 tensor-core peak, for users who enable TF32.
#
# Peak numbers (TFLOP/s, dense, NVIDIA datasheets; H100 measured on this project's H100 instead):
#   kind       fp32    tf32    memory  intra-machine link       notes
#   V100       15.7    -       16 GiB  NVLink (SXM2)            paper testbed's V100 machines have NVLink
#   P100        9.3    -       16 GiB  PCIe                     (SXM2 peak 10.6); testbed lists no NVLink
#   A100       19.5    156     40 GiB  NVLink (SXM4)
#   A100-80G   19.5    156     80 GiB  NVLink (SXM4; the PCIe card has the same peaks)
#   H100       51.6    406     80 GiB  NVLink4/NVSwitch         measured raw matmul rates here (bf16 788);
#                                                               datasheet SXM: fp32 67, tf32 494.7
#   T4          8.1    -       16 GiB  PCIe                     Turing: no TF32
#   A10        31.2    62.5    24 GiB  PCIe
#   RTX3090    35.6    35.6    24 GiB  PCIe                     GeForce: TF32 dense = fp32 rate
#   RTX4090    82.6    82.6    24 GiB  PCIe
#   A6000      38.7    77.4    48 GiB  PCIe                     RTX A6000
# GeForce/workstation fp32 peaks count dual-issue FP32, which training rarely reaches, so their
# derived values are optimistic.

_V100_EFFECTIVE = 3.858755112937e12
_P100_EFFECTIVE = 2.149250936815e12
_V100_PEAK_FP32 = 15.7e12
#: Fraction of fp32 peak reached in training on the V100 (HAP profile / datasheet).
TRAINING_EFFICIENCY = _V100_EFFECTIVE / _V100_PEAK_FP32


@dataclass(frozen=True)
class DeviceKind:
    """A known GPU model: effective flops, memory, its peak (TFLOP/s) and intra-machine link class."""

    name: str
    flops: float
    memory_bytes: int
    peak_tflops: float
    link: str  # "nvlink-h100" | "nvlink" | "pcie": default intra-machine collectives
    source: str
    model: DeviceModel | None = None  # the roofline model (None: flops-only, as the paper's HAP)


H100_MODEL = DeviceModel(  # fit to hapnb/data/h100-lm-steps.json (docs/fidelity.md); others flops-only
    peak_flops=51.6e12,  # fp32 matmul rate measured on an H100 (docs/fidelity.md); datasheet SXM 67
    bandwidth_Bps=2.8e12,  # ~0.84 x the 3.35 TB/s HBM3 datasheet figure (not fitted)
    kernel_s=7.052e-05,
    matmul_eff=1.0,  # the fit's bound: GEMMs at the measured peak, less their wave quantization
    matmul_half_flops=2.353e09,
    attention_eff=0.2203,
    optimizer_passes=16.0,  # foreach Adam's passes over the parameter bytes (not fitted)
    optimizer_kernels=5.627,
    memory_overhead=0.03949,  # refit when the saved-activation rules learned views and fused groups
    memory_const_bytes=7.079e07,
    source="fit to 12 measured H100 runs (hapnb/data/h100-lm-steps.json, hapnb calibrate --measured)",
    sm_count=132,  # H100 SXM5 datasheet; gemm_tile: cuBLAS's fp32 SGEMM tile, assumed (docs/fidelity.md)
    gemm_tile=128,
)
DEVICE_MODELS: Mapping[str, DeviceModel] = MappingProxyType({"H100": H100_MODEL})


def _derived(name: str, peak_tflops: float, mem_gib: int, link: str, source: str) -> DeviceKind:
    return DeviceKind(
        name, peak_tflops * 1e12 * TRAINING_EFFICIENCY, mem_gib * GiB, peak_tflops, link, source
    )


def _build_kinds() -> dict[str, DeviceKind]:
    kinds = [
        DeviceKind("V100", _V100_EFFECTIVE, 16 * GiB, 15.7, "nvlink", "HAP profile (hap-reference §7)"),
        DeviceKind("P100", _P100_EFFECTIVE, 16 * GiB, 9.3, "pcie", "HAP profile (hap-reference §7)"),
        _derived("T4", 8.1, 16, "pcie", "datasheet fp32 x V100 efficiency"),
    ]
    # (name, fp32 peak, tf32 dense peak, memory GiB, link, source)
    ampere_plus = [
        ("A100", 19.5, 156.0, 40, "nvlink", "datasheet"),
        ("A100-80G", 19.5, 156.0, 80, "nvlink", "datasheet"),
        ("H100", 51.6, 406.0, 80, "nvlink-h100", "measured matmul rate on this project's H100"),
        ("A10", 31.2, 62.5, 24, "pcie", "datasheet"),
        ("RTX3090", 35.6, 35.6, 24, "pcie", "datasheet"),
        ("RTX4090", 82.6, 82.6, 24, "pcie", "datasheet"),
        ("A6000", 38.7, 77.4, 48, "pcie", "datasheet"),
    ]
    for name, fp32, tf32, mem, link, src in ampere_plus:
        k = _derived(name, fp32, mem, link, f"{src} fp32 x V100 efficiency")
        kinds.append(dataclasses.replace(k, model=DEVICE_MODELS.get(name)))
        kinds.append(_derived(f"{name}-TF32", tf32, mem, link, f"{src} tf32 (dense) x V100 efficiency"))
    return {k.name: k for k in kinds}


#: Known device kinds by canonical name (only those with a :class:`DeviceModel` leave flops-only mode).
KINDS: Mapping[str, DeviceKind] = MappingProxyType(_build_kinds())


def _kind_key(text: str) -> str:
    return re.sub(r"[^0-9A-Z]", "", text.upper())


_KIND_ALIASES = {_kind_key(k): k for k in KINDS}
_KIND_ALIASES.update(
    {
        _kind_key("A100-40G"): "A100",
        _kind_key("A100-40GB"): "A100",
        _kind_key("A100-80GB"): "A100-80G",
        _kind_key("RTX-A6000"): "A6000",
        _kind_key("V100-16GB"): "V100",
        _kind_key("RTX3090-24GB"): "RTX3090",
        _kind_key("RTX4090-24GB"): "RTX4090",
    }
)


def _lookup_kind(text: str) -> DeviceKind:
    name = _KIND_ALIASES.get(_kind_key(text))
    if name is None:
        raise ValueError(
            f"unknown device kind {text!r}; known kinds: {', '.join(KINDS)} "
            f"(or give the effective flops/s directly, e.g. '2x5e12')"
        )
    return KINDS[name]


# ----------------------------------------------------------------------------------------------------
# Default collectives
#
# Network (between machines, ~10.4 Gbps Ethernet as in the paper's testbed, §7.1). Bandwidths come from
# HAP's 2023-07-01 heterogeneous profile (hap-reference §7: 8 machines, 29 GPUs), in bytes/s:
#   AG 815,418,707   AG grouped 549,828,906   AR 476,774,816   RS 876,490,907   RS grouped 512,358,434
#   A2A 7,504,501,871
# HAP's profiler divides a *volume* by the measured time, with volume = n * shard bytes for
# all-gather / reduce-scatter / all-to-all and the full tensor for all-reduce (hap-reference §2, §3.3).
# Conversion to our conventions:
# * all_gather, reduce_scatter: ours is time(n * max_shard_bytes), the same volume -> used as is.
#   (A ring all-gather makes each machine's NIC send ~(n-1)/n of that volume whatever the GPUs per
#   machine, so the figure is ~independent of n: 815 MB/s ~ 63 % of the 1.3 GB/s link.)
# * all_reduce: ours is time(full_bytes), the same volume -> used as is.
# * broadcast / reduce (grouped all-gather / reduce-scatter, n launches): ours is
#   time(full_bytes, launches=n); for HAP's even-shard measurement n * shard = full bytes, so the
#   grouped figures are used as is (broadcast <- AG grouped, reduce <- RS grouped).
# * all_to_all: ours is time(bytes one device sends), i.e. ~shard bytes, which is 1/n of HAP's volume.
#   With M machines of k GPUs, every machine's NIC carries k * shard * (M-1)/M bytes, so HAP's volume
#   rate is n * NIC * M / (k (M-1)) = NIC * M^2 / (M-1). Solving with M = 8 gives an effective NIC rate
#   of 7.5045e9 * 7/64 = 821 MB/s (agreeing with the all-gather's 815 MB/s), and our per-device
#   bandwidth for M machines with at most k GPUs each is NIC * M / ((M-1) * k); for the paper's
#   8 x (N/8) testbed that is exactly 7.5045e9 / N.
# Latencies: HAP has none (hap-reference §7). We use typical NCCL small-message times between nodes
# over TCP: 40 us for ring all-gather/reduce-scatter, 50 us for all-reduce and all-to-all, and 10 us per
# launch of the grouped broadcast/reduce (one NCCL group of n calls).

_HAP_AG = 815_418_707.0
_HAP_AG_GROUPED = 549_828_906.0
_HAP_AR = 476_774_816.0
_HAP_RS = 876_490_907.0
_HAP_RS_GROUPED = 512_358_434.0
_HAP_A2A = 7_504_501_871.0
_NIC_A2A_Bps = _HAP_A2A * 7 / 64  # effective NIC rate seen by all-to-all (see above)

# Intra-machine classes (one machine; bandwidths in our conventions, bytes/s). Round, conservative
# figures of NCCL on such machines (nccl-tests order of magnitude): NVLink4 + NVSwitch (H100 HGX: ~360
# GB/s all-gather bus bandwidth), NVLink 2/3 (DGX-1 V100 / DGX A100), PCIe 3/4 without NVLink.
# "intra" is the machine-internal all-reduce rate used for the data parallelism inside a virtual device.
_LINKS: dict[str, dict[str, float]] = {
    "nvlink-h100": dict(
        ag=350e9, rs=350e9, ar=200e9, a2a=300e9, bc=150e9, lat=15e-6, launch=5e-6, intra=2e11
    ),
    "nvlink": dict(ag=130e9, rs=130e9, ar=80e9, a2a=100e9, bc=60e9, lat=20e-6, launch=5e-6, intra=1e11),
    "pcie": dict(ag=12e9, rs=12e9, ar=6e9, a2a=10e9, bc=5e9, lat=25e-6, launch=8e-6, intra=1e10),
}
_LINK_ORDER = ("pcie", "nvlink", "nvlink-h100")  # slowest first


def _slowest_link(kinds: Iterable[DeviceKind | None]) -> str:
    links = [k.link if k is not None else "pcie" for k in kinds]
    return min(links, key=_LINK_ORDER.index) if links else "pcie"


def _intra_collectives(link: str) -> dict[str, Collective]:
    p = _LINKS[link]
    return {
        "all_gather": Collective(p["lat"], p["ag"]),
        "reduce_scatter": Collective(p["lat"], p["rs"]),
        "all_reduce": Collective(p["lat"], p["ar"]),
        "all_to_all": Collective(p["lat"], p["a2a"]),
        "broadcast": Collective(p["launch"], p["bc"]),
        "reduce": Collective(p["launch"], p["bc"]),
    }


def _network_collectives(machines: int, max_gpus_per_machine: int) -> dict[str, Collective]:
    """The ~10.4 Gbps network defaults (HAP's profile) for ``machines`` machines (>= 2)."""
    m, k = machines, max_gpus_per_machine
    return {
        "all_gather": Collective(40e-6, _HAP_AG),
        "reduce_scatter": Collective(40e-6, _HAP_RS),
        "all_reduce": Collective(50e-6, _HAP_AR),
        "all_to_all": Collective(50e-6, _NIC_A2A_Bps * m / ((m - 1) * k)),
        "broadcast": Collective(10e-6, _HAP_AG_GROUPED),
        "reduce": Collective(10e-6, _HAP_RS_GROUPED),
    }


def _default_collectives(devices: tuple[Device, ...]) -> tuple[dict[str, Collective], float]:
    """Collectives and intra-machine rate for a cluster, from its machines and device kinds."""
    per_machine: dict[str, int] = {}
    for d in devices:
        per_machine[d.machine] = per_machine.get(d.machine, 0) + 1
    kinds = [KINDS.get(d.kind) for d in devices]
    link = _slowest_link(kinds)
    if len(per_machine) == 1:
        colls = _intra_collectives(link)
    else:
        colls = _network_collectives(len(per_machine), max(per_machine.values()))
    return colls, _LINKS[link]["intra"]


# ----------------------------------------------------------------------------------------------------
# Inline specs

_NUMBER_RE = re.compile(r"^(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_GROUP_RE = re.compile(r"^(\d+)\s*[xX*]\s*\((.*)\)$")
_TERM_RE = re.compile(r"^(\d+)\s*[xX*]\s*(\S.*)$")
_CUSTOM_MEMORY = 16 * GiB


def _parse_machine(term: str, spec: str) -> tuple[int, str]:
    """``'2xV100'`` -> (2, 'V100'); ``'V100'`` -> (1, 'V100')."""
    m = _TERM_RE.match(term)
    count, kind = (int(m.group(1)), m.group(2).strip()) if m else (1, term)
    if count < 1:
        raise ValueError(f"cluster spec {spec!r}: term {term!r} has {count} GPUs; a machine needs at least 1")
    return count, kind


def _spec_terms(spec: str) -> list[tuple[int, str]]:
    """Split a spec into (gpus, kind-or-flops) per machine, expanding ``Mx(KxKIND)`` groups."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty cluster spec {spec!r}; write e.g. '2xV100+6xP100' or a preset name")
    machines: list[tuple[int, str]] = []
    for raw in spec.split("+"):
        term = raw.strip()
        if not term:
            raise ValueError(f"cluster spec {spec!r} has an empty term (two '+' in a row or a trailing '+')")
        group = _GROUP_RE.match(term)
        if group:
            repeat, inner = int(group.group(1)), group.group(2).strip()
            if repeat < 1:
                raise ValueError(f"cluster spec {spec!r}: {term!r} repeats a machine {repeat} times")
            if "(" in inner or ")" in inner or "+" in inner:
                raise ValueError(f"cluster spec {spec!r}: {term!r} must be Mx(KxKIND), e.g. 2x(8xV100)")
            machines.extend([_parse_machine(inner, spec)] * repeat)
        elif "(" in term or ")" in term:
            raise ValueError(
                f"cluster spec {spec!r}: cannot read {term!r}; write Mx(KxKIND), e.g. 2x(8xV100)"
            )
        else:
            machines.append(_parse_machine(term, spec))
    return machines


# ----------------------------------------------------------------------------------------------------
# Cluster


def _collectives_tuple(collectives: object) -> tuple[tuple[str, Collective], ...]:
    items = list(collectives.items()) if isinstance(collectives, Mapping) else list(collectives)  # type: ignore[arg-type]
    out: dict[str, Collective] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"collectives must map kind -> Collective, got entry {item!r}")
        kind, coll = item
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {', '.join(COLLECTIVE_KINDS)}")
        if not isinstance(coll, Collective):
            raise ValueError(f"collective {kind!r} must be a Collective, got {coll!r}")
        if kind in out:
            raise ValueError(f"collective {kind!r} given twice")
        out[kind] = coll
    return tuple(sorted(complete_collectives(out).items()))


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


_DEVICE_KEYS = ("name", "kind", "flops", "memory_bytes", "machine", "gpus", "model")


def _device_json(d: Device) -> dict[str, Any]:
    out = {k: getattr(d, k) for k in _DEVICE_KEYS[:-1]}
    if d.model is not None:
        out["model"] = d.model.to_json()
    return out


_TOP_KEYS = ("name", "dtype_bytes", "devices", "collectives", "intra_machine_Bps")


@dataclass(frozen=True)
class Cluster:
    """A set of devices, how fast they compute, and how fast they communicate.

    Build one with :meth:`parse` (``"2xV100+6xP100"``), :meth:`preset` (see :data:`PRESETS`),
    :meth:`load` (cluster JSON) or :meth:`resolve` (any of the three). ``collectives`` may be given as
    a mapping; it is stored as a tuple of ``(kind, Collective)`` sorted by kind.

    >>> c = Cluster.parse("2x5e12")
    >>> c.flops, c.collective("all_reduce").bandwidth_Bps > 1e9
    ((5000000000000.0, 5000000000000.0), True)
    """

    name: str
    devices: tuple[Device, ...]
    collectives: tuple[tuple[str, Collective], ...]
    intra_machine_Bps: float = 1e11
    dtype_bytes: int = 4

    def __post_init__(self) -> None:
        _nonempty_str(self.name, "cluster name")
        devices = tuple(self.devices)
        if not devices:
            raise ValueError(f"cluster {self.name!r} has no devices; it needs at least one")
        seen: dict[str, int] = {}
        for i, d in enumerate(devices):
            if not isinstance(d, Device):
                raise ValueError(f"cluster {self.name!r}: devices[{i}] is not a Device: {d!r}")
            if d.name in seen:
                raise ValueError(
                    f"cluster {self.name!r}: duplicate device name {d.name!r} "
                    f"(devices[{seen[d.name]}] and devices[{i}]); device names must be unique"
                )
            seen[d.name] = i
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "collectives", _collectives_tuple(self.collectives))
        object.__setattr__(
            self, "intra_machine_Bps", _positive_float(self.intra_machine_Bps, "intra_machine_Bps")
        )
        object.__setattr__(self, "dtype_bytes", _positive_int(self.dtype_bytes, "dtype_bytes"))

    # -- views ---------------------------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Number of devices (ranks of the SPMD program)."""
        return len(self.devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def flops(self) -> tuple[float, ...]:
        """Effective throughput per device, in device order."""
        return tuple(d.flops for d in self.devices)

    @property
    def memory_bytes(self) -> tuple[int, ...]:
        return tuple(d.memory_bytes for d in self.devices)

    @property
    def total_flops(self) -> float:
        return math.fsum(self.flops)

    @property
    def gpus(self) -> int:
        """Physical GPUs (a virtual device counts its ``gpus``)."""
        return sum(d.gpus for d in self.devices)

    @property
    def machines(self) -> tuple[str, ...]:
        """Machine names in order of first appearance."""
        return tuple(dict.fromkeys(d.machine for d in self.devices))

    def devices_on(self, machine: str) -> tuple[Device, ...]:
        """The devices of one machine (empty if unknown)."""
        return tuple(d for d in self.devices if d.machine == machine)

    def index(self, name: str) -> int:
        """Rank of the device called ``name``."""
        for i, d in enumerate(self.devices):
            if d.name == name:
                return i
        raise KeyError(f"no device {name!r} in cluster {self.name!r}; devices: {', '.join(self.names)}")

    def collective(self, kind: str) -> Collective:
        """The time model of one collective kind (see :data:`COLLECTIVE_KINDS`)."""
        for k, c in self.collectives:
            if k == kind:
                return c
        raise KeyError(f"unknown collective kind {kind!r}; valid kinds: {', '.join(COLLECTIVE_KINDS)}")

    # -- derived clusters ------------------------------------------------------------------------------

    def replace(self, **changes: Any) -> Cluster:
        """A copy with some fields changed (``dataclasses.replace`` with validation)."""
        return dataclasses.replace(self, **changes)

    def with_collectives(
        self, collectives: Mapping[str, Collective] | None = None, **kinds: Collective
    ) -> Cluster:
        """A copy with some collectives replaced.

        >>> c = Cluster.parse("2xV100").with_collectives(all_reduce=Collective(0, 1e9))
        >>> c.collective("all_reduce").time(1e9)
        1.0
        """
        merged = dict(self.collectives)
        merged.update(collectives or {})
        merged.update(kinds)
        return self.replace(collectives=merged)

    def virtual(self) -> Cluster:
        """Group each machine's devices into one virtual device (paper §3: data parallel inside).

        The virtual device is named after its machine, has ``gpus`` = the machine's GPUs and the sum of
        their flops and memory; its kind is the common kind (or ``"mixed"``). Collectives stay the same
        except ``all_to_all``: its per-device bandwidth is multiplied by the largest number of devices
        merged into one, since one virtual device now sends what that many devices sent through the same
        network link (the all-gather/reduce-scatter/all-reduce conventions already use whole-cluster
        volumes and need no change).

        >>> v = Cluster.preset("paper-hetero-16").virtual()
        >>> v.n, v.devices[0].name, v.devices[0].gpus
        (8, 'm0', 2)
        """
        groups: dict[str, list[Device]] = {}
        for d in self.devices:
            groups.setdefault(d.machine, []).append(d)
        devices = []
        for machine, ds in groups.items():
            kinds = {d.kind for d in ds}
            devices.append(
                Device(
                    name=machine,
                    kind=kinds.pop() if len(kinds) == 1 else "mixed",
                    flops=math.fsum(d.flops for d in ds),
                    memory_bytes=sum(d.memory_bytes for d in ds),
                    machine=machine,
                    gpus=sum(d.gpus for d in ds),
                    model=ds[0].model if len({d.model for d in ds}) == 1 else None,
                )
            )
        merge = max(len(ds) for ds in groups.values())
        colls = dict(self.collectives)
        a2a = colls["all_to_all"]
        colls["all_to_all"] = Collective(a2a.latency_s, a2a.bandwidth_Bps * merge)
        name = self.name if merge == 1 else f"{self.name}/virtual"
        return self.replace(name=name, devices=tuple(devices), collectives=colls)

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def parse(cls, spec: str, name: str | None = None) -> Cluster:
        """Build a cluster from an inline spec.

        Terms joined by ``+``; each term is one machine: ``KxKIND`` (K GPUs of a known kind, see
        :data:`KINDS`), ``KIND`` (one GPU), ``KxFLOPS`` (K custom devices with that effective flops/s,
        e.g. ``2x5e12``), or ``Mx(KxKIND)`` for M such machines. Devices are named lowercase kind + a
        running index (``v100-0``, ``p100-0``...), machines ``m0``, ``m1``... One machine gets
        intra-machine (NVLink/PCIe-class, by kind) collectives; several get the ~10.4 Gbps network ones.

        >>> Cluster.parse("2x(2xV100)+RTX3090").names
        ('v100-0', 'v100-1', 'v100-2', 'v100-3', 'rtx3090-0')
        """
        machines = _spec_terms(spec)
        devices: list[Device] = []
        counters: dict[str, int] = {}
        for mi, (count, kind_text) in enumerate(machines):
            if _NUMBER_RE.match(kind_text):
                flops = float(kind_text)
                if flops <= 0:
                    raise ValueError(
                        f"cluster spec {spec!r}: custom flops must be positive, got {kind_text!r}"
                    )
                kind, memory, model = "custom", _CUSTOM_MEMORY, None
            else:
                try:
                    k = _lookup_kind(kind_text)
                except ValueError as e:
                    raise ValueError(f"cluster spec {spec!r}: {e}") from None
                kind, flops, memory, model = k.name, k.flops, k.memory_bytes, k.model
            prefix = kind.lower()
            for _ in range(count):
                idx = counters.get(prefix, 0)
                counters[prefix] = idx + 1
                devices.append(Device(f"{prefix}-{idx}", kind, flops, memory, f"m{mi}", model=model))
        colls, intra = _default_collectives(tuple(devices))
        return cls(name or spec.strip(), tuple(devices), colls, intra_machine_Bps=intra)

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A named cluster from :data:`PRESETS`."""
        builder = _PRESET_BUILDERS.get(name)
        if builder is None:
            raise ValueError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)}")
        return builder()

    @classmethod
    def resolve(cls, spec: str | os.PathLike[str] | Cluster) -> Cluster:
        """A preset name, a path to a cluster JSON, or an inline spec (a Cluster is returned as is).

        >>> Cluster.resolve("paper-hetero-8").n, Cluster.resolve("4xA100").n
        (8, 4)
        """
        if isinstance(spec, Cluster):
            return spec
        if isinstance(spec, os.PathLike):
            return cls.load(spec)
        if not isinstance(spec, str):
            raise TypeError(f"cluster spec must be a str, path or Cluster, got {type(spec).__name__}")
        text = spec.strip()
        if text in _PRESET_BUILDERS:
            return cls.preset(text)
        path = Path(text).expanduser()
        if text.lower().endswith(".json") or path.is_file():
            if not path.is_file():
                raise ValueError(f"cluster file {text!r} does not exist")
            return cls.load(path)
        try:
            return cls.parse(text)
        except ValueError as e:
            raise ValueError(
                f"cannot read cluster {spec!r}: it is not a preset ({', '.join(PRESETS)}), not a JSON "
                f"file, and not an inline spec like '2xV100+6xP100': {e}"
            ) from None

    # -- JSON ----------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The cluster JSON object (docs/architecture.md §4)."""
        return {
            "name": self.name,
            "dtype_bytes": self.dtype_bytes,
            "devices": [_device_json(d) for d in self.devices],
            "collectives": {
                k: {"latency_s": c.latency_s, "bandwidth_Bps": c.bandwidth_Bps} for k, c in self.collectives
            },
            "intra_machine_Bps": self.intra_machine_Bps,
        }

    @classmethod
    def from_json(cls, data: object, source: str = "<cluster JSON>") -> Cluster:
        """Build from a parsed cluster JSON object; errors name the field and ``source``."""

        def fail(field: str, why: str) -> ValueError:
            return ValueError(f"{source}: {field}: {why}")

        def check(field: str, fn: Any, value: object) -> Any:
            try:
                return fn(value, field)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None

        if not isinstance(data, dict):
            raise fail("top level", f"expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_TOP_KEYS))
        if unknown:
            raise fail(", ".join(unknown), f"unknown key(s); allowed keys: {', '.join(_TOP_KEYS)}")
        for key in ("name", "devices", "collectives"):
            if key not in data:
                raise fail(key, "missing (required keys: name, devices, collectives)")
        name = check("name", _nonempty_str, data["name"])
        raw_devices = data["devices"]
        if not isinstance(raw_devices, list) or not raw_devices:
            raise fail("devices", f"must be a non-empty list of device objects, got {raw_devices!r:.80}")
        devices = []
        seen: dict[str, int] = {}
        for i, rd in enumerate(raw_devices):
            where = f"devices[{i}]"
            if not isinstance(rd, dict):
                raise fail(where, f"must be an object, got {rd!r:.80}")
            unknown = sorted(set(rd) - set(_DEVICE_KEYS))
            if unknown:
                raise fail(f"{where}.{unknown[0]}", f"unknown key; allowed keys: {', '.join(_DEVICE_KEYS)}")
            for key in _DEVICE_KEYS[:-2]:
                if key not in rd:
                    raise fail(f"{where}.{key}", "missing")
            dname = check(f"{where}.name", _nonempty_str, rd["name"])
            if dname in seen:
                raise fail(f"{where}.name", f"duplicate device name {dname!r} (also devices[{seen[dname]}])")
            seen[dname] = i
            devices.append(
                Device(
                    name=dname,
                    kind=check(f"{where}.kind", _nonempty_str, rd["kind"]),
                    flops=check(f"{where}.flops", _positive_float, rd["flops"]),
                    memory_bytes=check(f"{where}.memory_bytes", _positive_int, rd["memory_bytes"]),
                    machine=check(f"{where}.machine", _nonempty_str, rd["machine"]),
                    gpus=check(f"{where}.gpus", _positive_int, rd.get("gpus", 1)),
                    model=check(f"{where}.model", device_model_or_none, rd.get("model")),
                )
            )
        raw_colls = data["collectives"]
        if not isinstance(raw_colls, dict):
            raise fail("collectives", "must be an object mapping kind -> {latency_s, bandwidth_Bps}")
        colls = {}
        if not any(k in raw_colls for k in ("all_gather", "reduce_scatter", "all_reduce")):
            raise fail(
                "collectives",
                "needs at least one of all_gather, reduce_scatter, all_reduce (missing kinds default "
                "from the given ones: see hapnb.hardware.cluster.DERIVED_COLLECTIVES)",
            )
        for kind, rc in raw_colls.items():
            where = f"collectives.{kind}"
            if kind not in COLLECTIVE_KINDS:
                raise fail(where, f"unknown collective kind; valid kinds: {', '.join(COLLECTIVE_KINDS)}")
            if not isinstance(rc, dict):
                raise fail(where, "must be an object {latency_s, bandwidth_Bps}")
            extra = sorted(set(rc) - {"latency_s", "bandwidth_Bps"})
            if extra:
                raise fail(f"{where}.{extra[0]}", "unknown key; allowed keys: latency_s, bandwidth_Bps")
            for key in ("latency_s", "bandwidth_Bps"):
                if key not in rc:
                    raise fail(f"{where}.{key}", "missing")
            colls[kind] = Collective(
                check(f"{where}.latency_s", _nonnegative_float, rc["latency_s"]),
                check(f"{where}.bandwidth_Bps", _positive_float, rc["bandwidth_Bps"]),
            )
        intra = check("intra_machine_Bps", _positive_float, data.get("intra_machine_Bps", 1e11))
        dtype_bytes = check("dtype_bytes", _positive_int, data.get("dtype_bytes", 4))
        return cls(name, tuple(devices), colls, intra_machine_Bps=intra, dtype_bytes=dtype_bytes)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the cluster JSON to ``path`` (returns the path)."""
        p = Path(path)
        p.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster JSON file (plain JSON only; nothing in it is executed)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"cluster file {str(p)!r} does not exist") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        return cls.from_json(data, source=str(p))

    # -- display -------------------------------------------------------------------------------------

    def _kind_summary(self) -> str:
        counts: dict[str, int] = {}
        for d in self.devices:
            label = d.kind if d.gpus == 1 else f"({d.gpus}x{d.kind})"
            counts[label] = counts.get(label, 0) + 1
        return ", ".join(f"{c}x{k}" for k, c in counts.items())

    def _model_summary(self) -> str:
        models = {d.kind: d.model for d in self.devices if d.model is not None}
        return "".join(f"; {k} device model: {m}" for k, m in models.items())

    def __str__(self) -> str:
        machines = len(self.machines)
        return (
            f"Cluster {self.name!r}: {self.n} device{'s' * (self.n != 1)} ({self._kind_summary()}) on "
            f"{machines} machine{'s' * (machines != 1)}, {self.total_flops / 1e12:.4g} TFLOP/s effective, "
            f"all_reduce {self.collective('all_reduce').bandwidth_Bps / 1e9:.3g} GB/s{self._model_summary()}"
        )

    def _repr_html_(self) -> str:
        esc = html.escape
        style = "border-collapse:collapse;font-family:monospace;font-size:12px"
        cell = "style='border:1px solid #ccc;padding:2px 6px;text-align:right'"
        head = "style='border:1px solid #ccc;padding:2px 6px;background:#f4f4f4'"
        rows = "".join(
            f"<tr><td {cell}>{i}</td><td {cell}>{esc(d.name)}</td><td {cell}>{esc(d.kind)}</td>"
            f"<td {cell}>{d.gpus}</td><td {cell}>{d.flops / 1e12:.3f}</td>"
            f"<td {cell}>{d.memory_bytes / GiB:.3g}</td><td {cell}>{esc(d.machine)}</td></tr>"
            for i, d in enumerate(self.devices)
        )
        devices = (
            f"<table style='{style}'><tr>"
            + "".join(
                f"<th {head}>{h}</th>"
                for h in ("rank", "device", "kind", "GPUs", "TFLOP/s", "GiB", "machine")
            )
            + f"</tr>{rows}</table>"
        )
        crow = "".join(
            f"<tr><td {cell}>{esc(k)}</td><td {cell}>{c.latency_s * 1e6:.3g}</td>"
            f"<td {cell}>{c.bandwidth_Bps / 1e9:.4g}</td></tr>"
            for k, c in self.collectives
        )
        colls = (
            f"<table style='{style}'><tr><th {head}>collective</th><th {head}>latency (us)</th>"
            f"<th {head}>bandwidth (GB/s)</th></tr>{crow}</table>"
        )
        return (
            f"<div><b>Cluster {esc(self.name)}</b> &mdash; {self.n} devices on {len(self.machines)} "
            f"machines, {self.total_flops / 1e12:.4g} TFLOP/s effective, intra-machine "
            f"{self.intra_machine_Bps / 1e9:.3g} GB/s, {self.dtype_bytes}-byte elements{esc(self._model_summary())}"
            "<div style='display:flex;gap:16px;align-items:flex-start;margin-top:4px'>"
            f"{devices}{colls}</div></div>"
        )


# ----------------------------------------------------------------------------------------------------
# Presets


def _paper_hetero(n: int) -> Cluster:
    # Paper §7.1: 8 machines, 2 with 8 V100 (NVLink) and 6 with 8 P100, ~10.4 Gbps between machines;
    # the N-GPU experiments use N/8 GPUs per machine.
    k = n // 8
    return Cluster.parse(f"2x({k}xV100)+6x({k}xP100)", name=f"paper-hetero-{n}")


def _ditto(ex: int) -> Cluster:
    # Ditto (Zhu et al., README's References), §7.1 "Experimental Setup" and Figure 8: five heterogeneous
    # clusters of nodes x GPUs per node. Flops use Ditto's own "relative throughput on gpt2xl" column (from
    # Lambda GPU benchmarks) times the V100's effective flops, so the clusters reproduce Ditto's planner
    # inputs (not our fp32 kind table); memory comes from the kind table. Network: the ~10.4 Gbps defaults.
    mixes = {
        1: [("V100", 2, 2), ("RTX3090", 2, 2)],
        2: [("V100", 2, 2), ("RTX3090", 2, 2), ("A6000", 2, 2)],
        3: [("V100", 4, 2), ("RTX3090", 3, 2), ("A6000", 2, 2), ("RTX4090", 2, 2)],
        4: [("V100", 2, 4), ("RTX3090", 2, 4), ("A6000", 2, 4)],
        5: [("V100", 4, 2), ("RTX3090", 4, 2), ("A100-80G", 2, 2)],
    }[ex]
    spec = "+".join(f"{nodes}x({gpus}x{kind})" for kind, nodes, gpus in mixes)
    base = Cluster.parse(spec, name=f"ditto-ex{ex}")
    devices = tuple(
        dataclasses.replace(d, flops=DITTO_RELATIVE_THROUGHPUT[d.kind] * _V100_EFFECTIVE)
        for d in base.devices
    )
    return base.replace(devices=devices)


#: Ditto Figure 8, "Relative Throughput on gpt2xl" (V100 = 1).
DITTO_RELATIVE_THROUGHPUT: Mapping[str, float] = MappingProxyType(
    {"V100": 1.0, "RTX3090": 2.0, "A6000": 2.95, "RTX4090": 3.8, "A100-80G": 5.99}
)


def _h100x8() -> Cluster:
    return Cluster.parse("8xH100", name="h100x8")


_PRESET_BUILDERS = {
    **{f"paper-hetero-{n}": (lambda n=n: _paper_hetero(n)) for n in (8, 16, 32, 64)},
    "paper-homo-32": lambda: Cluster.parse("4x(8xP100)", name="paper-homo-32"),
    # Paper §2.4 / §7.6 case study: one machine with 2 A100, one with 2 P100.
    "a100-p100": lambda: Cluster.parse("2xA100+2xP100", name="a100-p100"),
    **{f"ditto-ex{i}": (lambda i=i: _ditto(i)) for i in range(1, 6)},
    "h100": lambda: Cluster.parse("H100", name="h100"),
    "h100x8": _h100x8,
}

#: Preset names and what they are.
PRESETS: Mapping[str, str] = MappingProxyType(
    {
        **{
            f"paper-hetero-{n}": f"HAP testbed (§7.1): 8 machines x {n // 8} GPUs, 2 V100 + 6 P100 machines, "
            "~10.4 Gbps network"
            for n in (8, 16, 32, 64)
        },
        "paper-homo-32": "HAP homogeneous runs (§7.3): 4 machines x 8 P100",
        "a100-p100": "HAP case study (§2.4, §7.6): one machine with 2 A100, one with 2 P100",
        **{f"ditto-ex{i}": f"Ditto experiment Ex{i} (§7.1, Fig. 8)" for i in range(1, 6)},
        "h100": "one H100",
        "h100x8": "one machine of 8 H100 (NVLink4/NVSwitch)",
    }
)
