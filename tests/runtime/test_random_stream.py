"""Random ops draw from the program's own stream (hapnb.runtime.random_stream): the same numbers on every
rank whatever the ranks' global seeds, the same as the single-device program given the same seed, so a
model with drop path (a random op written by hand, as vision libraries do) verifies exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapnb as hap
from hapnb.run.training import rank0_seed
from hapnb.runtime.codegen import generate
from hapnb.runtime.random_stream import RANDOM_OPS, RandomStream, from_stream
from hapnb.runtime.reference import reference_module


class DropPathNet(nn.Module):
    """A residual MLP with stochastic depth written as timm and Hugging Face write it: a per-sample
    ``torch.rand`` mask, floored, scaling the branch."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.keep = 1.0 - p

    def drop_path(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.keep + torch.rand((x.shape[0], 1), dtype=x.dtype, device=x.device)
        mask.floor_()
        return x / self.keep * mask

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x + self.drop_path(torch.relu(self.fc1(x)))
        h = h + self.drop_path(torch.relu(self.fc2(h)))
        return F.cross_entropy(self.head(h), y)


def _batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def test_the_stream_draws_by_seed_and_count_not_by_the_global_generator() -> None:
    rand = from_stream(torch.ops.aten.rand.default)
    torch.manual_seed(1)
    a = rand(RandomStream(3), [5])
    torch.manual_seed(2)
    s = RandomStream(3)
    b = rand(s, [5])
    assert torch.equal(a, b) and s.draws == 1
    assert not torch.equal(b, rand(s, [5]))  # the next draw is another one
    s.reseed(3)
    assert torch.equal(rand(s, [5]), a) and s.draws == 1
    bern = from_stream(torch.ops.aten.bernoulli.p)(RandomStream(3), torch.empty(1000), 0.25)
    assert 150 < int(bern.sum()) < 350  # still the distribution asked for
    assert (
        from_stream(torch.ops.aten.randn.default)(RandomStream(0), [2], device="meta").device.type == "meta"
    )


def test_every_op_the_rules_run_replicated_as_random_draws_from_the_stream() -> None:
    """The rules' random table (replicated only: every rank must draw the same numbers) and the stream
    cover the same ops."""
    from hapnb.rules import family, registered

    random_rule = {t for t in registered() if family(t) == "random"}
    assert random_rule == {str(op) for op in RANDOM_OPS}


def test_a_rank_program_draws_what_the_single_device_program_draws() -> None:
    m = DropPathNet()
    x = _batch()
    plan = hap.synthesize(m, "1xV100", example_inputs=x)
    g = plan.graph
    ref = reference_module(g, dropout=False, seed=11)
    torch.manual_seed(100)  # the global generator plays no part
    prog = generate(plan, g, 0, seed=11)
    torch.manual_seed(200)
    assert float(prog.module(*x).detach()) == float(ref(*x).detach())
    other = reference_module(g, dropout=False, seed=12)
    assert float(other(*x).detach()) != float(
        ref(*x).detach()
    )  # drop path is on: another seed drops other samples


def test_the_ranks_seed_is_the_one_given_or_this_process_s_own_seed() -> None:
    assert rank0_seed(7) == 7
    torch.manual_seed(42)
    assert rank0_seed() == 42  # one process: no other rank to agree with


@pytest.mark.slow
def test_drop_path_verifies_exactly_with_the_batch_sharded() -> None:
    plan = hap.synthesize(DropPathNet(), "1xV100+1xP100", example_inputs=_batch(), pins={"x": hap.Shard(0)})
    assert [i.form for i in plan.program if i.kind == "load" and i.tensor == "x"] == ["G0"]
    rep = hap.verify(plan, nproc=2, steps=2, timeout=120)
    assert rep.ok, rep.text()


def test_a_program_made_again_continues_the_draws_of_the_one_it_replaces() -> None:
    """A program for another batch size, or after a reshard, draws on from the planned program's stream
    (``continue_stream``) instead of repeating its first masks."""
    from hapnb.runtime.random_stream import continue_stream

    m = DropPathNet()
    x = _batch()
    plan = hap.synthesize(m, "1xV100", example_inputs=x)
    ref = reference_module(plan.graph, dropout=False, seed=3)
    first, second = float(ref(*x).detach()), float(ref(*x).detach())
    planned, again = generate(plan, plan.graph, 0, seed=3), generate(plan, plan.graph, 0, seed=3)
    assert float(planned.module(*x).detach()) == first
    continue_stream(again.module, planned.module)
    assert float(again.module(*x).detach()) == second


def test_a_checkpoint_keeps_the_stream_so_a_resumed_run_draws_on(tmp_path) -> None:
    """save_checkpoint stores the stream's seed and draws; load_checkpoint into a new distributed module
    (another run, seeded otherwise) continues them: its next step draws what the saving run's next step
    draws, not the first step's numbers again."""
    import torch.distributed as dist

    m, x = DropPathNet(), _batch()
    plan = hap.synthesize(m, "1xV100", example_inputs=x)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(5)
        dm = hap.distribute(m, plan, example_inputs=x)
        first = float(dm(*x).detach())
        hap.save_checkpoint(tmp_path / "c", dm)
        nxt = float(dm(*x).detach())
        torch.manual_seed(6)
        again = hap.distribute(m, plan, example_inputs=x)
        hap.load_checkpoint(tmp_path / "c", again)
        assert float(again(*x).detach()) == nxt != first
    finally:
        hap.destroy_groups()
