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


def _sumk_strategies(graph, op):
    """:func:`synthetic.strategies`, and for ``sumk`` (the sum of k same-shaped tensors) one strategy per
    form every input and the output share: replicated, each dim sharded, partial."""
    if op.target != "sumk":
        return S.strategies(graph, op)
    from hapnb.rules import Strategy

    k, nd, F = len(op.inputs), len(graph.tensors[op.outputs[0]].shape), op.flops
    out = [Strategy("replicated", (I,) * k, (I,), 0.0, 3 * F), Strategy("R", (R,) * k, (R,), 0.0, 3 * F)]
    return out + [Strategy(f"G{d}", (G(d),) * k, (G(d),), 3 * F, 0.0) for d in range(nd)]


def _sumk_graph(k: int, batch: int = 16, d: int = 32):
    """k matmuls of one input, each free to leave its output in another form (data: G0, column: G1, row:
    R, replicated: I), summed by one op that takes all k at once (as a Mamba block's ``stack`` of its scan
    steps): each input it needs in another form has up to two collectives to get there."""
    b = S.Builder()
    x = b.tensor("x", (batch, d), "input")
    hs = [
        b.op("mm", [x, b.tensor(f"w{i}", (d, d), "param")], (batch, d), 2.0 * batch * d * d) for i in range(k)
    ]
    s = b.op("sumk", hs, (batch, d), float(k * batch * d))
    return b.build(b.op("sum", [s], (), float(batch * d)), f"gather{k}")


@pytest.mark.parametrize("cluster", ["2xV100+2xP100", "1x5e12+1x1e12+1x2e12"])
def test_an_op_taking_many_inputs_gets_each_by_its_cheapest_collective_alone(cluster):
    # every collective giving a needed form leaves the same state, so the search keeps the cheapest alone:
    # A* still equals brute force (which tries every collective), and an op with k inputs to convert
    # expands to at most one child per strategy instead of the product of the options (2^k)
    c = Cluster.parse(cluster)
    small = theory(_sumk_graph(3), _sumk_strategies)
    s = Search(small, c, ratios=[[(j + 1.0) for j in range(c.n)]])
    res = s.run()
    bf_cost, _ = brute_force(small, c, s.ratios)
    assert res.optimal and res.cost == pytest.approx(bf_cost, rel=1e-9)

    k = 12
    th = theory(_sumk_graph(k), _sumk_strategies)
    s = Search(th, c)
    at = next(op.id for op in th.graph.ops if op.target == "sumk")
    widest = 0
    while not (ev := s.step()).done:
        if ev.popped is not None and ev.popped.position == at:
            widest = max(widest, len(ev.children) + len(ev.pruned))
    assert 0 < widest <= len(th.strategies[at])
    assert s.result().optimal


def test_a_state_space_lm_s_scan_expands_to_one_child_per_strategy():
    # HF MambaForCausalLM runs its selective scan step by step and stacks the 16 steps' outputs: the stack
    # takes 16 tensors that a step may leave in another form. Each was offered every collective from every
    # present form, and one expansion of the stack made 65,536 children (a 2-layer Mamba at batch 8 x seq 16
    # took 67 s to plan, 8.8 million children in one search; now 2.8 s)
    transformers = pytest.importorskip("transformers")
    import torch

    from examples import corpus
    from hapnb.tracing import trace

    cfg = transformers.MambaConfig(
        vocab_size=128,
        hidden_size=32,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        use_cache=False,
    )
    torch.manual_seed(0)
    lm = corpus.TokensLoss(
        transformers.MambaForCausalLM(cfg), lambda m, x: m(input_ids=x, labels=x).loss, "mamba"
    )
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    th = theory(trace(lm.train(), (ids,), name="mamba"))
    stacks = [op.id for op in th.graph.ops if op.target == "aten.stack.default" and len(op.inputs) == 16]
    assert stacks
    s = Search(th, Cluster.parse("V100+P100"))
    widths: list[int] = []
    for _ in range(20_000):
        ev = s.step()
        if ev.done or len(widths) == 3:
            break
        if ev.popped is not None and ev.popped.position in stacks:
            widths.append(len(ev.children) + len(ev.pruned))
    assert widths and max(widths) <= max(len(th.strategies[k]) for k in stacks)
