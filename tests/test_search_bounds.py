"""The A* heuristic: admissible (never above the optimum, on random graphs against brute force) and tight
enough that BERT-MoE at the paper's scale is proven optimal within the default budget — the spine follows
the largest activations (the MoE layers' expert path, where the all-to-alls and the expert weights'
synchronisation are), not the deepest path (the gating ops)."""

from __future__ import annotations

import pytest
import synthetic as S
from test_search import CLUSTERS, brute_force

from hapnb import search as search_module
from hapnb.cluster import Cluster
from hapnb.search import Search
from hapnb.tracing import zoo_graph
from hapnb.triples import theory


def test_root_bound_never_exceeds_the_optimum():
    # the optimum: A*'s result, which tests/test_search.py checks against brute force on these graphs
    for seed in range(24):
        th = theory(S.random_graph(seed), S.strategies)
        c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
        for ratios in (None, [[(j + 1.0) for j in range(c.n)]]):
            s = Search(th, c, ratios=ratios)
            root = s.node(0).score
            res = s.run()
            assert res.optimal and root <= res.cost * (1 + 1e-12)


def test_bert_moe_at_paper_scale_is_proven_optimal_within_the_default_budget():
    c = Cluster.preset("paper-hetero-8")
    g, _ = zoo_graph("bert-moe", devices=c.n)  # 12 layers (6 MoE), 16 experts, hidden 768, batch 256
    s = Search(theory(g), c)
    res = s.run(max_expansions=30_000)
    assert res.optimal and res.expansions < 30_000
    # the spine bound sees the expert path: the root bound is within 2 % of the optimum
    assert s.node(0).score >= 0.98 * res.cost


@pytest.mark.parametrize("seed", range(24))
def test_chain_bound_is_admissible_and_the_search_with_it_exact(seed, monkeypatch):
    # the chain bound (hapnb.chainbound) from the first expansion on: the root value never exceeds the
    # optimum, and A* with it still returns the brute-force optimum (tests/test_search.py's check)
    monkeypatch.setattr(search_module, "SWITCH_AFTER", 0)
    th = theory(S.random_graph(seed), S.strategies)
    c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
    ratios = None if seed % 2 else [[(j + 1.0) for j in range(c.n)]]
    s = Search(th, c, ratios=ratios)
    res = s.run()
    assert res.optimal and s._chain is not None
    bf_cost, _ = brute_force(th, c, s.ratios)
    assert res.cost == pytest.approx(bf_cost, rel=1e-9)
    root = s._chain.value(0, 0)
    assert root <= bf_cost * (1 + 1e-12)


def test_side_terms_bound_the_optimum_at_every_prefix_of_it():
    # along the optimal program, every node's score (cost so far + the bound) stays at or below the optimum
    for seed in range(12):
        th = theory(S.random_graph(seed), S.strategies)
        c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
        s = Search(th, c)
        res = s.run()
        nid = s._best
        while nid > 0:
            assert s.node(nid).score <= res.cost * (1 + 1e-9)
            nid = s.node(nid).parent
