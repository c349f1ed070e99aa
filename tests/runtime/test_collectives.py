"""Tests for hapnb.runtime.collectives: forward and backward of every collective against full-tensor references.

Every rank builds the same seeded full tensors, so it can compute the single-process reference itself:
for a collective ``y = f(x_r)`` with a per-rank upstream gradient ``g_r``, the expected input gradient
follows from the gradient semantics (I gradients are partial, G/R gradients complete). One process launch
per world size (2, 3, 4 gloo ranks) runs all checks for that size; each rank reports the checks it passed.
"""

from __future__ import annotations

import json
import socket
import time
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hapnb.runtime.collectives as C
from hapnb.ir.forms import shard_lengths, shard_offsets

F64 = torch.float64
BASE = (4, 3, 2)  # full shape; the sharded dim's size is replaced by sum(lengths)

LENGTHS = {
    2: [(3, 2), (0, 4), (1, 1)],
    3: [(3, 0, 2), (1, 1, 1), (0, 0, 3)],
    4: [(2, 0, 3, 1), (1, 2, 1, 1), (0, 0, 0, 0)],
}


# --------------------------------------------------------------------------------------------------
# helpers used inside the worker processes
# --------------------------------------------------------------------------------------------------


def rand(shape, *key) -> torch.Tensor:
    """A float64 tensor that depends only on (shape, key): the same on every rank."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((tuple(shape), key)).encode()))
    return torch.randn(tuple(shape), generator=gen, dtype=F64)


def full_shape(dim: int, size: int, base=BASE) -> list[int]:
    shape = list(base)
    shape[dim] = size
    return shape


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, transposed strides (non-contiguous whenever the first and last dims exceed 1)."""
    return t.transpose(0, -1).contiguous().transpose(0, -1)


def piece(t: torch.Tensor, dim: int, lengths, r: int) -> torch.Tensor:
    return t.narrow(dim, shard_offsets(lengths)[r], lengths[r])


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def other_lengths(lengths, shift: int) -> tuple[int, ...]:
    """Different lengths with the same total (for reshard / all_to_all targets)."""
    n = len(lengths)
    ratios = [1.0 + ((k + shift) % n) for k in range(n)]
    return shard_lengths(sum(lengths), ratios)


# --------------------------------------------------------------------------------------------------
# checks (each runs on every rank in the same order)
# --------------------------------------------------------------------------------------------------


def check_all_gather(r: int, n: int, lengths, dim: int, padded: bool, tag) -> None:
    d = dim % len(BASE)
    shape = full_shape(d, sum(lengths))
    full = rand(shape, "ag", tag)
    x = piece(full, d, lengths, r)
    x = (noncontig(x) if padded else x.clone()).requires_grad_()
    y = C.all_gather(x, dim, lengths, padded=padded)
    assert torch.equal(y, full), f"all_gather forward {tag}"
    grads = [rand(shape, "ag-grad", tag, j) for j in range(n)]
    y.backward(noncontig(grads[r]))
    close(x.grad, piece(sum(grads), d, lengths, r), f"all_gather backward {tag}")


def check_reduce_scatter(r: int, n: int, lengths, dim: int, padded: bool, tag) -> None:
    d = dim % len(BASE)
    shape = full_shape(d, sum(lengths))
    partials = [rand(shape, "rs", tag, j) for j in range(n)]
    x = (noncontig(partials[r]) if not padded else partials[r].clone()).requires_grad_()
    y = C.reduce_scatter(x, dim, lengths, padded=padded)
    close(y, piece(sum(partials), d, lengths, r), f"reduce_scatter forward {tag}")
    gfull = rand(shape, "rs-grad", tag)
    y.backward(noncontig(piece(gfull, d, lengths, r)))
    close(x.grad, gfull, f"reduce_scatter backward {tag}")


def check_all_reduce(r: int, n: int, tag) -> None:
    partials = [rand(BASE, "ar", tag, j) for j in range(n)]
    x = noncontig(partials[r]).requires_grad_()
    before = x.detach().clone()
    y = C.all_reduce(x)
    close(y, sum(partials), f"all_reduce forward {tag}")
    assert torch.equal(x.detach(), before), "all_reduce must not modify its input"
    grads = [rand(BASE, "ar-grad", tag, j) for j in range(n)]
    y.backward(grads[r])
    close(x.grad, sum(grads), f"all_reduce backward {tag}")


def check_all_to_all(r: int, n: int, cat_lengths, split_lengths, cat_dim: int, split_dim: int, tag) -> None:
    shape = list(BASE)
    shape[cat_dim % 3] = sum(cat_lengths)
    shape[split_dim % 3] = sum(split_lengths)
    full = rand(shape, "a2a", tag)
    x = noncontig(piece(full, cat_dim % 3, cat_lengths, r)).requires_grad_()
    y = C.all_to_all(x, cat_dim, split_dim, cat_lengths, split_lengths)
    close(y, piece(full, split_dim % 3, split_lengths, r), f"all_to_all forward {tag}")
    gfull = rand(shape, "a2a-grad", tag)
    y.backward(piece(gfull, split_dim % 3, split_lengths, r))
    close(x.grad, piece(gfull, cat_dim % 3, cat_lengths, r), f"all_to_all backward {tag}")


def check_reshard(r: int, n: int, old, new, dim: int, tag) -> None:
    d = dim % 3
    shape = full_shape(d, sum(old))
    full = rand(shape, "reshard", tag)
    x = noncontig(piece(full, d, old, r)).requires_grad_()
    y = C.reshard(x, dim, old, new)
    close(y, piece(full, d, new, r), f"reshard forward {tag}")
    y.mul_(1.0)  # the output is a fresh tensor, so in-place ops are allowed
    gfull = rand(shape, "reshard-grad", tag)
    y.backward(piece(gfull, d, new, r))
    close(x.grad, piece(gfull, d, old, r), f"reshard backward {tag}")


def check_shard(r: int, n: int, lengths, dim: int, tag) -> None:
    d = dim % 3
    full = rand(full_shape(d, sum(lengths)), "shard", tag).requires_grad_()
    y = C.shard(full, dim, lengths)
    assert y.is_contiguous()
    close(y, piece(full.detach(), d, lengths, r), f"shard forward {tag}")
    g = rand(y.shape, "shard-grad", tag, r)
    y.backward(g)
    expected = torch.zeros_like(full)
    piece(expected, d, lengths, r).copy_(g)
    close(full.grad, expected, f"shard backward {tag}")


def check_replicate(r: int, n: int, tag) -> None:
    w = rand(BASE, "rep", tag).requires_grad_()
    y = C.replicate(w)
    assert torch.equal(y, w.detach())
    grads = [rand(BASE, "rep-grad", tag, j) for j in range(n)]
    (y * grads[r]).sum().backward()
    close(w.grad, sum(grads), f"replicate backward {tag}")


def check_to_partial(r: int, n: int) -> None:
    x = torch.tensor(2.5, dtype=F64, requires_grad=True)
    y = C.to_partial(x)
    total = y.detach().clone()
    dist.all_reduce(total)
    assert total.item() == 2.5
    y.backward()
    assert x.grad.item() == (1.0 if r == 0 else 0.0)


def check_fallback_reduce_scatter(r: int, n: int, lengths) -> None:
    """The all-reduce + slice path (taken by backends without reduce_scatter) gives the same result."""
    C._FORCE_ALL_REDUCE_FOR_REDUCE_SCATTER = True
    try:
        for dim in (0, 2):
            check_reduce_scatter(r, n, lengths, dim, True, ("fallback", lengths, dim))
    finally:
        C._FORCE_ALL_REDUCE_FOR_REDUCE_SCATTER = False


def check_float32_and_int(r: int, n: int, lengths) -> None:
    full = torch.arange(sum(lengths) * 3, dtype=torch.int64).reshape(sum(lengths), 3)
    for padded in (True, False):
        y = C.all_gather(piece(full, 0, lengths, r), 0, lengths, padded=padded)
        assert torch.equal(y, full)
    parts = [rand((3, sum(lengths)), "f32", j).float() for j in range(n)]
    x = parts[r].clone().requires_grad_()
    y = C.reduce_scatter(x, 1, lengths)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, piece(sum(parts), 1, lengths, r))


def check_async(r: int, n: int, lengths, tag) -> None:
    d = 1
    shape = full_shape(d, sum(lengths))
    full = rand(shape, "async-ag", tag)
    partials = [rand(shape, "async-rs", tag, j) for j in range(n)]
    xg = piece(full, d, lengths, r).clone().requires_grad_()
    xr = partials[r].clone().requires_grad_()
    xa = partials[r].clone().requires_grad_()
    # start several, do local compute, wait in reverse order
    h1 = C.all_gather_async(xg, d, lengths, padded=True)
    h2 = C.reduce_scatter_async(xr, d, lengths, padded=False)
    h3 = C.all_reduce_async(xa)
    h4 = C.all_gather_async(xg, d, lengths, padded=False)
    local = (xa.detach() @ torch.ones(BASE[2], dtype=F64)).sum()  # overlapped compute
    y4, y3, y2, y1 = h4.wait(), h3.wait(), h2.wait(), h1.wait()
    assert h1.wait() is y1 and "done" in repr(h1)
    assert torch.isfinite(local)
    close(y1, full, f"all_gather_async forward {tag}")
    close(y4, full, f"grouped all_gather_async forward {tag}")
    close(y2, piece(sum(partials), d, lengths, r), f"reduce_scatter_async forward {tag}")
    close(y3, sum(partials), f"all_reduce_async forward {tag}")
    # backward through the async results (synchronous duals)
    g1 = [rand(shape, "async-g1", tag, j) for j in range(n)]
    g2 = rand(shape, "async-g2", tag)
    g3 = [rand(shape, "async-g3", tag, j) for j in range(n)]
    y1.mul_(1.0)  # async results accept in-place ops
    loss = (
        (y1 * g1[r]).sum() + (y4 * g1[r]).sum() + (y2 * piece(g2, d, lengths, r)).sum() + (y3 * g3[r]).sum()
    )
    loss.backward()
    close(xg.grad, 2 * piece(sum(g1), d, lengths, r), f"all_gather_async backward {tag}")
    close(xr.grad, g2, f"reduce_scatter_async backward {tag}")
    close(xa.grad, sum(g3), f"all_reduce_async backward {tag}")
    # without autograd the handle still works and returns a plain tensor
    with torch.no_grad():
        y = C.all_gather_async(xg, d, lengths).wait()
    assert y.grad_fn is None and torch.equal(y, full)
    # all-to-all G(1) -> G(0) and a reshard to the reversed lengths, both started before either waits
    a2a_shape = full_shape(0, sum(lengths), full_shape(d, sum(lengths)))
    fa = rand(a2a_shape, "async-a2a", tag)
    xt = piece(fa, d, lengths, r).clone().requires_grad_()
    new = tuple(reversed(lengths))
    fs = rand(shape, "async-reshard", tag)
    xs = piece(fs, d, lengths, r).clone().requires_grad_()
    h5 = C.all_to_all_async(xt, d, 0, lengths, lengths)
    h6 = C.reshard_async(xs, d, lengths, new)
    y6, y5 = h6.wait(), h5.wait()
    close(y5, piece(fa, 0, lengths, r), f"all_to_all_async forward {tag}")
    close(y6, piece(fs, d, new, r), f"reshard_async forward {tag}")
    ga, gs = rand(a2a_shape, "async-a2a-g", tag), rand(shape, "async-reshard-g", tag)
    ((y5 * piece(ga, 0, lengths, r)).sum() + (y6 * piece(gs, d, new, r)).sum()).backward()
    close(xt.grad, piece(ga, d, lengths, r), f"all_to_all_async backward {tag}")
    close(xs.grad, piece(gs, d, lengths, r), f"reshard_async backward {tag}")


def check_megatron_mlp(r: int, n: int, lb, lh, padded: bool) -> None:
    """A tensor-parallel MLP on uneven shards equals the single-device program (loss and all grads).

    X: G(0) rows -> all_gather -> I; W1 sharded on columns (shard), W2 on rows; the partial product is
    R -> reduce_scatter(0) -> G(0); a replicated bias is added to the row shard; loss = sum of squares (R).
    """
    rows, d_in, hidden, d_out = sum(lb), 3, sum(lh), 2
    X, W1, W2 = rand((rows, d_in), "mlp-x"), rand((d_in, hidden), "mlp-w1"), rand((hidden, d_out), "mlp-w2")
    b = rand((d_out,), "mlp-b")
    # single-device reference
    ref = [t.clone().requires_grad_() for t in (X, W1, W2, b)]
    ref_loss = ((torch.relu(ref[0] @ ref[1]) @ ref[2] + ref[3]) ** 2).sum()
    ref_loss.backward()
    # distributed program
    x_r = piece(X, 0, lb, r).clone().requires_grad_()
    w1, w2, bias = (t.clone().requires_grad_() for t in (W1, W2, b))
    xi = C.all_gather(x_r, 0, lb, padded=padded)
    h = torch.relu(xi @ C.shard(w1, 1, lh))
    out_r = C.reduce_scatter(h @ C.shard(w2, 0, lh), 0, lb, padded=padded) + C.replicate(bias)
    loss_r = (out_r**2).sum()
    loss_r.backward()
    total = loss_r.detach().clone()
    dist.all_reduce(total)
    close(total, ref_loss.detach(), "mlp loss")
    close(x_r.grad, piece(ref[0].grad, 0, lb, r), "mlp X grad (G shard: complete)")
    close(bias.grad, ref[3].grad, "mlp replicated bias grad (complete after replicate)")
    for name, mine, want in (("W1", w1.grad, ref[1].grad), ("W2", w2.grad, ref[2].grad)):
        summed = mine.clone()
        dist.all_reduce(summed)
        close(summed, want, f"mlp {name} grad (I: partial, sums to the reference)")


def check_subgroup(r: int, n: int) -> None:
    """Collectives on a sub-group use group ranks (broadcast/reduce roots are translated to global ranks)."""
    members = list(range(1, n))
    group = dist.new_group(members)  # every rank must take part in creating it
    if r not in members:
        return
    gr, gn = r - 1, len(members)
    lengths = (2,) + (0,) * (gn - 2) + (1,)
    full = rand((3, sum(lengths)), "sub")
    partials = [rand((3, sum(lengths)), "sub-p", j) for j in range(gn)]
    for padded in (True, False):
        x = piece(full, 1, lengths, gr).clone().requires_grad_()
        y = C.all_gather(x, 1, lengths, padded=padded, group=group)
        assert torch.equal(y, full)
        y.backward(partials[gr])
        close(x.grad, piece(sum(partials), 1, lengths, gr), "subgroup all_gather backward")
        z = C.reduce_scatter(partials[gr], 1, lengths, padded=padded, group=group)
        close(z, piece(sum(partials), 1, lengths, gr), "subgroup reduce_scatter")
    close(C.all_reduce(partials[gr], group=group), sum(partials), "subgroup all_reduce")
    with pytest.raises(ValueError, match=f"process group has {gn} ranks"):
        C.all_gather(full, 0, (3,) * n, group=group)


def check_empty_other_dims(r: int, n: int, lengths) -> None:
    """Tensors with a zero-size dim besides the sharded one: right shapes, no communication deadlock."""
    new = other_lengths(lengths, 1)
    x = torch.zeros(lengths[r], 0, dtype=F64, requires_grad=True)
    for padded in (True, False):
        y = C.all_gather(x, 0, lengths, padded=padded)
        assert y.shape == (sum(lengths), 0)
        y.sum().backward()
        z = C.reduce_scatter(torch.zeros(sum(lengths), 0, requires_grad=True), 0, lengths, padded=padded)
        assert z.shape == (lengths[r], 0)
    assert C.reshard(x, 0, lengths, new).shape == (new[r], 0)
    w = torch.zeros(lengths[r], 0, sum(new))
    assert C.all_to_all(w, 0, 2, lengths, new).shape == (sum(lengths), 0, new[r])
    assert x.grad.shape == x.shape


def check_errors(r: int, n: int, lengths) -> None:
    """Bad arguments raise ValueError on every rank before any communication."""
    x = torch.zeros(lengths[r] + 1, 3, dtype=F64)
    with pytest.raises(
        ValueError, match=r"all_gather: rank \d+ holds a shard .* size on dim 0 is .*lengths\[rank\]"
    ):
        C.all_gather(x, 0, lengths)
    with pytest.raises(ValueError, match=r"len\(lengths\)=\d+ but the process group has \d+ ranks"):
        C.all_gather(x, 0, tuple(lengths) + (1,))
    with pytest.raises(ValueError, match=r"reduce_scatter: .* sum\(lengths\)="):
        C.reduce_scatter(torch.zeros(sum(lengths) + 1, 2), 0, lengths)
    with pytest.raises(ValueError, match="use reshard"):
        C.all_to_all(torch.zeros(lengths[r], sum(lengths)), 0, 0, lengths, lengths)
    with pytest.raises(ValueError, match="new_lengths"):
        C.reshard(torch.zeros(lengths[r], 2), 0, lengths, tuple(lengths[:-1]) + (lengths[-1] + 1,))
    with pytest.raises(ValueError, match="out of range"):
        C.all_gather(torch.zeros(lengths[r]), 1, lengths)
    with pytest.raises(ValueError, match="non-negative"):
        C.all_gather(torch.zeros(lengths[r]), 0, (-1,) + tuple(lengths[1:]))


def run_checks(r: int, n: int) -> list[str]:
    done: list[str] = []
    cases = LENGTHS[n]
    for ci, lengths in enumerate(cases):
        for dim in (0, 1, -1):
            for padded in (True, False):
                tag = (ci, dim, padded)
                check_all_gather(r, n, lengths, dim, padded, tag)
                check_reduce_scatter(r, n, lengths, dim, padded, tag)
                done += [f"all_gather{tag}", f"reduce_scatter{tag}"]
            check_shard(r, n, lengths, dim, (ci, dim))
            done.append(f"shard{(ci, dim)}")
        for shift in (0, 1):
            new = other_lengths(lengths, shift)
            for dim in (0, 2):
                check_reshard(r, n, lengths, new, dim, (ci, shift, dim))
                done.append(f"reshard{(ci, shift, dim)}")
            for cat_dim, split_dim in ((0, 1), (1, 0), (2, -3), (1, 2)):
                tag = (ci, shift, cat_dim, split_dim)
                check_all_to_all(r, n, lengths, new, cat_dim, split_dim, tag)
                done.append(f"all_to_all{tag}")
        check_reshard(r, n, lengths, lengths, 1, (ci, "same"))  # nothing moves
        check_async(r, n, lengths, ci)
        check_megatron_mlp(r, n, lengths, other_lengths(lengths, 1), padded=ci % 2 == 0)
        done += [f"reshard{(ci, 'same')}", f"async{ci}", f"mlp{ci}"]
    for t in range(2):
        check_all_reduce(r, n, t)
        check_replicate(r, n, t)
    check_to_partial(r, n)
    check_fallback_reduce_scatter(r, n, cases[0])
    check_float32_and_int(r, n, cases[0])
    check_errors(r, n, cases[0])
    check_empty_other_dims(r, n, cases[0])
    if n >= 3:
        check_subgroup(r, n)
        done.append("subgroup")
    done += ["all_reduce", "replicate", "to_partial", "fallback", "dtypes", "errors", "empty"]
    dist.barrier()
    return done


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        done = run_checks(rank, world)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(done))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, outdir: Path, timeout: float = 120.0) -> list[list[str]]:
    """Run ``_worker`` on ``world`` gloo ranks; kill the processes we started if they overrun."""
    ctx = mp.start_processes(
        _worker, args=(world, _free_port(), str(outdir)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} gloo ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [json.loads(Path(outdir, f"rank{k}.json").read_text()) for k in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "world", [2, 3]
)  # even, and uneven cuts on an odd world (4 added ~20 s, no new case)
def test_collectives_match_single_process_reference(world: int, tmp_path: Path) -> None:
    reports = launch(world, tmp_path)
    assert len(reports) == world
    assert all(rep == reports[0] for rep in reports), "ranks ran different checks"
    assert len(reports[0]) > 50
    assert "errors" in reports[0] and "mlp0" in reports[0]


# --------------------------------------------------------------------------------------------------
# single process (torch.distributed not initialised: acts as one rank)
# --------------------------------------------------------------------------------------------------


def test_single_rank_without_init() -> None:
    assert not dist.is_initialized()
    x = rand((3, 4), "single").requires_grad_()
    for padded in (True, False):
        y = C.all_gather(x, 1, (4,), padded=padded)
        assert torch.equal(y, x.detach()) and y.data_ptr() != x.data_ptr()
        z = C.reduce_scatter(x, 0, [3], padded=padded)
        assert torch.equal(z, x.detach())
    assert torch.equal(C.all_reduce(x), x.detach())
    assert torch.equal(C.all_to_all(x, 0, 1, (3,), (4,)), x.detach())
    assert torch.equal(C.reshard(x, 1, (4,), (4,)), x.detach())
    assert torch.equal(C.to_partial(x), x)
    y = C.all_gather(x, 0, (3,)) * 2 + C.replicate(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    h = C.all_reduce_async(x)
    assert torch.equal(h.wait(), x.detach()) and h.is_completed()


def test_errors_without_init() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="not initialised, so this process counts as a single rank"):
        C.all_gather(x, 0, (1, 1))
    with pytest.raises(
        ValueError, match=r"all_gather: rank 0 holds a shard of shape \(2, 3\).*lengths\[rank\]=3"
    ):
        C.all_gather(x, 0, (3,))
    with pytest.raises(ValueError, match=r"all_to_all: rank 0 .* cat_lengths\[rank\]=1"):
        C.all_to_all(x, 0, 1, (1,), (3,))
    with pytest.raises(TypeError, match="python ints"):
        C.all_gather(x, 0, (2.0,))
    with pytest.raises(RuntimeError, match="not initialised"):
        C.all_reduce(x, group=object())
