"""Code generation: per-rank fx programs lint, carry exactly the plan's collectives, slice weights and
inputs as the plan says, and (on one device, where collectives are identities) compute the same loss
and gradients as the single-device program. Multi-rank equivalence runs in tests/test_equivalence.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
import synthetic
import torch
from torch import nn

from hapnb import zoo
from hapnb.hardware.cluster import Cluster
from hapnb.ir.forms import parse_form, shard_offsets
from hapnb.plans.plan import Instruction, Plan
from hapnb.plans.synthesis import synthesize
from hapnb.runtime.codegen import generate
from hapnb.runtime.program import COLLECTIVE_FUNCTIONS, CodegenError, count_collectives, program_weights
from hapnb.runtime.reference import reference_module, reference_params
from hapnb.triples import theory


def _plan(name: str, cluster: str, ratios=None, **kw) -> Plan:
    opts = {**zoo.TINY[name], **kw}
    return synthesize(name, cluster, ratios=ratios, **opts)


@pytest.fixture(scope="module")
def mlp3() -> Plan:
    return _plan("mlp", "3xV100", ratios=[0.5, 0.0, 0.5])


@pytest.fixture(scope="module")
def gpt2() -> Plan:
    return _plan("gpt", "2xV100", ratios=[0.7, 0.3])


def _communicating(plan: Plan) -> int:
    return sum(1 for ins in plan.program if ins.communicates)


@pytest.mark.parametrize("fixture", ["mlp3", "gpt2"])
def test_programs_lint_and_carry_the_plans_collectives(fixture: str, request: pytest.FixtureRequest) -> None:
    plan = request.getfixturevalue(fixture)
    for rank in range(plan.cluster.n):
        prog = generate(plan, plan.graph, rank, dropout=False)
        prog.module.graph.lint()
        assert count_collectives(prog.module) == _communicating(plan)
        # the generated source is plain Python: it compiles, and it calls each collective the plan has
        compile(prog.code, f"rank{rank}", "exec")
        calls = re.findall(r"= hapnb_runtime_collectives_(\w+)\(", prog.code)
        assert len(calls) >= _communicating(plan) > 0
        assert "all_gather" in calls or "reduce_scatter" in calls or "all_reduce" in calls
        assert prog.rank == rank and prog.n == plan.cluster.n


def test_weights_are_sliced_with_the_plans_lengths(mlp3: Plan) -> None:
    weights = program_weights(mlp3.graph)
    loads = {i.tensor: parse_form(i.form) for i in mlp3.program if i.kind == "load"}
    for rank in range(3):
        prog = generate(mlp3, mlp3.graph, rank)
        params = dict(prog.module.named_parameters())
        for p in prog.params:
            local = params[p.local_name]
            f = loads[p.name]
            if f.kind == "G":
                ls = mlp3.lengths_of(p.name, f.dim)
                assert p.sharded and p.dim == f.dim and p.lengths == ls
                assert p.start == shard_offsets(ls)[rank] and local.shape[f.dim] == ls[rank]
                want = weights[p.name].narrow(f.dim, p.start, ls[rank])
            else:
                assert not p.sharded
                want = weights[p.name]
            assert torch.equal(local.detach(), want)
    # rank 1 has ratio 0: its sharded weights are empty
    prog1 = generate(mlp3, mlp3.graph, 1)
    assert any(p.sharded and p.length == 0 for p in prog1.params)


def test_local_inputs_match_batch_slice() -> None:
    plan = _plan("mlp", "2xV100", ratios=[0.75, 0.25], pins={"x": "G0", "y": "G0"})
    _, inputs, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    for rank in range(2):
        prog = generate(plan, plan.graph, rank, inputs="local")
        sl = plan.batch_slice(rank)
        local = prog.local_inputs(*inputs)
        for full, part in zip(inputs, local):
            assert torch.equal(part, full[sl])
        assert count_collectives(prog.module) == _communicating(plan)


def _one_device_plan(name: str, **kw) -> Plan:
    return _plan(name, "1xV100", **kw)


@pytest.mark.parametrize("name", ["mlp", "gpt", "vgg19"])
def test_one_rank_program_equals_single_device(name: str) -> None:
    """With one rank every collective is an identity, so loss and gradients must equal the original."""
    plan = _one_device_plan(name)
    _, inputs, _ = zoo.build(name, devices=1, **zoo.TINY[name])
    prog = generate(plan, plan.graph, 0, dropout=False, dtype=torch.float64)
    xs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    loss = prog.module(*xs)
    loss.backward()
    ref = reference_module(plan.graph, dropout=False, dtype=torch.float64)
    rl = ref(*xs)
    rl.backward()
    assert torch.allclose(loss, rl, rtol=1e-12, atol=1e-12)
    rparams = reference_params(plan.graph, ref)
    grads = {p.name: prog.module.get_parameter(p.local_name).grad for p in prog.params if p.kind == "param"}
    for k, p in rparams.items():
        assert torch.allclose(grads[k], p.grad, rtol=1e-9, atol=1e-12), k


def test_reference_module_does_not_touch_the_traced_weights(mlp3: Plan) -> None:
    before = {k: v.clone() for k, v in program_weights(mlp3.graph).items()}
    ref = reference_module(mlp3.graph, dtype="float64")
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    after = program_weights(mlp3.graph)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dropout_off_removes_randomness() -> None:
    plan = _one_device_plan("bert")  # dropout layers and attention dropout
    _, inputs, _ = zoo.build("bert", devices=1, **zoo.TINY["bert"])
    prog = generate(plan, plan.graph, 0, dropout=False)
    a, b = prog.module(*inputs), prog.module(*inputs)
    assert torch.equal(a, b)
    targets = {str(n.target) for n in prog.module.graph.nodes if n.op == "call_function"}
    assert not any("dropout.default" in t and "scaled" not in t for t in targets)
    with_dropout = generate(plan, plan.graph, 0, dropout=True)
    assert any("dropout" in str(n.target) for n in with_dropout.module.graph.nodes)


# ----------------------------------------------------------------------------- synthetic graphs


def _synthetic_local(graph, op, strategy, ctx):
    """Localizer for tests/synthetic.py ops (mm, relu, add, sum): every strategy runs the plain op."""
    from hapnb.ir.graph import TensorArg
    from hapnb.rules import LocalCall

    fn = {"mm": torch.mm, "relu": torch.relu, "add": torch.add, "sum": torch.sum}[op.target]
    return LocalCall(fn, tuple(TensorArg(i) for i in range(len(op.inputs))))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_synthetic_programs(seed: int) -> None:
    g = synthetic.random_graph(seed)
    th = theory(g, synthetic.strategies)
    weights = {g.tensors[t].name: torch.randn(g.tensors[t].shape, dtype=torch.float64) for t in g.params}
    plan = synthesize(th, Cluster.parse("3xV100"), ratios=[0.5, 0.2, 0.3], check_memory=False)
    for rank in range(3):
        prog = generate(
            plan, g, rank, weights=weights, strategies=synthetic.strategies, localize=_synthetic_local
        )
        prog.module.graph.lint()
        assert count_collectives(prog.module) == _communicating(plan)
    # a one-device plan runs in this process and equals the plain computation
    plan1 = synthesize(th, Cluster.parse("1xV100"), check_memory=False)
    prog = generate(plan1, g, 0, weights=weights, strategies=synthetic.strategies, localize=_synthetic_local)
    x = torch.randn(g.tensors[g.inputs[0]].shape, dtype=torch.float64)
    env = {g.inputs[0]: x, **{t: weights[g.tensors[t].name] for t in g.params}}
    for op in g.ops:
        fn = {"mm": torch.mm, "relu": torch.relu, "add": torch.add, "sum": torch.sum}[op.target]
        env[op.outputs[0]] = fn(*(env[t] for t in op.inputs))
    assert torch.allclose(prog.module(x), env[g.loss])


def test_clear_errors(mlp3: Plan) -> None:
    bad_fp = dataclasses.replace(mlp3, graph_fingerprint="0" * 16)
    with pytest.raises(CodegenError, match="made for graph"):
        generate(bad_fp, mlp3.graph, 0)
    # drop the load of the first weight: the op that needs it names the missing property
    first = next(i for i, ins in enumerate(mlp3.program) if ins.kind == "load" and ins.tensor != "x")
    broken = dataclasses.replace(mlp3, program=mlp3.program[:first] + mlp3.program[first + 1 :])
    with pytest.raises(CodegenError, match=r"needs layers\.0\.weight:G0"):
        generate(broken, mlp3.graph, 0)
    odd = Instruction("collective", "teleport", 0, tensor="linear", src="G1", form="I")
    with pytest.raises(CodegenError, match="unknown collective"):
        generate(
            dataclasses.replace(mlp3, program=mlp3.program[:4] + (odd,) + mlp3.program[4:]), mlp3.graph, 0
        )
    with pytest.raises(ValueError, match="out of range"):
        generate(mlp3, mlp3.graph, 3)
    # an op whose G tensors are cut differently (e.g. two ratio segments meeting without a reshard)
    recut = tuple((t, d, (20, 12, 0) if t == "relu" else ls) for t, d, ls in mlp3.lengths)
    with pytest.raises(CodegenError, match="cut alike"):
        generate(dataclasses.replace(mlp3, lengths=recut), mlp3.graph, 0)


def test_collective_functions_are_the_communicating_ones() -> None:
    from hapnb.runtime import collectives as C

    assert set(COLLECTIVE_FUNCTIONS) == {
        C.all_gather,
        C.reduce_scatter,
        C.all_reduce,
        C.all_to_all,
        C.reshard,
    }


def test_tied_parameter_is_one_local_parameter() -> None:
    """Weight tying (examples.factories:tied_lm): the two names of one parameter map to one local
    parameter on every rank, and its gradient is the sum over both uses, as in eager PyTorch."""
    from examples.factories import tied_lm

    torch.manual_seed(0)
    model, inputs = tied_lm()
    plan = synthesize(model, "1xV100", example_inputs=inputs)
    g = plan.graph
    prog = generate(plan, g, 0, dropout=False, dtype=torch.float64)
    local = dict(prog.module.named_parameters())
    emb, head = prog.param("embed.weight"), prog.param("head.weight")
    assert emb.local_name == head.local_name and emb.local_name in local
    assert all(p.local_name in local for p in prog.params if p.kind == "param")
    assert len(local) == len({p.local_name for p in prog.params if p.kind == "param"})
    # eager PyTorch: one parameter, its gradient summed over the embedding and the output projection
    model.double().zero_grad()
    model(*inputs).backward()
    want = model.embed.weight.grad
    ref = reference_module(g, dtype=torch.float64)
    rparams = reference_params(g, ref)
    assert rparams["embed.weight"] is rparams["head.weight"]
    ref(*inputs).backward()
    torch.testing.assert_close(rparams["head.weight"].grad, want)
    prog.module(*inputs).backward()
    torch.testing.assert_close(local[emb.local_name].grad, want)


class _Positions(nn.Module):
    """Tensors the trace makes on a fixed device: ``arange(..., device=...)`` and ``.to(device)`` of a
    plain tensor attribute (a lifted constant on a submodule)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.pos = nn.Embedding(6, 8)
        self.inner = nn.Module()
        self.inner.freq = torch.linspace(0.5, 1.5, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = torch.arange(ids.shape[1], device=ids.device)
        h = self.emb(ids) + self.pos(p) * self.inner.freq.to(ids.device)
        return (h * h).mean()


def test_programs_make_their_tensors_where_they_are_moved() -> None:
    """A program traced on the CPU and moved with ``.to(device)`` makes its tensors on that device (a
    traced device argument reads the program's own device), and its constants move with it (checked on
    the meta device: a tensor left on the CPU fails there as it would on a GPU)."""
    torch.manual_seed(0)
    model, ids = _Positions(), torch.randint(0, 16, (4, 6))
    plan = synthesize(model, "1xV100", example_inputs=(ids,), check_memory=False)
    prog = generate(plan, plan.graph, 0)
    assert prog.module(ids).item() == pytest.approx(model(ids).item(), rel=1e-6)
    assert prog.module.to("meta")(ids.to("meta")).device.type == "meta"
    ref = reference_module(plan.graph)
    assert ref(ids).item() == pytest.approx(model(ids).item(), rel=1e-6)
    assert ref.to("meta")(ids.to("meta")).device.type == "meta"
    assert sorted(ref.state_dict()) == ["model.emb.weight", "model.pos.weight"]  # no lifted constants


def test_the_graph_fingerprint_ignores_the_tracing_device() -> None:
    """A plan made from a model on the CPU fits the same model traced on a GPU."""
    from hapnb.ir.graph import fingerprint

    model, ids = _Positions(), torch.randint(0, 16, (4, 6))
    g = synthesize(model, "1xV100", example_inputs=(ids,), check_memory=False).graph
    moved = [
        dataclasses.replace(
            op,
            kwargs=tuple(
                (k, torch.device("cuda", 0) if isinstance(v, torch.device) else v) for k, v in op.kwargs
            ),
        )
        for op in g.ops
    ]
    assert any(dict(op.kwargs).get("device") is not None for op in g.ops)
    assert fingerprint(g.tensors, moved) == g.fingerprint
