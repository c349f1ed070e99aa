"""Hugging Face architectures beyond the corpus (issue 18): does hapnb take them as a new user would?

Each architecture below is built from its library config at a tiny size (2 layers, width 32, batch 8,
16 tokens or 32 x 32 images), with the library's own loss (``labels=``), and then:

* traced (:func:`hapnb.trace`);
* checked for ops that cannot shard the batch (:func:`examples.corpus.unshardable_batch_ops`);
* planned on ``1xV100+1xP100``, with ops without a rule listed (``plan.fallback_ops``), and checked for a
  sharded batch (:func:`examples.corpus.batch_sharded`; where the tiny plan replicates the batch, the plan
  with the first input pinned ``G0``);
* verified against one device on 2 CPU ranks (``--verify``).

``--real`` plans the decoder LMs at the corpus's realistic widths (hidden 1024, 8 layers, 16 heads / 4 kv
heads, vocab 32000, seq 512, batch 64) and the vision models at their library's default sizes (224 x 224,
batch 64) on ``2xV100+6xP100`` (``--cluster`` for another): synthesis time, cost, proof, and the
data-parallel and tensor-parallel baselines (:func:`hapnb.baselines`) on both clocks.

    python benchmarks/architectures.py --verify --out docs/benchmarks/architectures.json --md docs/models.md
    python benchmarks/architectures.py --render --out docs/benchmarks/architectures.json --md docs/models.md
    python benchmarks/architectures.py --real [--only gemma2]... [--cluster h100x8]

None of these is in the test suite (the corpus's families are: tests/test_corpus.py); this is the wider
net, rerun when the tracer or the rules change. Results: docs/models.md, "Which architectures work".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import hapnb as hap  # noqa: E402
from examples import corpus  # noqa: E402

BATCH, SEQ, VOCAB = 8, 16, 128
TINY = "1xV100+1xP100"
REAL = "2xV100+6xP100"
#: the tiny widths every text config gets (a config's ``attribute_map`` takes these names)
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64}  # fmt: skip
DECODER = {**TEXT, "num_key_value_heads": 2, "use_cache": False, "attn_implementation": "sdpa"}
EAGER = {"attn_implementation": "eager"}  # the library has no SDPA path for these

Factory = Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _model(config: str, model: str, settings: dict[str, Any]) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    settings = {k: v for k, v in settings.items() if v is not None}  # None: leave the library's default out
    return getattr(transformers, model)(getattr(transformers, config)(**settings))


def causal_lm(config: str, model: str, **settings: Any) -> Factory:
    """``model(input_ids=ids, labels=ids).loss`` of a decoder LM (the library shifts the labels)."""

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        m = _model(config, model, {**DECODER, **settings})
        return corpus._finish(m, model, lambda m, x: m(input_ids=x, labels=x).loss, corpus.TokensLoss), (
            _ids(),
        )

    return build


def classifier(config: str, model: str, **settings: Any) -> Factory:
    """A sequence classifier's loss over 3 labels."""

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        m = _model(config, model, {**TEXT, "num_labels": 3, **settings})
        labels = torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(2))
        call = lambda m, x, y: m(input_ids=x, labels=y).loss  # noqa: E731
        return corpus._finish(m, model, call, corpus.TokensLabelsLoss), (_ids(), labels)

    return build


def token_loss(config: str, model: str, **settings: Any) -> Factory:
    """A masked LM's or a seq2seq model's loss with token labels."""

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        m = _model(config, model, {**TEXT, **settings})
        call = lambda m, x, y: m(input_ids=x, labels=y).loss  # noqa: E731
        return corpus._finish(m, model, call, corpus.TokensLabelsLoss), (_ids(), _ids(2))

    return build


def image_classifier(config: str, model: str, image: int = 32, **settings: Any) -> Factory:
    """An image classifier's loss over 5 labels."""

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        m = _model(config, model, {"num_labels": 5, **settings})
        pixels, labels = corpus._images(BATCH, image, 5, 0)
        call = lambda m, x, y: m(pixel_values=x, labels=y).loss  # noqa: E731
        return corpus._finish(m, model, call, corpus.ImagesLoss), (pixels, labels)

    return build


_SEQ2SEQ = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "use_cache": False,
            "pad_token_id": 1, "decoder_start_token_id": 2}  # fmt: skip
_CNN = {"hidden_sizes": [8, 16], "depths": [1, 1]}

#: name -> factory; the decoder LMs also run at realistic size (``--real``)
# fmt: off
ARCHITECTURES: dict[str, Factory] = {
    "qwen3": causal_lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "gemma2": causal_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, **EAGER),
    "gemma3": causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8),
    "olmo2": causal_lm("Olmo2Config", "Olmo2ForCausalLM"),
    "olmoe": causal_lm("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2),
    "stablelm": causal_lm("StableLmConfig", "StableLmForCausalLM"),
    "starcoder2": causal_lm("Starcoder2Config", "Starcoder2ForCausalLM"),
    "granite": causal_lm("GraniteConfig", "GraniteForCausalLM"),
    "nemotron": causal_lm("NemotronConfig", "NemotronForCausalLM", head_dim=8),
    "gpt_bigcode": causal_lm("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=32, n_layer=2, n_head=4),
    "bloom": causal_lm("BloomConfig", "BloomForCausalLM", n_layer=2, n_head=4, **EAGER),
    "codegen": causal_lm("CodeGenConfig", "CodeGenForCausalLM", n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                         n_ctx=64, n_positions=64),
    "xglm": causal_lm("XGLMConfig", "XGLMForCausalLM", d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                      **EAGER),
    # the library's default problem_type branches on (labels >= 0).nonzero(): docs/models.md
    "deberta_v2": classifier("DebertaV2Config", "DebertaV2ForSequenceClassification",
                             problem_type="single_label_classification"),
    "deberta_v2_mlm": token_loss("DebertaV2Config", "DebertaV2ForMaskedLM"),
    "electra": classifier("ElectraConfig", "ElectraForSequenceClassification", embedding_size=32),
    "albert": classifier("AlbertConfig", "AlbertForSequenceClassification", embedding_size=16),
    "funnel": classifier("FunnelConfig", "FunnelForSequenceClassification", num_hidden_layers=None,
                         block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64),
    "mpnet": token_loss("MPNetConfig", "MPNetForMaskedLM"),
    "roformer": token_loss("RoFormerConfig", "RoFormerForMaskedLM"),
    "xlm_roberta": token_loss("XLMRobertaConfig", "XLMRobertaForMaskedLM"),
    "pegasus": token_loss("PegasusConfig", "PegasusForConditionalGeneration", **_SEQ2SEQ),
    "marian": token_loss("MarianConfig", "MarianMTModel", **_SEQ2SEQ),
    "mbart": token_loss("MBartConfig", "MBartForConditionalGeneration", **_SEQ2SEQ),
    "convnextv2": image_classifier("ConvNextV2Config", "ConvNextV2ForImageClassification", num_stages=2, **_CNN),
    "regnet": image_classifier("RegNetConfig", "RegNetForImageClassification", embedding_size=8, groups_width=4,
                               **_CNN),
    "resnet": image_classifier("ResNetConfig", "ResNetForImageClassification", embedding_size=8, **_CNN),
    "efficientnet": image_classifier("EfficientNetConfig", "EfficientNetForImageClassification", image_size=32,
                                     width_coefficient=0.25, depth_coefficient=0.2, hidden_dim=320),
    "dinov2": image_classifier("Dinov2Config", "Dinov2ForImageClassification", hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, image_size=32, patch_size=8),
    "mobilevit": image_classifier("MobileViTConfig", "MobileViTForImageClassification", image_size=32,
                                  hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 16, 16, 16, 32]),
    "levit": image_classifier("LevitConfig", "LevitForImageClassification", image=224),
    "poolformer": image_classifier("PoolFormerConfig", "PoolFormerForImageClassification",
                                   hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1]),
}
# fmt: on
#: the decoder LMs at the corpus's realistic widths (``--real``): the extra settings beyond the corpus's
REAL_LMS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64, "sliding_window": 256, **EAGER}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 64, "sliding_window": 256}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
}


#: the vision models at realistic size (``--real``): the library's default config (ResNet-50, RegNetY-040,
#: MobileViT-S, ConvNeXt V2-T, PoolFormer-S12, LeViT-128S, DINOv2-B), EfficientNet-B0, 224 x 224 images,
#: 1000 classes, batch 64
REAL_VISION = {
    "resnet": ("ResNetConfig", "ResNetForImageClassification", {}),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", {}),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", {"image_size": 224}),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2ForImageClassification", {}),
    "poolformer": ("PoolFormerConfig", "PoolFormerForImageClassification", {}),
    "levit": ("LevitConfig", "LevitForImageClassification", {}),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", {"image_size": 224, "patch_size": 14}),
    "efficientnet": ("EfficientNetConfig", "EfficientNetForImageClassification",
                     {"image_size": 224, "width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280}),
}  # fmt: skip


def tiny(name: str, verify: bool) -> dict[str, Any]:
    """One architecture at tiny size: the record of what worked (``stage`` is where it stopped)."""
    rec: dict[str, Any] = {"model": name, "stage": "build"}
    t0 = time.perf_counter()
    try:
        model, inputs = ARCHITECTURES[name]()
        rec["stage"] = "trace"
        g = hap.trace(model, inputs, name=name)
        rec["ops"] = len(g.ops)
        rec["unshardable"] = sorted({t for _, t in corpus.unshardable_batch_ops(g)})
        rec["stage"] = "plan"
        plan = hap.synthesize(g, TINY)
        rec["fallback"] = sorted({t for _, t in plan.fallback_ops})
        rec["batch_sharded"] = corpus.batch_sharded(plan)
        if not rec["batch_sharded"]:  # the tiny plan replicates: the plan with the batch pinned split
            plan = hap.synthesize(g, TINY, pins={g.tensors[g.inputs[0]].name: "G0"})
            rec["batch_sharded_pinned"] = corpus.batch_sharded(plan)
        rec["optimal"] = plan.stats.get("optimal")
        if verify:
            rec["stage"] = "verify"
            report = hap.verify(plan, nproc=2, steps=1, timeout=180, model=model, example_inputs=inputs)
            rec["verified"] = report.ok
        rec["stage"] = "done"
    except Exception as exc:  # noqa: BLE001 - recorded: the point is to see what fails
        rec["error"] = f"{type(exc).__name__}: {exc}"[:800]
        rec["where"] = traceback.format_exc(limit=-3)[-800:]
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def real(name: str, cluster: str = REAL) -> dict[str, Any]:
    """A decoder LM at the corpus's realistic widths (:data:`REAL_LMS`) or a vision model at its default size
    (:data:`REAL_VISION`), planned on ``cluster``, with its baselines."""
    torch.set_num_threads(1)
    if name in REAL_LMS:
        config, model, extra = REAL_LMS[name]
        m = _model(config, model, {**corpus._decoder_style("real", 512), **extra})
        call = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
        wrapped, inputs = (
            corpus._finish(m, model, call, corpus.TokensLoss),
            (corpus._tokens(64, 512, 32000, 0),),
        )
    else:
        config, model, extra = REAL_VISION[name]
        m = _model(config, model, {"num_labels": 1000, **extra})
        call = lambda m, x, y: m(pixel_values=x, labels=y).loss  # noqa: E731
        wrapped, inputs = corpus._finish(m, model, call, corpus.ImagesLoss), corpus._images(64, 224, 1000, 0)
    t0 = time.perf_counter()
    g = hap.trace(wrapped, inputs, name=name)
    trace_s = time.perf_counter() - t0
    del wrapped, m
    t0 = time.perf_counter()
    plan = hap.synthesize(g, cluster)
    synthesis_s = time.perf_counter() - t0
    base = hap.baselines(g, cluster)
    return {
        "model": name, "size": "real", "cluster": cluster, "ops": len(g.ops), "trace_s": round(trace_s, 1),
        "synthesis_s": round(synthesis_s, 2), "cost_ms": round(plan.cost_s * 1e3, 1),
        "simulated_ms": round(plan.simulated_s * 1e3, 1), "optimal": plan.stats.get("optimal"),
        "gap": plan.stats.get("gap"), "expansions": plan.stats.get("expansions"), "chosen": plan.stats.get("chosen"),
        "fallback": len(plan.fallback_ops), "batch_sharded": corpus.batch_sharded(plan),
        "replicated_ops": len(corpus.replicated_ops(plan)),
        "baselines": {k: [round(b.cost_s * 1e3, 1), round(b.simulated_s * 1e3, 1)] for k, b in base.items()},
        "unavailable": dict(base.unavailable),
    }  # fmt: skip


def _mark(value: Any) -> str:
    return {True: "yes", False: "**no**", None: "-"}.get(value, str(value))


def table(records: list[dict[str, Any]]) -> str:
    """The tiny-size records as a markdown table (one row per architecture)."""
    rows = [
        "| architecture | ops | ops without a rule | ops that cannot shard the batch | batch sharded | proven (tiny) | "
        "verified (2 ranks) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            rows.append(f"| {r['model']} | stopped at {r['stage']}: {r['error'][:160]} | | | | | |")
            continue
        sharded = _mark(r.get("batch_sharded"))
        if r.get("batch_sharded_pinned") is not None:
            sharded += f" (pinned: {_mark(r['batch_sharded_pinned'])})"
        rows.append(
            f"| {r['model']} | {r.get('ops', '')} | {', '.join(r.get('fallback', [])) or '0'} | "
            f"{', '.join(r.get('unshardable', [])) or '0'} | {sharded} | {_mark(r.get('optimal'))} | "
            f"{_mark(r.get('verified'))} |"
        )
    return "\n".join(rows)


def real_table(records: list[dict[str, Any]]) -> str:
    """The realistic-size records (one cluster) as a markdown table: the plan against its baselines."""
    rows = [
        "| model | ops | HAP stage / sim (ms) | dp_ev stage / sim (ms) | best baseline (sim, ms) | picked | "
        "proven | no rule | synthesis (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        base = r.get("baselines", {})
        dp = base.get("dp_ev")
        best = min(base.items(), key=lambda kv: kv[1][1]) if base else None
        proven = "yes" if r["optimal"] else f"no, gap {100 * (r.get('gap') or 0):.1f} %"
        rows.append(
            f"| {r['model']} | {r.get('ops', '')} | {r['cost_ms']} / {r['simulated_ms']} | "
            f"{f'{dp[0]} / {dp[1]}' if dp else '-'} | {f'{best[0]} {best[1][1]}' if best else '-'} | "
            f"{r.get('chosen', '')} | {proven} | {r['fallback']} | {r['synthesis_s']} |"
        )
    return "\n".join(rows)


def write_table(path: Path, records: list[dict[str, Any]], real: bool = False) -> None:
    """Replace the text between the ``architectures-table`` markers of ``path`` with :func:`table`, or
    (``real``) between the ``real-table CLUSTER`` markers with :func:`real_table`."""
    text = path.read_text()
    tag = f"real-table {records[0]['cluster']}" if real else "architectures-table"
    start, end = f"<!-- {tag} -->", f"<!-- /{tag} -->"
    a, b = text.index(start) + len(start), text.index(end)
    body = real_table(records) if real else table(records)
    path.write_text(text[:a] + "\n" + body + "\n" + text[b:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run only this architecture (repeatable)")
    ap.add_argument("--verify", action="store_true", help="verify each tiny plan on 2 CPU ranks")
    ap.add_argument("--real", action="store_true", help="the LMs and vision models at realistic size")
    ap.add_argument("--cluster", default=REAL, help="the cluster of --real (default %(default)s)")
    ap.add_argument("--out", help="write the records as JSON here")
    ap.add_argument(
        "--md", help="rewrite this markdown file's table (tiny size, or --real's for its cluster)"
    )
    ap.add_argument("--render", action="store_true", help="only rewrite --md from the --out file, no runs")
    args = ap.parse_args(argv)
    if args.render:
        write_table(Path(args.md), json.loads(Path(args.out).read_text()), args.real)
        return 0
    names = args.only or list({**REAL_LMS, **REAL_VISION} if args.real else ARCHITECTURES)
    records = []
    for name in names:
        rec = real(name, args.cluster) if args.real else tiny(name, args.verify)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    if args.md:
        write_table(Path(args.md), records, args.real)
    failed = [r["model"] for r in records if "error" in r or r.get("verified") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
