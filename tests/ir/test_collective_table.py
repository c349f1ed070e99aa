"""The one collective table (hapnb.ir.collective_table) and its readers: the theory, the search's
conversions, the cost model, the simulator, the plan and code generation all take a collective's forms,
kinds, launches and runtime function from it."""

from __future__ import annotations

import pytest
import synthetic as S
import torch

from hapnb.cost.model import Conversion, CostModel
from hapnb.hardware.cluster import Cluster
from hapnb.hardware.parts import COLLECTIVE_KINDS, Collective
from hapnb.ir.collective_table import COLLECTIVES, FREE, PRICINGS, conversions
from hapnb.ir.forms import G, I, R
from hapnb.plans.plan import Instruction
from hapnb.plans.simulation import _kinds
from hapnb.runtime import collectives as runtime
from hapnb.synth.heuristic import CONVERSIONS
from hapnb.triples import COLLECTIVES as THEORY_COLLECTIVES
from hapnb.triples import theory

#: a cluster whose six collective kinds all differ (latency k * 1e-5 s, bandwidth k GB/s), so a price
#: names the kinds it used
KIND_NUMBER = {k: i + 1 for i, k in enumerate(COLLECTIVE_KINDS)}


def _cluster() -> Cluster:
    colls = {k: Collective(v * 1e-5, v * 1e9) for k, v in KIND_NUMBER.items()}
    return Cluster.parse("1x4e12+1x1e12+1x1e12").with_collectives(**colls)


def _t(kind: str, nbytes: float, launches: int = 1) -> float:
    v = KIND_NUMBER[kind]
    return launches * v * 1e-5 + nbytes / (v * 1e9)


def test_every_entry_is_well_formed():
    for name, c in COLLECTIVES.items():
        assert c.name == name and c.pricing in PRICINGS
        assert c.src in "GIR" and c.dst in "GIR" and c.src != c.dst or c.src == c.dst == "G"
        assert (c.forward is None) == (c.backward is None) == (c.pricing == "free") == (name in FREE)
        assert c.forward is None or {c.forward, c.backward} <= set(COLLECTIVE_KINDS)
        assert callable(getattr(runtime, c.runtime)), name
        assert not (c.resegments and c.searched)


def test_the_theory_and_the_search_read_the_table():
    assert set(THEORY_COLLECTIVES) == {n for n, c in COLLECTIVES.items() if not c.resegments}
    assert all(
        THEORY_COLLECTIVES[n][:2] == (c.src, c.dst) for n, c in COLLECTIVES.items() if n in THEORY_COLLECTIVES
    )
    for (a, b), names in CONVERSIONS.items():
        assert names == conversions(a, b) and all(COLLECTIVES[n].searched for n in names)
    searched = {n for names in CONVERSIONS.values() for n in names}
    assert searched == {n for n, c in COLLECTIVES.items() if c.searched}
    # the collective triples of a graph use the table's names with their form kinds
    g = S.mlp_graph(batch=8, dims=(4, 4))
    th = theory(g, S.strategies)
    used = {t.instr.name: (t.instr.src.kind, t.instr.form.kind) for t in th if t.instr.kind == "collective"}
    assert used and all(COLLECTIVES[n].src == a and COLLECTIVES[n].dst == b for n, (a, b) in used.items())


@pytest.mark.parametrize("name", [n for n, c in COLLECTIVES.items() if c.pricing != "free"])
def test_the_cost_model_prices_each_collective_with_its_table_kinds(name):
    """Forward and backward part of each collective on a tensor that needs a gradient, by hand from its
    table entry on a cluster where every kind has its own numbers."""
    g = S.mlp_graph(batch=64, dims=(32, 16))
    th = theory(g, S.strategies)
    cm = CostModel(th, _cluster())
    h = g.ops[0].outputs[0]  # [64, 16], needs a gradient
    nbytes = 64 * 16 * 4
    c = COLLECTIVES[name]
    src = {"G": G(0), "R": R, "I": I}[c.src]
    dst = G(1) if c.dst == "G" and c.src == "G" and not c.resegments else {"G": G(0), "R": R, "I": I}[c.dst]
    (term,) = cm.conversion_terms(Conversion(h, name, src, dst))
    ratios = ((0.5, 0.25, 0.25),)
    n = 3
    if c.pricing == "grouped":
        want_f, want_b = _t(c.forward, nbytes, n), _t(c.backward, nbytes, n)
    elif c.pricing == "full":
        want_f, want_b = _t(c.forward, nbytes), _t(c.backward, nbytes)
    else:  # padded: n x the largest shard; exchange: the largest shard one device sends
        vol = (n if c.pricing == "padded" else 1) * nbytes * 0.5
        want_f, want_b = _t(c.forward, vol), _t(c.backward, vol)
    assert term.time(ratios) == pytest.approx(want_f + want_b)
    assert term.backward_time(ratios) == pytest.approx(want_b)


def test_the_simulator_plan_and_codegen_read_the_table():
    for name, c in COLLECTIVES.items():
        comm = Instruction("collective", name, 0, tensor="h", src="G0", form="I").communicates
        assert comm == (name not in FREE)
        if c.forward is not None:
            launches = 4 if c.pricing == "grouped" else 1
            assert _kinds(name, 4, False) == ((c.forward, launches), (c.backward, launches))
    assert _kinds("zero2_gather", 4, False) == (("zero2_gather", 1), ("zero2_gather", 1))
    # codegen: each runtime function runs on one process as the identity (a 1-rank group)
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(runtime.all_gather(x, 0, (2,)), x) and torch.equal(runtime.to_partial(x), x)
