"""Every collective a training batch norm's program runs is priced (issue 18, :mod:`hapnb.cost.buffers`):
the forward statistics all-reduces and their backward duals, the gradient all-reduces of the replicated
weights, and the collectives of the running-statistics updates (a statistic the plan keeps partial or
sharded). The generated rank program is run on a fake two-rank process group that records each
collective; the plan's priced terms must be exactly those (count, kind and bytes)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from synthetic import BNNet
from torch import nn

import hapnb as hap
import hapnb.runtime.collectives as C
from hapnb.cost.buffers import update_collectives, update_reads
from hapnb.cost.model import CostModel
from hapnb.ir.collective_table import COLLECTIVES
from hapnb.plans.explain import program_steps
from hapnb.runtime.codegen import generate


@pytest.fixture(scope="module")
def bn_graph():
    torch.manual_seed(0)
    inputs = (torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,)))
    return hap.trace(BNNet(), inputs), inputs


def _ran(plan: hap.Plan, inputs: tuple[torch.Tensor, ...]) -> Counter:
    """(kind, whole-tensor bytes) of every collective rank 0's program runs in one forward + backward,
    on a fake two-rank group (no data moves; the calls and their sizes are the program's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    ran: Counter = Counter()
    orig = {k: getattr(C, k) for k in ("_gather", "_scatter", "_reduce", "_to_all", "_recut")}

    def record(name: str, kind: str, grouped: str = ""):  # noqa: ANN202
        def call(x: torch.Tensor, *args):  # noqa: ANN202
            # grouped (padded=False): one broadcast / reduce per rank, priced as one of the whole tensor
            k = grouped if grouped and args[2] is False else kind
            if kind == "all_gather":  # x is the rank's shard: the whole tensor is every rank's lengths
                dim, lengths = args[0], args[1]
                rows = x.numel() // x.shape[dim] if x.shape[dim] else 0
                ran[(k, x.element_size() * rows * sum(lengths))] += 1
            else:
                ran[(k, x.nbytes)] += 1
            return orig[name](x, *args)

        return call

    kinds = {"_gather": ("all_gather", "broadcast"), "_scatter": ("reduce_scatter", "reduce"),
             "_reduce": ("all_reduce",), "_to_all": ("all_to_all",), "_recut": ("all_to_all",)}  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for name, kind in kinds.items():
            setattr(C, name, record(name, *kind))
        prog = generate(plan, plan.graph, 0, dropout=False)
        prog.module(*inputs).backward()
    finally:
        for name, fn in orig.items():
            setattr(C, name, fn)
        dist.destroy_process_group()
    return ran


def _priced(plan: hap.Plan) -> Counter:
    """(kind, whole-tensor bytes) of every collective the plan prices: each term's forward and backward
    part (a collective's forward and dual kinds from the collective table)."""
    g = plan.graph
    out: Counter = Counter()
    for ins in plan.program:
        for cc in ins.comm:
            if cc.gradient:
                out[("all_reduce", cc.nbytes)] += 1
            elif ins.kind == "collective":
                spec, nbytes = COLLECTIVES[ins.name], g.tensor(ins.tensor).nbytes
                out[(spec.forward, nbytes)] += cc.forward_s > 0
                out[(spec.backward, nbytes)] += cc.backward_s > 0
            else:
                assert cc.what.startswith("buffer update ") and cc.backward_s == 0, cc
                out[(cc.kind, g.tensor(cc.what.split()[-1]).nbytes)] += 1
    return +out


@pytest.mark.parametrize(
    "pins,update",
    [
        ({"x": hap.Shard(0)}, None),  # batch sharded: the plan's own all-reduces give the statistics
        # var and var + eps made partial: var + eps reduced for rsqrt, var left partial for the update (pinning
        # var alone, the search, which charges the update, reduces var itself: no update collective)
        ({"x": hap.Shard(0), "div_1": hap.Partial(), "add_3": hap.Partial()}, "all_reduce"),
        ({"conv2d": hap.Shard(1)}, "all_gather"),  # channels sharded: the statistics are sharded
    ],
)
def test_priced_collectives_are_the_ones_the_program_runs(bn_graph, pins, update) -> None:
    g, inputs = bn_graph
    plan = hap.synthesize(g, "1xV100+1xP100", pins=pins)
    assert _priced(plan) == _ran(plan, inputs)
    ups = [c for i in plan.program for c in i.comm if c.what.startswith("buffer update ")]
    assert {c.kind for c in ups} == ({update} if update else set())
    if update:  # charged to the last stage, listed there, and counted in the summary
        assert plan.stages[-1].comm[-len(ups) :] == tuple(c.what for c in ups)
        assert f"(+{len(ups)} for buffer updates)" in plan.summary()
        assert plan.cost_s == pytest.approx(sum(s.time_s for s in plan.stages))
        th = hap.theory(g)  # what the cost model re-evaluates (explain, why-not) prices them too
        cm = CostModel(th, plan.cluster)
        steps, _ = program_steps(plan, th)
        assert cm.evaluate(steps, plan.ratios).cost_s == pytest.approx(plan.cost_s)
        assert [t.what for t in cm.update_terms(steps)] == [c.what for c in ups]


def test_update_reads_name_the_statistics(bn_graph) -> None:
    g, _ = bn_graph
    reads = {r.buffer: [g.tensors[t].name for t in r.activations] for r in update_reads(g)}
    # the batch mean and biased variance; the step count reads only itself
    assert reads == {"bn.running_mean": ["div"], "bn.running_var": ["div_1"], "bn.num_batches_tracked": []}
    assert update_collectives(g, ()) == ()  # no form made yet: nothing to reduce or gather
    mlp = hap.trace(nn.Sequential(nn.Linear(4, 3)), (torch.randn(2, 4),), loss=lambda o: o.sum())
    assert update_reads(mlp) == ()
