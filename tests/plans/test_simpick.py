"""The cheap bounds behind synthesize's post-search work: they skip work, never change a plan."""

from __future__ import annotations

import pytest
import synthetic as S
from oracles import all_programs, storage_variants, with_memory

import hapnb as hap
from hapnb import zoo
from hapnb.cost.memory import fits as memory_fits
from hapnb.cost.memory import memory_linear
from hapnb.cost.model import CostModel
from hapnb.hardware.cluster import Cluster
from hapnb.ir.forms import FullShard, ShardGradOp
from hapnb.plans import planner as planner_module
from hapnb.plans.explain import program_steps
from hapnb.plans.simulation import iteration_time, plan_lower_bound
from hapnb.synth.search import Search
from hapnb.triples import theory


def _graph(name: str, cluster: str):
    n = hap.Cluster.resolve(cluster).n
    return hap.trace(*zoo.build(name, **{**zoo.TINY[name], "devices": n})[:2], name=name)


@pytest.mark.parametrize(
    "name,cluster,duplex",
    [("mlp", "paper-hetero-8", False), ("bert", "2xV100+2xP100", True), ("vit", "a100-p100", False)],
)
def test_simulated_pick_skips_only_candidates_that_cannot_win(monkeypatch, name, cluster, duplex):
    g = _graph(name, cluster)
    plan = hap.synthesize(g, cluster, duplex=duplex)
    th, c = plan.planner.theory, plan.cluster
    packaged = [(key[1], p) for key, p in plan.planner.memo.tables["plan"].items()]
    assert packaged
    for k, p in packaged:  # the bound from the program alone is the packaged plan's, and below its simulation
        b = planner_module.program_lower_bound(CostModel(th, c), k.program, k.ratios, duplex)
        assert b == pytest.approx(plan_lower_bound(p), rel=1e-12)
        assert 0 < b <= iteration_time(p) * (1 + 1e-12)
    # without the bound every candidate is simulated: the same pick
    monkeypatch.setattr(planner_module, "program_lower_bound", lambda *a: 0.0)
    every = hap.synthesize(g, cluster, duplex=duplex)
    assert every.stats["candidates_bounded"] == 0 < plan.stats["candidates_bounded"]
    assert (
        plan.stats["candidates_simulated"] + plan.stats["candidates_bounded"]
        == every.stats["candidates_simulated"]
    )
    assert (every.program, every.ratios, every.cost_s, every.simulated_s) == (
        plan.program, plan.ratios, plan.cost_s, plan.simulated_s,
    )  # fmt: skip
    assert (
        every.stats["chosen"] == plan.stats["chosen"] and every.stats["cost_rank"] == plan.stats["cost_rank"]
    )


def _upper_holds(cm, program, extra, ratios) -> None:
    """The program's linear upper bound is above its exact peak on every device, and :func:`fits` agrees
    with the exact check on clusters whose memory is just above or just below that peak."""
    lin = memory_linear(cm, program, extra)
    exact = cm.memory(program, extra, ratios)
    for j, (d, k) in enumerate(zip(cm.cluster.devices, cm.gpus)):
        assert exact[j] <= lin.upper(ratios, j, d.model, k), (j, exact[j])
    c = cm.cluster
    for j in range(c.n):  # one device 1 byte short: the bound does not settle it, the breakdown says no
        caps = [(m + 1) * d.gpus for m, d in zip(exact, c.devices)]
        caps[j] = (exact[j] - 1) * c.devices[j].gpus
        tight = CostModel(cm.theory, with_memory(c, caps))
        assert not memory_fits(tight, program, extra, ratios, lin)
    roomy = CostModel(cm.theory, with_memory(c, [(m + 1) * d.gpus for m, d in zip(exact, c.devices)]))
    assert memory_fits(roomy, program, extra, ratios, lin)


@pytest.mark.parametrize("seed", [0, 4])
def test_memory_upper_bound_holds_for_every_program_and_storage(seed):
    th = theory(S.random_graph(seed), S.strategies)
    c = Cluster.parse(["2xV100+2xP100", "1x5e12+1x1e12+1x2e12"][seed % 2])
    probe = Search(th, c, memory=True)
    dstar = {t.id: probe._mem.dstar(t.id) for t in th.graph.tensors if t.role == "param"}
    cm = CostModel(th, c)
    rows = [probe.ratios[0], [0.7, 0.2, 0.1, 0.0][: c.n], [1 / c.n] * c.n]
    for k, prog in enumerate(all_programs(th)):
        for i, p in enumerate(storage_variants(th, prog, dstar)):
            ratios = [rows[(k + i) % len(rows)]] * cm.n_segments
            lin = memory_linear(cm, p, ())
            exact = cm.memory(p, (), ratios)
            assert all(
                m <= lin.upper(ratios, j, d.model, g)
                for j, (m, d, g) in enumerate(zip(exact, c.devices, cm.gpus))
            )


@pytest.mark.parametrize(
    "name,cluster,pins",
    [
        ("bert", "paper-hetero-8", {}),
        (
            "gpt",
            "2xV100+2xP100",
            {"blocks.0.qkv.weight": FullShard(0), "blocks.1.fc2.weight": ShardGradOp(1)},
        ),
        ("mlp", "1x5e12+1x1e12+1x2e12", {"layers.0.weight": FullShard(0)}),
    ],
)
def test_memory_upper_bound_holds_for_synthesized_programs(name, cluster, pins):
    plan = hap.synthesize(_graph(name, cluster), cluster, pins=pins)
    th = plan.planner.theory
    steps, convs = program_steps(plan, th)
    cm = CostModel(th, plan.cluster)
    n = plan.cluster.n
    for row in (plan.ratios[0], [0.9] + [0.1 / (n - 1)] * (n - 1), [1.0] + [0.0] * (n - 1)):
        _upper_holds(cm, steps, convs, [tuple(row)] * cm.n_segments)
