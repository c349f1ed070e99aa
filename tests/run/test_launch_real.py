"""hapnb.launch with the real worker: a plan on 4 local ranks streams its steps; killing a rank ends
the whole job with that rank named, and no process is left behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
from procs import alive

import hapnb as hap
from hapnb import zoo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plan() -> hap.Plan:
    return hap.synthesize("mlp", "2xV100+2xP100", **zoo.TINY["mlp"])


def test_four_ranks_stream_steps(plan: hap.Plan) -> None:
    job = hap.launch(plan, nproc=4, steps=3, timeout_s=120)
    seen = []
    for m in job.metrics():
        seen.append(m)
    res = job.wait(timeout=60)
    assert res.ok, res.error
    assert {(m["rank"], m["step"]) for m in seen} == {(r, s) for r in range(4) for s in range(3)}
    losses = [m["global_loss"] for m in seen if m["rank"] == 0]
    assert all(x is not None and x > 0 for x in losses)
    assert all(m["step_s"] > 0 for m in seen)


def test_killing_a_rank_ends_the_job_cleanly(plan: hap.Plan) -> None:
    job = hap.launch(plan, nproc=4, steps=10_000, timeout_s=60)
    pids = job.pids
    for m in job.metrics():
        if m["rank"] == 2:
            os.kill(pids[2], signal.SIGKILL)
            break
    t0 = time.monotonic()
    res = job.wait(timeout=90)
    assert not res.ok
    assert res.failed_rank == 2
    assert "rank 2" in res.error
    assert time.monotonic() - t0 < 60
    time.sleep(0.5)
    assert not any(alive(p) for p in pids)
