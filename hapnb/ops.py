"""Runtime helpers that localized ops call (emitted into per-rank torch.fx graphs by name).

Every function here is module-level, takes tensors plus static Python values (ints, floats, tuples),
and is differentiable where the op it stands for is. Two need data from the other ranks:

* :func:`global_sum` (the global count of non-ignored targets of a mean loss over a sharded batch),
* :func:`all_gather_dim` (the padded all-gather of sufficient factors in the SFB backward).

Both use ``torch.distributed`` when it is initialized. Without it they act on one rank, unless a
*simulation hook* is installed with :func:`simulate` — the rule checker uses this to run all ranks one
after another in one process: the first pass records every rank's contribution, the second pass
serves the combined results (SPMD: every rank makes the same sequence of calls).

>>> import torch
>>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]); w = torch.eye(2); b = torch.ones(2)
>>> linear_partial(x, w, b, False)
tensor([[1., 2.],
        [3., 4.]])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "zero_link",
    "add_partial",
    "scalar_partial",
    "masked_fill_partial",
    "linear_partial",
    "addmm_partial",
    "conv_partial",
    "mean_partial",
    "embedding_vocab",
    "loss_partial",
    "mse_partial",
    "created_slice",
    "conv_local",
    "pool_local",
    "global_sum",
    "all_gather_dim",
    "sfb_linear",
    "sfb_matmul",
    "simulate",
    "RankSimulator",
]


# ------------------------------------------------------------------------------------ helpers


class _ZeroLink(torch.autograd.Function):
    """A scalar 0 that depends on ``x`` with a zero gradient (keeps ``x`` in the autograd graph)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return torch.zeros((), dtype=x.dtype if x.is_floating_point() else torch.float32, device=x.device)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ctx.shape, dtype=ctx.dtype, device=g.device)


def zero_link(x: torch.Tensor) -> torch.Tensor:
    """A scalar zero whose gradient w.r.t. ``x`` is zero (no NaN even when ``x`` holds inf)."""
    return _ZeroLink.apply(x)


def _drop(x: torch.Tensor) -> torch.Tensor:
    return zero_link(x) if x.requires_grad else torch.zeros((), dtype=x.dtype, device=x.device)


def add_partial(
    a: Any, b: Any, alpha: float = 1, keep_a: bool = True, keep_b: bool = True, sub: bool = False
) -> torch.Tensor:
    """``a + alpha*b`` (``a - alpha*b`` when ``sub``) where a dropped operand counts as zero.

    Used for ``R + I``: the replicated operand is added on rank 0 only. The result keeps the
    broadcast shape and dtype of the full op; a dropped tensor stays linked with a zero gradient.
    """
    ta, tb = torch.as_tensor(a), torch.as_tensor(b)
    shape = torch.broadcast_shapes(ta.shape, tb.shape)
    dtype = torch.result_type(a, b)
    sign = -alpha if sub else alpha
    if keep_a and keep_b:
        return (torch.sub if sub else torch.add)(a, b, alpha=alpha)
    if keep_a:
        out = ta.to(dtype).expand(shape).clone()
        if isinstance(b, torch.Tensor):
            out = out + _drop(b).to(dtype)
        return out
    out = (tb.to(dtype) * sign).expand(shape).clone()
    if isinstance(a, torch.Tensor):
        out = out + _drop(a).to(dtype)
    return out


def scalar_partial(x: torch.Tensor, op: str, scalar: float, keep: bool) -> torch.Tensor:
    """``x + s`` / ``x - s`` / ``s - x`` for an R-form ``x``: the scalar counts on rank 0 only."""
    s = scalar if keep else 0
    if op == "add":
        return torch.add(x, s)
    if op == "sub":
        return torch.sub(x, s)
    if op == "rsub":
        return torch.sub(s, x) if keep else torch.neg(x)
    raise ValueError(f"scalar_partial: unknown op {op!r} (use add, sub or rsub)")


def masked_fill_partial(x: torch.Tensor, mask: torch.Tensor, value: float, keep: bool) -> torch.Tensor:
    """``masked_fill`` of an R-form tensor: the fill value lands on rank 0, zero elsewhere."""
    return x.masked_fill(mask, value if keep else 0)


def linear_partial(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, with_bias: bool) -> torch.Tensor:
    """``F.linear`` whose bias is added only when ``with_bias`` (rank 0 of an R-form result)."""
    if b is None:
        return F.linear(x, w)
    if with_bias:
        return F.linear(x, w, b)
    return F.linear(x, w) + _drop(b).to(x.dtype)


def addmm_partial(
    bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta: float, alpha: float, with_bias: bool
) -> torch.Tensor:
    """``addmm`` / ``baddbmm`` whose bias term counts only when ``with_bias`` (rank 0 of an R-form
    result): ``beta * bias + alpha * (m1 @ m2)``."""
    prod = torch.matmul(m1, m2)
    if alpha != 1:
        prod = prod * alpha
    if with_bias:
        return prod + (bias * beta if beta != 1 else bias)
    return prod + _drop(bias).to(prod.dtype)


def conv_partial(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    stride: Sequence[int],
    padding: Any,
    dilation: Sequence[int],
    groups: int,
    with_bias: bool,
) -> torch.Tensor:
    """conv1d/2d on in-channel shards (an R-form result): the bias is added on rank 0 only."""
    fn = F.conv2d if w.dim() == 4 else F.conv1d
    out = fn(x, w, None, stride, padding, dilation, groups)
    if b is None:
        return out
    if with_bias:
        return out + _bias_view(b, out, 1 if x.dim() == w.dim() else 0)
    return out + _drop(b).to(out.dtype)


def mean_partial(
    x: torch.Tensor, dims: Sequence[int] | None, keepdim: bool, count: int, dtype: Any = None
) -> torch.Tensor:
    """Local sum over ``dims`` divided by the GLOBAL element count: the R-form of a mean."""
    if dims is None or len(dims) == 0:
        s = torch.sum(x, dtype=dtype)
        if keepdim:
            s = s.reshape([1] * x.dim())
    else:
        s = torch.sum(x, dim=list(dims), keepdim=keepdim, dtype=dtype)
    return s / count


def embedding_vocab(w: torch.Tensor, idx: torch.Tensor, offset: int, padding_idx: int = -1) -> torch.Tensor:
    """Vocab-parallel embedding: rows ``[offset, offset+len(w))`` live here; other ids give zeros.

    Summing the result over ranks gives the full lookup (an R-form output).
    """
    n = w.shape[0]
    inside = (idx >= offset) & (idx < offset + n)
    if n == 0:
        out = torch.zeros((*idx.shape, w.shape[1]), dtype=w.dtype, device=w.device)
        return out + _drop(w) if w.requires_grad else out
    local = torch.where(inside, idx - offset, torch.zeros_like(idx))
    out = F.embedding(local, w)
    return out * inside.unsqueeze(-1).to(w.dtype)


def loss_partial(
    kind: str,
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
    count: int,
) -> torch.Tensor:
    """Cross-entropy / NLL over a shard of the batch (and extra dims), as an R-form partial.

    ``reduction`` 2 (sum): the local sum. 1 (mean): the local sum divided by the GLOBAL denominator —
    the number of non-ignored targets (weighted by ``weight[target]`` when class weights are given),
    summed over ranks with :func:`global_sum`; for probability targets it is the static sample
    ``count``. The denominator carries no gradient (as in PyTorch for the count; class weights are
    treated as constants).
    """
    if kind == "ce":
        s = F.cross_entropy(x, target, weight, ignore_index=ignore_index, reduction="sum",
                            label_smoothing=label_smoothing)  # fmt: skip
    else:
        s = F.nll_loss(x, target, weight, ignore_index=ignore_index, reduction="sum")
    if reduction != 1:
        return s
    if target.is_floating_point():
        return s / count
    keep = target != ignore_index
    if weight is None:
        local = keep.sum().to(x.dtype)
    else:
        safe = torch.where(keep, target, torch.zeros_like(target))
        local = (weight.detach()[safe] * keep.to(weight.dtype)).sum().to(x.dtype)
    return s / global_sum(local.detach())


def mse_partial(a: torch.Tensor, b: torch.Tensor, reduction: int, count: int) -> torch.Tensor:
    """``mse_loss`` over shards: local sum of squares (divided by the global ``count`` for mean)."""
    s = F.mse_loss(a, b, reduction="sum")
    return s / count if reduction == 1 else s


def created_slice(target: str, args: tuple, kwargs: tuple, dim: int, start: int, length: int) -> torch.Tensor:
    """Run the creation op named ``target`` (``"aten.eye.default"``) with ``args``/``kwargs`` (pairs)
    and keep the slice ``[start, start+length)`` of ``dim``. ``arange`` creates only its slice."""
    _, name, overload = target.split(".")
    kw = dict(kwargs)
    if name == "arange":
        a = list(args)
        lo, hi, step = (0, a[0], 1) if overload == "default" else (a[0], a[1], a[2] if len(a) > 2 else 1)
        first = lo + start * step
        if all(isinstance(v, int) for v in (lo, hi, step)):
            end = first + length * step  # exact for integers (and keeps the int64 dtype)
        else:
            end = first + (length - 0.5) * step if length else first
        return torch.ops.aten.arange.start_step(first, end, step, **kw)
    fn = getattr(getattr(torch.ops.aten, name), overload)
    return fn(*args, **kw).narrow(dim, start, length).contiguous()


# ------------------------------------------------------------------------ collectives + simulation


class RankSimulator:
    """Runs the cross-rank helpers for ``n`` ranks executed one after another in one process.

    Usage (what the rule checker does): for each pass, for each rank ``r``: ``with sim.rank(r):`` run
    that rank's code. Pass 1 records each call's local value and returns a same-shape placeholder;
    pass 2 returns the combined value recorded in pass 1 (call ``sim.next_pass()`` in between).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.records: dict[tuple[int, int], torch.Tensor] = {}
        self.pass_no = 0
        self.current = 0
        self.calls = 0

    @contextlib.contextmanager
    def rank(self, r: int) -> Iterator[None]:
        global _HOOK
        self.current, self.calls = r, 0
        prev, _HOOK = _HOOK, self
        try:
            yield
        finally:
            _HOOK = prev

    def next_pass(self) -> None:
        self.pass_no += 1

    def _record(self, t: torch.Tensor) -> int:
        k = self.calls
        self.calls += 1
        if self.pass_no == 0:
            self.records[(self.current, k)] = t.detach().clone()
        return k

    def _all(self, k: int) -> list[torch.Tensor]:
        try:
            return [self.records[(r, k)] for r in range(self.n)]
        except KeyError as exc:
            raise RuntimeError(f"rank simulation: call {k} was not recorded on every rank") from exc

    def global_sum(self, t: torch.Tensor) -> torch.Tensor:
        k = self._record(t)
        if self.pass_no == 0:
            return t
        return torch.stack(self._all(k)).sum(0).to(t.dtype)

    def all_gather_dim(self, t: torch.Tensor, dim: int, lengths: Sequence[int]) -> torch.Tensor:
        k = self._record(t)
        if self.pass_no == 0:
            shape = list(t.shape)
            shape[dim] = sum(lengths)
            return torch.zeros(shape, dtype=t.dtype, device=t.device)
        return torch.cat(self._all(k), dim).to(t.dtype)


_HOOK: RankSimulator | None = None


@contextlib.contextmanager
def simulate(sim: RankSimulator, rank: int) -> Iterator[None]:
    """Shorthand for ``sim.rank(rank)``."""
    with sim.rank(rank):
        yield


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def global_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over all ranks (no gradient): all-reduce, or the simulation hook, or ``t``."""
    if _HOOK is not None:
        return _HOOK.global_sum(t)
    dist = _dist()
    if dist is None:
        return t
    out = t.detach().clone()
    dist.all_reduce(out)
    return out


def all_gather_dim(t: torch.Tensor, dim: int, lengths: Sequence[int]) -> torch.Tensor:
    """Uneven all-gather along ``dim`` (no autograd): pad to the longest shard, gather, trim, concat."""
    if _HOOK is not None:
        return _HOOK.all_gather_dim(t, dim, lengths)
    dist = _dist()
    if dist is None:
        if len(lengths) != 1:
            raise RuntimeError(
                f"all_gather_dim over {len(lengths)} ranks needs torch.distributed to be initialized "
                "(or a hapnb.ops.RankSimulator)"
            )
        return t
    longest = max(lengths)
    pad_shape = list(t.shape)
    pad_shape[dim] = longest - t.shape[dim]
    padded = torch.cat([t, t.new_zeros(pad_shape)], dim) if pad_shape[dim] else t.contiguous()
    bufs = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(bufs, padded.contiguous())
    return torch.cat([bb.narrow(dim, 0, n) for bb, n in zip(bufs, lengths)], dim)


class _SFB(torch.autograd.Function):
    """Forward on the local batch shard; backward all-gathers the input and the output gradient and
    computes the FULL weight (and bias) gradient on every rank (sufficient factor broadcasting)."""

    @staticmethod
    def forward(ctx: Any, x: Any, w: Any, b: Any, dim: int, lengths: tuple, transposed: bool) -> Any:
        ctx.save_for_backward(x, w)
        ctx.dim, ctx.lengths, ctx.transposed, ctx.has_b = dim, tuple(lengths), transposed, b is not None
        y = x.matmul(w.t() if transposed else w)
        return y + b if b is not None else y

    @staticmethod
    def backward(ctx: Any, gy: Any) -> Any:
        x, w = ctx.saved_tensors
        gx = gy.matmul(w if ctx.transposed else w.t())
        xf = all_gather_dim(x.contiguous(), ctx.dim, ctx.lengths).reshape(-1, x.shape[-1])
        gf = all_gather_dim(gy.contiguous(), ctx.dim, ctx.lengths).reshape(-1, gy.shape[-1])
        gw = gf.t().matmul(xf) if ctx.transposed else xf.t().matmul(gf)
        gb = gf.sum(0) if ctx.has_b else None
        return gx, gw, gb, None, None, None


def sfb_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dim: int, lengths: tuple) -> Any:
    """``F.linear`` with SFB backward; ``x`` is sharded on batch dim ``dim`` with shard ``lengths``."""
    return _SFB.apply(x, w, b, dim, tuple(lengths), True)


def sfb_matmul(x: torch.Tensor, w: torch.Tensor, dim: int, lengths: tuple) -> Any:
    """``x @ w`` (2-D ``w``) with SFB backward; ``x`` is sharded on batch dim ``dim``."""
    return _SFB.apply(x, w, None, dim, tuple(lengths), False)


def conv_local(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    stride: Sequence[int],
    padding: Any,
    dilation: Sequence[int],
    groups: int,
    with_bias: bool = True,
) -> torch.Tensor:
    """conv1d/2d on a shard that may be EMPTY (zero batch, in- or out-channels): PyTorch's conv
    rejects zero channels, so a zero-length shard computes on a 1-channel zero stand-in instead."""
    fn = F.conv2d if w.dim() == 4 else F.conv1d
    ch = 1 if x.dim() == w.dim() else 0
    if w.shape[0] == 0:  # no output channels here
        stand = w.new_zeros((1, *w.shape[1:]))
        out = fn(x, stand, None, stride, padding, dilation, groups).narrow(ch, 0, 0)
        return out + _drop(w).to(out.dtype) + (_drop(b).to(out.dtype) if b is not None else 0)
    if x.shape[ch] == 0:  # no input channels here: the partial sum is zero
        xs = x.new_zeros((*x.shape[:ch], 1, *x.shape[ch + 1 :]))
        ws = w.new_zeros((w.shape[0], 1, *w.shape[2:]))
        out = fn(xs, ws, None, stride, padding, dilation, 1) + _drop(x).to(x.dtype) + _drop(w).to(x.dtype)
        if b is not None:
            out = out + (_bias_view(b, out, ch) if with_bias else _drop(b).to(out.dtype))
        return out
    return conv_partial(x, w, b, stride, padding, dilation, groups, with_bias)


def convolution_local(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    with_bias: bool = True,
) -> torch.Tensor:
    """``aten.convolution`` (a convolution or a transposed one, 1-3 spatial dims, batched) on a shard: the
    bias only where ``with_bias`` (rank 0 of a partial-sum result), and a shard with no input or output
    channels (PyTorch rejects those) computed on a one-channel zero stand-in."""

    def conv(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.convolution.default(
            xx, ww, None, stride, padding, dilation, transposed, output_padding, groups
        )

    cin, cout = (0, 1) if transposed else (1, 0)  # the weight's dims of input and output channels
    if w.shape[cout] == 0:  # no output channels here
        shape = list(w.shape)
        shape[cout] = 1
        out = conv(x, w.new_zeros(shape)).narrow(1, 0, 0)
        return out + _drop(w).to(out.dtype) + (_drop(b).to(out.dtype) if b is not None else 0)
    if x.shape[1] == 0 or w.shape[cin] == 0:  # no input channels here: the partial sum is zero
        shape = list(w.shape)
        shape[cin] = 1
        xs = x.new_zeros((x.shape[0], 1, *x.shape[2:]))
        out = conv(xs, w.new_zeros(shape)) + _drop(x).to(x.dtype) + _drop(w).to(x.dtype)
    else:
        out = conv(x, w)
    if b is None:
        return out
    return out + (_bias_view(b, out, 1) if with_bias else _drop(b).to(out.dtype))


def _bias_view(b: torch.Tensor, out: torch.Tensor, ch: int) -> torch.Tensor:
    shape = [1] * out.dim()
    shape[ch] = -1
    return b.view(shape)


def pool_local(fn: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """A pooling or resampling op on a shard that may have no rows or channels (PyTorch rejects those)."""
    name = str(fn)
    sp = 1 if "1d" in name else 3 if "3d" in name else 2  # number of spatial dims
    lead = x.shape[:-sp]
    if x.numel() == 0 and any(s == 0 for s in lead):
        shape = [max(s, 1) for s in lead] + list(x.shape[-sp:])
        res = fn(x.new_zeros(shape), *args)

        def empty(t: torch.Tensor) -> torch.Tensor:
            for d, s in enumerate(lead):
                if s == 0:
                    t = t.narrow(d, 0, 0)
            return t + _drop(x).to(t.dtype) if t.is_floating_point() else t

        return tuple(empty(t) for t in res) if isinstance(res, (tuple, list)) else empty(res)
    return fn(x, *args)
