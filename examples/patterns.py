"""Training patterns: the way people train models, as hapnb factories (the corpus, :mod:`examples.corpus`, covers
architectures; these cover what a training script adds to them).

Each factory takes ``size="tiny"|"real"`` and ``seed`` and returns ``(model, example_inputs)`` with
``model(*example_inputs)`` the scalar loss, as every factory of :mod:`examples.factories` does. Nothing is
downloaded: models are built from configs with seeded random weights.

======================  ============================================================================
factory                 pattern
======================  ============================================================================
``llama_padded``        HF Llama fed ``attention_mask`` with right padding and labels ``-100`` on the pads
``t5_padded``           HF T5 with a padded source ``attention_mask``
``bert_classifier``     HF ``BertForSequenceClassification`` with a padding mask and class labels
``whisper``             HF ``WhisperForConditionalGeneration`` (log-mel frames in, token labels)
``recommender``         four ``nn.EmbeddingBag`` tables over multi-hot ids, dense features, an MLP
``unet``                a diffusion UNet: step embedding, GroupNorm, ``F.interpolate``, noise MSE
``dcgan``               a DCGAN-style generator of ``ConvTranspose2d`` layers with batch norm
``llama_lora``          the corpus's Llama fine-tuned with LoRA: frozen weights, low-rank adapters on
                        the query and value projections
``llama_amp``           the corpus's Llama trained in mixed precision: its loss under ``torch.autocast``
                        (bfloat16)
``gptj``                HF GPT-J with its config's defaults: the key/value cache on (as every HF causal
                        LM's config has it, also in training), attention and MLP in parallel
======================  ============================================================================

>>> model, inputs = recommender()
>>> model(*inputs).shape
torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.corpus import LossOf, _finish, _pick, _tokens, t5
from examples.corpus import gptj as corpus_gptj
from examples.corpus import llama as corpus_llama
from examples.factories import SmallUNet

__all__ = [
    "PATTERNS",
    "Autocast",
    "bert_classifier",
    "dcgan",
    "gptj",
    "llama_amp",
    "llama_lora",
    "llama_padded",
    "recommender",
    "t5_padded",
    "unet",
    "whisper",
]

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


class IdsMaskLabelsLoss(LossOf):
    """:class:`LossOf` fed token ids, their padding mask and labels."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        return self._call(self.model, input_ids, attention_mask, labels)


class FeaturesLabelsLoss(LossOf):
    """:class:`LossOf` fed input features and labels (graph inputs ``input_features``, ``labels``)."""

    def forward(self, input_features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._call(self.model, input_features, labels)


def padding_mask(batch: int, seq: int) -> torch.Tensor:
    """A right-padding mask: sample ``b`` ends with ``(b % 4) * seq // 16`` pads (1 = token, 0 = pad)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        pads = (b % 4) * (seq // 16)
        if pads:
            mask[b, seq - pads :] = 0
    return mask


def llama_padded(size: str = "tiny", seed: int = 0) -> Built:
    """The corpus's Llama fed a padding mask and labels with ``-100`` on the pads (what a data collator
    makes)."""
    model, (ids,) = corpus_llama(size=size, seed=seed)
    mask = padding_mask(*ids.shape)
    ids = ids.masked_fill(mask == 0, 0)

    def loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    labels = ids.masked_fill(mask == 0, -100)
    return _finish(model.model, "llama_padded", loss, IdsMaskLabelsLoss), (ids, mask, labels)


def t5_padded(size: str = "tiny", seed: int = 0) -> Built:
    """The corpus's T5 with a padded source and its ``attention_mask``."""
    model, (src, tgt) = t5(size=size, seed=seed)
    mask = padding_mask(*src.shape)

    def loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    return _finish(model.model, "t5_padded", loss, IdsMaskLabelsLoss), (
        src.masked_fill(mask == 0, 0),
        mask,
        tgt,
    )


def bert_classifier(size: str = "tiny", seed: int = 0) -> Built:
    """HF ``BertForSequenceClassification`` (3 classes, SDPA attention) on padded sequences.
    real: hidden 1024, 8 layers, 16 heads, seq 512, batch 64."""
    from transformers import BertConfig, BertForSequenceClassification

    batch, seq = _pick(size, 8, 64), _pick(size, 16, 512)
    tiny = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4}  # fmt: skip
    real = {"vocab_size": 30522, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
            "num_attention_heads": 16}  # fmt: skip
    torch.manual_seed(seed)
    cfg = BertConfig(**_pick(size, tiny, real), max_position_embeddings=max(seq, 64), num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")  # fmt: skip
    mask = padding_mask(batch, seq)
    ids = _tokens(batch, seq, cfg.vocab_size, seed).masked_fill(mask == 0, 0)

    def loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    model = BertForSequenceClassification(cfg)
    return _finish(model, "bert_classifier", loss, IdsMaskLabelsLoss), (ids, mask, torch.arange(batch) % 3)


def whisper(size: str = "tiny", seed: int = 0) -> Built:
    """HF ``WhisperForConditionalGeneration`` (tied decoder embedding and output projection).
    real: d_model 1024, 8+8 layers, 16 heads, 80 mel bins x 3000 frames (30 s), 128 target tokens, batch 16."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    batch, mels, frames, tokens = _pick(size, (8, 16, 32, 8), (16, 80, 3000, 128))
    tiny = {"vocab_size": 128, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}  # fmt: skip
    real = {"vocab_size": 51865, "d_model": 1024, "encoder_layers": 8, "decoder_layers": 8,
            "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
            "decoder_ffn_dim": 4096}  # fmt: skip
    torch.manual_seed(seed)
    cfg = WhisperConfig(**_pick(size, tiny, real), num_mel_bins=mels, max_source_positions=frames // 2,
                        max_target_positions=max(2 * tokens, 32), decoder_start_token_id=1, pad_token_id=0,
                        use_cache=False, dropout=0.0)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 3)
    feats = torch.randn(batch, mels, frames, generator=gen)
    labels = _tokens(batch, tokens, cfg.vocab_size, seed + 1)

    def loss(m: nn.Module, feats: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_features=feats, labels=labels).loss

    model = WhisperForConditionalGeneration(cfg)
    return _finish(model, "whisper", loss, FeaturesLabelsLoss), (feats, labels)


class Recommender(nn.Module):
    """Multi-hot categorical features through ``nn.EmbeddingBag`` tables (one per feature, summed bags of
    ``ids.shape[-1]`` ids), concatenated with dense features, an MLP, a click loss."""

    def __init__(self, rows: int, dim: int, tables: int, dense: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        width = tables * dim + dense
        self.mlp = nn.Sequential(
            nn.Linear(width, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1)
        )

    def forward(self, ids: torch.Tensor, dense: torch.Tensor, clicked: torch.Tensor) -> torch.Tensor:
        bags = [table(ids[:, k]) for k, table in enumerate(self.tables)]
        logits = self.mlp(torch.cat([*bags, dense], -1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, clicked)


def recommender(size: str = "tiny", seed: int = 0) -> Built:
    """:class:`Recommender`. tiny: 4 tables of 1,000 x 16, batch 8; real: 4 tables of 1M x 64 (1 GiB),
    20 ids per bag, 13 dense features, batch 4096."""
    rows, dim, batch = _pick(size, (1000, 16, 8), (1_000_000, 64, 4096))
    torch.manual_seed(seed)
    model = Recommender(rows, dim, 4, 13)
    gen = torch.Generator().manual_seed(seed + 5)
    ids = torch.randint(0, rows, (batch, 4, 20), generator=gen)
    dense = torch.randn(batch, 13, generator=gen)
    return model, (ids, dense, torch.rand(batch, generator=gen).round())


def unet(size: str = "tiny", seed: int = 0) -> Built:
    """:class:`examples.factories.SmallUNet`. tiny: 16 channels, 16 x 16, batch 8; real: 128 channels,
    64 x 64, batch 64."""
    channels, image, batch = _pick(size, (16, 16, 8), (128, 64, 64))
    torch.manual_seed(seed)
    model = SmallUNet(channels)
    gen = torch.Generator().manual_seed(seed + 7)
    x0, noise = (
        torch.randn(batch, 3, image, image, generator=gen),
        torch.randn(batch, 3, image, image, generator=gen),
    )
    return model, (x0, noise, torch.randint(0, model.steps, (batch,), generator=gen))


class Generator(nn.Module):
    """A DCGAN-style generator: a latent through a linear layer to ``(w, 4, 4)``, then ``ConvTranspose2d``
    layers (stride 2) with batch norm and ReLU up to a ``tanh`` image; trained here to reconstruct (MSE)."""

    def __init__(self, latent: int, width: int, ups: int) -> None:
        super().__init__()
        self.width = width
        self.fc = nn.Linear(latent, width * 16)
        layers: list[nn.Module] = []
        c = width
        for _ in range(ups - 1):
            layers += [nn.ConvTranspose2d(c, c // 2, 4, 2, 1), nn.BatchNorm2d(c // 2), nn.ReLU()]
            c //= 2
        layers += [nn.ConvTranspose2d(c, 3, 4, 2, 1), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(self.fc(z).view(-1, self.width, 4, 4)), image)


def dcgan(size: str = "tiny", seed: int = 0) -> Built:
    """:class:`Generator`. tiny: width 16, 16 x 16 images, batch 8; real: width 512, 64 x 64, batch 128."""
    width, ups, batch = _pick(size, (16, 2, 8), (512, 4, 128))
    torch.manual_seed(seed)
    model = Generator(128, width, ups)
    gen = torch.Generator().manual_seed(seed + 7)
    side = 4 * 2**ups
    return model, (torch.randn(batch, 128, generator=gen), torch.randn(batch, 3, side, side, generator=gen))


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``(x A^T) B^T * alpha / r`` (LoRA); ``B``
    starts at zero as LoRA's does, here small and random so that every gradient is non-zero."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.B = nn.Parameter(torch.randn(base.out_features, r) * 0.01)
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.T @ self.B.T) * self.scale


def llama_lora(size: str = "tiny", seed: int = 0) -> Built:
    """The corpus's Llama with every weight frozen and LoRA adapters (rank 8) on ``q_proj`` and ``v_proj``."""
    model, inputs = corpus_llama(size=size, seed=seed)
    model.requires_grad_(False)
    torch.manual_seed(seed + 11)
    for layer in model.model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model, inputs


class Autocast(nn.Module):
    """``model``'s loss computed under ``torch.autocast(device, dtype)``: mixed-precision training (linear
    layers and attention in ``dtype``, weights and their gradients kept in float32)."""

    def __init__(self, model: nn.Module, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.model, self.device, self.dtype = model, device, dtype

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device, dtype=self.dtype):
            return self.model(*inputs)


def llama_amp(size: str = "tiny", seed: int = 0) -> Built:
    """The corpus's Llama (library loss) under ``torch.autocast`` with bfloat16."""
    model, inputs = corpus_llama(size=size, seed=seed)
    return Autocast(model), inputs


def gptj(size: str = "tiny", seed: int = 0) -> Built:
    """HF ``GPTJForCausalLM`` with ``labels=`` and the config's default ``use_cache=True``: each layer's keys
    and values are concatenated to the cache's empty tensor (dropout off). Otherwise the corpus's
    :func:`examples.corpus.gptj`: attention and MLP in parallel from one layer norm, rotary on the first
    ``rotary_dim`` dims of each head.
    tiny: hidden 32, 2 layers, 4 heads, rotary 4, vocab 128, seq 16, batch 8;
    real: hidden 1024, 8 layers, 16 heads, rotary 32, ff 4096, vocab 32000, seq 512, batch 64."""
    return corpus_gptj(size, seed=seed, use_cache=True)


PATTERNS: dict[str, Callable[..., Any]] = {
    "llama_padded": llama_padded,
    "t5_padded": t5_padded,
    "bert_classifier": bert_classifier,
    "whisper": whisper,
    "recommender": recommender,
    "unet": unet,
    "dcgan": dcgan,
    "llama_lora": llama_lora,
    "llama_amp": llama_amp,
    "gptj": gptj,
}
