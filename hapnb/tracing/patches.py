"""Trace-time patches of torch library code that torch.export cannot capture as written.

* :func:`static_mask_hints`: ``torch.nn.Transformer`` and its decoder, given a ``tgt_mask`` but no
  ``tgt_is_causal``, compare the mask's values with a causal mask to decide a fast-path hint
  (``bool((mask == causal).all())``): a branch on tensor values that torch.export refuses (``Could not
  guard on data-dependent expression``). While tracing, the hint is taken only as the caller gives it; the
  mask is then applied as given, which computes the same attention (the hint only lets a kernel skip it).

>>> import torch
>>> m = torch.nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)
>>> x, mask = torch.randn(2, 4, 8), torch.nn.Transformer.generate_square_subsequent_mask(4)
>>> with static_mask_hints():
...     ep = torch.export.export(m, (x, x), {"tgt_mask": mask}, strict=False)
>>> ep.module()(x, x, tgt_mask=mask).shape
torch.Size([2, 4, 8])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["static_mask_hints"]


def _given_hint(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
    """``torch.nn.modules.transformer._detect_is_causal_mask`` without looking at the mask's values."""
    return is_causal is True


@contextmanager
def static_mask_hints() -> Iterator[None]:
    """While the block runs, torch.nn's Transformer modules take a mask's causality hint only as given
    (see the module doc)."""
    import torch.nn.modules.transformer as transformer

    own = transformer._detect_is_causal_mask
    transformer._detect_is_causal_mask = _given_hint
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = own
