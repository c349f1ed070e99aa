"""distribute / full_state_dict under local ranks (examples/train.py run as a torchrun-style job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hapnb import zoo
from hapnb.run.supervisor import run_local

ROOT = Path(__file__).resolve().parents[2]


def test_distribute_needs_a_process_group() -> None:
    from hapnb.run.distribute import distribute

    model, inputs, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        distribute(model, None, example_inputs=inputs)


@pytest.mark.slow
def test_distribute_and_full_state_dict_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "trained.pt"
    args = [
        str(ROOT / "examples" / "train.py"), "--model", "mlp", "--ratios", "0.7,0.3", "--steps", "3",
        "--check", "--out", str(out), "--layers", "2", "--hidden", "32", "--input", "16", "--batch", "8",
    ]  # fmt: skip
    lines: dict[int, list[str]] = {0: [], 1: []}
    res = run_local(2, args, stall_s=90, on_line=lambda r, _s, ln: lines[r].append(ln))
    assert res.ok, res.error
    logs = ["\n".join(lines[r]) for r in range(2)]
    assert all("full_state_dict round trip exact" in log for log in logs)
    steps = [json.loads(ln) for ln in logs[0].splitlines() if ln.startswith('{"step"')]
    assert len(steps) == 3 and steps[-1]["loss"] < steps[0]["loss"]
    final = json.loads(next(ln for ln in logs[0].splitlines() if "trained_single_device_loss" in ln))
    # the gathered weights, loaded into the single-device model, are the trained ones
    assert final["trained_single_device_loss"] < steps[-1]["loss"]
    state = torch.load(out, weights_only=True)
    model, _, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    model.load_state_dict(state)
    assert set(state) == set(model.state_dict())
