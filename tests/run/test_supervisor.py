"""The process supervisor (hapnb.run.supervisor): crashes name the root rank, peer losses are secondary,
stalls are told from slowness by heartbeats, and every process of every rank's tree is gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import assert_gone

from hapnb.run.supervisor import (
    Outcome,
    Supervisor,
    is_peer_loss,
    parse_json_line,
    rank_envs,
    run_local,
)

pytestmark = pytest.mark.slow

# A configurable rank: heartbeats every `beat` s for `steps` steps; may crash, hang, lose a peer, or
# start a child and a grandchild (all pids are in its first heartbeat) that would outlive it.
RANK = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    mine = {k[:-len("_rank")]: v for k, v in cfg.items() if k.endswith("_rank") and v == rank}
    kids = []
    if cfg.get("tree"):  # a child that starts a grandchild and tells its pid
        code = (
            "import subprocess, sys, time\\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\\n"
            "print(g.pid, flush=True)\\n"
            "time.sleep(600)\\n"
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        kids += [child.pid, int(child.stdout.readline())]
    print(json.dumps({"phase": "start", "pid": os.getpid(), "kids": kids}), flush=True)
    print("plain text is not a heartbeat", flush=True)
    if "peer_loss" in mine:
        time.sleep(cfg.get("peer_loss_after", 0.0))
        sys.stderr.write("RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer\\n")
        sys.exit(1)
    if "silent" in mine:  # blocked in a collective behind a slow peer: no heartbeat for a while
        time.sleep(cfg["silent_s"])
        sys.exit(0)
    for step in range(cfg.get("steps", 3)):
        if mine.get("crash") is not None and step == cfg.get("at", 1):
            time.sleep(cfg.get("crash_after", 0.0))
            raise ValueError(f"rank {rank} exploded at step {step}")
        if mine.get("hang") is not None and step == cfg.get("at", 1):
            time.sleep(600)
        time.sleep(cfg.get("beat", 0.05))
        print(json.dumps({"step": step, "loss": 1.0}), flush=True)
    """
)


def _run(nproc: int, cfg: dict, **kw) -> tuple[Outcome, list[dict]]:
    beats: list[dict] = []
    out = run_local(nproc, ["-c", RANK, json.dumps(cfg)], on_heartbeat=lambda r, rec: beats.append(rec), **kw)
    return out, beats


def _pids(beats: list[dict]) -> set[int]:
    out = set()
    for b in beats:
        out |= {b.get("pid"), *b.get("kids", ())} - {None}
    return out


def test_helpers() -> None:
    assert parse_json_line(' {"step": 1} ') == {"step": 1}
    assert parse_json_line("[1, 2]") is None and parse_json_line("{oops") is None
    assert is_peer_loss("... Connection reset by peer") and not is_peer_loss("ValueError: bad shape")
    envs = rank_envs(2, master_port=1234, nnodes=2, node_rank=1, env={"X": "1"})
    assert [e["RANK"] for e in envs] == ["2", "3"] and {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["MASTER_PORT"] for e in envs} == {"1234"} and all(e["X"] == "1" for e in envs)


def test_clean_run_streams_lines_and_logs(tmp_path: Path) -> None:
    lines: list[tuple[int, str, str]] = []
    done: list[Outcome] = []
    out, beats = _run(
        3,
        {"steps": 3},
        on_line=lambda r, s, ln: lines.append((r, s, ln)),
        on_done=done.append,
        log_dir=tmp_path,
    )
    assert out.ok and out.returncode == 0 and out.error is None and done == [out]
    assert out.returncodes == (0, 0, 0) and out.last_steps == (2, 2, 2)
    steps = sorted((b["rank"], b["step"]) for b in beats if "step" in b)
    assert steps == [(r, s) for r in range(3) for s in range(3)]  # "rank" filled in by the supervisor
    assert any(ln == "plain text is not a heartbeat" and s == "stdout" for _, s, ln in lines)
    assert all("plain text" in t for t in out.stdout_tails)
    assert "plain text" in (tmp_path / "rank2.log").read_text()


def test_crash_names_the_root_rank_and_kills_the_rest() -> None:
    t0 = time.monotonic()
    out, beats = _run(3, {"steps": 100, "beat": 0.1, "crash_rank": 1, "at": 2, "tree": True})
    assert time.monotonic() - t0 < 20
    assert out.status == "failed" and out.failed_rank == 1 and out.returncode == 1
    assert "rank 1 exited with code 1 after step 1" in out.error
    assert "ValueError: rank 1 exploded at step 2" in out.error  # the traceback's last line
    assert "Traceback" in out.stderr_tails[1]
    pids = _pids(beats)
    assert len(pids) == 9  # three ranks, each with a child and a grandchild
    assert_gone(pids)


def test_peer_loss_is_secondary_even_when_it_exits_first() -> None:
    # rank 0 reports a lost peer at once; rank 1, the real failure, dies 0.4 s later
    cfg = {"steps": 100, "peer_loss_rank": 0, "crash_rank": 1, "at": 0, "crash_after": 0.4}
    out, _ = _run(2, cfg, crash_grace_s=3.0)
    assert out.failed_rank == 1 and out.secondary == (0,)
    assert "rank 1 exited with code 1 before reporting any step" in out.error
    assert "ranks 0 failed after it because they lost a peer: secondary" in out.error


def test_slow_progress_is_not_stuck() -> None:
    # a heartbeat every 0.5 s, stall limit 1.5 s: 8 steps (4 s, past the stall limit) finish fine
    out, beats = _run(2, {"steps": 8, "beat": 0.5}, stall_s=1.5)
    assert out.ok, out.error
    assert len([b for b in beats if "step" in b]) == 16


def test_ranks_waiting_for_a_slow_peer_are_not_stuck() -> None:
    # rank 1 is silent for 3 s (blocked behind rank 0) while rank 0 keeps reporting progress
    out, _ = _run(2, {"steps": 8, "beat": 0.4, "silent_rank": 1, "silent_s": 3.0}, stall_s=1.5)
    assert out.ok, out.error


def test_stall_is_stuck_within_the_limit_and_the_tree_is_killed() -> None:
    t0 = time.monotonic()
    out, beats = _run(2, {"steps": 10, "beat": 0.05, "hang_rank": 1, "at": 2, "tree": True}, stall_s=1.5)
    elapsed = time.monotonic() - t0
    assert out.status == "stuck" and out.returncode == 124 and out.failed_rank == 1
    assert 1.5 < elapsed < 1.5 + 8, elapsed  # stopped soon after the stall limit
    assert "rank 1 printed nothing for 1.5 s (stall_s)" in out.error and "looks stuck" in out.error
    assert "rank 0: step 9" in out.error and "rank 1: step 1" in out.error
    pids = _pids(beats)
    assert_gone(pids)


def test_wall_limit_while_progressing_is_slow() -> None:
    out, beats = _run(2, {"steps": 1000, "beat": 0.1, "tree": True}, stall_s=5, wall_s=1.5,
                      limit_names=("--stall-timeout", "--timeout"))  # fmt: skip
    assert out.status == "slow" and out.returncode == 124 and out.failed_rank is None
    assert "wall-clock limit of 1.5 s (--timeout) while still progressing: it is slow, not stuck" in out.error
    assert "raise --timeout" in out.error
    pids = _pids(beats)
    assert_gone(pids)


def test_stop_and_a_failing_callback_end_the_run() -> None:
    cmd = [sys.executable, "-c", RANK, json.dumps({"steps": 1000, "beat": 0.05})]
    sup = Supervisor([cmd] * 2, rank_envs(2))
    while sup.running and len(sup.pids) < 2:
        time.sleep(0.05)
    out = sup.stop()
    assert out is not None and out.status == "stopped" and out.returncode == 130
    assert sup.stop() is out
    assert_gone(set(sup.pids))

    def boom(rank: int, rec: dict) -> None:
        raise KeyError("no such field")

    out = run_local(2, ["-c", RANK, json.dumps({"steps": 1000})], on_heartbeat=boom)
    assert out.status == "error" and "a callback failed: KeyError" in out.error


def test_interpreter_exit_kills_the_ranks(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from hapnb.run.supervisor import Supervisor, rank_envs
        cmd = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"]
        sup = Supervisor([cmd] * 2, rank_envs(2))
        time.sleep(0.5)
        open({str(tmp_path / "pids")!r}, "w").write(json.dumps(sup.pids))
        """
    )  # exits without stopping: the atexit hook must end the ranks
    r = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert_gone(set(json.loads((tmp_path / "pids").read_text())))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Supervisor([], [])
    with pytest.raises(ValueError, match="environments"):
        Supervisor([["x"]], [])
    with pytest.raises(ValueError, match="stall_s must be positive"):
        Supervisor([["x"]], [{}], stall_s=0)
