"""Tests for hapnb.hardware.cluster: devices, collectives, inline specs, presets, JSON, virtual devices."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from hapnb.hardware.catalogue import KINDS, TRAINING_EFFICIENCY
from hapnb.hardware.cluster import DITTO_RELATIVE_THROUGHPUT, PRESETS, Cluster
from hapnb.hardware.parts import COLLECTIVE_KINDS, Collective, Device, GiB

V100 = 3.858755112937e12
P100 = 2.149250936815e12


def kinds_of(c: Cluster) -> Counter:
    return Counter(d.kind for d in c.devices)


# ---------------------------------------------------------------------------------------------------
# Collective and Device


def test_collective_time_is_launches_times_latency_plus_bytes_over_bandwidth():
    c = Collective(latency_s=2e-5, bandwidth_Bps=5e8)
    assert c.time(1e9) == pytest.approx(2e-5 + 2.0, rel=1e-15)
    assert c.time(1e9, launches=3) == pytest.approx(3 * 2e-5 + 2.0, rel=1e-15)
    assert c.time(0, launches=4) == pytest.approx(8e-5)
    assert c.time(0, launches=0) == 0.0
    assert Collective(0, 1e9).time(5e8) == 0.5


@pytest.mark.parametrize("lat,bw", [(-1e-6, 1e9), (1e-6, 0), (1e-6, -5.0), (math.nan, 1e9), (0, math.inf)])
def test_collective_rejects_bad_parameters(lat, bw):
    with pytest.raises(ValueError, match="latency_s|bandwidth_Bps"):
        Collective(lat, bw)


def test_collective_time_rejects_negative_bytes():
    with pytest.raises(ValueError, match="nbytes"):
        Collective(0, 1e9).time(-1)


def test_device_validation_and_coercion():
    d = Device("g", "V100", 5, 16 * GiB, "m0")
    assert isinstance(d.flops, float) and d.flops == 5.0 and d.gpus == 1
    assert Device("g", "V100", 1e12, 16.0 * GiB, "m0").memory_bytes == 16 * GiB
    for bad in (dict(flops=0), dict(flops=-1.0), dict(flops=True), dict(memory_bytes=1.5), dict(gpus=0)):
        kw = dict(name="g", kind="V100", flops=1e12, memory_bytes=GiB, machine="m0") | bad
        with pytest.raises(ValueError, match="device 'g'"):
            Device(**kw)
    with pytest.raises(ValueError, match="name"):
        Device("", "V100", 1e12, GiB, "m0")


# ---------------------------------------------------------------------------------------------------
# Device kinds


def test_kind_table_profiled_and_derived_values():
    assert KINDS["V100"].flops == V100 and KINDS["P100"].flops == P100
    assert TRAINING_EFFICIENCY == pytest.approx(V100 / 15.7e12)
    # derived kinds: peak x the V100's effective/peak ratio
    for name, peak in [("A100", 19.5), ("H100", 51.6), ("H100-TF32", 406), ("T4", 8.1), ("A6000", 38.7)]:
        assert KINDS[name].flops == pytest.approx(peak * 1e12 * V100 / 15.7e12, rel=1e-12)
    expected_gib = {"V100": 16, "P100": 16, "A100": 40, "A100-80G": 80, "H100": 80, "T4": 16, "A10": 24}
    expected_gib |= {"RTX3090": 24, "RTX4090": 24, "A6000": 48}
    for name, gib in expected_gib.items():
        assert KINDS[name].memory_bytes == gib * GiB, name


# ---------------------------------------------------------------------------------------------------
# Inline specs


def test_parse_two_machines():
    c = Cluster.parse("2xV100+6xP100")
    assert c.n == 8 and c.name == "2xV100+6xP100"
    assert c.names == ("v100-0", "v100-1", "p100-0", "p100-1", "p100-2", "p100-3", "p100-4", "p100-5")
    assert [d.machine for d in c.devices] == ["m0"] * 2 + ["m1"] * 6
    assert c.machines == ("m0", "m1")
    assert c.flops == (V100,) * 2 + (P100,) * 6
    assert all(d.memory_bytes == 16 * GiB and d.gpus == 1 for d in c.devices)
    assert c.total_flops == pytest.approx(2 * V100 + 6 * P100)


def test_parse_single_kind_terms_and_case():
    c = Cluster.parse("V100+P100")
    assert c.names == ("v100-0", "p100-0") and c.machines == ("m0", "m1")
    assert Cluster.parse("v100 + 2X p100").names == ("v100-0", "p100-0", "p100-1")
    assert Cluster.parse("2xa100-80gb").devices[0].kind == "A100-80G"
    assert Cluster.parse("RTX3090").names == ("rtx3090-0",)
    assert Cluster.parse("2xRTX3090").n == 2  # the 'X' inside the kind is not a separator


def test_parse_single_machine_uses_intra_machine_collectives():
    one = Cluster.parse("4xA100")
    two = Cluster.parse("2xA100+2xA100")
    assert one.machines == ("m0",) and two.machines == ("m0", "m1")
    # NVLink-class inside a machine is orders of magnitude faster than the ~10 Gbps network
    for kind in COLLECTIVE_KINDS:
        assert one.collective(kind).bandwidth_Bps > 10 * two.collective(kind).bandwidth_Bps, kind
    # and a PCIe-only machine is slower than an NVLink one
    assert (
        Cluster.parse("4xRTX3090").collective("all_gather").bandwidth_Bps
        < one.collective("all_gather").bandwidth_Bps
    )


def test_parse_machine_groups():
    c = Cluster.parse("2x(8xV100)+6x(8xP100)")
    assert c.n == 64 and len(c.machines) == 8
    assert c.names[:9] == tuple(f"v100-{i}" for i in range(9))
    assert c.devices[8].machine == "m1" and c.devices[16].name == "p100-0" and c.devices[16].machine == "m2"
    assert Counter(d.machine for d in c.devices) == {f"m{i}": 8 for i in range(8)}
    assert c == Cluster.preset("paper-hetero-64").replace(name=c.name)


def test_parse_custom_flops():
    c = Cluster.parse("2x5e12+1.5e12")
    assert c.flops == (5e12, 5e12, 1.5e12)
    assert c.names == ("custom-0", "custom-1", "custom-2")
    assert {d.kind for d in c.devices} == {"custom"}


@pytest.mark.parametrize(
    "spec,pattern",
    [
        ("3xFOO", r"unknown device kind 'FOO'.*V100.*P100"),
        ("", "empty cluster spec"),
        ("  ", "empty cluster spec"),
        ("2xV100++P100", "empty term"),
        ("2xV100+", "empty term"),
        ("0xV100", "at least 1"),
        ("2x(8xV100", "Mx\\(KxKIND\\)"),
        ("2x(3x(1xV100))", "Mx\\(KxKIND\\)"),
        ("0x(2xV100)", "repeats"),
    ],
)
def test_parse_errors(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        Cluster.parse(spec)


# ---------------------------------------------------------------------------------------------------
# Presets


@pytest.mark.parametrize("n", [8, 16, 32, 64])
def test_paper_hetero_presets(n):
    c = Cluster.preset(f"paper-hetero-{n}")
    assert c.n == n and c.name == f"paper-hetero-{n}"
    assert kinds_of(c) == {"V100": n // 4, "P100": 3 * n // 4}
    assert c.machines == tuple(f"m{i}" for i in range(8))
    assert all(len(c.devices_on(m)) == n // 8 for m in c.machines)
    assert {d.kind for m in ("m0", "m1") for d in c.devices_on(m)} == {"V100"}
    assert c.names[0] == "v100-0" and c.names[n // 4] == "p100-0"
    # bandwidths from HAP's heterogeneous profile, converted to our conventions
    assert c.collective("all_gather").bandwidth_Bps == 815_418_707
    assert c.collective("reduce_scatter").bandwidth_Bps == 876_490_907
    assert c.collective("all_reduce").bandwidth_Bps == 476_774_816
    assert c.collective("broadcast").bandwidth_Bps == 549_828_906
    assert c.collective("reduce").bandwidth_Bps == 512_358_434
    # all-to-all: HAP's volume is n x shard, ours is one device's bytes
    assert c.collective("all_to_all").bandwidth_Bps * n == pytest.approx(7_504_501_871, rel=1e-12)
    for kind in COLLECTIVE_KINDS:
        assert 0 < c.collective(kind).latency_s <= 1e-4


def test_paper_hetero_8_and_64_exact_counts():
    assert kinds_of(Cluster.preset("paper-hetero-8")) == {"V100": 2, "P100": 6}
    assert kinds_of(Cluster.preset("paper-hetero-64")) == {"V100": 16, "P100": 48}


def test_other_presets():
    homo = Cluster.preset("paper-homo-32")
    assert kinds_of(homo) == {"P100": 32} and len(homo.machines) == 4
    ap = Cluster.preset("a100-p100")
    assert ap.names == ("a100-0", "a100-1", "p100-0", "p100-1")
    assert [d.machine for d in ap.devices] == ["m0", "m0", "m1", "m1"]
    h = Cluster.preset("h100")
    assert h.n == 1 and h.devices[0].kind == "H100" and h.devices[0].memory_bytes == 80 * GiB
    assert h.flops[0] == pytest.approx(51.6e12 * TRAINING_EFFICIENCY)
    h8 = Cluster.preset("h100x8")
    assert h8.n == 8 and h8.machines == ("m0",) and kinds_of(h8) == {"H100": 8}
    assert h8.collective("all_gather").bandwidth_Bps >= 1e11  # NVLink class


DITTO = {  # Ditto Figure 8: kind -> (nodes, GPUs per node)
    1: {"V100": (2, 2), "RTX3090": (2, 2)},
    2: {"V100": (2, 2), "RTX3090": (2, 2), "A6000": (2, 2)},
    3: {"V100": (4, 2), "RTX3090": (3, 2), "A6000": (2, 2), "RTX4090": (2, 2)},
    4: {"V100": (2, 4), "RTX3090": (2, 4), "A6000": (2, 4)},
    5: {"V100": (4, 2), "RTX3090": (4, 2), "A100-80G": (2, 2)},
}


@pytest.mark.parametrize("ex", sorted(DITTO))
def test_ditto_presets(ex):
    c = Cluster.preset(f"ditto-ex{ex}")
    mix = DITTO[ex]
    assert kinds_of(c) == {k: nodes * gpus for k, (nodes, gpus) in mix.items()}
    assert len(c.machines) == sum(nodes for nodes, _ in mix.values())
    for m in c.machines:
        ds = c.devices_on(m)
        assert len({d.kind for d in ds}) == 1 and len(ds) == mix[ds[0].kind][1]
    for d in c.devices:
        assert d.flops == pytest.approx(DITTO_RELATIVE_THROUGHPUT[d.kind] * V100)
        assert d.memory_bytes == KINDS[d.kind].memory_bytes
    if ex == 3:
        assert len(c.machines) == 11  # "4 types of devices and 11 nodes" (Ditto §7.2)


def test_preset_listing_and_unknown_preset():
    assert {f"paper-hetero-{n}" for n in (8, 16, 32, 64)} <= set(PRESETS)
    assert {"paper-homo-32", "a100-p100", "h100", "h100x8"} | {f"ditto-ex{i}" for i in range(1, 6)} <= set(
        PRESETS
    )
    with pytest.raises(ValueError, match="unknown cluster preset 'nope'.*paper-hetero-8"):
        Cluster.preset("nope")


# ---------------------------------------------------------------------------------------------------
# JSON


@pytest.mark.parametrize("name", list(PRESETS))
def test_json_round_trip_every_preset(name, tmp_path):
    c = Cluster.preset(name)
    p = c.save(tmp_path / f"{name}.json")
    back = Cluster.load(p)
    assert back == c
    assert back.to_json() == c.to_json()
    p2 = back.save(tmp_path / "again.json")
    assert p2.read_text() == p.read_text()
    # also through the virtual view
    v = c.virtual()
    assert Cluster.from_json(json.loads(json.dumps(v.to_json()))) == v


def test_json_keys_are_exactly_the_design_keys():
    d = Cluster.preset("paper-hetero-8").to_json()
    assert set(d) == {"name", "dtype_bytes", "devices", "collectives", "intra_machine_Bps"}
    assert set(d["devices"][0]) == {"name", "kind", "flops", "memory_bytes", "machine", "gpus"}
    assert set(d["collectives"]) == set(COLLECTIVE_KINDS)
    assert set(d["collectives"]["all_gather"]) == {"latency_s", "bandwidth_Bps"}
    assert d["devices"][0] == {
        "name": "v100-0",
        "kind": "V100",
        "flops": V100,
        "memory_bytes": 17179869184,
        "machine": "m0",
        "gpus": 1,
    }


def _valid_json() -> dict:
    return {
        "name": "tiny",
        "dtype_bytes": 4,
        "devices": [
            {"name": "a", "kind": "V100", "flops": 3.86e12, "memory_bytes": 17179869184, "machine": "m0"},
            {"name": "b", "kind": "P100", "flops": 2.15e12, "memory_bytes": 17179869184, "machine": "m1"},
        ],
        "collectives": {k: {"latency_s": 2e-5, "bandwidth_Bps": 1.3e9} for k in COLLECTIVE_KINDS},
        "intra_machine_Bps": 1.0e11,
    }


def test_json_design_example_loads_with_defaults(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(_valid_json()))
    c = Cluster.load(p)
    assert c.names == ("a", "b") and c.flops == (3.86e12, 2.15e12) and c.devices[0].gpus == 1
    assert c.collective("all_reduce") == Collective(2e-5, 1.3e9)
    d = _valid_json()
    del d["dtype_bytes"], d["intra_machine_Bps"]
    c2 = Cluster.from_json(d)
    assert c2.dtype_bytes == 4 and c2.intra_machine_Bps == 1e11


def _mutate(fn):
    d = _valid_json()
    fn(d)
    return d


BAD_JSON = [
    (lambda d: d.pop("name"), r"\bname: missing"),
    (lambda d: d.pop("devices"), r"devices: missing"),
    (lambda d: d.update(devices=[]), r"devices: must be a non-empty list"),
    (lambda d: d["devices"][1].pop("flops"), r"devices\[1\]\.flops: missing"),
    (lambda d: d["devices"][0].update(flops=-1), r"devices\[0\]\.flops must be a positive"),
    (lambda d: d["devices"][0].update(flops=0), r"devices\[0\]\.flops must be a positive"),
    (lambda d: d["devices"][0].update(flops="3e12"), r"devices\[0\]\.flops must be a positive"),
    (
        lambda d: d["devices"][0].update(memory_bytes=1.5),
        r"devices\[0\]\.memory_bytes must be a positive integer",
    ),
    (lambda d: d["devices"][0].update(gpus=0), r"devices\[0\]\.gpus must be a positive integer"),
    (lambda d: d["devices"][0].update(machine=3), r"devices\[0\]\.machine must be a non-empty string"),
    (lambda d: d["devices"][0].update(flop=1), r"devices\[0\]\.flop: unknown key"),
    (lambda d: d["devices"][1].update(name="a"), r"devices\[1\]\.name: duplicate device name 'a'"),
    (
        lambda d: d.update(collectives={"broadcast": d["collectives"]["broadcast"]}),
        r"collectives: needs at least one",
    ),
    (lambda d: d["collectives"].update(gather={}), r"collectives\.gather: unknown collective kind"),
    (lambda d: d["collectives"]["all_gather"].update(bandwidth_Bps=0), r"all_gather\.bandwidth_Bps must be"),
    (lambda d: d["collectives"]["all_gather"].pop("latency_s"), r"all_gather\.latency_s: missing"),
    (lambda d: d["collectives"]["all_gather"].update(latency_s=-1), r"all_gather\.latency_s must be"),
    (lambda d: d.update(intra_machine_Bps=0), r"intra_machine_Bps must be a positive"),
    (lambda d: d.update(dtype_bytes="4"), r"dtype_bytes must be a positive integer"),
    (lambda d: d.update(extra=1), r"extra: unknown key"),
]


@pytest.mark.parametrize("mutate,pattern", BAD_JSON)
def test_malformed_json_names_field_and_file(mutate, pattern, tmp_path):
    p = tmp_path / "bad_cluster.json"
    p.write_text(json.dumps(_mutate(mutate)))
    with pytest.raises(ValueError, match=pattern) as info:
        Cluster.load(p)
    assert str(p) in str(info.value)


def test_json_not_json_or_not_object(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{"name": "x", ')
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON .*line 1"):
        Cluster.load(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        Cluster.load(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Cluster.load(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------------
# resolve


def test_resolve_preset_path_inline(tmp_path):
    assert Cluster.resolve("paper-hetero-8") == Cluster.preset("paper-hetero-8")
    inline = Cluster.resolve("2xV100+6xP100")
    assert inline.n == 8 and inline.name == "2xV100+6xP100"
    p = Cluster.preset("ditto-ex2").save(tmp_path / "ex2.json")
    assert Cluster.resolve(str(p)) == Cluster.preset("ditto-ex2")
    assert Cluster.resolve(p) == Cluster.preset("ditto-ex2")
    c = Cluster.preset("h100")
    assert Cluster.resolve(c) is c


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match=r"not a preset \(paper-hetero-8.*unknown device kind 'BOGUS'"):
        Cluster.resolve("BOGUS")
    with pytest.raises(ValueError, match="does not exist"):
        Cluster.resolve(str(tmp_path / "nope.json"))


# ---------------------------------------------------------------------------------------------------
# Virtual devices


def test_virtual_groups_machines():
    c = Cluster.preset("paper-hetero-64")
    v = c.virtual()
    assert v.n == 8 and v.names == tuple(f"m{i}" for i in range(8))
    assert all(d.gpus == 8 for d in v.devices) and v.gpus == 64
    assert [d.kind for d in v.devices] == ["V100"] * 2 + ["P100"] * 6
    assert v.flops[0] == pytest.approx(8 * V100) and v.flops[7] == pytest.approx(8 * P100)
    assert v.devices[0].flops_per_gpu == pytest.approx(V100)
    assert v.memory_bytes == (8 * 16 * GiB,) * 8
    assert v.total_flops == pytest.approx(c.total_flops)
    for kind in COLLECTIVE_KINDS:
        if kind != "all_to_all":
            assert v.collective(kind) == c.collective(kind)
    # all-to-all: a virtual device sends what its 8 GPUs sent through the same NIC -> same time
    per_gpu = 1e6
    assert v.collective("all_to_all").time(8 * per_gpu) == pytest.approx(
        c.collective("all_to_all").time(per_gpu)
    )
    assert v.virtual() == v  # idempotent


def test_virtual_mixed_machine_and_single_gpu_machines():
    c = Cluster(
        "mix",
        (
            Device("a", "V100", 4e12, 16 * GiB, "x"),
            Device("b", "P100", 2e12, 16 * GiB, "x"),
            Device("c", "P100", 2e12, 16 * GiB, "y"),
        ),
        Cluster.parse("V100+P100").collectives,
    )
    v = c.virtual()
    assert v.names == ("x", "y") and [d.kind for d in v.devices] == ["mixed", "P100"]
    assert v.flops == (6e12, 2e12) and [d.gpus for d in v.devices] == [2, 1]
    # one GPU per machine: same devices up to naming, same collectives
    p8 = Cluster.preset("paper-hetero-8")
    assert p8.virtual().flops == p8.flops and p8.virtual().collectives == p8.collectives


# ---------------------------------------------------------------------------------------------------
# Cluster object


def test_cluster_collective_lookup_and_errors():
    c = Cluster.preset("a100-p100")
    assert c.collective("all_reduce").bandwidth_Bps == 476_774_816
    with pytest.raises(KeyError, match="valid kinds: all_gather"):
        c.collective("allreduce")
    with pytest.raises(ValueError, match="missing collective kinds: .*give at least one of all_gather"):
        Cluster("x", c.devices, {"broadcast": c.collective("broadcast")})
    with pytest.raises(ValueError, match="duplicate device name 'a100-0'"):
        Cluster("x", c.devices + c.devices[:1], c.collectives)
    with pytest.raises(ValueError, match="no devices"):
        Cluster("x", (), c.collectives)


def test_cluster_collectives_sorted_and_replace_helpers():
    c = Cluster.parse("2xV100")
    assert [k for k, _ in c.collectives] == sorted(COLLECTIVE_KINDS)
    d = c.with_collectives(all_reduce=Collective(1e-3, 1e6))
    assert d.collective("all_reduce").time(1e6) == pytest.approx(1.001)
    assert d.collective("all_gather") == c.collective("all_gather")
    assert [k for k, _ in d.collectives] == sorted(COLLECTIVE_KINDS)
    assert c.replace(dtype_bytes=2).dtype_bytes == 2
    assert c.index("v100-1") == 1
    with pytest.raises(KeyError, match="no device 'zz'"):
        c.index("zz")


def test_display():
    c = Cluster.preset("paper-hetero-8")
    s = str(c)
    assert "paper-hetero-8" in s and "8 devices" in s and "2xV100" in s and "6xP100" in s
    h = c._repr_html_()
    assert h.startswith("<div>") and h.count("<tr>") == 1 + 8 + 1 + len(COLLECTIVE_KINDS)
    assert "v100-0" in h and "p100-5" in h and "all_to_all" in h
    weird = Cluster.parse("V100", name="<b>&")
    assert "<b>&" not in weird._repr_html_() and "&lt;b&gt;&amp;" in weird._repr_html_()
    assert str(Device("v", "V100", 3.86e12, 16 * GiB, "m0")) == "v (V100, 3.86 TFLOP/s, 16 GiB, m0)"


def test_no_code_is_evaluated_from_json(tmp_path):
    d = _valid_json()
    d["devices"][0]["flops"] = "__import__('os').system('false')"
    p = Path(tmp_path / "evil.json")
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"devices\[0\]\.flops"):
        Cluster.load(p)


def test_documented_five_kind_json_loads_with_reduce_derived(tmp_path):
    """The schema of DESIGN §3.3 names five kinds; a file written to it loads, and the sixth kind the
    cost model uses (``reduce``: the grouped reduce, dual of the grouped broadcast) takes broadcast's
    numbers, as DERIVED_COLLECTIVES documents."""
    d = _mutate(lambda d: d["collectives"].pop("reduce"))
    d["collectives"]["broadcast"] = {"latency_s": 7e-6, "bandwidth_Bps": 3e9}
    p = tmp_path / "five.json"
    p.write_text(json.dumps(d))
    c = Cluster.load(p)
    assert c.collective("reduce") == Collective(7e-6, 3e9)
    assert set(dict(c.collectives)) == set(COLLECTIVE_KINDS)


@pytest.mark.parametrize("given", ["all_gather", "reduce_scatter", "all_reduce"])
def test_every_kind_derives_from_one_base_kind(given):
    from hapnb.hardware.parts import DERIVED_COLLECTIVES, complete_collectives

    base = Collective(1e-5, 4e9)
    out = complete_collectives({given: base})
    assert set(out) == set(COLLECTIVE_KINDS) and out[given] == base
    # padded all-gather and reduce-scatter are duals; a ring all-reduce is both in a row
    ag_rs = base if given != "all_reduce" else Collective(0.5e-5, 8e9)
    assert out["all_gather"] == out["reduce_scatter"] == ag_rs
    assert out["all_reduce"] == (base if given == "all_reduce" else Collective(2e-5, 2e9))
    assert out["all_to_all"] == ag_rs and out["broadcast"] == ag_rs and out["reduce"] == ag_rs
    assert set(DERIVED_COLLECTIVES) == set(COLLECTIVE_KINDS)  # every kind has a documented default


def test_given_kinds_win_over_derived_ones():
    from hapnb.hardware.parts import complete_collectives

    given = {"all_gather": Collective(1e-5, 4e9), "broadcast": Collective(3e-6, 1e9)}
    out = complete_collectives(given)
    assert out["broadcast"] == given["broadcast"] and out["reduce"] == given["broadcast"]


# --------------------------------------------------------------------------- device models


def test_h100_has_a_device_model_with_its_source_and_paper_kinds_stay_flops_only():
    from hapnb.hardware.catalogue import DEVICE_MODELS, KINDS

    for spec in ("1xH100", "h100", "h100x8"):
        c = Cluster.resolve(spec)
        assert all(d.model is DEVICE_MODELS["H100"] for d in c.devices)
        assert "H100 device model" in str(c) and c.devices[0].model.source in str(c)
        assert c.devices[0].model.source in c._repr_html_()
    assert Cluster.parse("8xH100").virtual().devices[0].model is DEVICE_MODELS["H100"]
    assert KINDS["H100-TF32"].model is None
    for name in ("paper-hetero-8", "paper-hetero-64", "2xV100+6xP100", "4xA100"):
        c = Cluster.resolve(name)
        assert all(d.model is None for d in c.devices) and "device model" not in str(c)


def test_device_model_json_round_trip_and_old_json_still_loads(tmp_path):
    from hapnb.hardware.devices import DeviceModel

    c = Cluster.parse("2xH100")
    d = c.to_json()
    assert d["devices"][0]["model"]["source"] == c.devices[0].model.source
    back = Cluster.load(c.save(tmp_path / "c.json"))
    assert back == c and back.devices[1].model == c.devices[1].model
    old = _valid_json()  # no model key: flops-only
    assert all(dv.model is None for dv in Cluster.from_json(old).devices)
    m = DeviceModel(5e12, 1e11, 1e-5, 0.7, 1e8, source="profile of this CPU")
    old["devices"][0]["model"] = m.to_json()
    loaded = Cluster.from_json(old)
    assert loaded.devices[0].model == m and loaded.devices[1].model is None
    old["devices"][0]["model"] = {**m.to_json(), "bogus": 1}
    with pytest.raises(ValueError, match=r"devices\[0\]\.model"):
        Cluster.from_json(old)
    with pytest.raises(ValueError, match="matmul_eff"):
        DeviceModel(5e12, 1e11, 1e-5, 0.0, 1e8)


def test_device_model_cpu_refinements_round_trip_and_default_off(tmp_path):
    import dataclasses

    from hapnb.hardware.catalogue import DEVICE_MODELS
    from hapnb.hardware.devices import DeviceModel

    for m in DEVICE_MODELS.values():  # every shipped kind keeps today's pricing
        assert m.optimizer_per_tensor is False and m.vector_flops is None
        assert m.pool_flops is None and not {"optimizer_per_tensor", "vector_flops", "pool_flops"} & set(
            m.to_json()
        )
    m = DeviceModel(
        5e12, 1e11, 1e-5, 0.7, 1e8, overlap=False, optimizer_per_tensor=True, vector_flops=4e9, pool_flops=5e8
    )
    assert m.to_json()["vector_flops"] == 4e9 and m.to_json()["optimizer_per_tensor"] is True
    assert DeviceModel.from_json(json.loads(json.dumps(m.to_json()))) == m
    c = Cluster.parse("2xH100")
    c = c.replace(devices=tuple(dataclasses.replace(d, model=m) for d in c.devices))
    back = Cluster.load(c.save(tmp_path / "c.json"))
    assert back.devices[0].model == m and "vector 4 GFLOP/s" in str(m) and "Adam per tensor" in str(m)
    assert "pooling 0.5 GFLOP/s" in str(m)
    old = {
        k: v
        for k, v in m.to_json().items()
        if k not in ("optimizer_per_tensor", "vector_flops", "pool_flops")
    }
    loaded = DeviceModel.from_json(old)  # JSON written before the fields existed
    assert loaded.optimizer_per_tensor is False and loaded.vector_flops is None and loaded.pool_flops is None
    for bad in (0.0, -1.0, float("nan"), True):
        for rate in ("vector_flops", "pool_flops"):
            with pytest.raises(ValueError, match=rate):
                DeviceModel(5e12, 1e11, 1e-5, 0.7, 1e8, **{rate: bad})
    with pytest.raises(ValueError, match="optimizer_per_tensor"):
        DeviceModel(5e12, 1e11, 1e-5, 0.7, 1e8, optimizer_per_tensor=1)


def test_device_model_scan_conv_and_wave_fields_round_trip():
    from hapnb.hardware.catalogue import H100_MODEL
    from hapnb.hardware.devices import DeviceModel

    new = dict(scan_flops=3e8, conv_eff=0.8, conv_half_flops=9e6, sm_count=132, gemm_tile=128)
    m = DeviceModel(5e12, 1e11, 1e-5, 0.7, 1e8, **new)
    assert {k: m.to_json()[k] for k in new} == new
    assert DeviceModel.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert "scan 0.3 GFLOP/s" in str(m) and "conv x 0.8" in str(m) and "132 SMs" in str(m)
    plain = DeviceModel(5e12, 1e11, 1e-5, 0.7, 1e8)  # at their defaults the fields stay out of the JSON
    assert not set(new) & set(plain.to_json()) and plain.gemm_wave_factor((1, 64, 64, 64)) == 1.0
    assert (H100_MODEL.sm_count, H100_MODEL.gemm_tile) == (132, 128)
    for bad in (dict(sm_count=0, gemm_tile=128), dict(gemm_tile=1.5, sm_count=132), dict(scan_flops=0.0),
                dict(conv_half_flops=-1.0, conv_eff=0.5), dict(sm_count=True, gemm_tile=128)):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            DeviceModel(5e12, 1e11, 1e-5, 0.7, 1e8, **bad)
