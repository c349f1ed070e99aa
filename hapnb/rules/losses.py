"""Losses: the ``loss`` table (cross entropy, NLL, MSE).

Algebra: a loss is a sum (or mean) of per-sample terms, so sharding the batch (or an extra per-sample
dim) of input and target gives a partial sum ``R``; ``reduction='mean'`` divides by the GLOBAL count
(of non-ignored targets for cross entropy/NLL, of elements for MSE), so the partials add up to the
single-device loss exactly (the gradient semantics of docs/architecture.md §5). ``reduction='none'`` keeps the shard
(``G``). Class weights stay ``I``.
"""

from __future__ import annotations

from ..ir.forms import G, I, R
from ..ir.graph import Graph, Op
from .registry import LocalCall, LocalContext, Strategy, _arg, _Cand, _default_local, _numel, _register, _tin


def _gen_loss(g: Graph, op: Op) -> list[_Cand]:
    x, tgt = _tin(g, op, 0), _tin(g, op, 1)
    reduction = int(_arg(op, 3, 1))
    rest = (I,) * (len(op.inputs) - 2)
    prob = tgt.is_float
    cands = []
    # sample dims: input 0 <-> target 0, input k (k >= 2) <-> target k-1 (prob target: same dim)
    pairs = [(0, 0)] + [(k, k if prob else k - 1) for k in range(2, x.ndim)]
    if x.ndim == 1:
        pairs = []
    for dx, dt in pairs:
        if x.shape[dx] < 2:
            continue
        if reduction == 0:
            out_d = dx if dx == 0 else dx - 1
            cands.append(_Cand(f"shard{dx}", (G(dx), G(dt)) + rest, (G(out_d),)))
        else:
            cands.append(_Cand(f"reduce{dx}", (G(dx), G(dt)) + rest, (R,)))
    return cands


def _local_loss(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if not s.outputs[0].is_reduce:
        return _default_local(g, op, s, ctx)
    kind = "ce" if op.target.startswith("aten.cross_entropy") else "nll"
    x = _tin(g, op, 0)
    count = x.numel // (x.shape[1] if x.ndim > 1 else x.numel)
    smoothing = float(_arg(op, 5, 0.0)) if kind == "ce" else 0.0
    return LocalCall(
        hops.loss_partial,
        (kind, op.args[0], op.args[1], op.args[2], int(op.args[3]), int(op.args[4]), smoothing, count),
    )


_register(
    [
        "aten.cross_entropy_loss.default",
        "aten.nll_loss_nd.default",
        "aten.nll_loss.default",
        "aten.nll_loss2d.default",
    ],
    "loss",
    _gen_loss,
    local=_local_loss,
    flops=lambda i, o, a, k: 6.0 * _numel(i[0]),
    reason="per-sample losses: a sharded batch (or extra dim) sums to R; mean divides by the "
    "global count of non-ignored targets",
)


def _gen_mse(g: Graph, op: Op) -> list[_Cand]:
    a = _tin(g, op, 0)
    red = int(_arg(op, 2, 1))
    if len(op.inputs) != 2 or _tin(g, op, 1).shape != a.shape:
        return []
    return [_Cand(f"shard{d}", (G(d), G(d)), (G(d),) if red == 0 else (R,)) for d in range(a.ndim)]


def _local_mse(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    if not s.outputs[0].is_reduce:
        return _default_local(g, op, s, ctx)
    return LocalCall(hops.mse_partial, (op.args[0], op.args[1], int(op.args[2]), _tin(g, op, 0).numel))


_register(
    ["aten.mse_loss.default"],
    "loss",
    _gen_mse,
    local=_local_mse,
    flops=lambda i, o, a, k: 3.0 * _numel(i[0]),
    reason="elementwise squared error: shards sum to R (mean divides by the static global count)",
)
