"""synthesize / baselines on real traced models: bounds, pins, ratios, segments, memory, virtual devices, errors."""

from __future__ import annotations

import pytest
import torch

import hapnb as hap
from hapnb import zoo
from hapnb.plans.synthesis import OutOfMemoryError
from hapnb.synth.search import PinError

CLUSTERS = ["paper-hetero-8", "a100-p100", "2xV100+2xP100"]


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in zoo.ZOO_NAMES:
        for c in CLUSTERS:
            n = hap.Cluster.resolve(c).n
            model, inputs, spec = zoo.build(name, **{**zoo.TINY[name], "devices": n})
            out[(name, c)] = hap.trace(model, inputs, name=name)
    return out


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_the_tensor_parallel_baseline_keeps_the_batch_whole(graphs, name):
    """``tp_ev`` is Megatron-style: weights split, no tensor split on the batch (its replicated token ids
    are never cut by a free slice, which would make it data parallelism)."""
    from hapnb.synth.seeds import batch_dims
    from hapnb.triples import dim_class

    g = graphs[(name, "2xV100+2xP100")]
    th = hap.theory(g)
    whole = {p for n, d in batch_dims(th).items() for p in dim_class(th, g.tensor(n).id, d)}
    tp = hap.baselines(th, "2xV100+2xP100")["tp_ev"]
    assert any(i.kind == "load" and i.form.startswith("G") for i in tp.program), "weights are split"
    for i in tp.program:
        for tensor, form in i.outputs:
            f = hap.parse_form(form) if form else None
            assert f is None or f.kind != "G" or (g.tensor(tensor).id, f.dim) not in whole, (
                i.name,
                tensor,
                form,
            )


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_plan_between_lower_bound_and_baselines(graphs, name, cluster):
    g = graphs[(name, cluster)]
    plan = hap.synthesize(g, cluster, pick="cost")
    assert plan.cost_s >= plan.lower_bound_s * (1 - 1e-9)
    base = hap.baselines(g, cluster)
    assert {"dp_ev", "dp_cp"} <= set(base)
    for k, b in base.items():
        assert plan.cost_s <= b.cost_s * (1 + 1e-9), k
        assert b.cost_s >= b.lower_bound_s * (1 - 1e-9)
    assert plan.stats["optimal"]
    # the plan is the best round of the Q/B history, and it is costed at the ratios balanced for it
    assert plan.history and min(r.balanced_cost_s for r in plan.history) == pytest.approx(plan.cost_s)
    assert all(abs(sum(r) - 1) < 1e-9 for r in plan.ratios)
    # the default picks by simulated time among the loop's candidates and the baselines' programs
    fast = hap.synthesize(g, cluster)
    assert fast.cost_s >= fast.lower_bound_s * (1 - 1e-9)
    assert fast.simulated_s <= plan.simulated_s * (1 + 1e-9)
    for k, b in base.items():
        assert fast.simulated_s <= b.simulated_s * (1 + 1e-9), k
    assert fast.stats["pick"] == "simulated"
    assert fast.stats["candidates_simulated"] + fast.stats["candidates_bounded"] >= 1 + len(base) - 1


def test_form_pins_are_honoured():
    opts = {**zoo.TINY["mlp"], "hidden": 256, "batch": 8}
    plan = hap.synthesize("mlp", "4xA100", pins={"layers.0.weight": hap.Shard(1)}, **opts)
    assert plan.form_of("layers.0.weight") == ["G1"]
    plan = hap.synthesize("mlp", "4xA100", pins={"x": hap.Replicate()}, **opts)
    assert plan.form_of("x") == ["I"]


def test_unsatisfiable_pins_name_the_pin():
    opts = {**zoo.TINY["mlp"], "batch": 8}
    with pytest.raises(PinError, match="layers.0.weight"):
        hap.synthesize("mlp", "4xA100", pins={"layers.0.weight": hap.Shard(7)}, **opts)
    with pytest.raises(PinError, match="nosuch"):
        hap.synthesize("mlp", "4xA100", pins={"nosuch.weight": hap.Replicate()}, **opts)
    with pytest.raises(PinError, match="cannot be satisfied"):
        hap.synthesize("mlp", "4xA100", pins={"x": hap.Shard(1), "layers.0.weight": hap.Shard(0)}, **opts)


def test_fixed_and_pinned_ratios():
    opts = {**zoo.TINY["mlp"]}
    fixed = [0.4, 0.3, 0.2, 0.1]
    plan = hap.synthesize("mlp", "2xV100+2xP100", ratios=fixed, **opts)
    assert plan.ratios[0] == pytest.approx(tuple(fixed))
    plan = hap.synthesize("mlp", "2xV100+2xP100", ratios={"p100-1": 0.05}, **opts)
    assert plan.ratios[0][3] == pytest.approx(0.05, abs=1e-7)


def test_zero_ratio_gives_zero_length_shards():
    plan = hap.synthesize("mlp", "2xV100+2xP100", ratios=[0.5, 0.3, 0.2, 0.0], **zoo.TINY["mlp"])
    assert any(ls[3] == 0 for _, _, ls in plan.lengths)
    for _, _, ls in plan.lengths:
        assert all(x >= 0 for x in ls)


def test_segments_per_layer():
    g_opts = {**zoo.TINY["gpt"], "layers": 3}
    plan = hap.synthesize("gpt", "2xV100+2xP100", segments="layer", **g_opts)
    assert len(plan.ratios) == 4  # outside any layer + 3 layers
    assert all(abs(sum(r) - 1) < 1e-9 for r in plan.ratios)
    one = hap.synthesize("gpt", "2xV100+2xP100", **g_opts)
    assert plan.cost_s <= one.cost_s * 1.02  # more freedom, same cost model (reshard bound may cost a little)


def test_out_of_memory_is_a_clear_error():
    c = hap.Cluster.parse("2xV100+2xP100")
    tiny = c.replace(devices=tuple(d.__class__(**{**d.__dict__, "memory_bytes": 1 << 8}) for d in c.devices))
    with pytest.raises(OutOfMemoryError, match="does not fit"):
        hap.synthesize("mlp", tiny, **zoo.TINY["mlp"])
    plan = hap.synthesize("mlp", tiny, check_memory=False, **zoo.TINY["mlp"])
    assert max(plan.memory_bytes) > 1 << 8


def test_user_module_and_bad_inputs():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    plan = hap.synthesize(model, "2xA100", example_inputs=(x,), loss=lambda out: out.pow(2).mean())
    assert plan.cost_s > 0 and plan.program
    with pytest.raises(ValueError, match="example_inputs"):
        hap.synthesize(model, "2xA100")
    with pytest.raises(ValueError):
        hap.synthesize("no-such-model", "2xA100")
    with pytest.raises(ValueError):
        hap.synthesize("mlp", "3xNOPE")


def test_virtual_devices_add_inner_data_parallel_sync():
    phys = hap.Cluster.preset("paper-hetero-16")
    virt = phys.virtual()
    assert virt.n == 8 and all(d.gpus == 2 for d in virt.devices)
    g_opts = {**zoo.TINY["gpt"], "batch": 16}
    plan = hap.synthesize("gpt", virt, **g_opts)
    assert plan.cost_s >= plan.lower_bound_s
    # the same devices as single GPUs with the same total throughput: no inner sync, so cheaper or equal
    flat = virt.replace(devices=tuple(d.__class__(**{**d.__dict__, "gpus": 1}) for d in virt.devices))
    assert hap.synthesize("gpt", flat, **g_opts).cost_s < plan.cost_s


def test_per_layer_segments_run_exactly():
    """Segments with different ratios meet through reshards; the program still equals one device."""
    plan = hap.synthesize("gpt", "2xV100+1xP100", segments="layer", **{**zoo.TINY["gpt"], "layers": 3})
    assert len({r for r in plan.ratios}) > 1  # the LP gave the segments different ratios
    assert any(i.name == "reshard" for i in plan.program)
    assert hap.verify(plan, nproc=3, steps=2).ok


def test_duplex_keeps_pins_and_ratios():
    """synthesize(duplex=True) honours form pins, fixed ratios (costed by the duplex model) and ratio pins."""
    opts = {**zoo.TINY["mlp"], "hidden": 256, "batch": 8}
    plan = hap.synthesize("mlp", "4xA100", pins={"layers.0.weight": hap.Shard(1)}, duplex=True, **opts)
    assert plan.duplex and plan.form_of("layers.0.weight") == ["G1"]
    fixed = [0.4, 0.3, 0.2, 0.1]
    plan = hap.synthesize("mlp", "2xV100+2xP100", ratios=fixed, duplex=True, **zoo.TINY["mlp"])
    assert plan.ratios[0] == pytest.approx(tuple(fixed)) and plan.history[-1].balance_s == 0.0
    plain = hap.synthesize("mlp", "2xV100+2xP100", ratios=fixed, **zoo.TINY["mlp"])
    assert plan.cost_s <= plain.cost_s * (1 + 1e-12)
    plan = hap.synthesize(
        "mlp", "2xV100+2xP100", ratios={"p100-1": 0.05}, duplex=True, pick="cost", **zoo.TINY["mlp"]
    )
    assert plan.ratios[0][3] == pytest.approx(0.05, abs=1e-7)
    assert plan.cost_s == pytest.approx(min(r.balanced_cost_s for r in plan.history))


def test_pick_is_checked_and_the_simulated_pick_is_the_fastest_candidate():
    with pytest.raises(ValueError, match="pick"):
        hap.synthesize("mlp", "2xV100", pick="fastest", **zoo.TINY["mlp"])
    g = hap.trace(*zoo.build("mlp", **{**zoo.TINY["mlp"], "devices": 4})[:2], name="mlp")
    plan = hap.synthesize(g, "paper-hetero-8")
    by_cost = hap.synthesize(g, "paper-hetero-8", pick="cost")
    assert plan.simulated_s == pytest.approx(hap.simulate(plan).iteration_s)
    assert plan.simulated_s <= by_cost.simulated_s * (1 + 1e-9)
    assert by_cost.stats["chosen"] == "search" and by_cost.stats["candidates_simulated"] == 1


def test_duplex_plans_cut_the_batch_into_even_local_batches():
    """The LP's ratios would give 1xV100+1xP100 a batch of 8 as 5 + 3; a duplex plan rounds to pairs."""
    from hapnb.plans.synthesis import even_batch_ratios

    plain = hap.synthesize("mlp", "1xV100+1xP100", layers=2, hidden=64, input=32, batch=8)
    duplex = hap.synthesize("mlp", "1xV100+1xP100", duplex=True, layers=2, hidden=64, input=32, batch=8)
    assert plain.lengths_of("x", 0) == (5, 3)
    assert all(n % 2 == 0 for n in duplex.lengths_of("x", 0)) and duplex.stats["ratios_even_batch"]
    assert even_batch_ratios(((0.55, 0.45),), 7) == ((0.55, 0.45),)  # odd batch: nothing to round to
    assert even_batch_ratios(((0.3, 0.3, 0.4),), 4) == ((0.5, 0.0, 0.5),)
