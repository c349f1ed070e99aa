"""Virtual devices (hapnb.runtime.expand): a machine of k GPUs planned as one device runs as its expansion, one
rank per GPU; the cuts, ratios and stage estimates of the expansion against the virtual plan, and the
expanded program against one device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hapnb import zoo
from hapnb.plans.plan import Plan
from hapnb.plans.synthesis import synthesize
from hapnb.run.verify import verify
from hapnb.runtime.codegen import generate

VIRTUAL = "2xV100+2xP100"  # two machines of two GPUs: 2 virtual devices, 4 ranks


@pytest.fixture(scope="module")
def virtual_plans() -> dict[str, Plan]:
    from hapnb.hardware.cluster import Cluster

    c = Cluster.parse(VIRTUAL).virtual()
    assert [d.gpus for d in c.devices] == [2, 2]
    gpt3 = {**zoo.TINY["gpt"], "layers": 3}
    return {
        "gpt": synthesize("gpt", c, **zoo.TINY["gpt"]),
        "mlp": synthesize("mlp", c, **zoo.TINY["mlp"]),
        # per-layer segments: the plan re-cuts activations between segments (reshard lengths)
        "gpt-segments": synthesize("gpt", c, segments="layer", **gpt3),
        # machine m0 gets no share at all (both its GPUs hold empty shards)
        "mlp-zero": synthesize("mlp", c, ratios=[0.0, 1.0], **zoo.TINY["mlp"]),
    }


def _check_expansion(plan: Plan) -> Plan:
    """Ground truth for expand_virtual: devices, ratios and every cut, against the virtual plan."""
    from hapnb import theory
    from hapnb.ir.forms import parse_form
    from hapnb.runtime.expand import expand_virtual

    e = expand_virtual(plan, plan.graph)
    vc, pc = plan.cluster, e.cluster
    assert pc.n == vc.gpus == 4 and all(d.gpus == 1 for d in pc.devices)
    assert e.devices == ("m0.g0", "m0.g1", "m1.g0", "m1.g1")
    for j, v in enumerate(vc.devices):
        for d in pc.devices[2 * j : 2 * j + 2]:
            assert d.machine == v.machine and d.kind == v.kind
            assert d.flops == pytest.approx(v.flops / 2) and d.memory_bytes == v.memory_bytes // 2
    for vrow, prow in zip(plan.ratios, e.ratios, strict=True):
        assert prow == pytest.approx([vrow[0] / 2, vrow[0] / 2, vrow[1] / 2, vrow[1] / 2])
    th = theory(plan.graph)
    g = plan.graph

    def check_cut(name: str, dim: int, virt: tuple[int, ...], phys: tuple[int, ...]) -> None:
        t = g.tensor(name)
        unit, _ = th.units.get((t.id, dim), (1, t.shape[dim]))
        assert sum(phys) == t.shape[dim], (name, dim, phys)
        assert all(x % unit == 0 for x in phys), (name, dim, unit, phys)
        assert (phys[0] + phys[1], phys[2] + phys[3]) == virt  # each machine keeps its share
        assert abs(phys[0] - phys[1]) <= unit and abs(phys[2] - phys[3]) <= unit  # split evenly

    assert [(t, d) for t, d, _ in e.lengths] == [(t, d) for t, d, _ in plan.lengths]
    for (t, d, virt), (_, _, phys) in zip(plan.lengths, e.lengths):
        check_cut(t, d, virt, phys)
    assert len(e.program) == len(plan.program)
    for vi, pi in zip(plan.program, e.program):
        assert dataclasses.replace(pi, lengths=vi.lengths) == vi  # only reshard lengths change
        if vi.lengths:
            check_cut(vi.tensor, parse_form(vi.form.partition("@")[0]).dim, vi.lengths, pi.lengths)
    assert [len(s.comp_s) for s in e.stages] == [4] * len(plan.stages)  # the virtual estimate, per GPU
    assert e.cost_s == plan.cost_s
    return e


@pytest.mark.parametrize("name", ["gpt", "mlp", "gpt-segments", "mlp-zero"])
def test_expand_virtual_cuts(virtual_plans: dict[str, Plan], name: str) -> None:
    plan = virtual_plans[name]
    e = _check_expansion(plan)
    if name == "gpt-segments":
        assert any(i.name == "reshard" and len(i.lengths) == 4 for i in e.program)
    if name == "mlp-zero":
        assert e.ratios[0][:2] == (0.0, 0.0)
        assert all(ls[:2] == (0, 0) for _, _, ls in e.lengths)
    # codegen runs a virtual plan as its expansion: rank r is physical GPU r
    for rank in (0, 3):
        assert generate(plan, plan.graph, rank).code == generate(e, plan.graph, rank).code
    # a plan without virtual devices is left alone; the expansion is a plain plan with a JSON round trip
    from hapnb.runtime.expand import expand_virtual

    assert expand_virtual(e) is e
    assert Plan.from_json(e.to_json()) == e


def test_virtual_plan_rank_counts(virtual_plans: dict[str, Plan], tmp_path: Path) -> None:
    from hapnb.run.launch import plan_bundle

    plan = virtual_plans["mlp"]
    with pytest.raises(ValueError, match=r"is for 4 GPUs \(2 virtual devices of 2\+2 GPUs.*nproc=4, not 2"):
        verify(plan, nproc=2)
    (tmp_path / "b").mkdir()
    plan.save(tmp_path / "b" / "plan.json")
    assert plan_bundle(tmp_path / "b") == (tmp_path / "b", 4)  # launch's default nproc


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-segments", "mlp-zero"])
def test_verify_virtual_plan_on_gpus(virtual_plans: dict[str, Plan], name: str) -> None:
    # the bundle keeps the virtual plan; verify and every worker expand it to one rank per GPU
    report = verify(virtual_plans[name], steps=2, timeout=120)
    assert report.ok, report.text()
    assert report.nproc == 4 and "OK on 4 ranks" in report.text()
    assert report.max_rel < 1e-10
