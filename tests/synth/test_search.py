"""A* against brute force, determinism, pins, step events."""

from __future__ import annotations

import pytest
import synthetic as S
from oracles import brute_force

from hapnb.cost.model import CostModel
from hapnb.hardware.cluster import Cluster
from hapnb.ir.forms import G, I, R
from hapnb.synth.search import PinError, Search
from hapnb.triples import theory

CLUSTERS = ["2xV100+2xP100", "V100+P100", "4xA100", "1x5e12+1x1e12+1x2e12"]


@pytest.mark.parametrize("seed", range(24))
def test_astar_matches_brute_force(seed):
    g = S.random_graph(seed)
    th = theory(g, S.strategies)
    c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
    # also uneven, non-proportional ratios
    ratios = None if seed % 2 else [[(j + 1.0) for j in range(c.n)]]
    s = Search(th, c, ratios=ratios)
    res = s.run()
    assert res.optimal
    bf_cost, bf_prog = brute_force(th, c, s.ratios)
    assert res.cost == pytest.approx(bf_cost, rel=1e-9)
    # the program found evaluates to the cost reported
    assert CostModel(th, c).evaluate(res.program, s.ratios).cost_s == pytest.approx(res.cost, rel=1e-9)


def test_megatron_style_program_for_mlp():
    g = S.mlp_graph(batch=8, dims=(1024, 4096, 1024))
    th = theory(g, S.strategies)
    res = Search(th, Cluster.parse("4xA100")).run()
    names = [st.strategy.name for st in res.program]
    assert names[0] == "column" and names[2] == "row"  # small batch, big weights: tensor parallel wins


def test_deterministic():
    g = S.random_graph(3)
    th = theory(g, S.strategies)
    c = Cluster.parse("2xV100+2xP100")
    a = Search(th, c).run()
    b = Search(theory(g, S.strategies), c).run()
    assert a.program == b.program and a.cost == b.cost


def test_pins_honoured_and_rejected():
    g = S.mlp_graph(batch=8, dims=(1024, 4096, 1024))
    th = theory(g, S.strategies)
    c = Cluster.parse("4xA100")
    res = Search(th, c, pins={"w0": G(0)}).run()
    loads = {ld.tensor: ld.form for st in res.program for ld in st.loads}
    assert loads[g.tensor("w0").id] == G(0)
    res = Search(th, c, pins={"x": G(0)}).run()
    loads = {ld.tensor: ld.form for st in res.program for ld in st.loads}
    assert loads[g.tensor("x").id] == G(0)
    with pytest.raises(PinError, match="w0"):
        Search(th, c, pins={"w0": G(5)})
    with pytest.raises(PinError, match="nope"):
        Search(th, c, pins={"nope": I})
    with pytest.raises(PinError, match="cannot be satisfied"):
        Search(th, c, pins={"mm_0": R, "x": G(0)})


def test_step_events_and_frontier():
    g = S.mlp_graph()
    th = theory(g, S.strategies)
    s = Search(th, Cluster.parse("2xV100+2xP100"))
    e = s.step()
    assert e.popped is not None and e.popped.position == 0
    assert e.children and all(ch.parent == e.popped.id for ch in e.children)
    assert s.frontier and s.frontier[0].score <= s.frontier[-1].score
    while not s.step().done:
        pass
    assert s.done and s.best is not None and s.best.complete
    assert s.best.cost == pytest.approx(Search(th, Cluster.parse("2xV100+2xP100")).run().cost)
    assert s.stats["expansions"] >= 1


def test_sfb_chosen_for_small_batch_large_weight_and_not_otherwise():
    g = S.mlp_graph(batch=8, dims=(4096, 4096, 4096))
    th = theory(g, S.strategies)
    c = Cluster.parse("2xV100+2xP100")
    res = Search(th, c, pins={"x": G(0)}).run()
    first = res.program[0]
    assert first.strategy.name == "sfb"
    assert [ld.sfb for ld in first.loads if g.tensors[ld.tensor].role == "param"] == [True]
    # with SFB switched off the search falls back to all-reducing the weight gradients, at a higher cost
    off = Search(th, c, pins={"x": G(0)}, options={"sfb": False}).run()
    assert off.cost > res.cost
    # a big batch makes the sufficient factors larger than the gradient: plain data parallel wins
    g2 = S.mlp_graph(batch=65536, dims=(64, 64, 64))
    th2 = theory(g2, S.strategies)
    res2 = Search(th2, c, pins={"x": G(0)}).run()
    assert "sfb" not in {st.strategy.name for st in res2.program}


def _gather_strategies(graph, op):
    out = S.strategies(graph, op)
    if op.target == "sum":  # force the all-gather: only the replicated sum is allowed
        return [s for s in out if s.name == "replicated"]
    return [s for s in out if s.name == "data"]


def test_grouped_broadcast_wins_on_skewed_ratios_padded_on_even():
    th = theory(S.gather_graph(), _gather_strategies)
    c = Cluster.parse("8xP100")

    def gather_kind(ratios):
        res = Search(th, c, ratios=ratios, pins={"x": G(0), "w": I}).run()
        return [cv.name for st in res.program for cv in st.conversions]

    assert gather_kind([1.0] * 8) == ["all_gather"]  # even: no padding, one launch
    assert gather_kind([0.93] + [0.01] * 7) == ["grouped_all_gather"]  # skewed: padding would be 8x
