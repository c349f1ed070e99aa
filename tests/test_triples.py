"""The theory of a program (hapnb.triples): loader, compute and collective triples with the paper's
pre/postconditions, valid forms, dim classes and shard lengths, filtering, and the notes renderers show."""

from __future__ import annotations

import synthetic as S

from hapnb.ir.forms import G, I, R, shard_lengths
from hapnb.triples import COLLECTIVES, Theory, theory


def _th() -> Theory:
    return theory(S.mlp_graph(batch=64, dims=(32, 48, 16)), S.strategies)


def test_collective_triples_are_the_papers():
    th = _th()
    g = th.graph
    h = g.ops[0].outputs[0]  # first matmul's output [64, 48]
    got = {
        (tr.instr.name, tr.pre, tr.post)
        for tr in th
        if tr.instr.kind == "collective" and tr.instr.tensor == h
    }
    for d in (0, 1):
        assert ("all_gather", ((h, G(d)),), ((h, I),)) in got
        assert ("grouped_all_gather", ((h, G(d)),), ((h, I),)) in got
        assert ("slice", ((h, I),), ((h, G(d)),)) in got
        assert ("reduce_scatter", ((h, R),), ((h, G(d)),)) in got
        assert ("all_to_all", ((h, G(d)),), ((h, G(1 - d)),)) in got
    assert ("all_reduce", ((h, R),), ((h, I),)) in got
    # every collective name the theory uses is documented, with its pre/post kinds
    for name, _, post, _note in ((n, *v) for n, v in COLLECTIVES.items()):
        assert name in Theory.collective_notes and Theory.collective_notes[name]
        for tr in th:
            if tr.instr.kind == "collective" and tr.instr.name == name:
                assert tr.post[0][1].kind == post


def test_loaders_cover_every_valid_form_and_params_are_never_communicated():
    th = _th()
    g = th.graph
    for t in g.tensors:
        loads = {tr.instr.form for tr in th if tr.instr.kind == "load" and tr.instr.tensor == t.id}
        comms = [tr for tr in th if tr.instr.kind == "collective" and tr.instr.tensor == t.id]
        if t.role in ("input", "param"):
            assert loads == set(th.forms[t.id]) and comms == []
        else:
            assert loads == set()
    loss = g.loss
    assert any(tr.instr.name == "to_partial" and tr.post == ((loss, R),) for tr in th)


def test_compute_triples_follow_the_strategies():
    th = _th()
    g = th.graph
    for op in g.ops:
        mine = [tr for tr in th if tr.instr.kind == "compute" and tr.instr.op == op.id]
        assert [tr.instr.strategy for tr in mine] == list(th.strategies[op.id])
        for tr in mine:
            assert tr.pre == tuple(zip(op.inputs, tr.instr.strategy.inputs))
            assert tr.post == tuple(zip(op.outputs, tr.instr.strategy.outputs))


def test_filter_and_shard_lengths():
    th = _th()
    g = th.graph
    assert all(tr.instr.kind == "load" for tr in th.filter(kind="load"))
    w0 = g.tensor("w0").id
    assert th.filter(tensor="w0") and all(
        any(t == w0 for t, _ in tr.pre + tr.post) for tr in th.filter(tensor="w0")
    )
    assert th.lengths(g.tensor("x").id, 0, (0.5, 0.25, 0.25)) == shard_lengths(64, (0.5, 0.25, 0.25))
    assert sum(th.lengths(w0, 1, (0.7, 0.3))) == 48
    kinds = {k: sum(tr.instr.kind == k for tr in th) for k in ("collective", "compute", "load")}
    assert repr(th) == (
        f"Theory of mlp: {len(th)} triples ({kinds['collective']} collective, {kinds['compute']} compute, "
        f"{kinds['load']} load)"
    )


def test_ops_with_one_signature_share_the_rules_answer_exactly():
    """theory() asks the rules once per op signature (repeated layers): the strategies, forms and dim units
    are those of asking for every op (a caller's own strategies function is asked for every op)."""
    import pytest

    from hapnb import rules
    from hapnb.tracing import zoo_graph

    for name in ("bert-moe", "vit", "gpt"):
        g = zoo_graph(name, layers=3)[0]
        asked: list[int] = []

        def every_op(g, op, asked=asked):  # noqa: ANN001, ANN202 - the strategies callable
            asked.append(op.id)
            return rules.strategies(g, op)

        shared, each = theory(g), theory(g, every_op)
        assert asked == [op.id for op in g.ops]
        assert shared.strategies == each.strategies, name
        assert shared.forms == each.forms and shared.units == each.units, name
    with pytest.raises(ValueError, match="no valid strategy"):
        theory(g, lambda g, op: ())
