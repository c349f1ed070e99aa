"""``distribute`` / ``full_state_dict``: a plan as a DDP-like module inside a torchrun job.

>>> dm = hapnb.distribute(model, plan, example_inputs=(x, y))  # doctest: +SKIP
>>> loss = dm(*dm.local_inputs(x, y)); loss.backward(); opt.step()  # doctest: +SKIP
>>> model.load_state_dict(hapnb.full_state_dict(dm))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..plans.plan import Plan
from ..runtime.codegen import generate
from ..runtime.expand import expand_virtual
from ..runtime.program import RankProgram
from .bundle import program_inputs, resolve_graph

__all__ = ["DistributedModule", "distribute", "full_state_dict"]


class DistributedModule(torch.nn.Module):
    """This rank's part of a distributed model (see :func:`distribute`): ``forward(*inputs)`` returns the
    rank's partial loss (R form); ``loss.backward()`` synchronises every gradient itself."""

    def __init__(self, program: RankProgram, plan: Plan) -> None:
        super().__init__()
        self.module = program.module
        self.program = program
        self.plan = plan
        self.rank = program.rank

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.module(*inputs)

    def local_inputs(self, *full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's slices of the global batch (what ``forward`` takes with ``inputs='local'``)."""
        return self.program.local_inputs(*full)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, n={self.program.n}, inputs={self.program.inputs!r}"


def distribute(
    model: Any, plan: Plan, *, example_inputs: Sequence[Any] | None = None, inputs: str = "local"
) -> DistributedModule:
    """Inside an initialised process group (torchrun): this rank's module for ``plan``.

    ``model`` is the single-device model (its current weights are sliced for this rank); with
    ``inputs='local'`` feed ``dm.local_inputs(*global_batch)`` (this rank's slice), with ``'full'`` the
    whole batch. Like DDP, but gradients are synchronised by the program's own collectives.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "distribute() needs torch.distributed: run under torchrun and call "
            "torch.distributed.init_process_group() first (or use hapnb.verify for a local check)"
        )
    n, rank = dist.get_world_size(), dist.get_rank()
    if n != plan.cluster.gpus:
        raise ValueError(f"plan {plan.name} is for {plan.cluster.gpus} GPUs but the job has {n} ranks")
    if model is not None and example_inputs is None:
        example_inputs = program_inputs(plan.graph) if plan.graph is not None else None
        if example_inputs is None:
            raise ValueError("distribute(model, plan) needs example_inputs=(...) to trace the model")
    g, _ = resolve_graph(plan, model, example_inputs)
    plan = expand_virtual(plan, g)  # a virtual plan runs one rank per physical GPU
    prog = generate(plan, g, rank, inputs=inputs)
    dev = next((p.device for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    dm = DistributedModule(prog, plan)
    if dev is not None:
        dm.to(dev)
    return dm


def full_state_dict(dm: DistributedModule) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model at full shape, on every rank (all-gathers the shards).

    Keys are the model's own names (``model.state_dict()`` keys; a tied parameter under each of its
    names), so ``model.load_state_dict(full_state_dict(dm))`` restores the single-device model exactly.
    """
    from ..runtime import collectives as C

    state = dict(dm.module.named_parameters())
    state.update(dict(dm.module.named_buffers()))
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for p in dm.program.params:
            local = state[p.local_name].detach()
            if p.sharded:
                out[p.name] = C.all_gather(local.contiguous(), p.dim, p.lengths).clone()
            else:
                out[p.name] = local.clone()
    return out
