"""The cost model against hand computation: stages, computation per device, collective terms with their
duals, latency + bytes/bandwidth, padded shards driven by the largest one, memory per device, and the
linear form the LP reads."""

from __future__ import annotations

import random

import pytest
import synthetic as S

from hapnb.cluster import Cluster, Collective
from hapnb.cost import Conversion, CostModel, Load, Step
from hapnb.forms import G, I, R
from hapnb.triples import theory

BATCH, DIMS = 64, (32, 16)


@pytest.fixture
def setup():
    g = S.mlp_graph(batch=BATCH, dims=DIMS)  # x[64,32] @ w0[32,16] -> sum
    th = theory(g, S.strategies)
    flat = Collective(1e-5, 1e9)
    c = Cluster.parse("1x4e12+1x1e12").with_collectives(
        **{
            k: flat
            for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce")
        }
    )
    return g, th, c, CostModel(th, c)


def _strategy(th, op, name):
    return next(s for s in th.strategies[op] if s.name == name)


def _data_parallel(g, th) -> list[Step]:
    """x sharded on the batch, the weight replicated (its gradient all-reduced), the sum on G(0)."""
    x, w = g.tensor("x").id, g.tensor("w0").id
    mm, total = g.ops[0], g.ops[1]
    return [
        Step(mm.id, _strategy(th, mm.id, "data"), (Load(x, G(0)), Load(w, I))),
        Step(total.id, _strategy(th, total.id, "G0"), ()),
    ]


def test_data_parallel_program_by_hand(setup):
    g, th, c, cm = setup
    mm, total = g.ops[0], g.ops[1]
    prog = _data_parallel(g, th)
    ratios = ((0.8, 0.2),)
    ev = cm.evaluate(prog, ratios)
    # one stage: the replicated weight all-reduces its gradient (latency + bytes / bandwidth)
    assert len(ev.stages) == 1
    w_bytes = 32 * 16 * 4
    assert ev.stages[0].comm_s == pytest.approx(1e-5 + w_bytes / 1e9)
    # computation: 3 x forward flops (fwd + bwd) scaled by each device's ratio, over its throughput
    fl = 3 * (mm.flops + total.flops)
    assert ev.stages[0].comp_s == pytest.approx((fl * 0.8 / 4e12, fl * 0.2 / 1e12))
    assert ev.cost_s == pytest.approx(ev.stages[0].comm_s + max(ev.stages[0].comp_s))


def test_padded_all_gather_is_driven_by_the_largest_shard_and_charges_its_dual(setup):
    g, th, c, cm = setup
    h = g.ops[0].outputs[0]  # [64, 16] activation, needs a gradient
    (term,) = cm.conversion_terms(Conversion(h, "all_gather", G(0), I))
    nbytes = BATCH * 16 * 4
    # forward all-gather + backward reduce-scatter, each n * max_shard bytes
    assert term.const == pytest.approx(2e-5)
    assert term.time(((0.75, 0.25),)) == pytest.approx(2e-5 + 2 * 2 * nbytes * 0.75 / 1e9)
    assert term.time(((0.5, 0.5),)) < term.time(((0.75, 0.25),))
    # grouped broadcast: one exact-size broadcast per device, independent of the ratios
    (grouped,) = cm.conversion_terms(Conversion(h, "grouped_all_gather", G(0), I))
    assert grouped.slope == 0.0 and grouped.const == pytest.approx(2 * (2 * 1e-5 + nbytes / 1e9))
    # free conversions move nothing
    assert cm.conversion_terms(Conversion(h, "slice", I, G(0))) == ()
    (ar,) = cm.conversion_terms(Conversion(h, "all_reduce", R, I))
    assert ar.const == pytest.approx(2 * (1e-5 + nbytes / 1e9))


def test_lower_bound_is_total_flops_over_total_throughput(setup):
    g, th, c, cm = setup
    assert cm.lower_bound() == pytest.approx(3 * sum(op.flops for op in g.ops) / 5e12)


def test_comp_linear_is_the_cost_models_own_computation(setup):
    g, th, c, cm = setup
    rnd = random.Random(0)
    for op in g.ops:
        for s in th.strategies[op.id]:
            step = Step(
                op.id,
                s,
                tuple(Load(t, f) for t, f in zip(op.inputs, s.inputs) if g.tensors[t].role != "activation"),
            )
            coef, const = cm.comp_linear(step)
            for _ in range(3):
                a = rnd.random()
                r = ((a, 1 - a),)
                want = cm.step_comp(step, r)
                got = [sum(coef[s_][j] * r[s_][j] for s_ in coef) + const[j] for j in range(2)]
                assert got == pytest.approx(want, rel=1e-12, abs=1e-18)


def test_memory_counts_parameter_state_and_local_shards(setup):
    g, th, c, cm = setup
    prog = _data_parallel(g, th)
    ratios = ((0.75, 0.25),)
    mem = cm.memory(prog, (), ratios)
    w_state = 4 * 32 * 16 * 4  # weight + gradient + two Adam moments
    x_rows = (48, 16)
    for j in range(2):
        want = w_state + x_rows[j] * 32 * 4 + x_rows[j] * 16 * 4 + 4  # input shard, activation shard, loss
        assert mem[j] == want
