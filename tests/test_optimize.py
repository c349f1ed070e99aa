"""The Q/B alternation (hapnb.optimize) on its own: it returns a fixpoint of search and LP."""

from __future__ import annotations

import pytest

import hapnb as hap
from hapnb import zoo


@pytest.mark.parametrize("name", ["gpt", "vgg19"])
def test_program_is_paired_with_ratios_optimised_for_it(name):
    """The Q/B loop returns a fixpoint: re-balancing the final program cannot improve it, and the plan
    costs exactly what the cost model says at its ratios."""
    from hapnb.balance import balance
    from hapnb.cost import CostModel
    from hapnb.optimize import optimize
    from hapnb.plan import make_plan

    model, inputs, _ = zoo.build(name, **{**zoo.TINY[name], "devices": 4})
    th = hap.theory(hap.trace(model, inputs, name=name))
    c = hap.Cluster.parse("2xA100+2xP100")
    best = optimize(th, c)
    cm = CostModel(th, c)
    again = balance(cm, best.program)
    assert again.cost >= best.cost_s * (1 - 1e-9)
    assert cm.evaluate(best.program, best.ratios).cost_s == pytest.approx(best.cost_s, rel=1e-12)
    assert make_plan(th, c, best.program, best.extra, best.ratios).cost_s == pytest.approx(best.cost_s)
