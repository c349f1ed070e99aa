"""Seq-first attention keeps the batch sharded (issue 18, :mod:`hapnb.tracing.folds`): the fold of the batch
into an inner position around ``nn.MultiheadAttention``'s output projection, ``(S, B, E) -> (S*B, E)``,
linear, back to ``(S, B, E)``, is rewritten at trace time so the projection works on ``(S, B, E)``; the
batch (``G1`` on the input) then stays sharded with no collective, and the program equals one device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import hapnb as hap
from hapnb.ir.graph import Graph, Op, TensorArg, TensorRef
from hapnb.rules import flops
from hapnb.runtime.codegen import generate
from hapnb.runtime.reference import reference_module, reference_params
from hapnb.tracing.folds import find_row_folds, unfold_rows

A = TensorArg


def _graph(mid: list[tuple[str, tuple, tuple[int, ...]]], unfold: tuple[str, tuple] | None = None) -> Graph:
    """x[3,2,4] -> flatten(0,1) [6,4] -> ``mid`` ops -> unfold -> sum: ``mid`` is ``(target, args,
    extra input shapes)`` applied to the running tensor (TensorArg 0); extra inputs are parameters."""
    tensors: list[TensorRef] = [TensorRef(0, "x", (3, 2, 4), "float32", "input")]
    ops: list[Op] = []
    params: list[int] = []

    def tensor(name: str, shape: tuple[int, ...], role: str = "activation") -> int:
        tensors.append(
            TensorRef(len(tensors), name, shape, "float32", role, len(ops) if role == "activation" else None)
        )
        return len(tensors) - 1

    def op(target: str, ins: tuple[int, ...], args: tuple, shape: tuple[int, ...]) -> int:
        out = tensor(f"t{len(ops)}", shape)
        ops.append(Op(len(ops), f"t{len(ops)}", target, ins, (out,), args))
        return out

    cur = op("aten.flatten.using_ints", (0,), (A(0), 0, 1), (6, 4))
    for target, args, extra in mid:
        ins = [cur]
        for shape in extra:
            params.append(tensor(f"p{len(tensors)}", shape, "param"))
            ins.append(params[-1])
        n = tensors[ins[1]].shape[0] if target == "aten.linear.default" else tensors[cur].shape[-1]
        cur = op(target, tuple(ins), args, (6, n))
    target, args = unfold or ("aten.view.default", (A(0), (3, 2, tensors[cur].shape[-1])))
    cur = op(target, (cur,), args, (3, 2, tensors[cur].shape[-1]))
    loss = op("aten.sum.default", (cur,), (A(0),), ())
    consumers: dict[int, list[int]] = {}
    for o in ops:
        for t in o.inputs:
            consumers.setdefault(t, []).append(o.id)
    tensors = [dataclasses.replace(t, consumers=tuple(consumers.get(t.id, ()))) for t in tensors]
    return Graph(tuple(tensors), tuple(ops), (0,), tuple(params), loss)


LINEAR = ("aten.linear.default", (A(0), A(1), None), ((5, 4),))


def test_a_fold_around_row_wise_ops_is_unfolded() -> None:
    g = _graph([LINEAR, ("aten.relu.default", (A(0),), ()), ("aten.add.Tensor", (A(0), A(1)), ((5,),))])
    (fold,) = find_row_folds(g)
    assert (fold.fold, fold.chain, fold.unfold, fold.lead) == (0, (1, 2, 3), 4, (3, 2))
    new = unfold_rows(g)
    shapes = [new.tensors[op.outputs[0]].shape for op in new.ops]
    assert shapes == [(3, 2, 4), (3, 2, 5), (3, 2, 5), (3, 2, 5), (3, 2, 5), ()]
    first = new.ops[0]  # the flatten became a reshape to the unfolded rows (and says what it was)
    assert (first.target, first.args, first.origin) == (
        "aten.reshape.default",
        (A(0), (3, 2, 4)),
        "aten.flatten.using_ints",
    )
    assert new.ops[4].args == (A(0), (3, 2, 5))  # the unfold is the identity now

    def work(graph: Graph, op: Op) -> float:
        shapes = [[graph.tensors[t].shape for t in ts] for ts in (op.inputs, op.outputs)]
        return flops(op.target, *shapes, op.args, op.kwargs)

    assert [op.flops for op in new.ops[:5]] == [work(g, op) for op in g.ops[:5]]  # the same work
    assert new.ops[1].flops == 2 * 6 * 4 * 5
    assert new.fingerprint != g.fingerprint and not find_row_folds(new)
    assert [(op.inputs, op.outputs) for op in new.ops] == [(op.inputs, op.outputs) for op in g.ops]


@pytest.mark.parametrize(
    "mid,unfold",
    [
        ([], None),  # nothing between the fold and the unfold: a plain view pair
        (
            [("aten.softmax.int", (A(0), 1, False), ())],
            None,
        ),  # not elementwise: dim 1 is a different dim unfolded
        ([("aten.mul.Tensor", (A(0), A(1)), ((6, 4),))], None),  # a full-size operand has the folded shape
        (
            [("aten.layer_norm.default", (A(0), (2, 2), None, None, 1e-5, False), ())],
            None,
        ),  # not the last dim only
        ([LINEAR], ("aten.view.default", (A(0), (6, 5)))),  # unfolds to the same rows
        ([LINEAR], ("aten.view.default", (A(0), (3, 10)))),  # not back to rows of the same last dim
    ],
)
def test_other_patterns_are_left_alone(mid, unfold) -> None:
    g = _graph(mid, unfold)
    if unfold is not None:  # fix the unfold's recorded output shape to what its arguments say
        out = g.ops[-2].outputs[0]
        ts = list(g.tensors)
        ts[out] = dataclasses.replace(ts[out], shape=tuple(unfold[1][1]))
        g = dataclasses.replace(g, tensors=tuple(ts))
    assert find_row_folds(g) == () and unfold_rows(g) is g


def test_a_folded_tensor_read_elsewhere_is_left_alone() -> None:
    g = _graph([LINEAR])
    ts = list(g.tensors)  # the loss also reads the flattened tensor: it must keep its folded shape
    ts[1] = dataclasses.replace(ts[1], consumers=(1, 3))
    assert unfold_rows(dataclasses.replace(g, tensors=tuple(ts))).ops[0].target == "aten.flatten.using_ints"


class SeqFirst(nn.Module):
    """A seq-first (batch_first=False) nn.TransformerEncoder layer, then nn.MultiheadAttention directly,
    and a per-token head: the input and hidden states are ``(S, B, E)``."""

    def __init__(self, hidden: int = 16, ff: int = 32) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(hidden, 2, ff, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.att = nn.MultiheadAttention(hidden, 2)
        self.head = nn.Linear(hidden, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        h = h + self.att(h, h, h, need_weights=False)[0]
        return nn.functional.cross_entropy(self.head(h).transpose(0, 1).flatten(0, 1), y.flatten())


CLUSTER = "1xV100+1xP100"


@pytest.fixture(scope="module")
def seq_first() -> tuple[Graph, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    x, y = torch.randn(8, 256, 16), torch.randint(0, 5, (256, 8))  # (S, B, E) and labels (B, S)
    return hap.trace(SeqFirst(), (x, y)), (x, y)


def test_seq_first_attention_projects_the_unfolded_batch(seq_first) -> None:
    g, (x, y) = seq_first
    projections = [op for op in g.ops if op.target == "aten.linear.default" and "att" in op.module]
    assert len(projections) >= 4 and all(g.tensors[op.inputs[0]].ndim == 3 for op in projections)
    assert not find_row_folds(g)
    plan = hap.synthesize(g, "1xV100")  # one rank: the rewritten graph's program equals the traced one
    prog = generate(plan, g, 0, dropout=False, dtype=torch.float64)
    loss = prog.module(x.double(), y)
    loss.backward()
    ref = reference_module(g, dropout=False, dtype=torch.float64)
    want = ref(x.double(), y)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    grads = {p.name: prog.module.get_parameter(p.local_name).grad for p in prog.params if p.kind == "param"}
    for k, p in reference_params(g, ref).items():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-9, atol=1e-12)


def test_the_batch_stays_sharded_through_seq_first_attention(seq_first) -> None:
    g, _ = seq_first
    pinned = hap.synthesize(g, CLUSTER, pins={"x": hap.Shard(1)})
    assert not [i for i in pinned.program if i.communicates], "the batch needs no collective at all"
    plan = hap.synthesize(g, CLUSTER)
    assert {i.tensor: i.form for i in plan.program if i.kind == "load"}["x"] == "G1"
    assert not [i for i in plan.program if i.communicates]


@pytest.mark.slow
def test_seq_first_batch_sharded_plan_equals_one_device(seq_first) -> None:
    plan = hap.synthesize(seq_first[0], CLUSTER)
    assert {i.tensor: i.form for i in plan.program if i.kind == "load"}["x"] == "G1"
    rep = hap.verify(plan, nproc=2, steps=2, timeout=120)
    assert rep.ok, rep.text()


def test_data_parallel_baselines_split_the_seq_first_batch(seq_first) -> None:
    """dp_ev and dp_cp split the batch, which a seq-first input holds in dim 1 (dim 0 is the sequence that
    attention needs whole), and need no activation collective; batch-first inputs keep dim 0."""
    from hapnb import zoo
    from hapnb.synth.seeds import batch_dims, dp_pins
    from hapnb.tracing import zoo_graph

    g, _ = seq_first
    th = hap.theory(g)
    assert batch_dims(th) == {"x": 1, "y": 0}
    assert {k: str(v) for k, v in dp_pins(th).items() if k in ("x", "y")} == {"x": "G1", "y": "G0"}
    cmp = hap.compare(th, CLUSTER, strategies=["dp_ev", "dp_cp"])
    for name in ("dp_ev", "dp_cp"):
        plan = cmp[name].plan
        assert {i.tensor: i.form for i in plan.program if i.kind == "load"}["x"] == "G1"
        gathers = [
            i.name for i in plan.program if i.communicates and ("gather" in i.name or "to_all" in i.name)
        ]
        assert not gathers, f"{name} gathers the split batch: {gathers}"
    lm = hap.theory(zoo_graph("lm", **zoo.TINY["lm"])[0])
    assert set(batch_dims(lm).values()) == {0}


def test_the_batch_dim_judge_searches_within_a_budget(seq_first, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where several dims could be the batch, each is priced by a data-parallel search on two devices: that
    search has an expansion budget (without one, GPT-J's judge, before its cache's empty ``cat`` input was
    dropped, ran out of 24 GB), and its best program within it prices the candidate."""
    from hapnb.synth import search, seeds

    budgets = []
    run = search.Search.run

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        budgets.append(kwargs.get("max_expansions"))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(search.Search, "run", recording)
    monkeypatch.setattr(seeds, "_splits_through", lambda th, dims: False)  # every candidate is judged
    th = hap.theory(seq_first[0])
    assert seeds._choose_batch_dims(th) in seeds._candidates(th)
    assert budgets and all(b == seeds._JUDGE_EXPANSIONS for b in budgets)
