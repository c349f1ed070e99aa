"""Fail fast (issue 20): a collective that waits past its timeout, or loses its peer, names the rank and the
instruction; the job's error quotes it; ``hapnb launch ... -- ARGS`` reaches the worker's own argv."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from procs import assert_gone

from hapnb import zoo
from hapnb.cli import main as cli_main
from hapnb.plans.synthesis import synthesize
from hapnb.run.buckets import GradBuckets
from hapnb.runtime import collectives as C
from hapnb.runtime.codegen import generate
from hapnb.runtime.collective_errors import CollectiveError, collective_error, guarded
from hapnb.runtime.program import COLLECTIVE_FUNCTIONS

TIMED_OUT = (
    "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
)
PEER_GONE = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9635"


@pytest.fixture(scope="module")
def mlp2():  # type: ignore[no-untyped-def]
    return synthesize("mlp", "2xV100", ratios=[0.5, 0.5], **zoo.TINY["mlp"])


def test_the_error_names_rank_instruction_direction_and_timeout() -> None:
    where = "instruction 7 (grouped_all_gather of relu: relu:I = grouped_all_gather(relu:G1))"
    e = collective_error(RuntimeError(TIMED_OUT), rank=2, op="all_gather", where=where)
    msg = str(e)
    assert (e.reason, e.rank, e.timeout_s, e.direction) == ("timeout", 2, 3.0, "forward")
    assert msg.startswith(
        f"rank 2 waited more than 3 s (the collective timeout) for its peers in the forward of {where}"
    )
    assert "another rank did not reach this collective" in msg and "hapnb launch --timeout S" in msg
    assert "\n" not in msg and msg.endswith("Timed out waiting 3000ms for recv operation to complete")
    e = collective_error(RuntimeError(PEER_GONE), rank=0, op="reduce_scatter", where=where, timeout_s=9.0)
    assert e.reason == "peer" and str(e).startswith(f"rank 0 lost a peer in the forward of {where}")
    assert "running reduce_scatter" in str(e) and "see that rank's log" in str(e)
    # outside a rank program: no direction, the collective named instead
    e = collective_error(RuntimeError("boom"), rank=1, op="all_reduce", where="the global loss of step 3")
    assert (
        e.reason == "error"
        and str(e) == "rank 1: all_reduce failed in the global loss of step 3. Backend: boom"
    )

    def fails() -> None:
        raise RuntimeError(TIMED_OUT)

    with pytest.raises(CollectiveError) as info:
        guarded(0, None, "all_reduce", "instruction 3 (x)", fails)
    assert isinstance(info.value.__cause__, RuntimeError) and isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError):  # not a backend error: as it is
        guarded(0, None, "all_reduce", None, lambda: int("x"))

    def out_of_memory() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError):  # an error of the tensors around the communication, too
        guarded(0, None, "all_gather", None, out_of_memory)


def test_in_the_backward_the_dual_names_its_forward_instruction(monkeypatch) -> None:
    """The dual collective keeps its forward's label and says backward (autograd context, no recording)."""
    import hapnb.runtime.collectives as coll

    def stalls(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError(TIMED_OUT)

    x = torch.ones(4, 2, requires_grad=True)
    y = C.all_gather(x, 0, (4,), where="instruction 5 (all_gather of h: h:I = all_gather(h:G0))")
    monkeypatch.setattr(coll, "_start_reduce_scatter", stalls)  # the dual: as if the peer never came
    with pytest.raises(CollectiveError) as info:
        y.sum().backward()
    e = info.value
    assert e.direction == "backward" and e.op == "reduce_scatter" and e.where.startswith("instruction 5 ")
    assert "in the backward of instruction 5 (all_gather of h" in str(e)


def test_gradient_bucket_wait_names_the_bucket(monkeypatch) -> None:
    import torch.distributed as dist

    class Stuck:
        def wait(self):  # type: ignore[no-untyped-def]
            raise RuntimeError(TIMED_OUT)

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    gb = GradBuckets([("fc.weight", a), ("fc.bias", b)])
    gb._active = True  # as in a process group, whose all-reduce never completes
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: Stuck())
    monkeypatch.setattr(dist, "get_rank", lambda *args: 1)
    (a.sum() + b.sum()).backward()
    with pytest.raises(CollectiveError) as info:
        gb.wait()
    msg = str(info.value)
    assert msg.startswith(
        "rank 1 waited more than 3 s (the collective timeout) for its peers in the backward"
    )
    assert "gradient bucket 0 of 1 (the all-reduce of the gradients of fc.bias, fc.weight)" in msg


def test_training_helpers_name_what_they_reduce(monkeypatch) -> None:
    """dm.global_loss and dm.clip_grad_norm_ communicate too: a stalled peer there is named as well."""
    import torch.distributed as dist

    from hapnb.run import training
    from hapnb.runtime.program import LocalParam

    def stalls(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError(TIMED_OUT)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *args: 2)
    monkeypatch.setattr(dist, "all_reduce", stalls)
    with pytest.raises(CollectiveError) as info:
        training.global_loss(torch.tensor(1.5))
    assert str(info.value).startswith(
        "rank 2 waited more than 3 s"
    ) and "the global loss (dm.global_loss)" in str(info.value)
    fc = torch.nn.Linear(2, 2)
    fc(torch.ones(1, 2)).sum().backward()
    params = [LocalParam("weight", "weight", "param", "G0", (2, 2), dim=0, length=2, lengths=(2, 2))]
    for norm_type, what in ((2.0, "global norm"), (float("inf"), "global max norm")):
        with pytest.raises(CollectiveError) as info:
            training.clip_grad_norm_(fc, params, 1.0, norm_type)
        assert f"the gradients' {what} (dm.clip_grad_norm_)" in str(info.value)


def test_generated_collectives_carry_their_instruction(mlp2) -> None:
    """Every communicating call of a rank program names its instruction (index, collective, tensor)."""
    for grad_sync in ("sync", "buckets"):
        prog = generate(mlp2, mlp2.graph, 1, grad_sync=grad_sync)
        calls = [nd for nd in prog.module.graph.nodes if nd.target in (*COLLECTIVE_FUNCTIONS, C.replicate)]
        assert calls and len(calls) >= sum(1 for i in mlp2.program if i.kind == "collective")
        for nd in calls:
            where = nd.kwargs["where"]
            k = int(where.split()[1])
            ins = mlp2.program[k]
            assert where.startswith(f"instruction {k} ({ins.name} of {ins.tensor}: {ins}")
        assert any(nd.target is C.replicate for nd in calls) == (grad_sync == "sync")


# Rank 1 stalls before its first collective (as a rank stuck in its own code would): rank 0 waits there.
STALL_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from hapnb.run import worker
    if os.environ["RANK"] == "1":
        for name in ("broadcast", "all_gather", "all_reduce", "reduce", "reduce_scatter", "all_to_all_single"):
            def stalled(*args, _real=getattr(dist, name), **kwargs):
                time.sleep(60)
                return _real(*args, **kwargs)
            setattr(dist, name, stalled)
    sys.exit(worker.main())
    """
)


@pytest.mark.slow
def test_a_stalled_peer_is_named_by_the_waiting_rank_and_the_job(mlp2, tmp_path: Path) -> None:
    """2 gloo ranks, rank 1 stalls before the program's first collective, collective timeout 3 s: rank 0
    fails naming itself, the instruction, its tensor and the timeout; the job's error quotes it and says
    where rank 1 was; no process is left behind."""
    from hapnb.run.bundle import write_bundle
    from hapnb.run.launch import launch

    k, ins = next((k, i) for k, i in enumerate(mlp2.program) if i.kind == "collective")
    script = tmp_path / "stall_worker.py"
    script.write_text(STALL_WORKER)
    bundle = write_bundle(mlp2, tmp_path / "bundle")
    t0 = time.monotonic()
    job = launch(
        bundle, nproc=2, steps=2, worker=(str(script),), extra_args=["--timeout", "3"], timeout_s=120
    )
    result = job.wait(timeout=120)
    elapsed = time.monotonic() - t0
    assert_gone(set(job.pids))
    assert not result.ok and result.failed_rank == 0 and result.returncode == 1
    msg = result.error
    head = msg.splitlines()[0]
    assert head.startswith("rank 0 exited with code 1 before reporting any step: rank 0 waited more than 3 s")
    assert f"in the forward of instruction {k} ({ins.name} of {ins.tensor}: {ins})" in head
    assert "Ranks still running then: rank 1 (last heartbeat: forward of step 0" in head
    assert elapsed < 60, f"rank 0 must fail after its 3 s timeout, not when the peer wakes ({elapsed:.0f} s)"


ARGV_WORKER = "import json, sys\nprint(json.dumps({'step': 0, 'argv': sys.argv[1:]}), flush=True)\n"


def test_launch_passes_the_workers_own_arguments(tmp_path: Path, capsys, monkeypatch) -> None:
    """``hapnb launch ... -- ARGS`` reaches the worker's argv after hapnb's own arguments (verbatim, a
    second ``--`` included), in local runs and in the printed torchrun commands; hapnb's own workers also
    get the collective timeout, a custom worker does not."""
    script = tmp_path / "argv_worker.py"
    script.write_text(ARGV_WORKER)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    base = ["launch", str(bundle), "--nproc", "1", "--steps", "2", "--backend", "gloo", "--timeout", "30"]
    assert cli_main([*base, "--worker", str(script), "--json", "--", "--my-flag", "3", "--", "x y"]) == 0
    argv = json.loads(capsys.readouterr().out.splitlines()[0])["argv"]
    assert argv == [str(bundle), "--steps", "2", "--backend", "gloo", "--my-flag", "3", "--", "x y"]
    assert cli_main([*base, "--print-commands", "--", "--my-flag", "3"]) == 0
    cmd = capsys.readouterr().out.strip()
    assert cmd.endswith("--backend gloo --timeout 30 --my-flag 3") and "-m hapnb.run.worker" in cmd

    import hapnb.run.launch as launch_module

    seen: dict = {}
    monkeypatch.setattr(launch_module, "Job", lambda argvs, envs, **kw: seen.update(argv=argvs[0], **kw))
    launch_module.launch(bundle, nproc=1, steps=1, timeout_s=7, python=sys.executable)
    assert seen["argv"][-2:] == ["--timeout", "7"]
    assert seen["timeout_s"] == 7 + launch_module.COLLECTIVE_ERROR_GRACE_S  # the named error comes first
