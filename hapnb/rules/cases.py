"""The sample cases of the ground-truth checker (:mod:`.checker`): for each op target, builders
``build(rng) -> (args, kwargs)`` of float64 inputs whose shapes are drawn from ``rng``. The cases here
are grouped by the kind of op (the contraction, attention, loss and conv families have their cases only
here); :func:`sample_cases` appends the samples the family modules register themselves
(``registry._register_samples``). The order of the cases is part of the check: every case draws its
shapes and values from the same random streams, one after the other.

>>> cases = sample_cases()
>>> cases[0][0]
'aten.relu.default'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import registry

__all__ = ["sample_cases"]

#: ``(target, build(rng) -> (args, kwargs))``
_Case = tuple[str, Callable[[Any], tuple[tuple, dict]]]
_Add = Callable[[str, Callable[[Any], tuple[tuple, dict]]], None]
_Tensor = Callable[..., Any]  # T(*shape): a random float64 tensor
_Dims = Callable[..., list[int]]  # dims(rng, k, lo=2, hi=6): k sizes
_Bsh = Callable[[Any], tuple[int, int, int]]  # bsh(rng): (batch, sequence, hidden) sizes


def sample_cases() -> list[_Case]:
    """(target, builder(rng) -> (args, kwargs)) with float64 tensors; shapes drawn from ``rng``."""
    import torch

    f64 = torch.float64

    def T(*shape: int) -> Any:  # noqa: N802
        return torch.randn(*shape, dtype=f64)

    def dims(r: Any, k: int, lo: int = 2, hi: int = 6) -> list[int]:
        return [r.randint(lo, hi) for _ in range(k)]

    C: list[_Case] = []

    def add(target: str, fn: Callable[[Any], tuple[tuple, dict]]) -> None:
        C.append((target, fn))

    def bsh(r: Any) -> tuple[int, int, int]:
        b, s, h = dims(r, 3)
        return b, s, h

    for group in (
        _pointwise,
        _reductions,
        _dimwise,
        _matmul,
        _views,
        _zoo_extras,
        _creation,
        _norms,
        _attention,
        _embedding,
        _losses,
        _conv,
    ):
        group(add, T, dims, bsh)
    return C + list(registry._SAMPLES)  # the family modules' own samples


def _pointwise(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Element-wise ops, broadcasting binary ops and their scalar forms, casts and ``*_like``."""
    import torch

    for u in ("relu", "gelu", "silu", "tanh", "sigmoid", "exp", "neg", "abs", "rsqrt", "erf", "log"):
        add(
            f"aten.{u}.default",
            lambda r, u=u: ((T(*bsh(r)).abs() + 0.5 if u in ("rsqrt", "log") else T(*bsh(r)),), {}),
        )
    add("aten.gelu.default", lambda r: ((T(*bsh(r)),), {"approximate": "tanh"}))
    add("aten.dropout.default", lambda r: ((T(*bsh(r)), 0.0, True), {}))
    add("aten.pow.Tensor_Scalar", lambda r: ((T(*bsh(r)), 2), {}))
    for b_op in ("add", "sub"):
        add(f"aten.{b_op}.Tensor", lambda r, o=b_op: ((T(*(s := bsh(r))), T(s[2])), {"alpha": 2}))
        add(f"aten.{b_op}.Tensor", lambda r: ((T(*(s := bsh(r))), T(s[0], 1, s[2])), {}))
        add(f"aten.{b_op}.Tensor", lambda r: ((T(*bsh(r)), 2.5), {}))
        add(f"aten.{b_op}.Tensor", lambda r: ((T(*(s := bsh(r))), T(*s)), {}))
    add("aten.mul.Tensor", lambda r: ((T(*(s := bsh(r))), T(s[1], s[2])), {}))
    add("aten.mul.Tensor", lambda r: ((T(*bsh(r)), 3.0), {}))
    add("aten.div.Tensor", lambda r: ((T(*(s := bsh(r))), T(s[2]).abs() + 1), {}))
    add("aten.div.Tensor", lambda r: ((T(*bsh(r)), 4.0), {}))
    add("aten.add.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.rsub.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.maximum.default", lambda r: ((T(*(s := bsh(r))), T(*s)), {}))
    add("aten.gt.Scalar", lambda r: ((T(*bsh(r)), 0.0), {}))
    add("aten.eq.Tensor", lambda r: ((torch.randint(0, 3, (s := bsh(r))), torch.randint(0, 3, s[1:])), {}))
    add("aten.where.self", lambda r: ((T((s := bsh(r))[1], 1) > 0, T(*s), T(*s)), {}))
    add("aten.masked_fill.Scalar", lambda r: ((T(*(s := bsh(r))), T(s[1], s[2]) > 0, -1.5), {}))
    add("aten.clone.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.contiguous.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.alias.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.to.dtype", lambda r: ((T(*bsh(r)), torch.float32), {}))
    add("aten._to_copy.default", lambda r: ((T(*bsh(r)),), {"dtype": torch.float32}))
    add("aten.zeros_like.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.ones_like.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.full_like.default", lambda r: ((T(*bsh(r)), 2.0), {}))


def _reductions(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Reductions over all dims, some dims (kept or not), and arg-reductions."""
    add("aten.sum.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.sum.dim_IntList", lambda r: ((T(*bsh(r)), [1]), {}))
    add("aten.sum.dim_IntList", lambda r: ((T(*bsh(r)), [0, 2], True), {}))
    add("aten.mean.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.mean.dim", lambda r: ((T(*bsh(r)), [-1], True), {}))
    add("aten.mean.dim", lambda r: ((T(*bsh(r)), [0, 1]), {}))
    add("aten.amax.default", lambda r: ((T(*bsh(r)), [1]), {}))
    add("aten.max.dim", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.argmax.default", lambda r: ((T(*bsh(r)), 2), {}))


def _dimwise(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Ops along one dim: softmax, scans, top-k, one-hot, flip."""
    import torch

    add("aten.softmax.int", lambda r: ((T(*bsh(r)), -1), {}))
    add("aten.log_softmax.int", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten._softmax.default", lambda r: ((T(*bsh(r)), 2, False), {}))
    add("aten.cumsum.default", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.logcumsumexp.default", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.logcumsumexp.default", lambda r: ((T(*bsh(r)), -1), {}))
    add("aten.topk.default", lambda r: ((T(*bsh(r)), 2, -1), {}))
    add("aten.one_hot.default", lambda r: ((torch.randint(0, 5, dims(r, 2)), 5), {}))
    add("aten.flip.default", lambda r: ((T(*bsh(r)), [1]), {}))


def _matmul(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """The matmul family: linear, mm, bmm, matmul with broadcasting, addmm and einsum contractions."""
    add("aten.linear.default", lambda r: _lin(r, T, False))
    add("aten.linear.default", lambda r: _lin(r, T, True))
    add("aten.linear.default", lambda r: _lin(r, T, False, two_d=True))
    add("aten.mm.default", lambda r: ((T((m := dims(r, 3))[0], m[1]), T(m[1], m[2])), {}))
    add("aten.bmm.default", lambda r: ((T((m := dims(r, 4))[0], m[1], m[2]), T(m[0], m[2], m[3])), {}))
    add("aten.matmul.default", lambda r: ((T((m := dims(r, 4))[0], m[1], m[2]), T(m[2], m[3])), {}))
    add(
        "aten.matmul.default",
        lambda r: ((T((m := dims(r, 5, 2, 4))[0], m[1], m[2], m[3]), T(m[0], m[1], m[3], m[4])), {}),
    )
    add("aten.matmul.default", lambda r: ((T((m := dims(r, 4))[0], 1, m[1], m[2]), T(m[3], m[2], 3)), {}))
    add("aten.addmm.default", lambda r: ((T((m := dims(r, 3))[2]), T(m[0], m[1]), T(m[1], m[2])), {}))
    for eq, spec in (
        ("bsd,bsec->becd", ("bsd", "bsec")),
        ("edh,becd->bech", ("edh", "becd")),
        ("ehd,bech->becd", ("ehd", "bech")),
        ("becd,bsec->bsd", ("becd", "bsec")),
        ("bhqd,bhkd->bhqk", ("bhqd", "bhkd")),
    ):
        add("aten.einsum.default", lambda r, eq=eq, spec=spec: _ein_case(r, eq, spec, T))


def _views(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Views and reshapes, transposes, expands, slices and splits, concatenation, masks and padding."""
    add("aten.view.default", lambda r: ((T(*(s := bsh(r))), [s[0] * s[1], s[2]]), {}))
    add("aten.view.default", lambda r: ((T((s := bsh(r))[0] * s[1], s[2]), list(s)), {}))
    add(
        "aten.view.default",
        lambda r: ((T(*(s := (r.randint(2, 4), r.randint(2, 4), 6))), [s[0], s[1], 2, 3]), {}),
    )
    add("aten.reshape.default", lambda r: ((T(*(s := bsh(r))), [s[0], s[1] * s[2]]), {}))
    add("aten.view.default", lambda r: ((T(6, 4), [4, 6]), {}))
    add("aten.flatten.using_ints", lambda r: ((T(*dims(r, 4, 2, 4)), 1), {}))
    add("aten.unflatten.int", lambda r: ((T(*bsh(r)[:2], 6), -1, [2, 3]), {}))
    add("aten.transpose.int", lambda r: ((T(*bsh(r)), 1, 2), {}))
    add("aten.permute.default", lambda r: ((T(*bsh(r)), [2, 0, 1]), {}))
    add("aten.t.default", lambda r: ((T(*dims(r, 2)),), {}))
    add("aten.unsqueeze.default", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.squeeze.dim", lambda r: ((T((s := bsh(r))[0], 1, s[2]), 1), {}))
    add("aten.expand.default", lambda r: ((T((s := bsh(r))[0], 1, s[2]), list(s)), {}))
    add("aten.expand.default", lambda r: ((T((s := bsh(r))[1], s[2]), list(s)), {}))
    add("aten.select.int", lambda r: ((T(*bsh(r)), 1, 1), {}))
    add("aten.slice.Tensor", lambda r: ((T(*bsh(r)), 1, 1, 3), {}))
    add("aten.split.Tensor", lambda r: ((T(*bsh(r)[:2], 5), 2, -1), {}))
    add("aten.chunk.default", lambda r: ((T(*bsh(r)), 2, 1), {}))
    add("aten.split_with_sizes.default", lambda r: ((T(*bsh(r)[:2], 5), [2, 3], 2), {}))
    add("aten.unbind.int", lambda r: ((T(*bsh(r)), 1), {}))
    add("aten.cat.default", lambda r: (([T(*(s := bsh(r))), T(s[0], 3, s[2])], 1), {}))
    add("aten.stack.default", lambda r: (([T(*(s := bsh(r))), T(*s)], 1), {}))
    add("aten.triu.default", lambda r: ((T(*[r.randint(3, 7)] * 2), 1), {}))
    add("aten.tril.default", lambda r: ((T(r.randint(2, 4), *[r.randint(3, 7)] * 2), -1), {}))
    add("aten.constant_pad_nd.default", lambda r: ((T(*bsh(r)), [1, 1]), {}))
    add("aten.repeat.default", lambda r: ((T(*bsh(r)), [1, 2, 1]), {}))


def _zoo_extras(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """More ops the zoo models export (and close relatives)."""
    import torch

    f64 = torch.float64
    add("aten.clamp.default", lambda r: ((T(*bsh(r)), -0.5, 0.7), {}))
    add("aten.lt.Scalar", lambda r: ((T(*bsh(r)), 0.1), {}))
    add("aten.bitwise_not.default", lambda r: ((T(*bsh(r)) > 0,), {}))
    add("aten.sqrt.default", lambda r: ((T(*bsh(r)).abs(),), {}))
    add("aten.mul.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.sub.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add("aten.div.Scalar", lambda r: ((T(*bsh(r)), 1.5), {}))
    add(
        "aten.masked_fill.Tensor",
        lambda r: ((T(*(s := bsh(r))), T(s[2]) > 0, torch.tensor(2.0, dtype=f64)), {}),
    )
    add("aten.squeeze.default", lambda r: ((T((s := bsh(r))[0], 1, s[2]),), {}))
    add("aten.index_select.default", lambda r: ((T(*bsh(r)), 1, torch.tensor([1, 0, 1])), {}))
    add("aten.narrow.default", lambda r: ((T(*bsh(r)), 2, 0, 2), {}))
    add("aten.logsumexp.default", lambda r: ((T(*bsh(r)), [2]), {}))
    add("aten.min.dim", lambda r: ((T(*bsh(r)), 0, True), {}))
    add("aten.amin.default", lambda r: ((T(*bsh(r)), [0, 2]), {}))
    add("aten._log_softmax.default", lambda r: ((T(*bsh(r)), 0, False), {}))
    add("aten.sort.default", lambda r: ((T(*bsh(r)), 1), {}))
    add(
        "aten.baddbmm.default",
        lambda r: ((T((m := dims(r, 4))[0], m[1], m[3]), T(*m[:3]), T(m[0], m[2], m[3])), {}),
    )
    add("aten.group_norm.default", lambda r: ((T(r.randint(2, 5), 4, 3), 2, T(4), T(4)), {}))
    add("aten.conv1d.default", lambda r: ((T(3, 4, 7), T(5, 4, 3), T(5)), {}))
    add("aten.max_pool2d_with_indices.default", lambda r: ((T(*dims(r, 2), 4, 6), [2, 2]), {}))
    add("aten.max_pool1d.default", lambda r: ((T(*dims(r, 2), 6), [2]), {}))
    add("aten.linalg_vector_norm.default", lambda r: ((T(*bsh(r)), 2, [1]), {}))
    add("aten.fill.Scalar", lambda r: ((T(*bsh(r)), 2.0), {}))
    add("aten.to.other", lambda r: ((T(*bsh(r)), torch.ones(2, dtype=torch.float32)), {}))
    add("aten.detach.default", lambda r: ((T(*bsh(r)),), {}))
    add("aten.scalar_tensor.default", lambda r: ((2.5,), {"dtype": f64}))
    add("aten.arange.start", lambda r: ((2, r.randint(4, 11)), {"dtype": f64}))


def _creation(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Factories: arange, zeros, ones, full."""
    import torch

    f64 = torch.float64
    add("aten.arange.default", lambda r: ((r.randint(2, 9),), {"dtype": f64}))
    add("aten.arange.start_step", lambda r: ((1, 2 * r.randint(2, 9) + 1, 2), {"dtype": f64}))
    add("aten.zeros.default", lambda r: ((dims(r, 2),), {"dtype": f64}))
    add("aten.ones.default", lambda r: ((dims(r, 2),), {"dtype": f64}))
    add("aten.full.default", lambda r: ((dims(r, 2), 3.0), {"dtype": f64}))


def _norms(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Layer and RMS norm."""
    add("aten.layer_norm.default", lambda r: ((T(*(s := bsh(r))), [s[2]], T(s[2]), T(s[2])), {}))
    add("aten.layer_norm.default", lambda r: ((T(*(s := bsh(r))), [s[1], s[2]], None, None), {}))
    add("aten.rms_norm.default", lambda r: ((T(*(s := bsh(r))), [s[2]], T(s[2]), 1e-6), {}))


def _attention(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Scaled dot-product attention without a mask, with a float or bool mask, and causal."""
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, None))
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, "float"))
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, "bool"))
    add("aten.scaled_dot_product_attention.default", lambda r: _sdpa_case(r, T, "causal"))


def _embedding(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Embedding lookups."""
    import torch

    add(
        "aten.embedding.default",
        lambda r: ((T(v := r.randint(2, 9), r.randint(2, 6)), torch.randint(0, v, dims(r, 2))), {}),
    )


def _losses(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Cross-entropy (reductions, class weights, smoothing, extra dims, probability targets), NLL, MSE."""
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 2))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 0))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, weight=True))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, smoothing=0.1))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, extra=True))
    add("aten.cross_entropy_loss.default", lambda r: _ce_case(r, T, 1, prob=True))
    add("aten.nll_loss_nd.default", lambda r: _ce_case(r, T, 1, nll=True))
    add("aten.nll_loss_nd.default", lambda r: _ce_case(r, T, 2, nll=True, extra=True))
    add("aten.mse_loss.default", lambda r: ((T(*(s := bsh(r))), T(*s), 1), {}))
    add("aten.mse_loss.default", lambda r: ((T(*(s := bsh(r))), T(*s), 2), {}))


def _conv(add: _Add, T: _Tensor, dims: _Dims, bsh: _Bsh) -> None:  # noqa: N803
    """Convolution, pooling and resampling."""
    add("aten.conv2d.default", lambda r: _conv_case(r, T, 1, 1))
    add("aten.conv2d.default", lambda r: _conv_case(r, T, 2, 0))
    add("aten.max_pool2d.default", lambda r: ((T(*dims(r, 2), 4, 6), [2, 2], [2, 2]), {}))
    add("aten.adaptive_avg_pool2d.default", lambda r: ((T(*dims(r, 2), 4, 6), [1, 1]), {}))
    add("aten.avg_pool2d.default", lambda r: ((T(*dims(r, 2), 4, 6), [2, 2]), {}))
    add("aten.max_pool3d_with_indices.default", lambda r: ((T(*dims(r, 2), 2, 4, 4), [2, 2, 2]), {}))
    add("aten.adaptive_max_pool2d.default", lambda r: ((T(*dims(r, 2), 4, 6), [2, 3]), {}))
    add("aten.avg_pool3d.default", lambda r: ((T(*dims(r, 2), 2, 4, 4), [2, 2, 2]), {}))
    add("aten.adaptive_avg_pool3d.default", lambda r: ((T(*dims(r, 2), 2, 4, 4), [1, 2, 2]), {}))
    # aten.convolution: transposed 1-d/2-d (stride, output padding, groups, no bias) and a 3-d convolution
    add("aten.convolution.default", lambda r: _convolution_case(r, T, True, 2, 1, 1, 1))
    add("aten.convolution.default", lambda r: _convolution_case(r, T, True, 1, 0, 0, 2))
    add("aten.convolution.default", lambda r: _convolution_case(r, T, True, 2, 1, 0, 1, bias=False))
    add("aten.convolution.default", lambda r: _convolution_case(r, T, False, 1, 1, 0, 1, spatial=3))
    add("aten.convolution.default", lambda r: _convolution_case(r, T, True, 2, 0, 1, 1, spatial=1))
    # resampling (F.interpolate): scale factors (.vec) and output sizes (.default), with and without corners
    add("aten.upsample_nearest2d.vec", lambda r: ((T(*dims(r, 2), 3, 4), None, [2.0, 1.5]), {}))
    add("aten.upsample_nearest2d.default", lambda r: ((T(*dims(r, 2), 3, 4), [5, 7]), {}))
    add("aten._upsample_nearest_exact2d.vec", lambda r: ((T(*dims(r, 2), 3, 4), [6, 5], None), {}))
    add("aten.upsample_nearest1d.vec", lambda r: ((T(*dims(r, 2), 5), None, [2.0]), {}))
    add("aten.upsample_nearest3d.vec", lambda r: ((T(*dims(r, 2), 2, 3, 2), None, [2.0, 2.0, 1.0]), {}))
    for corners in (False, True):
        add(
            "aten.upsample_bilinear2d.vec",
            lambda r, c=corners: ((T(*dims(r, 2), 3, 4), None, c, [2.0, 2.0]), {}),
        )
        add("aten.upsample_bilinear2d.default", lambda r, c=corners: ((T(*dims(r, 2), 3, 4), [5, 6], c), {}))
        add("aten.upsample_bicubic2d.vec", lambda r, c=corners: ((T(*dims(r, 2), 4, 4), [6, 7], c, None), {}))
        add("aten.upsample_linear1d.vec", lambda r, c=corners: ((T(*dims(r, 2), 5), None, c, [1.5]), {}))
        add(
            "aten.upsample_trilinear3d.vec",
            lambda r, c=corners: ((T(*dims(r, 2), 2, 3, 2), None, c, [2.0, 1.0, 2.0]), {}),
        )
    add("aten._upsample_bilinear2d_aa.vec", lambda r: ((T(*dims(r, 2), 6, 6), [3, 4], False, None), {}))


def _lin(r: Any, T: Callable, bias: bool, two_d: bool = False) -> tuple[tuple, dict]:  # noqa: N803
    k, n = r.randint(2, 6), r.randint(2, 6)
    x = T(r.randint(2, 6), k) if two_d else T(r.randint(2, 5), r.randint(2, 5), k)
    return ((x, T(n, k), T(n)) if bias else (x, T(n, k))), {}


def _ein_case(r: Any, eq: str, spec: tuple[str, ...], T: Callable) -> tuple[tuple, dict]:  # noqa: N803
    size = {c: r.randint(2, 4) for c in set("".join(spec))}
    return (eq, [T(*[size[c] for c in s]) for s in spec]), {}


def _sdpa_case(r: Any, T: Callable, mask: str | None) -> tuple[tuple, dict]:  # noqa: N803
    import torch

    b, h, lq, s, e = r.randint(2, 4), r.randint(2, 4), r.randint(2, 5), r.randint(2, 5), r.randint(2, 5)
    if mask == "causal":
        s = lq
    q, k, v = T(b, h, lq, e), T(b, h, s, e), T(b, h, s, e + 1)
    if mask == "float":
        return (q, k, v, T(lq, s)), {}
    if mask == "bool":
        m = torch.rand(b, 1, lq, s) > 0.3
        m[..., 0] = True
        return (q, k, v, m), {}
    return (q, k, v, None, 0.0, mask == "causal"), {}


def _ce_case(
    r: Any,
    T: Callable,
    red: int,
    weight: bool = False,
    smoothing: float = 0.0,
    extra: bool = False,
    prob: bool = False,
    nll: bool = False,
) -> tuple[tuple, dict]:  # noqa: N803
    import torch

    n, c = r.randint(2, 7), r.randint(2, 5)
    shape = (n, c, r.randint(2, 4)) if extra else (n, c)
    x = T(*shape)
    if prob:
        tgt = torch.softmax(T(*shape), 1)
    else:
        tshape = (shape[0],) + shape[2:]
        tgt = torch.randint(0, c, tshape)
        tgt[torch.rand(tshape) < 0.25] = -100
    if nll:
        return (torch.log_softmax(x, 1), tgt, None, red, -100), {}
    w = T(c).abs() + 0.5 if weight else None
    return (x, tgt, w, red, -100, smoothing), {}


def _convolution_case(
    r: Any,
    T: Callable,  # noqa: N803
    transposed: bool,
    stride: int,
    pad: int,
    out_pad: int,
    groups: int,
    bias: bool = True,
    spatial: int = 2,
) -> tuple[tuple, dict]:
    """``aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)``."""
    n, ci, co = r.randint(2, 4), groups * r.randint(1, 3), groups * r.randint(1, 3)
    w = T(ci, co // groups, *[3] * spatial) if transposed else T(co, ci // groups, *[3] * spatial)
    x = T(n, ci, *[5, 4, 3][:spatial])
    k = [1] * spatial
    return (x, w, T(co) if bias else None, [stride] * spatial, [pad] * spatial, k, transposed,
            [out_pad] * spatial, groups), {}  # fmt: skip


def _conv_case(r: Any, T: Callable, stride: int, pad: int) -> tuple[tuple, dict]:  # noqa: N803
    n, ci, co = r.randint(2, 4), r.randint(2, 4), r.randint(2, 4)
    return (T(n, ci, 5, 6), T(co, ci, 3, 3), T(co), [stride, stride], [pad, pad], [1, 1], 1), {}
