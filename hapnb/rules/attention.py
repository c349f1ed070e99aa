"""Attention: the ``attention`` table (``scaled_dot_product_attention``).

Algebra: ``softmax(q k^T / sqrt(E) + mask) v`` is independent across batch and heads (q, k, v and the
mask share the leading dims; grouped-query heads where k/v heads differ from q heads do not shard),
and across query rows when there is no causal offset (k and v stay ``I``, the mask's rows follow).
Flops: ``2*B*H*L*S*(E+Ev)`` for the two products plus ``5*B*H*L*S`` for scale and softmax.
"""

from __future__ import annotations

from ..ir.forms import Form, G, I
from ..ir.graph import Graph, Op, TensorArg
from .registry import _arg, _Cand, _numel, _register, _tin


def _gen_sdpa(g: Graph, op: Op) -> list[_Cand]:
    q, k, v = (_tin(g, op, i) for i in range(3))
    has_mask = isinstance(_arg(op, 3), TensorArg)
    mask = _tin(g, op, op.args[3].index) if has_mask else None
    nd = q.ndim
    cands = []

    def mask_form(d: int) -> tuple[Form, ...]:
        if mask is None:
            return ()
        dm = d - (nd - mask.ndim)
        return (G(dm) if dm >= 0 and mask.shape[dm] == q.shape[d] else I,)

    for d in range(nd - 2):
        if q.shape[d] < 2:
            continue
        kv = tuple(G(d) if t.shape[d] == q.shape[d] else I for t in (k, v))
        if any(t.shape[d] not in (1, q.shape[d]) for t in (k, v)):
            continue  # grouped-query heads: k/v heads differ from q heads
        cands.append(_Cand(f"shard{d}", (G(d),) + kv + mask_form(d), (G(d),)))
    causal = bool(_arg(op, 5, False))
    if not causal and q.shape[nd - 2] >= 2:
        cands.append(_Cand("rows", (G(nd - 2), I, I) + mask_form(nd - 2), (G(nd - 2),)))
    return cands


def _f_sdpa(ins: list, outs: list, args: tuple, kw: dict) -> float:
    q, k, v = ins[0], ins[1], ins[2]
    lead = _numel(q[:-2])
    L, E = q[-2], q[-1]
    S, Ev = k[-2], v[-1]
    return float(2 * lead * L * S * (E + Ev) + 5 * lead * L * S)


_register(
    ["aten.scaled_dot_product_attention.default"],
    "attention",
    _gen_sdpa,
    flops=_f_sdpa,
    reason="attention is independent across batch and heads, and across query rows (non-causal)",
)
