"""The hardware catalogue: the GPU kinds hapnb knows (effective throughput, memory, peak, link class,
and the shipped device model where one was fitted), the default collectives of a set of devices
(intra-machine links, the paper testbed's network), and the inline cluster spec's terms
(``2xV100+6xP100``, ``2x(8xA100)``).

>>> KINDS["V100"].memory_bytes // GiB, lookup_kind("a100-80g").name
(16, 'A100-80G')
>>> spec_terms("2xV100+1x(2xP100)")
[(2, 'V100'), (2, 'P100')]
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .devices import DeviceModel
from .parts import Collective, Device, GiB

__all__ = [
    "DEVICE_MODELS", "H100_MODEL", "KINDS", "TRAINING_EFFICIENCY", "DeviceKind", "lookup_kind",
    "default_collectives", "spec_terms", "NUMBER_RE", "CUSTOM_MEMORY",
]  # fmt: skip

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


H100_MODEL = DeviceModel(  # fit to hapnb/data/h100-lm-steps.json (docs/benchmarks/fidelity.md); others flops-only
    peak_flops=51.6e12,  # fp32 matmul rate measured on an H100 (docs/benchmarks/fidelity.md); datasheet SXM 67
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
    sm_count=132,  # H100 SXM5 datasheet; gemm_tile: cuBLAS's fp32 SGEMM tile, assumed (docs/benchmarks/fidelity.md)
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


def lookup_kind(text: str) -> DeviceKind:
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


def default_collectives(devices: tuple[Device, ...]) -> tuple[dict[str, Collective], float]:
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

NUMBER_RE = re.compile(r"^(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_GROUP_RE = re.compile(r"^(\d+)\s*[xX*]\s*\((.*)\)$")
_TERM_RE = re.compile(r"^(\d+)\s*[xX*]\s*(\S.*)$")
CUSTOM_MEMORY = 16 * GiB


def _parse_machine(term: str, spec: str) -> tuple[int, str]:
    """``'2xV100'`` -> (2, 'V100'); ``'V100'`` -> (1, 'V100')."""
    m = _TERM_RE.match(term)
    count, kind = (int(m.group(1)), m.group(2).strip()) if m else (1, term)
    if count < 1:
        raise ValueError(f"cluster spec {spec!r}: term {term!r} has {count} GPUs; a machine needs at least 1")
    return count, kind


def spec_terms(spec: str) -> list[tuple[int, str]]:
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
