"""hapnb.widgets.Explorer driven programmatically: every control has the effect it promises."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import synthetic  # noqa: E402
from hapnb.widgets import Explorer  # noqa: E402

from hapnb.cluster import Cluster  # noqa: E402
from hapnb.search import Search  # noqa: E402
from hapnb.synthesis import synthesize  # noqa: E402
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
    ex.controls["spec"].value = "2xV100+2xP100"
    ex.buttons["load_spec"].click()
    assert ex.last_error is None and "flops:v100-0" in ex.controls


def test_gantt_and_history_views(ex):
    g = ex.outputs["gantt"].value
    assert g.startswith("<iframe") and "srcdoc" in g
    assert not re.search(r"&lt;script[^&]*\ssrc=", g)  # the embedded page loads no external script
    assert "Q/B alternation" in ex.outputs["history"].value
    assert ex.plan.name in ex.outputs["plan"].value


def test_verify_and_launch_stream_metrics(ex, monkeypatch):
    launch_module = sys.modules["hapnb.run.launch"]

    calls = {}

    class Result:
        ok = True

        def summary(self):
            return "loss and 3 gradients match (max rel err 1e-7)"

    def fake_verify(plan, nproc):
        calls["verify"] = (plan, nproc)
        return Result()

    class Job:
        def __init__(self, steps):
            self.steps = steps

        def metrics(self):
            for s in range(self.steps):
                for r in range(2):
                    yield {"rank": r, "step": s, "loss": 2.0 - 0.1 * s, "step_s": ex.plan.cost_s * 1.5}

        def wait(self):
            return None

        def stop(self):
            calls["stop"] = True

    def fake_launch(plan, nproc, backend, steps):
        calls["launch"] = (plan, nproc, backend, steps)
        return Job(steps)

    monkeypatch.setitem(sys.modules, "hapnb.run.runtime", types.SimpleNamespace(verify=fake_verify))
    monkeypatch.setattr(launch_module, "launch", fake_launch)
    ex.controls["nproc"].value = 2
    ex.buttons["verify"].click()
    assert ex.last_error is None and calls["verify"] == (ex.plan, 2)
    assert "gradients match" in ex.outputs["launch_status"].value
    ex.controls["steps"].value = 4
    ex.buttons["launch"].click()  # streams in a background thread
    ex._launch_thread.join(10)
    assert ex.last_error is None
    assert calls["launch"] == (ex.plan, 2, "gloo", 4)
    assert len(ex.metrics) == 8 and len(ex.measured) == 4
    out = ex.outputs["metrics"].value
    assert f"measured mean {ex.plan.cost_s * 1.5e3:.4g} ms" in out and "<td>1.7</td>" in out
    assert "measured" in ex.outputs["gantt"].value  # predicted vs measured overlay
    ex.buttons["stop"].click()
    assert calls.get("stop")

    def broken_verify(plan, nproc):
        raise RuntimeError("rank 1 gradient mismatch")

    monkeypatch.setitem(sys.modules, "hapnb.run.runtime", types.SimpleNamespace(verify=broken_verify))
    ex.buttons["verify"].click()  # never raises in the panel
    assert "gradient mismatch" in ex.outputs["status"].value


def test_every_button_is_wired(ex):
    expected = {
        "step", "step_n", "run_to_complete", "run", "reset", "use_best", "resynthesize", "load_spec",
        "apply_cluster", "verify", "launch", "stop",
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
