"""The simulator (hapnb.simulate): the stage model in time, the overlap simulation (DDP buckets, γ,
bandwidth sharing, duplex), memory over time, JSON and errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

import hapnb as hap
from hapnb import zoo
from hapnb.hardware.cluster import Cluster
from hapnb.hardware.parts import Collective
from hapnb.plans.plan import CommCost, Instruction, Plan, Stage
from hapnb.plans.simulation import DEFAULT_OVERLAP_SLOWDOWN, FORWARD_FRACTION, STREAMS, Span, simulate
from hapnb.plans.synthesis import baselines

BERT = dict(layers=2, hidden=64, heads=4, batch=8)
CASES = [
    ("bert", "2xV100+2xP100", BERT),
    ("gpt", "2xH100", zoo.TINY["gpt"]),
    ("mlp", "2xV100+2xP100", zoo.TINY["mlp"]),
    ("vit", "2xA100+2xP100", zoo.TINY["vit"]),
]


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    out = {f"{m}@{c}": hap.synthesize(m, c, **kw) for m, c, kw in CASES}
    # data parallel on one machine, large enough that the first DDP bucket closes before the backward ends
    base = baselines("mlp", "2xH100", layers=3, hidden=1024, input=1024, batch=512)
    out["dp_ev mlp"] = base["dp_ev"]
    # a reshard between ratio segments, and SFB steps (sufficient-factor gathers on compute instructions)
    out["gpt segments"] = hap.synthesize(
        "gpt", "2xV100+1xP100", segments="layer", **{**zoo.TINY["gpt"], "layers": 3}
    )
    dp = {f"{m}.{k}": "I" for m in ("layers.0", "layers.1", "head") for k in ("weight", "bias")}
    out["mlp sfb"] = hap.synthesize(
        "mlp", "2xV100", ratios=[0.75, 0.25], pins={"x": "G0", **dp}, **zoo.TINY["mlp"]
    )
    assert any(i.name == "reshard" and i.comm for i in out["gpt segments"].program)
    assert any(i.kind == "compute" and i.comm for i in out["mlp sfb"].program)
    return out


def assert_streams_disjoint(tl) -> None:
    assert {s.stream for s in tl.spans} <= set(STREAMS)
    for d in tl.devices:
        for stream in STREAMS:
            spans = tl.spans_of(d, stream)
            for a, b in zip(spans, spans[1:]):
                assert b.start_s >= a.end_s - 1e-15 * max(1.0, a.end_s), (d, stream, a, b)


# ------------------------------------------------------------------------------ zoo plans


def test_plans_carry_costs_that_sum_to_the_stage_model(plans):
    for plan in plans.values():
        assert plan.costed and len(plan.optimizer_s) == plan.cluster.n
        assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
        for st in plan.stages:
            comm = sum(c.time_s for i in st.instructions for c in plan.program[i].comm)
            assert comm == pytest.approx(st.comm_s, rel=1e-12, abs=1e-18)
            for j in range(plan.cluster.n):
                comp = sum(
                    plan.program[i].comp_s[j] for i in st.instructions if plan.program[i].kind == "compute"
                )
                if st.index == plan.stages[-1].index:
                    comp += plan.optimizer_s[j]
                assert comp == pytest.approx(st.comp_s[j], rel=1e-12, abs=1e-18)
    # the device-model cluster charges an optimizer step, the flops-only ones none
    assert all(x > 0 for x in plans["gpt@2xH100"].optimizer_s)
    assert plans["bert@2xV100+2xP100"].optimizer_s == (0.0,) * 4


def test_stage_synchronous_is_the_stage_model(plans):
    for name, plan in plans.items():
        tl = simulate(plan, overlap=False, bandwidth_sharing=False)
        assert tl.iteration_s == pytest.approx(plan.cost_s, rel=1e-9), name
        assert not tl.overlap and tl.peak_memory_bytes == plan.memory_bytes
        assert_streams_disjoint(tl)
        # each stage: its communication, then every device's computation (old Segment view kept)
        for st in plan.stages:
            for j, d in enumerate(plan.devices):
                comp = sum(s.duration_s for s in tl.segments if s.device == d and s.stage == st.index and s.kind == "comp")  # fmt: skip
                idle = sum(s.duration_s for s in tl.segments if s.device == d and s.stage == st.index and s.kind == "idle")  # fmt: skip
                assert comp == pytest.approx(st.comp_s[j], rel=1e-9, abs=1e-18)
                assert comp + idle == pytest.approx(max(st.comp_s), rel=1e-9, abs=1e-18)
        # computation per instruction: forward a third, backward two thirds
        for s in tl.spans:
            if s.stream == "compute" and s.phase != "optimizer":
                x = plan.program[s.instruction].comp_s[plan.devices.index(s.device)]
                frac = FORWARD_FRACTION if s.phase == "forward" else 1 - FORWARD_FRACTION
                assert s.duration_s == pytest.approx(x * frac, rel=1e-9)


def test_overlap_is_never_slower_than_the_stage_model(plans):
    for name, plan in plans.items():
        for kw in ({}, {"bandwidth_sharing": False}, {"slowdown": 0.0}, {"slowdown": 1.0}):
            tl = simulate(plan, **kw)
            assert tl.overlap and tl.iteration_s <= plan.cost_s * (1 + 1e-9), (name, kw)
            assert_streams_disjoint(tl)
            assert tl.peak_memory_bytes == plan.memory_bytes
        duplex = simulate(dataclasses.replace(plan, duplex=True))
        assert duplex.duplex and duplex.iteration_s <= plan.cost_s * (1 + 1e-9)
        assert_streams_disjoint(duplex)
        assert {s.micro_batch for s in duplex.spans if s.phase != "optimizer"} == {0, 1}
        assert duplex.peak_memory_bytes == plan.memory_bytes


def test_gradient_all_reduce_hides_behind_the_backward(plans):
    dp = plans["dp_ev mlp"]
    assert any(c.gradient for i in dp.program for c in i.comm)
    tl = simulate(dp, slowdown=0.0)
    assert tl.iteration_s < dp.cost_s * 0.999
    grads = [s for s in tl.spans if s.stream == "gradient-comm" and s.device == dp.devices[0]]
    back = [
        s for s in tl.spans if s.stream == "compute" and s.phase == "backward" and s.device == dp.devices[0]
    ]
    assert grads and back
    # the first bucket runs while the device still computes its backward
    assert grads[0].start_s < max(s.end_s for s in back)


def test_default_slowdown_and_per_device_override(plans):
    plan = plans["gpt@2xH100"]
    assert simulate(plan).slowdown == (DEFAULT_OVERLAP_SLOWDOWN,) * 2
    models = [dataclasses.replace(d.model, overlap_slowdown=0.25) for d in plan.cluster.devices]
    c2 = plan.cluster.replace(devices=tuple(dataclasses.replace(d, model=m) for d, m in zip(plan.cluster.devices, models)))  # fmt: skip
    with pytest.raises(ValueError, match="device model"):  # another device model: cannot re-price
        simulate(plan, cluster=c2)
    tl = simulate(dataclasses.replace(plan, cluster=c2))
    assert tl.slowdown == (0.25, 0.25)
    assert simulate(dataclasses.replace(plan, cluster=c2), slowdown=0.5).slowdown == (0.5, 0.5)


# ------------------------------------------------------------------------------ a hand-built plan

LAT, BW = 1e-4, 1e9
C = 3e-3  # seconds per step per device, forward + backward
MIB = 2**20


def hand_plan(feature_fwd: float = 0.5e-3, feature_bwd: float = 1e-3) -> Plan:
    """Three steps on two flops-only devices; w1, w2, w3 replicated (gradient all-reduces of 600 kB,
    600 kB and 2 MiB); a feature collective on step 1's output, fused in front of step 3."""
    cluster = Cluster.parse("2x1e12").with_collectives(
        {k: Collective(LAT, BW) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    )

    def grad(name: str, nbytes: int) -> CommCost:
        return CommCost(f"grad all_reduce {name}", "all_reduce", 0.0, LAT + nbytes / BW, True, nbytes)

    def step(k: int, ins: str, out: str) -> Instruction:
        return Instruction("compute", "shard0", k, op=f"op{k}", target="aten.mm", inputs=((ins, "G0"),), outputs=((out, "G0"),), comp_s=(C, C))  # fmt: skip

    feat = CommCost("all_gather h1", "all_gather", feature_fwd, feature_bwd)
    program = (
        Instruction("load", "load", 0, tensor="w1", form="I", comm=(grad("w1", 600_000),)),
        step(0, "x", "h1"),
        Instruction("load", "load", 1, tensor="w2", form="I", comm=(grad("w2", 600_000),)),
        step(1, "h1", "h2"),
        Instruction("collective", "all_gather", 2, tensor="h1", src="G0", form="I", comm=(feat,)),
        Instruction("load", "load", 2, tensor="w3", form="I", comm=(grad("w3", 2 * MIB),)),
        step(2, "h2", "y"),
    )
    stage_comm = [
        program[0].comm[0].time_s,
        program[2].comm[0].time_s,
        feat.time_s + program[5].comm[0].time_s,
    ]
    stages = tuple(Stage(k, stage_comm[k], (C, C), ins) for k, ins in enumerate(((0, 1), (2, 3), (4, 5, 6))))
    breakdown = (("parameters", 100), ("gradients", 0), ("optimizer", 200), ("inputs", 10), ("activations", 300), ("transient", 50), ("overhead", 0))  # fmt: skip
    return Plan(
        name="hand",
        graph_fingerprint="hand",
        cluster=cluster,
        ratios=((0.5, 0.5),),
        program=program,
        lengths=(),
        stages=stages,
        cost_s=sum(stage_comm) + 3 * C,
        lower_bound_s=0.0,
        memory_bytes=(660, 660),
        memory_breakdown=(breakdown, breakdown),
        optimizer_s=(0.0, 0.0),
    )


T_W3 = LAT + 2 * MIB / BW  # the first bucket: w3 alone (2 MiB >= the 1 MiB first cap)
T_W21 = LAT + 1_200_000 / BW  # the second: w2 and w1 together (one latency)


def test_hand_plan_stage_model_and_buckets():
    plan = hand_plan()
    st = simulate(plan, overlap=False)
    assert st.iteration_s == pytest.approx(plan.cost_s, rel=1e-12)
    tl = simulate(plan, slowdown=0.0, bandwidth_sharing=False)
    d = plan.devices[0]
    buckets = tl.spans_of(d, "gradient-comm")
    assert [s.what.split(": ")[1] for s in buckets] == ["w3", "w2, w1"]
    # forward: 3 steps of C/3 (the feature collective runs beside step 2); backward: step 3 ends at
    # C + 2C/3, w3's bucket starts then; the feature collective's backward (1 ms) blocks step 1's backward
    f = C * FORWARD_FRACTION
    b = C - f
    assert buckets[0].start_s == pytest.approx(3 * f + b, rel=1e-12)
    assert buckets[0].duration_s == pytest.approx(T_W3, rel=1e-12)
    end_b1 = max(3 * f + b + 1e-3, 3 * f + 2 * b) + b  # B1 waits for the feature backward and B2
    assert buckets[1].start_s == pytest.approx(max(end_b1, 3 * f + b + T_W3), rel=1e-12)
    assert tl.iteration_s == pytest.approx(buckets[1].start_s + T_W21, rel=1e-12)
    assert tl.iteration_s < plan.cost_s
    # the feature collective blocks only its consumer (step 3), not step 2
    fwd = [s for s in tl.spans_of(d, "compute") if s.phase == "forward"]
    feat = tl.spans_of(d, "feature-comm")[0]
    assert (feat.start_s, feat.end_s) == pytest.approx((f, f + 0.5e-3))  # issued once step 1 is done
    assert [s.start_s for s in fwd] == pytest.approx([0.0, f, max(2 * f, f + 0.5e-3)])


def test_slowdown_stretches_computation_beside_communication():
    plan = hand_plan(feature_fwd=0.0, feature_bwd=0.0)
    g = 0.5
    tl = simulate(plan, slowdown=g, bandwidth_sharing=False)
    f = C * FORWARD_FRACTION
    b = C - f
    t0 = 3 * f + b  # B3 ends, w3's bucket starts; B2 runs beside it at 1/(1+g) until the bucket ends
    done_in_bucket = T_W3 / (1 + g)
    end_b2 = t0 + T_W3 + (b - done_in_bucket)
    d = plan.devices[0]
    bwd = [s for s in tl.spans_of(d, "compute") if s.phase == "backward"]
    assert bwd[1].end_s == pytest.approx(end_b2, rel=1e-12)
    assert tl.iteration_s == pytest.approx(end_b2 + b + T_W21, rel=1e-12)
    assert simulate(plan, slowdown=0.0).iteration_s == pytest.approx(3 * f + 3 * b + T_W21, rel=1e-12)


def test_bandwidth_sharing_takes_the_combined_time():
    plan = hand_plan(feature_fwd=0.0, feature_bwd=1e-3)
    f = C * FORWARD_FRACTION
    b = C - f
    t0 = 3 * f + b  # the feature collective's backward and w3's bucket start together
    d = plan.devices[0]
    shared = simulate(plan, slowdown=0.0)
    feat = shared.spans_of(d, "feature-comm")[0]
    bucket = shared.spans_of(d, "gradient-comm")[0]
    assert feat.start_s == pytest.approx(t0) and bucket.start_s == pytest.approx(t0)
    assert feat.end_s == pytest.approx(t0 + 2 * 1e-3, rel=1e-12)  # half speed while both run
    assert bucket.end_s == pytest.approx(t0 + 1e-3 + T_W3, rel=1e-12)  # exactly the combined time
    alone = simulate(plan, slowdown=0.0, bandwidth_sharing=False)
    assert alone.spans_of(d, "feature-comm")[0].end_s == pytest.approx(t0 + 1e-3, rel=1e-12)
    assert alone.spans_of(d, "gradient-comm")[0].end_s == pytest.approx(t0 + T_W3, rel=1e-12)


def test_memory_timeline():
    plan = hand_plan()
    for kw in ({"overlap": False}, {}, {"slowdown": 0.3}):
        tl = simulate(plan, **kw)
        assert tl.peak_memory_bytes == (660, 660)
        pts = tl.memory[0]
        assert pts[0] == (0.0, 310)  # persistent: parameters + optimizer + inputs
        assert max(b for _, b in pts) == 660  # all activations + the transient at the first backward
        assert all(t2 >= t1 for (t1, _), (t2, _) in zip(pts, pts[1:]))
    tl = simulate(plan)
    assert tl.memory[0][-1][1] == 310  # everything transient freed by the end
    small = plan.cluster.replace(
        devices=tuple(dataclasses.replace(d, memory_bytes=500) for d in plan.cluster.devices)
    )
    tight = simulate(dataclasses.replace(plan, cluster=small))
    assert tight.oom == (True, True) and "OUT OF MEMORY" in str(tight)


def test_duplex_halves_each_micro_batch():
    plan = dataclasses.replace(hand_plan(feature_fwd=0.0, feature_bwd=0.0), duplex=True)
    tl = simulate(plan, slowdown=0.0, bandwidth_sharing=False)
    d = plan.devices[0]
    comp = [s for s in tl.spans_of(d, "compute") if s.phase == "forward"]
    assert [(s.instruction, s.micro_batch) for s in comp] == [(1, 0), (1, 1), (3, 0), (3, 1), (6, 0), (6, 1)]
    assert all(s.duration_s == pytest.approx(C * FORWARD_FRACTION / 2) for s in comp)
    assert len(tl.spans_of(d, "gradient-comm")) == 2  # gradients all-reduced once per iteration
    assert tl.iteration_s == pytest.approx(simulate(dataclasses.replace(plan, duplex=False), slowdown=0.0, bandwidth_sharing=False).iteration_s)  # fmt: skip


def test_repricing_for_another_cluster():
    plan = hand_plan()
    fast = plan.cluster.replace(
        devices=tuple(dataclasses.replace(d, flops=d.flops * 2) for d in plan.cluster.devices)
    )
    fast = fast.with_collectives(
        {k: Collective(LAT, 2 * BW) for k in ("all_reduce", "all_gather", "reduce_scatter")}
    )
    tl = simulate(plan, cluster=fast, overlap=False)
    comm = [LAT + 600_000 / (2 * BW), LAT + 600_000 / (2 * BW), (0.5e-3 - LAT) / 2 + LAT + (1e-3 - LAT) / 2 + LAT + LAT + 2 * MIB / (2 * BW)]  # fmt: skip
    assert tl.iteration_s == pytest.approx(sum(comm) + 3 * C / 2, rel=1e-12)


# ------------------------------------------------------------------------------ JSON, old plans, errors


def test_json_round_trip(plans):
    plan = plans["bert@2xV100+2xP100"]
    tl = simulate(plan)
    js = json.loads(json.dumps(tl.to_json()))
    assert js["iteration_s"] == tl.iteration_s and js["mode"] == "overlap"
    assert [d["name"] for d in js["devices"]] == list(plan.devices)
    assert all(
        {"name", "peak_memory_bytes", "capacity_bytes", "oom", "busy_fraction"} <= set(d)
        for d in js["devices"]
    )
    assert tuple(Span.from_json(r) for r in js["spans"]) == tl.spans
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert simulate(again) == tl


def test_old_plans_simulate_the_stage_model_only(plans):
    plan = plans["bert@2xV100+2xP100"]
    js = plan.to_json()
    js.pop("optimizer_s")
    for ins in js["program"]:
        ins.pop("comp_s", None)
        ins.pop("comm", None)
    old = Plan.from_json(js)
    assert not old.costed
    with pytest.raises(ValueError, match="overlap=False"):
        simulate(old)
    tl = simulate(old, overlap=False)
    assert tl.iteration_s == pytest.approx(plan.cost_s, rel=1e-12)
    assert_streams_disjoint(tl)


def test_clear_errors(plans):
    plan = plans["bert@2xV100+2xP100"]
    with pytest.raises(ValueError, match="same device names"):
        simulate(plan, cluster=Cluster.parse("2xV100"))
    with pytest.raises(ValueError, match="slowdown"):
        simulate(plan, slowdown=-1)
    with pytest.raises(ValueError, match="Plan"):
        simulate("plan.json")  # type: ignore[arg-type]


def test_a_feature_collective_blocks_only_its_consumer():
    plan = hand_plan(feature_fwd=1.5e-3, feature_bwd=0.0)
    tl = simulate(plan, slowdown=0.0)
    f = C * FORWARD_FRACTION
    fwd = [s for s in tl.spans_of(plan.devices[0], "compute") if s.phase == "forward"]
    # step 2 runs beside the all-gather of step 1's output; step 3 waits for it
    assert [s.start_s for s in fwd] == pytest.approx([0.0, f, f + 1.5e-3], rel=1e-12)


def test_hapnb_simulate_is_the_function_even_after_the_module_is_imported():
    import hapnb
    import hapnb.plans.simulation  # noqa: F401  (binds the submodule on the package under its own name)

    plan = hand_plan()
    assert hapnb.simulate is simulate and hapnb.Timeline is hapnb.plans.simulation.Timeline
    assert hapnb.simulate(plan, slowdown=0.0) == simulate(plan, slowdown=0.0)
