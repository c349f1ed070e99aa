"""hapnb.widgets.Explorer driven programmatically: every control has the effect it promises."""

from __future__ import annotations

import html as html_lib
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers

import synthetic  # noqa: E402
from hapnb.widgets import Explorer  # noqa: E402

from hapnb.hardware.cluster import Cluster  # noqa: E402
from hapnb.plans.synthesis import synthesize  # noqa: E402
from hapnb.synth.search import Search  # noqa: E402
from hapnb.triples import theory  # noqa: E402

CLUSTER = "2xV100+2xP100"


@pytest.fixture(scope="module")
def th():
    return theory(synthetic.mlp_graph(), synthetic.strategies)


@pytest.fixture
def ex(th):
    return Explorer(th, CLUSTER)


def test_construct_and_display(ex, th):
    assert ex.plan.cost_s > 0 and ex.search.stats["expansions"] == 0
    assert ex.cluster.names == Cluster.parse(CLUSTER).names
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert f"{ex.plan.cost_s * 1e3:.4g} ms" in ex.outputs["header"].value
    assert ex.controls["tabs"].get_title(0) == "Search" and len(ex.controls["tabs"].children) == 6
    # from a Plan: same plan, search at its ratios
    ex2 = Explorer(ex.plan)
    assert ex2.plan is ex.plan and ex2.search.ratios == ex.plan.ratios
    # a view over an existing session: the same state, shown
    ex.session.step()
    ex3 = Explorer(ex.session)
    assert (
        ex3.session is ex.session
        and ex3.search is ex.search
        and "1 expansions" in ex3.outputs["search"].value
    )
    with pytest.raises(ValueError, match="cluster"):
        Explorer(ex.session, CLUSTER)


def test_step_updates_frontier_and_tree(ex):
    before_search, before_tree = ex.outputs["search"].value, ex.outputs["tree"].value
    ex.buttons["step"].click()
    assert ex.last_error is None
    assert ex.search.stats["expansions"] == 1 and ex.event.popped.id == 0
    assert ex.outputs["search"].value != before_search and ex.outputs["tree"].value != before_tree
    assert "popped #0" in ex.outputs["search"].value
    for ch in ex.event.children:
        assert f"#{ch.id}" in ex.outputs["search"].value
    assert ex.controls["node"].value == 0
    ex.controls["step_n"].value = 2
    ex.buttons["step_n"].click()
    assert ex.search.stats["expansions"] == 3
    assert ex.current == ex.event.popped.id
    assert f"#{ex.current}" in ex.outputs["tree"].value


def test_the_panel_follows_changes_made_to_its_session_by_a_script(ex):
    """The Explorer is a view: it listens to the session's change events, whoever makes the change."""
    before = ex.outputs["tree"].value
    ex.session.step()
    assert ex.outputs["tree"].value != before and ex.controls["node"].value == ex.session.current
    ex.session.set_pin("w0", "G1")
    assert ex.controls["pin:w0"].value == "G1" and "w0=G1" in ex.outputs["header"].value
    ex.session.set_ratio("v100-1", 0.3)
    assert ex.controls["ratio:v100-1"].value == pytest.approx(0.3) and ex.controls["lock:v100-1"].value
    ex.session.edit_device("p100-0", flops=20e12)
    assert (
        ex.controls["flops:p100-0"].value == pytest.approx(20.0)
        and "not applied" in ex.outputs["draft"].value
    )
    old = ex.outputs["plan"].value
    plan = ex.session.resynthesize()
    assert (
        ex.plan is plan
        and ex.outputs["plan"].value != old
        and "synthesizing" not in ex.controls["progress_label"].value
    )
    # the Explorer's names are the session's, not copies
    assert ex.step.__self__ is ex.session and ex.pins == ex.session.pins
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ex.nope  # noqa: B018


def test_run_to_next_complete_and_run_find_the_optimum(ex, th):
    ex.buttons["run_to_complete"].click()
    assert ex.last_error is None
    assert ex.search.best is not None and any(c.complete for c in ex.event.children)
    ex.buttons["run"].click()
    assert ex.search.done and ex.search.best is not None
    truth = Search(th, ex.cluster, ratios=ex.plan.ratios).run()
    assert ex.search.best.cost == pytest.approx(truth.cost)
    assert ex.current == ex.search.best.id
    assert "done" in ex.controls["progress_label"].value
    assert ex.controls["progress"].value == ex.controls["progress"].max
    ex.buttons["use_best"].click()
    assert ex.last_error is None
    assert ex.plan.cost_s == pytest.approx(truth.cost)
    ex.buttons["reset"].click()
    assert ex.search.stats["expansions"] == 0 and ex.current == 0


def test_select_node_and_depth(ex):
    ex.step()
    kid = ex.event.children[0].id
    ex.controls["node"].value = kid  # as a user typing a node id
    assert ex.current == kid
    assert f"#{kid}" in ex.outputs["tree"].value
    ex.controls["depth"].value = 0
    assert ex.last_error is None


def test_triple_browser_filters_and_highlights(ex, th):
    html = ex.filter_triples(op="mm_0")
    n = len(th.filter(op="mm_0"))
    assert f"showing {n} of {n} triples" in html
    enabled = ex.enabled()
    assert enabled  # at the root: op 0's strategies and loads
    ex.controls["triple_op"].value = None
    ex.controls["only_enabled"].value = True
    html = ex.outputs["triples"].value
    assert html.count("<tr") == len(enabled) + 1
    assert html.count("#fff3b0") == len(enabled)
    ex.controls["words"].value = True
    ex.controls["triple_kind"].value = "load"
    assert "Identity" in ex.outputs["triples"].value
    ex.controls["triple_tensor"].value = "w0"
    assert "w1" not in re.sub(r"<[^>]+>", "", ex.outputs["triples"].value.split("</b>", 1)[1])
    # after a step the highlight follows the popped node
    ex.controls["only_enabled"].value = False
    ex.controls["triple_kind"].value = None
    ex.controls["triple_tensor"].value = None
    ex.step()  # pops the root
    ex.step()  # pops a child: op 1 is next
    assert ex.current != 0 and ex.enabled() != enabled


def test_ratio_lock_resolves_lp_with_pin(ex):
    ex.controls["auto_resynth"].value = False  # the manual flow: lock, then Re-synthesize
    old = ex.plan
    ex.set_ratio("p100-0", 0.02, lock=True)
    assert ex.ratio_locks == {"p100-0": 0.02}
    ex.buttons["resynthesize"].click()
    assert ex.last_error is None
    new = ex.plan
    j = new.cluster.names.index("p100-0")
    assert new.ratios[0][j] == pytest.approx(0.02, abs=1e-6)
    assert ("p100-0", 0.02, 0.02) in new.ratio_pins
    assert new.cost_s != pytest.approx(old.cost_s)
    assert ex.previous_plan is old and "cost" in ex.outputs["diff"].value
    # the other sliders follow the new ratios, the locked one stays
    for k, d in enumerate(new.cluster.names):
        assert ex.controls[f"ratio:{d}"].value == pytest.approx(new.ratios[0][k], abs=1e-3)
    # a user dragging a slider locks it; unlocking removes the pin
    ex.controls["ratio:v100-1"].value = 0.4
    assert ex.ratio_locks["v100-1"] == pytest.approx(0.4) and ex.controls["lock:v100-1"].value
    ex.controls["lock:v100-1"].value = False
    assert "v100-1" not in ex.ratio_locks


def test_unsatisfiable_ratio_locks_show_an_error(ex):
    cost = ex.plan.cost_s
    ex.set_ratio("v100-0", 0.8)
    ex.set_ratio("v100-1", 0.8)
    ex.buttons["resynthesize"].click()  # must not raise
    assert ex.last_error is not None and "ratio" in str(ex.last_error)
    assert "ValueError" in ex.outputs["status"].value or "Error" in ex.outputs["status"].value
    assert ex.plan.cost_s == cost


def test_form_pin_is_honoured(ex):
    assert "G1" in ex.controls["pin:w0"].options and "auto" in ex.controls["pin:w0"].options
    ex.set_pin("w0", "G1")
    plan = ex.resynthesize()
    assert plan.form_of("w0") == ["G1"] and ("w0", "G1") in plan.pins
    # a user choosing in the dropdown, with automatic re-synthesis
    ex.controls["auto_resynth"].value = True
    ex.controls["pin:x"].value = "G0"  # mm_0 has no strategy for (x:G0, w0:G1): shown, not raised
    assert ex.last_error is not None and "w0" in str(ex.last_error) and "mm_0" in str(ex.last_error)
    assert ex.plan is plan
    ex.controls["pin:w0"].value = "auto"
    assert ex.last_error is None
    assert ex.pins == {"x": "G0"} and ex.plan.form_of("x") == ["G0"] and ex.plan.pins == (("x", "G0"),)
    with pytest.raises(ValueError):
        ex.set_pin("w0", "R")  # parameters cannot be partial sums
    with pytest.raises(KeyError):
        ex.set_pin("nope", "I")


def test_cluster_edits_change_the_cost(ex):
    c0 = ex.plan.cost_s
    ex.edit_device("v100-0", flops=ex.cluster.devices[0].flops / 10)
    ex.buttons["apply_cluster"].click()
    assert ex.last_error is None
    assert ex.cluster.devices[0].flops == pytest.approx(Cluster.parse(CLUSTER).devices[0].flops / 10)
    assert "(edited)" in ex.cluster.name and ex.plan.cost_s > c0
    c1 = ex.plan.cost_s
    ex.set_pin("x", "G0")  # data parallel: communication-bound gradient sync
    ex.resynthesize()
    c2 = ex.plan.cost_s
    assert any(i.communicates for i in ex.plan.program)
    for kind, col in ex.cluster.collectives:  # a 100x slower network
        ex.set_collective(kind, bandwidth_Bps=col.bandwidth_Bps / 100, latency_s=col.latency_s * 100)
    ex.apply_cluster()
    assert ex.plan.cost_s > c2 and c1 > 0
    # a preset changes the devices: fields and sliders are rebuilt
    ex.controls["preset"].value = "a100-p100"
    assert "flops:a100-0" in ex.controls
    ex.apply_cluster()
    assert ex.cluster.names == Cluster.preset("a100-p100").names
    assert "ratio:a100-0" in ex.controls and "ratio:v100-0" not in ex.controls
    assert ex.controls["nproc"].value == ex.cluster.gpus
    ex.controls["spec"].value = "2xV100+2xP100"
    ex.buttons["load_spec"].click()
    assert ex.last_error is None and "flops:v100-0" in ex.controls


def test_gantt_and_history_views(ex):
    g = ex.outputs["gantt"].value
    assert g.startswith("<iframe") and "srcdoc" in g
    assert not re.search(r"&lt;script[^&]*\ssrc=", g)  # the embedded page loads no external script
    assert "Q/B alternation" in ex.outputs["history"].value
    assert ex.plan.name in ex.outputs["plan"].value


@pytest.fixture(scope="module")
def tiny_ex():
    """An Explorer on a tiny zoo plan that the real verify and launch can run (2 local ranks)."""
    from hapnb import zoo

    ex = Explorer("mlp", "1xV100+1xP100", **zoo.TINY["mlp"])
    ex.controls["nproc"].value = 2
    return ex


@pytest.mark.slow
def test_launch_streams_real_metrics_and_stop_ends_the_job(tiny_ex):
    ex = tiny_ex
    assert "no launch yet" in ex.outputs["metrics"].value
    ex.controls["steps"].value = 4
    ex.buttons["launch"].click()  # follows the job in a background thread
    assert ex.last_error is None
    ex._launch_thread.join(120)
    assert not ex._launch_thread.is_alive() and ex.last_error is None
    job = ex.session.job
    assert job.nproc == 2 and job.result.ok, job.result.error
    assert len(ex.metrics) == 8 and len(ex.measured) == 4  # 2 ranks x 4 steps; one time per step
    out = ex.outputs["metrics"].value
    mean = sum(ex.measured) / 4
    assert f"measured mean {mean * 1e3:.4g} ms" in out and f"predicted {ex.plan.cost_s * 1e3:.4g} ms" in out
    last = ex.metrics[-1]
    assert f"<td>{float(last['loss']):.5g}</td>" in out  # per-step loss in the table
    assert "launch finished" in ex.outputs["launch_status"].value
    assert html_lib.escape(job.result.summary()) in ex.outputs["launch_status"].value
    assert "measured" in ex.outputs["gantt"].value  # predicted vs measured overlay
    assert ex.controls["progress"].value == ex.controls["progress"].max == 4
    # a second launch while one runs is an error in the panel; Stop ends the running one
    ex.controls["steps"].value = 100_000
    ex.buttons["launch"].click()
    ex.buttons["launch"].click()
    assert "still running" in str(ex.last_error) and "still running" in ex.outputs["status"].value
    ex.buttons["stop"].click()
    ex._launch_thread.join(60)
    assert not ex.session.job.running and not ex.session.job.result.ok
    assert "FAILED" in ex.outputs["launch_status"].value


def test_every_button_is_wired(ex):
    expected = {
        "step", "step_n", "run_to_complete", "run", "reset", "use_best", "resynthesize", "load_spec",
        "apply_cluster", "verify", "launch", "stop", "why_not", "what_if",
    }  # fmt: skip
    assert set(ex.buttons) == expected
    for b in ex.buttons.values():
        assert b._click_handlers.callbacks, b.description


def test_explorer_on_zoo_model():
    base = synthesize("mlp", CLUSTER, layers=2, hidden=64, batch=16)
    ex = Explorer("mlp", CLUSTER, layers=2, hidden=64, batch=16)
    assert ex.plan.cost_s == pytest.approx(base.cost_s, rel=1e-6)
    assert dict(ex.plan.model)  # the zoo spec is kept so the plan can be rebuilt/launched
    ex.run()
    assert ex.search.done and ex.search.best is not None
    w = "layers.0.weight"
    other = next(f for f in ex.controls[f"pin:{w}"].options if f not in ("auto", *ex.plan.form_of(w)))
    ex.set_pin(w, other)
    plan = ex.resynthesize()
    assert plan.form_of(w) == [other]
    # an nn.Module with example inputs
    from hapnb import zoo

    model, inputs, _ = zoo.build("mlp", devices=4, layers=2, hidden=64, batch=16)
    ex2 = Explorer(model, CLUSTER, example_inputs=inputs)
    assert ex2.plan.cost_s == pytest.approx(base.cost_s, rel=1e-6)
    assert len(ex2.graph.ops) == len(base.graph.ops)


# ------------------------------------------------------------------------------------- defects (issue 7)
def _node_left_edges(svg: str) -> dict[str, float]:
    """Left edge (smallest x) of each node's shape in a graphviz SVG, by node name."""
    out = {}
    for body in re.findall(r'<g id="node\d+" class="node">(.*?)</g>', svg, re.S):
        name = re.search(r"<title>(.*?)</title>", body).group(1)
        shape = re.sub(r"<text.*?</text>", "", body, flags=re.S)
        xs = [float(x) for x, _ in re.findall(r"(-?\d+(?:\.\d+)?),(-?\d+(?:\.\d+)?)", shape)]
        if xs:
            out[name] = min(xs)
    return out


def test_search_tab_status_wraps_and_the_tree_opens_at_its_root(ex):
    import ipywidgets as W

    from hapnb import display

    # the status line is not a Label: a Label clips its text with an ellipsis (white-space: nowrap)
    assert not isinstance(ex.controls["progress_label"], W.Label)
    ex.step()
    ex.step()
    assert "2 expansions" in ex.controls["progress_label"].value
    # search view and tree drawing each get the whole width, one below the other (side by side, each
    # got half and clipped the status text); wide tables and drawings scroll inside their own box
    # instead of widening the text, which then wraps at the box's width
    tab = ex.controls["tabs"].children[0]
    assert ex.outputs["search"] in tab.children and ex.outputs["tree"] in tab.children
    for key in ("search", "tree"):
        assert ex.outputs[key].layout.width == "100%"
        assert "contain:inline-size" in ex.outputs[key].value
        assert "overflow-x:auto" in ex.outputs[key].value
    # the drawing grows from the root at its left edge, where a scroll box starts
    if display.has_dot():
        edges = _node_left_edges(ex.outputs["tree"].value)
        assert len(edges) > 3 and edges["n0"] == min(edges.values())


@pytest.mark.slow
def test_verify_button_shows_the_real_report(tiny_ex):
    """The Verify button runs the real ``verify`` on a tiny zoo plan and shows its summary line (it used
    to call a ``summary()`` the report lacked and print the raw dataclass repr instead)."""
    ex = tiny_ex
    ex.controls["nproc"].value = 2
    ex.buttons["verify"].click()
    assert ex.last_error is None
    status = ex.outputs["launch_status"].value
    assert "VerifyReport(" not in status and "TensorCheck(" not in status
    assert "#060" in status  # shown as a pass
    report = ex.session.verify_report
    assert report.ok and html_lib.escape(report.summary()) in status
    assert report.nproc == 2 and report.plan == ex.plan.name  # the current plan, the nproc field
    # a verify that cannot run shows the error in the panel (the button never raises)
    ex.controls["nproc"].value = 3
    ex.buttons["verify"].click()
    assert isinstance(ex.last_error, ValueError) and "nproc" in ex.outputs["status"].value
    assert "failed" in ex.outputs["launch_status"].value
    ex.controls["nproc"].value = 2


def test_every_control_calls_the_session_and_renders(ex, monkeypatch):
    """The panel is a view: each button, field and selector calls one Session method and re-renders."""
    ex.controls["auto_resynth"].value = False  # one control, one call (re-planning on change: test_explain)
    calls: list[str] = []
    for name in (
        "step", "step_n", "run_to_complete", "run", "reset", "select", "use_best", "set_pin", "set_ratio",
        "resynthesize", "load_cluster", "edit_device", "set_collective", "apply_cluster", "stop",
    ):  # fmt: skip
        real = getattr(ex.session, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ex.session, name, spy)

    def fire(action, method, output):
        calls.clear()
        before = ex.outputs[output].value
        action()
        assert ex.last_error is None, ex.last_error
        assert calls and calls[0] == method, (method, calls)
        assert ex.outputs[output].value != before, f"{method} did not re-render {output}"

    def set_value(key, value):
        return lambda: setattr(ex.controls[key], "value", value)

    c, b = ex.controls, ex.buttons
    fire(b["step"].click, "step", "tree")
    fire(set_value("node", ex.event.children[0].id), "select", "tree")
    fire(b["run_to_complete"].click, "run_to_complete", "search")
    fire(b["reset"].click, "reset", "search")
    c["step_n"].value = 2
    fire(b["step_n"].click, "step_n", "search")
    fire(b["run"].click, "run", "search")
    fire(b["use_best"].click, "use_best", "diff")
    fire(b["step"].click, "step", "search")
    fire(b["reset"].click, "reset", "search")
    fire(set_value("pin:w0", "G0"), "set_pin", "header")
    fire(set_value("ratio:p100-0", 0.05), "set_ratio", "locks")
    fire(set_value("lock:p100-0", False), "set_ratio", "locks")
    fire(b["resynthesize"].click, "resynthesize", "diff")
    fire(set_value("flops:v100-0", c["flops:v100-0"].value / 2), "edit_device", "draft")
    fire(set_value("memory:p100-1", 1.0), "edit_device", "draft")
    fire(b["apply_cluster"].click, "apply_cluster", "cluster")
    fire(set_value("bw:all_reduce", c["bw:all_reduce"].value / 10), "set_collective", "draft")
    fire(b["apply_cluster"].click, "apply_cluster", "cluster")
    fire(set_value("lat:all_gather", c["lat:all_gather"].value * 10), "set_collective", "draft")
    fire(set_value("preset", "a100-p100"), "load_cluster", "draft")
    c["spec"].value = "2xV100+2xP100"
    fire(b["load_spec"].click, "load_cluster", "draft")
    calls.clear()
    b["stop"].click()  # nothing launched: harmless
    assert calls == ["stop"] and ex.last_error is None and "no launch yet" in ex.outputs["metrics"].value


def test_launch_panel_passes_rebalancing_through_and_draws_the_live_chart(ex, monkeypatch):
    """Re-balance and straggler controls reach the launch; the chart is redrawn at the decision and at the end
    (a replayed job: no processes)."""
    from replay import DECISION, REPLAY, ReplayJob

    import hapnb.run.launch as launch_module
    from hapnb import display

    calls = []
    monkeypatch.setattr(launch_module, "launch", lambda plan, **kw: calls.append(kw) or ReplayJob(REPLAY))
    c, out = ex.controls, ex.outputs
    assert [v for _, v in c["slow_rank"].options] == [-1, 0, 1, 2, 3]  # none, or one of the 4 ranks
    c["slow_rank"].value = 3
    c["nproc"].value = 2  # the straggler choice follows nproc (rank 3 is gone)
    assert [v for _, v in c["slow_rank"].options] == [-1, 0, 1] and c["slow_rank"].value == -1
    assert out["live_chart"].value == "" and not c["rebalance"].value
    c["rebalance"].value, c["slow_rank"].value, c["slow_factor"].value, c["steps"].value = True, 1, 2.5, 3
    charts = []
    out["live_chart"].observe(lambda ch: charts.append(ch["new"]), names="value")
    ex.launch_panel.chart_interval_s = 1e9  # while it runs: only the forced redraws
    ex.buttons["launch"].click()
    ex._launch_thread.join(60)
    assert ex.last_error is None, ex.last_error
    kw = calls[-1]
    assert (kw["nproc"], kw["steps"], kw["rebalance"], kw["slowdown"]) == (2, 3, True, {1: 2.5})
    # drawn when the job started, at the re-balance, and complete at the end
    assert len(charts) == 3 and charts[0] == "<div>waiting for the first step...</div>"
    assert all(ch.startswith("<iframe srcdoc=") and "after step 1: re-balanced" in ch for ch in charts[1:])
    assert "2 ranks, step 2/3; 1 re-balance" in charts[1] and "2 ranks, step 3/3; 1 re-balance" in charts[2]
    assert "<b>re-balanced</b>" in out["rebalances"].value and "0.800/0.200" in out["rebalances"].value
    assert "launch finished" in out["launch_status"].value and ex.rebalances == [DECISION]
    assert c["progress_label"].value == html_lib.escape(display.telemetry_text(REPLAY[4]))
    # arguments given to Explorer.launch win over the controls
    ex.launch(nproc=2, steps=3, rebalance=False, slowdown={}, dtype="float64")
    kw = calls[-1]
    assert (kw["rebalance"], kw["slowdown"], kw["dtype"]) == (False, None, "float64")
    assert c["rebalance"].value and ex.launch_panel.slowdown() == {1: 2.5}
    c["slow_factor"].value = 1.0
    assert ex.launch_panel.slowdown() == {}  # 1x is no straggler
