"""The optimizer step in the search's cost (:mod:`hapnb.synth.optimizer_step`): on device-model devices the cost
model adds Adam's step over each device's parameter bytes to the last stage; A* minimises that cost, returns
the brute-force optimum of it, and its bound stays admissible with the step's least part in it."""

from __future__ import annotations

import pytest
import synthetic as S
from oracles import brute_force

from hapnb.hardware.cluster import Cluster
from hapnb.synth.search import Search
from hapnb.tracing import zoo_graph
from hapnb.triples import theory

#: device-model clusters: every device modelled, and one modelled beside a flops-only one
CLUSTERS = ["2xH100", "1xH100+1xA100"]


@pytest.mark.parametrize("seed", range(8))  # each cluster at throughput and at given ratios, twice
def test_the_search_charges_the_optimizer_step_and_returns_the_brute_force_optimum(seed):
    th = theory(S.random_graph(seed), S.strategies)
    c = Cluster.parse(CLUSTERS[seed % 2])
    ratios = None if seed % 4 < 2 else [[1.0, 3.0]]
    s = Search(th, c, ratios=ratios)
    assert s._opt is not None
    res = s.run()
    bf_cost, _ = brute_force(th, c, s.ratios)  # CostModel.evaluate: the step in the last stage
    assert res.optimal and res.cost == pytest.approx(bf_cost, rel=1e-9)
    assert res.cost == pytest.approx(s.cost_model.evaluate(res.program, s.ratios).cost_s, rel=1e-12)
    nid = s._best  # admissible along the optimal program: no prefix scores above it
    while nid >= 0:
        assert s.node(nid).score <= bf_cost * (1 + 1e-9)
        nid = s.node(nid).parent


def test_a_transformer_on_h100s_is_proven_at_the_root():
    # the single-consumer weights' steps priced with their loads in the spine terms: the root bound is the
    # optimum (with the step's least part counted apart, the search stopped 0.6 % short after 30,000)
    c = Cluster.preset("h100x8")
    g, _ = zoo_graph("bert", devices=c.n)
    s = Search(theory(g), c)
    res = s.run(max_expansions=30_000)
    assert res.optimal and res.expansions < 2_000
    assert s.node(0).score == pytest.approx(res.cost, rel=1e-9)
    assert res.cost == pytest.approx(s.cost_model.evaluate(res.program, s.ratios).cost_s, rel=1e-12)
