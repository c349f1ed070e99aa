"""hapnb.session.Session without any widget: the search cursor, pins, ratio locks, plans and their diff,
cluster edits, and the verify/launch job state (the real verify and launch, marked slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import synthetic  # noqa: E402
from replay import DECISION, REPLAY, ReplayJob  # noqa: E402

from hapnb.hardware.cluster import Cluster  # noqa: E402
from hapnb.ir.forms import FullShard  # noqa: E402
from hapnb.plans.plan import Plan  # noqa: E402
from hapnb.run.launch import JobState  # noqa: E402
from hapnb.session import AUTO, PlanDiff, Progress, Session, UnknownPinError  # noqa: E402
from hapnb.synth.search import PinError, Search  # noqa: E402
from hapnb.triples import theory  # noqa: E402

CLUSTER = "2xV100+2xP100"


@pytest.fixture(scope="module")
def th():
    return theory(synthetic.mlp_graph(), synthetic.strategies)


@pytest.fixture
def s(th):
    return Session(th, CLUSTER)


def _ids(nodes):
    return [n.id for n in nodes]


def test_hapnb_exports_the_session_and_never_loads_a_widget_toolkit():
    import subprocess

    code = (
        "import sys, hapnb; s = hapnb.Session; import hapnb.session; "
        "assert s is hapnb.session.Session; "
        "assert not any(m.startswith(('ipywidgets', 'hapnb.widgets')) for m in sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_session_has_a_plan_and_a_fresh_cursor(s, th):
    assert s.plan.cost_s > 0 and s.plans == [s.plan] and s.previous_plan is None and s.diff is None
    assert s.cluster.names == Cluster.parse(CLUSTER).names and s.draft == s.cluster
    assert s.stats["expansions"] == 0 and s.current == 0 and s.event is None and not s.done
    assert s.search.ratios == s.plan.ratios  # the cursor searches at the plan's ratios
    assert s.ratio_values == dict(zip(s.cluster.names, s.plan.ratios[0])) and s.ratio_locks == {}
    assert "expansions" in repr(s) and s.plan.name in repr(s)
    assert "<div>" in s._repr_html_()
    # from the plan: the same plan, the same ratios, its pins
    s2 = Session(s.plan)
    assert s2.plan is s.plan and s2.search.ratios == s.plan.ratios and s2.pins == dict(s.plan.pins)
    with pytest.raises(ValueError, match="cluster"):
        Session(th)


def test_step_run_reset_and_use_best_move_the_cursor_as_the_search_does(s, th):
    ref = Search(th, s.cluster, ratios=s.plan.ratios)
    ev, want = s.step(), ref.step()
    assert ev == want and s.event is ev and s.current == ev.popped.id == 0
    assert _ids(s.frontier) == _ids(ref.frontier)
    seen: list[Progress] = []
    ev = s.step_n(2, progress=seen.append)
    ref.step()
    assert ev == ref.step() and s.stats["expansions"] == 3 and s.current == ev.popped.id
    assert _ids(s.frontier) == _ids(ref.frontier)
    assert seen and seen[-1].done == seen[-1].total == 2 and "3 expansions" in seen[-1].text
    ev = s.run_to_complete()
    assert any(c.complete for c in ev.children) and s.best is not None
    best = s.run(progress=seen.append)
    truth = Search(th, s.cluster, ratios=s.plan.ratios).run()
    assert s.done and best == s.best and best.cost == pytest.approx(truth.cost)
    assert s.current == best.id and s.event is None and "done" in seen[-1].text
    old = s.plan
    plan = s.use_best()
    assert plan is s.plan and s.previous_plan is old and s.plans == [old, plan]
    assert plan.cost_s == pytest.approx(truth.cost)
    assert isinstance(s.diff, PlanDiff) and s.stats["expansions"] == 0  # a new plan restarts the cursor
    s.step()
    s.reset()
    assert s.stats["expansions"] == 0 and s.current == 0 and s.event is None


def test_select_and_enabled_follow_the_current_node(s):
    s.step()
    root_enabled = s.enabled()
    kid = s.event.children[0].id
    assert s.select(kid).id == kid and s.current == kid
    assert s.enabled() != root_enabled
    for bad in (-1, 10**6):
        with pytest.raises(IndexError, match=f"#{bad}"):
            s.select(bad)
    assert s.current == kid


def test_use_best_before_a_complete_program_is_an_error(s):
    with pytest.raises(RuntimeError, match="no complete program"):
        s.use_best()
    assert s.plans == [s.plan]


def test_a_pin_changes_the_plan_and_the_diff_names_it(s):
    assert s.plan.form_of("x") != ["G0"]
    assert s.set_pin("x", "G0") == "G0" and s.pins == {"x": "G0"}
    old = s.plan
    plan = s.resynthesize()
    assert plan.form_of("x") == ["G0"] and plan.pins == (("x", "G0"),)
    assert s.previous_plan is old and s.plan is plan
    d = s.diff
    assert ("x", None, "G0") in d.pins and "x" in d.names
    assert any(t == "x" and new == ("G0",) for t, _, new in d.forms)
    assert (d.old_cost_s, d.new_cost_s) == (old.cost_s, plan.cost_s) and not d.same_program
    assert "x: auto -> G0" in d.summary() and str(d) == d.summary()
    assert "cost" in d._repr_html_()
    assert s.search.pins  # the cursor restarted under the pin
    assert s.set_pin("x", AUTO) == AUTO and s.pins == {}
    s.resynthesize()
    assert ("x", "G0", None) in s.diff.pins


def test_an_unsatisfiable_pin_raises_naming_the_pin(s):
    plan = s.plan
    s.set_pin("x", "G0")
    s.set_pin("w0", "G1")  # mm_0 has no strategy for (x:G0, w0:G1)
    with pytest.raises(PinError) as e:
        s.resynthesize()
    assert "w0" in str(e.value) and "x=G0" in str(e.value) and "mm_0" in str(e.value)
    assert s.plan is plan and s.plans == [plan]  # nothing changed
    s.set_pin("w0", None)
    assert s.resynthesize().form_of("x") == ["G0"]
    with pytest.raises(UnknownPinError, match="nope") as e:
        s.set_pin("nope", "I")
    assert isinstance(e.value, KeyError) and str(e.value).startswith("pin nope")
    with pytest.raises(PinError, match="w0=R"):
        s.set_pin("w0", "R")  # parameters cannot be partial sums
    with pytest.raises(UnknownPinError):
        s.pin_options("nope")
    storages = ("zero3(0)", "zero2(0)", "zero3(1)", "zero2(1)")  # parameter storage pins (ZeRO-3 / ZeRO-2)
    assert s.pin_options("w0") == (AUTO, "I", "G0", "G1", *storages) and "w0" in s.pinnable()
    assert s.set_pin("w0", FullShard(1)) == "zero3(1)"  # a storage pin, re-planned like a form pin
    assert any(i.name == "load_zero3" and i.tensor == "w0" for i in s.resynthesize().program)
    s.set_pin("w0", None)
    with pytest.raises(UnknownPinError):
        Session(s.theory, CLUSTER, pins={"nope": "I"})


def test_a_locked_ratio_comes_back_from_the_lp(s):
    old = s.plan
    s.set_ratio("p100-0", 0.02)
    assert s.ratio_locks == {"p100-0": 0.02} and s.ratio_values["p100-0"] == 0.02
    plan = s.resynthesize()
    j = plan.cluster.names.index("p100-0")
    assert plan.ratios[0][j] == pytest.approx(0.02, abs=1e-6)
    assert ("p100-0", 0.02, 0.02) in plan.ratio_pins and plan.cost_s != pytest.approx(old.cost_s)
    assert s.ratio_values == pytest.approx(dict(zip(plan.cluster.names, plan.ratios[0])))
    assert any(d == "p100-0" for d, _, _ in s.diff.ratios)
    s.set_ratio("v100-1", 0.4, lock=False)  # a value without a lock
    assert s.ratio_values["v100-1"] == 0.4 and "v100-1" not in s.ratio_locks
    s.set_ratio("v100-1", 0.4)
    s.unlock("v100-1")
    assert s.ratio_locks == {"p100-0": 0.02}
    # errors name the device and change nothing
    with pytest.raises(KeyError, match="gpu9"):
        s.set_ratio("gpu9", 0.1)
    with pytest.raises(ValueError, match="p100-1"):
        s.set_ratio("p100-1", 1.5)
    s.set_ratio("v100-0", 0.8)
    s.set_ratio("v100-1", 0.8)
    with pytest.raises(ValueError, match="v100-0") as e:
        s.resynthesize()
    assert "v100-1" in str(e.value) and s.plan is plan
    s.unlock()
    assert s.ratio_locks == {}
    # locks given to the constructor
    s2 = Session(s.theory, CLUSTER, ratios={"p100-0": 0.02})
    assert s2.plan.ratios[0][j] == pytest.approx(0.02, abs=1e-6) and s2.ratio_locks == {"p100-0": 0.02}
    assert Session(s2.plan).ratio_locks == {"p100-0": 0.02}  # a plan brings its locks along


def test_a_cluster_edit_changes_the_cost(s):
    c0 = s.plan.cost_s
    v100 = s.cluster.devices[0]
    d = s.edit_device("v100-0", flops=v100.flops / 10)
    assert d.flops == pytest.approx(v100.flops / 10) and s.draft_pending
    assert s.cluster.devices[0] == v100 and s.plan.cost_s == c0  # a draft until applied
    plan = s.apply_cluster()
    assert not s.draft_pending and s.cluster.devices[0].flops == pytest.approx(v100.flops / 10)
    assert "(edited)" in s.cluster.name and plan.cost_s > c0 and plan.cluster == s.cluster
    assert s.diff.cluster == (Cluster.parse(CLUSTER).name, s.cluster.name)
    s.set_pin("x", "G0")  # data parallel: communication-bound gradient sync
    c2 = s.resynthesize().cost_s
    for kind, col in s.cluster.collectives:  # a 100x slower network
        s.set_collective(kind, bandwidth_Bps=col.bandwidth_Bps / 100, latency_s=col.latency_s * 100)
    assert s.apply_cluster().cost_s > c2 and s.cluster.name.count("(edited)") == 1
    # memory edits; unchanged values leave the draft alone
    s.edit_device("p100-1", memory_bytes=2**30)
    assert s.draft.devices[3].memory_bytes == 2**30
    s.discard_draft()
    assert s.draft == s.cluster
    s.edit_device("p100-1", flops=s.cluster.devices[3].flops)
    assert not s.draft_pending
    # errors name the device / collective and leave the draft as it was
    with pytest.raises(KeyError, match="gpu9"):
        s.edit_device("gpu9", flops=1e12)
    with pytest.raises(ValueError, match="v100-1"):
        s.edit_device("v100-1", flops=-1.0)
    with pytest.raises(KeyError, match="teleport"):
        s.set_collective("teleport", latency_s=0.0)
    assert not s.draft_pending
    # a cluster with other devices: locks of devices it lacks go, the ratio values follow its plan
    s.set_ratio("v100-0", 0.3)
    before = s.cluster
    s.load_cluster("a100-p100")
    assert s.cluster == before and s.draft.names == Cluster.preset("a100-p100").names
    s.apply_cluster()
    assert s.cluster.names == Cluster.preset("a100-p100").names and s.ratio_locks == {}
    assert list(s.ratio_values) == list(s.cluster.names)
    # an apply that fails (an unsatisfiable lock) changes nothing
    plan, cluster = s.plan, s.cluster
    s.set_ratio(s.cluster.names[0], 1.0)
    s.set_ratio(s.cluster.names[1], 1.0)
    s.edit_device(s.cluster.names[0], flops=s.cluster.devices[0].flops * 2)
    with pytest.raises(ValueError, match="ratio"):
        s.apply_cluster()
    assert s.plan is plan and s.cluster == cluster and s.draft_pending


def test_no_job_yet(s):
    state = s.poll()
    assert isinstance(state, JobState) and not state.started and not state.running
    assert state.summary() == "no launch yet" and s.metrics == [] and s.measured == []
    assert s.job is None and s.stop() is None and s.verify_report is None
    with pytest.raises(RuntimeError, match="launch"):
        s.follow()


def test_a_plan_loaded_from_json_is_rebuilt_from_its_zoo_model(tmp_path):
    from hapnb import zoo

    s = Session("mlp", CLUSTER, **zoo.TINY["mlp"])
    assert s.plan.model_spec and s.plan.model_spec["name"] == "mlp"
    loaded = Plan.load(s.plan.save(tmp_path / "p.json"))
    assert loaded.graph is None
    s2 = Session(loaded)
    assert s2.graph.fingerprint == s.graph.fingerprint and s2.plan == loaded
    assert s2.plan.graph is s2.graph  # kept with the plan: re-planning does not rebuild the model again
    s2.run()
    # the search at the plan's ratios finds the stage-model optimum; the plan is the candidate the
    # simulator found fastest, never cheaper than that optimum
    assert s2.best.cost <= loaded.cost_s * (1 + 1e-6)
    assert dict(s2.use_best().model) == dict(loaded.model)  # the model spec travels with new plans


# ------------------------------------------------------------------------------------- real run layer
@pytest.fixture(scope="module")
def tiny():
    from hapnb import zoo

    return Session("mlp", "1xV100+1xP100", **zoo.TINY["mlp"])


@pytest.mark.slow
def test_verify_keeps_the_real_report(tiny):
    report = tiny.verify(nproc=2)
    assert report.ok and tiny.verify_report is report
    assert isinstance(report.summary(), str) and report.summary()
    with pytest.raises(ValueError, match="nproc"):
        tiny.verify(nproc=3)
    assert tiny.verify_report is None  # a failed verify leaves no stale report


@pytest.mark.slow
def test_job_state_of_a_real_launch(tiny):
    from hapnb.run.launch import Job, JobResult

    job = tiny.launch(nproc=2, steps=3, timeout_s=120)
    assert isinstance(job, Job) and tiny.job is job
    with pytest.raises(RuntimeError, match="running"):
        tiny.launch(nproc=2, steps=3)
    states: list[JobState] = []
    result = tiny.follow(states.append)
    assert isinstance(result, JobResult) and result.ok, result.error
    last = tiny.poll()
    assert states[-1] == last and not last.running and last.result is result and last.started
    assert len(last.step_times) == 3 and last.steps == 3 and last.predicted_s == tiny.plan.cost_s
    assert {(m["rank"], m["step"]) for m in last.metrics} == {(r, k) for r in range(2) for k in range(3)}
    assert last.summary() == f"launch finished: {result.summary()}" and last.mean_step_s > 0
    assert tiny.measured == list(last.step_times) and len(tiny.metrics) == 6
    assert tiny.stop() is result  # stopping an ended job is harmless
    # the measured overlay belongs to the plan that ran
    tiny.resynthesize()
    assert tiny.measured == [] and len(tiny.metrics) == 6
    # a long launch stops on request
    tiny.launch(nproc=2, steps=100_000, timeout_s=120)
    assert tiny.poll().running
    stopped = tiny.stop()
    assert stopped is not None and not stopped.ok and not tiny.poll().running
    assert tiny.poll().result is stopped


# ------------------------------------------------------------------------------ live re-balancing (no processes)
def test_launch_passes_rebalancing_through_and_follow_reports_windows_and_decisions(s, monkeypatch):
    import hapnb.run.launch as launch_module
    from hapnb import display

    calls = []

    def fake_launch(plan, **kw):
        calls.append((plan, kw))
        return ReplayJob(REPLAY)

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    s.launch(nproc=2, steps=3)  # defaults: no re-balancing, no straggler
    assert calls[-1][1]["rebalance"] is False and calls[-1][1]["slowdown"] is None
    s.follow()
    changes = []
    s.subscribe(changes.append)
    job = s.launch(nproc=2, steps=3, rebalance={"every": 1}, slowdown={1: 3.0}, dtype="float64")
    plan, kw = calls[-1]
    assert plan is s.plan and s.job is job
    assert kw == dict(
        nproc=2, backend="gloo", steps=3, rebalance={"every": 1}, slowdown={1: 3.0}, dtype="float64"
    )
    assert s.rebalances == []  # nothing arrived yet
    result = s.follow(interval_s=1e9)
    assert result.ok and s.rebalances == [DECISION]
    kinds = [c.kind for c in changes]
    assert kinds[0] == "job" and kinds[-1] == "job"
    (window,) = [c for c in changes if c.kind == "progress"]
    assert window.progress == Progress(2, 3, display.telemetry_text(REPLAY[4]))  # step 1 of 3 done
    (decided,) = [c for c in changes if c.kind == "rebalance"]
    assert decided.rebalance == DECISION and decided.text == display.rebalance_text(DECISION)
    assert "ratios 0.500/0.500 -> 0.800/0.200" in decided.text
    assert kinds.index("progress") < kinds.index("rebalance")  # in the order the job printed them
