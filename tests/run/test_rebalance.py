"""Live re-balancing (issue 21): the fit and the decision on synthetic telemetry (fast), and end-to-end runs
on 3 local gloo ranks with an injected straggler (slow)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from procs import assert_gone

import hapnb
from hapnb.run.bundle import load_bundle, write_bundle
from hapnb.run.launch import launch
from hapnb.run.linkfit import LinkDetector, fit_links
from hapnb.run.rebalance import (
    Detector,
    RebalanceOptions,
    fit_speeds,
    measured_cluster,
    parse_slowdown,
    predicted_compute,
    propose,
    summarize,
)
from hapnb.run.telemetry import FIELDS, CollectiveClock, Window, table
from hapnb.run.verify import run_reference
from hapnb.triples import theory


@pytest.fixture(scope="module")
def plan() -> hapnb.Plan:
    """A tiny MLP on 3 equal devices with a sharded layer (sharded weights and Adam state move too)."""
    return hapnb.synthesize(
        "mlp", "3xV100", layers=2, hidden=32, input=16, batch=12, pins={"layers.1.weight": "G0"}
    )


# ------------------------------------------------------------------------------------------- the fit


def test_fit_scales_against_the_plan_and_skips_idle_devices() -> None:
    fit = fit_speeds([2e-3, 2e-3, 6e-3, 1e-3], [1e-3, 1e-3, 1e-3, 0.0], [0.05, 0.05, 0.1, 0.0])
    assert fit.k[3] is None and fit.scale[3] == 1.0
    assert fit.k_ref == pytest.approx(2.0)
    assert fit.scale[:3] == pytest.approx((1.0, 1.0, 3.0))
    assert fit.departing(0.5) == (2,)
    # a departure inside the measurement's own spread does not count
    assert fit_speeds([1.0, 1.7], [1.0, 1.0], [0.0, 0.9]).departing(0.3) == ()
    with pytest.raises(ValueError, match="no device"):
        fit_speeds([1.0], [0.0])


def test_detector_needs_patience_consecutive_windows() -> None:
    d = Detector(RebalanceOptions(patience=3))
    slow, calm = fit_speeds([1, 1, 3], [1, 1, 1]), fit_speeds([1, 1.1, 0.95], [1, 1, 1])
    assert d.update(slow) == () and d.update(slow) == ()
    assert d.update(calm) == ()  # the streak breaks
    assert [d.update(slow) for _ in range(3)] == [(), (), (2,)]
    d.reset()
    assert d.update(slow) == ()


def test_noise_without_a_slowdown_never_triggers() -> None:
    """Equal devices measured with 20 % noise: no window departs, so no re-balance is ever considered."""
    g = torch.Generator().manual_seed(0)
    d = Detector(RebalanceOptions())
    for _ in range(200):
        noisy = (1.0 + 0.2 * (torch.rand(3, generator=g) * 2 - 1)).tolist()
        assert d.update(fit_speeds(noisy, [1.0, 1.0, 1.0])) == ()


def test_options_and_slowdown_are_checked() -> None:
    assert RebalanceOptions.from_json({"every": 2}).every == 2
    with pytest.raises(ValueError, match="unknown rebalance option.*evry"):
        RebalanceOptions.from_json({"evry": 2})
    with pytest.raises(ValueError, match="patience"):
        RebalanceOptions(patience=0)
    with pytest.raises(ValueError, match="program must be true or false"):
        RebalanceOptions.from_json({"program": 1})
    opts = RebalanceOptions.parse(["program=false", "every=2", "min-gain=0.2", "links=yes"])
    assert opts == {"program": False, "every": 2, "min_gain": 0.2, "links": True}
    assert RebalanceOptions.from_json(opts).program is False
    for bad, why in ((["progam=false"], "KEY one of every"), (["every=2.5"], "every takes an integer"),
                     (["links=maybe"], "links takes true or false"), (["every=0"], "integer >= 1")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            RebalanceOptions.parse(bad)
    assert parse_slowdown(["2=3", "0=1.5"]) == {2: 3.0, 0: 1.5}
    assert parse_slowdown({1: 2}) == {1: 2.0}
    for bad in (["2"], ["x=3"], ["1=0.5"]):
        with pytest.raises(ValueError, match="slowdown"):
            parse_slowdown(bad)


def _link_table(cluster, blocked: list[float], kind: str = "all_reduce", nbytes: float = 4e5) -> dict:
    """A window table of 3 ranks whose only collective is ``kind`` (2 calls of ``nbytes`` per step), each
    rank blocked ``blocked[r]`` times the model's time for it."""
    model = cluster.collective(kind).time(nbytes, launches=2)
    tab = {f: [0.0] * 3 for f in FIELDS}
    tab.update(
        {f"{kind}_s": [b * model for b in blocked], f"{kind}_bytes": [nbytes] * 3, f"{kind}_calls": [2.0] * 3}
    )
    return tab


def test_link_fit_detects_a_slow_link_and_not_a_slow_device(plan: hapnb.Plan) -> None:
    """Blocked time includes the wait for slower peers: the fastest rank's is the transfer."""
    c, pred = plan.cluster, predicted_compute(plan)
    k = 50.0  # measured seconds per predicted second (a CPU running a V100 plan)
    # rank 2 computes 3x slower; ranks 0 and 1 wait for it in the all-reduce, rank 2 does not
    slow_device = fit_speeds([k * pred[0], k * pred[1], 3 * k * pred[2]], pred)
    tab = _link_table(c, [k * 9, k * 9, k * 1.0])
    links = fit_links(tab, c, slow_device.k_ref)
    assert slow_device.departing(0.5) == (2,)
    assert links.scale_of("all_reduce") == pytest.approx(1.0) and links.departing(0.5) == ()
    assert links.rank[links.kinds.index("all_reduce")] == 2
    # every rank blocked 4x the model (relative to the compute): a slow link, and no straggler
    calm = fit_speeds([k * x for x in pred], pred)
    links = fit_links(_link_table(c, [k * 4.4, k * 4.2, k * 4.0]), c, calm.k_ref)
    assert calm.departing(0.5) == () and links.departing(0.5) == ("all_reduce",)
    assert links.scale_of("all_reduce") == pytest.approx(4.0) and links.overall == pytest.approx(4.0)
    assert links.measured == ("all_reduce",)
    assert links.scale_of("all_gather") == pytest.approx(4.0)  # not measured: the overall scale
    rec = links.record()
    assert rec["link_scale"] == {"all_reduce": pytest.approx(4.0)} and json.dumps(rec)
    # a link as fast as planned relative to the compute, however slow the hardware, does not depart
    assert fit_links(_link_table(c, [k, k, k]), c, k).departing(0.5) == ()
    # an unmeasured kind (no call on some rank) has no fit
    tab = _link_table(c, [k, k, k])
    tab["all_reduce_calls"][1] = 0.0
    assert fit_links(tab, c, k).measured == ()
    # detection: patience windows in a row, then against the reference it was last asked about
    d = LinkDetector(0.5, 2)
    assert d.update(links) == () and d.update(links) == ("all_reduce",)
    d.reset(links.links())
    assert d.update(links) == () and d.update(links) == ()
    # the measured cluster slows the collective's model by the link's scale
    m = measured_cluster(c, calm.scale, links.links())
    assert m.collective("all_reduce").bandwidth_Bps * 4 == pytest.approx(
        c.collective("all_reduce").bandwidth_Bps
    )


def test_link_noise_without_a_slow_link_never_triggers(plan: hapnb.Plan) -> None:
    g = torch.Generator().manual_seed(1)
    d = LinkDetector(RebalanceOptions().threshold, RebalanceOptions().patience)
    for _ in range(200):
        noisy = (1.0 + 0.2 * (torch.rand(3, generator=g) * 2 - 1)).tolist()
        assert d.update(fit_links(_link_table(plan.cluster, noisy), plan.cluster, 1.0)) == ()


def test_a_slow_link_under_which_another_program_wins_changes_the_program(plan: hapnb.Plan) -> None:
    """The plan all-reduces gradients and gathers activations (grouped: broadcasts and reduces); measured
    with its all-reduce 10x slower than the model and the rest as planned, the planner shards every weight
    instead (no gradient all-reduce), and the decision takes that program."""
    from hapnb.plans.simulation import iteration_time

    kinds = {"all_reduce": 10.0, "broadcast": 1.0, "reduce": 1.0}
    assert {c.kind for i in plan.program for c in i.comm} >= {"all_reduce", "grouped_all_gather"}
    pred = predicted_compute(plan)
    fit = fit_speeds(list(pred), pred)  # devices as planned; 1 measured second per predicted second
    tab = {f: [0.0] * 3 for f in FIELDS}
    for kind, x in kinds.items():
        tab.update({f: v for f, v in _link_table(plan.cluster, [x] * 3, kind).items() if f.startswith(kind)})
    links = fit_links(tab, plan.cluster, fit.k_ref)
    assert links.measured == ("all_reduce", "broadcast", "reduce") and links.departing(0.5) == ("all_reduce",)
    measured = measured_cluster(plan.cluster, fit.scale, links.links())
    step_s = iteration_time(dataclasses.replace(plan, cluster=measured))  # its step on the measured cluster
    window = {"compute_s": list(pred), "step_s": [step_s] * 3}
    seen: list = []

    def replan(c):
        seen.append(c)
        return plan.replan(cluster=c)

    th = theory(plan.graph)
    p = propose(plan, th, fit, window, RebalanceOptions(), step=8, steps_left=100, links=links,
                slow_links=("all_reduce",), replan=replan, codegen_s=1e-3)  # fmt: skip
    ar = [c.collective("all_reduce").bandwidth_Bps for c in (seen[0], plan.cluster)]
    assert ar[0] * 10 == pytest.approx(ar[1])  # the planner ran on the measured links
    assert p.accepted and p.program_changed, p.reason
    assert "link: all_reduce at 10.00x" in p.reason and "a new program" in p.reason
    assert [o["program_changed"] for o in p.options] == [False, True]
    assert not p.options[0]["accepted"]  # equal devices: new ratios alone save nothing
    assert p.plan.program != plan.program and dict(p.plan.pins) == dict(plan.pins)
    assert not any(c.kind == "all_reduce" for i in p.plan.program for c in i.comm if c.gradient)
    assert p.reshard_s_estimate == pytest.approx(1e-3 + 4 * step_s)  # a program change: one step more
    assert p.link_scale == {"all_reduce": pytest.approx(10.0), "broadcast": pytest.approx(1.0),
                            "reduce": pytest.approx(1.0)}  # fmt: skip
    json.dumps(p.record())
    # without the planner (RebalanceOptions(program=False)): the same program only, which saves nothing
    q = propose(plan, th, fit, window, RebalanceOptions(), step=8, steps_left=100, links=links)
    assert not q.program_changed and len(q.options) == 1 and not q.accepted


# ------------------------------------------------------------------------------ re-solve and decide


def test_propose_moves_work_off_a_straggler(plan: hapnb.Plan) -> None:
    th = theory(plan.graph)
    pred = predicted_compute(plan)
    assert len(pred) == 3 and min(pred) > 0
    k = 4e-3 / pred[0]  # measured seconds per predicted second
    comp = [k * pred[0], k * pred[1], 3 * k * pred[2]]
    fit = fit_speeds(comp, pred)
    window = {"compute_s": comp, "step_s": [0.02] * 3}
    p = propose(
        plan, th, fit, window, RebalanceOptions(), step=8, steps_left=100, stragglers=(2,), codegen_s=0.01
    )
    assert p.accepted, p.reason
    assert "v100-2 (rank 2)" in p.reason
    r = p.new_ratios[0]
    assert r[2] < r[0] and r[2] < r[1] and math.isclose(sum(r), 1.0)
    assert p.predicted_step_s < p.step_s and p.predicted_gain == pytest.approx(p.step_s - p.predicted_step_s)
    # the new plan is the same program (same instructions but for lengths) at the new ratios
    assert [(i.kind, i.name, i.tensor) for i in p.plan.program] == [
        (i.kind, i.name, i.tensor) for i in plan.program
    ]
    assert p.reshard_s_estimate == pytest.approx(0.01 + 3 * 0.02)
    # an optimizer step (which does not shrink with the share) is kept in the prediction
    opt = {**window, "optimizer_s": [1e-3, 1e-3, 3e-3]}
    q = propose(plan, th, fit_speeds([c - o for c, o in zip(comp, opt["optimizer_s"])], pred), opt, RebalanceOptions(),
                step=8, steps_left=100, codegen_s=0.0)  # fmt: skip
    assert q.predicted_step_s > p.predicted_step_s
    # too few steps left to repay the reshard: rejected, saying why
    q = propose(
        plan, th, fit, window, RebalanceOptions(), step=8, steps_left=2, stragglers=(2,), codegen_s=0.01
    )
    assert not q.accepted and "pay back" in q.reason and q.plan is None
    json.dumps(q.record())
    # the measured cluster is the plan's, each device slower by its scale
    c = measured_cluster(plan.cluster, fit.scale)
    assert c.devices[0].flops / c.devices[2].flops == pytest.approx(3.0)


def test_equal_speeds_predict_no_gain(plan: hapnb.Plan) -> None:
    pred = predicted_compute(plan)
    comp = [2e-3 * x / pred[0] for x in pred]
    p = propose(
        plan, theory(plan.graph), fit_speeds(comp, pred), {"compute_s": comp, "step_s": [0.01] * 3},
        RebalanceOptions(), step=4, steps_left=1000,
    )  # fmt: skip
    assert not p.accepted and "under" in p.reason


def test_summary_before_and_after() -> None:
    m = [
        {"rank": 0, "step": s, "global_loss": 2.0 - s / 10, "step_s": t}
        for s, t in enumerate([9, 3, 3, 3, 1, 1, 1])
    ]
    m.append({"rank": 0, "event": "rebalance", "rebalance": {"step": 3, "accepted": True}})
    m.append({"rank": 0, "event": "rebalance", "rebalance": {"step": 1, "accepted": False}})
    m.append({"rank": 0, "event": "telemetry", "step": 3})
    s = summarize(m)
    assert s["step_s_before"] == 3 and s["step_s_after"] == 1
    assert [r["step"] for r in s["rebalances"]] == [3] and len(s["rejected"]) == 1
    assert len(s["losses"]) == len(s["step_s"]) == 7


def test_telemetry_window_and_clock_restore() -> None:
    import torch.distributed as dist

    before = dist.all_reduce
    with CollectiveClock() as clock:
        assert dist.all_reduce is not before
        assert clock.original("all_reduce") is before
    assert dist.all_reduce is before
    w = Window()
    for c in (1.0, 2.0, 3.0):
        w.add(compute_s=c, comm_s=0.1, step_s=c + 0.1, memory=int(c))
    tab = table(w.gather(0.5, torch.device("cpu")))  # one process: its own row
    assert tab["compute_s"] == [2.0] and tab["steps"] == [3.0] and tab["memory"] == [3.0]
    assert len(w) == 0  # a new window


def test_launch_checks_rebalance_arguments_before_starting(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"  # no rank starts: the arguments fail first
    bundle.mkdir()
    with pytest.raises(ValueError, match="rank 5, but the job has ranks 0..2"):
        launch(bundle, nproc=3, slowdown={5: 2.0})
    with pytest.raises(ValueError, match="unknown rebalance option"):
        launch(bundle, nproc=3, rebalance={"every_steps": 2})


# -------------------------------------------------------------------------------------- end to end


def _run(bundle: Path, extra: list[str], **kw) -> hapnb.run.launch.JobResult:
    job = launch(
        bundle, nproc=3, steps=48, timeout_s=60, wall_timeout_s=150, dtype="float64",
        extra_args=["--no-dropout", *extra], **kw,
    )  # fmt: skip
    with job:
        return job.wait()


@pytest.mark.slow
@pytest.mark.timing  # the choice between the two options rests on measured step times: run alone
def test_straggler_changes_the_program_live_and_the_math_does_not_change(
    plan: hapnb.Plan, tmp_path: Path
) -> None:
    """The plan was made for V100s: it shards its layers and computes the head replicated. On CPU ranks
    with rank 2 slowed 3x, new ratios cannot move the replicated compute off the straggler: the planner on
    the measured cluster (devices and links fitted) finds another program, taken live at a step boundary
    (sharded parameters, Adam's state and the data shares move into the new program's forms)."""
    bundle = write_bundle(plan, tmp_path / "bundle")
    calm = _run(bundle, [], telemetry=True)  # the no-rebalance run: its losses are the reference
    assert calm.ok, calm.error
    s0 = summarize(calm.metrics)
    assert s0["rebalances"] == [] and s0["rejected"] == []
    assert all("compute_s" in m and "comm_s" in m for m in calm.metrics if "loss" in m)
    tele = [m for m in calm.metrics if m.get("event") == "telemetry"]
    assert tele and all("link_scale" in m and "link_overall" in m for m in tele)
    assert {"all_reduce", "broadcast"} <= set(tele[-1]["link_scale"])  # the kinds this plan runs

    slow = _run(
        bundle, ["--verify-out", str(tmp_path / "v")], rebalance={"max_rebalances": 1}, slowdown={2: 3.0}
    )
    assert slow.ok, slow.error
    s1 = summarize(slow.metrics)
    assert len(s1["rebalances"]) == 1, s1["rejected"]
    r = s1["rebalances"][0]
    assert r["program_changed"], r["reason"]
    assert [o["program_changed"] for o in r["options"]] == [False, True]
    assert r["new_ratios"][0][2] < r["old_ratios"][0][2]  # work moved off the slowed rank
    assert r["predicted_step_s"] > 0 and r["predicted_gain"] > 0 and "rank 2" in r["reason"]
    assert r["link_scale"] and r["replan_s"] > 0 and r["reshard_s"] > 0
    assert len(s1["losses"]) == len(s0["losses"]) == 48
    for a, b in zip(s1["losses"], s0["losses"]):
        assert a == pytest.approx(b, rel=1e-9)

    # the weights after the last step (in the new program) equal one device's
    b = load_bundle(bundle)
    ref = run_reference(b.graph, b.inputs, 48, optimizer="adam")
    recs = [torch.load(tmp_path / "v" / f"rank{r}.pt", weights_only=True) for r in range(3)]
    for name, want in ref["weights"].items():
        rows = [next(p for p in rec["params"] if p[1] == name) for rec in recs]
        pieces = [rec["weights"][row[0]] for rec, row in zip(recs, rows)]
        dim = int(rows[0][3])
        got = torch.cat(pieces, dim) if dim >= 0 else pieces[0]
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), name
    before = {i.tensor: i.form for i in plan.program if i.kind == "load"}
    after = {row[1]: int(row[3]) for row in recs[0]["params"]}
    # a parameter changed form (sharded <-> replicated) and the pinned one was re-cut sharded
    assert any((before[n] == "I") != (d < 0) for n, d in after.items() if n in before), (before, after)
    assert after["layers.1.weight"] >= 0


@pytest.mark.slow
@pytest.mark.timing  # a reshard happens only if a measured straggler is worth re-balancing: run alone
def test_rank_dying_in_a_reshard_names_it(plan: hapnb.Plan, tmp_path: Path) -> None:
    job = launch(
        plan, nproc=3, steps=60, timeout_s=30, wall_timeout_s=120, rebalance={"max_rebalances": 1},
        slowdown={2: 3.0}, extra_args=["--fault-reshard-rank", "1"],
    )  # fmt: skip
    with job:
        res = job.wait()
    assert not res.ok and res.failed_rank == 1
    assert "rank 1" in res.error and "while resharding" in res.error, res.error
    assert res.status == "failed"  # a crash, not a timeout: nothing hung
    assert_gone(job.pids)
