"""Benchmark models of the HAP paper as plain PyTorch, and loading of user model factories.

Every model here *includes its loss*: ``model(*example_inputs)`` returns the scalar training loss, and
the targets are among the example inputs. Weights are created under ``torch.manual_seed(seed)`` and
inputs from a generator seeded with ``seed``, so a build is reproducible; a :class:`ModelSpec` (stored in
plans) records exactly how to rebuild it.

>>> import torch
>>> from hapnb import zoo
>>> model, inputs, spec = zoo.build("mlp", devices=2, layers=2, hidden=16, input=8, batch=4)
>>> loss = model(*inputs)
>>> loss.shape, spec.to_json()["name"]
(torch.Size([]), 'mlp')
>>> model2, inputs2, _ = zoo.build_spec(zoo.ModelSpec.from_json(spec.to_json()))
>>> bool(torch.equal(model2(*inputs2), loss))
True

Models (paper sizes by default: hidden 768, 12 heads, ff 3072, seq 128, dropout 0.1, batch 32/device):

* ``mlp`` — ``layers`` x (Linear + ReLU) and a Linear head on a random input; the smoke model.
* ``vgg19`` — CIFAR-10 VGG19 (3x3 convs, 5 max-pools, adaptive avg-pool 7x7, 25088-4096-4096-10).
* ``vit`` — CIFAR ViT: 4x4 patches by a strided conv, cls token, learned positions, post-LN encoder.
* ``bert`` — the paper's "BERT-base", a causal LM on a 33,280-word vocabulary (WikiText-2 padded).
* ``bert-moe`` — ``bert`` with a top-2 GShard MoE FFN on every odd layer (E = 2 x devices experts).
* ``gpt`` — a pre-norm GPT with fused qkv and ``scaled_dot_product_attention(is_causal=True)``.
* ``lm`` — the LM measured on an H100 (hapnb/data/h100-lm-steps.json, docs/fidelity.md): embedding
  (vocab 8192) + learned positions, post-LN ReLU encoder layers (heads = hidden // 64, no mask, dropout 0),
  linear head, summed cross-entropy over the next token.

Options (``build`` keywords): ``devices`` (default 8), ``seed`` (0), ``dtype`` ("float32"), ``batch``
(global, default 32 x devices), ``reduction`` ("mean" or "sum" for the loss) and per model:

=========  ====================================================================================
mlp        layers 4, hidden 1024, input 1024, classes 10
vgg19      image 32 (>= 32), classes 10, width 1.0 (channel multiplier), hidden 4096, dropout 0.1
vit        layers 12, hidden 768, heads 12, ff 4*hidden, dropout 0.1, image 32, patch 4, classes 10,
           attention "sdpa"
bert       layers 12, seq 128, hidden 768, heads 12, ff 4*hidden, dropout 0.1, vocab 33280,
           attention "sdpa"
bert-moe   as bert, plus experts 2*devices, capacity_factor 2.5 (capacity = ceil(seq/experts*factor))
gpt        layers 12, seq 128, hidden 768, heads 12, ff 4*hidden, dropout 0.1, vocab 32000
lm         layers 2, seq 64, hidden 256, heads hidden//64, ff 4*hidden, dropout 0.0, vocab 8192,
           reduction "sum", attention "sdpa"
=========  ====================================================================================

The default ``attention="sdpa"`` builds the encoder layers from :class:`PostLNEncoderLayer`; the
alternative ``attention="torch"`` uses ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` as the
paper does (still planned and verified, but less shardable): their export transposes to sequence-first and folds batch into other dims (``view [S, B*H, hd]``,
``permute`` + ``reshape [S*B, D]``), which hides the batch dim from sharding rules. ``attention="sdpa"``
swaps in :class:`PostLNEncoderLayer` / :class:`SelfAttention`: same parameters, same math, and a
batch-major graph (linear, split, view, transpose, SDPA, transpose, reshape, linear).

The default ``bert`` vocabulary follows the original: WikiText-2's 33,278 words padded to
``devices * (33278 // devices + 1)`` (33,280 for 1, 2, 4, 8 or 16 devices).

Tracing: every model exports with ``torch.export.export(model, inputs)`` in ``train()`` mode, both
non-strict (the default in torch 2.13) and ``strict=True``; the exported graphs hold the same aten ops.
The ``call_function`` targets of each export (train mode, torch 2.13; small configs, the ops do not
depend on sizes) — see also docs/zoo-ops.md:

* ``mlp``: aten.cross_entropy_loss.default, aten.linear.default, aten.relu.default
* ``vgg19``: aten.adaptive_avg_pool2d.default, aten.conv2d.default, aten.dropout.default,
  aten.flatten.using_ints, aten.linear.default, aten.log_softmax.int, aten.max_pool2d.default,
  aten.nll_loss_nd.default, aten.relu.default
* ``vit``: operator.getitem, aten.add.Tensor, aten.cat.default, aten.conv2d.default,
  aten.cross_entropy_loss.default, aten.dropout.default, aten.expand.default, aten.flatten.using_ints,
  aten.layer_norm.default, aten.linear.default, aten.relu.default, aten.reshape.default,
  aten.scaled_dot_product_attention.default, aten.select.int, aten.split.Tensor, aten.transpose.int,
  aten.view.default
* ``bert``: operator.getitem, aten.add.Tensor, aten.cross_entropy_loss.default, aten.dropout.default,
  aten.embedding.default, aten.layer_norm.default, aten.linear.default, aten.mul.Tensor,
  aten.relu.default, aten.reshape.default, aten.scaled_dot_product_attention.default, aten.split.Tensor,
  aten.transpose.int, aten.view.default
* ``bert-moe``: operator.getitem, aten._assert_tensor_metadata.default, aten.add.Tensor,
  aten.clamp.default, aten.cross_entropy_loss.default, aten.cumsum.default, aten.div.Tensor,
  aten.dropout.default, aten.einsum.default, aten.embedding.default, aten.gt.Scalar,
  aten.layer_norm.default, aten.linear.default, aten.lt.Scalar, aten.mul.Tensor, aten.one_hot.default,
  aten.relu.default, aten.reshape.default, aten.scaled_dot_product_attention.default, aten.select.int,
  aten.softmax.int, aten.split.Tensor, aten.sub.Tensor, aten.sum.dim_IntList, aten.to.dtype,
  aten.topk.default, aten.transpose.int, aten.unsqueeze.default, aten.view.default
* ``gpt``: operator.getitem, aten.add.Tensor, aten.arange.start, aten.cross_entropy_loss.default,
  aten.dropout.default, aten.embedding.default, aten.gelu.default, aten.layer_norm.default,
  aten.linear.default, aten.reshape.default, aten.scaled_dot_product_attention.default,
  aten.split.Tensor, aten.transpose.int, aten.view.default
* ``lm``: operator.getitem, aten.add.Tensor, aten.cross_entropy_loss.default, aten.dropout.default,
  aten.embedding.default, aten.flatten.using_ints, aten.layer_norm.default, aten.linear.default,
  aten.relu.default, aten.reshape.default, aten.scaled_dot_product_attention.default,
  aten.split.Tensor, aten.transpose.int, aten.view.default

With ``attention="sdpa"`` the MultiheadAttention plumbing (unflatten, unsqueeze, squeeze, contiguous,
permute) becomes ``aten.split.Tensor`` + ``operator.getitem``.
``aten._assert_tensor_metadata.default`` (no users, no output) is emitted by each ``.to(dtype)``;
graph consumers can skip it. ``aten.dropout.default`` appears because the export is in train() mode.

(:func:`exported_ops` recomputes these lists; ``python -m hapnb.zoo`` prints them as markdown.)
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelSpec",
    "ZOO_NAMES",
    "FactoryError",
    "build",
    "build_spec",
    "rebuild",
    "model_spec",
    "load_factory",
    "exported_ops",
    "zoo_options",
]

ZOO_NAMES: tuple[str, ...] = ("mlp", "vgg19", "vit", "bert", "bert-moe", "gpt", "lm")

# Options accepted by every zoo model besides its own (build's explicit keywords included).
_COMMON = ("devices", "seed", "dtype", "batch", "reduction")
_LM = ("layers", "seq", "hidden", "heads", "ff", "dropout", "vocab")
_OPTIONS: dict[str, tuple[str, ...]] = {
    "mlp": ("layers", "hidden", "input", "classes"),
    "vgg19": ("image", "classes", "width", "hidden", "dropout"),
    "vit": ("layers", "hidden", "heads", "ff", "dropout", "image", "patch", "classes", "attention"),
    "bert": (*_LM, "attention"),
    "bert-moe": (*_LM, "attention", "experts", "capacity_factor"),
    "gpt": _LM,
    "lm": (*_LM, "attention"),
}
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_WIKITEXT2_WORDS = 33278  # WikiText-2 word vocabulary incl. <eos>, as in the original benchmark


class FactoryError(ValueError):
    """A ``package.module:factory`` path could not be loaded, or its factory returned the wrong thing."""


def zoo_options(name: str) -> tuple[str, ...]:
    """The option names :func:`build` accepts for zoo model ``name`` (sorted).

    >>> zoo_options("mlp")
    ('batch', 'classes', 'devices', 'dtype', 'hidden', 'input', 'layers', 'reduction', 'seed')
    """
    if name not in _OPTIONS:
        raise ValueError(f"unknown zoo model {name!r}; valid names: {', '.join(ZOO_NAMES)}")
    return tuple(sorted({*_COMMON, *_OPTIONS[name]}))


# ---------------------------------------------------------------------------------------------------
# ModelSpec


def _is_json_value(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_is_json_value(x) for x in v)
    return False


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


def _thaw(v: Any) -> Any:
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class ModelSpec:
    """A JSON-able description of how to rebuild a model (stored inside plans).

    ``name`` is a zoo name or ``"package.module:factory"``; ``options`` are the sorted ``(key, value)``
    pairs given to :func:`build` (``devices`` and ``seed`` are always recorded, other options only when
    given, so defaults are re-derived on rebuild).

    >>> s = ModelSpec("bert", (("layers", 2), ("seed", 0)))
    >>> ModelSpec.from_json(s.to_json()) == s
    True
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        opts = tuple(sorted((str(k), _freeze(v)) for k, v in self.options))
        object.__setattr__(self, "options", opts)

    def to_json(self) -> dict:
        """``{"name": ..., "options": {key: value}}`` (plain JSON types only)."""
        return {"name": self.name, "options": {k: _thaw(v) for k, v in self.options}}

    @staticmethod
    def from_json(d: dict) -> ModelSpec:
        """Inverse of :meth:`to_json`; raises ValueError on a malformed object."""
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            raise ValueError(f"a model spec must be an object with a string 'name', got {d!r}")
        opts = d.get("options", {})
        if not isinstance(opts, dict):
            raise ValueError(f"model spec 'options' must be an object, got {opts!r}")
        return ModelSpec(d["name"], tuple(opts.items()))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments for :func:`build`."""
        return dict(self.options)

    def __str__(self) -> str:
        opts = " ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}({opts})"


# ---------------------------------------------------------------------------------------------------
# Building blocks


def _loss_ce(logits: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction=reduction)


def _sinusoid(seq: int, hidden: int) -> torch.Tensor:
    """Fixed sinusoidal positional encoding ``[1, seq, hidden]`` (Vaswani et al.)."""
    pos = torch.arange(seq, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, hidden, 2, dtype=torch.float32) * (-math.log(10000.0) / hidden))
    pe = torch.zeros(seq, hidden)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)[:, : hidden // 2]
    return pe.unsqueeze(0)


def _causal_mask(seq: int) -> torch.Tensor:
    """Additive causal mask ``[seq, seq]``: 0 on and below the diagonal, -inf above."""
    return torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)


class MLP(nn.Module):
    """``layers`` x (Linear + ReLU), a Linear head and cross-entropy."""

    def __init__(self, layers: int, input: int, hidden: int, classes: int, reduction: str) -> None:
        super().__init__()
        dims = [input] + [hidden] * layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], classes)
        self.reduction = reduction

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return _loss_ce(self.head(x), y, self.reduction)


_VGG19_PLAN = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M")
_VGG19_PLAN += (512, 512, 512, 512, "M")


class VGG19(nn.Module):
    """CIFAR-10 VGG19 with log_softmax + nll_loss (ReLUs are not in-place, for a functional graph)."""

    def __init__(self, width: float, hidden: int, classes: int, dropout: float, reduction: str) -> None:
        super().__init__()
        feats: list[nn.Module] = []
        c_in = 3
        for item in _VGG19_PLAN:
            if item == "M":
                feats.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                c_out = max(1, round(int(item) * width))
                feats += [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.ReLU()]
                c_in = c_out
        self.features = nn.Sequential(*feats)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(c_in * 49, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )
        self.reduction = reduction
        for m in self.modules():  # the original's init: Kaiming convs, N(0, 0.01) linears
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.avgpool(self.features(x))
        logits = self.classifier(torch.flatten(h, 1))
        return F.nll_loss(F.log_softmax(logits, dim=-1), y, reduction=self.reduction)


class SelfAttention(nn.Module):
    """Batch-first multi-head self-attention on ``F.scaled_dot_product_attention``.

    Same parameters (names, shapes, init) and math as ``nn.MultiheadAttention(batch_first=True)``, but
    the exported graph stays batch-major: packed in-projection, split, ``view(B, S, H, hd)``,
    transpose, SDPA, transpose, reshape, out-projection.
    """

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        hd = d // self.heads
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).split(d, dim=-1)
        q = q.view(b, s, self.heads, hd).transpose(1, 2)  # [B, H, S, hd]
        k = k.view(b, s, self.heads, hd).transpose(1, 2)
        v = v.view(b, s, self.heads, hd).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        return self.out_proj(a.transpose(1, 2).reshape(b, s, d))


class PostLNEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` (post-LN, ReLU, batch-first) rebuilt on :class:`SelfAttention`.

    Same parameter names and math (its state dict loads into the torch layer and vice versa).
    """

    def __init__(self, hidden: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = SelfAttention(hidden, heads, dropout)
        self.linear1 = nn.Linear(hidden, ff)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(ff, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm1(x + self.dropout1(self.self_attn(x, src_mask)))
        return self.norm2(x + self.dropout2(self.linear2(self.dropout(F.relu(self.linear1(x))))))


def _encoder_layer(hidden: int, heads: int, ff: int, dropout: float, attention: str) -> nn.Module:
    if attention == "sdpa":
        return PostLNEncoderLayer(hidden, heads, ff, dropout)
    return nn.TransformerEncoderLayer(hidden, heads, ff, dropout, batch_first=True, norm_first=False)


class ViT(nn.Module):
    """CIFAR ViT: conv patch embedding, cls token, learned positions, post-LN encoder layers."""

    def __init__(
        self,
        layers: int,
        hidden: int,
        heads: int,
        ff: int,
        dropout: float,
        image: int,
        patch: int,
        classes: int,
        reduction: str,
        attention: str = "torch",
    ) -> None:
        super().__init__()
        n_patches = (image // patch) ** 2
        self.patch = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, hidden) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            _encoder_layer(hidden, heads, ff, dropout, attention) for _ in range(layers)
        )
        self.head = nn.Linear(hidden, classes)
        self.reduction = reduction

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)  # [B, patches, hidden]
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        h = self.drop(h)
        for layer in self.layers:
            h = layer(h)
        return _loss_ce(self.head(h[:, 0]), y, self.reduction)


class MoEFFN(nn.Module):
    """Top-2 gated mixture of experts (GShard), gating computed per sequence.

    ``x [B, S, D]`` -> gate logits ``[B, S, E]`` -> softmax, top-2, capacity ``C`` per expert and
    sequence (tokens over capacity are dropped) -> ``dispatch``/``combine`` ``[B, S, E, C]`` -> the four
    einsums ``bsd,bsec->becd``, ``edh,becd->bech`` (ReLU), ``ehd,bech->becd``, ``becd,bsec->bsd``.
    """

    def __init__(self, hidden: int, ff: int, experts: int, capacity: int) -> None:
        super().__init__()
        self.experts = experts
        self.capacity = capacity
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ff))
        self.w2 = nn.Parameter(torch.empty(experts, ff, hidden))
        nn.init.uniform_(self.w1, -1.0 / math.sqrt(hidden), 1.0 / math.sqrt(hidden))
        nn.init.uniform_(self.w2, -1.0 / math.sqrt(ff), 1.0 / math.sqrt(ff))

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dispatch, combine)``, both ``[B, S, E, C]``; combine carries the gate's gradient."""
        e, c = self.experts, self.capacity
        probs = torch.softmax(self.gate(x), dim=-1)  # [B, S, E]
        _, top = torch.topk(probs, 2, dim=-1)  # [B, S, 2]
        mask1 = F.one_hot(top[..., 0], e).to(x.dtype)
        mask2 = F.one_hot(top[..., 1], e).to(x.dtype)
        pos1 = torch.cumsum(mask1, dim=1) - 1  # slot of each token in its expert's buffer
        mask1 = mask1 * (pos1 < c).to(x.dtype)
        pos2 = torch.cumsum(mask2, dim=1) - 1 + mask1.sum(dim=1, keepdim=True)
        mask2 = mask2 * (pos2 < c).to(x.dtype)
        g1 = (probs * mask1).sum(dim=-1)  # [B, S]
        g2 = (probs * mask2).sum(dim=-1)
        denom = torch.clamp(g1 + g2, min=torch.finfo(x.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
        loc1 = (pos1 * mask1).sum(dim=-1).to(torch.int64)  # [B, S]
        loc2 = (pos2 * mask2).sum(dim=-1).to(torch.int64)
        slot1 = F.one_hot(loc1, c).to(x.dtype)  # [B, S, C]
        slot2 = F.one_hot(loc2, c).to(x.dtype)
        combine = (g1[..., None, None] * mask1[..., None] * slot1[..., None, :]) + (
            g2[..., None, None] * mask2[..., None] * slot2[..., None, :]
        )
        dispatch = (combine > 0).to(x.dtype)
        return dispatch, combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dispatch, combine = self.routing(x)
        expert_in = torch.einsum("bsd,bsec->becd", x, dispatch)
        h = F.relu(torch.einsum("edh,becd->bech", self.w1, expert_in))
        out = torch.einsum("ehd,bech->becd", self.w2, h)
        return torch.einsum("becd,bsec->bsd", out, combine)


class MoEEncoderLayer(nn.Module):
    """Post-LN encoder layer whose FFN is :class:`MoEFFN` (attention as in TransformerEncoderLayer)."""

    def __init__(
        self, hidden: int, heads: int, ff: int, dropout: float, experts: int, capacity: int, attention: str
    ) -> None:
        super().__init__()
        self.self_attn: nn.Module
        if attention == "sdpa":
            self.self_attn = SelfAttention(hidden, heads, dropout)
        else:
            self.self_attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.moe = MoEFFN(hidden, ff, experts, capacity)
        self.norm1 = nn.LayerNorm(hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.self_attn, SelfAttention):
            a = self.self_attn(x, src_mask)
        else:
            a = self.self_attn(x, x, x, attn_mask=src_mask, need_weights=False)[0]
        x = self.norm1(x + self.dropout1(a))
        return self.norm2(x + self.dropout2(self.moe(x)))


class LM(nn.Module):
    """The measured H100 LM (hapnb/data/h100-lm-steps.json): token embedding + learned positions, post-LN
    ReLU encoder layers without a mask, a linear head and summed cross-entropy over next tokens."""

    def __init__(
        self, layers: int, seq: int, hidden: int, heads: int, ff: int, dropout: float, vocab: int,
        reduction: str, attention: str = "sdpa",
    ) -> None:  # fmt: skip
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.zeros(1, seq, hidden))
        blocks = [_encoder_layer(hidden, heads, ff, dropout, attention) for _ in range(layers)]
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(hidden, vocab)
        self.reduction = reduction

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return _loss_ce(logits.flatten(0, 1), targets.flatten(), self.reduction)


class CausalLM(nn.Module):
    """The paper's "BERT": scaled embedding + sinusoidal positions, post-LN encoder with a causal mask.

    With ``experts`` set, every odd layer (1, 3, ...) is a :class:`MoEEncoderLayer` ("BERT-MoE").
    """

    def __init__(
        self,
        layers: int,
        seq: int,
        hidden: int,
        heads: int,
        ff: int,
        dropout: float,
        vocab: int,
        reduction: str,
        experts: int | None = None,
        capacity: int | None = None,
        attention: str = "torch",
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.register_buffer("pos", _sinusoid(seq, hidden), persistent=False)
        self.register_buffer("mask", _causal_mask(seq), persistent=False)
        self.drop = nn.Dropout(dropout)
        blocks: list[nn.Module] = []
        for i in range(layers):
            if experts is not None and i % 2 == 1:
                assert capacity is not None
                blocks.append(MoEEncoderLayer(hidden, heads, ff, dropout, experts, capacity, attention))
            else:
                blocks.append(_encoder_layer(hidden, heads, ff, dropout, attention))
        self.layers = nn.ModuleList(blocks)
        self.decoder = nn.Linear(hidden, vocab)
        self.reduction = reduction
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # the original's init
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        pos, mask = self.pos, self.mask
        if s != mask.shape[0]:  # shorter sequences (static shapes: no slice op when seq is full length)
            pos, mask = pos[:, :s], mask[:s, :s]
        h = self.drop(self.embed(tokens) * math.sqrt(self.hidden) + pos)
        for layer in self.layers:
            h = layer(h, src_mask=mask)
        logits = self.decoder(h)
        return _loss_ce(logits.reshape(-1, self.vocab), targets.reshape(-1), self.reduction)


class GPTBlock(nn.Module):
    """Pre-norm block: LN, fused qkv, causal SDPA, out proj, residual; LN, 4x MLP with GELU, residual."""

    def __init__(self, hidden: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ff)
        self.fc2 = nn.Linear(ff, hidden)
        self.drop1 = nn.Dropout(dropout)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # [B, H, S, hd]
        k = k.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).contiguous().view(b, s, d)
        x = x + self.drop1(self.proj(a))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """Pre-norm GPT: token + learned positions, blocks, final LayerNorm, LM head (untied), cross-entropy."""

    def __init__(
        self,
        layers: int,
        seq: int,
        hidden: int,
        heads: int,
        ff: int,
        dropout: float,
        vocab: int,
        reduction: str,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads, ff, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.reduction = reduction

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, tokens.shape[1], device=tokens.device)
        h = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        return _loss_ce(logits.reshape(-1, self.vocab), targets.reshape(-1), self.reduction)


# ---------------------------------------------------------------------------------------------------
# build


def _need(cfg: dict[str, Any], key: str, kind: type, *, low: float = 1) -> Any:
    v = cfg[key]
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok or v < low:
        raise ValueError(
            f"option {key}={v!r} is invalid: expected {'an integer' if kind is int else 'a number'} >= {low}"
        )
    return v


def _resolve(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """Defaults for ``name`` updated with the given options, validated."""
    devices = _need(given, "devices", int)
    _need(given, "seed", int, low=0)
    cfg: dict[str, Any] = {"devices": devices, "seed": given["seed"], "dtype": "float32"}
    cfg.update(batch=32 * devices, reduction="mean")
    if name == "mlp":
        cfg.update(layers=4, hidden=1024, input=1024, classes=10)
    elif name == "vgg19":
        cfg.update(image=32, classes=10, width=1.0, hidden=4096, dropout=0.1)
    elif name == "vit":
        cfg.update(layers=12, hidden=768, heads=12, ff=None, dropout=0.1, image=32, patch=4, classes=10)
        cfg.update(attention="sdpa")
    elif name == "lm":
        cfg.update(layers=2, seq=64, hidden=256, heads=None, ff=None, dropout=0.0, vocab=8192)
        cfg.update(attention="sdpa", reduction="sum")
    else:
        vocab = devices * (_WIKITEXT2_WORDS // devices + 1) if name != "gpt" else 32000
        cfg.update(layers=12, seq=128, hidden=768, heads=12, ff=None, dropout=0.1, vocab=vocab)
        if name != "gpt":
            cfg.update(attention="sdpa")
        if name == "bert-moe":
            cfg.update(experts=2 * devices, capacity_factor=2.5)
    cfg.update({k: v for k, v in given.items() if v is not None})
    if cfg.get("ff", 0) is None:
        cfg["ff"] = 4 * cfg["hidden"]
    if name == "lm" and cfg.get("heads") is None:
        cfg["heads"] = max(1, cfg["hidden"] // 64)

    _need(cfg, "batch", int)
    if cfg["dtype"] not in _DTYPES:
        raise ValueError(f"option dtype={cfg['dtype']!r} is invalid: expected one of {', '.join(_DTYPES)}")
    if cfg.get("attention", "torch") not in ("torch", "sdpa"):
        raise ValueError(f"option attention={cfg['attention']!r} is invalid: expected 'torch' or 'sdpa'")
    if cfg["reduction"] not in ("mean", "sum"):
        raise ValueError(f"option reduction={cfg['reduction']!r} is invalid: expected 'mean' or 'sum'")
    for key in ("layers", "hidden", "heads", "ff", "input", "classes", "seq", "vocab", "experts", "patch"):
        if key in cfg:
            _need(cfg, key, int)
    for key in ("dropout", "width", "capacity_factor"):
        if key in cfg:
            _need(cfg, key, float, low=0)
    if "dropout" in cfg and cfg["dropout"] >= 1:
        raise ValueError(f"option dropout={cfg['dropout']!r} is invalid: expected 0 <= dropout < 1")
    if "heads" in cfg and cfg["hidden"] % cfg["heads"]:
        raise ValueError(
            f"option heads={cfg['heads']} must divide hidden={cfg['hidden']} (attention splits hidden)"
        )
    if name == "vgg19":
        _need(cfg, "image", int, low=32)  # five 2x2 max-pools
    if name == "vit":
        _need(cfg, "image", int)
        if cfg["image"] % cfg["patch"]:
            raise ValueError(f"option patch={cfg['patch']} must divide image={cfg['image']}")
    if name == "bert-moe":
        cfg["capacity"] = math.ceil(cfg["seq"] / cfg["experts"] * cfg["capacity_factor"])
        if cfg["capacity"] < 1:
            raise ValueError(f"capacity_factor={cfg['capacity_factor']} gives an expert capacity of 0")
    return cfg


def _make(name: str, cfg: dict[str, Any], gen: torch.Generator) -> tuple[nn.Module, tuple]:
    b, red = cfg["batch"], cfg["reduction"]
    if name == "mlp":
        model: nn.Module = MLP(cfg["layers"], cfg["input"], cfg["hidden"], cfg["classes"], red)
        x = torch.randn(b, cfg["input"], generator=gen)
        return model, (x, torch.randint(0, cfg["classes"], (b,), generator=gen))
    if name in ("vgg19", "vit"):
        if name == "vgg19":
            model = VGG19(cfg["width"], cfg["hidden"], cfg["classes"], cfg["dropout"], red)
        else:
            keys = ("layers", "hidden", "heads", "ff", "dropout", "image", "patch", "classes")
            model = ViT(*(cfg[k] for k in keys), red, cfg["attention"])
        img = torch.randn(b, 3, cfg["image"], cfg["image"], generator=gen)
        return model, (img, torch.randint(0, cfg["classes"], (b,), generator=gen))
    keys = ("layers", "seq", "hidden", "heads", "ff", "dropout", "vocab")
    if name == "gpt":
        model = GPT(*(cfg[k] for k in keys), red)
    elif name == "lm":
        model = LM(*(cfg[k] for k in keys), red, attention=cfg["attention"])
        tokens = torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=gen)
        return model, (tokens, tokens.roll(-1, 1))
    elif name == "bert":
        model = CausalLM(*(cfg[k] for k in keys), red, attention=cfg["attention"])
    else:
        moe = dict(experts=cfg["experts"], capacity=cfg["capacity"], attention=cfg["attention"])
        model = CausalLM(*(cfg[k] for k in keys), red, **moe)
    tokens = torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=gen)
    return model, (tokens, torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=gen))


def build(
    name: str,
    *,
    devices: int = 8,
    layers: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> tuple[nn.Module, tuple[torch.Tensor, ...], ModelSpec]:
    """Build zoo model ``name`` (or load factory ``"package.module:factory"``).

    Returns ``(model, example_inputs, spec)`` with ``model(*example_inputs)`` the scalar loss, the model
    in train() mode. ``batch`` is global (default 32 x devices); ``overrides`` set other options (see
    :func:`zoo_options`), e.g. ``hidden=32, heads=4, vocab=64`` for a tiny config. Unknown names or
    options raise ValueError listing the valid ones.

    For a factory path, ``layers``/``batch``/``seq`` (when given) and ``overrides`` are passed to the
    factory as keywords, ``devices`` and ``seed`` only if its signature names them; the factory runs
    under ``torch.manual_seed(seed)``.

    >>> model, (x, y), spec = build("mlp", devices=1, hidden=8, input=4, layers=1)
    >>> tuple(x.shape), str(spec)
    ((32, 4), 'mlp(devices=1 hidden=8 input=4 layers=1 seed=0)')
    """
    spec = model_spec(name, devices=devices, layers=layers, batch=batch, seq=seq, seed=seed, **overrides)
    given = {k: _thaw(v) for k, v in spec.options}

    if ":" in name:
        fkw = {k: v for k, v in given.items() if k not in ("devices", "seed")}
        factory = _import_factory(name)
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):  # builtins without a signature
            params = {}
        for k in ("devices", "seed"):
            if k in params:
                fkw[k] = given[k]
        torch.manual_seed(seed)
        model, inputs = _call_factory(name, factory, fkw)
        return model, inputs, spec

    if name not in _OPTIONS:
        raise ValueError(
            f"unknown model {name!r}: valid zoo names are {', '.join(ZOO_NAMES)}, "
            "or give a factory as 'package.module:factory'"
        )
    valid = zoo_options(name)
    bad = sorted(set(given) - set(valid))
    if bad:
        raise ValueError(
            f"model {name!r} does not take option(s) {', '.join(bad)}; valid: {', '.join(valid)}"
        )
    cfg = _resolve(name, given)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, inputs = _make(name, cfg, gen)
    dtype = _DTYPES[cfg["dtype"]]
    if dtype != torch.float32:
        model = model.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    model.train()
    model.zoo_config = dict(cfg)  # resolved options (defaults filled in), for display
    return model, inputs, spec


def model_spec(name: str, **options: Any) -> ModelSpec:
    """The :class:`ModelSpec` :func:`build` records for ``build(name, **options)``, made without building
    (options are checked to be JSON values only): ``model_spec("bert", devices=2)`` is
    ``bert(devices=2 seed=0)``."""
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    given: dict[str, Any] = {"devices": options.pop("devices", 8), "seed": options.pop("seed", 0)}
    given.update({k: v for k, v in options.items() if v is not None or k not in ("layers", "batch", "seq")})
    for k, v in given.items():
        if not _is_json_value(v):
            raise ValueError(
                f"option {k}={v!r} of model {name!r} is not a JSON value (number, string, bool or list); "
                "plans must be able to record it"
            )
    return ModelSpec(name, tuple(given.items()))


def build_spec(spec: ModelSpec) -> tuple[nn.Module, tuple[torch.Tensor, ...], ModelSpec]:
    """Rebuild the model a :class:`ModelSpec` describes (same seed -> same weights and inputs)."""
    kwargs = spec.kwargs
    kwargs = {k: (_thaw(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
    return build(spec.name, **kwargs)


def rebuild(
    spec: dict | None, missing: Exception | None = None
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Model and inputs of a plan's recorded spec (JSON); raises ``missing`` (else ValueError) if there is none."""
    if not spec:
        raise missing or ValueError('no model spec ({"name": ..., "options": ...}) to rebuild the model from')
    return build_spec(ModelSpec.from_json(spec))[:2]


# ---------------------------------------------------------------------------------------------------
# factories


def _import_factory(path: str) -> Callable[..., Any]:
    mod_name, sep, attr = path.rpartition(":")
    if not sep or not mod_name or not attr:
        raise FactoryError(
            f"factory path {path!r} is malformed: expected 'package.module:factory' (or 'file.py:factory')"
        )
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise FileNotFoundError(f"no such file: {mod_name}")
            mod_id = "_hapnb_factory_" + os.path.splitext(os.path.basename(mod_name))[0]
            ispec = importlib.util.spec_from_file_location(mod_id, mod_name)
            assert ispec is not None and ispec.loader is not None
            module = importlib.util.module_from_spec(ispec)
            ispec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(mod_name)
            except ModuleNotFoundError as e:
                # console scripts do not put the working directory on sys.path; python -m does
                cwd = os.getcwd()
                top = mod_name.split(".")[0]
                if e.name not in (top, mod_name) or cwd in sys.path or "" in sys.path:
                    raise
                sys.path.insert(0, cwd)
                try:
                    module = importlib.import_module(mod_name)
                finally:
                    sys.path.remove(cwd)
    except Exception as e:
        raise FactoryError(
            f"cannot import module {mod_name!r} of factory {path!r}: {type(e).__name__}: {e}. "
            "Check that it is importable (on PYTHONPATH or run from its folder)."
        ) from e
    for part in attr.split("."):
        if not hasattr(module, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise FactoryError(
                f"module {mod_name!r} has no attribute {attr!r} (factory {path!r}); "
                f"callables there: {', '.join(names) or 'none'}"
            )
        module = getattr(module, part)
    if not callable(module):
        raise FactoryError(f"factory {path!r} is not callable (it is a {type(module).__name__})")
    return module


def _call_factory(
    path: str, factory: Callable[..., Any], options: dict[str, Any]
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**options)
        except TypeError as e:
            raise FactoryError(f"factory {path!r}{sig} cannot take options {options}: {e}") from e
    result = factory(**options)
    if (
        not isinstance(result, (tuple, list))
        or len(result) != 2
        or not isinstance(result[0], nn.Module)
        or not isinstance(result[1], (tuple, list))
        or not all(isinstance(t, torch.Tensor) for t in result[1])
    ):
        got = type(result).__name__
        if isinstance(result, (tuple, list)):
            got += "(" + ", ".join(type(r).__name__ for r in result) + ")"
        raise FactoryError(
            f"factory {path!r} must return (nn.Module, tuple of tensors) with model(*inputs) the "
            f"scalar loss; it returned {got}"
        )
    return result[0], tuple(result[1])


def load_factory(path: str, **options: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Import ``"package.module:factory"`` (or ``"path/file.py:factory"``) and return ``factory(**options)``.

    The result must be ``(model, example_inputs)``; anything else raises :class:`FactoryError` (a
    ValueError) naming the path.

    >>> model, inputs = load_factory("examples.factories:small_convnet", batch=2)
    >>> model(*inputs).shape
    torch.Size([])
    """
    return _call_factory(path, _import_factory(path), options)


# ---------------------------------------------------------------------------------------------------
# introspection


def exported_ops(model: nn.Module, inputs: tuple[torch.Tensor, ...], *, strict: bool = False) -> list[str]:
    """Sorted ``call_function`` targets of ``torch.export.export(model, inputs)`` (model in train mode)."""
    ep = torch.export.export(model, inputs, strict=strict)
    return sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})


TINY: dict[str, dict[str, Any]] = {
    "mlp": dict(layers=2, hidden=32, input=16, batch=8),
    "vgg19": dict(width=1 / 16, hidden=32, batch=4),
    "vit": dict(layers=2, hidden=32, heads=4, image=8, batch=8),
    "bert": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8),
    "bert-moe": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8, experts=4),
    "gpt": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8),
    "lm": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8),
}
"""Small configurations of every zoo model (fast to build, trace and run; used by tests)."""


_OPS_NOTES = """\
Notes for rule authors:

* `<built-in function getitem>` is `operator.getitem` on a multi-output op (split, topk, unbind).
* `aten._assert_tensor_metadata.default` has no users and no output; export emits one per `.to(dtype)`.
  Skip it.
* `aten.dropout.default` (args: input, p, train=True) is there because export runs in train() mode;
  SDPA also gets `dropout_p` > 0 in train mode for `attention="torch"` and `"sdpa"` (not for gpt).
* `attention="torch"` (the default for vit, bert, bert-moe) is `nn.TransformerEncoderLayer` /
  `nn.MultiheadAttention`. Its export goes: transpose(1, 0) to [S, B, D], linear (packed in_proj),
  unflatten(-1, [3, D]), unsqueeze(0), transpose(0, -2), squeeze(-2), contiguous, select x3,
  view [S, B*H, hd], transpose(0, 1), view [B, H, S, hd], SDPA (attn_mask = the causal buffer,
  unsqueezed twice, for bert), permute [2, 0, 1, 3], reshape [S*B, D], linear (out_proj),
  view [S, B, D], transpose(1, 0). Batch is merged with heads, then with seq (as the inner dim) there, so
  a batch shard is not a contiguous slice of the merged dim.
* `attention="sdpa"` gives the same parameters and math with a batch-major graph: linear (packed
  in_proj), split, view [B, S, H, hd], transpose(1, 2), SDPA, transpose(1, 2), reshape [B, S, D], linear.
* bert-moe gating (softmax, topk, one_hot, cumsum over the sequence dim, lt, sum, clamp, div, gt, to) is
  per sequence: batch-shardable, but not along the sequence (cumsum and the capacity count run over it).
  The four einsums are `bsd,bsec->becd`, `edh,becd->bech`, `ehd,bech->becd`, `becd,bsec->bsd`.
"""


def _ops_markdown() -> str:
    """The aten ops of every zoo model and example factory, as markdown (for docs/zoo-ops.md)."""
    lines = [
        "# aten ops of the zoo models",
        "",
        f"`torch.export.export(model, inputs)` in train() mode, torch {torch.__version__}, small configs",
        "(`hapnb.zoo.TINY`; the ops do not depend on sizes). Regenerate the file with",
        "`python -m hapnb.zoo > docs/zoo-ops.md`.",
        "",
        _OPS_NOTES,
    ]
    cases: list[tuple[str, Callable[[], tuple[nn.Module, tuple]]]] = []
    for name in ZOO_NAMES:
        cases.append((name, lambda name=name: build(name, devices=2, **TINY[name])[:2]))
        if "attention" in _OPTIONS[name]:
            sdpa = lambda name=name: build(name, devices=2, attention="sdpa", **TINY[name])[:2]
            cases.append((f'{name} (attention="sdpa")', sdpa))
    for fac in ("examples.factories:small_convnet", "examples.factories:prenorm_lm"):
        cases.append((fac, lambda fac=fac: load_factory(fac)))
    for title, make in cases:
        model, inputs = make()
        ops = exported_ops(model, inputs, strict=False)
        strict_ops = exported_ops(model, inputs, strict=True)
        same = "same ops" if ops == strict_ops else f"strict differs: {sorted(set(strict_ops) ^ set(ops))}"
        lines.append(f"## {title}\n\nNon-strict and strict export both work ({same}).\n")
        lines.append(", ".join(f"`{op}`" for op in ops))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(_ops_markdown())
