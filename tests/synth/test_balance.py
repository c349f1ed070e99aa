"""The ratio LP against known answers."""

from __future__ import annotations

import pytest
import synthetic as S

from hapnb.cost.model import Conversion, CostModel, Load, Step
from hapnb.hardware.cluster import Cluster
from hapnb.ir.forms import G, I, R
from hapnb.rules import Strategy
from hapnb.synth.balance import apply_ratio_pins, balance, parse_ratio_pins, solver_name
from hapnb.triples import theory


def test_compute_only_gives_throughput_proportional_ratios():
    g = S.mlp_graph(batch=1024, dims=(64, 64, 64))
    th = theory(g, S.strategies)
    c = Cluster.parse("1x4e12+1x2e12+1x1e12+1x1e12")
    # drop the gradient all-reduce: load weights sharded (a compute-only program)
    prog = []
    for st in S.dp_program(th):
        loads = tuple(
            Load(ld.tensor, ld.form if g.tensors[ld.tensor].role == "input" else G(0)) for ld in st.loads
        )
        prog.append(Step(st.op, st.strategy, loads))
    res = balance(CostModel(th, c), prog)
    assert res.ratios[0] == pytest.approx((0.5, 0.25, 0.125, 0.125), abs=1e-6)


def test_identical_devices_give_even_ratios():
    g = S.mlp_graph(batch=1024, dims=(64, 64, 64))
    th = theory(g, S.strategies)
    res = balance(CostModel(th, Cluster.parse("4xA100")), S.dp_program(th))
    assert res.ratios[0] == pytest.approx((0.25,) * 4, abs=1e-6)


def test_communication_only_gives_even_ratios():
    """A program whose only ratio-dependent cost is a padded all-gather: even shards are best."""
    g = S.mlp_graph(batch=64, dims=(4, 4096))
    th = theory(g, S.strategies)
    c = Cluster.parse("1x4e12+1x1e12+1x1e12")
    mm = g.ops[0]
    # x sharded, W replicated -> y G0 (no flops worth mentioning), then all-gather y and sum replicated
    tiny = Strategy("data", (G(0), I), (G(0),), 0.0, 0.0)
    repl = Strategy("replicated", (I,), (R,), 0.0, 0.0)
    prog = [
        Step(mm.id, tiny, (Load(mm.inputs[0], G(0)), Load(mm.inputs[1], G(0)))),
        Step(g.ops[1].id, repl, (), (Conversion(mm.outputs[0], "all_gather", G(0), I),)),
    ]
    res = balance(CostModel(th, c), prog)
    assert res.ratios[0] == pytest.approx((1 / 3,) * 3, abs=1e-6)


def test_lp_cost_equals_evaluate_and_keeps_constants():
    g = S.mlp_graph(batch=256, dims=(512, 512, 512))
    th = theory(g, S.strategies)
    cm = CostModel(th, Cluster.parse("2xV100+2xP100"))
    prog = S.dp_program(th)
    res = balance(cm, prog)
    assert res.cost == pytest.approx(cm.evaluate(prog, res.ratios).cost_s, rel=1e-6)
    # the replicated weights' gradient all-reduce is a constant and is part of the cost
    assert res.cost > sum(st.comp_s[0] for st in cm.evaluate(prog, res.ratios).stages) * 0.5
    assert solver_name() in ("HiGHS", "CBC")


def test_ratio_pins_fixed_and_bounds():
    g = S.mlp_graph(batch=1024, dims=(64, 64, 64))
    th = theory(g, S.strategies)
    c = Cluster.parse("1x4e12+1x2e12+1x1e12+1x1e12")
    cm = CostModel(th, c)
    pins = parse_ratio_pins({c.names[0]: 0.1, c.names[3]: (0.3, 0.4)}, c.names)
    res = balance(cm, S.dp_program(th), pins)
    assert res.ratios[0][0] == pytest.approx(0.1, abs=1e-7)
    assert 0.3 - 1e-7 <= res.ratios[0][3] <= 0.4 + 1e-7
    assert sum(res.ratios[0]) == pytest.approx(1.0)
    start = apply_ratio_pins((0.5, 0.25, 0.125, 0.125), pins, c.names, c.flops)
    assert start[0] == pytest.approx(0.1) and 0.3 - 1e-9 <= start[3] <= 0.4 + 1e-9


def test_bad_ratio_pins_are_rejected():
    names = ("a", "b")
    with pytest.raises(ValueError, match="no device"):
        parse_ratio_pins({"zz": 0.5}, names)
    with pytest.raises(ValueError, match="cannot be satisfied"):
        parse_ratio_pins({"a": 0.7, "b": 0.7}, names)
    with pytest.raises(ValueError, match="lo <= hi"):
        parse_ratio_pins({"a": (0.6, 0.2)}, names)
