"""The cheap bounds behind synthesize's post-search work: they skip work, never change a plan."""

from __future__ import annotations

import pytest

import hapnb as hap
from hapnb import synthesis, zoo
from hapnb.cost import CostModel
from hapnb.simulation import iteration_time, plan_lower_bound


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
    th, c = plan.context.theory, plan.cluster
    packaged = [(key[1], p) for key, p in plan.context.memo.tables["plan"].items()]
    assert packaged
    for k, p in packaged:  # the bound from the program alone is the packaged plan's, and below its simulation
        b = synthesis.program_lower_bound(CostModel(th, c), k.program, k.ratios, duplex)
        assert b == pytest.approx(plan_lower_bound(p), rel=1e-12)
        assert 0 < b <= iteration_time(p) * (1 + 1e-12)
    # without the bound every candidate is simulated: the same pick
    monkeypatch.setattr(synthesis, "program_lower_bound", lambda *a: 0.0)
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
