"""Tests of the view rules that keep a sharded dim through merges and splits, and of the hand rules for
core-ATen ops (indexing, integer/bool pointwise ops, histc, sort.stable, repeat_interleave, new_*):
every sample of the family modules' ``CASES`` tables against the single-device op (uneven ratios,
empty shards included), plus the strategies a view must (and must not) offer."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from hapnb import rules
from hapnb.ir.forms import G, I, R, shard_lengths
from hapnb.rules.checker import _check_strategy, _class_lengths, _single_op

f64 = torch.float64

#: uneven ratios, with empty shards (a zero ratio, two in a row) and one device holding everything
_RATIOS = ((0.7, 0.3), (0.5, 0.0, 0.5), (0.4, 0.3, 0.2, 0.1), (0.0, 1.0), (0.2, 0.0, 0.0, 0.8))


def _family_cases() -> list[tuple[str, str, object]]:
    out = []
    for mod in rules._FAMILY_MODULES:
        for target, build in getattr(mod, "CASES", ()):
            out.append((mod.__name__.rsplit(".", 1)[1], target, build))
    return out


_CASES = _family_cases()


def _check_all(target, args, kwargs, rng):
    g, op, full = _single_op(target, args, kwargs)
    strats = rules.strategies(g, op)
    draws = list(_RATIOS)
    for _ in range(3):
        rs = [rng.choice((0.0, rng.random() + 0.05)) for _ in range(rng.randint(2, 4))]
        draws.append(tuple(rs) if sum(rs) else (1.0, *rs[1:]))
    for s in strats:
        for k, ratios in enumerate(draws):
            status, why = _check_strategy(g, op, full, s, len(ratios), ratios, rng.randrange(1 << 30), k < 5)
            assert status == "ok", f"{target} {[tuple(x.shape) for x in full]} {s} ratios {ratios}: {why}"
    return strats


@pytest.mark.parametrize(
    ("family", "target", "build"), _CASES, ids=[f"{f}:{t}:{k}" for k, (f, t, _) in enumerate(_CASES)]
)
def test_family_case_passes_the_ground_truth_check(family, target, build):
    rng = random.Random(hash(target) & 0xFFFF)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            args, kwargs = build(rng)
            strats = _check_all(target, args, kwargs, rng)
            assert strats[0].name == "replicate"


def test_new_rules_are_registered_and_sampled():
    have = rules.registered()
    sampled = {t for _, t, _ in _CASES}
    new = (
        "aten.logical_and.default",
        "aten.logical_or.default",
        "aten.logical_xor.default",
        "aten.minimum.default",
        "aten.maximum.default",
        "aten.floor_divide.default",
        "aten.addcmul.default",
        "aten.addcdiv.default",
        "aten.lerp.Scalar",
        "aten.lerp.Tensor",
        "aten.index.Tensor",
        "aten.index_put.default",
        "aten.gather.default",
        "aten.scatter.src",
        "aten.scatter.value",
        "aten.scatter_add.default",
        "aten.histc.default",
        "aten.sort.stable",
        "aten.argsort.stable",
        "aten.repeat_interleave.self_int",
        "aten.slice_scatter.default",
        "aten.select_scatter.default",
        "aten.roll.default",
    )
    for t in new:
        assert t in have, t
        assert t in sampled, t
    assert rules.family("aten.index.Tensor") == "index"


# ------------------------------------------------------------------------------ views


def _forms(target, *args, **kwargs):
    g, op, full = _single_op(target, args, kwargs)
    return {(s.inputs, s.outputs) for s in rules.strategies(g, op)}


@pytest.mark.parametrize(
    ("shape", "new", "pairs"),
    [
        ((4, 3, 5), [12, 5], [(0, 0), (2, 1)]),  # merge (B, S) -> B*S with B sharded
        ((1, 4, 3), [12], [(1, 0)]),  # leading size-1 dim
        ((12, 5), [4, 3, 5], [(0, 0), (1, 2)]),  # split a*b -> (a, b): outer a sharded
        ((2, 3, 4, 5), [2, 3, 20], [(0, 0), (1, 1), (2, 2)]),  # (B, S, H, d) -> (B, S, H*d): H sharded
        ((6, 3, 5), [2, 3, 3, 5], [(0, 0), (1, 2), (2, 3)]),  # (B*H, S, d) -> (B, H, S, d)
        ((2, 3, 3, 5), [6, 3, 5], [(0, 0), (2, 1), (3, 2)]),  # and back
        ((3, 4, 5), [1, 3, 4, 5], [(0, 1), (1, 2), (2, 3)]),  # (1*H, S, d) -> (1, H, S, d): H sharded
        ((1, 3, 4, 5), [3, 4, 5], [(1, 0), (2, 1), (3, 2)]),  # and back
        ((4, 6), [6, 4], [(0, 0)]),  # one block: the outer dims share the class base gcd(4, 6)
    ],
)
def test_contiguous_view_shards_are_offered(shape, new, pairs):
    forms = _forms("aten.view.default", torch.randn(*shape, dtype=f64), new)
    got = sorted((s[0][0].dim, s[1][0].dim) for s in forms if s[0][0].is_gather)
    assert got == pairs
    assert ((R,), (R,)) in forms
    _check_all("aten.view.default", (torch.randn(*shape, dtype=f64), new), {}, random.Random(0))


def test_seq_first_batch_fold_is_not_offered():
    """(S, B, E) -> (S*B, E) with B sharded is a strided set of rows: never a shard (unsound)."""
    x = torch.randn(5, 4, 3, dtype=f64)
    for target, args in (
        ("aten.view.default", (x, [20, 3])),
        ("aten.reshape.default", (x, [-1, 3])),
        ("aten._unsafe_view.default", (x, [20, 3])),
        ("aten.flatten.using_ints", (x, 0, 1)),
    ):
        forms = _forms(target, *args)
        assert all(s[0][0] != G(1) for s in forms), target
        assert ((G(0),), (G(0),)) in forms  # the outer (sequence) dim still shards
    # and the split back: the inner factor of the merged dim is not offered either
    forms = _forms("aten.view.default", torch.randn(20, 3, dtype=f64), [5, 4, 3])
    assert all(s[1][0] != G(1) for s in forms)


def test_view_localizes_a_split_to_multiples_of_the_inner_factor():
    g, op, _ = _single_op("aten.view.default", (torch.randn(12, 5), [4, 3, 5]), {})
    (s,) = [s for s in rules.strategies(g, op) if s.inputs == (G(0),)]
    ratios = (0.5, 0.0, 0.5)
    lengths = _class_lengths(g, op, s, ratios)
    calls = [rules.localize(g, op, s, rules.LocalContext(r, 3, lengths)) for r in range(3)]
    assert [c.args[1] for c in calls] == [(2, 3, 5), (0, 3, 5), (2, 3, 5)]
    assert lengths(op.inputs[0], 0) == (6, 0, 6)  # input rows: multiples of 3 (the class base is 4)
    assert shard_lengths(4, ratios) == (2, 0, 2)


def test_view_as_and_expand_as_follow_the_output():
    forms = _forms("aten.view_as.default", torch.randn(4, 3, 5), torch.randn(12, 5))
    assert ((G(0), G(0)), (G(0),)) in forms and ((R, I), (R,)) in forms
    forms = _forms("aten.expand_as.default", torch.randn(4, 1, 5), torch.randn(4, 3, 5))
    assert ((G(0), G(0)), (G(0),)) in forms and ((G(2), G(2)), (G(2),)) in forms


# ------------------------------------------------------------------------------ hand rules


def test_index_with_batch_sharded_row_ids_and_hidden_sharded_table():
    table, ids = torch.randn(10, 6, dtype=f64), torch.randint(0, 10, (4, 5))
    forms = _forms("aten.index.Tensor", table, [ids])
    assert ((I, G(0)), (G(0),)) in forms  # batch of ids sharded, table replicated
    assert ((I, G(1)), (G(1),)) in forms
    assert ((G(1), I), (G(2),)) in forms  # table sharded on its (not indexed) hidden dim
    assert ((G(0), I), (G(0),)) not in forms  # the indexed dim never shards
    assert ((R, I), (R,)) in forms
    # boolean masks have a data-dependent shape: replicated only
    assert _forms("aten.index.Tensor", table, [torch.rand(10) > 0.5]) == {((I, I), (I,))}


def test_histc_counts_add_only_with_a_fixed_range():
    x = torch.randn(6, 4, dtype=f64)
    assert ((G(0),), (R,)) in _forms("aten.histc.default", x, 5, -1.0, 1.0)
    assert _forms("aten.histc.default", x, 5) == {((I,), (I,))}  # min == max: range from the data


def test_integer_and_bool_tensors_are_never_r():
    a, b = torch.randint(0, 9, (3, 4)), torch.randint(1, 9, (3, 4))
    for target, args, kw in (
        ("aten.bitwise_and.Tensor", (a, b), {}),
        ("aten.floor_divide.default", (a, b), {}),
        ("aten.new_zeros.default", (a, [3, 4]), {}),
        ("aten.repeat_interleave.self_int", (a, 2, 1), {}),
        ("aten.gather.default", (a, 1, torch.randint(0, 4, (3, 2))), {}),
    ):
        for ins, outs in _forms(target, *args, **kw):
            assert R not in ins + outs, target


def test_new_zeros_follows_the_input_and_localizes_its_size_list():
    """T5 shifts its labels with ``labels.new_zeros(labels.shape)``: a batch-sharded strategy exists."""
    labels = torch.randint(0, 9, (5, 7))
    g, op, _ = _single_op("aten.new_zeros.default", (labels, [5, 7]), {})
    strats = rules.strategies(g, op)
    (s,) = [s for s in strats if s.inputs == (G(0),)]
    assert s.outputs == (G(0),)
    ratios = (0.6, 0.0, 0.4)
    lengths = _class_lengths(g, op, s, ratios)
    calls = [rules.localize(g, op, s, rules.LocalContext(r, 3, lengths)) for r in range(3)]
    assert [c.args[1] for c in calls] == [(3, 7), (0, 7), (2, 7)]
    assert any(s.inputs == (I,) and s.outputs == (G(1),) for s in strats)
