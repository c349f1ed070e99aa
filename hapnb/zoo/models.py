"""The zoo's models as plain PyTorch modules: each one's ``forward`` returns the scalar training loss
(its targets are among its inputs). Built with their options by :func:`hapnb.zoo.build`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP", "VGG19", "SelfAttention", "PostLNEncoderLayer", "ViT", "MoEFFN", "MoEEncoderLayer", "LM",
    "CausalLM", "GPTBlock", "GPT",
]  # fmt: skip

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
        # persistent: tables in the state dict stay in the program (export folds non-persistent ones)
        self.register_buffer("pos", _sinusoid(seq, hidden))
        self.register_buffer("mask", _causal_mask(seq))
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
