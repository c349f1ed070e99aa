"""Pipeline plans (:class:`hapnb.pipelines.PipelinePlan`) trained on ranks: ``hapnb verify --plan
pipeline.json`` and ``hapnb launch pipeline.json`` run this module's worker, one rank per plan device in
stage order (``plan.devices``).

What torch.distributed.pipelining does
--------------------------------------
* **The cut.** Every rank rebuilds the plan's model from its spec (``plan.model``: zoo name or factory)
  and ``pipeline(model, micro_batch, split_spec={unit: SplitPoint.BEGINNING})`` traces it with
  torch.export and cuts it where stages 1, 2, ... begin (``plan.split_points()``); uneven stages are just
  cuts at uneven places.
* **The schedule.** One rank per stage, the stage's *leader*, joins the pipeline process group and runs
  a ``PipelineStage`` (static shapes from the trace) under ``ScheduleGPipe`` or ``Schedule1F1B`` with
  the plan's ``micro_batches``: the library splits the batch, runs forwards and backwards in the
  schedule's order, sends activations and gradients between the leaders, accumulates the micro-batches'
  gradients and, for a loss that is a mean over the batch, scales them by 1/micro_batches
  (``scale_grads``), so the gradients are those of the whole batch.

What hapnb adds (:mod:`hapnb.run.pipestage`)
--------------------------------------------
* **Checks** on the cut: one stage per plan stage, each unit's module in the stage it begins, no weight
  in two stages (weights tied across stages, e.g. a GPT-2 embedding reused as its head, are an error
  naming them), one scalar loss out of the last stage, whether the loss is a mean or a sum (the loss op's
  ``reduction``), 1F1B given at least as many micro-batches as stages.
* **A chain.** The library's stages may read a value from any earlier stage; each stage is wrapped so it
  receives every value live at its boundary and passes on what later stages need. Model inputs a later
  stage reads (the targets of the loss) are given to it directly from its own copy of the batch.
* **Data parallelism inside a stage.** The library's schedules drive one rank per stage, so a stage with
  several devices shows the library only its leader (its first device with rows). Each micro-batch's
  samples are cut by the stage's ``shares`` into whole rows (:func:`hapnb.ir.forms.shard_lengths`: floor,
  then +1 to the largest deficit); through two autograd functions the leader sends every other device
  its rows, computes its own meanwhile and gathers their outputs in device order (backward: their
  output gradients out, their input gradients back, their backward beside the leader's); the other
  devices serve those requests (:func:`hapnb.run.pipestage.serve`). Activations between stages pass
  through the leaders only.
  After the schedule's step the stage's devices all-reduce their gradients (sum) and every one of them
  steps its optimizer, so the replicas stay equal. torch.export bakes the row count into shapes, so each
  device traces its stage at its own row count and the leader also at the full micro-batch, to tell
  batch-sized boundary values (split by rows) from whole ones (sent whole, gradients summed). In the last
  stage each device's loss counts by its rows / micro-batch (mean) or fully (sum). A device with no rows
  idles through the run. Ops that mix samples (batch norm) differ from one device, as in any data
  parallelism.

Command line (under torchrun or :func:`hapnb.run.supervisor.run_local`)::

    python -m hapnb.run.pipelined PLAN.json [--steps N] [--backend gloo|nccl] [--optimizer adam|sgd]
        [--lr LR] [--dtype float64] [--no-dropout] [--metrics FILE | --metrics-fd FD] [--timeout S]

prints phase heartbeats (``load``, ``trace``, ``connect``, ``forward`` per micro-batch, ``save``) and one
metrics line per step, as :mod:`hapnb.run.worker` does::

    {"rank": 2, "stage": 1, "step": 0, "loss": 3.47, "global_loss": null, "step_s": 0.05, "max_memory_bytes": ...}

``loss`` is the batch's loss on the last stage's leader and 0 elsewhere (so the sum over ranks is the
loss, as for SPMD plans); ``global_loss`` (rank 0) that sum.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ir.forms import shard_lengths
from ..pipelines import PipelinePlan
from .pipestage import PipelineError, Split, check_units, split_model
from .supervisor import Outcome, run_local

__all__ = [
    "PIPELINE_WORKER_ARGV",
    "PipelineError",
    "Role",
    "load_model",
    "main",
    "manual_plan",
    "prepare",
    "roles",
    "run_rank",
    "run_ranks",
]

#: How to start a pipeline rank: ``python *PIPELINE_WORKER_ARGV PLAN.json ...``.
PIPELINE_WORKER_ARGV: tuple[str, ...] = ("-m", "hapnb.run.pipelined")


@dataclass(frozen=True)
class Role:
    """What rank ``rank`` does: device ``index`` of stage ``stage``, whose devices are ranks ``ranks``
    with ``rows`` rows of every micro-batch each; the stage's ``leader`` (an index) is its first device
    with rows.

    >>> from hapnb.hardware.cluster import Cluster
    >>> from hapnb.pipelines import PipelinePlan, PipelineStage
    >>> p = PipelinePlan("p", (), Cluster.parse("3xV100"), ("(input)", "a", "b"),
    ...     (PipelineStage(0, (0, 2), ("v100-0",)), PipelineStage(1, (2, 3), ("v100-1", "v100-2"), (0.7, 0.3))),
    ...     "GPipe", 2, 8)
    >>> [(r.stage, r.ranks, r.rows, r.is_leader) for r in roles(p)]
    [(0, (0,), (4,), True), (1, (1, 2), (3, 1), True), (1, (1, 2), (3, 1), False)]
    """

    rank: int
    stage: int
    index: int
    ranks: tuple[int, ...]
    rows: tuple[int, ...]
    leader: int

    @property
    def is_leader(self) -> bool:
        return self.index == self.leader

    @property
    def my_rows(self) -> int:
        return self.rows[self.index]

    @property
    def active(self) -> tuple[int, ...]:
        """The ranks of the stage's devices with rows."""
        return tuple(r for r, n in zip(self.ranks, self.rows) if n > 0)


def roles(plan: PipelinePlan) -> tuple[Role, ...]:
    """Every rank's :class:`Role`, in rank order (``plan.devices``)."""
    out: list[Role] = []
    for st in plan.stages:
        rows = shard_lengths(plan.micro_batch_size, st.shares)
        ranks = tuple(range(len(out), len(out) + len(st.devices)))
        leader = next(i for i, n in enumerate(rows) if n > 0)
        out += [Role(r, st.index, i, ranks, rows, leader) for i, r in enumerate(ranks)]
    return tuple(out)


def manual_plan(
    model: str,
    options: Mapping[str, Any],
    units: Sequence[str],
    stages: Sequence[tuple[int, int, Sequence[float]]],
    schedule: str = "GPipe",
    micro_batches: int = 1,
    kind: str = "V100",
) -> PipelinePlan:
    """A pipeline plan written by hand: ``stages`` as ``(first unit, end unit, shares)`` with one device of
    ``kind`` per share (named in rank order), the batch from ``options["batch"]``.

    >>> p = manual_plan("gpt", {"layers": 2, "batch": 8}, ("(input)", "blocks.0", "blocks.1"),
    ...                 [(0, 2, (1.0,)), (2, 3, (0.5, 0.5))], "GPipe", 2)
    >>> p.split_points(), p.devices, p.micro_batch_size
    (('blocks.1',), ('v100-0', 'v100-1', 'v100-2'), 4)
    """
    from ..hardware.cluster import Cluster
    from ..pipelines import PipelineStage

    n = sum(len(sh) for _, _, sh in stages)
    cluster = Cluster.parse(f"{n}x{kind}")
    names = iter(cluster.names)
    built = tuple(
        PipelineStage(k, (a, b), tuple(next(names) for _ in sh), tuple(float(x) for x in sh))
        for k, (a, b, sh) in enumerate(stages)
    )
    return PipelinePlan(
        name=f"{model.rpartition(':')[2]}-{schedule}-{'-'.join(str(b - a) for a, b, _ in stages)}",
        model=(("name", model), ("options", tuple(sorted(options.items())))),
        cluster=cluster,
        units=tuple(units),
        stages=built,
        schedule=schedule,
        micro_batches=micro_batches,
        batch=int(options["batch"]),
        method="manual",
    )


def load_model(plan: PipelinePlan, dtype: Any = None) -> tuple[Any, tuple[Any, ...]]:
    """The plan's model and example batch, rebuilt from its spec (``dtype``: cast weights and float
    inputs). The batch must be the plan's, on dim 0 of every input."""

    from .. import zoo

    missing = PipelineError(
        f'pipeline plan {plan.name} has no model spec ("model": {{"name": ..., "options": ...}}) '
        "to rebuild its model from"
    )
    model, inputs = zoo.rebuild(plan.model_spec, missing)
    bad = [k for k, x in enumerate(inputs) if x.dim() == 0 or x.shape[0] != plan.batch]
    if bad:
        shapes = ", ".join(str(tuple(x.shape)) for x in inputs)
        raise PipelineError(
            f"pipeline plan {plan.name} is for a batch of {plan.batch}, but its model's inputs have shapes "
            f"{shapes}: every input must hold the batch on dim 0 (set the model's batch option to {plan.batch})"
        )
    if dtype is not None:
        model = model.to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    return model, tuple(inputs)


def _check_job(plan: PipelinePlan, nproc: int | None) -> None:
    n = len(plan.devices)
    if nproc is not None and nproc != n:
        per = ", ".join(f"stage {s.index}: {'+'.join(s.devices)}" for s in plan.stages)
        raise PipelineError(
            f"pipeline plan {plan.name} runs one rank per device, {n} in all ({per}); "
            f"start it with nproc={n}, not {nproc}"
        )
    if plan.schedule == "1F1B" and plan.micro_batches < len(plan.stages):
        raise PipelineError(
            f"pipeline plan {plan.name}: the 1F1B schedule needs at least as many micro-batches as stages "
            f"({plan.micro_batches} < {len(plan.stages)}); raise micro_batches or use GPipe (hapnb pipeline "
            "and hapnb.pipeline plan a schedule that runs by default: plan it again)"
        )


def _check_reduction(plan: PipelinePlan, split: Split) -> None:
    last = roles(plan)[-1]
    if split.reduction is None and (plan.micro_batches > 1 or len(last.active) > 1):
        raise PipelineError(
            f"pipeline plan {plan.name}: cannot tell whether the model's loss is a mean or a sum over the "
            "batch (its last op is not a loss with a reduction, mean or sum), so micro-batch losses "
            "cannot be added up exactly; end the model with a reduced loss"
        )


def prepare(
    plan: PipelinePlan, nproc: int | None = None, *, trace: bool = True
) -> tuple[Any, tuple[Any, ...]]:
    """Check that ``plan`` can run on ``nproc`` ranks before any rank starts (a :class:`PipelineError`
    says why not): ranks, schedule, model spec, batch, units; with ``trace`` also the cut itself (traced
    at one micro-batch: tied weights, loss). Returns the model and its example batch."""
    _check_job(plan, nproc)
    model, inputs = load_model(plan)
    check_units(model, plan.units, f"pipeline plan {plan.name}")
    if trace:
        mb = [x[: plan.micro_batch_size] for x in inputs]
        split = split_model(
            model, mb, plan.split_points(), len(plan.stages), what=f"pipeline plan {plan.name}"
        )
        _check_reduction(plan, split)
    return model, inputs


# ============================================================================================ a rank


def run_rank(
    plan: PipelinePlan | str | os.PathLike[str],
    rank: int | None = None,
    world_size: int | None = None,
    backend: str = "gloo",
    steps: int = 10,
    metrics_out: Any = None,
    *,
    lr: float | None = None,
    optimizer: str = "adam",
    dropout: bool = True,
    dtype: str | None = None,
    verify_out: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
    heartbeat: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Train ``steps`` steps of the pipeline plan as ``rank`` of ``world_size`` (environment defaults, as
    torchrun sets them); every step trains on the model's example batch. Returns this rank's metrics.
    ``verify_out``: also save ``rank<r>.pt`` there (global loss per step, this rank's gradients after the
    first step and weights after the last, by model parameter name)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    t_start = time.perf_counter()

    def phase(name: str, step: int | None = None, **extra: Any) -> None:
        if heartbeat is not None:
            heartbeat({"rank": rank, "phase": name, **({} if step is None else {"step": step}), **extra,
                       "t": round(time.perf_counter() - t_start, 3)})  # fmt: skip

    phase("load")
    import torch
    import torch.distributed as dist

    from .worker import _Sink, init_group

    if not isinstance(plan, PipelinePlan):
        plan = PipelinePlan.load(plan)
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    _check_job(plan, world_size)
    role = roles(plan)[rank]
    tdtype = getattr(torch, dtype) if dtype else None
    model, inputs = load_model(plan, tdtype)  # built as the plan's spec says, then cast
    if tdtype is not None:
        torch.set_default_dtype(tdtype)  # tensors the traced stages create
    what = f"pipeline plan {plan.name}"
    mb, n_stages, points = plan.micro_batch_size, len(plan.stages), plan.split_points()
    phase("trace")
    full = own = None
    if role.is_leader:
        full = split_model(model, [x[:mb] for x in inputs], points, n_stages, dropout=dropout, what=what)
        if role.stage == n_stages - 1:
            _check_reduction(plan, full)
    sharded = len(role.active) > 1
    if role.my_rows and sharded:
        own = split_model(
            model, [x[: role.my_rows] for x in inputs], points, n_stages, dropout=dropout, what=what
        )

    phase("connect")
    created = init_group(backend, rank, world_size, timeout_s)
    sink = _Sink(metrics_out, rank)
    try:
        return _train(plan, role, model, inputs, full, own, steps, lr, optimizer, verify_out, sink, phase,
                      backend, created)  # fmt: skip
    finally:
        sink.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    plan: PipelinePlan,
    role: Role,
    model: Any,
    inputs: tuple[Any, ...],
    full: Split | None,
    own: Split | None,
    steps: int,
    lr: float | None,
    optimizer: str,
    verify_out: Any,
    sink: Any,
    phase: Callable[..., None],
    backend: str,
    created: bool,
) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from .pipestage import Peers, ShardedStage, StageProgram, remote_keys, serve
    from .worker import _peak_memory, make_optimizer

    all_roles = roles(plan)
    n_stages, m = len(plan.stages), plan.micro_batches
    s = role.stage
    last = s == n_stages - 1
    # process groups: every rank creates every group, in the same order
    leaders = [r.rank for r in all_roles if r.is_leader]
    pp_group = dist.new_group(leaders)
    firsts = {r.stage: r for r in reversed(all_roles)}  # one role per stage
    groups = {st: dist.new_group(list(r.active)) for st, r in sorted(firsts.items()) if len(r.active) > 1}
    group = groups.get(s)
    if backend == "nccl":
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", role.rank % torch.cuda.device_count()))
        )
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    batch = tuple(x.to(device) for x in inputs)

    def on_forward(k: int) -> None:
        phase("forward", step_now[0], micro_batch=k)

    step_now = [0]
    program = None
    if role.my_rows:
        split = own if own is not None else full
        assert split is not None
        program = StageProgram(split, s, on_forward).to(device)
    peers = Peers(role.ranks, group, device) if group is not None else None
    # which boundary values are batch-sized: the leader compares its traces, then tells the others
    keys = tuple(sorted(set(program.feeds) | set(program.produces))) if program is not None else ()
    sharding = None
    if group is not None and program is not None:
        sharding = _agree_sharding(plan, role, full, own, keys, group, device)
        _broadcast_params(program, role, group)

    lib_module = None
    sched = None
    if role.is_leader:
        assert full is not None and program is not None
        if sharding is not None:
            assert peers is not None
            lib_module = ShardedStage(program, sharding, peers, role.leader, full.metas)
        else:
            lib_module = program

        def examples(ks: Sequence[Any], grad: bool) -> tuple[Any, ...]:
            out = []
            for k in ks:
                shape, dt = full.metas[k]
                out.append(
                    torch.empty(shape, dtype=dt, device=device).requires_grad_(grad and dt.is_floating_point)
                )
            return tuple(out)

        stage = PipelineStage(
            lib_module, s, n_stages, device,
            input_args=examples(full.inputs(s), s > 0), output_args=examples(full.outputs(s), True), group=pp_group,
        )  # fmt: skip
        kind = ScheduleGPipe if plan.schedule == "GPipe" else Schedule1F1B
        sched = kind(stage, m, loss_fn=lambda out, _target: out, scale_grads=full.reduction == "mean")

    params = dict(program.body.named_parameters()) if program is not None else {}
    opt = make_optimizer(optimizer, list(params.values()), lr) if params else None
    traced = full if full is not None else own
    mean = traced is not None and traced.reduction == "mean"
    out: list[dict[str, Any]] = []
    losses: list[float] = []
    grads: dict[str, Any] = {}
    for step in range(steps):
        step_now[0] = step
        t0 = time.perf_counter()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        mb_losses: list[Any] = []
        if sched is not None:
            assert program is not None and full is not None
            program.calls = 0
            args = batch if s == 0 else ()
            kwargs = {n: batch[full.roots.index(n)] for n in full.root_inputs(s)}
            target = torch.zeros(m, device=device) if last else None
            sched.step(
                *args, target=target, losses=mb_losses if last else None, return_outputs=False, **kwargs
            )
            if isinstance(lib_module, ShardedStage):
                lib_module.finish()
        elif program is not None and peers is not None and sharding is not None:
            assert own is not None
            serve(program, peers, role.leader, remote_keys(program, sharding), own.metas)
            if mean and m > 1:  # the library scaled the leader's gradients by 1/micro_batches; do ours
                for p in params.values():
                    if p.grad is not None:
                        p.grad.div_(m)
        if group is not None and params:
            _sum_grads(params, group)
        if step == 0 and verify_out is not None:
            grads = {n: p.grad.detach().cpu().clone() for n, p in params.items() if p.grad is not None}
        if opt is not None:
            opt.step()
        mine = torch.stack([x.detach() for x in mb_losses]) if mb_losses else None
        loss = 0.0 if mine is None else float(mine.mean() if mean else mine.sum())
        total = torch.tensor([loss], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        losses.append(float(total))
        rec = {
            "rank": role.rank, "stage": s, "step": step, "loss": loss,
            "global_loss": losses[-1] if role.rank == 0 else None,
            "step_s": time.perf_counter() - t0, "max_memory_bytes": _peak_memory(device),
        }  # fmt: skip
        out.append(rec)
        sink(rec)
    if verify_out is not None:
        phase("save")
        _save_verify_record(verify_out, role, model, params, losses, grads)
    if created:
        dist.barrier()
    return out


def _agree_sharding(
    plan: PipelinePlan,
    role: Role,
    full: Split | None,
    own: Split | None,
    keys: tuple[str, ...],
    group: Any,
    device: Any,
) -> Any:
    """Which boundary values of a stage on several devices are batch-sized (and on which dim): the leader
    compares its traces at the full micro-batch and at its own rows (:meth:`Sharding.compare`) and
    broadcasts the answer to the stage's other devices."""
    import torch
    import torch.distributed as dist

    from .pipestage import Sharding

    sharding = None
    if role.is_leader:
        assert full is not None and own is not None
        weights = [n / plan.micro_batch_size if full.reduction == "mean" else 1.0 for n in role.rows]
        sharding = Sharding.compare(full, own, keys, role.rows, weights, f"pipeline plan {plan.name}")
        code = torch.tensor([v for _, d in sharding.dims for v in (d or (-1, 0))], dtype=torch.int64)
    else:
        code = torch.zeros(2 * len(keys), dtype=torch.int64)
    code = code.to(device)
    dist.broadcast(code, src=role.ranks[role.leader], group=group)
    pairs = code.view(-1, 2).tolist()
    dims = tuple((k, None if d < 0 else (d, p)) for k, (d, p) in zip(keys, pairs))
    return sharding or Sharding(role.rows, dims, ())


def _save_verify_record(
    verify_out: Any,
    role: Role,
    model: Any,
    params: Mapping[str, Any],
    losses: list[float],
    grads: dict[str, Any],
) -> None:
    """Write ``rank<r>.pt`` for :func:`hapnb.verify`: the global loss per step, this rank's gradients after
    the first step and weights after the last, by model parameter name (a tied one under each name)."""
    import torch

    from ..runtime.program import tied_groups

    named = dict(model.named_parameters(remove_duplicate=False))
    tied = tied_groups({n: p.detach() for n, p in named.items()}, list(named))
    weights = {n: p.detach().cpu().clone() for n, p in params.items()}
    for table in (grads, weights):  # a tied parameter under each of its names, as the reference has it
        for n in list(table):
            for alias in tied.get(n, ()):
                table.setdefault(alias, table[n])
    d = Path(verify_out)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".rank{role.rank}.pt.tmp"
    torch.save(
        {"rank": role.rank, "stage": role.stage, "losses": losses, "grads": grads, "weights": weights}, tmp
    )
    tmp.replace(d / f"rank{role.rank}.pt")


def _broadcast_params(program: Any, role: Role, group: Any) -> None:
    """The stage's devices start from the leader's weights (they rebuilt the same model; this makes sure)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for _, p in sorted(program.body.named_parameters()):
            dist.broadcast(p.data, src=role.ranks[role.leader], group=group)


def _sum_grads(params: Mapping[str, Any], group: Any) -> None:
    """Sum the stage's gradients over its devices (one flat all-reduce; a parameter none of them has a
    gradient for keeps None, as on one device)."""
    import torch
    import torch.distributed as dist

    names = sorted(params)
    ps = [params[n] for n in names]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
    has = torch.tensor([p.grad is not None for p in ps], dtype=flat.dtype, device=flat.device)
    buf = torch.cat([flat, has])
    dist.all_reduce(buf, group=group)
    at = 0
    for p in ps:
        n = p.numel()
        p.grad = buf[at : at + n].view_as(p).clone()
        at += n
    for p, h in zip(ps, buf[at:].tolist()):
        if h == 0:
            p.grad = None


# ======================================================================================== the parent


def run_ranks(
    plan: PipelinePlan,
    work: str | os.PathLike[str],
    steps: int,
    *,
    backend: str = "gloo",
    dtype: str | None = None,
    optimizer: str = "adam",
    lr: float | None = None,
    dropout: bool = True,
    verify_out: str | os.PathLike[str] | None = None,
    stall_s: float | None = 300.0,
    wall_s: float | None = None,
    on_heartbeat: Callable[[int, dict[str, Any]], None] | None = None,
    limit_names: tuple[str, str] = ("stall_s", "wall_s"),
) -> Outcome:
    """Run ``plan`` on its ranks on this machine under the process supervisor (plan JSON and rank logs
    in ``work``) and return the :class:`~hapnb.run.supervisor.Outcome`."""
    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    path = plan.save(w / "pipeline.json")
    backstop = (wall_s if wall_s is not None else 10 * (stall_s or 300.0)) + 60
    args = [
        *PIPELINE_WORKER_ARGV, str(path), "--steps", str(steps), "--backend", backend,
        "--optimizer", optimizer, "--timeout", f"{backstop:g}",
    ]  # fmt: skip
    if dtype:
        args += ["--dtype", dtype]
    if lr is not None:
        args += ["--lr", str(lr)]
    if not dropout:
        args.append("--no-dropout")
    if verify_out is not None:
        args += ["--verify-out", str(verify_out)]
    return run_local(
        len(plan.devices), args, stall_s=stall_s, wall_s=wall_s, on_heartbeat=on_heartbeat, log_dir=w,
        limit_names=limit_names,
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    from .worker import rank_options

    ap = argparse.ArgumentParser(
        prog="python -m hapnb.run.pipelined", description="Run one rank of a hapnb pipeline plan."
    )
    ap.add_argument("plan", help="pipeline plan JSON (hapnb pipeline -o)")
    rank_options(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hapnb.run.pipelined PLAN.json ...``; exit status 1 on any error (traceback on stderr)."""
    from .worker import _write_line, rank_main

    args = _parser().parse_args(argv)
    return rank_main(
        "hapnb.run.pipelined",
        lambda: run_rank(
            args.plan, None, None, args.backend, args.steps,
            args.metrics if args.metrics is not None else args.metrics_fd,
            lr=args.lr, optimizer=args.optimizer, dropout=not args.no_dropout, dtype=args.dtype,
            verify_out=args.verify_out, timeout_s=args.timeout, heartbeat=lambda d: _write_line(sys.stdout, d),
        ),
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
