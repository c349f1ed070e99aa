"""The real-model corpus: models from well-known libraries, built from configs, as hapnb factories.

Each factory follows the convention of :mod:`examples.factories`: it takes keyword options and returns
``(model, example_inputs)`` where ``model(*example_inputs)`` is the scalar training loss. Every factory
takes ``size="tiny"|"real"`` (tiny: a few channels, 2 layers, seq 16, batch 8, for ``hapnb.verify`` on
CPU ranks; real: the widths the issue names, for planning at realistic size), ``batch`` / ``seq`` (or
``image``) overrides and ``seed``. Nothing is downloaded: every model is made from its config with
seeded random weights (no ``from_pretrained``); dropout (and drop-path) is off so that a run is a
deterministic function of the weights and the batch, which ``hapnb.verify`` needs.

Plan one from the command line (factory options go through ``--set KEY=VALUE``; ``--batch``/``--seq``
are passed too)::

    hapnb plan --model examples.corpus:llama --set size=real --cluster 2xV100+6xP100 --json

======================  ============================================================================
factory                 model
======================  ============================================================================
``llama``               HF ``LlamaForCausalLM`` (GQA, RoPE, RMSNorm, SwiGLU), the library's own loss
``llama_handloss``      the same model returning logits, next-token cross-entropy written by hand
``gemma``               HF ``GemmaForCausalLM`` (tied, scaled embeddings; ``(1 + w)`` RMSNorm, ``type_as``)
``t5``                  HF ``T5ForConditionalGeneration`` with ``labels=`` (relative position bias)
``vit``                 HF ``ViTForImageClassification`` with ``labels=``
``resnet50``            HF ``ResNetForImageClassification`` (bottleneck [3, 4, 6, 3]), train-mode BN
``convnext_t``          HF ``ConvNextForImageClassification`` (ConvNeXt-T: [3, 3, 9, 3] x [96..768])
``moe``                 a top-2 MoE LM with batched (einsum) experts, written here in torch.nn
``mixtral``             HF ``MixtralForCausalLM`` with ``experts_implementation="batched_mm"``
``gpt2``                HF ``GPT2LMHeadModel`` with ``labels=``
``bert``                HF ``BertForMaskedLM`` with ``labels=`` (fixed mask pattern, -100 elsewhere)
``gptj``                HF ``GPTJForCausalLM`` with ``labels=`` (parallel attention + MLP, partial rotary)
``cohere``              HF ``CohereForCausalLM`` with ``labels=`` (parallel block, SwiGLU, tied head)
======================  ============================================================================

>>> model, inputs = llama()
>>> model(*inputs).shape
torch.Size([])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CORPUS",
    "ImagesLoss",
    "LossOf",
    "TokensLabelsLoss",
    "TokensLoss",
    "batch_sharded",
    "batch_tensors",
    "bert",
    "cohere",
    "convnext_t",
    "gpt2",
    "gptj",
    "input_forms",
    "llama",
    "llama_handloss",
    "mixtral",
    "moe",
    "replicated_ops",
    "resnet50",
    "t5",
    "unshardable_batch_ops",
    "vit",
]

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]

#: the sizes every factory takes
SIZES = ("tiny", "real")


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")


def _pick(size: str, tiny: Any, real: Any) -> Any:
    _check_size(size)
    return tiny if size == "tiny" else real


class LossOf(nn.Module):
    """Wrap a library model so that ``forward(*inputs)`` is the scalar loss.

    ``call(model, *inputs)`` computes the loss from the wrapped model (stored as ``self.model``, so
    parameter names read ``model.<library names>``).
    """

    def __init__(self, model: nn.Module, call: Callable[..., torch.Tensor], name: str) -> None:
        super().__init__()
        self.model = model
        self._call = call
        self._name = name

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._call(self.model, *inputs)

    def extra_repr(self) -> str:
        return self._name


def _tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def _images(batch: int, image: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    pixels = torch.randn(batch, 3, image, image, generator=gen)
    labels = torch.randint(0, classes, (batch,), generator=gen)
    return pixels, labels


class TokensLoss(LossOf):
    """:class:`LossOf` for models fed token ids only (the graph input is named ``input_ids``)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._call(self.model, input_ids)


class TokensLabelsLoss(LossOf):
    """:class:`LossOf` for models fed token ids and labels (graph inputs ``input_ids``, ``labels``)."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._call(self.model, input_ids, labels)


class ImagesLoss(LossOf):
    """:class:`LossOf` for image classifiers (graph inputs ``pixel_values``, ``labels``)."""

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._call(self.model, pixel_values, labels)


def _finish(model: nn.Module, name: str, call: Callable[..., torch.Tensor], kind: type[LossOf]) -> LossOf:
    wrapped = kind(model, call, name)
    wrapped.train()
    return wrapped


# ============================================================================ language models (HF)


def _decoder_style(size: str, seq: int) -> dict[str, Any]:
    """The config keywords the Llama-style decoder configs (Llama, Gemma, Cohere, Mixtral) share: the widths
    of ``size``, positions for ``seq``, no KV cache, attention dropout off, SDPA attention."""
    tiny = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    real = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 4}  # fmt: skip
    return {**_pick(size, tiny, real), "max_position_embeddings": max(seq, 16), "use_cache": False,
            "attention_dropout": 0.0, "attn_implementation": "sdpa"}  # fmt: skip


def _llama_config(size: str, seq: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_style(size, seq), tie_word_embeddings=False)


def llama(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``LlamaForCausalLM`` with the library's own loss: ``model(input_ids=ids, labels=ids).loss``
    (next-token cross-entropy, mean over the ``batch x (seq - 1)`` predicted tokens).

    GQA (kv heads a quarter/half of the heads), RoPE, RMSNorm, SwiGLU, SDPA attention, no KV cache.
    tiny: hidden 32, 2 layers, 4 heads / 2 kv heads, intermediate 64, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 16 heads / 4 kv heads, intermediate 2816, vocab 32000, seq 512, batch 64.
    """
    from transformers import LlamaForCausalLM

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    cfg = _llama_config(size, seq)
    model = LlamaForCausalLM(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size, seed)
    return _finish(model, "llama", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss), (ids,)


def gemma(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``GemmaForCausalLM`` with the library's own loss: tied input and output embeddings, the
    embedding scaled by ``sqrt(hidden)``, RMSNorm with ``(1 + weight)`` cast back by ``type_as`` to the
    residual stream's dtype, GELU-tanh gated MLP, GQA, RoPE, SDPA.
    tiny: hidden 32, 2 layers, 4 heads of 8 / 2 kv heads, intermediate 64, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 16 heads of 64 / 4 kv heads, intermediate 2816, vocab 32000, seq 512,
    batch 64.
    """
    from transformers import GemmaConfig, GemmaForCausalLM

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    cfg = GemmaConfig(**_decoder_style(size, seq), head_dim=_pick(size, 8, 64))
    model = GemmaForCausalLM(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size, seed)
    return _finish(model, "gemma", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss), (ids,)


def _hand_next_token_loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = m(input_ids=ids).logits
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, vocab), ids[:, 1:].reshape(-1))


def llama_handloss(
    size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0
) -> Built:
    """:func:`llama` (same config, same weights for the same seed) returning logits, with the loss written
    by hand: ``cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))`` — the same value as
    the library's loss; issue 18 asks that both variants plan within 1 % of each other."""
    model, (ids,) = llama(size, batch, seq, seed)
    return _finish(model.model, "llama_handloss", _hand_next_token_loss, TokensLoss), (ids,)


def t5(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``T5ForConditionalGeneration``, ``model(input_ids=src, labels=tgt).loss``.

    The library shifts the labels right itself (``new_zeros`` + slice copy) to make the decoder inputs;
    relative position bias (bucketed), T5 RMS layer norm, ReLU feed-forward, tied embeddings scaled.
    tiny: d_model 32, 2+2 layers, 4 heads of 8, d_ff 64, vocab 128, seq 16, batch 8.
    real: d_model 1024, 8+8 layers, 16 heads of 64, d_ff 2816, vocab 32128, seq 512, batch 64.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    tiny = {"vocab_size": 128, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}
    real = {"vocab_size": 32128, "d_model": 1024, "d_kv": 64, "d_ff": 2816, "num_layers": 8, "num_heads": 16}
    torch.manual_seed(seed)
    cfg = T5Config(
        **_pick(size, tiny, real),
        num_decoder_layers=None,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = T5ForConditionalGeneration(cfg)
    src = _tokens(batch, seq, cfg.vocab_size, seed)
    tgt = _tokens(batch, seq, cfg.vocab_size, seed + 7)
    return _finish(model, "t5", lambda m, src, tgt: m(input_ids=src, labels=tgt).loss, TokensLabelsLoss), (
        src,
        tgt,
    )


def _gpt_style(dims: dict[str, int], seq: int) -> dict[str, Any]:
    """The config keywords GPT-2-style configs (GPT-2, GPT-J) share: ``dims``, begin/end-of-text ids at the
    vocabulary's end, positions for ``seq``, dropout off."""
    end = dims["vocab_size"] - 1
    return {**dims, "bos_token_id": end, "eos_token_id": end, "n_positions": max(seq, 16),
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # fmt: skip


def gpt2(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``GPT2LMHeadModel``, ``model(input_ids=ids, labels=ids).loss`` (learned positions,
    LayerNorm, GELU-tanh MLP, Conv1D projections, tied head).
    tiny: hidden 32, 2 layers, 4 heads, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 16 heads, vocab 50257, seq 512, batch 64.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    dims = _pick(size, {"vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4},
                 {"vocab_size": 50257, "n_embd": 1024, "n_layer": 8, "n_head": 16})  # fmt: skip
    cfg = GPT2Config(**_gpt_style(dims, seq), use_cache=False, attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size, seed)
    return _finish(model, "gpt2", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss), (ids,)


def bert(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``BertForMaskedLM``, ``model(input_ids=ids, labels=labels).loss``.

    A fixed masking pattern (every 7th position, offset by the row) replaces tokens with ``[MASK]``
    (id 3) and keeps their ids as labels; every other label is -100 (ignored by the library's loss).
    tiny: hidden 32, 2 layers, 4 heads, intermediate 64, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 16 heads, intermediate 4096, vocab 30522, seq 512, batch 64.
    """
    from transformers import BertConfig, BertForMaskedLM

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    dims = _pick(size,
                 {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 64},
                 {"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                  "intermediate_size": 4096})  # fmt: skip
    cfg = BertConfig(
        **dims,
        max_position_embeddings=max(seq, 16),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    model = BertForMaskedLM(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size, seed)
    pos = torch.arange(seq)[None, :] + torch.arange(batch)[:, None]
    masked = pos % 7 == 0
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, 3), ids)
    return _finish(
        model, "bert", lambda m, ids, labels: m(input_ids=ids, labels=labels).loss, TokensLabelsLoss
    ), (
        inputs,
        labels,
    )


def gptj(
    size: str = "tiny",
    batch: int | None = None,
    seq: int | None = None,
    seed: int = 0,
    use_cache: bool = False,
) -> Built:
    """Hugging Face ``GPTJForCausalLM`` with ``labels=``: a parallel block (attention and MLP from one layer
    norm, summed with the residual), partial rotary (interleaved, on the first ``rotary_dim`` of each head),
    GELU-tanh MLP, untied head with a bias. ``use_cache=True`` is the library's default (the key/value cache
    on in training too: :func:`examples.patterns.gptj`).
    tiny: hidden 32, 2 layers, 4 heads, rotary 4, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 16 heads, rotary 32, ff 4096, vocab 32000, seq 512, batch 64.
    """
    from transformers import GPTJConfig, GPTJForCausalLM

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    dims = _pick(size, {"vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4},
                 {"vocab_size": 32000, "n_embd": 1024, "n_layer": 8, "n_head": 16, "rotary_dim": 32})  # fmt: skip
    cfg = GPTJConfig(**_gpt_style(dims, seq), use_cache=use_cache, tie_word_embeddings=False)
    model = GPTJForCausalLM(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size, seed)
    return _finish(model, "gptj", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss), (ids,)


def cohere(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``CohereForCausalLM`` with ``labels=``: a parallel block with SwiGLU, LayerNorm without
    bias, interleaved rotary, GQA, tied embeddings and a scaled head.
    tiny: hidden 32, 2 layers, 4 heads / 2 kv heads, intermediate 64, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 16 heads / 4 kv heads, intermediate 2816, vocab 32000, seq 512, batch 64.
    """
    from transformers import CohereConfig, CohereForCausalLM

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    cfg = CohereConfig(**_decoder_style(size, seq), tie_word_embeddings=True)
    model = CohereForCausalLM(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size, seed)
    return _finish(model, "cohere", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss), (ids,)


def mixtral(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``MixtralForCausalLM`` (top-2 of 4 / 8 experts), the library's loss, with
    ``experts_implementation="batched_mm"``: the library's default expert loop (``nonzero`` / ``where``
    per expert) has data-dependent shapes and cannot be exported, while ``batched_mm`` gathers each
    token's two experts' weights (``gate_up_proj[expert_ids]``: a ``[tokens x 2, 2I, H]`` tensor) and runs
    one bmm — exportable, but its gathered weights make it memory-hungry at real size (that is the
    library's design, kept as it is). No router auxiliary loss.
    tiny: hidden 32, 2 layers, 4 experts, 4 heads / 2 kv heads, intermediate 64, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 8 experts, 16 heads / 4 kv heads, intermediate 2816, vocab 32000,
    seq 512, batch 64.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        **_decoder_style(size, seq),
        num_local_experts=_pick(size, 4, 8),
        num_experts_per_tok=2,
        output_router_logits=False,
        experts_implementation="batched_mm",
    )
    model = MixtralForCausalLM(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size, seed)
    return _finish(model, "mixtral", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss), (ids,)


# ============================================================================ MoE LM (torch.nn)


class BatchedTop2Experts(nn.Module):
    """Top-2 routed SwiGLU experts with batched weights ``[E, ...]`` and a fixed-capacity dispatch.

    Router: linear ``D -> E`` logits, top-2 per token, the two gates a softmax over the two chosen
    logits (Mixtral's routing). Each expert takes at most ``capacity`` tokens per sequence, in sequence
    order (first choices first; the rest are dropped, their gate 0), so all shapes are static: the
    dispatch tensor is ``[B, S, E, C]`` and the experts run as einsums over ``[B, E, C, D]`` buffers.
    """

    def __init__(self, hidden: int, ff: int, experts: int, capacity: int) -> None:
        super().__init__()
        self.experts = experts
        self.capacity = capacity
        self.router = nn.Linear(hidden, experts, bias=False)
        bound_in, bound_ff = 1.0 / math.sqrt(hidden), 1.0 / math.sqrt(ff)
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, ff).uniform_(-bound_in, bound_in))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, ff).uniform_(-bound_in, bound_in))
        self.w_down = nn.Parameter(torch.empty(experts, ff, hidden).uniform_(-bound_ff, bound_ff))

    def dispatch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(route, weight)``, both ``[B, S, E, C]``: route is 0/1 (token -> expert slot), weight is the
        gate there (carries the router's gradient)."""
        logits = self.router(x)  # [B, S, E]
        top_logits, top = torch.topk(logits, 2, dim=-1)
        gates = torch.softmax(top_logits, dim=-1)  # [B, S, 2]
        choice = F.one_hot(top, self.experts).to(x.dtype)  # [B, S, 2, E]
        first, second = choice[:, :, 0], choice[:, :, 1]
        # position of each token in its expert's buffer: first choices fill before second choices
        slot_first = torch.cumsum(first, dim=1) - first
        slot_second = torch.cumsum(second, dim=1) - second + first.sum(dim=1, keepdim=True)
        keep_first = first * (slot_first < self.capacity).to(x.dtype)
        keep_second = second * (slot_second < self.capacity).to(x.dtype)
        where_first = F.one_hot((slot_first * keep_first).sum(-1).long(), self.capacity).to(x.dtype)
        where_second = F.one_hot((slot_second * keep_second).sum(-1).long(), self.capacity).to(x.dtype)
        route = (
            keep_first[..., None] * where_first[:, :, None, :]
            + keep_second[..., None] * where_second[:, :, None, :]
        )
        weight = (gates[:, :, 0, None, None] * keep_first[..., None] * where_first[:, :, None, :]) + (
            gates[:, :, 1, None, None] * keep_second[..., None] * where_second[:, :, None, :]
        )
        return route, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route, weight = self.dispatch(x)
        buf = torch.einsum("bsd,bsec->becd", x, route)
        act = F.silu(torch.einsum("becd,edf->becf", buf, self.w_gate)) * torch.einsum(
            "becd,edf->becf", buf, self.w_up
        )
        out = torch.einsum("becf,efd->becd", act, self.w_down)
        return torch.einsum("becd,bsec->bsd", out, weight)


class MoEBlock(nn.Module):
    """Pre-RMSNorm decoder block: causal SDPA attention, then :class:`BatchedTop2Experts`."""

    def __init__(self, hidden: int, heads: int, ff: int, experts: int, capacity: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, eps=1e-6)
        self.moe = BatchedTop2Experts(hidden, ff, experts, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    """Token embedding, :class:`MoEBlock` x layers, RMSNorm, untied head, next-token cross-entropy."""

    def __init__(
        self, vocab: int, hidden: int, heads: int, ff: int, layers: int, experts: int, capacity: int
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MoEBlock(hidden, heads, ff, experts, capacity) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def moe(size: str = "tiny", batch: int | None = None, seq: int | None = None, seed: int = 0) -> Built:
    """A top-2 mixture-of-experts LM with batched experts, written here in torch.nn (:class:`MoELM`).

    Why not a library's MoE: HF ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` by default loop over
    the experts a batch hits (``nonzero``, ``where``: data-dependent shapes torch.export cannot trace);
    their exportable ``batched_mm`` mode gathers per-token expert weights (see :func:`mixtral`). This
    model routes like Mixtral (top-2, softmax over the two logits, SwiGLU experts) and dispatches like
    GShard (capacity ``2 x seq x 2 / experts`` per sequence, einsums over ``[B, E, C, D]``).
    tiny: hidden 32, 2 layers, 4 experts, 4 heads, ff 64, vocab 128, seq 16, batch 8.
    real: hidden 1024, 8 layers, 8 experts, 16 heads, ff 2816, vocab 32000, seq 512, batch 64.
    """
    batch = batch or _pick(size, 8, 64)
    seq = seq or _pick(size, 16, 512)
    torch.manual_seed(seed)
    vocab, hidden, heads, ff, layers, experts = _pick(
        size, (128, 32, 4, 64, 2, 4), (32000, 1024, 16, 2816, 8, 8)
    )
    capacity = max(1, 2 * seq * 2 // experts)
    model = MoELM(vocab, hidden, heads, ff, layers, experts, capacity)
    model.train()
    return model, (_tokens(batch, seq, vocab, seed),)


# ============================================================================ vision (HF)


def vit(size: str = "tiny", batch: int | None = None, image: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``ViTForImageClassification``, ``model(pixel_values=x, labels=y).loss`` (conv patch
    embedding, CLS token, learned positions, pre-LN encoder, GELU MLP, head on CLS).
    tiny: hidden 32, 2 layers, 4 heads, intermediate 64, 32x32 images, patch 8, 10 classes, batch 8.
    real: hidden 1024, 8 layers, 16 heads, intermediate 4096 (ViT-L width), 224x224, patch 16,
    1000 classes, batch 64.
    """
    from transformers import ViTConfig, ViTForImageClassification

    batch = batch or _pick(size, 8, 64)
    image = image or _pick(size, 32, 224)
    torch.manual_seed(seed)
    dims = _pick(size,
                 {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                  "patch_size": 8, "num_labels": 10},
                 {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                  "intermediate_size": 4096, "patch_size": 16, "num_labels": 1000})  # fmt: skip
    cfg = ViTConfig(
        **dims,
        image_size=image,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    model = ViTForImageClassification(cfg)
    x, y = _images(batch, image, cfg.num_labels, seed)
    return _finish(model, "vit", lambda m, x, y: m(pixel_values=x, labels=y).loss, ImagesLoss), (x, y)


def resnet50(size: str = "tiny", batch: int | None = None, image: int | None = None, seed: int = 0) -> Built:
    """Hugging Face ``ResNetForImageClassification`` in train mode (BatchNorm with batch statistics and
    running-stat updates), ``model(pixel_values=x, labels=y).loss``.
    real: ResNet-50 (bottleneck, depths [3, 4, 6, 3], widths 256..2048, stem 64), 224x224, 1000 classes,
    batch 128.
    tiny: bottleneck, depths [1, 1, 1, 1], widths 16..128, stem 8, 32x32, 10 classes, batch 8.
    """
    from transformers import ResNetConfig, ResNetForImageClassification

    batch = batch or _pick(size, 8, 128)
    image = image or _pick(size, 32, 224)
    torch.manual_seed(seed)
    dims = _pick(size,
                 {"embedding_size": 8, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1],
                  "num_labels": 10},
                 {"embedding_size": 64, "hidden_sizes": [256, 512, 1024, 2048], "depths": [3, 4, 6, 3],
                  "num_labels": 1000})  # fmt: skip
    cfg = ResNetConfig(**dims, layer_type="bottleneck", hidden_act="relu")
    model = ResNetForImageClassification(cfg)
    x, y = _images(batch, image, cfg.num_labels, seed)
    return _finish(model, "resnet50", lambda m, x, y: m(pixel_values=x, labels=y).loss, ImagesLoss), (x, y)


def convnext_t(
    size: str = "tiny", batch: int | None = None, image: int | None = None, seed: int = 0
) -> Built:
    """Hugging Face ``ConvNextForImageClassification``, ``model(pixel_values=x, labels=y).loss`` (patchify
    stem, depthwise 7x7 convs, channels-last LayerNorm, inverted-bottleneck MLP, layer scale; drop-path 0).
    real: ConvNeXt-T (depths [3, 3, 9, 3], dims [96, 192, 384, 768]), 224x224, 1000 classes, batch 128.
    tiny: depths [1, 1, 1, 1], dims [8, 16, 32, 64], 32x32, 10 classes, batch 8.
    """
    from transformers import ConvNextConfig, ConvNextForImageClassification

    batch = batch or _pick(size, 8, 128)
    image = image or _pick(size, 32, 224)
    torch.manual_seed(seed)
    dims = _pick(size,
                 {"depths": [1, 1, 1, 1], "hidden_sizes": [8, 16, 32, 64], "num_labels": 10},
                 {"depths": [3, 3, 9, 3], "hidden_sizes": [96, 192, 384, 768], "num_labels": 1000})  # fmt: skip
    cfg = ConvNextConfig(**dims, image_size=image, drop_path_rate=0.0)
    model = ConvNextForImageClassification(cfg)
    x, y = _images(batch, image, cfg.num_labels, seed)
    return _finish(model, "convnext_t", lambda m, x, y: m(pixel_values=x, labels=y).loss, ImagesLoss), (x, y)


#: every corpus factory by name (``examples.corpus:NAME``), in the order the benchmark reports them
CORPUS: dict[str, Callable[..., Built]] = {
    "llama": llama,
    "llama_handloss": llama_handloss,
    "gemma": gemma,
    "t5": t5,
    "vit": vit,
    "resnet50": resnet50,
    "convnext_t": convnext_t,
    "moe": moe,
    "mixtral": mixtral,
    "gpt2": gpt2,
    "bert": bert,
    "gptj": gptj,
    "cohere": cohere,
}


# ============================================================================ plan checks


def batch_tensors(graph: Any) -> set[int]:
    """Ids of the tensors of ``graph`` that carry the batch (:func:`hapnb.triples.batch_tensors`)."""
    from hapnb.triples import batch_tensors as tensors

    return set(tensors(graph))


def replicated_ops(plan: Any) -> list[tuple[str, str]]:
    """``(op name, aten target)`` of the compute steps of ``plan`` that run the batch replicated: strategy
    ``replicate``, non-zero flops, and a tensor input that carries the batch (:func:`batch_tensors`).

    A stand-in for ``plan.fallback_ops`` (which lists ops without a rule): this one also catches ops
    that have a rule but were still run replicated on batch-sized data.
    """
    g = plan.graph
    by_name = {op.name: op for op in g.ops}
    batchy = batch_tensors(g)
    out = []
    for ins in plan.program:
        if ins.kind != "compute" or ins.name != "replicate":
            continue
        op = by_name.get(ins.op)
        if op is None or op.flops <= 0:
            continue
        if any(t in batchy for t in op.inputs):
            out.append((op.name, op.target))
    return out


def input_forms(plan: Any) -> dict[str, str]:
    """The form each graph input (token ids, pixel values, labels) is loaded in, by input name."""
    names = {plan.graph.tensors[t].name for t in plan.graph.inputs}
    return {i.tensor: i.form for i in plan.program if i.kind == "load" and i.tensor in names}


def batch_sharded(plan: Any) -> bool:
    """Whether ``plan`` shards the batch: the first graph input (token ids, pixel values) is loaded ``G0``,
    or it is loaded ``I`` (a small integer tensor), a tensor computed from it is cut to ``G0`` by a free
    ``slice`` (e.g. the embedding's ids) and no work on batch data runs replicated
    (:func:`replicated_ops` is empty)."""
    g = plan.graph
    first = g.tensors[g.inputs[0]].name
    if input_forms(plan).get(first) == "G0":
        return True
    batchy = {g.tensors[t].name for t in batch_tensors(g)}
    sliced = any(
        i.kind == "collective" and i.name == "slice" and i.form == "G0" and i.tensor in batchy
        for i in plan.program
    )
    return sliced and not replicated_ops(plan)


def unshardable_batch_ops(graph: Any) -> list[tuple[str, str]]:
    """``(op name, aten target)`` of the ops of ``graph`` that do work on batch data but have no strategy
    that shards it (:attr:`hapnb.triples.Coverage.batch_blockers`): the ops that force a plan to replicate
    the batch whatever the cluster; unlike :func:`replicated_ops` this does not depend on the cost
    model's choices."""
    from hapnb.triples import coverage, theory

    return [(r.op, r.target) for r in coverage(theory(graph)).batch_blockers]
