"""Buffer updates in the search's cost (:mod:`hapnb.synth.updates`): A* minimises what the cost model charges,
the running-statistics collectives included, and returns the brute-force optimum of that cost."""

from __future__ import annotations

import pytest
import synthetic as S
from oracles import brute_force
from test_search import CLUSTERS
from test_search_bounds import _bn_graph, _bn_strategies, exact_and_admissible_on

from hapnb.cost.buffers import UpdateRead
from hapnb.hardware.cluster import Cluster
from hapnb.synth.search import Search
from hapnb.synth.updates import BufferUpdates
from hapnb.triples import theory


def _with_updates(seed: int):
    """A random graph whose first product (it can be partial) and loss (no op reads it: charged when the
    program completes) stand for batch statistics a buffer update reads, with the first weight (charged
    when it is loaded stored sharded)."""
    g = S.random_graph(seed)
    first = g.ops[0].outputs[0]
    w = next(t for t in g.ops[0].inputs if g.tensors[t].role == "param")
    reads = (UpdateRead("bn.running_mean", (first,), (w,)), UpdateRead("bn.running_var", (g.loss,), ()))
    object.__setattr__(g, "_update_reads", reads)  # what buffers.update_reads caches for a traced program
    return g


@pytest.mark.parametrize("seed", range(12))
def test_the_search_charges_buffer_updates_and_returns_the_brute_force_optimum(seed):
    th = theory(_with_updates(seed), S.strategies)
    c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
    ratios = None if seed % 2 else [[(j + 1.0) for j in range(c.n)]]
    s = Search(th, c, ratios=ratios)
    res = s.run()
    bf_cost, _ = brute_force(th, c, s.ratios)  # CostModel.evaluate: the updates in the last stage
    assert res.optimal and res.cost == pytest.approx(bf_cost, rel=1e-9)
    assert res.cost == pytest.approx(s.cost_model.evaluate(res.program, s.ratios).cost_s, rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_counts_a_statistic_s_update_admissibly(seed, monkeypatch):
    # a batch norm whose mean and variance buffer updates read: held sharded (the feature-split norm that
    # a column-split layer makes), each update all-gathers its statistic. The bound charges the update as
    # one more consumer of the statistic (its price per form, BufferUpdates.form_prices): A* returns the
    # brute-force optimum, no node on either optimal path scores above it, and the root bound is the optimum
    # here; without the update's charge the root is 4-7 % lower
    g = _bn_graph(*[(8, 16), (64, 8), (8, 16)][seed])
    mean, var = (op.outputs[0] for op in g.ops if op.target == "colsum")
    reads = (UpdateRead("bn.running_mean", (mean,), ()), UpdateRead("bn.running_var", (var,), ()))
    object.__setattr__(g, "_update_reads", reads)
    th = theory(g, _bn_strategies)
    c = Cluster.parse(CLUSTERS[[0, 0, 2][seed]])
    s = exact_and_admissible_on(th, c, None, walk=True)
    opt = s.result().cost
    assert any(f.kind == "G" for st in s.result().program for f in st.strategy.outputs if st.op == 1)
    assert Search(th, c).node(0).score == pytest.approx(opt, rel=1e-9)
    monkeypatch.setattr(BufferUpdates, "form_prices", lambda self: {})
    assert Search(th, c).node(0).score < opt * 0.98


@pytest.mark.parametrize("seed", range(12))
def test_no_node_on_an_optimal_path_scores_above_the_optimum_with_updates(seed):
    # the random graphs above, whose first product may be a branch tensor: the update's charge in its Joint
    # keeps every node on A*'s optimal path and on brute force's (walked as a seed) at or below the optimum
    th = theory(_with_updates(seed), S.strategies)
    c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
    exact_and_admissible_on(th, c, None if seed % 2 else [[(j + 1.0) for j in range(c.n)]], walk=True)
