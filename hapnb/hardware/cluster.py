"""Clusters: a :class:`Cluster` is a set of devices, how fast they compute, and how fast they
communicate (one :class:`~hapnb.hardware.parts.Collective` per kind); read from an inline spec, a preset
name or a cluster JSON, and written back as JSON. The values it is made of are in
:mod:`hapnb.hardware.parts`, the GPU kinds and default links in :mod:`hapnb.hardware.catalogue`.

>>> c = Cluster.parse("2xV100+6xP100")
>>> c.n, c.names[:3], c.machines
(8, ('v100-0', 'v100-1', 'p100-0'), ('m0', 'm1'))
>>> Cluster.preset("paper-hetero-64").virtual().n
8
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .catalogue import (
    CUSTOM_MEMORY,
    KINDS,
    NUMBER_RE,
    default_collectives,
    lookup_kind,
    spec_terms,
)
from .devices import device_model_or_none
from .parts import (
    COLLECTIVE_KINDS,
    Collective,
    Device,
    GiB,
    complete_collectives,
    nonempty_str,
    nonnegative_float,
    positive_float,
    positive_int,
)

__all__ = ["DITTO_RELATIVE_THROUGHPUT", "PRESETS", "Cluster"]

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
        nonempty_str(self.name, "cluster name")
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
            self, "intra_machine_Bps", positive_float(self.intra_machine_Bps, "intra_machine_Bps")
        )
        object.__setattr__(self, "dtype_bytes", positive_int(self.dtype_bytes, "dtype_bytes"))

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

    def edited(self, **changes: Any) -> Cluster:
        """A copy with ``changes`` (:meth:`replace`) named ``"<name> (edited)"`` (once)."""
        name = self.name if self.name.endswith("(edited)") else f"{self.name} (edited)"
        return self.replace(name=name, **changes)

    def with_device(
        self, name: str, *, flops: float | None = None, memory_bytes: float | None = None
    ) -> Cluster:
        """:meth:`edited` with device ``name``'s throughput (flop/s) or memory (bytes) changed; this
        cluster itself when neither changes (to 1e-9 relative).

        >>> c = Cluster.parse("2xV100").with_device("v100-1", flops=7e12)
        >>> c.name, c.devices[1].flops
        ('2xV100 (edited)', 7000000000000.0)
        """
        if name not in self.names:
            raise KeyError(f"no device {name!r} in cluster {self.name!r}; devices: {', '.join(self.names)}")
        j = self.names.index(name)
        d = self.devices[j]
        new = dataclasses.replace(
            d,
            flops=d.flops if flops is None or _close(flops, d.flops) else flops,
            memory_bytes=d.memory_bytes
            if memory_bytes is None or _close(memory_bytes, d.memory_bytes)
            else int(memory_bytes),
        )
        if new == d:
            return self
        return self.edited(devices=(*self.devices[:j], new, *self.devices[j + 1 :]))

    def with_collective(
        self, kind: str, *, bandwidth_Bps: float | None = None, latency_s: float | None = None
    ) -> Cluster:
        """:meth:`edited` with collective ``kind``'s bandwidth (bytes/s) or latency (s) changed; this
        cluster itself when neither changes."""
        colls = dict(self.collectives)
        if kind not in colls:
            raise KeyError(f"unknown collective {kind!r}; kinds: {', '.join(colls)}")
        old = colls[kind]
        bw = (
            old.bandwidth_Bps
            if bandwidth_Bps is None or _close(bandwidth_Bps, old.bandwidth_Bps)
            else bandwidth_Bps
        )
        lat = old.latency_s if latency_s is None or abs(latency_s - old.latency_s) <= 1e-12 else latency_s
        try:
            new = Collective(lat, bw)
        except ValueError as e:
            raise ValueError(f"collective {kind}: {e}") from None
        if new == old:
            return self
        colls[kind] = new
        return self.edited(collectives=colls)

    def changes_to(self, other: Cluster) -> tuple[str, ...]:
        """What differs in ``other``, one line each (``"v100-0: 15.7 -> 7.85 TFLOP/s"``).

        >>> Cluster.parse("2xV100").changes_to(Cluster.parse("2xV100").with_device("v100-0", flops=7e12))
        ('v100-0: 3.859 -> 7 TFLOP/s',)
        """
        a, b = self, other
        if a.names != b.names:
            return (f"devices {', '.join(a.names)} -> {', '.join(b.names)}",)
        out = []
        for x, y in zip(a.devices, b.devices):
            if x.flops != y.flops:
                out.append(f"{x.name}: {x.flops / 1e12:.4g} -> {y.flops / 1e12:.4g} TFLOP/s")
            if x.memory_bytes != y.memory_bytes:
                out.append(f"{x.name}: {x.memory_bytes / 2**30:.4g} -> {y.memory_bytes / 2**30:.4g} GiB")
        old = dict(a.collectives)
        for k, y in b.collectives:
            x = old.get(k)
            if x is None:
                out.append(f"{k}: new")
                continue
            if x.bandwidth_Bps != y.bandwidth_Bps:
                out.append(f"{k}: {x.bandwidth_Bps / 1e9:.4g} -> {y.bandwidth_Bps / 1e9:.4g} GB/s")
            if x.latency_s != y.latency_s:
                out.append(f"{k}: {x.latency_s * 1e6:.4g} -> {y.latency_s * 1e6:.4g} us latency")
        for attr, unit in (
            ("intra_machine_Bps", "B/s within a machine"),
            ("dtype_bytes", "bytes per element"),
        ):
            if getattr(a, attr) != getattr(b, attr):
                out.append(f"{getattr(a, attr):g} -> {getattr(b, attr):g} {unit}")
        return tuple(out)

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
        machines = spec_terms(spec)
        devices: list[Device] = []
        counters: dict[str, int] = {}
        for mi, (count, kind_text) in enumerate(machines):
            if NUMBER_RE.match(kind_text):
                flops = float(kind_text)
                if flops <= 0:
                    raise ValueError(
                        f"cluster spec {spec!r}: custom flops must be positive, got {kind_text!r}"
                    )
                kind, memory, model = "custom", CUSTOM_MEMORY, None
            else:
                try:
                    k = lookup_kind(kind_text)
                except ValueError as e:
                    raise ValueError(f"cluster spec {spec!r}: {e}") from None
                kind, flops, memory, model = k.name, k.flops, k.memory_bytes, k.model
            prefix = kind.lower()
            for _ in range(count):
                idx = counters.get(prefix, 0)
                counters[prefix] = idx + 1
                devices.append(Device(f"{prefix}-{idx}", kind, flops, memory, f"m{mi}", model=model))
        colls, intra = default_collectives(tuple(devices))
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
        name = check("name", nonempty_str, data["name"])
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
            dname = check(f"{where}.name", nonempty_str, rd["name"])
            if dname in seen:
                raise fail(f"{where}.name", f"duplicate device name {dname!r} (also devices[{seen[dname]}])")
            seen[dname] = i
            devices.append(
                Device(
                    name=dname,
                    kind=check(f"{where}.kind", nonempty_str, rd["kind"]),
                    flops=check(f"{where}.flops", positive_float, rd["flops"]),
                    memory_bytes=check(f"{where}.memory_bytes", positive_int, rd["memory_bytes"]),
                    machine=check(f"{where}.machine", nonempty_str, rd["machine"]),
                    gpus=check(f"{where}.gpus", positive_int, rd.get("gpus", 1)),
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
                "from the given ones: see hapnb.hardware.parts.DERIVED_COLLECTIVES)",
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
                check(f"{where}.latency_s", nonnegative_float, rc["latency_s"]),
                check(f"{where}.bandwidth_Bps", positive_float, rc["bandwidth_Bps"]),
            )
        intra = check("intra_machine_Bps", positive_float, data.get("intra_machine_Bps", 1e11))
        dtype_bytes = check("dtype_bytes", positive_int, data.get("dtype_bytes", 4))
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
        dataclasses.replace(d, flops=DITTO_RELATIVE_THROUGHPUT[d.kind] * KINDS["V100"].flops)
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


def _close(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) <= 1e-9 * max(abs(float(b)), 1e-300)
