"""Rule discovery (hapnb.rules.discover): strategies for ops without a hand rule found by ground truth on
uneven splits with an empty shard, its caches, custom ops (torch.library) that run, and a plan with a
custom op that shards the batch and verifies on two ranks."""

from __future__ import annotations

import json

import discover_ops as ops
import pytest
import torch

import hapnb as hap
from hapnb import rules
from hapnb.ir.forms import G, I, R
from hapnb.ir.graph import Graph, Op, TensorArg, TensorRef
from hapnb.rules import discover as D


def _one_op(
    target: str, in_shapes: list[tuple[int, ...]], out_shape: tuple[int, ...], args=None
) -> tuple[Graph, Op]:
    """A one-op graph: float32 inputs of ``in_shapes``, one output of ``out_shape``."""
    ts = [TensorRef(k, f"in{k}", s, "float32", "input") for k, s in enumerate(in_shapes)]
    ts.append(TensorRef(len(ts), "out", out_shape, "float32", "activation", producer=0))
    args = tuple(TensorArg(k) for k in range(len(in_shapes))) if args is None else args
    op = Op(0, "op", target, tuple(range(len(in_shapes))), (len(in_shapes),), args, flops=100.0)
    return Graph(tuple(ts), (op,), tuple(range(len(in_shapes))), (), len(in_shapes), name=target), op


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    """Every test: its own on-disk cache folder and an empty in-memory cache, discovery on."""
    monkeypatch.setenv("HAPNB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HAPNB_DISCOVER", raising=False)
    monkeypatch.delenv("HAPNB_DISCOVER_CACHE", raising=False)
    D.clear_cache()
    yield
    D.clear_cache()


def test_elementwise_custom_op_gets_batch_sharded_strategies() -> None:
    g, op = _one_op("hapnb_test.scaled_tanh.default", [(6, 4), (4,)], (6, 4))
    assert rules.rule_source(op.target) == "none"  # nothing discovered yet
    strats = rules.strategies(g, op)
    forms = {(s.inputs, s.outputs) for s in strats}
    assert strats[0].name == "replicate"
    assert ((G(0), I), (G(0),)) in forms  # the batch
    assert ((G(1), G(0)), (G(1),)) in forms  # the features, with the weight sharded alongside
    assert ((I, R), (R,)) in forms  # linear in w
    assert ((R, I), (R,)) not in forms  # tanh is not linear
    batch = next(s for s in strats if s.inputs == (G(0), I))
    assert batch.name.startswith("discovered") and batch.scaled_flops == 300.0 and batch.fixed_flops == 0
    partial = next(s for s in strats if s.inputs == (I, R))
    assert partial.fixed_flops == 300.0  # no G form: every rank does the whole op
    assert rules.rule_source(op, g) == "discovered" and rules.rule_source(op.target) == "discovered"
    assert rules.rule_source("aten.linear.default") == "hand"
    # a discovered strategy runs the op itself with its own arguments, on any rank
    call = rules.localize(g, op, batch, rules.LocalContext(0, 2, lambda t, d: (4, 2)))
    assert call.fn is torch.ops.hapnb_test.scaled_tanh.default
    out = call.run([torch.ones(4, 4), torch.ones(4)])
    assert out.shape == (4, 4)


def test_wrong_candidates_are_rejected() -> None:
    g, op = _one_op("hapnb_test.colnorm.default", [(5, 3)], (5, 3))
    full = [torch.randn(5, 3, dtype=torch.float64)]
    fn = torch.ops.hapnb_test.colnorm.default
    # planted: the op normalizes over dim 0, so sharding dim 0 changes the result
    ok, why = D.accepts(fn, op, full, ((G(0),), (G(0),)), D.splits(5))
    assert not ok and "output 0" in why
    ok, _ = D.accepts(fn, op, full, ((G(1),), (G(1),)), D.splits(3))
    assert ok  # columns are independent
    ok, why = D.accepts(fn, op, full, ((R,), (R,)), D.splits(2))
    assert not ok  # not linear
    found = D.discover(g, op)
    assert found.accepted == (((G(1),), (G(1),)),), found
    assert any("(G0) -> (G0)" in c for c, _ in found.rejected)
    # and an R input of the non-linear tanh is rejected
    g2, op2 = _one_op("hapnb_test.scaled_tanh.default", [(6, 4), (4,)], (6, 4))
    full2 = [torch.randn(6, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    ok, why = D.accepts(torch.ops.hapnb_test.scaled_tanh.default, op2, full2, ((R, I), (R,)), D.splits(2))
    assert not ok and "max abs error" in why


def test_ground_truth_uses_uneven_splits_with_an_empty_shard() -> None:
    assert D.splits(6) == ((2, 0, 4), (0, 5, 1))
    for n in (2, 3, 4, 7):
        s1, s2 = D.splits(n)
        assert s1 != s2 and sum(s1) == sum(s2) == n and 0 in s1 and 0 in s2
    ops.CALLS.clear()
    g, op = _one_op("hapnb_test.scaled_tanh.default", [(6, 4), (4,)], (6, 4))
    found = D.discover(g, op)
    assert found.splits[6] == ((2, 0, 4), (0, 5, 1)) and found.splits[4] == ((2, 0, 2), (0, 3, 1))
    seen = {shape for name, shape in ops.CALLS if name == "scaled_tanh"}
    # the batch split (2, 0, 4) and (0, 5, 1) ran, the empty shard included
    assert {(2, 4), (0, 4), (4, 4), (5, 4), (1, 4)} <= seen


def test_disk_cache_written_read_back_and_corrupt_file_ignored(tmp_path) -> None:
    g, op = _one_op("hapnb_test.scaled_tanh.default", [(6, 4), (4,)], (6, 4))
    ops.CALLS.clear()
    first = D.discover(g, op)
    ran = len(ops.CALLS)
    assert ran > 0 and first.accepted
    files = list(D.cache_folder().glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["target"] == op.target
    D.clear_cache()  # memory only: the next answer comes from disk, without running the op
    again = D.discover(g, op)
    assert len(ops.CALLS) == ran and again.accepted == first.accepted
    D.clear_cache()
    files[0].write_text("{not json")  # corrupt: ignored, discovered again and rewritten
    third = D.discover(g, op)
    assert len(ops.CALLS) > ran and third.accepted == first.accepted
    assert json.loads(files[0].read_text())["accepted"]
    D.clear_cache()
    files[0].write_text(json.dumps({"format": D.FORMAT, "key": files[0].stem, "accepted": [["__import__"]]}))
    assert D.discover(g, op).accepted == first.accepted  # a bad entry is data that does not parse


def test_switch_off_unresolvable_ops_and_random_ops(monkeypatch) -> None:
    g, op = _one_op("hapnb_test.scaled_tanh.default", [(6, 4), (4,)], (6, 4))
    monkeypatch.setenv("HAPNB_DISCOVER", "0")
    assert len(rules.strategies(g, op)) == 1
    monkeypatch.setenv("HAPNB_DISCOVER", "1")
    assert len(rules.strategies(g, op)) > 1
    g2, op2 = _one_op("nolib.nothing.default", [(6, 4)], (6, 4))
    assert len(rules.strategies(g2, op2)) == 1
    assert "no op overload" in D.discover(g2, op2).reason
    with pytest.raises(KeyError, match="nolib.nothing.default"):
        rules.localize(g2, op2, rules.strategies(g2, op2)[0], rules.LocalContext(0, 1, lambda t, d: ()))
    g3, op3 = _one_op("aten.rand_like.default", [(6, 4)], (6, 4))
    assert "not deterministic" in D.discover(g3, op3).reason


def test_big_op_is_checked_shrunk() -> None:
    g, op = _one_op("hapnb_test.scaled_tanh.default", [(4096, 512), (512,)], (4096, 512))
    ops.CALLS.clear()
    found = D.discover(g, op)
    assert found.shrunk == {512: 3, 4096: 4} and found.accepted
    assert max(s[0] * s[1] for _, s in ops.CALLS) <= 16  # never ran at full size
    assert ((G(0), I), (G(0),)) in found.accepted
    # a big size pinned by an argument cannot shrink: not discovered, and why
    gv, opv = _one_op("aten.view.default", [(2048, 1024)], (1024, 2048), args=(TensorArg(0), [1024, 2048]))
    assert "cannot shrink" in D.discover(gv, opv).reason


def test_checker_covers_discovered_rules() -> None:
    g, op = _one_op("hapnb_test.scaled_tanh.default", [(6, 4), (4,)], (6, 4))
    rules.strategies(g, op)
    report = rules.check(["hapnb_test.scaled_tanh"], trials=4)
    assert report.ok, str(report)
    assert report.rows and all(r.source == "discovered" for r in report.rows)
    assert "hapnb_test.scaled_tanh.default (discovered)" in str(report)


def test_model_with_custom_op_plans_batch_sharded_and_verifies() -> None:
    torch.manual_seed(0)
    g = hap.trace(ops.TanhMLP(), (torch.randn(64, 4),))
    op = next(o for o in g.ops if o.target == "hapnb_test.scaled_tanh.default")
    assert rules.rule_source(op, g) == "discovered"
    plan = hap.synthesize(g, "2xV100")
    loads = {i.tensor: i.form for i in plan.program if i.kind == "load"}
    assert loads["x"] == "G0", [str(i) for i in plan.program]
    custom = next(i for i in plan.program if i.kind == "compute" and i.op == op.name)
    assert custom.name.startswith("discovered") and custom.inputs[0][1] == "G0"
    # the bundle records the module that defines the custom op; the worker imports it before loading
    report = hap.verify(plan, nproc=2, steps=2, timeout=120)
    assert report.ok, report.text()
