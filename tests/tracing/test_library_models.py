"""Library model code beyond the corpus, traced at tiny sizes: the way each library writes a layer reaches
the ops the rules and bounds know (the full checks, plans verified on 2 ranks, are in
docs/benchmarks/models.md, "Checked ... beyond the corpus")."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hapnb as hap  # noqa: E402
from examples.corpus import ImagesLoss, TokensLoss, _finish, _images, _tokens  # noqa: E402


def test_mobilenet_v2_in_place_dropout_is_a_dropout() -> None:
    """HF MobileNetV2's classifier dropout is ``nn.Dropout(inplace=True)``: traced as ``native_dropout``
    (verification and ``eval()`` switch it off), not as a ``bernoulli`` mask."""
    torch.manual_seed(0)
    cfg = transformers.MobileNetV2Config(num_labels=10, image_size=32, depth_multiplier=0.35)
    m = transformers.MobileNetV2ForImageClassification(cfg)
    px, lab = _images(4, 32, 10, 0)
    model = _finish(m, "mobilenet_v2", lambda m, px, lab: m(pixel_values=px, labels=lab).loss, ImagesLoss)
    targets = [op.target for op in hap.trace(model, (px, lab)).ops]
    assert "aten.native_dropout.default" in targets
    assert not any("bernoulli" in t for t in targets)


def test_falcon_linear_layers_are_linear_ops() -> None:
    """Falcon's ``FalconLinear`` computes ``x @ self.weight.T``: traced as ``linear`` with the weight."""
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    m = transformers.FalconForCausalLM(cfg)
    ids = _tokens(4, 8, 64, 0)
    model = _finish(m, "falcon", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss)
    g = hap.trace(model, (ids,))
    weights = {g.tensors[op.inputs[1]].name for op in g.ops if op.target == "aten.linear.default"}
    assert {n for n in weights if "h.0." in n} == {
        f"model.transformer.h.0.{p}.weight"
        for p in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                  "mlp.dense_4h_to_h")
    }  # fmt: skip
    assert "aten.matmul.default" not in [op.target for op in g.ops if "dense" in (op.module or "")]


def _qwen2_moe(**kw: str) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, use_cache=False, attn_implementation="sdpa", **kw,
    )  # fmt: skip
    ids = _tokens(4, 8, 64, 0)
    m = transformers.Qwen2MoeForCausalLM(cfg)
    return _finish(m, "qwen2_moe", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss), (ids,)


def test_a_sort_over_all_tokens_is_reported_as_a_batch_blocker() -> None:
    """HF Qwen2-MoE's default expert dispatch sorts every token by its expert: no strategy shards that
    sort, so the batch is replicated there whatever the cluster. The coverage report names it, where, and
    what to do; with ``batched_mm`` nothing blocks the batch."""
    from hapnb.triples import coverage

    cov = coverage(hap.theory(hap.trace(*_qwen2_moe())))
    assert "aten.sort.default" in {r.target for r in cov.batch_blockers}
    assert "model.model.layers.0.mlp.experts" in {r.module for r in cov.batch_blockers}
    assert "experts_implementation='batched_mm'" in cov.summary()
    assert ["aten.sort.default" == t for _, t, _ in cov.to_json()["batch_blockers"]].count(True) == 1
    batched = coverage(hap.theory(hap.trace(*_qwen2_moe(experts_implementation="batched_mm"))))
    assert not batched.batch_blockers and "batch_blockers" in batched.to_json()
