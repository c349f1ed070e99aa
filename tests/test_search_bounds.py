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
    monkeypatch.setattr(search_module, "NEAR", 0.0)  # switch even where a dive nearly proves the optimum
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


def _tied_branch_graph(batch: int, d: int, wide: bool):
    """A parameter two spine ops take (tied, as an LM's embedding and head) and a branch with its own weight
    into a spine op (``wide``: the branch forks into two weighted ops, one of them a side of the branch)."""
    b = S.Builder()
    x = b.tensor("x", (batch, d), "input")
    xb = b.tensor("xb", (batch, d), "input")
    w = b.tensor("w", (d, d), "param")
    wb = b.tensor("wb", (d, d), "param")
    h = b.op("relu", [b.op("mm", [x, w], (batch, d), 2.0 * batch * d * d)], (batch, d), float(batch * d))
    for _ in range(3 if wide else 0):  # the spine stays the deeper path
        h = b.op("relu", [h], (batch, d), float(batch * d))
    br = b.op("mm", [xb, wb], (batch, d), 2.0 * batch * d * d)
    if wide:
        wc = b.tensor("wc", (d, d), "param")
        wd = b.tensor("wd", (d, d), "param")
        z = b.op("relu", [br], (batch, d), float(batch * d))
        za = b.op("mm", [z, wc], (batch, d), 2.0 * batch * d * d)
        zb = b.op("mm", [z, wd], (batch, d), 2.0 * batch * d * d)
        br = b.op("add", [za, zb], (batch, d), float(batch * d))
    h = b.op("add", [h, br], (batch, d), float(batch * d))
    h = b.op("mm", [h, w], (batch, d), 2.0 * batch * d * d)
    return b.build(b.op("sum", [h], (), float(batch * d)), "tied")


@pytest.mark.parametrize("seed", range(8))
def test_tied_parameter_and_branch_terms_are_admissible_against_brute_force(seed):
    # the spine DP keeps the tied parameter's form; the branch into the add (with the add's share of its
    # cost, and its side) joins the bound: A* still returns the brute-force optimum, and no node on the
    # optimal program's path scores above it
    batch, d = [(8, 32), (64, 8), (16, 128), (4, 512)][seed % 4]
    th = theory(_tied_branch_graph(batch, d, wide=False), S.strategies)
    c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
    ratios = None if seed % 2 else [[(j + 1.0) for j in range(c.n)]]
    s = Search(th, c, ratios=ratios)
    assert s.node(0).score > 0.0
    res = s.run()
    bf_cost, _ = brute_force(th, c, s.ratios)
    assert res.optimal and res.cost == pytest.approx(bf_cost, rel=1e-9)
    nid = s._best
    while nid >= 0:
        assert s.node(nid).score <= bf_cost * (1 + 1e-9)
        nid = s.node(nid).parent


@pytest.mark.parametrize("seed", range(2))
def test_a_branch_that_forks_bounds_the_optimum_at_every_prefix_of_it(seed):
    # the branch's second weighted op is a side of the branch tensor, with the rest of its own branch in
    # its table (too many programs for brute force: checked against A*'s optimum)
    th = theory(_tied_branch_graph(*[(8, 32), (64, 8)][seed], wide=True), S.strategies)
    c = Cluster.parse(CLUSTERS[seed])
    s = Search(th, c)
    res = s.run()
    nid = s._best
    while nid >= 0:
        assert s.node(nid).score <= res.cost * (1 + 1e-9)
        nid = s.node(nid).parent
