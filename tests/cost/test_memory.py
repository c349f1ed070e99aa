"""Memory-aware synthesis (issue 10): the memory model's parts, A* with memory against brute force over the
programs that fit, ZeRO-2/3 storage (cost, plan, pins, runtime), memory caps in the LP, plans unchanged
where memory does not bind, and the error when nothing fits."""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref

import numpy as np
import pytest
import synthetic as S
import torch
from oracles import all_programs, storage_variants, with_memory

import hapnb as hap
from hapnb import zoo
from hapnb.cost.memory import memory_linear, overflow, peak_raw
from hapnb.cost.model import CostModel, Load
from hapnb.hardware.cluster import Cluster
from hapnb.ir.forms import FullShard, I, ShardGradOp, Storage, parse_pin
from hapnb.plans.plan import Plan
from hapnb.plans.synthesis import OutOfMemoryError
from hapnb.runtime import collectives as C
from hapnb.synth.balance import MemoryCapError, balance, balance_in_memory
from hapnb.synth.search import NoProgramError, Search
from hapnb.tracing import resolve_model, zoo_graph
from hapnb.triples import theory

CLUSTERS = ["2xV100+2xP100", "V100+P100", "4xA100", "1x5e12+1x1e12+1x2e12"]


_TABLES: dict[int, tuple] = {}


def table(seed: int):
    """Every program of the search space with ZeRO storage (cost, memory per device), cheapest first."""
    if seed not in _TABLES:
        th = theory(S.random_graph(seed), S.strategies)
        c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
        probe = Search(th, c, memory=True)
        dstar = {t.id: probe._mem.dstar(t.id) for t in th.graph.tensors if t.role == "param"}
        cm = CostModel(th, c)
        rows = []
        for prog in all_programs(th):
            for p in storage_variants(th, prog, dstar):
                rows.append((cm.evaluate(p, probe.ratios).cost_s, cm.memory(p, (), probe.ratios)))
        rows.sort(key=lambda r: r[0])
        _TABLES[seed] = (th, c, rows)
    return _TABLES[seed]


@pytest.mark.parametrize("seed", [0, 4, 9])
@pytest.mark.parametrize("frac", [1.0, 0.5, 0.25, 0.0])
def test_astar_with_memory_matches_brute_force_over_programs_that_fit(seed, frac):
    th, c0, rows = table(seed)
    lo, hi = min(max(m) for _, m in rows), max(rows[0][1])
    caps = [(lo + (hi - lo) * frac) * (1 + 0.1 * j) for j in range(c0.n)]  # uneven caps
    c = with_memory(c0, caps)
    best = next((cost for cost, m in rows if all(x <= cap for x, cap in zip(m, caps))), math.inf)
    s = Search(th, c, memory=True)
    try:
        res = s.run()
    except NoProgramError:
        assert best == math.inf
        return
    assert res.optimal and res.cost == pytest.approx(best, rel=1e-9)
    cm = CostModel(th, c)
    assert cm.evaluate(res.program, s.ratios).cost_s == pytest.approx(res.cost, rel=1e-9)
    assert max(overflow(cm, res.program, s.final_conversions(), s.ratios)) <= 0


def test_one_evaluation_of_the_phases_decides_pruning_and_storage():
    """``MemoryTracker.check`` evaluates a node's two peak phases once (one linear map of its memory parts)
    for both pruning and the storage bound. On every node of a search over a small GPT, with the capacities
    swept from roomy to below the leanest program (so that both pruning and storage costs fire), it returns
    what :meth:`exceeds` and :meth:`storage_bound` return, and the phases give the peak formula's value."""
    th = theory(zoo_graph("gpt", **zoo.TINY["gpt"])[0])
    c = Cluster.parse("2xV100+2xP100")
    s = Search(th, c, memory=True)
    s.run(max_expansions=3000)
    tr = s._mem
    states = [(n.ms, n.pos) for n in s._nodes if n.ms is not None]
    peaks = [float(tr.peak(ms[0], pos).max()) for ms, pos in states]
    assert len(states) > 100
    for ms, pos in states:  # the phases are the formula 3P + In + max(2P, A + 2L + F + X)
        m, f = ms[0], tr._fut[pos]
        P, In, A = m[0] + f[0], m[1] + f[1], m[2] + f[2]
        formula = 3 * P + In + np.maximum(2 * P, A + 2 * m[3] + m[4] + m[5])
        assert tr.peak(m, pos) == pytest.approx(formula * tr.scale + tr.const, rel=1e-12)
    pruned = stored = 0
    for cap in np.linspace(2.0 * max(peaks), 0.5 * min(peaks), 8):
        tr.cap = np.full(c.n, cap)
        tr._phase_tables()
        for ms, pos in states:
            quick = tr.check(ms, pos)
            why = tr.exceeds(ms, pos)
            exact = (why, 0.0) if why else ("", tr.storage_bound(ms, pos))
            assert quick == exact
            pruned += bool(why)
            stored += exact[1] > 0
    assert pruned and stored  # every path was taken


@pytest.mark.parametrize("seed", range(6))
def test_memory_search_equals_the_plain_search_where_memory_does_not_bind(seed):
    th = theory(S.random_graph(seed), S.strategies)
    c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
    plain, mem = Search(th, c).run(), Search(th, c, memory=True).run()
    assert mem.cost == plain.cost and mem.program == plain.program


def test_memory_linear_is_the_breakdown_at_even_cuts():
    th = theory(S.mlp_graph(batch=64, dims=(256, 512, 256)), S.strategies)
    c = Cluster.parse("4xA100")
    res = Search(th, c, ratios=[0.25] * 4).run()
    cm = CostModel(th, c)
    ml = memory_linear(cm, res.program, ())
    r = [[0.25] * 4]
    exact = cm.memory(res.program, (), r)
    for j in range(4):
        p = ml.parts(r, j)
        assert peak_raw(p["P"], p["In"], p["A"], p["L"], p["F"], p["X"]) == pytest.approx(exact[j], rel=1e-9)


def test_zero_storage_costs_memory_and_communication():
    th = theory(S.mlp_graph(batch=8, dims=(1024, 1024, 1024)), S.strategies)
    c = Cluster.parse("2xV100+2xP100")
    cm = CostModel(th, c)
    w = th.graph.tensor("w0").id
    r = [[0.25] * 4]
    rep, z2, z3 = Load(w, I), Load(w, I, False, 2, hap.G(0)), Load(w, I, False, 3, hap.G(0))
    t = {ld: sum(tm.time(r) for tm in cm.load_terms(ld)) for ld in (rep, z2, z3)}
    assert 0 < t[z2] < t[z3]  # ZeRO-3 all-gathers again in the backward
    assert [tm.kind for tm in cm.load_terms(z3)] == ["zero3_gather", "all_gather"]
    base = Search(th, c, ratios=r[0]).run().program
    swap = [
        dataclasses.replace(st, loads=tuple(z3 if ld.tensor == w else ld for ld in st.loads)) for st in base
    ]
    if any(ld.tensor == w and ld.form == I for st in base for ld in st.loads):
        a, b = cm.memory_breakdown(base, (), r)[0], cm.memory_breakdown(swap, (), r)[0]
        assert b["parameters"] < a["parameters"]  # stored as a quarter


def test_storage_pins_parse_plan_and_round_trip(tmp_path):
    assert parse_pin("zero3(1)") == FullShard(1) == Storage(3, 1) and str(ShardGradOp(0)) == "zero2(0)"
    with pytest.raises(ValueError, match="zero3"):
        parse_pin("zero9(0)")
    pins = {"layers.0.weight": FullShard(0), "layers.1.weight": "zero2(1)"}
    plan = hap.synthesize("mlp", "1xV100+2xP100", pins=pins, **zoo.TINY["mlp"])
    loads = {i.tensor: i for i in plan.program if i.kind == "load"}
    assert loads["layers.0.weight"].name == "load_zero3" and loads["layers.0.weight"].src == "G0"
    assert loads["layers.1.weight"].name == "load_zero2" and loads["layers.1.weight"].src == "G1"
    assert "zero3 re-gather layers.0.weight" in {c.what for c in loads["layers.0.weight"].comm}
    assert "stored sharded (ZeRO-3)" in plan.summary()
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    with pytest.raises(hap.PinError, match="parameter"):
        hap.synthesize("mlp", "2xV100", pins={"x": FullShard(0)}, **zoo.TINY["mlp"])


def test_regathering_keeps_no_gathered_weight_for_the_backward():
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(3, 4)
    W = C.gather_param(w, 0, (6,))
    ref = weakref.ref(W)
    y = C.regathered(torch.ops.aten.linear.default)(x, W)
    del W
    gc.collect()
    assert ref() is None  # freed after the forward use
    y.sum().backward()  # the backward gathers it again
    assert torch.allclose(w.grad, x.sum(0).expand(6, 4))


def test_balance_in_memory_caps_the_ratios():
    th = theory(S.mlp_graph(batch=256, dims=(256, 512, 256)), S.strategies)
    c = Cluster.parse("1x8e12+1x1e12")
    res = Search(th, c, pins={"x": hap.G(0)}).run()
    cm = CostModel(th, c)
    free = balance(cm, res.program)
    peak = cm.memory(res.program, (), free.ratios)
    assert balance_in_memory(cm, res.program).ratios[0] == pytest.approx(free.ratios[0])  # caps far away
    tight = with_memory(c, [0.8 * peak[0], 10 * peak[1]])  # the fast device cannot hold its share
    cmt = CostModel(th, tight)
    capped = balance_in_memory(cmt, res.program)
    assert capped.ratios[0][0] < free.ratios[0][0] and max(overflow(cmt, res.program, (), capped.ratios)) <= 0
    with pytest.raises(MemoryCapError):
        balance_in_memory(CostModel(th, with_memory(c, [peak[1] / 50] * 2)), res.program)


def test_memory_bound_synthesis_shards_storage_and_fits():
    c = Cluster.parse("2xV100+2xP100")
    kw = dict(layers=2, hidden=256, input=256, batch=512)
    free = hap.synthesize("mlp", c, check_memory=False, **kw)
    cap = 0.6 * max(free.memory_bytes)  # the searched program does not fit: the search stores weights ZeRO
    plan = hap.synthesize("mlp", with_memory(c, [cap] * 4), **kw)
    assert plan.stats["memory_bound"] and max(plan.memory_bytes) <= cap and plan.cost_s > free.cost_s
    assert any(i.kind == "load" and i.name.startswith("load_zero") for i in plan.program)


def test_no_program_fits_names_the_memory_that_would():
    c = Cluster.parse("2xV100+2xP100")
    with pytest.raises(OutOfMemoryError) as e:
        hap.synthesize("mlp", with_memory(c, [1 << 12] * 4), **zoo.TINY["mlp"])
    msg = str(e.value)
    for part in (
        "no program fits",
        "needs",
        " on v100-0",
        "every device would need at least",
        "What fills",
        "To fit",
    ):
        assert part in msg, msg


@pytest.mark.parametrize("name", ["vit", "bert", "gpt"])
def test_plans_that_fit_are_unchanged_by_memory(name):
    c = Cluster.preset("paper-hetero-8")
    g, _ = resolve_model(name, c)
    on, off = hap.synthesize(g, c), hap.synthesize(g, c, check_memory=False)
    assert (on.program, on.ratios, on.cost_s) == (off.program, off.ratios, off.cost_s)
    assert not on.stats.get("memory_bound")


@pytest.mark.slow
def test_zero_plans_verify_on_three_ranks_with_uneven_ratios_and_an_empty_shard():
    pins = {"layers.0.weight": FullShard(0), "layers.1.weight": ShardGradOp(1), "head.weight": FullShard(1)}
    plan = hap.synthesize("mlp", "1xV100+2xP100", pins=pins, ratios=[0.625, 0.375, 0.0], **zoo.TINY["mlp"])
    assert 0 in plan.lengths_of("layers.0.weight", 0)  # the third rank holds an empty shard
    report = hap.verify(plan, nproc=3, steps=3, optimizer="adam", timeout=120)
    assert report.ok, report.text()
    assert {c.kind for c in report.checks} == {"loss", "grad", "weight"} and report.max_rel < 1e-10


def test_a_session_plans_as_the_command_line_does_where_memory_binds():
    """The Explorer's session keeps to memory like ``hapnb plan``: where the plan ignoring memory does not
    fit, its plan is the memory-bound one; where no program fits, it keeps the plan ignoring memory and
    says why (``memory_note``) instead of failing."""
    from hapnb.session import Session

    c = Cluster.parse("2xV100+2xP100")
    kw = dict(layers=2, hidden=256, input=256, batch=512)
    free = hap.synthesize("mlp", c, check_memory=False, **kw)
    tight = with_memory(c, [0.6 * max(free.memory_bytes)] * 4)
    cli = hap.synthesize("mlp", tight, **kw)
    s = Session("mlp", tight, **kw)
    assert (s.plan.program, s.plan.ratios, s.plan.cost_s) == (cli.program, cli.ratios, cli.cost_s)
    assert s.memory_note == "" and s.plan.stats["memory_bound"]
    none_fits = Session("mlp", with_memory(c, [1 << 12] * 4), **zoo.TINY["mlp"])
    assert "no program fits" in none_fits.memory_note and none_fits.plan.program
