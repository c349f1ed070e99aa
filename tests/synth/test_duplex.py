"""HiDup duplex: the ψ/φ cost against a hand computation, the duplex search against brute force, the
duplex LP against a grid, and duplex plans against plain ones."""

from __future__ import annotations

import random

import pytest
import synthetic as S
from oracles import all_programs, brute_force

import hapnb as hap
from hapnb import zoo
from hapnb.cost.model import Conversion, CostModel, Load, Step
from hapnb.hardware.cluster import Cluster
from hapnb.hardware.parts import Collective
from hapnb.ir.forms import G, I
from hapnb.synth.balance import balance
from hapnb.synth.duplex import (
    duplex_cost,
    duplex_evaluate,
    feature_terms,
    label_close,
    label_step,
    next_psi,
    psi_phi,
)
from hapnb.synth.search import Search
from hapnb.triples import theory


def test_psi_phi_recurrence_by_hand():
    # stage 1: micro-batch 1 computes 2, then micro-batch 2 computes 2 while micro-batch 1 sends (3);
    # micro-batch 1 computes 1 while micro-batch 2 sends (3); micro-batch 2 computes 1: 2 + 3 + 3 + 1
    per, total = psi_phi([(0.0, 2.0), (3.0, 1.0)])
    assert per == ((4.0, -2.0), (9.0, -1.0)) and total == 9.0
    # communication shorter than the computation around it is hidden: 2 + 2 + 2 + 2 (the comm of 1
    # runs under micro-batch 2's stage-1 computation, the other under micro-batch 1's stage 2)
    assert psi_phi([(0.0, 2.0), (1.0, 2.0)])[1] == 8.0
    assert next_psi(0.0, 0.0, 5.0, 1.0) == (11.0, -1.0)  # a first stage that communicates: 5 + 5 + 1


def test_duplex_cost_by_hand():
    g = S.gather_graph()
    th = theory(g, S.strategies)
    bw = 1e9
    c = Cluster.parse("1x4e12+1x2e12").with_collectives(
        {k: Collective(0.0, bw) for k, _ in Cluster.parse("2xV100").collectives}
    )
    cm = CostModel(th, c)
    data = next(s for s in th.strategies[0] if s.name == "data")
    repl = next(s for s in th.strategies[1] if s.name == "replicated")
    xid, wid, hid = g.tensor("x").id, g.tensor("w").id, g.tensor("mm_0").id
    prog = [
        Step(0, data, (Load(xid, G(0)), Load(wid, I))),
        Step(1, repl, (), (Conversion(hid, "all_gather", G(0), I),)),
    ]
    ratios = ((2 / 3, 1 / 3),)
    F = 2.0 * 1024 * 256 * 256
    # per micro-batch: half of each stage's slowest device, half of the all-gather (+ its backward
    # reduce-scatter), both over n * bytes * max ratio
    p1 = 0.5 * max(3 * F * (2 / 3) / 4e12, 3 * F * (1 / 3) / 2e12)
    c2 = 0.5 * 2 * (2 * 1024 * 256 * 4 / bw) * (2 / 3)
    p2 = 0.5 * max(3 * 1024 * 256 / 4e12, 3 * 1024 * 256 / 2e12)
    psi1 = 0.0 + 0.0 + max(0.0, 0.0) + max(0.0, p1) + p1
    psi2 = psi1 - p1 + max(p1, c2) + max(c2, p2) + p2
    grad = 256 * 256 * 4 / bw  # w's gradient all-reduce, once, full size
    ev = duplex_evaluate(cm, prog, ratios)
    assert [s.steps for s in ev.stages] == [(0,), (1,)]
    assert ev.stages[1].comm_s == pytest.approx(c2, rel=1e-12)
    assert ev.stages[0].psi == pytest.approx(psi1, rel=1e-12) and ev.stages[0].phi == pytest.approx(-p1)
    assert ev.psi == pytest.approx(psi2, rel=1e-12) and ev.gradient_s == pytest.approx(grad, rel=1e-12)
    assert duplex_cost(cm, prog, ratios) == pytest.approx(psi2 + grad, rel=1e-12)
    # the plain cost is the stage sum of the full-batch times: the duplex hides micro-batch 2's compute
    plain = cm.evaluate(prog, ratios).cost_s
    assert plain == pytest.approx(2 * p1 + grad + 2 * c2 + 2 * p2, rel=1e-12)
    assert duplex_cost(cm, prog, ratios) < plain


@pytest.mark.parametrize("seed", [1, 3, 5, 12])
def test_duplex_never_above_plain_and_equal_without_feature_communication(seed):
    """ψ_m = sum [max(p_{k-1}, c_k) + max(c_k, p_k)] + p_m <= sum 2 (c_k + p_k) on flops-only devices,
    with equality when no step sends features: then ψ_m = 2 sum p_k, the gradient syncs cost the same,
    and here (one ratio vector, two devices) the same device is the slowest in every plain stage."""
    g = S.random_graph(seed)
    th = theory(g, S.strategies)
    c = Cluster.parse("V100+P100")
    cm = CostModel(th, c)
    ratios = ((0.6, 0.4),)
    n_equal = n_less = 0
    for prog in all_programs(th):
        d, p = duplex_cost(cm, prog, ratios), cm.evaluate(prog, ratios).cost_s
        assert d <= p * (1 + 1e-12)
        if not any(feature_terms(cm, st) for st in prog):
            assert d == pytest.approx(p, rel=1e-12)
            n_equal += 1
        elif d < p * (1 - 1e-9):
            n_less += 1
    assert n_equal and n_less


CLUSTERS = ["2xV100+2xP100", "V100+P100", "4xA100", "1x5e12+1x1e12+1x2e12"]


def _check_optimal(th, c, ratios=None):
    s = Search(th, c, ratios=ratios, duplex=True)
    res = s.run()
    assert res.optimal
    bf_cost, _ = brute_force(th, c, s.ratios, cost=duplex_cost)
    assert res.cost == pytest.approx(bf_cost, rel=1e-9)
    assert duplex_cost(CostModel(th, c), res.program, s.ratios) == pytest.approx(res.cost, rel=1e-9)
    return res


@pytest.mark.parametrize("seed", range(0, 24, 2))
def test_duplex_search_matches_brute_force_random(seed):
    g = S.random_graph(seed + 1)
    c = Cluster.parse(CLUSTERS[seed % len(CLUSTERS)])
    _check_optimal(theory(g, S.strategies), c, [[j + 1.0 for j in range(c.n)]] if seed % 4 else None)


@pytest.mark.parametrize(
    "cluster,batch,dims",
    [
        ("4xA100", 512, (512, 2048, 512, 2048)),  # duplex shards differently from the plain optimum
        ("4xA100", 4096, (128, 128, 128, 128)),  # plain: data parallel; duplex: tensor parallel
        ("V100+P100", 512, (512, 2048, 512, 2048)),  # slow network
        ("virtual", 512, (512, 2048, 512, 2048)),  # virtual devices: inner syncs at the end
    ],
)
def test_duplex_search_matches_brute_force_mlp(cluster, batch, dims):
    c = Cluster.parse("2x(2xV100)").virtual() if cluster == "virtual" else Cluster.parse(cluster)
    th = theory(S.mlp_graph(batch=batch, dims=dims), S.strategies)
    res = _check_optimal(th, c)
    plain = Search(th, c).run()
    assert res.cost <= duplex_cost(CostModel(th, c), plain.program, Search(th, c).ratios) * (1 + 1e-12)


def test_duplex_search_picks_another_program_when_overlap_pays():
    """Big batch, small weights on 4 A100s: plain picks data parallel (gradient syncs only); duplex
    prefers tensor parallelism, whose feature collectives hide under the other micro-batch's work."""
    th = theory(S.mlp_graph(batch=4096, dims=(128, 128, 128, 128)), S.strategies)
    c = Cluster.parse("4xA100")
    plain = Search(th, c).run()
    dup = Search(th, c, duplex=True).run()
    assert {st.strategy.name for st in plain.program} == {"data", "G0"}
    assert "column" in {st.strategy.name for st in dup.program}
    cm = CostModel(th, c)
    r = Search(th, c).ratios
    assert dup.cost < duplex_cost(cm, plain.program, r) * (1 - 1e-3)


@pytest.mark.parametrize("layers,hidden,batch", [(1, 4096, 64), (2, 1024, 8), (2, 256, 4096)])
def test_duplex_search_matches_brute_force_zoo_mlp(layers, hidden, batch):
    c = Cluster.parse("1x5e12+1x1e12+1x2e12")
    model, inputs, _ = zoo.build("mlp", layers=layers, hidden=hidden, input=16, batch=batch, devices=c.n)
    _check_optimal(hap.theory(hap.trace(model, inputs, name="mlp")), c)


def test_duplex_search_steps_like_the_plain_one():
    th = theory(S.mlp_graph(batch=512, dims=(512, 2048, 512, 2048)), S.strategies)
    c = Cluster.parse("4xA100")
    s = Search(th, c, duplex=True)
    e = s.step()
    assert e.popped is not None and e.popped.position == 0 and e.children
    for ch in e.children:
        assert ch.parent == e.popped.id and 0.0 <= ch.cost <= ch.score * (1 + 1e-12)
    popped = [e.popped.score]
    while True:
        e = s.step()
        if e.popped is not None:
            popped.append(e.popped.score)
        if e.done:
            break
    assert s.best is not None and s.best.complete
    assert s.best.cost == pytest.approx(Search(th, c, duplex=True).run().cost, rel=1e-12)
    # admissible priority: nothing popped before the optimum scores above it
    assert max(popped) <= s.best.cost * (1 + 1e-12)
    assert s.stats["duplex"] and "duplex" in repr(s) and "duplex" not in Search(th, c).stats
    assert s.best.cost == pytest.approx(duplex_cost(CostModel(th, c), s.program(s.best.id), s.ratios))


def _grid(n, steps):
    if n == 2:
        return [((i / steps, 1 - i / steps),) for i in range(steps + 1)]
    return [
        ((i / steps, k / steps, (steps - i - k) / steps),)
        for i in range(steps + 1)
        for k in range(steps + 1 - i)
    ]


def test_duplex_lp_compute_only_is_throughput_proportional():
    """One stage, no feature collective: the duplex time is max_j comp_j + gradient syncs, minimised
    by ratios proportional to the flops."""
    th = theory(S.mlp_graph(batch=1024, dims=(64, 64, 64)), S.strategies)
    prog = S.dp_program(th)
    cm = CostModel(th, Cluster.parse("1x4e12+1x2e12+1x1e12+1x1e12"))
    res = balance(cm, prog, duplex=True)
    assert res.ratios[0] == pytest.approx((0.5, 0.25, 0.125, 0.125), abs=1e-6)
    assert res.cost == pytest.approx(duplex_cost(cm, prog, res.ratios), rel=1e-12)


@pytest.mark.parametrize("cluster", ["V100+P100", "1x5e12+1x1e12+1x2e12"])
@pytest.mark.parametrize("seed", [0, 2, 3, 5])
def test_duplex_lp_against_grid(cluster, seed):
    th = theory(S.random_graph(seed), S.strategies)
    c = Cluster.parse(cluster)
    cm = CostModel(th, c)
    prog = Search(th, c, duplex=True).run().program
    res = balance(cm, prog, duplex=True)
    grid = [duplex_cost(cm, prog, r) for r in _grid(c.n, 200 if c.n == 2 else 60)]
    assert res.cost <= min(grid) * (1 + 1e-7)  # no grid point beats the LP
    assert res.cost >= min(grid) * (1 - 0.02)  # and the grid comes close to it
    assert res.cost == pytest.approx(duplex_cost(cm, prog, res.ratios), rel=1e-12)
    # a local perturbation of the LP's ratios cannot improve either
    r = list(res.ratios[0])
    for j in range(c.n):
        for k in range(c.n):
            if j != k and r[j] > 1e-3:
                q = list(r)
                q[j] -= 1e-3
                q[k] += 1e-3
                assert duplex_cost(cm, prog, (tuple(q),)) >= res.cost * (1 - 1e-9)


def test_synthesize_duplex_faster_on_communication_heavy_case():
    """A wide MLP on two machines over the ~10 Gbps network: the duplex hides collectives."""
    opts = dict(layers=2, hidden=1024, input=16, batch=8)
    plain = hap.synthesize("mlp", "V100+P100", **opts)
    dup = hap.synthesize("mlp", "V100+P100", duplex=True, **opts)
    assert dup.duplex and not plain.duplex
    assert dup.stats["duplex"] and not plain.stats["duplex"]
    assert dup.cost_s < plain.cost_s * 0.99
    assert dup.cost_s >= dup.lower_bound_s
    again = hap.Plan.from_json(dup.to_json())
    assert again.duplex and again.cost_s == dup.cost_s


def test_synthesize_duplex_not_faster_without_feature_communication():
    """Nothing to overlap: on one device the duplex time is the plain time (two half-batch passes);
    with a data-parallel program (pinned) only gradients are synchronised, once per iteration either way,
    so the duplex gains nothing worth the name (it only drops the plain model's per-stage device sync at
    each gradient all-reduce: < 0.1 % here)."""
    opts = dict(zoo.TINY["mlp"])
    plain = hap.synthesize("mlp", "1xV100", **opts)
    dup = hap.synthesize("mlp", "1xV100", duplex=True, **opts)
    assert dup.duplex and dup.cost_s == pytest.approx(plain.cost_s, rel=1e-12)
    c = "V100+P100"
    g = hap.trace(*zoo.build("mlp", **opts, devices=2)[:2], name="mlp")
    pins = {
        t.name: (hap.Shard(0) if t.role == "input" else hap.Replicate())
        for t in g.tensors
        if t.role in ("param", "input")
    }
    plain = hap.synthesize(g, c, pins=pins)
    dup = hap.synthesize(g, c, pins=pins, duplex=True)
    assert dup.cost_s == pytest.approx(plain.cost_s, rel=1e-3)


def test_seeded_duplex_search_never_worse_than_the_plain_program():
    """Search.seed walks the plain optimum into the duplex tree: a duplex search stopped early returns a
    program whose duplex time is at most the plain program's; unbounded, it still proves the optimum."""
    model, inputs, _ = zoo.build("bert", **{**zoo.TINY["bert"], "devices": 4})
    th = hap.theory(hap.trace(model, inputs, name="bert"))
    c = Cluster.parse("2xV100+2xP100")
    assert not any(d.model for d in c.devices)  # flops-only: the search's cost is the duplex cost
    cm = CostModel(th, c)
    plain = Search(th, c).run()
    s = Search(th, c, duplex=True)
    assert s.seed(plain.program)
    res = s.run(max_expansions=20, dives=0)
    r = s.ratios
    assert res.cost <= duplex_cost(cm, plain.program, r) * (1 + 1e-12)
    assert duplex_cost(cm, res.program, r) == pytest.approx(res.cost, rel=1e-9)
    th2 = theory(S.mlp_graph(batch=4096, dims=(128, 128, 128, 128)), S.strategies)
    c2 = Cluster.parse("4xA100")
    s2 = Search(th2, c2, duplex=True)
    p2 = Search(th2, c2).run().program
    s2.seed(p2)  # the greedy dive already beats it here: the walk stops at the bound
    assert s2.best is not None and s2.best.cost <= duplex_cost(CostModel(th2, c2), p2, s2.ratios)
    assert s2.run().cost == pytest.approx(Search(th2, c2, duplex=True).run().cost, rel=1e-12)
    assert not Search(th2, c2, duplex=True).seed(plain.program[:1])  # not a complete program here


def _complete(label, delta, stages, grad, inner):
    """The final duplex time of a label completed by: ``delta`` more computation in the open stage, then
    ``stages`` (full-batch comm, per-device comp), ``grad`` more gradient syncs, ``inner`` more inner syncs."""
    base, acc, copen, tail = label
    p = 0.5 * max(a + d for a, d in zip(acc, delta))
    psi, phi = base + max(0.5 * copen, p) + p + grad, -p  # ψ of the open stage once closed
    for comm, comp in stages:
        psi, phi = next_psi(psi, phi, 0.5 * comm, 0.5 * max(comp))
    return psi + max(t + x for t, x in zip(tail, inner))


def test_dominance_and_priority_hold_for_random_completions():
    """dominates(a, b) implies a completes no worse than b under every completion; priority() never
    exceeds the completed time when its bounds are the true remaining computation and communication."""
    import random

    from hapnb.synth.duplex import dominates, priority

    rnd = random.Random(7)
    n = 3

    def vec(k=1.0):
        return tuple(rnd.choice([0.0, rnd.uniform(0, k)]) for _ in range(n))

    def label():
        return (rnd.uniform(0, 3), vec(), rnd.choice([0.0, rnd.uniform(0, 3)]), vec(0.5))

    seen_dominated = 0
    for _ in range(3000):
        a, b = label(), label()
        if rnd.random() < 0.5:  # make near-dominance likely
            b = (a[0] + rnd.uniform(0, 0.5), tuple(x + rnd.uniform(-0.1, 0.3) for x in a[1]), a[2], a[3])
        comps = []
        for _ in range(5):
            delta = vec()
            stages = [(rnd.uniform(0, 4), vec(2.0)) for _ in range(rnd.randint(0, 3))]
            grad, inner = rnd.uniform(0, 1), vec(0.5)
            fa, fb = _complete(a, delta, stages, grad, inner), _complete(b, delta, stages, grad, inner)
            comps.append((fa, fb))
            # admissible priority at b with its true remainders
            rem = tuple(d + sum(c[j] for _, c in stages) for j, d in enumerate(delta))
            comm = sum(c for c, _ in stages) + grad
            w = (0.0, 1.0, 0.0)
            spine = sum(x * r for x, r in zip(w, rem)) + comm
            assert priority(b[0], b[2], b[1], b[3], rem, w, spine, comm) <= fb + 1e-12
        if dominates(a, b):
            seen_dominated += 1
            assert all(fa <= fb + 1e-12 for fa, fb in comps)
    assert seen_dominated > 100


@pytest.mark.parametrize("seed", range(6))
def test_the_search_labels_step_by_hidups_recurrence(seed):
    """The search's label arithmetic (label_step / label_close, what Search._children runs) gives the
    duplex time of HiDup's recurrence over the same stages (psi_phi): one objective, two evaluators."""
    rng = random.Random(seed)
    n, steps = 3, rng.randint(1, 12)
    base, copen, acc, grads = 0.0, 0.0, (0.0,) * n, 0.0
    stages: list[list[float]] = []  # per stage: full-batch comm, then per-device full-batch computation
    for k in range(steps):
        comm = rng.choice([0.0, rng.uniform(0.1, 3.0)])
        grad = rng.choice([0.0, rng.uniform(0.0, 1.0)])
        comp = tuple(rng.uniform(0.0, 2.0) for _ in range(n))
        base, copen, acc = label_step(base, copen, acc, k == 0, comm, grad, comp)
        grads += grad
        if comm > 0.0 or k == 0:
            stages.append([comm, *comp])
        else:
            stages[-1] = [stages[-1][0], *(a + b for a, b in zip(stages[-1][1:], comp))]
    total = base + label_close(copen, acc, (0.0,) * n)
    _, psi_m = psi_phi([(0.5 * s[0], 0.5 * max(s[1:])) for s in stages])
    assert total == pytest.approx(psi_m + grads, rel=1e-12)
