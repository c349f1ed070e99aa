"""Indexing with tensor indices: the ``index`` table (``index``, ``index_put``, ``gather``, ``scatter``).

Algebra: these ops read or write elements at positions an integer tensor names, along some dims of
the indexed tensor. Every dim the indices do NOT address is an independent batch of the op, so the
indexed tensor, the values/sources and the output shard on it together (indices replicated, or
sharded with them where they span it). Along the addressed dims, the positions are global, so the
indexed tensor stays replicated there; the *index* tensor may then be sharded on its own (batch) dims
instead, with the indexed tensor replicated: each rank reads the rows its indices name and the
output is sharded on the corresponding dim (``x[idx]`` with a batch-sharded ``idx``;
``gather(x, dim, idx)`` with ``idx`` sharded along ``dim``). Linear members: reading (``index``,
``gather``) is linear in the indexed tensor (``R -> R``); accumulating writes (``index_put`` with
``accumulate=True``, ``scatter_add``) are linear in (self, values) jointly, and with the index and
values sharded they add disjoint contributions, so ``self | R`` gives an ``R`` output. Plain
(overwriting) writes are not linear when indices repeat: no ``R``. Boolean-mask indexing has a
data-dependent shape: replicated only. Integer/bool tensors are never ``R``. Flops: one per output
element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..ir.forms import Form, G, I, R
from ..ir.graph import Graph, Op, TensorArg
from .registry import _Cand, _is_float, _ndim_dim, _register, _register_samples, _tin
from .truth import sample as _t


def _bcast(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The broadcast shape of ``shapes`` (numpy rules; the shapes are known to broadcast)."""
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for k, n in enumerate(s):
            j = nd - len(s) + k
            out[j] = n if out[j] == 1 else out[j]
    return tuple(out)


def _index_layout(
    g: Graph, op: Op
) -> tuple[list[TensorArg | None], tuple[int, ...], dict[int, int], int] | None:
    """For ``self[indices]``: the index args (None where a dim is not indexed), their broadcast shape,
    the output dim of every NOT indexed dim of self, and the output dim where the broadcast dims start.
    None for boolean masks (data-dependent shape)."""
    self_ = _tin(g, op, 0)
    idx = list(op.args[1])
    tensors = [v for v in idx if isinstance(v, TensorArg)]
    if not tensors or any(g.tensors[op.inputs[v.index]].dtype in ("bool", "uint8") for v in tensors):
        return None
    pos = [k for k, v in enumerate(idx) if isinstance(v, TensorArg)]
    bshape = _bcast([g.tensors[op.inputs[v.index]].shape for v in tensors])
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    start = pos[0] if adjacent else 0
    rest = [k for k in range(self_.ndim) if k not in pos]
    kept = {}
    for n, k in enumerate(rest):
        kept[k] = k if adjacent and k < pos[0] else (start + len(bshape) + (n - pos[0] if adjacent else n))
    return idx, bshape, kept, start


def _forms(n: int, assign: dict[int, Form]) -> tuple[Form, ...]:
    return tuple(assign.get(k, I) for k in range(n))


def _idx_forms(
    g: Graph, op: Op, idx: Sequence[TensorArg | None], bshape: Sequence[int], b: int
) -> dict[int, Form]:
    """Index tensors sharded on broadcast dim ``b`` where they span it (size-1/missing: replicated)."""
    out: dict[int, Form] = {}
    for v in idx:
        if isinstance(v, TensorArg):
            t = g.tensors[op.inputs[v.index]]
            tb = b - (len(bshape) - t.ndim)
            if tb >= 0 and t.shape[tb] == bshape[b]:
                out[v.index] = G(tb)
    return out


def _gen_index(g: Graph, op: Op) -> list[_Cand]:
    """``self[indices]``: self sharded on a dim no index addresses, or the indices on a broadcast
    (batch) dim with self replicated; linear in self."""
    lay = _index_layout(g, op)
    if lay is None:
        return []
    idx, bshape, kept, start = lay
    n, s0 = len(op.inputs), op.args[0].index
    cands = [_Cand(f"shard{k}", _forms(n, {s0: G(k)}), (G(o),)) for k, o in kept.items()]
    for b in range(len(bshape)):
        forms = _idx_forms(g, op, idx, bshape, b)
        if forms:
            cands.append(_Cand(f"rows{b}", _forms(n, forms), (G(start + b),)))
    if _is_float(_tin(g, op, 0)):
        cands.append(_Cand("partial", _forms(n, {s0: R}), (R,), "full"))
    return cands


def _gen_index_put(g: Graph, op: Op) -> list[_Cand]:
    """``self[indices] = values`` (functional): self, values and the output shard together on a dim no
    index addresses; with ``accumulate=True`` also the indices and values on a broadcast dim with
    ``self | R`` (disjoint contributions add) and ``(R, R) -> R``."""
    lay = _index_layout(g, op)
    if lay is None:
        return []
    idx, bshape, kept, start = lay
    self_, n = _tin(g, op, 0), len(op.inputs)
    s0, v0 = op.args[0].index, op.args[2].index
    vals = g.tensors[op.inputs[v0]]
    rshape = [0] * (len(bshape) + len(kept))
    for k, o in kept.items():
        rshape[o] = self_.shape[k]
    rshape[start : start + len(bshape)] = bshape

    def vform(o: int) -> Form | None:
        vd = o - (len(rshape) - vals.ndim)
        return G(vd) if vd >= 0 and vals.shape[vd] == rshape[o] else None

    cands = []
    for k, o in kept.items():
        f = vform(o)
        cands.append(_Cand(f"shard{k}", _forms(n, {s0: G(k)} | ({v0: f} if f else {})), (G(k),)))
    accumulate = bool(op.args[3]) if len(op.args) > 3 else False
    if accumulate and _is_float(self_) and _is_float(vals):
        for b in range(len(bshape)):
            forms, f = _idx_forms(g, op, idx, bshape, b), vform(start + b)
            if forms and f:
                cands.append(_Cand(f"add-rows{b}", _forms(n, {**forms, v0: f, s0: R}), (R,)))
        cands.append(_Cand("partial", _forms(n, {s0: R, v0: R}), (R,), "full"))
    return cands


_register(
    ["aten.index.Tensor", "aten.index.Tensor_hacked_twin"],
    "index",
    _gen_index,
    reason="rows named by tensor indices: non-indexed dims of self, or the indices' batch dims, shard",
)
_register(
    ["aten.index_put.default", "aten.index_put.hacked_twin"],
    "index",
    _gen_index_put,
    reason="writes at tensor indices: non-indexed dims shard; accumulating writes of sharded rows add (R)",
)


def _gen_gather(g: Graph, op: Op) -> list[_Cand]:
    """``gather(self, dim, index)``: self and index shard together on another dim where they are equally
    long; or the index along ``dim`` with self replicated (each output element reads its own index);
    linear in self."""
    self_, index = _tin(g, op, 0), _tin(g, op, 1)
    dim = _ndim_dim(int(op.args[1]), self_.ndim)
    cands = [
        _Cand(f"shard{d}", (G(d), G(d)), (G(d),))
        for d in range(self_.ndim)
        if d != dim and index.shape[d] == self_.shape[d]
    ]
    cands.append(_Cand(f"rows{dim}", (I, G(dim)), (G(dim),)))
    if _is_float(self_):
        cands.append(_Cand("partial", (R, I), (R,), "full"))
    return cands


_register(
    ["aten.gather.default"],
    "index",
    _gen_gather,
    reason="gather reads self at index along one dim: other dims shard with the index, or the index alone",
)


def _gen_scatter(g: Graph, op: Op) -> list[_Cand]:
    """``scatter(self, dim, index, src|value)``/``scatter_add``: self, index, src and the output shard
    together on another dim where they are equally long. ``scatter_add`` is linear in (self, src) and
    adds the contributions of disjoint index/src slices: ``(R, G(dim), G(dim)) -> R`` and ``(R, I, R) -> R``."""
    self_, index = _tin(g, op, 0), _tin(g, op, 1)
    dim = _ndim_dim(int(op.args[1]), self_.ndim)
    has_src = len(op.inputs) == 3
    src = _tin(g, op, 2) if has_src else None
    cands = []
    for d in range(self_.ndim):
        if (
            d == dim
            or index.shape[d] != self_.shape[d]
            or (src is not None and src.shape[d] != index.shape[d])
        ):
            continue
        cands.append(_Cand(f"shard{d}", (G(d), G(d)) + ((G(d),) if has_src else ()), (G(d),)))
    if op.target == "aten.scatter_add.default" and src is not None and _is_float(self_) and _is_float(src):
        if src.shape[dim] == index.shape[dim]:
            cands.append(_Cand(f"add-rows{dim}", (R, G(dim), G(dim)), (R,)))
        cands.append(_Cand("partial", (R, I, R), (R,), "full"))
    return cands


_register(
    ["aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default"],
    "index",
    _gen_scatter,
    reason="scatter writes self at index along one dim: other dims shard together; scatter_add adds (R)",
)


# ------------------------------------------------------------------ ground-truth sample cases


def _ix(hi: int, *shape: int) -> Any:
    import torch

    return torch.randint(0, hi, shape)


def _perm(n: int, k: int) -> Any:
    import torch

    return torch.randperm(n)[:k]


#: ``(target, build(rng) -> (args, kwargs))`` samples for the ground-truth checker (float64 values;
#: shapes drawn from ``rng``, a :class:`random.Random`).
CASES: tuple[tuple[str, Callable[[Any], tuple[tuple, dict]]], ...] = (
    # x[idx] with a batch of row ids (the indices' batch dims shard, or x's hidden dim)
    (
        "aten.index.Tensor",
        lambda r: ((_t(v := r.randint(3, 7), r.randint(2, 5)), [_ix(v, r.randint(2, 6), 3)]), {}),
    ),
    # x[:, idx] (an adjacent non-leading indexed dim) and x[i, :, j] (non-adjacent: batch dims first)
    ("aten.index.Tensor", lambda r: ((_t(r.randint(2, 5), 6, 3), [None, _ix(6, r.randint(2, 5))]), {})),
    (
        "aten.index.Tensor",
        lambda r: ((_t(5, r.randint(2, 4), 4), [_ix(5, r.randint(2, 5), 1), None, _ix(4, 1, 3)]), {}),
    ),
    (
        "aten.index_put.default",
        lambda r: ((_t(v := r.randint(4, 8), h := r.randint(2, 5)), [_perm(v, 3)], _t(3, h), False), {}),
    ),
    (
        "aten.index_put.default",
        lambda r: (
            (_t(v := r.randint(3, 6), h := r.randint(2, 5)), [_ix(v, r.randint(2, 7))], _t(1, h), True),
            {},
        ),
    ),
    (
        "aten.index_put.default",
        lambda r: (
            (_t(v := r.randint(3, 6), h := r.randint(2, 5)), [_ix(v, n := r.randint(2, 7))], _t(n, h), True),
            {},
        ),
    ),
    ("aten.gather.default", lambda r: ((_t(b := r.randint(2, 5), 6), 1, _ix(6, b, r.randint(2, 5))), {})),
    ("aten.gather.default", lambda r: ((_t(6, b := r.randint(2, 5)), 0, _ix(6, r.randint(2, 8), b)), {})),
    (
        "aten.scatter.src",
        lambda r: ((_t(b := r.randint(2, 5), 6), 1, _perm(6, 4).expand(b, 4).clone(), _t(b, 4)), {}),
    ),
    (
        "aten.scatter.value",
        lambda r: ((_t(b := r.randint(2, 5), 6), 1, _perm(6, 3).expand(b, 3).clone(), 2.5), {}),
    ),
    (
        "aten.scatter_add.default",
        lambda r: ((_t(b := r.randint(2, 5), 6), 1, _ix(6, b, n := r.randint(2, 8)), _t(b, n)), {}),
    ),
    (
        "aten.scatter_add.default",
        lambda r: ((_t(5, b := r.randint(2, 4)), 0, _ix(5, n := r.randint(2, 8), b), _t(n, b)), {}),
    ),
)
_register_samples(CASES)
