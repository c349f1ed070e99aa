"""Launcher tests against a stand-in worker (a small script with the real worker's CLI and output)."""

from __future__ import annotations

import json
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest
from procs import assert_gone

from hapnb.cli import main as cli_main
from hapnb.run.launch import (
    Job,
    JobResult,
    LaunchError,
    launch,
    launch_commands,
    slurm_script,
    step_times,
)

# The stand-in: same CLI as `python -m hapnb.run.worker BUNDLE --steps N --backend B`, prints one JSON line per
# step; can crash or hang on a chosen rank/step, and spawns a child process (to check no orphans remain).
STANDIN = textwrap.dedent(
    """
    import argparse, json, os, subprocess, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("bundle")
    p.add_argument("--steps", type=int)
    p.add_argument("--backend")
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--sigkill-rank", type=int, default=-1)
    p.add_argument("--at-step", type=int, default=2)
    p.add_argument("--child", action="store_true")
    p.add_argument("--others-block", action="store_true")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert os.environ["MASTER_ADDR"] and int(os.environ["MASTER_PORT"]) > 0
    assert os.path.isdir(a.bundle), a.bundle
    child = None
    if a.child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("starting rank", rank, "of", world, flush=True)
    for step in range(a.steps):
        if rank == a.crash_rank and step == a.at_step:
            raise ValueError(f"boom on rank {rank} at step {step}")
        if rank == a.sigkill_rank and step == a.at_step:
            os.kill(os.getpid(), 9)
        if rank == a.hang_rank and step == a.at_step:
            time.sleep(600)
        if a.others_block and step == a.at_step:
            time.sleep(600)  # as if blocked in a collective waiting for the failed rank
        time.sleep(a.step_s)
        line = {"step": step, "loss": 1.0 / (step + 1), "global_loss": 1.0 / (step + 1),
                "step_s": a.step_s * (1 + rank), "max_memory_bytes": 1024 * (rank + 1),
                "backend": a.backend, "world": world, "child": child.pid if child else None}
        if rank != 3:  # rank 3 leaves "rank" out: the launcher fills it in
            line["rank"] = rank
        print(json.dumps(line), flush=True)
    """
)


@pytest.fixture()
def standin(tmp_path: Path) -> tuple[tuple[str, ...], Path]:
    script = tmp_path / "standin_worker.py"
    script.write_text(STANDIN)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    return (str(script),), bundle


def _all_pids(job: Job) -> set[int]:
    pids = set(job.pids)
    pids |= {m["child"] for m in job.steps if m.get("child")}
    return pids


def test_streams_steps_from_four_ranks(standin) -> None:
    worker, bundle = standin
    job = launch(bundle, nproc=4, steps=6, worker=worker, extra_args=["--step-s", "0.15", "--child"])
    arrivals = []
    with job:
        seen = []
        for m in job.metrics():
            arrivals.append(time.monotonic())
            seen.append(m)
        result = job.wait(timeout=30, check=True)
    assert result.ok and result.returncode == 0 and result.error is None
    assert len(seen) == 24 and list(result.metrics) == seen == job.steps
    assert sorted((m["rank"], m["step"]) for m in seen) == [(r, s) for r in range(4) for s in range(6)]
    assert {m["backend"] for m in seen} == {"gloo"} and {m["world"] for m in seen} == {4}
    # streamed: the first line arrived long before the last (6 steps x 0.15 s each)
    assert arrivals[-1] - arrivals[0] > 0.4
    # slowest rank per step is rank 3 (0.6 s), first step skipped as warm-up
    assert result.step_times(1) == [pytest.approx(0.6)] * 5
    assert result.median_step_s == pytest.approx(0.6)
    assert result.final_loss == pytest.approx(1 / 6)
    assert "6 steps" in result.summary()
    assert all("starting rank" in t for t in result.stdout_tails)
    assert_gone(_all_pids(job))  # the children each rank spawned are gone too


def test_crashing_rank_stops_job_with_its_error(standin) -> None:
    worker, bundle = standin
    t0 = time.monotonic()
    job = launch(
        bundle,
        nproc=4,
        steps=50,
        worker=worker,
        extra_args=["--crash-rank", "2", "--at-step", "2", "--others-block", "--child"],
        timeout_s=60,
    )
    with pytest.raises(LaunchError) as info:
        job.wait(timeout=30, check=True)
    elapsed = time.monotonic() - t0
    result = info.value.result
    assert isinstance(result, JobResult) and not result.ok
    assert elapsed < 15, "the other ranks (blocked) must be stopped at once, not after timeout_s"
    assert result.failed_rank == 2 and result.returncode == 1
    msg = str(info.value)
    assert "rank 2 exited with code 1 after step 1" in msg
    assert "ValueError: boom on rank 2 at step 2" in msg  # the traceback's last line
    assert "boom on rank 2" in result.stderr_tails[2]
    assert result.returncodes[2] == 1
    assert_gone(_all_pids(job))


def test_rank_killed_by_signal(standin) -> None:
    worker, bundle = standin
    job = launch(
        bundle, nproc=2, steps=50, worker=worker, extra_args=["--sigkill-rank", "0", "--others-block"]
    )
    result = job.wait(timeout=30)
    assert result.failed_rank == 0 and result.returncode == 128 + 9 and result.returncodes[0] == -9
    assert "rank 0 was killed by SIGKILL (often the out-of-memory killer) after step 1" in result.error
    assert_gone(set(job.pids))


def test_hanging_rank_is_stopped_by_timeout(standin) -> None:
    worker, bundle = standin
    t0 = time.monotonic()
    job = launch(
        bundle, nproc=3, steps=4, worker=worker, extra_args=["--hang-rank", "1", "--at-step", "1", "--child"],
        timeout_s=1.5,
    )  # fmt: skip
    result = job.wait(timeout=30)
    assert time.monotonic() - t0 < 12
    assert not result.ok and result.returncode == 124 and result.failed_rank == 1
    assert "rank 1 printed nothing for 1.5 s" in result.error
    assert "rank 1: step 0" in result.error and "rank 0: step 3" in result.error
    assert_gone(_all_pids(job))


def test_wall_timeout_and_stop(standin) -> None:
    worker, bundle = standin
    job = launch(
        bundle, nproc=2, steps=1000, worker=worker, extra_args=["--step-s", "0.05"], wall_timeout_s=1.0
    )
    result = job.wait(timeout=20)
    assert result.returncode == 124 and "wall-clock limit of 1 s" in result.error
    assert_gone(set(job.pids))

    job = launch(bundle, nproc=2, steps=1000, worker=worker, extra_args=["--child"])
    while len(job.steps) < 2:
        time.sleep(0.05)
    res = job.stop()
    assert res is not None and res.returncode == 130 and "stopped" in res.error
    assert job.stop() is res  # idempotent
    assert_gone(_all_pids(job))


def test_ctrl_c_during_wait_cleans_up(standin) -> None:
    worker, bundle = standin
    job = launch(bundle, nproc=2, steps=1000, worker=worker, extra_args=["--child"])
    while not any(m.get("child") for m in job.steps):
        time.sleep(0.05)
    main = threading.main_thread().ident
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        job.wait()
    assert not job.running and job.result.returncode == 130
    assert_gone(_all_pids(job))


def test_launch_validates_inputs(standin, tmp_path: Path) -> None:
    worker, bundle = standin
    with pytest.raises(ValueError, match="pass nproc"):
        launch(bundle, worker=worker)  # no plan.json in the stand-in bundle
    with pytest.raises(FileNotFoundError, match="neither a bundle directory"):
        launch(tmp_path / "missing", nproc=2, worker=worker)
    with pytest.raises(ValueError, match="unknown backend"):
        launch(bundle, nproc=2, backend="tcp", worker=worker)
    with pytest.raises(ValueError, match="needs rdzv"):
        launch(bundle, nproc=2, nnodes=2, worker=worker)
    (bundle / "plan.json").write_text(json.dumps({"cluster": {"devices": [{}] * 4}}))
    with pytest.raises(ValueError, match="plan is for 4 devices"):
        launch(bundle, nproc=2, worker=worker)


def test_multinode_static_rendezvous_env(standin, tmp_path: Path) -> None:
    worker, bundle = standin
    job = launch(bundle, nproc=2, steps=1, nnodes=2, node_rank=1, rdzv="10.0.0.1:29511", worker=worker)
    result = job.wait(timeout=20)
    # node 1 of 2 runs global ranks 2 and 3 of a world of 4
    assert sorted(m["rank"] for m in result.metrics) == [2, 3] and {m["world"] for m in result.metrics} == {4}


def test_launch_commands_and_slurm() -> None:
    cmds = launch_commands("/shared/b", 2, 4, "node0:29500", steps=7, backend="nccl")
    assert len(cmds) == 2
    for i, c in enumerate(cmds):
        assert c.startswith("python -m torch.distributed.run ")
        flags = ["--nnodes 2", "--nproc-per-node 4", f"--node-rank {i}", "--rdzv-backend c10d"]
        flags += ["--rdzv-endpoint node0:29500", "-m hapnb.run.worker /shared/b --steps 7 --backend nccl"]
        for flag in flags:
            assert flag in c
    (local,) = launch_commands("b", 1, 3, backend="gloo")
    assert "--nproc-per-node 3" in local and "--master-addr 127.0.0.1" in local and "--master-port" in local
    with pytest.raises(ValueError, match="HOST:PORT"):
        launch_commands("b", 2, 4, "node0")
    script = slurm_script("/shared/b", 3, 8, steps=5, partition="gpu")
    texts = ["#!/bin/bash", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"]
    texts += ["#SBATCH --partition=gpu", "srun", "--nnodes 3", "--nproc-per-node 8", "--rdzv-backend c10d"]
    texts += ['--rdzv-endpoint "$rdzv"', "scontrol show hostnames", "-m hapnb.run.worker /shared/b --steps 5"]
    for text in texts:
        assert text in script
    assert "gpus-per-node" not in slurm_script("b", 2, 2, backend="gloo")


def test_step_times_and_final_loss() -> None:
    ms = [
        {"rank": r, "step": s, "step_s": 0.1 * (s + 1) + 0.01 * r, "loss": 9.0, "global_loss": float(s)}
        for s in range(4)
        for r in range(2)
    ]
    assert step_times(ms) == pytest.approx([0.11, 0.21, 0.31, 0.41])
    res = JobResult(0, tuple(ms), ("", ""))
    assert res.median_step_s == pytest.approx(0.31) and res.final_loss == 3.0


def test_launch_cli(standin, capsys, tmp_path: Path) -> None:
    worker, bundle = standin
    argv = ["launch", str(bundle), "--nproc", "2", "--steps", "3", "--backend", "gloo", "--worker", worker[0]]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("rank ") >= 6 and "3 steps" in out and "final loss 0.333333" in out
    assert cli_main([*argv, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["ok"] and summary["steps"] == 3 and len(lines) == 7  # 6 metrics lines, one summary
    argv = ["launch", str(bundle), "--nproc", "2", "--nnodes", "2", "--rdzv", "h:1234", "--print-commands"]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "--node-rank 1" in lines[1] and "--rdzv-endpoint h:1234" in lines[1]
    assert cli_main(["launch", str(tmp_path / "missing"), "--nproc", "2", "--worker", worker[0]]) == 2
    assert "neither a bundle directory" in capsys.readouterr().err
    # a crashing rank: the exit status is its code, the error on stderr names it
    crash = tmp_path / "crash.py"
    crash.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n")
    assert cli_main(["launch", str(bundle), "--nproc", "2", "--worker", str(crash), "--backend", "gloo"]) == 3
    assert "rank 1 exited with code 3 before reporting any step" in capsys.readouterr().err


def test_plan_is_bundled_lazily_and_temp_bundle_removed(standin, monkeypatch) -> None:
    import hapnb.run.launch as launch_module
    from hapnb.hardware.cluster import Cluster
    from hapnb.plans.plan import Plan

    worker, _ = standin
    written = []

    def fake_write_bundle(plan, directory):  # what launch uses of a plan: its cluster, and its bundle
        Path(directory).mkdir(parents=True)
        written.append(Path(directory))
        return Path(directory)

    monkeypatch.setattr(launch_module, "write_bundle", fake_write_bundle)
    plan = Plan(name="p", graph_fingerprint="x", cluster=Cluster.parse("3xV100"), ratios=((1 / 3,) * 3,),
                program=(), lengths=(), stages=(), cost_s=0.01, lower_bound_s=0.001)  # fmt: skip
    job = launch(plan, steps=2, worker=worker)  # nproc from the plan's 3 devices
    result = job.wait(timeout=20, check=True)
    assert sorted({m["rank"] for m in result.metrics}) == [0, 1, 2]
    assert len(written) == 1 and not written[0].exists()  # the temporary bundle is gone
    with pytest.raises(ValueError, match="plan is for 3 devices"):
        launch(plan, nproc=2, worker=worker)
    assert not written[1].parent.exists()
