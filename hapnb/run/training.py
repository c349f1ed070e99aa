"""What a training loop around :func:`hapnb.distribute` needs besides the forward: each rank's share of a
global batch (:class:`ShareSampler`), the global loss for logging (:func:`global_loss`), gradient
clipping by the global norm over sharded and replicated gradients (:func:`clip_grad_norm_`), and the
check that every rank holds the same plan and model (:func:`check_same_everywhere`).

These are the :class:`hapnb.run.distribute.DistributedModule` methods ``batch_sampler``, ``global_loss``
and ``clip_grad_norm_``; see docs/training.md for the loop beside a DDP loop.

>>> s = ShareSampler(10, batch=4, shares=(2, 1, 1), rank=1, shuffle=False, drop_last=True)
>>> list(s), len(s)
([[2], [6]], 2)
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from ..runtime.collective_errors import guarded
from ..runtime.program import LocalParam

__all__ = [
    "ShareSampler", "batch_share", "scaled_shares", "rescale_plan", "global_loss", "clip_grad_norm_",
    "check_same_everywhere", "plan_digests", "weight_sums", "PROGRAM_FIELDS", "rank0_seed",
]  # fmt: skip


class ShareSampler(Sampler[list[int]]):
    """A batch sampler that yields this rank's rows of each global batch: the dataset's row indices
    (shuffled by ``seed`` and the epoch, the same permutation on every rank) are cut into global batches
    of ``batch`` rows, and each batch into the ranks' ``shares`` (rows per rank, summing to ``batch``;
    None: every rank takes the whole batch). For ``DataLoader(dataset, batch_sampler=...)``.

    A dataset that is not a whole number of global batches leaves a short last batch: it is split by the
    same ratios when they give every rank a whole number of its rows (and ``short_ok``: the module can
    run that batch size), dropped with ``drop_last=True``, and refused otherwise. :meth:`set_epoch`
    reshuffles, as with ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        batch: int,
        shares: Sequence[int] | None,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        short_ok: bool = True,
    ) -> None:
        if (
            dataset_len < 0
            or batch <= 0
            or (shares is not None and (sum(shares) != batch or rank >= len(shares)))
        ):
            raise ValueError(f"ShareSampler: shares {shares} of rank {rank} are not a split of {batch} rows")
        self.dataset_len, self.batch, self.shares, self.rank = dataset_len, batch, shares, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self.short = 0 if drop_last else dataset_len % batch
        if self.short and shares is not None:
            scaled = scaled_shares(shares, batch, self.short)
            if scaled is None or not short_ok:
                why = (
                    f"the plan's shares {tuple(shares)} of {batch} rows do not split {self.short} rows into whole "
                    "numbers"
                    if scaled is None
                    else "the plan's program cannot be rescaled to another batch size (a rank has no rows)"
                )
                raise ValueError(
                    f"batch_sampler: {dataset_len} rows make {dataset_len // batch} global batches of {batch} and "
                    f"a short last batch of {self.short} rows, but {why}. Pass drop_last=True, or give a dataset "
                    f"of a multiple of {batch} rows"
                )
        if len(self) == 0:
            raise ValueError(f"batch_sampler: {dataset_len} rows make no global batch of {batch} rows")

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` next (the same on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.dataset_len // self.batch + (1 if self.short else 0)

    def _mine(self, rows: int) -> tuple[int, int]:
        if self.shares is None:
            return 0, rows
        shares = self.shares if rows == self.batch else scaled_shares(self.shares, self.batch, rows)
        assert shares is not None
        return sum(shares[: self.rank]), shares[self.rank]

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=gen).tolist()
        else:
            order = list(range(self.dataset_len))
        for b in range(len(self)):
            rows = min(self.batch, self.dataset_len - b * self.batch)
            start, length = self._mine(rows)
            first = b * self.batch + start
            yield order[first : first + length]


def batch_share(
    input_names: Sequence[str], input_slices: Sequence[tuple[int, int, int]], batch_sizes: Sequence[int],
    lengths: Callable[[str, int], tuple[int, ...]],
) -> tuple[int, tuple[int, ...] | None]:  # fmt: skip
    """``(batch, shares)``: the global batch (rows on dim 0 of every input) and every rank's rows of it,
    from a rank program's input slices (``dim == -1``: every rank takes the whole input; ``shares`` None
    when all do) and the plan's shard ``lengths(input, dim)``. Raises when the inputs are not all cut
    alike on dim 0 (a row sampler cannot serve them)."""
    sizes = set(batch_sizes)
    if len(sizes) != 1:
        listed = ", ".join(f"{n}: {b}" for n, b in zip(input_names, batch_sizes))
        raise ValueError(f"batch_sampler needs inputs of one batch size on dim 0, got {listed}")
    (batch,) = sizes
    cuts = {None if d < 0 else (d, lengths(n, d)) for n, (d, _, _) in zip(input_names, input_slices)}
    if len(cuts) != 1 or (None not in cuts and next(iter(cuts))[0] != 0):
        listed = ", ".join(
            f"{n}: dim {d} rows [{s}, {s + k})" for n, (d, s, k) in zip(input_names, input_slices)
        )
        raise ValueError(
            f"batch_sampler needs every input cut alike on dim 0 (the batch), but this rank takes {listed}; "
            "use distribute(..., inputs='full') (every rank then reads whole batches) or feed the global batch "
            "through dm.local_inputs"
        )
    cut = next(iter(cuts))
    return batch, None if cut is None else tuple(cut[1])


def global_loss(loss: torch.Tensor) -> float:
    """The global loss from this rank's partial loss (``R`` form: the ranks' partial losses sum to the
    single-device loss), by one all-reduce; every rank gets it. For logging: it does not backpropagate."""
    import torch.distributed as dist

    total = loss.detach().reshape(()).to(torch.float64).clone()
    if dist.is_initialized():
        _all_reduce(total, "the global loss (dm.global_loss)")
    return float(total)


def _all_reduce(x: torch.Tensor, where: str, op: Any = None) -> None:
    """In-place all-reduce of a training helper on the default group; a timeout or a lost peer raises the
    :class:`~hapnb.runtime.collective_errors.CollectiveError` that names this rank and ``where``."""
    import torch.distributed as dist

    kw = {} if op is None else {"op": op}
    guarded(dist.get_rank(), None, "all_reduce", where, lambda: dist.all_reduce(x, **kw))


def clip_grad_norm_(
    module: torch.nn.Module, params: Sequence[LocalParam], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients of a rank program's weights by their global norm, as
    ``torch.nn.utils.clip_grad_norm_`` does on one device: every element of the model's gradient counts
    once. A sharded weight's gradient contributes this rank's shard (the shards are summed over ranks by
    one all-reduce); a replicated weight's gradient (the same on every rank, the program synchronised
    it) counts once. Every rank gets the same norm and scales its gradients by the same factor.
    ``params``: one record per local weight (:attr:`hapnb.runtime.program.RankProgram.unique_params`).
    Returns the total norm (before clipping)."""
    import torch.distributed as dist

    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    device = torch.device("cpu")
    for rec in params:
        if rec.kind != "param":
            continue
        p = module.get_parameter(rec.local_name)
        device = p.device
        if p.grad is not None:
            (sharded if rec.sharded else replicated).append(p.grad)
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        part = torch.zeros((), dtype=torch.float64, device=device)
        for g in sharded:
            if g.numel():
                part = torch.maximum(part, g.detach().abs().max().to(torch.float64))
        if dist.is_initialized():
            _all_reduce(part, "the gradients' global max norm (dm.clip_grad_norm_)", dist.ReduceOp.MAX)
        for g in replicated:
            if g.numel():
                part = torch.maximum(part, g.detach().abs().max().to(torch.float64))
        total = part
    else:
        part = torch.zeros((), dtype=torch.float64, device=device)
        for g in sharded:
            part = part + g.detach().to(torch.float64).abs().pow(norm_type).sum()
        if dist.is_initialized():
            _all_reduce(part, "the gradients' global norm (dm.clip_grad_norm_)")
        for g in replicated:
            part = part + g.detach().to(torch.float64).abs().pow(norm_type).sum()
        total = part.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.detach().mul_(coef.to(g.dtype))
    dtype = (sharded + replicated)[0].dtype if sharded or replicated else torch.float32
    return total.to(dtype)


# ------------------------------------------------------------------------------------------- batch size


def scaled_shares(lengths: Sequence[int], old: int, new: int) -> tuple[int, ...] | None:
    """Every rank's share ``lengths`` of ``old`` rows scaled to ``new`` rows, or None when a share would
    not be a whole number of rows (the plan's ratios cannot split ``new`` rows exactly).

    >>> scaled_shares((6, 3, 3), 12, 8), scaled_shares((6, 3, 3), 12, 10)
    ((4, 2, 2), None)
    """
    if sum(lengths) != old or old <= 0:
        return None
    if any(x * new % old for x in lengths):
        return None
    return tuple(x * new // old for x in lengths)


def rescale_plan(plan: Any, old: Any, new: Any) -> Any:
    """``plan`` (made for graph ``old``) for graph ``new``, the same model traced at another batch size:
    the same program (forms, collectives, ratios) with every shard length of a dim whose size changed
    scaled by the sizes' ratio. Raises ValueError naming the tensor when a share would not be a whole
    number of rows (the program's shapes and loss scale are then not the plan's at this batch).
    (:func:`hapnb.run.duplex.half_plan` is the half-batch case, which also re-cuts odd shares.)"""
    from dataclasses import replace

    from ..ir.forms import parse_form

    def scale(tensor: str, dim: int, ls: Sequence[int], what: str) -> tuple[int, ...]:
        try:
            a, b = old.tensor(tensor).shape[dim], new.tensor(tensor).shape[dim]
        except (KeyError, IndexError):
            raise ValueError(f"{what}: {tensor} is not in the model traced at the new batch size") from None
        if a == b:
            return tuple(ls)
        out = scaled_shares(ls, a, b)
        if out is None:
            raise ValueError(
                f"{what}: {tensor} dim {dim} has {b} elements at this batch size (planned {a}), and the plan's "
                f"shares {tuple(ls)} of {a} do not split {b} into whole numbers"
            )
        return out

    lengths = tuple((t, d, scale(t, d, ls, f"plan {plan.name}")) for t, d, ls in plan.lengths)
    program = []
    for ins in plan.program:
        if ins.kind == "collective" and ins.lengths:  # a reshard's lengths after the re-cut
            dim = parse_form(ins.form.partition("@")[0]).dim
            ins = replace(ins, lengths=scale(ins.tensor, dim, ins.lengths, f"plan {plan.name}: {ins}"))
        program.append(ins)
    return replace(
        plan, lengths=lengths, program=tuple(program), graph_fingerprint=new.fingerprint, graph=new
    )


# ------------------------------------------------------------------------------------------- fail fast


#: the plan fields that decide what a rank runs (its search statistics and timings do not)
PROGRAM_FIELDS = ("graph_fingerprint", "cluster", "ratios", "program", "lengths", "pins", "duplex")


def plan_digests(plan: Any) -> dict[str, str]:
    """A short digest of each field of the plan's JSON that decides the rank programs
    (:data:`PROGRAM_FIELDS`), to tell which field two ranks' plans differ in."""
    d = plan.to_json()
    return {
        k: hashlib.sha256(json.dumps(d.get(k), sort_keys=True, default=str).encode()).hexdigest()[:12]
        for k in PROGRAM_FIELDS
    }


def weight_sums(named: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per tensor the float64 sum and sum of squares: a cheap check that ranks start from the same
    weights (the same values give the same sums)."""
    out = {}
    with torch.no_grad():
        for k, t in named.items():
            x = t.detach().to(torch.float64)
            out[k] = (float(x.sum()), float((x * x).sum()))
    return out


def _first_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    for k in list(a) + [k for k in b if k not in a]:
        if k not in b or k not in a:
            return k
        va, vb = a[k], b[k]
        if isinstance(va, tuple) and isinstance(vb, tuple):
            if any(not math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(va, vb)):
                return k
        elif va != vb:
            return k
    return None


def rank0_seed(seed: int | None = None) -> int:
    """The seed of every rank's random stream (:mod:`hapnb.runtime.random_stream`): ``seed`` where given
    (the same on every rank), else rank 0's ``torch.initial_seed()`` sent to every rank, so ranks seeded
    apart still draw the same numbers in the program's random ops."""
    import torch.distributed as dist

    if seed is not None:
        return int(seed)
    box: list[Any] = [torch.initial_seed()]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return int(box[0])


def check_same_everywhere(info: Mapping[str, Any], own_error: BaseException | None = None) -> None:
    """Gather every rank's ``info`` once (``error``: what failed there, or None; ``plan``: field
    digests; ``graph``: the model's graph fingerprint; ``weights``: :func:`weight_sums`) and raise on
    every rank when a rank failed (``own_error`` on the rank where it happened, an error naming that rank
    on the others) or differs from rank 0, naming the rank and the first difference."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dict(info))
    if own_error is not None:
        raise own_error
    for r, got in enumerate(every):
        if got.get("error"):
            raise RuntimeError(f"distribute failed on rank {r}: {got['error']}")
    first = every[0]
    for r, got in enumerate(every[1:], start=1):
        field = _first_difference(first["plan"], got["plan"])
        if field is not None:
            raise RuntimeError(
                f"distribute: rank {r}'s plan differs from rank 0's in {field!r}: every rank must hold the same "
                "plan (load one plan file on every rank, or synthesize on rank 0 and broadcast it)"
            )
        if first["graph"] != got["graph"]:
            raise RuntimeError(
                f"distribute: rank {r}'s model traces to graph {got['graph']} but rank 0's to {first['graph']}: "
                "every rank must build the same model with the same options and example input shapes"
            )
        name = _first_difference(first["weights"], got["weights"])
        if name is not None:
            raise RuntimeError(
                f"distribute: rank {r}'s model starts from other weights than rank 0's (first at {name}): seed "
                "every rank alike (torch.manual_seed) before building the model, or load one checkpoint on "
                "every rank"
            )
