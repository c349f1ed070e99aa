"""Example model factories for ``hapnb plan --model examples.factories:NAME`` and the docs.

A factory takes keyword options and returns ``(model, example_inputs)`` where ``model(*example_inputs)``
is the scalar training loss (the model includes its loss; targets are among the inputs).

>>> model, inputs = small_convnet(batch=4)
>>> model(*inputs).shape
torch.Size([])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SmallConvNet(nn.Module):
    """conv -> relu -> max-pool -> conv -> relu -> max-pool -> linear -> cross-entropy (CIFAR-sized)."""

    def __init__(self, channels: int = 8, classes: int = 10, image: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1)
        self.fc = nn.Linear(2 * channels * (image // 4) ** 2, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return F.cross_entropy(self.fc(h.flatten(1)), y)


def small_convnet(
    batch: int = 8, channels: int = 8, classes: int = 10, image: int = 16
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A small conv net on random ``batch x 3 x image x image`` images with random labels."""
    model = SmallConvNet(channels, classes, image)
    x = torch.randn(batch, 3, image, image)
    y = torch.randint(0, classes, (batch,))
    return model, (x, y)


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU written out with ``torch.erf`` (an op a sharding rule table is unlikely to cover)."""
    return 0.5 * x * (1.0 + torch.erf(x / 2**0.5))


class PrenormBlock(nn.Module):
    """Pre-norm block: LN, causal attention (explicit softmax), residual; LN, erf-GELU MLP, residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).reshape(b, s, 3, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.matmul(q, k.transpose(-2, -1)) / hd**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = torch.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        a = torch.matmul(att, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.fc2(erf_gelu(self.fc1(self.ln2(x))))


class PrenormLM(nn.Module):
    """A tiny pre-norm LM whose positions come from ``torch.cumsum`` over a ones mask."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(PrenormBlock(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.cumsum(torch.ones_like(tokens), dim=1) - 1
        h = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def prenorm_lm(
    batch: int = 4, seq: int = 8, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A tiny pre-norm causal LM on random tokens (next-token targets)."""
    model = PrenormLM(vocab, hidden, heads, layers, seq)
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class CumulativeMixLM(nn.Module):
    """A tiny LM whose token mixing is a running log-sum-exp over the sequence (``torch.logcumsumexp``:
    a nonlinear scan, so its rule shards the batch and hidden dims, never the sequence it runs along)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + torch.logcumsumexp(self.mix(self.norm1(h)), dim=1)
        logits = self.head(self.norm2(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def cumulative_mix_lm(
    batch: int = 4, seq: int = 8, vocab: int = 64, hidden: int = 32
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`CumulativeMixLM` on random tokens (next-token targets)."""
    model = CumulativeMixLM(vocab, hidden)
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class TiedLM(nn.Module):
    """A tiny LM whose output projection reuses the embedding matrix (weight tying, as in GPT-2): one
    parameter with two uses, so its gradient is the sum of both and one copy is updated."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: the same Parameter under two names

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + torch.tanh(self.mix(self.norm(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tied_lm(
    batch: int = 4, seq: int = 8, vocab: int = 32, hidden: int = 16
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`TiedLM` on random tokens (next-token targets)."""
    model = TiedLM(vocab, hidden)
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class SmallUNet(nn.Module):
    """A denoising-diffusion UNet in miniature: the noisy image ``sqrt(a) x0 + sqrt(1 - a) noise`` at step
    ``t``, a sinusoidal step embedding, conv + GroupNorm + SiLU blocks, average-pool down, nearest
    ``F.interpolate`` up, a skip ``cat``, and the MSE of the predicted noise."""

    def __init__(self, channels: int = 16, steps: int = 1000) -> None:
        super().__init__()
        c = channels
        self.steps = steps
        self.embed = nn.Sequential(nn.Linear(c, c), nn.SiLU(), nn.Linear(c, c))
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 2 * c, 3, padding=1))
        self.up = nn.Sequential(nn.GroupNorm(4, 3 * c), nn.SiLU(), nn.Conv2d(3 * c, c, 3, padding=1))
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def step_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = self.inp.out_channels // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) * (9.21 / half))
        angle = t[:, None].float() * freqs[None]
        return self.embed(torch.cat([angle.sin(), angle.cos()], -1))

    def forward(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = (1 - t.float() / self.steps)[:, None, None, None]
        x = a.sqrt() * x0 + (1 - a).sqrt() * noise
        h = self.inp(x) + self.step_embedding(t)[:, :, None, None]
        low = self.down(F.avg_pool2d(h, 2))
        h = self.up(torch.cat([F.interpolate(low, scale_factor=2, mode="nearest"), h], 1))
        return F.mse_loss(self.out(h), noise)


def small_unet(
    batch: int = 8, channels: int = 16, image: int = 16
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`SmallUNet` on random images, noise and diffusion steps."""
    model = SmallUNet(channels)
    x0, noise = torch.randn(batch, 3, image, image), torch.randn(batch, 3, image, image)
    return model, (x0, noise, torch.randint(0, model.steps, (batch,)))


class SmallAutoencoder(nn.Module):
    """A convolutional autoencoder: strided convs down, transposed convs (``ConvTranspose2d``) up, the MSE
    of the reconstruction; a ``Conv3d`` over a stack of two copies of the input first (a video model's
    first layer, in miniature)."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        c = channels
        self.stem = nn.Conv3d(3, c, (2, 3, 3), padding=(0, 1, 1))
        self.enc = nn.Conv2d(c, 2 * c, 4, stride=2, padding=1)
        self.dec1 = nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1)
        self.dec2 = nn.ConvTranspose2d(c, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(torch.stack([x, x.flip(-1)], 2)).squeeze(2)
        h = F.relu(self.enc(F.relu(h)))
        return F.mse_loss(self.dec2(F.relu(self.dec1(h))), x)


def small_autoencoder(
    batch: int = 8, channels: int = 8, image: int = 16
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """:class:`SmallAutoencoder` on random images."""
    return SmallAutoencoder(channels), (torch.randn(batch, 3, image, image),)
