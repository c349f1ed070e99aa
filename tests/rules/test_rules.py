"""Tests of hapnb.rules: every rule against the single-device op (the checker), pinned strategy
lists, flop formulas by hand, the replicated fallback, and the localize contract."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hapnb import ops as hops
from hapnb import rules
from hapnb.ir.forms import G, I, R, shard_lengths
from hapnb.ir.graph import Graph, Op, TensorArg, TensorRef
from hapnb.rules.checker import _check_strategy, _class_lengths, _single_op
from hapnb.rules.registry import _RULES, _Cand, _Rule

f64 = torch.float64


def _strats(target, *args, **kwargs):
    g, op, full = _single_op(target, args, kwargs)
    return g, op, full, rules.strategies(g, op)


def _forms(strats):
    return {(s.inputs, s.outputs, s.sfb) for s in strats}


# ----------------------------------------------------------------------------- ground truth


def test_every_rule_passes_the_ground_truth_check():
    report = rules.check(trials=12, seed=0)
    assert report.ok, str(report)
    assert not report.wrong and not report.crashed
    # the checker covers the issue list
    checked = set(report.by_target())
    for t in (
        "aten.linear.default",
        "aten.addmm.default",
        "aten.matmul.default",
        "aten.bmm.default",
        "aten.conv2d.default",
        "aten.scaled_dot_product_attention.default",
        "aten.embedding.default",
        "aten.cross_entropy_loss.default",
        "aten.nll_loss_nd.default",
        "aten.einsum.default",
        "aten.layer_norm.default",
        "aten.rms_norm.default",
        "aten.view.default",
        "aten.cat.default",
        "aten.max_pool2d.default",
        "aten.adaptive_avg_pool2d.default",
        "aten.upsample_nearest2d.vec",
        "aten.upsample_bilinear2d.vec",
        "aten.sum.dim_IntList",
        "aten.mean.dim",
        "aten.softmax.int",
        "aten.logcumsumexp.default",
        "aten.triu.default",
        "aten.arange.default",
    ):
        assert t in checked, t
    assert "PASS" in str(report)


def test_checker_catches_a_wrong_rule(monkeypatch):
    """A deliberately unsound rule (relu of R -> R) must be reported as wrong, not pass."""
    orig = _RULES["aten.relu.default"]
    bad = _Rule(orig.family, lambda g, op: [_Cand("bad", (R,), (R,), "full")], None, orig.flops, "")
    monkeypatch.setitem(_RULES, "aten.relu.default", bad)
    report = rules.check(["aten.relu.default"], trials=2)
    assert not report.ok
    assert any("bad" in r.strategy for r in report.wrong)


def test_checker_reports_crashes_separately(monkeypatch):
    def boom(g, op, s, ctx):
        raise RuntimeError("boom")

    orig = _RULES["aten.tanh.default"]
    monkeypatch.setitem(_RULES, "aten.tanh.default", _Rule(orig.family, orig.gen, boom, orig.flops, ""))
    report = rules.check(["aten.tanh.default"], trials=2)
    assert report.crashed and not report.wrong
    assert "boom" in report.crashed[0].detail


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(2, 6),
    s=st.integers(1, 5),
    k=st.integers(2, 6),
    n=st.integers(2, 6),
    ratios=st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]), min_size=2, max_size=4).filter(
        lambda r: sum(r) > 0
    ),
)
def test_linear_and_view_rules_hold_for_random_shapes_and_ratios(b, s, k, n, ratios):
    x, w, bias = torch.randn(b, s, k, dtype=f64), torch.randn(n, k, dtype=f64), torch.randn(n, dtype=f64)
    for target, args in (("aten.linear.default", (x, w, bias)), ("aten.view.default", (x, [b * s, k]))):
        g, op, full = _single_op(target, args, {})
        for strat in rules.strategies(g, op):
            status, why = _check_strategy(g, op, full, strat, len(ratios), ratios, 1, True)
            assert status == "ok", f"{target} {strat}: {why}"


# ------------------------------------------------------------------------------ design facts


def test_linear_strategy_list_is_pinned():
    g, op, _, strats = _strats("aten.linear.default", torch.randn(4, 5, 6), torch.randn(3, 6), torch.randn(3))
    assert [str(s) for s in strats] == [
        "replicate: (I,I,I) -> (I)",
        "shard:a: (G0,I,I) -> (G0)",  # batch
        "shard:b: (G1,I,I) -> (G1)",  # sequence
        "reduce:k: (G2,G1,I) -> (R)",  # row-parallel: contracted dim, bias on rank 0
        "shard:n: (I,G0,G0) -> (G2)",  # column-parallel
        "partial0: (R,I,I) -> (R)",
        "partial1: (I,R,I) -> (R)",
        "sfb:a: (G0,I,I) -> (G0)",
        "sfb:b: (G1,I,I) -> (G1)",
    ]
    F = op.flops
    rep, sfb = strats[0], strats[-1]
    assert (rep.scaled_flops, rep.fixed_flops) == (0.0, 3 * F)
    assert strats[1].scaled_flops == 3 * F and strats[1].fixed_flops == 0.0
    assert sfb.sfb and (sfb.scaled_flops, sfb.fixed_flops) == (2 * F, F)


def test_g_forms_only_on_dims_of_size_two_or_more():
    _, _, _, strats = _strats("aten.linear.default", torch.randn(1, 5, 6), torch.randn(3, 6))
    for s in strats:
        assert G(0) not in s.inputs[:1]


def test_broadcast_dims_are_replicated_for_the_small_operand():
    _, _, _, strats = _strats("aten.add.Tensor", torch.randn(4, 5, 6), torch.randn(4, 1, 6))
    forms = _forms(strats)
    assert ((G(1), I), (G(1),), False) in forms
    assert ((G(0), G(0)), (G(0),), False) in forms
    assert ((R, I), (R,), False) in forms and ((R, R), (R,), False) in forms


def test_moe_einsums_come_from_the_generic_generator_without_the_unsound_combine_rule():
    x, y = torch.randn(2, 3, 4, 5), torch.randn(2, 6, 3, 4)  # becd, bsec
    _, _, _, strats = _strats("aten.einsum.default", "becd,bsec->bsd", [x, y])
    forms = _forms(strats)
    assert ((I, G(2)), (G(1),), False) not in forms  # the original's unsound rule
    assert ((I, G(1)), (G(1),), False) in forms  # the sound one (s is kept)
    assert ((G(1), G(2)), (R,), False) in forms  # e contracted
    assert ((G(0), G(0)), (G(0),), False) in forms
    moe = (
        ("bsd,bsec->becd", [(2, 3, 4), (2, 3, 5, 6)]),
        ("edh,becd->bech", [(5, 4, 3), (2, 5, 6, 4)]),
        ("ehd,bech->becd", [(5, 3, 4), (2, 5, 6, 3)]),
    )
    for eq, shapes in moe:
        _, _, _, st_ = _strats("aten.einsum.default", eq, [torch.randn(*s) for s in shapes])
        assert len(st_) >= 6


def test_unknown_op_gets_only_the_replicated_strategy():
    ts = (
        TensorRef(0, "x", (4, 4), "float32", "input"),
        TensorRef(1, "y", (4, 4), "float32", "activation", 0),
    )
    op = Op(0, "frob", "aten.frobnicate.default", (0,), (1,), (TensorArg(0),), flops=10.0)
    g = Graph(ts, (op,), (0,), (), 1)
    (only,) = rules.strategies(g, op)
    assert only.inputs == (I,) and only.outputs == (I,)
    assert (only.scaled_flops, only.fixed_flops) == (0.0, 30.0)
    assert rules.family("aten.frobnicate.default") == "unknown"


def test_dropout_is_never_partial_and_integers_never_r():
    _, _, _, strats = _strats("aten.dropout.default", torch.randn(4, 5), 0.1, True)
    assert all(R not in s.inputs for s in strats)
    _, _, _, strats = _strats("aten.embedding.default", torch.randn(10, 4), torch.randint(0, 10, (3, 5)))
    assert all(s.inputs[1] in (I, G(0), G(1)) for s in strats)
    names = {s.name for s in strats}
    assert {"vocab", "hidden", "batch0", "batch1"} <= names


def test_sdpa_batch_and_head_parallel_with_mask():
    q = torch.randn(2, 3, 4, 5)
    _, _, _, strats = _strats(
        "aten.scaled_dot_product_attention.default", q, q.clone(), q.clone(), torch.randn(4, 4)
    )
    forms = _forms(strats)
    assert ((G(0), G(0), G(0), I), (G(0),), False) in forms  # batch; a [L,S] mask broadcasts
    assert ((G(1), G(1), G(1), I), (G(1),), False) in forms  # heads
    assert ((G(2), I, I, G(0)), (G(2),), False) in forms  # query rows: the mask's rows follow


def test_flops_by_hand():
    assert rules.flops("aten.linear.default", [(8, 4), (3, 4), (3,)], [(8, 3)]) == 2 * 8 * 3 * 4 + 8 * 3
    assert rules.flops("aten.linear.default", [(8, 4), (3, 4)], [(8, 3)]) == 2 * 8 * 3 * 4
    # sdpa [B=2, H=4, L=5, E=8], S=5: QK^T and AV (2 flops per MAC) + softmax/scale 5 per score
    assert rules.flops("aten.scaled_dot_product_attention.default", [(2, 4, 5, 8)] * 3, [(2, 4, 5, 8)]) == (
        2 * 8 * 5 * 5 * (8 + 8) + 5 * 8 * 5 * 5
    )
    # conv2d x[2,3,8,8] w[4,3,3,3] pad 1 -> out [2,4,8,8]: 2*out*Cin*kh*kw + bias
    assert rules.flops("aten.conv2d.default", [(2, 3, 8, 8), (4, 3, 3, 3), (4,)], [(2, 4, 8, 8)]) == (
        2 * 512 * 27 + 512
    )
    assert rules.flops(
        "aten.einsum.default", [(2, 3, 4), (2, 3, 5, 6)], [(2, 5, 6, 4)], ("bsd,bsec->becd",)
    ) == (2 * 2 * 3 * 4 * 5 * 6)
    assert rules.flops("aten.view.default", [(4, 4)], [(16,)]) == 0
    # logcumsumexp: per element exp + log1p (4 each) + min, max, subtract, add
    assert rules.flops("aten.logcumsumexp.default", [(2, 3, 4)], [(2, 3, 4)], (1,)) == 12 * 24


def test_logcumsumexp_is_a_scan_sharded_only_off_its_dim():
    _, _, _, strats = _strats("aten.logcumsumexp.default", torch.randn(4, 6, 5), 1)
    assert rules.family("aten.logcumsumexp.default") == "scan"
    assert _forms(strats) == {((I,), (I,), False), ((G(0),), (G(0),), False), ((G(2),), (G(2),), False)}


# ------------------------------------------------------------------------------ localize


def _ctx(g, op, s, ratios, rank):
    lengths = _class_lengths(g, op, s, ratios)
    return rules.LocalContext(rank, len(ratios), lengths)


def test_views_rewrite_their_shape_to_local_sizes():
    g, op, _, strats = _strats("aten.view.default", torch.randn(4, 3, 5), [12, 5])
    (s,) = [s for s in strats if s.inputs == (G(0),)]
    ratios = (0.5, 0.25, 0.25)
    calls = [rules.localize(g, op, s, _ctx(g, op, s, ratios, r)) for r in range(3)]
    assert [c.args[1] for c in calls] == [(6, 5), (3, 5), (3, 5)]  # S * local batch rows
    assert shard_lengths(4, ratios) == (2, 1, 1)


def test_row_parallel_linear_adds_the_bias_on_rank_zero_only():
    x, w, b = torch.randn(3, 4, dtype=f64), torch.randn(2, 4, dtype=f64), torch.randn(2, dtype=f64)
    g, op, full, strats = _strats("aten.linear.default", x, w, b)
    (s,) = [s for s in strats if s.outputs == (R,) and s.inputs[0] == G(1)]
    ratios = (0.5, 0.0, 0.5)  # a rank with an empty shard
    outs = []
    for r in range(3):
        call = rules.localize(g, op, s, _ctx(g, op, s, ratios, r))
        assert call.fn is hops.linear_partial and call.args[3] == (r == 0)
        lens = _class_lengths(g, op, s, ratios)(op.inputs[0], 1)
        off = sum(lens[:r])
        outs.append(call.run([x[:, off : off + lens[r]], w[:, off : off + lens[r]], b]))
    torch.testing.assert_close(sum(outs), torch.nn.functional.linear(x, w, b))


def test_cross_entropy_mean_with_ignore_index_uses_the_global_count():
    x = torch.randn(6, 3, dtype=f64)
    t = torch.tensor([0, -100, 2, 1, -100, -100])  # rank 1's shard is all ignored
    g, op, full, strats = _strats("aten.cross_entropy_loss.default", x, t, None, 1, -100, 0.0)
    (s,) = [s for s in strats if s.outputs == (R,)]
    ratios = (0.5, 0.5)
    sim = hops.RankSimulator(2)
    for _pass in range(2):
        parts = []
        for r in range(2):
            call = rules.localize(g, op, s, _ctx(g, op, s, ratios, r))
            with sim.rank(r):
                parts.append(call.run([x[3 * r : 3 * r + 3], t[3 * r : 3 * r + 3], None]))
        sim.next_pass()
    torch.testing.assert_close(parts[0] + parts[1], torch.nn.functional.cross_entropy(x, t))


def test_cli_check_one_op(capsys):
    assert rules.main(["--check", "linear", "--trials", "3"]) == 0
    out = capsys.readouterr().out
    assert "aten.linear.default" in out and "PASS" in out
    assert rules.main(["--list"]) == 0
