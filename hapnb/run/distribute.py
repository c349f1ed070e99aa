"""``distribute`` / ``full_state_dict``: a plan as a DDP-like module inside a torchrun job.

>>> dm = hapnb.distribute(model, plan)  # doctest: +SKIP
>>> loader = DataLoader(ds, batch_sampler=dm.batch_sampler(len(ds)))  # doctest: +SKIP
>>> for x, y in loader:  # doctest: +SKIP
...     loss = dm(x, y); loss.backward(); dm.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
...     print(dm.global_loss(loss))
>>> model.load_state_dict(hapnb.full_state_dict(dm))  # doctest: +SKIP

See docs/training.md for the whole loop beside a DDP loop, and :mod:`hapnb.run.checkpoint` for sharded
checkpoints (``hapnb.save_checkpoint`` / ``hapnb.load_checkpoint``) that load onto another plan.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..ir.graph import Graph
from ..plans.plan import Plan
from ..runtime.bufferupdates import write_buffer
from ..runtime.codegen import generate
from ..runtime.collective_errors import set_group_timeout
from ..runtime.expand import expand_virtual
from ..runtime.program import RankProgram, program_weights
from ..runtime.random_stream import continue_stream
from ..tracing.tracer import unwrap_compiled
from . import training
from .buckets import GradBuckets, program_buckets
from .bundle import program_inputs, resolve_graph

__all__ = ["DistributedModule", "distribute", "full_state_dict"]


class DistributedModule(torch.nn.Module):
    """This rank's part of a distributed model (see :func:`distribute`): ``forward(*inputs)`` returns the
    rank's partial loss (R form); ``loss.backward()`` synchronises every gradient itself.

    ``program`` is the rank program with each local weight listed once (a tied parameter under its first
    name, its other names as ``aliases``), as ``parameters()`` lists it: an optimizer steps it once.
    ``eval()`` switches the program's dropout off. A global batch of another size than planned runs the
    same program (forms, collectives, ratios) re-derived for that size, on the same weights, when the
    plan's ratios split it into whole shares on every rank; else it is refused. Helpers for the loop,
    named like torch's: :meth:`batch_sampler`, :meth:`global_loss`, :meth:`clip_grad_norm_`.
    """

    def __init__(
        self,
        program: RankProgram,
        plan: Plan,
        input_shapes: Sequence[tuple[int, ...]] = (),
        state_keys: Sequence[str] | None = None,
        retrace: Callable[[Sequence[tuple[int, ...]]], RankProgram] | None = None,
    ) -> None:
        super().__init__()
        import dataclasses

        self.module = program.module
        self.program = dataclasses.replace(program, params=program.unique_params)
        self.plan = plan
        self.rank = program.rank
        #: the full (global) shape of every input the program was made for
        self.input_shapes = tuple(tuple(s) for s in input_shapes)
        #: the keys of the model's ``state_dict()`` (what :func:`full_state_dict` returns), or None
        self.state_keys = tuple(state_keys) if state_keys is not None else None
        self._updates_buffers = any(nd.target is write_buffer for nd in self.module.graph.nodes)
        self._retrace = retrace
        #: programs for other global batch sizes (sharing this module's weights), by batch size
        self._variants: dict[int, RankProgram] = {}
        self._batch = self.input_shapes[0][0] if self.input_shapes and self.input_shapes[0] else 0
        self._why_fixed = self._fixed_batch_reason()
        #: the replicated gradients' buckets (``grad_sync="buckets"``), or None (synced in-graph)
        self.buckets: GradBuckets | None = None

    # ------------------------------------------------------------------ gradient sync
    def sync_gradients_in_buckets(
        self, cap_bytes: int | None = None, first_cap_bytes: int | None = None
    ) -> None:
        """All-reduce the replicated gradients in DDP-like buckets started during the backward and waited
        for at its end (what :func:`distribute` does by default); needs a program made with
        ``grad_sync="buckets"``. Call it on every rank (it makes a process group)."""
        if not self.program.grad_sync:
            raise ValueError("the program syncs its gradients in-graph: generate it with grad_sync='buckets'")
        self.buckets = program_buckets(
            self.module,
            self.program.grad_sync,
            cap=cap_bytes,
            first_cap=first_cap_bytes,
            wait_at_backward_end=True,
        )
        self.register_full_backward_pre_hook(self._before_backward)

    def _before_backward(self, _module: Any, _grad: Any) -> None:
        """A backward that would add to gradients an earlier backward already all-reduced: the buckets
        all-reduce ``.grad`` as it is, so the earlier sums would be counted once per rank. Refused."""
        b = self.buckets
        if b is not None and not b.paused and b.holds_sums():
            raise RuntimeError(
                f"rank {self.rank}: this backward would add to gradients the previous backward already "
                "all-reduced (gradient accumulation): run the inner micro-steps under dm.no_sync() (as with "
                "DDP), or zero the gradients first (optimizer.zero_grad()), or distribute(..., "
                "grad_sync='sync') to all-reduce every backward's own gradients"
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Like DDP's: inside, backward passes accumulate the replicated gradients without all-reducing
        them; the first backward outside all-reduces the sums (gradient accumulation: run the inner
        micro-steps under ``no_sync``). The program's feature collectives still run: a sharded layer needs
        them for its forward and backward."""
        if self.buckets is None:  # in-graph sync (grad_sync="sync"): every backward syncs
            yield
            return
        self.buckets.paused = True
        try:
            yield
        finally:
            self.buckets.paused = False

    # ------------------------------------------------------------------ the batch
    def _fixed_batch_reason(self) -> str:
        """Why this program runs only the planned batch size ('' when it can be re-derived for another)."""
        if self._retrace is None:
            return "the module was built without its model"
        if not self.input_shapes or any(not s or s[0] != self._batch for s in self.input_shapes):
            return "its inputs do not share one batch size on dim 0"
        for name, (d, _, _) in zip(self.program.input_names, self.program.input_slices):
            if d >= 0 and 0 in self.plan.lengths_of(name, d):
                return f"a rank has no rows of {name}, so it could not tell the batch size from its share"
        return ""

    def _expected(self, prog: RankProgram, batch: int, local: bool) -> list[tuple[int, ...]]:
        """The shape of every input ``prog`` takes (global batch ``batch``; ``local``: this rank's rows)."""
        out = []
        for shape, (d, _start, length) in zip(self.input_shapes, prog.input_slices):
            s = list(shape)
            if s:
                s[0] = batch
            if local and d >= 0:
                s[d] = length
            out.append(tuple(s))
        return out

    def _program_for(self, inputs: Sequence[Any], local: bool) -> RankProgram:
        """The program that runs these inputs (the planned one, or one re-derived for their batch size)."""
        names = self.program.input_names
        if len(inputs) != len(names):
            raise TypeError(f"the program takes {len(names)} inputs ({', '.join(names)}), got {len(inputs)}")
        if not self.input_shapes:
            return self.program
        shapes = [tuple(getattr(x, "shape", ())) for x in inputs]
        if shapes == self._expected(self.program, self._batch, local):
            return self.program
        for batch, prog in self._variants.items():
            if shapes == self._expected(prog, batch, local):
                return prog
        batch = self._batch_of(shapes, local)
        if batch is not None and not self._why_fixed and self._splits(batch):
            prog = self._variant(batch)
            if shapes == self._expected(prog, batch, local):
                return prog
        raise self._batch_error(shapes, local, batch)

    def _batch_of(self, shapes: Sequence[tuple[int, ...]], local: bool) -> int | None:
        """The global batch size these input shapes are (this rank's rows of) one batch of, or None."""
        x, (d, _, length) = shapes[0], self.program.input_slices[0]
        if not x:
            return None
        if not local or d < 0:
            return x[0]
        if d != 0 or length == 0 or x[0] * self._batch % length:
            return None
        return x[0] * self._batch // length

    def _splits(self, batch: int) -> bool:
        """Whether the plan's ratios give every rank a whole share of ``batch`` rows of every input."""
        return all(
            training.scaled_shares(self.plan.lengths_of(name, d), self._batch, batch) is not None
            for name, (d, _, _) in zip(self.program.input_names, self.program.input_slices)
            if d == 0
        )

    def _variant(self, batch: int) -> RankProgram:
        """The program re-derived for a global batch of ``batch`` rows, on this module's weights."""
        prog = self._variants.get(batch)
        if prog is not None:
            return prog
        shapes = [(batch, *s[1:]) for s in self.input_shapes]
        assert self._retrace is not None
        try:
            prog = self._retrace(shapes)
            _share_weights(prog.module, self.module)
        except Exception as e:
            raise ValueError(
                f"rank {self.rank}: plan {self.plan.name} cannot run a global batch of {batch} rows (planned "
                f"{self._batch}): {e}. Feed global batches of {self._batch} rows, or synthesize a plan for "
                f"batch {batch}"
            ) from None
        self._variants[batch] = prog
        return prog

    def _batch_error(self, shapes: Sequence[tuple[int, ...]], local: bool, batch: int | None) -> ValueError:
        names = self.program.input_names
        want = self._expected(self.program, self._batch, local)
        k = next((i for i, (a, b) in enumerate(zip(shapes, want)) if a != b), 0)
        which = (
            f"rank {self.rank}'s rows of the batch"
            if local and want[k] != self.input_shapes[k]
            else "the batch"
        )
        if self._why_fixed:
            why = f"the program runs the planned batch only ({self._why_fixed})"
        elif batch is None or any(a[1:] != b[1:] for a, b in zip(shapes, want)):
            why = "only the batch size (dim 0) may differ, by whole shares of every rank"
        else:
            why = f"{batch} rows do not give every rank a whole share by the plan's ratios"
        return ValueError(
            f"rank {self.rank}: input {names[k]} has shape {shapes[k]}, but plan {self.plan.name}'s program takes "
            f"{which} as {want[k]} (global {self.input_shapes[k]}, rows by rank: {self._shares()}); {why}. Feed "
            f"global batches of {self._batch} rows (dm.batch_sampler gives every rank its rows of each), or "
            "synthesize a plan for this batch"
        )

    def _shares(self) -> str:
        d = next((d for d, _, _ in self.program.input_slices if d >= 0), -1)
        if d < 0:
            return "all rows on every rank"
        name = next(
            n for n, (dd, _, _) in zip(self.program.input_names, self.program.input_slices) if dd >= 0
        )
        return ", ".join(str(x) for x in self.plan.lengths_of(name, d))

    # ------------------------------------------------------------------ running
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not self.training and self._updates_buffers:
            raise RuntimeError(
                f"rank {self.rank}: eval() on a model that updates buffers (batch norm's running statistics): "
                "the plan was traced in training mode (batch statistics, running statistics updated), so its "
                "program has no eval-mode forward. Evaluate the single-device model with "
                "model.load_state_dict(hapnb.full_state_dict(dm))"
            )
        prog = self._program_for(inputs, local=self.program.inputs == "local")
        if prog is self.program:
            return self.module(*inputs)
        prog.module.train(self.training)
        return prog.module(*inputs)

    def local_inputs(self, *full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's slices of the global batch (what ``forward`` takes with ``inputs='local'``). A batch
        of another size than planned is split by the plan's ratios when they give whole shares, and
        refused otherwise (the same error on every rank)."""
        return self._program_for(full, local=False).local_inputs(*full)

    def batch_sampler(
        self, dataset_len: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> training.ShareSampler:
        """A batch sampler for ``DataLoader(dataset, batch_sampler=...)``: this rank's rows of each global
        batch, by the plan's shares (the same permutation on every rank from ``seed``; ``set_epoch``
        reshuffles). The loader's batches go straight to ``forward``. A short last batch is split by the
        same ratios when they give whole shares, dropped with ``drop_last=True``, and refused otherwise."""
        if not self.input_shapes:
            raise ValueError(
                "batch_sampler needs the program's input shapes; build the module with distribute()"
            )
        local = self.program.inputs == "local"
        batch, shares = training.batch_share(
            self.program.input_names,
            self.program.input_slices if local else [(-1, 0, 0)] * len(self.input_shapes),
            [s[0] if s else 0 for s in self.input_shapes],
            self.plan.lengths_of,
        )
        return training.ShareSampler(
            dataset_len, batch=batch, shares=shares, rank=self.rank, shuffle=shuffle, seed=seed,
            drop_last=drop_last, short_ok=not self._why_fixed,
        )  # fmt: skip

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global loss (the single-device loss of the global batch) from this rank's partial loss, for
        logging: the ranks' partial losses summed by one all-reduce. Call it on every rank."""
        return training.global_loss(loss)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the global norm, as ``torch.nn.utils.clip_grad_norm_(model.parameters())``
        on one device (each element counted once: shards summed over ranks, replicated gradients once);
        returns the total norm. Call it on every rank, after ``backward``."""
        return training.clip_grad_norm_(self.module, self.program.params, max_norm, norm_type)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> DistributedModule:
        """``to()``/``double()``/...: the programs for other batch sizes keep sharing the moved weights."""
        super()._apply(fn, *args, **kwargs)
        for prog in self._variants.values():
            _share_weights(prog.module, self.module)
        return self

    def extra_repr(self) -> str:
        return f"rank={self.rank}, n={self.program.n}, inputs={self.program.inputs!r}"


def _share_weights(module: torch.nn.Module, owner: torch.nn.Module) -> None:
    """Make ``module`` (a program for another batch size) use ``owner``'s parameters and buffers, which
    have the same names and shapes (the weights' shards do not depend on the batch size)."""
    params, buffers = dict(owner.named_parameters()), dict(owner.named_buffers())
    for name, p in list(module.named_parameters()):
        if name not in params or params[name].shape != p.shape:
            raise ValueError(f"its weight {name} is not the planned program's")
        module._parameters[name] = params[name]
    for name, b in list(module.named_buffers()):
        if name not in buffers or buffers[name].shape != b.shape:
            raise ValueError(f"its buffer {name} is not the planned program's")
        module._buffers[name] = buffers[name]
    continue_stream(module, owner)  # its random ops go on with the planned program's draws


def _floating_dtype(model: Any) -> torch.dtype | None:
    if not isinstance(model, torch.nn.Module):
        return None
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _example_inputs(plan: Plan, example_inputs: Sequence[Any] | None) -> tuple[Any, ...]:
    """The inputs to trace with: given, else kept by the plan's graph, else the plan's model spec's."""
    if example_inputs is not None:
        return tuple(example_inputs)
    if plan.graph is not None:
        kept = program_inputs(plan.graph)
        if kept is not None:
            return kept
    if plan.model_spec:
        from .. import zoo

        return tuple(zoo.rebuild(plan.model_spec)[1])
    raise ValueError(
        f"distribute(model, plan) needs example_inputs=(...) to trace the model: plan {plan.name} keeps no "
        "graph with inputs and no model spec to rebuild them from"
    )


def _model_weights(model: torch.nn.Module, g: Graph) -> dict[str, torch.Tensor]:
    """The model's own tensors by graph name (tied parameters stay one tensor), constants from ``g``."""
    weights = dict(program_weights(g))
    own = dict(model.named_buffers(remove_duplicate=False))
    own.update(model.named_parameters(remove_duplicate=False))
    for k in weights:
        if k in own:
            weights[k] = own[k]
    return weights


#: the dtypes a plan made at float32 runs in when the model is cast to them (``model.double()``,
#: ``model.to(torch.bfloat16)``, ``model.half()``): its program is the float32 trace's, run in that dtype
RECAST_DTYPES = (torch.float64, torch.bfloat16, torch.float16)


def _resolve(
    plan: Plan, model: Any, inputs: tuple[Any, ...]
) -> tuple[Graph, torch.dtype | None, Mapping[str, torch.Tensor] | None]:
    """The graph the plan was made for, traced from ``model``. A model cast to another floating dtype
    than float32 (:data:`RECAST_DTYPES`: float64 for an exact check, bfloat16 or float16 to train in half
    precision) is traced as a float32 copy, and its program runs in the model's dtype on the model's own
    weights: the trace's float32 dtype constants (a mask's fill, an upcast before a softmax) become that
    dtype, so every op and every collective runs in it. An explicit float32 upcast in the model's code
    (Hugging Face's loss upcasts the logits) is a no-op in a float32 trace, so such a program computes it
    in the model's dtype too: its losses match one device's run of the cast model to that dtype's
    precision, not bit for bit. Returns ``(graph, dtype, weights)``; ``dtype`` is None for a model that
    runs as it was traced (float32, or a plan made at the model's own dtype)."""
    dtype = _floating_dtype(model)
    if dtype not in RECAST_DTYPES:
        g, _ = resolve_graph(plan, model, inputs)
        return g, None, None
    as32 = copy.deepcopy(model).float()  # plans are made at float32: try the model as it was planned first
    ins32 = tuple(x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
    try:
        g, _ = resolve_graph(plan, as32, ins32)
    except Exception:
        g, _ = resolve_graph(plan, model, inputs)  # a plan made at the model's own dtype
        return g, None, None
    return g, dtype, _model_weights(model, g)


def distribute(
    model: Any,
    plan: Plan,
    *,
    example_inputs: Sequence[Any] | None = None,
    inputs: str = "local",
    grad_sync: str = "buckets",
    timeout: float | None = None,
) -> DistributedModule:
    """Inside an initialised process group (torchrun): this rank's module for ``plan``.

    ``model`` is the single-device model (its current weights are sliced for this rank), the same on
    every rank; a plan made at float32 also runs it cast to float64 (``model.double()``) or to bfloat16
    or float16 (``model.to(torch.bfloat16)``): the program then runs in that dtype (see
    ``docs/training.md``, *Precision*). The module
    keeps a reference to ``model`` to re-derive the program for another batch size, and starts in the
    model's mode (``train``/``eval``). ``example_inputs`` default to the plan's own (its graph, or its
    model spec). With ``inputs='local'`` feed this rank's rows (``dm.batch_sampler`` or
    ``dm.local_inputs(*global_batch)``), with ``'full'`` the whole batch. Like DDP: ``loss.backward()``
    returns with every gradient synchronised. ``grad_sync="buckets"`` (default): replicated gradients are
    all-reduced in DDP-like buckets during the backward (and ``dm.no_sync()`` defers them for gradient
    accumulation); ``"sync"``: each in its own all-reduce inside autograd. ``timeout``: seconds any
    collective may wait for its peers (it sets the process group's timeout; None keeps the group's own,
    ``init_process_group(timeout=...)``); one that waits longer, or loses a peer, raises
    :class:`~hapnb.runtime.collective_errors.CollectiveError` naming this rank and the instruction.

    Every rank checks once that all ranks hold the same plan, trace the same graph and start from the
    same weights, and raises the same error everywhere naming the first difference.
    """
    import torch.distributed as dist

    model = unwrap_compiled(model)
    if not dist.is_initialized():
        raise RuntimeError(
            "distribute() needs torch.distributed: run under torchrun and call "
            "torch.distributed.init_process_group() first (or use hapnb.verify for a local check)"
        )
    n, rank = dist.get_world_size(), dist.get_rank()
    if timeout is not None:
        set_group_timeout(timeout)  # before the first collective (the same-everywhere check below)
    if n != plan.cluster.gpus:
        raise ValueError(f"plan {plan.name} is for {plan.cluster.gpus} GPUs but the job has {n} ranks")
    info: dict[str, Any] = {"error": None, "plan": {}, "graph": "", "weights": {}}
    g, dtype, weights, ins, failed = None, None, None, (), None
    try:
        ins = _example_inputs(plan, example_inputs)
        g, dtype, weights = _resolve(plan, model, ins)
        info["plan"] = training.plan_digests(plan)
        info["graph"] = g.fingerprint
        if isinstance(model, torch.nn.Module):
            info["weights"] = training.weight_sums(dict(model.state_dict()))
    except Exception as e:  # every rank learns it (a rank that raised alone would leave the others waiting)
        info["error"], failed = f"{type(e).__name__}: {e}", e
    training.check_same_everywhere(info, failed)
    assert g is not None
    plan = expand_virtual(plan, g)  # a virtual plan runs one rank per physical GPU
    if grad_sync not in ("buckets", "sync"):
        raise ValueError(f"grad_sync must be 'buckets' or 'sync', got {grad_sync!r}")
    seed = training.rank0_seed()  # the random ops draw the same numbers on every rank
    prog = generate(
        plan, g, rank, inputs=inputs, dtype=dtype, weights=weights, grad_sync=grad_sync, seed=seed
    )
    state_keys = list(model.state_dict()) if isinstance(model, torch.nn.Module) else None
    shapes = [g.tensors[t].shape for t in g.inputs]
    dev = next((p.device for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    retrace = None
    if isinstance(model, torch.nn.Module) and all(torch.is_tensor(x) for x in ins):
        dtypes = [torch.float32 if dtype is not None and x.is_floating_point() else x.dtype for x in ins]

        def retrace(batch_shapes: Sequence[tuple[int, ...]]) -> RankProgram:
            """This rank's program of the same plan for inputs of ``batch_shapes`` (another batch size)."""
            from ..tracing import trace

            source = model if dtype is None else copy.deepcopy(model).float()
            ex = tuple(torch.zeros(sh, dtype=dt, device=dev) for sh, dt in zip(batch_shapes, dtypes))
            g2 = trace(source, ex, name=plan.name)
            return generate(
                training.rescale_plan(plan, g, g2), g2, rank, inputs=inputs, dtype=dtype, grad_sync=grad_sync,
                seed=seed,
            )  # fmt: skip

    dm = DistributedModule(prog, plan, shapes, state_keys, retrace)
    if dev is not None:
        dm.to(dev)
    if prog.grad_sync:
        dm.sync_gradients_in_buckets()
    if isinstance(model, torch.nn.Module):
        dm.train(model.training)
    return dm


def full_state_dict(dm: DistributedModule) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model at full shape, on every rank (all-gathers the shards).

    Keys are the model's ``state_dict()`` keys (a tied parameter under each of its names; the tracer's
    lifted constants and non-persistent buffers left out), so
    ``model.load_state_dict(full_state_dict(dm))`` (strict) restores the single-device model exactly.
    """
    from ..runtime import collectives as C

    state = dict(dm.module.named_parameters())
    state.update(dict(dm.module.named_buffers()))
    keep = set(dm.state_keys) if dm.state_keys is not None else None
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for p in dm.program.unique_params:
            if p.kind == "const":
                continue
            names = [nm for nm in p.names if keep is None or nm in keep]
            if not names and not p.sharded:
                continue
            local = state[p.local_name].detach()
            full = C.all_gather(local.contiguous(), p.dim, p.lengths).clone() if p.sharded else local.clone()
            for nm in names:
                out[nm] = full
    return out
