"""The cost model against hand computation: stages, computation per device, collective terms with their
duals, latency + bytes/bandwidth, padded shards driven by the largest one, memory per device, and the
linear form the LP reads."""

from __future__ import annotations

import random

import pytest
import synthetic as S

from hapnb.cost.model import Conversion, CostModel, Load, Step
from hapnb.hardware.cluster import Cluster
from hapnb.hardware.parts import Collective
from hapnb.ir.forms import G, I, R
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


def _assert_comp_linear(cm: CostModel, step: Step, rnd: random.Random, samples: int) -> None:
    """``cm.comp_linear(step)`` (what the LP reads) equals ``cm.step_comp`` at random ratios of 2 devices."""
    coef, const = cm.comp_linear(step)
    for _ in range(samples):
        a = rnd.random()
        r = ((a, 1 - a),)
        want = cm.step_comp(step, r)
        got = [sum(coef[k][j] * r[k][j] for k in coef) + const[j] for j in range(2)]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-18)


def test_comp_linear_is_the_cost_models_own_computation(setup):
    g, th, c, cm = setup
    rnd = random.Random(0)
    for op in g.ops:
        for s in th.strategies[op.id]:
            loads = tuple(
                Load(t, f) for t, f in zip(op.inputs, s.inputs) if g.tensors[t].role != "activation"
            )
            _assert_comp_linear(cm, Step(op.id, s, loads), rnd, 3)


def test_memory_counts_parameter_state_and_local_shards(setup):
    g, th, c, cm = setup
    prog = _data_parallel(g, th)
    ratios = ((0.75, 0.25),)
    mem = cm.memory(prog, (), ratios)
    w = 32 * 16 * 4
    x_rows = (48, 16)
    for j in range(2):
        static = w + 2 * w + x_rows[j] * 32 * 4  # weight, two Adam moments, input shard
        # saved: the sum (family unknown: keeps its inputs) keeps mm's output shard; x is an input (counted
        # above); the transient is twice the largest local activation
        backward = x_rows[j] * 16 * 4 + 2 * x_rows[j] * 16 * 4
        step = w + w  # gradient + one foreach temporary
        assert mem[j] == static + max(backward, step)
    # device 0 peaks in the backward, device 1 (a quarter of the batch) in the optimizer step
    b0, b1 = cm.memory_breakdown(prog, (), ratios)
    assert b0["transient"] == 2 * 48 * 16 * 4 and b0["gradients"] == 0
    assert b1["gradients"] == w and b1["transient"] == w and b1["overhead"] == 0


# --------------------------------------------------------------------------- device model


def _model(**kw):
    from hapnb.hardware.devices import DeviceModel

    base = dict(peak_flops=1e9, bandwidth_Bps=1e12, kernel_s=1e-5, matmul_eff=0.8, matmul_half_flops=1e4)
    return DeviceModel(**{**base, **kw}, source="test")


def _with_models(c, *models):
    import dataclasses

    devs = tuple(dataclasses.replace(d, model=m) for d, m in zip(c.devices, models))
    return c.replace(devices=devs)


def test_device_model_time_by_hand(setup):
    g, th, c, _ = setup
    m = _model()
    cm = CostModel(th, _with_models(c, m, None))
    mm = g.ops[0]
    s = _strategy(th, mm.id, "data")
    r = ((0.6, 0.4),)
    t0, t1 = cm.comp(mm.id, s, r)
    # device 0 is GPU bound at 1 GFLOP/s (work > launches), compute bound (bytes / 1 TB/s is less)
    assert not cm.launch_bound(0)
    assert t0 == pytest.approx((s.scaled_flops * 0.6 + s.fixed_flops) / 1e9)
    # device 1 has no model: flops-only, exactly the old formula
    assert t1 == (s.scaled_flops * 0.4 + s.fixed_flops) / 1e12
    # memory bound when the bandwidth is small: bytes = forward inputs + output, 3x for fwd + bwd
    cm2 = CostModel(th, _with_models(c, _model(bandwidth_Bps=1e5), None))
    nbytes = 3 * (64 * 32 + 32 * 16 + 64 * 16) * 4
    assert cm2.op_traffic(mm.id) == (nbytes, 2)  # a family not in the table: 1 forward + 1 backward kernel
    want = nbytes * s.scaled_flops / (s.scaled_flops + s.fixed_flops) * 0.6 / 1e5
    assert cm2.comp(mm.id, s, r)[0] == pytest.approx(want)
    # launch bound when the GPU is fast: every op costs its kernels x kernel_s, whatever its share
    cm3 = CostModel(th, _with_models(c, _model(peak_flops=1e15, kernel_s=1e-3), None))
    assert cm3.launch_bound(0)
    assert cm3.comp(mm.id, s, r)[0] == cm3.comp(mm.id, s, ((0.1, 0.9),))[0] == pytest.approx(2e-3)
    # without overlap (a CPU runs its own kernels) launches and work add up
    cm4 = CostModel(th, _with_models(c, _model(overlap=False), None))
    assert cm4.comp(mm.id, s, r)[0] == pytest.approx(2e-5 + (s.scaled_flops * 0.6 + s.fixed_flops) / 1e9)


def test_matmul_efficiency_curve():
    m = _model()
    assert m.efficiency(1e4) == pytest.approx(0.4)  # half of matmul_eff at matmul_half_flops
    assert m.efficiency(1e12) == pytest.approx(0.8, rel=1e-6)
    assert m.efficiency(1e3) < m.efficiency(1e5)


def test_device_model_is_linear_in_the_ratio_and_comp_linear_matches(setup):
    g, th, c, _ = setup
    cm = CostModel(th, _with_models(c, _model(), _model(bandwidth_Bps=1e6)))
    rnd = random.Random(1)
    for op in g.ops:
        for s in th.strategies[op.id]:
            step = Step(op.id, s, tuple(Load(t, f) for t, f in zip(op.inputs, s.inputs) if t != 2))
            _assert_comp_linear(cm, step, rnd, 5)


def test_optimizer_step_is_charged_once_to_the_last_stage(setup):
    g, th, c, _ = setup
    m = _model(optimizer_passes=10.0, optimizer_kernels=3.0, bandwidth_Bps=1e9)
    cm = CostModel(th, _with_models(c, m, m))
    prog = _data_parallel(g, th)
    r = ((0.5, 0.5),)
    coef, const = cm.optimizer_linear(prog)
    w = 32 * 16 * 4  # the replicated weight: every device steps all of it
    assert coef == {} and const == pytest.approx((3e-5 + 10 * w / 1e9,) * 2)
    ev = cm.evaluate(prog, r)
    comp = [sum(cm.step_comp(st, r)[j] for st in prog) + const[j] for j in range(2)]
    assert ev.stages[-1].comp_s == pytest.approx(tuple(comp))
    # a G-loaded parameter counts its share
    x, w_id = g.tensor("x").id, g.tensor("w0").id
    sharded = [Step(prog[0].op, prog[0].strategy, (Load(x, G(0)), Load(w_id, G(0))))]
    coef, const = cm.optimizer_linear(sharded)
    assert coef[0] == pytest.approx((10 * w / 1e9,) * 2) and const == pytest.approx((3e-5,) * 2)


def test_flops_only_kinds_keep_the_old_formula():
    from hapnb import zoo
    from hapnb.tracing import trace

    model, inputs, _ = zoo.build("mlp", devices=8, **zoo.TINY["mlp"])
    g = trace(model, inputs)
    th = theory(g)
    c = Cluster.preset("paper-hetero-8")
    assert all(d.model is None for d in c.devices)
    cm = CostModel(th, c)
    r = ((0.2, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1),) * cm.n_segments
    for op in g.ops:
        for s in th.strategies[op.id]:
            old = tuple((s.scaled_flops * r[op.segment][j] + s.fixed_flops) / c.flops[j] for j in range(8))
            assert cm.comp(op.id, s, r) == old
    assert cm.optimizer_linear([]) == ({}, (0.0,) * 8)
    total = sum(min(s.scaled_flops + s.fixed_flops for s in ss) for ss in th.strategies)
    assert cm.lower_bound() == pytest.approx(total / c.total_flops)


def test_memory_breakdown_sums_to_the_peak_and_shards_parameters(setup):
    g, th, c, _ = setup
    m = _model(memory_overhead=0.1, memory_const_bytes=1000.0)
    cm = CostModel(th, _with_models(c, m, None))
    x, w = g.tensor("x").id, g.tensor("w0").id
    mm = g.ops[0]
    step = Step(mm.id, _strategy(th, mm.id, "data"), (Load(x, G(0)), Load(w, I)))
    r = ((0.75, 0.25),)
    for b, total in zip(cm.memory_breakdown([step], (), r), cm.memory([step], (), r)):
        assert sum(b.values()) == total
    b0, b1 = cm.memory_breakdown([step], (), r)
    assert b0["overhead"] == int(0.1 * sum(v for k, v in b0.items() if k != "overhead") + 1000)
    assert b1["overhead"] == 0
    # a parameter sharded on its rows counts its shard in parameters, gradients and both Adam states
    col = next(s for s in th.strategies[mm.id] if s.inputs[1].kind == "G")
    d = col.inputs[1].dim
    step2 = Step(mm.id, col, (Load(x, col.inputs[0]), Load(w, col.inputs[1])))
    for j, b in enumerate(cm.memory_breakdown([step2], (), r)):
        shard = th.lengths(w, d, r[0])[j] * 32 * 16 * 4 // g.tensors[w].shape[d]
        assert b["parameters"] == shard and b["optimizer"] == 2 * shard


# --------------------------------------------------------------------------- CPU refinements


def _tiny_gpt(devices: int = 1):
    from hapnb import zoo
    from hapnb.tracing import trace

    model, inputs, _ = zoo.build("gpt", devices=devices, **zoo.TINY["gpt"])
    g = trace(model, inputs)
    return g, theory(g)


def _cluster_of(*models):
    return _with_models(Cluster.parse(f"{len(models)}x1e12"), *models)


def test_vector_flops_prices_only_the_vector_families_as_compute():
    from hapnb.cost.model import MATMUL_FAMILIES, VECTOR_FAMILIES

    g, th = _tiny_gpt()
    plain = _model(peak_flops=1e12, bandwidth_Bps=1e10, overlap=False)
    vec = _model(peak_flops=1e12, bandwidth_Bps=1e10, overlap=False, vector_flops=1e7)
    cp, cv = CostModel(th, _cluster_of(plain)), CostModel(th, _cluster_of(vec))
    r = ((1.0,),) * cp.n_segments
    seen = set()
    for op in g.ops:
        s = th.strategies[op.id][0]
        nbytes, kernels = cp.op_traffic(op.id)
        flops = s.scaled_flops + s.fixed_flops
        if op.family in VECTOR_FAMILIES and kernels:
            want = kernels * 1e-5 + max(flops / 1e7, nbytes / 1e10)
            assert cv.comp(op.id, s, r)[0] == pytest.approx(want)
            assert cp.comp(op.id, s, r)[0] == pytest.approx(kernels * 1e-5 + max(flops / 1e12, nbytes / 1e10))
            seen.add(op.family)
        else:  # matmul, attention, norm, additive, ...: exactly as without vector_flops
            assert cv.comp(op.id, s, r) == cp.comp(op.id, s, r)
            seen.add("matmul" if op.family in MATMUL_FAMILIES else "other")
    assert {"pointwise", "loss", "matmul", "other"} <= seen


def test_pool_flops_prices_pooling_and_falls_back_to_vector_flops():
    from hapnb import zoo
    from hapnb.tracing import trace

    model, inputs, _ = zoo.build("vgg19", devices=1, **zoo.TINY["vgg19"])
    g = trace(model, inputs)
    th = theory(g)
    base = dict(peak_flops=1e12, bandwidth_Bps=1e12, overlap=False)
    vec = CostModel(th, _cluster_of(_model(**base, vector_flops=1e6)))
    pool = CostModel(th, _cluster_of(_model(**base, vector_flops=1e6, pool_flops=1e5)))
    r = ((1.0,),) * vec.n_segments
    assert any(op.family == "pool" for op in g.ops)
    for op in g.ops:
        s = th.strategies[op.id][0]
        nbytes, kernels = vec.op_traffic(op.id)
        flops = s.scaled_flops + s.fixed_flops
        if op.family == "pool":
            assert vec.comp(op.id, s, r)[0] == pytest.approx(kernels * 1e-5 + max(flops / 1e6, nbytes / 1e12))
            assert pool.comp(op.id, s, r)[0] == pytest.approx(
                kernels * 1e-5 + max(flops / 1e5, nbytes / 1e12)
            )
        else:
            assert pool.comp(op.id, s, r) == vec.comp(op.id, s, r)


def _factory(name: str, **options):
    import importlib

    from hapnb.tracing import trace

    model, inputs = getattr(importlib.import_module("examples.factories"), name)(**options)
    g = trace(model, inputs)
    return g, theory(g)


def test_scan_flops_and_the_conv_curve_price_their_families_only():
    from hapnb.hardware.devices import DeviceModel

    base = dict(peak_flops=1e11, bandwidth_Bps=1e13, overlap=False, vector_flops=1e9)
    for name, family, extra in (
        ("cumulative_mix_lm", "scan", dict(scan_flops=1e7)),
        ("small_convnet", "conv", dict(conv_eff=0.25, conv_half_flops=3e4)),
    ):
        g, th = _factory(name)
        plain = CostModel(th, _cluster_of(_model(**base)))
        own = CostModel(th, _cluster_of(m := _model(**base, **extra)))
        r = ((1.0,),) * plain.n_segments
        assert any(op.family == family for op in g.ops)
        for op in g.ops:
            s = th.strategies[op.id][0]
            nbytes, kernels = own.op_traffic(op.id)
            flops = s.scaled_flops + s.fixed_flops
            if op.family == family == "scan":  # 12 flops per element, at scan_flops (not vector_flops)
                assert flops == 3 * 12 * g.tensors[op.outputs[0]].numel and kernels == 21
                assert own.comp(op.id, s, r)[0] == pytest.approx(kernels * 1e-5 + flops / 1e7)
                assert plain.comp(op.id, s, r)[0] == pytest.approx(kernels * 1e-5 + flops / 1e9)
            elif op.family == family == "conv":  # its own curve, not the matmul one
                eff = 0.25 * op.flops / (op.flops + 3e4)
                assert m.efficiency(op.flops, "conv") == pytest.approx(eff)
                # the first conv's input (the images) needs no gradient: forward + weight gradient only
                first = op.inputs[0] == g.ops[0].inputs[0]
                assert own.grad_share(op.id) == pytest.approx(2 / 3 if first else 1.0)
                assert kernels == (3 if first else 4)
                work = flops * own.grad_share(op.id) / (1e11 * eff)
                assert own.comp(op.id, s, r)[0] == pytest.approx(kernels * 1e-5 + work)
            else:
                assert own.comp(op.id, s, r) == plain.comp(op.id, s, r)
    with pytest.raises(ValueError, match="conv_eff and conv_half_flops go together"):
        DeviceModel(1e11, 1e10, 1e-6, 0.9, 1e6, conv_eff=0.5)
    with pytest.raises(ValueError, match="sm_count and gemm_tile go together"):
        DeviceModel(1e11, 1e10, 1e-6, 0.9, 1e6, sm_count=132)


def test_gemm_dims_follow_the_sharded_dim_and_waves_price_the_reference_share():
    import torch

    from hapnb.cost.model import gemm_dims
    from hapnb.tracing import trace

    g = trace(torch.nn.Linear(512, 768), (torch.randn(4, 64, 512),), loss=lambda o: o.sum())
    th = theory(g)
    lin = g.ops[0]
    dims = {str(s.inputs[:2]): gemm_dims(g, lin, s, 0.25) for s in th.strategies[lin.id]}
    assert dims["(I, I)"] == (1.0, 256.0, 768.0, 512.0)  # replicated: the whole GEMM, x's rows folded
    assert dims["(G(0), I)"] == (1.0, 64.0, 768.0, 512.0)  # batch-sharded: a quarter of the rows
    assert dims["(I, G(0))"] == (1.0, 256.0, 192.0, 512.0)  # weight rows sharded: output columns
    assert dims["(G(2), G(1))"] == (1.0, 256.0, 768.0, 128.0)  # contracted dim sharded: partial sums
    assert gemm_dims(g, lin, th.strategies[lin.id][0], 1.0, gpus=2)[1] == 128.0  # a virtual device's GPUs
    # a GPU with waves: the op's efficiency is the curve's times the wave factor at the reference share
    wave = _model(peak_flops=1e12, kernel_s=1e-9, matmul_half_flops=0.0, sm_count=4, gemm_tile=128)
    cm = CostModel(th, _cluster_of(wave, wave))
    s = next(s for s in th.strategies[lin.id] if s.inputs[:2] == (G(0), I))
    f = wave.gemm_wave_factor(gemm_dims(g, lin, s, 0.5))
    assert f == pytest.approx(3 / (1 / (3 / 4) + 1 / (4 / 4) + 1))  # 1 x 6 tiles: 2 waves of 4, 6 of 8
    const, coef = cm.op_linear(lin.id, s, 0)
    assert cm.grad_share(lin.id) == pytest.approx(2 / 3)  # x is an input: no input-gradient GEMM
    assert coef == pytest.approx(s.scaled_flops * 2 / 3 / (1e12 * 0.8 * f)) and const == 0.0


def test_optimizer_per_tensor_charges_the_launches_per_local_parameter_tensor():
    from hapnb.cost.model import Load, Step

    g, th = _tiny_gpt()
    prog = []
    for op in g.ops:
        s = th.strategies[op.id][0]
        prog.append(Step(op.id, s, tuple(Load(t, f) for t, f in zip(op.inputs, s.inputs))))
    n = len({ld.tensor for st in prog for ld in st.loads if g.tensors[ld.tensor].role == "param"})
    assert n > 2
    foreach = _model(optimizer_kernels=5.0, kernel_s=1e-5)
    single = _model(optimizer_kernels=5.0, kernel_s=1e-5, optimizer_per_tensor=True)
    (_, c0), (_, c1) = (CostModel(th, _cluster_of(m)).optimizer_linear(prog) for m in (foreach, single))
    assert c1[0] - c0[0] == pytest.approx((n - 1) * 5 * 1e-5)


def test_cpu_refinements_keep_comp_linear_equal_to_step_comp():
    g, th = _tiny_gpt(devices=2)
    cpu = _model(
        peak_flops=1e11,
        bandwidth_Bps=4e10,
        overlap=False,
        vector_flops=5e9,
        pool_flops=5e8,
        scan_flops=1e8,
        conv_eff=0.6,
        conv_half_flops=1e6,
        optimizer_per_tensor=True,
    )
    gpu = _model(
        peak_flops=1e13, bandwidth_Bps=1e12, kernel_s=1e-6, vector_flops=1e12, sm_count=8, gemm_tile=16
    )
    cm = CostModel(th, _cluster_of(cpu, gpu))
    rnd = random.Random(3)
    for op in g.ops:
        for s in th.strategies[op.id]:
            step = Step(op.id, s, tuple(Load(t, f) for t, f in zip(op.inputs, s.inputs)))
            coef, const = cm.comp_linear(step)
            a = rnd.random()
            r = ((a, 1 - a),) * cm.n_segments
            want = cm.step_comp(step, r)
            got = [sum(coef[k][j] * r[k][j] for k in coef) + const[j] for j in range(2)]
            assert got == pytest.approx(want, rel=1e-12, abs=1e-18)


def test_shipped_kinds_price_vector_ops_memory_bound_as_before():
    from hapnb.cost.model import VECTOR_FAMILIES
    from hapnb.hardware.catalogue import DEVICE_MODELS

    g, th = _tiny_gpt()
    h100 = DEVICE_MODELS["H100"]
    cm = CostModel(th, Cluster.parse("1xH100"))
    assert cm.models[0] is h100
    for op in g.ops:
        if op.family not in VECTOR_FAMILIES:
            continue
        s = th.strategies[op.id][0]
        nbytes, _ = cm.op_traffic(op.id)
        flops = s.scaled_flops + s.fixed_flops
        work = max(flops / h100.peak_flops, nbytes / h100.bandwidth_Bps)  # efficiency 1: memory bound
        const, coef = cm._work_linear(op.id, s, 0)
        assert const + coef == pytest.approx(work, rel=1e-12)
