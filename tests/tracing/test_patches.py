"""Trace-time patches (hapnb.tracing.patches): torch.nn.Transformer with a causal target mask, as its own
tutorial writes it, traces (torch.export refused the mask's value comparison) and verifies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapnb as hap
from hapnb.tracing.patches import static_mask_hints


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (encoder-decoder, batch first) with a causal target mask made in ``forward``."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.tr = nn.Transformer(d, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.tr(self.emb(src), self.emb(tgt), tgt_mask=mask)
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt.flatten())


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (8, 6), generator=gen), torch.randint(0, 32, (8, 5), generator=gen)


def test_transformer_with_a_causal_mask_traces_and_computes_the_model() -> None:
    torch.manual_seed(0)
    m = Seq2Seq()
    g = hap.trace(m, _tokens())
    from hapnb.runtime.reference import reference_module

    got = reference_module(g)(*_tokens())
    torch.testing.assert_close(got, m(*_tokens()), rtol=1e-6, atol=1e-6)
    import torch.nn.modules.transformer as tr

    assert tr._detect_is_causal_mask.__name__ == "_detect_is_causal_mask"  # the patch is gone after tracing


def test_the_hint_is_kept_where_the_caller_gives_it() -> None:
    import torch.nn.modules.transformer as tr

    mask = nn.Transformer.generate_square_subsequent_mask(3)
    with static_mask_hints():
        assert tr._detect_is_causal_mask(mask, True, 3) is True
        assert tr._detect_is_causal_mask(mask, None, 3) is False  # torch would compare the values: True


@pytest.mark.slow
def test_transformer_plan_shards_the_batch_and_verifies() -> None:
    plan = hap.synthesize(Seq2Seq(), "1xV100+1xP100", example_inputs=_tokens(), pins={"src": hap.Shard(0)})
    assert not plan.fallback_ops
    rep = hap.verify(plan, nproc=2, steps=2, timeout=120)
    assert rep.ok, rep.text()
