"""Renderers in hapnb.display: valid HTML/SVG/figures on synthetic and zoo plans, never raising."""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers

import synthetic  # noqa: E402

from hapnb import display as D  # noqa: E402
from hapnb.hardware.cluster import Cluster  # noqa: E402
from hapnb.plans.plan import Plan  # noqa: E402
from hapnb.plans.synthesis import synthesize  # noqa: E402
from hapnb.synth.search import Search  # noqa: E402
from hapnb.triples import theory  # noqa: E402

HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="graphviz `dot` is not installed")

_VOID = {"br", "hr", "img", "input", "meta", "link", "col", "area", "base", "wbr", "source", "rect", "path"}


class _Balance(HTMLParser):
    """Checks that every non-void tag is closed in order (a cheap well-formedness check)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: object) -> None:
        pass

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def check_html(s: str) -> str:
    """Assert ``s`` is balanced HTML; returns its text content."""
    assert isinstance(s, str) and s
    p = _Balance()
    p.feed(s)
    p.close()
    assert not p.errors, p.errors[:5]
    assert not p.stack, f"unclosed tags: {p.stack[:5]}"
    return "".join(p.text)


@pytest.fixture(scope="module")
def syn():
    g = synthetic.mlp_graph()
    th = theory(g, synthetic.strategies)
    c = Cluster.parse("2xV100+2xP100")
    plan = synthesize(th, c, pins={"x": "G0"})  # data parallel input: 2 stages with a collective
    free = synthesize(th, c)
    return g, th, c, plan, free


@pytest.fixture(scope="module")
def zoo_plan():
    return synthesize("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)


# ------------------------------------------------------------------------------------------ safe_html


def test_safe_html_never_raises_and_escapes():
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("repr broke")

    def boom(obj):
        raise ValueError("<script>bad</script>")

    out = D.safe_html(boom, "<b>x</b>")
    text = check_html(out)
    assert "<b>x</b>" in text  # shown as text, escaped in the HTML
    assert "<script>" not in out and "ValueError" in out
    out2 = D.safe_html(boom, Broken())
    check_html(out2)
    assert "repr failed" in out2 and "repr broke" in out2
    assert D.safe_html(lambda o: f"<i>{o}</i>", 3) == "<i>3</i>"


@pytest.mark.parametrize(
    "fn",
    [D.graph_html, D.theory_html, D.search_html, D.plan_html, D.history_html, D.gantt_svg, D.cluster_html],
)
def test_renderers_on_broken_input_degrade_to_text(fn):
    for bad in (None, object(), 42):
        out = D.safe_html(fn, bad)
        check_html(out)
        assert "could not render" in out


def test_repr_html_of_core_objects(syn):
    g, th, c, plan, _ = syn
    s = Search(th, c)
    for obj in (g, th, s, plan, c):
        out = obj._repr_html_()
        check_html(out)
        assert "could not render" not in out, type(obj).__name__


# ------------------------------------------------------------------------------------------ tables


def test_theory_html_filters_and_highlights(syn):
    _, th, *_ = syn
    full = check_html(D.theory_html(th))
    assert f"showing {len(th)} of {len(th)}" in full
    only = th.filter(op="mm_0")
    html = D.theory_html(th, op="mm_0", highlight={only[0].id, only[1].id})
    text = check_html(html)
    assert f"showing {len(only)} of {len(only)} triples" in text
    assert html.count("<tr") == len(only) + 1  # header + one row per triple
    assert html.count("#fff3b0") == 2  # two highlighted rows
    # math notation: {x | G(0), w0 | I} mm_0 = mm[data] {mm_0 | G(0)}
    assert "{x | G(0), w0 | I}" in text and "mm_0 = mm[data]" in text and "{mm_0 | G(0)}" in text
    words = check_html(D.theory_html(th, tensor="mm_0", kind="collective", words=True))
    assert "All-Gather(0)" in words and "All-Reduce" in words and "Identity" in words
    ids = {t.id for t in only[:3]}
    assert D.theory_html(th, only=ids).count("<tr") == 4


def test_enabled_triples_ground_truth(syn):
    _, th, c, *_ = syn
    s = Search(th, c)
    root = s.node(0)
    en = D.enabled_triples(s, root)
    g = th.graph
    # at the root: every strategy of op 0 (its inputs are loadable) and the loads of op 0's inputs
    expect = {t.id for t in th.filter(op=0)} | {
        t.id for t in th if t.instr.kind == "load" and t.instr.tensor in g.ops[0].inputs
    }
    assert en == expect
    ev = s.step()
    child = next(ch for ch in ev.children if ch.step.strategy.name == "column")  # mm_0 : G1
    en = D.enabled_triples(s, child)
    held = dict(child.props)
    for tid in en:
        tr = th[tid]
        if tr.instr.kind == "compute":
            assert tr.instr.op == child.position
            assert all(held.get(t) == f or g.tensors[t].role != "activation" for t, f in tr.pre)
        elif tr.instr.kind == "collective":
            assert all(held.get(t) == f for t, f in tr.pre)
    relu_g1 = next(t.id for t in th.filter(op=1) if t.instr.name == "G1")
    relu_g0 = next(t.id for t in th.filter(op=1) if t.instr.name == "G0")
    assert relu_g1 in en and relu_g0 not in en
    assert any(th[t].instr.name == "all_gather" for t in en)  # mm_0:G1 can be gathered


def test_search_and_frontier_html(syn):
    _, th, c, *_ = syn
    s = Search(th, c)
    ev = s.step()
    html = D.search_html(s, ev)
    text = check_html(html)
    assert f"frontier: {len(s.frontier)} open" in text
    assert f"popped #{ev.popped.id}" in text
    for ch in ev.children:
        assert f"#{ch.id}" in text
    s.run()
    text = check_html(D.search_html(s))
    assert "best complete program" in text and "done" in text
    ev = s.step()  # done: nothing to expand
    assert "nothing to expand" in check_html(D.event_html(s, ev))


def test_plan_html_history_and_oom(syn):
    _, _, c, plan, _ = syn
    text = check_html(D.plan_html(plan))
    assert f"{plan.cost_s * 1e3:.4g} ms" in text
    for d in c.names:
        assert d in text
    assert "pins: x=G0" in text
    assert "OOM" not in text
    tiny = c.replace(devices=tuple(d.__class__(d.name, d.kind, d.flops, 1024, d.machine) for d in c.devices))
    oom = Plan(**{**plan.__dict__, "cluster": tiny})
    assert "OOM" in check_html(D.plan_html(oom))
    hist = check_html(D.history_html(plan))
    assert "Q/B alternation" in hist and len(plan.history) >= 1
    empty = Plan(**{**plan.__dict__, "history": ()})
    assert "no Q/B history" in D.history_html(empty)


def test_plan_diff_html(syn):
    *_, plan, free = syn
    html = D.plan_diff_html(free, plan)
    text = check_html(html)
    assert f"{free.cost_s * 1e3:.4g} ms → {plan.cost_s * 1e3:.4g} ms" in text
    assert "x=G0" in text  # pins changed
    assert "+x:G0 = load(x)" in text.replace(" ", " ")
    same = check_html(D.plan_diff_html(plan, plan))
    assert "same program" in same and "+0 ms" in same


def test_sharding_html_shows_uneven_lengths(syn):
    *_, plan, free = syn
    t, d, ls = free.lengths[0]
    text = check_html(D.sharding_html(free, t))
    assert f"G({d}): lengths {list(ls)}" in text
    assert "<svg" in D.sharding_html(free, t)
    assert "every device holds a full copy" in check_html(D.sharding_html(plan, "w0"))
    assert "does not appear" in check_html(D.sharding_html(plan, "nope"))


# ------------------------------------------------------------------------------------------ bokeh


def _segments(fig):
    src = fig.renderers[0].data_source.data
    return list(zip(src["lane"], src["left"], src["right"], src["kind"], src["stage"]))


def test_gantt_figure_matches_stages(syn):
    *_, plan, _ = syn
    fig = D.gantt(plan)
    assert list(fig.y_range.factors) == list(reversed(plan.devices))
    unit, k = D.time_unit(plan.cost_s)
    assert fig.xaxis[0].axis_label == f"time ({unit})"
    segs = _segments(fig)
    for s in plan.stages:
        comm = [(a, b) for lane, a, b, k, st in segs if k == "communication" and st == str(s.index)]
        if s.comm_s > 0:
            assert len(comm) == len(plan.devices) and len(set(comm)) == 1  # same segment on every device
            assert comm[0][1] - comm[0][0] == pytest.approx(s.comm_s * k)
        for j, dev in enumerate(plan.devices):
            comp = [
                b - a
                for lane, a, b, k, st in segs
                if lane == dev and k == "computation" and st == str(s.index)
            ]
            idle = [b - a for lane, a, b, k, st in segs if lane == dev and k == "idle" and st == str(s.index)]
            assert sum(comp) == pytest.approx(s.comp_s[j] * k)
            assert sum(comp) + sum(idle) == pytest.approx(max(s.comp_s) * k)
    assert max(b for _, _, b, _, _ in segs) == pytest.approx(plan.cost_s * k)


@pytest.mark.parametrize("span, unit", [(3e-5, "µs"), (3.5e-3, "ms"), (12.0, "s")])
def test_gantt_picks_its_unit(syn, span, unit):
    """The axis reads in the unit the chart spans (µs, ms or s), with plain ticks (no 3.500e-3)."""
    *_, plan, _ = syn
    scale = span / plan.cost_s
    stages = tuple(
        dataclasses.replace(s, comm_s=s.comm_s * scale, comp_s=tuple(c * scale for c in s.comp_s))
        for s in plan.stages
    )
    scaled = dataclasses.replace(plan, stages=stages, cost_s=plan.cost_s * scale)
    fig = D.gantt(scaled)
    assert fig.xaxis[0].axis_label == f"time ({unit})"
    assert fig.xaxis[0].formatter.use_scientific is False
    right = max(fig.renderers[0].data_source.data["right"])
    assert 1.0 <= right < 1000.0  # the span reads as 1..999 of its unit
    assert unit in fig.title.text


def test_gantt_measured_overlay(syn):
    *_, plan, _ = syn
    fig = D.gantt(plan, measured=[plan.cost_s * 1.1, plan.cost_s * 1.3])
    assert list(fig.y_range.factors)[:2] == ["measured", "predicted"]
    meas = [(a, b) for lane, a, b, k, _ in _segments(fig) if lane == "measured"]
    assert meas == [(0.0, pytest.approx(plan.cost_s * 1.2 * D.time_unit(plan.cost_s * 1.3)[1]))]
    fig2 = D.gantt(plan, measured={"stage_s": [s.time_s * 2 for s in plan.stages]})
    meas2 = [(a, b) for lane, a, b, k, _ in _segments(fig2) if lane == "measured"]
    assert len(meas2) == len(plan.stages)


def test_gantt_html_is_self_contained(syn):
    *_, plan, _ = syn
    page = D.gantt_html(plan)
    assert page.lstrip().lower().startswith("<!doctype html")
    assert not re.search(r"<script[^>]*\ssrc=", page, re.I), "external script"
    assert "cdn.bokeh.org" not in page and "Bokeh" in page


def test_report_html(syn, tmp_path):
    *_, plan, free = syn
    page = D.report_html(
        plan, baselines={"dp_ev": free, "dp_cp": 2 * plan.cost_s}, search_stats={"expansions": 7}
    )
    assert not re.search(r"<script[^>]*\ssrc=", page, re.I)
    assert not re.search(r"<link[^>]*href=['\"]?https?:", page, re.I)
    assert "dp_ev" in page and "2.00x" in page and "expansions" in page
    assert plan.name in page and "Timeline" in page
    if HAS_DOT:
        assert "Proof (Hoare triples)" in page and "Program graph" in page
    (tmp_path / "r.html").write_text(page)


# ------------------------------------------------------------------------------------------ graphviz


def test_graph_dot_colours_by_plan_forms(syn):
    g, th, c, plan, free = syn
    dot = D.graph_dot(plan)
    src = dot.source
    for op in g.ops:
        assert op.name in src
    # every op's record shows the plan's strategy and output form, and is filled with that form's colour
    for ins in plan.program:
        if ins.kind == "compute":
            form = ins.outputs[0][1]
            assert f"{ins.name}: {D.form_text(form)}" in src
            line = next(x for x in src.splitlines() if x.strip().startswith("op") and f"{{{ins.op}" in x)
            assert D.FORM_COLORS[form[0]] in line
        if ins.kind == "load":
            assert f"{D.form_text(ins.form)}" in src
    plain = D.graph_dot(g).source
    assert "#a1d99b" not in plain and "#fdae6b" not in plain
    # a plan without its graph (from JSON) is drawn from its instructions
    loaded = Plan.from_json(free.to_json())
    assert loaded.graph is None
    src2 = D.graph_dot(loaded).source
    for ins in free.program:
        if ins.kind == "compute":
            assert ins.op in src2


def test_search_tree_dot_shows_pruned_and_best(syn):
    _, th, c, *_ = syn
    s = Search(th, c)
    events = [s.step() for _ in range(3)]
    ev = next((e for e in events if e.pruned), None)
    if ev is not None:
        src = D.search_tree_dot(s, event=ev).source
        assert "pruned:" in src and "dashed" in src
        assert ev.pruned[0][1].split(":")[0] in src
    s.run()
    best = s.best
    src = D.search_tree_dot(s, around=best.id, depth=1).source
    assert f"#{best.id}" in src and "doubleoctagon" in src and "#a50f15" in src
    src0 = D.search_tree_dot(s, around=0, depth=1).source
    for k in s.children_of(0)[:12]:
        assert f"n{k.id}" in src0


def test_proof_dot_chain(syn):
    *_, plan, _ = syn
    dot = D.proof_dot(plan)
    src = dot.source
    assert sum(1 for line in src.splitlines() if re.match(r"\s*i\d+ \[", line)) == len(plan.program)
    assert "goal" in src and "| R" in src
    for s in plan.stages:
        assert f"cluster_{s.index}" in src


@needs_dot
def test_drawings_render_to_svg(syn):
    g, th, c, plan, _ = syn
    s = Search(th, c)
    ev = s.step()
    for d in (D.graph_dot(plan), D.graph_dot(g), D.search_tree_dot(s, event=ev), D.proof_dot(plan)):
        out = D.svg(d)
        assert out is not None and out.startswith("<svg") and out.rstrip().endswith("</svg>")
        bundle = d._repr_mimebundle_()
        assert "image/svg+xml" in bundle


def test_drawing_without_dot_falls_back_to_source(syn, monkeypatch):
    *_, plan, _ = syn
    d = D.proof_dot(plan)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert D.svg(d) is None
    bundle = d._repr_mimebundle_()
    assert "text/plain" in bundle and "digraph" in bundle["text/plain"]
    assert "<svg" not in D.graph_html(plan.graph)  # no picture, but the table
    check_html(D.graph_html(plan.graph))


# ------------------------------------------------------------------------------------------ zoo


def test_renderers_on_zoo_plan(zoo_plan):
    plan = zoo_plan
    for fn in (D.plan_html, D.history_html, D.gantt_svg):
        check_html(fn(plan))
    check_html(D.graph_html(plan.graph))
    check_html(D.theory_html(theory(plan.graph), op="linear"))
    check_html(D.sharding_html(plan, plan.lengths[0][0]))
    assert len(D.gantt(plan).y_range.factors) == plan.cluster.n
    proof = D.proof_dot(plan).source
    assert f"({len(plan.program)} triples)" in proof
    assert len(re.findall(r"^\s*i\d+ \[label=", proof, re.M)) == len(plan.program)  # one record each
    assert re.search(r"^\s*goal \[label=.*loss \| R", proof, re.M)  # ends at the goal loss | R
    page = D.report_html(plan)
    assert not re.search(r"<script[^>]*\ssrc=", page, re.I)
    if HAS_DOT:
        # the drawings are collapsed (closed <details>): a long plan's proof is thousands of pixels tall
        for heading in ("Proof (Hoare triples)", "Program graph"):
            m = re.search(
                r"<details>\s*<summary[^>]*>" + re.escape(heading) + r"[^<]*</summary>\s*<div[^>]*><svg", page
            )
            assert m, heading
        assert "<details open><summary" not in page.split("Proof (Hoare triples)")[0][-200:]
        assert D.svg(D.graph_dot(plan)).startswith("<svg")
