"""Contractions: the ``matmul`` table (linear, mm, bmm, matmul, addmm, baddbmm, einsum, mv, dot) and
the ``embedding`` lookup.

Algebra: ONE generator for every contraction, written as einsum subscripts. An index kept in the
output shards every operand that has it (operands that broadcast it stay ``I``) and the output; a
contracted index shards every operand that has it and makes the output ``R`` (each rank holds a
partial sum); one ``R`` operand with all others ``I`` gives ``R`` (multilinearity). A bias follows the
output's sharded index (and counts on rank 0 only under ``R``). SFB (sufficient factor broadcasting)
variants shard a batch index with a replicated 2-D weight. Flops: 2 x the product of all index
extents, plus one per output element for a bias.

An embedding lookup ``W[idx]`` is the contraction ``one_hot(idx) @ W`` over the vocabulary: each index
and each hidden unit is independent (``G``), and a vocabulary shard gives masked partial rows (``R``).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

from ..ir.forms import Form, G, I, R
from ..ir.graph import Graph, Op
from .registry import (
    Flops,
    LocalCall,
    LocalContext,
    Strategy,
    _Cand,
    _default_local,
    _is_float,
    _kw,
    _numel,
    _register,
    _tin,
    _tout,
)


@dataclass(frozen=True)
class _Ein:
    ins: tuple[str, ...]  # subscripts per operand
    out: str
    sizes: tuple[tuple[int, ...], ...]  # per operand shapes


def _einsum_cands(e: _Ein, out_shape: Sequence[int], float_ops: Sequence[bool]) -> list[_Cand]:
    cands = []
    letters = []
    for s in e.ins:
        for c in s:
            if c not in letters:
                letters.append(c)
    for c in letters:
        if c in e.out:
            p = e.out.index(c)
            if out_shape[p] < 2:
                continue
            ins = tuple(
                G(s.index(c)) if c in s and sz[s.index(c)] == out_shape[p] else I
                for s, sz in zip(e.ins, e.sizes)
            )
            cands.append(_Cand(f"shard:{c}", ins, (G(p),)))
        else:
            size = max(sz[s.index(c)] for s, sz in zip(e.ins, e.sizes) if c in s)
            if size < 2:
                continue
            if any(c in s and sz[s.index(c)] != size for s, sz in zip(e.ins, e.sizes)):
                continue
            ins = tuple(G(s.index(c)) if c in s else I for s in e.ins)
            cands.append(_Cand(f"reduce:{c}", ins, (R,)))
    for k in range(len(e.ins)):
        if float_ops[k]:
            ins = tuple(R if j == k else I for j in range(len(e.ins)))
            cands.append(_Cand(f"partial{k}", ins, (R,), "full"))
    return cands


def _ein_letters(n: int, avoid: str = "") -> str:
    pool = [c for c in string.ascii_letters if c not in avoid]
    return "".join(pool[:n])


def _matmul_ein(a: Sequence[int], b: Sequence[int]) -> _Ein:
    """Subscripts for torch.matmul with broadcasting batch dims (k = contracted)."""
    k, m, n = "k", "m", "n"
    if len(a) == 1 and len(b) == 1:
        return _Ein(("k", "k"), "", (tuple(a), tuple(b)))
    if len(b) == 1:
        batch = _ein_letters(len(a) - 2, "kmn")
        return _Ein((batch + m + k, k), batch + m, (tuple(a), tuple(b)))
    if len(a) == 1:
        batch = _ein_letters(len(b) - 2, "kmn")
        return _Ein((k, batch + k + n), batch + n, (tuple(a), tuple(b)))
    nb = max(len(a), len(b)) - 2
    batch = _ein_letters(nb, "kmn")
    sa = batch[nb - (len(a) - 2) :] + m + k
    sb = batch[nb - (len(b) - 2) :] + k + n
    return _Ein((sa, sb), batch + m + n, (tuple(a), tuple(b)))


def _ein_for(g: Graph, op: Op) -> _Ein:
    """The contraction of a matmul-like op over its (first two / all) matrix operands."""
    tgt = op.target
    shp = [g.tensors[t].shape for t in op.inputs]
    if tgt == "aten.linear.default":
        x, w = shp[0], shp[1]
        batch = _ein_letters(len(x) - 1, "kn")
        if len(w) == 1:
            return _Ein((batch + "k", "k"), batch, (x, w))
        return _Ein((batch + "k", "nk"), batch + "n", (x, w))
    if tgt in (
        "aten.mm.default",
        "aten.bmm.default",
        "aten.matmul.default",
        "aten.mv.default",
        "aten.dot.default",
    ):
        return _matmul_ein(shp[0], shp[1])
    if tgt in ("aten.addmm.default", "aten.baddbmm.default"):
        return _matmul_ein(shp[1], shp[2])
    if tgt == "aten.einsum.default":
        return _parse_einsum(op.args[0], shp)
    raise KeyError(tgt)


def _parse_einsum(eq: str, shapes: Sequence[Sequence[int]]) -> _Ein:
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    used = set(eq) - set(".,->")
    ell_n = max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t), default=0)
    ell = _ein_letters(ell_n, "".join(used))
    ins = []
    for t, s in zip(terms, shapes):
        if "..." in t:
            k = len(s) - (len(t) - 3)
            t = t.replace("...", ell[ell_n - k :])
        ins.append(t)
    if not _:
        counts: dict[str, int] = {}
        for t in ins:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        rhs = ell + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    return _Ein(tuple(ins), rhs, tuple(tuple(s) for s in shapes))


def _gen_matmul(g: Graph, op: Op) -> list[_Cand]:
    tgt = op.target
    e = _ein_for(g, op)
    out = _tout(g, op)
    if tgt in ("aten.addmm.default", "aten.baddbmm.default"):
        mats = op.inputs[1:3]
    elif tgt == "aten.einsum.default" or tgt != "aten.linear.default":
        mats = op.inputs
    else:
        mats = op.inputs[:2]
    float_ops = [_is_float(g.tensors[t]) for t in mats]
    core = _einsum_cands(e, out.shape, float_ops)
    cands: list[_Cand] = []
    for c in core:
        if tgt == "aten.linear.default":
            extra: tuple[Form, ...] = ()
            if len(op.inputs) == 3:  # bias [N]: follows n, else I (rank 0 only under R)
                o = c.outputs[0]
                extra = (
                    G(0)
                    if o.is_gather and o.dim == out.ndim - 1 and len(e.out) == out.ndim and e.out[-1] == "n"
                    else I,
                )
            cands.append(_Cand(c.name, c.inputs + extra, c.outputs, c.cost))
        elif tgt in ("aten.addmm.default", "aten.baddbmm.default"):
            bias = _tin(g, op, 0)
            o = c.outputs[0]
            if o.is_reduce:
                bf: Form = I
            elif o.is_gather:
                db = o.dim - (out.ndim - bias.ndim)
                bf = G(db) if db >= 0 and bias.shape[db] == out.shape[o.dim] else I
            else:
                bf = I
            cands.append(_Cand(c.name, (bf,) + c.inputs, c.outputs, c.cost))
        else:
            cands.append(c)
    # SFB: x sharded on a batch index, 2-D weight replicated
    if tgt in ("aten.linear.default", "aten.matmul.default", "aten.mm.default"):
        w = _tin(g, op, 1)
        x = _tin(g, op, 0)
        if w.ndim == 2 and x.ndim >= 2 and _is_float(w):
            for c in cands:
                if (
                    c.cost == "shard"
                    and c.inputs[1] is I
                    and c.inputs[0].is_gather
                    and c.inputs[0].dim < x.ndim - 1
                    and c.outputs[0].is_gather
                ):
                    cands.append(_Cand("sfb:" + c.name.split(":")[-1], c.inputs, c.outputs, "sfb"))
    return cands


def _local_matmul(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    tgt = op.target
    if s.sfb:
        d = s.inputs[0].dim
        lens = ctx.lengths(op.inputs[0], d)
        if tgt == "aten.linear.default":
            b = op.args[2] if len(op.inputs) == 3 else None
            return LocalCall(hops.sfb_linear, (op.args[0], op.args[1], b, d, lens))
        return LocalCall(hops.sfb_matmul, (op.args[0], op.args[1], d, lens))
    out_r = s.outputs[0].is_reduce
    if tgt == "aten.linear.default" and len(op.inputs) == 3 and out_r:
        return LocalCall(hops.linear_partial, (op.args[0], op.args[1], op.args[2], ctx.rank == 0))
    if tgt in ("aten.addmm.default", "aten.baddbmm.default") and out_r:
        beta, alpha = _kw(op, "beta", 1), _kw(op, "alpha", 1)
        return LocalCall(hops.addmm_partial, (*op.args[:3], beta, alpha, ctx.rank == 0))
    return _default_local(g, op, s, ctx)


def _f_ein(target: str) -> Flops:
    def f(ins: list, outs: list, args: tuple, kw: dict) -> float:
        if target == "aten.einsum.default":
            e = _parse_einsum(args[0], ins)
        elif target in ("aten.addmm.default", "aten.baddbmm.default"):
            e = _matmul_ein(ins[1], ins[2])
        elif target == "aten.linear.default":
            x, w = ins[0], ins[1]
            batch = _ein_letters(len(x) - 1, "kn")
            e = _Ein(
                (batch + "k", "nk" if len(w) == 2 else "k"), batch + ("n" if len(w) == 2 else ""), (x, w)
            )
        else:
            e = _matmul_ein(ins[0], ins[1])
        size: dict[str, int] = {}
        for s, sh in zip(e.ins, e.sizes):
            for c, n in zip(s, sh):
                size[c] = max(size.get(c, 1), n)
        total = 2.0 * _numel(list(size.values()))
        if target == "aten.linear.default" and len(ins) == 3:
            total += _numel(outs[0])
        if target in ("aten.addmm.default", "aten.baddbmm.default"):
            total += _numel(outs[0])
        return total

    return f


for _t in (
    "aten.linear.default",
    "aten.mm.default",
    "aten.bmm.default",
    "aten.matmul.default",
    "aten.addmm.default",
    "aten.baddbmm.default",
    "aten.einsum.default",
    "aten.mv.default",
    "aten.dot.default",
):
    _register(
        [_t],
        "matmul",
        _gen_matmul,
        local=_local_matmul,
        flops=_f_ein(_t),
        reason="one einsum generator: kept index -> G, contracted index -> R, one R operand -> R",
    )


# ---- embedding: W[idx] = one_hot(idx) @ W, a contraction over the vocabulary


def _gen_embedding(g: Graph, op: Op) -> list[_Cand]:
    w, idx = _tin(g, op, 0), _tin(g, op, 1)
    cands = [_Cand(f"batch{d}", (I, G(d)), (G(d),)) for d in range(idx.ndim)]
    cands.append(_Cand("hidden", (G(1), I), (G(idx.ndim),)))
    if w.shape[0] >= 2:
        cands.append(_Cand("vocab", (G(0), I), (R,), "full"))
    cands.append(_Cand("partial", (R, I), (R,), "full"))
    return cands


def _local_embedding(g: Graph, op: Op, s: Strategy, ctx: LocalContext) -> LocalCall:
    import hapnb.ops as hops

    f = s.inputs[0]
    if f.is_gather and f.dim == 0:
        return LocalCall(hops.embedding_vocab, (op.args[0], op.args[1], ctx.offset(op.inputs[0], 0)))
    return _default_local(g, op, s, ctx)


_register(
    ["aten.embedding.default"],
    "embedding",
    _gen_embedding,
    local=_local_embedding,
    reason="lookup is independent per index and per hidden unit; vocab shards sum (masked) to R",
)
