"""The real-model corpus (examples/corpus.py, issue 18): models from well-known libraries, tiny sizes.

For each model: it traces, its plan on a small mixed cluster shards the batch (the token ids / pixel
values are loaded ``G0``, or cut to ``G0`` by a free slice; or, where replicating the batch is faster at
this size, the plan with the batch pinned shards it), it has no ops without a rule
(``plan.fallback_ops``), every op on batch data has a strategy that shards it, and the plan verifies
exactly against one device on 2 CPU ranks. The two Llama variants (library loss / hand-written loss)
plan within 1 % of each other.

These are the targets the trace-time decomposition, rule discovery, batch-norm and view-rule work is
measured by; a model that fails here names the ops that hold it back.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hapnb as hap  # noqa: E402
from examples import corpus  # noqa: E402
from hapnb.plans.plan import Plan  # noqa: E402

CLUSTER = "1xV100+1xP100"
MODELS = list(corpus.CORPUS)
#: verified against one device on 2 ranks (each run ~8 s): one of each architecture family; the others
#: (llama_handloss, gpt2, bert, mixtral, convnext_t, cohere) reuse the same ops and are checked for sharding and
#: coverage above, and verify the same way (`hapnb verify --model examples.corpus:NAME ...`); gptj is verified
#: with its key/value cache on as tests/test_patterns.py's gptj
VERIFIED = ["llama", "gemma", "t5", "vit", "resnet50", "moe"]

_PLANS: dict[str, Plan] = {}


def _plan(name: str) -> Plan:
    """The tiny model's plan on :data:`CLUSTER`, synthesized once per test session."""
    if name not in _PLANS:
        _PLANS[name] = hap.synthesize(f"examples.corpus:{name}", CLUSTER, size="tiny")
    return _PLANS[name]


@pytest.mark.parametrize("name", MODELS)
def test_tiny_model_runs_and_traces(name: str) -> None:
    model, inputs = corpus.CORPUS[name](size="tiny")
    loss = model(*inputs)
    assert loss.shape == () and loss.requires_grad
    assert all(t.shape[0] == 8 for t in inputs)  # shardable over 2-4 ranks
    g = hap.trace(model, inputs)
    assert len(g.inputs) == len(inputs) and g.ops


def _sharded_plan(name: str) -> Plan:
    """The plan with the batch sharded: :func:`_plan`, or, where that replicates the batch, the plan with
    the first input pinned ``G0``."""
    plan = _plan(name)
    if corpus.batch_sharded(plan):
        return plan
    key = f"{name} G0"
    if key not in _PLANS:
        first = plan.graph.tensors[plan.graph.inputs[0]].name
        _PLANS[key] = hap.synthesize(f"examples.corpus:{name}", CLUSTER, size="tiny", pins={first: "G0"})
    return _PLANS[key]


@pytest.mark.parametrize("name", MODELS)
def test_plan_shards_the_batch(name: str) -> None:
    """The token ids / pixel values (the first input) are loaded sharded on the batch, or loaded
    replicated and cut by a free slice before use (:func:`examples.corpus.batch_sharded`). Where a program
    that replicates the batch is faster at this tiny size (the tiny MoE: tensor parallelism over experts
    of 32 wide), the plan with the batch pinned ``G0`` shards it and is not faster than that pick."""
    plan = _plan(name)
    if corpus.batch_sharded(plan):
        return
    sharded = _sharded_plan(name)
    assert corpus.batch_sharded(sharded), f"{name}: inputs loaded as {corpus.input_forms(sharded)}"
    assert sharded.simulated_s >= plan.simulated_s * (1 - 1e-9), (name, sharded.simulated_s, plan.simulated_s)


@pytest.mark.parametrize("name", MODELS)
def test_plan_has_no_fallback_ops(name: str) -> None:
    """No op of the plan is without a rule (``plan.fallback_ops``: they run replicated)."""
    plan = _plan(name)
    targets = sorted({t for _, t in plan.fallback_ops})
    assert not plan.fallback_ops, (
        f"{name}: ops without a rule ({', '.join(targets)}): {list(plan.fallback_ops)}"
    )


@pytest.mark.parametrize("name", MODELS)
def test_every_batch_op_can_shard_the_batch(name: str) -> None:
    """Every op that works on batch data has a strategy that shards it (whatever the cost model picks:
    at tiny sizes replicating can be the cheaper choice, e.g. ResNet's per-layer batch-norm statistics
    all-reduces cost more latency than its microseconds of compute; the realistic-size plans'
    replicated ops are in docs/benchmarks/models.md)."""
    bad = corpus.unshardable_batch_ops(_plan(name).graph)
    targets = sorted({t for _, t in bad})
    assert not bad, f"{name}: {len(bad)} ops cannot shard the batch ({', '.join(targets)}): {bad[:10]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", VERIFIED)
def test_plan_verifies_against_one_device(name: str) -> None:
    report = hap.verify(_sharded_plan(name), nproc=2, steps=1, timeout=180)
    assert report.ok, report.text()


def test_gemma_keeps_its_residual_stream_sharded() -> None:
    """Gemma's RMSNorm casts back with ``x.type_as(residual)``: ``type_as`` reads only the residual's dtype,
    so its rule takes it in any form; when it demanded ``I``, every layer all-gathered the batch-sharded
    residual stream and ran replicated (45 ops at real size, 3.8x slower than data parallelism)."""
    plan = _plan("gemma")
    assert corpus.batch_sharded(plan)
    assert not corpus.replicated_ops(plan), corpus.replicated_ops(plan)[:8]
    gathers = [i.name for i in plan.program if i.communicates and "gather" in i.name]
    assert not gathers, gathers


def test_llama_library_and_hand_loss_plan_alike() -> None:
    lib, hand = _plan("llama"), _plan("llama_handloss")
    assert abs(lib.cost_s - hand.cost_s) <= 0.01 * min(lib.cost_s, hand.cost_s), (lib.cost_s, hand.cost_s)


def test_llama_variants_compute_the_same_loss() -> None:
    (m1, x1), (m2, x2) = corpus.llama(), corpus.llama_handloss()
    assert float(m1(*x1)) == pytest.approx(float(m2(*x2)), rel=1e-6)


def test_batch_tensors_follow_the_batch() -> None:
    """The helper's notion of batch data: the inputs and what is computed from them with a leading
    batch (or batch x sequence) dim, never a parameter."""
    model, inputs = corpus.llama()
    g = hap.trace(model, inputs)
    batchy = corpus.batch_tensors(g)
    assert set(g.inputs) <= batchy
    assert not batchy & set(g.params)
    assert any(g.tensors[t].shape == (8, 16, 128) for t in batchy)  # the logits


def test_unshardable_batch_ops_names_an_op_without_a_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coverage helper flags an op with no rule (rule discovery off) that works on the batch."""
    import torch

    monkeypatch.setenv("HAPNB_DISCOVER", "0")

    class Bessel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.special.i0(self.fc(x)).mean()

    g = hap.trace(Bessel(), (torch.randn(8, 4),))
    assert corpus.unshardable_batch_ops(g) == [("i0", "aten.i0.default")]


@pytest.mark.parametrize("name", ["llama", "t5"])  # rotary .to(device), SDPA's view; an arange's device
def test_programs_traced_on_the_cpu_run_on_another_device(name: str) -> None:
    """A one-device plan's program and the single-device program traced on the CPU run on a device whose kernels lay
    their results out otherwise (the meta device, as a GPU: SDPA's output strides differ, so a traced
    ``view`` after its transpose fails there) and make every tensor there (traced device arguments)."""
    from hapnb.runtime.codegen import generate
    from hapnb.runtime.reference import reference_module

    _, inputs = corpus.CORPUS[name](size="tiny")
    plan = hap.synthesize(f"examples.corpus:{name}", "1xV100", size="tiny", check_memory=False)
    meta = tuple(x.to("meta") for x in inputs)
    assert generate(plan, plan.graph, 0).module.to("meta")(*meta).device.type == "meta"
    assert reference_module(plan.graph).to("meta")(*meta).device.type == "meta"
