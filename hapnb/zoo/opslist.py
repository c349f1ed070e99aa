"""The aten ops each zoo model exports to (what the rules must cover), and how to list them.

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

import torch
from torch import nn

__all__ = ["exported_ops", "OPS_NOTES"]


def exported_ops(model: nn.Module, inputs: tuple[torch.Tensor, ...], *, strict: bool = False) -> list[str]:
    """Sorted ``call_function`` targets of ``torch.export.export(model, inputs)`` (model in train mode)."""
    ep = torch.export.export(model, inputs, strict=strict)
    return sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})


OPS_NOTES = """\
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
  a batch shard is not a contiguous slice of the merged dim. hapnb's tracing turns reshape [S*B, D],
  out_proj, view [S, B, D] into reshape [S, B, D], out_proj, an identity view (hapnb/tracing/folds.py),
  so the batch stays sharded through the attention.
* `attention="sdpa"` gives the same parameters and math with a batch-major graph: linear (packed
  in_proj), split, view [B, S, H, hd], transpose(1, 2), SDPA, transpose(1, 2), reshape [B, S, D], linear.
* bert-moe gating (softmax, topk, one_hot, cumsum over the sequence dim, lt, sum, clamp, div, gt, to) is
  per sequence: batch-shardable, but not along the sequence (cumsum and the capacity count run over it).
  The four einsums are `bsd,bsec->becd`, `edh,becd->bech`, `ehd,bech->becd`, `becd,bsec->bsd`.
"""
