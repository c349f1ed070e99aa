"""The search's shared tables and caches change nothing: a search with them finds exactly what a search
without them finds (program, cost, expansions), for the collapsed device classes, the theory tables and
strategy filters shared by the searches of a context, and the per-ratio / per-cluster price caches."""

from __future__ import annotations

import pytest
import synthetic as S

import hapnb
import hapnb.synth.search as search_module
from hapnb.cost.model import CostModel
from hapnb.hardware.cluster import Cluster
from hapnb.ir.forms import FullShard, G, I
from hapnb.synth.tables import entries_for, ratio_classes, theory_tables
from hapnb.tracing import zoo_graph
from hapnb.triples import theory


def _outcome(s: hapnb.Search) -> tuple:
    res = s.run()
    return res.program, res.cost, res.optimal, s.stats["expansions"], s.stats["generated"]


@pytest.mark.parametrize("seed", range(8))
def test_device_classes_give_the_search_of_every_device(seed, monkeypatch):
    g = S.random_graph(seed)
    th = theory(g, S.strategies)
    c = Cluster.parse("2xV100+2xP100+1xA100")
    ratios = None if seed % 2 else [[0.3, 0.3, 0.1, 0.1, 0.2]]
    collapsed = Search = search_module.Search
    assert len(collapsed(th, c, ratios=ratios)._reps) == 3
    with_classes = _outcome(Search(th, c, ratios=ratios))
    monkeypatch.setattr(search_module, "ratio_classes", lambda cm, r: tuple(range(cm.n)))
    every_device = Search(th, c, ratios=ratios)
    assert every_device._reps == (0, 1, 2, 3, 4)
    assert _outcome(every_device) == with_classes


def test_ratio_classes_need_equal_speed_and_equal_ratios():
    th = theory(zoo_graph("mlp", layers=1, hidden=8, input=6, batch=4)[0])
    cm = CostModel(th, Cluster.parse("2xV100+2xP100"))
    assert ratio_classes(cm, ((0.25,) * 4,)) == (0, 2)
    assert ratio_classes(cm, ((0.3, 0.3, 0.2, 0.2), (0.3, 0.2, 0.3, 0.2))) == (0, 1, 2, 3)  # per segment
    assert ratio_classes(cm, ((0.3, 0.3 + 1e-17, 0.2, 0.2 + 1e-12),)) == (0, 2, 3)  # exactly equal only


def test_searches_sharing_tables_and_prices_find_what_fresh_searches_find():
    th = theory(zoo_graph("mlp", layers=2, hidden=32, input=16, batch=16)[0])
    c = Cluster.parse("2xV100+2xP100")
    w = "layers.0.weight" if "layers.0.weight" in {t.name for t in th.graph.tensors} else None
    params = [t.name for t in th.graph.tensors if t.role == "param" and len(t.shape) == 2]
    w = w or params[0]
    runs = [
        ({}, {}, False),
        ({w: G(0)}, {}, False),
        ({w: FullShard(1)}, {}, False),  # a storage pin: its loads are not shared
        ({}, {"sfb": False, "grouped": False}, False),
        ({}, {}, True),  # memory: loads priced by the memory tracker
        ({w: I}, {}, False),
    ]
    for ratios in (None, [[0.4, 0.3, 0.2, 0.1]]):
        shared: dict = {"static": {}, "per_cluster": {}}
        for pins, options, memory in runs + runs[::-1]:
            kw = dict(ratios=ratios, pins=pins, options=options, memory=memory)
            together = _outcome(hapnb.Search(th, c, shared=shared, **kw))
            alone = _outcome(hapnb.Search(th, c, **kw))
            assert together == alone, (pins, options, memory)
        assert shared["static"]["tables"][0] is th


def test_tables_are_rebuilt_for_another_theory():
    g = zoo_graph("mlp", layers=1, hidden=8, input=6, batch=4)[0]
    th1, th2 = theory(g), theory(g)
    c = Cluster.parse("2xV100+2xP100")
    shared: dict = {"static": {}}
    hapnb.Search(th1, c, shared=shared)
    first = shared["static"]["tables"][1]
    hapnb.Search(th2, c, shared=shared)
    assert shared["static"]["tables"][0] is th2 and shared["static"]["tables"][1] is not first


def test_entries_for_keeps_exactly_the_strategies_the_pins_allow():
    th = theory(zoo_graph("mlp", layers=2, hidden=16, input=8, batch=8)[0])
    g = th.graph
    cm = CostModel(th, Cluster.parse("2xV100+2xP100"))
    tb = theory_tables(th, cm.segment_of)
    w = next(t.id for t in g.tensors if t.role == "param" and len(t.shape) == 2)
    act = next(t.id for t in g.tensors if t.role == "activation" and len(t.shape) == 2)
    for pins, storage, sfb in (
        ({}, {}, True),
        ({}, {}, False),
        ({w: G(0), act: I}, {}, True),
        ({w: I}, {w: 1}, True),
    ):
        got = entries_for(th, tb, pins, storage, sfb)
        for op, row in zip(g.ops, got):
            want = []
            for k, s in enumerate(th.strategies[op.id]):
                if s.sfb and (
                    not sfb or any(t in storage for t, f in zip(op.inputs, s.inputs) if f.kind == "I")
                ):
                    continue
                if any(pins.get(t, f) != f for t, f in zip(op.outputs, s.outputs)):
                    continue
                if any(tb.loadable[t] and pins.get(t, f) != f for t, f in zip(op.inputs, s.inputs)):
                    continue
                if s.sfb and any(
                    g.tensors[t].role == "param" and f.kind == "I" and len(set(g.tensors[t].consumers)) > 1
                    for t, f in zip(op.inputs, s.inputs)
                ):
                    continue
                want.append(k)
            assert [e.index for e in row] == want, (op.name, pins, storage, sfb)
