"""The worker (python -m hapnb.run.worker BUNDLE): metrics lines, phase heartbeats, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hapnb import zoo
from hapnb.plans.plan import Plan
from hapnb.plans.synthesis import synthesize
from hapnb.run.bundle import write_bundle
from hapnb.run.supervisor import run_local

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_worker_cli_metrics(tmp_path: Path) -> None:
    pins = {
        "x": "G0",
        "y": "G0",
        **{f"{m}.{k}": "I" for m in ("layers.0", "layers.1", "head") for k in ("weight", "bias")},
    }
    plan: Plan = synthesize(
        "mlp", "2xV100", ratios=[0.75, 0.25], pins=pins, options={"sfb": False}, **zoo.TINY["mlp"]
    )
    d = write_bundle(plan, tmp_path / "bundle")
    metrics = tmp_path / "m{rank}.jsonl"
    beats: list[dict] = []
    args = ["-m", "hapnb.run.worker", str(d), "--steps", "3", "--metrics", str(metrics), "--optimizer", "sgd"]
    out = run_local(2, args, stall_s=90, on_heartbeat=lambda r, rec: beats.append(rec))
    assert out.ok, out.error
    rows = [[json.loads(ln) for ln in (tmp_path / f"m{r}.jsonl").read_text().splitlines()] for r in range(2)]
    keys = {"rank", "step", "loss", "global_loss", "step_s", "max_memory_bytes"}
    for r, rs in enumerate(rows):
        assert [m["step"] for m in rs] == [0, 1, 2]
        assert all(set(m) == keys and m["rank"] == r and m["step_s"] > 0 for m in rs)
    for s in range(3):
        total = rows[0][s]["loss"] + rows[1][s]["loss"]
        assert rows[0][s]["global_loss"] == pytest.approx(total, rel=1e-6)
        assert rows[1][s]["global_loss"] is None
    assert rows[0][2]["global_loss"] < rows[0][0]["global_loss"]  # it trains
    # the metrics went to the files; stdout carried the phase heartbeats, in order, for every step
    for r in range(2):
        phases = [(b["phase"], b.get("step")) for b in beats if b["rank"] == r]
        steps = [p for s in range(3) for p in (("forward", s), ("backward", s))]
        assert phases == [("load", None), ("connect", None), ("compile", None), *steps]


def test_worker_cli_reports_bad_bundle(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hapnb.run.worker", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"},
    )
    assert r.returncode == 1
    assert "is not a hapnb bundle" in r.stderr
    assert json.loads(r.stdout.splitlines()[0])["phase"] == "load"  # a heartbeat before the failure


def test_worker_cli_overlap_options() -> None:
    """--grad-sync takes buckets (default) or sync; the bucket caps are byte counts."""
    from hapnb.run.worker import _parser, main

    a = _parser().parse_args(["b"])
    assert (a.grad_sync, a.bucket_cap_bytes, a.first_bucket_cap_bytes, a.no_interleave) == (
        "buckets",
        None,
        None,
        False,
    )
    a = _parser().parse_args(["b", "--grad-sync", "sync", "--bucket-cap-bytes", "4096", "--no-interleave"])
    assert (a.grad_sync, a.bucket_cap_bytes, a.no_interleave) == ("sync", 4096, True)
    with pytest.raises(SystemExit):
        main(["b", "--grad-sync", "later"])


def test_rank_device_choices_and_errors() -> None:
    """Where a rank's tensors live: the backend's own device by default, the CPU for gloo on request,
    and a clear error for nccl on the CPU, CUDA without a GPU or an unknown device."""
    import torch

    from hapnb.run.worker import rank_device, runtime_argv

    assert rank_device("gloo", "auto", 0) == torch.device("cpu")
    assert rank_device("gloo", "cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="nccl runs on CUDA tensors only"):
        rank_device("nccl", "cpu", 0)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        rank_device("gloo", "tpu", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="rank 1: device cuda, but torch sees no CUDA device"):
            rank_device("gloo", "cuda", 1)
    assert runtime_argv() == [] and runtime_argv(device="cuda")[-2:] == ["--device", "cuda"]
