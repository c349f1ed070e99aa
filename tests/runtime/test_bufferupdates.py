"""Buffer updates in distributed runs (hapnb.runtime.bufferupdates): batch norm's running statistics and
num_batches_tracked are updated on every rank as single-device training on the global batch updates them
(SyncBatchNorm semantics, uneven and empty shards), and verification compares buffers."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapnb as hap
from hapnb.plans.plan import Plan
from hapnb.run.verify import verify
from hapnb.runtime.codegen import generate


class BNNet(nn.Module):
    """conv -> BatchNorm2d -> relu -> pool -> linear -> BatchNorm1d -> relu -> linear; the BatchNorm1d
    has its own ``momentum`` (None: a cumulative moving average)."""

    def __init__(self, momentum: float | None = 0.3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 6)
        self.bn1 = nn.BatchNorm1d(6, momentum=momentum)
        self.out = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        h = F.relu(self.bn1(self.fc(h.mean((2, 3)))))
        return F.cross_entropy(self.out(h), y)


BUFFERS = {f"{m}.{b}" for m in ("bn", "bn1") for b in ("running_mean", "running_var", "num_batches_tracked")}


def _batch(n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(n, 3, 6, 6), torch.randint(0, 5, (n,))


@pytest.fixture(scope="module")
def model_and_plan() -> tuple[BNNet, tuple[torch.Tensor, torch.Tensor], Plan]:
    """Batch 7 cut 4/3 over a V100 and a P100: the batch norms' statistics are all-reduced sums;
    BatchNorm1d keeps a cumulative moving average (``momentum=None``)."""
    torch.manual_seed(1)
    model = BNNet(momentum=None)
    batch = _batch()
    plan = hap.synthesize(
        copy.deepcopy(model), "1xV100+1xP100", example_inputs=batch, pins={"x": hap.Shard(0)}
    )
    assert ("x", 0, (4, 3)) in plan.lengths
    return model, batch, plan


def _eager_buffers(model: nn.Module, batch: tuple[torch.Tensor, ...], steps: int) -> dict[str, torch.Tensor]:
    """Train ``model`` eagerly on one device in float64 (SGD, verify's default lr): its buffers."""
    m = copy.deepcopy(model).double().train()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x, y = batch[0].double(), batch[1]
    for _ in range(steps):
        opt.zero_grad()
        m(x, y).backward()
        opt.step()
    return {k: b.detach() for k, b in m.named_buffers()}


def test_the_rank_program_writes_the_running_statistics_back(model_and_plan) -> None:
    _, _, plan = model_and_plan
    prog = generate(plan, plan.graph, 1, dropout=False)
    assert prog.code.count("write_buffer(") == len(BUFFERS)
    assert not prog.notes  # the statistics are already replicated (all-reduced for the normalisation)
    names = {p.name for p in prog.params if p.kind == "buffer"}
    assert names == BUFFERS


@pytest.mark.slow
def test_running_statistics_equal_one_device_training(model_and_plan, tmp_path: Path) -> None:
    model, batch, plan = model_and_plan
    steps = 3
    report = verify(plan, nproc=2, steps=steps, timeout=120, keep=tmp_path)
    assert report.ok, report.text()
    assert {c.name for c in report.checks if c.kind == "buffer"} == BUFFERS
    # every rank's buffers equal eager single-device training on the whole batch (torch's own BatchNorm)
    want = _eager_buffers(model, batch, steps)
    assert int(want["bn.num_batches_tracked"]) == steps
    for r in range(2):
        rec = torch.load(tmp_path / "ranks" / f"rank{r}.pt", weights_only=True)
        got = {name: rec["weights"][local] for local, name, kind, *_ in rec["params"] if kind == "buffer"}
        assert set(got) == BUFFERS
        for name in BUFFERS:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.slow
def test_an_empty_shard_and_channel_sharded_statistics_update_alike() -> None:
    """Rank 1 holds no samples; BatchNorm1d's statistics stay sharded by channel (its batch mean ``div_2``
    pinned so: the search, which prices the update's all-gathers, would otherwise pick a plan without
    them), so their update all-gathers them first."""
    pins = {"x": hap.Shard(0), "div_2": hap.Shard(1)}
    plan = hap.synthesize(BNNet(), "2xV100", example_inputs=_batch(), ratios=[1.0, 0.0], pins=pins)
    assert ("x", 0, (7, 0)) in plan.lengths
    notes = generate(plan, plan.graph, 0, dropout=False).notes
    assert any("all-gathers" in n and "bn1.running_var" in n for n in notes), notes
    report = verify(plan, nproc=2, steps=2, timeout=120)
    assert report.ok, report.text()
    assert {c.name for c in report.checks if c.kind == "buffer"} == BUFFERS


# A worker whose programs leave the buffers alone (the behaviour before buffer updates were generated).
STALE_WORKER = textwrap.dedent(
    """
    import runpy, sys
    import hapnb.runtime.codegen
    hapnb.runtime.codegen.emit_buffer_updates = lambda *args, **kwargs: []
    sys.argv = ["hapnb.run.worker", *sys.argv[1:]]
    runpy.run_module("hapnb.run.worker", run_name="__main__")
    """
)


@pytest.mark.slow
def test_verification_names_a_buffer_the_distributed_run_never_updates(
    model_and_plan, tmp_path: Path
) -> None:
    _, _, plan = model_and_plan
    script = tmp_path / "stale_worker.py"
    script.write_text(STALE_WORKER)
    report = verify(plan, nproc=2, steps=2, timeout=120, worker=(str(script),))
    assert not report.ok
    bad = {c.name for c in report.failures}
    assert bad == BUFFERS, report.text()  # losses, gradients and weights still match
    assert all("never updated" in c.detail for c in report.failures)
    summary = report.summary()
    assert "MISMATCH" in summary and "buffer bn.running_mean" in summary and "never updated" in summary
