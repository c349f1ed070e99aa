"""Verification against one device (hapnb.run.verify): reports, shared parameters, corrupted plans,
progress, and stalls told from slowness (stand-in workers)."""

from __future__ import annotations

import dataclasses
import textwrap
import time
from pathlib import Path

import pytest
import torch
from procs import assert_gone
from synthetic import DP_PINS

import hapnb as hap
from hapnb import zoo
from hapnb.cli import main as cli_main
from hapnb.plans.plan import Plan
from hapnb.plans.synthesis import synthesize
from hapnb.run.launch import JobResult
from hapnb.run.verify import TensorCheck, VerifyError, VerifyReport, verify
from hapnb.runtime.program import CodegenError

TIED = "examples.factories:tied_lm"


def _mlp(cluster: str, ratios, **kw) -> Plan:
    return synthesize("mlp", cluster, ratios=ratios, **{**zoo.TINY["mlp"], **kw})


@pytest.fixture(scope="module")
def dp_plan() -> Plan:
    """Plain data parallel on uneven ratios: every weight replicated (gradient all-reduce), batch 6/2."""
    plan = _mlp("2xV100", [0.75, 0.25], pins=DP_PINS, options={"sfb": False})
    assert all(i.name == "load" for i in plan.program if i.kind == "load")
    return plan


# ============================================================================ against one device


@pytest.mark.slow
def test_verify_uneven_two_ranks() -> None:
    tp = _mlp("2xV100", [0.7, 0.3])  # the searched (tensor-parallel) program
    assert any(i.kind == "load" and i.form.startswith("G") and "weight" in i.tensor for i in tp.program)
    events: list[dict] = []
    report = verify(tp, nproc=2, steps=2, timeout=90, progress=events.append)
    assert report.ok, report.text()
    names = {c.name for c in report.checks}
    params = {tp.graph.tensors[t].name for t in tp.graph.params}
    assert params <= names  # every gradient and weight was compared
    assert {c.kind for c in report.checks} == {"loss", "grad", "weight"}
    assert report.max_rel < 1e-10
    assert "OK" in report.text() and "OK" in report._repr_html_()
    # progress: every rank's phases and steps, then the single-device run's steps
    assert {(e["rank"], e["step"]) for e in events if "phase" not in e} == {
        (r, s) for r in range(2) for s in range(2)
    }
    assert {e["phase"] for e in events if "phase" in e} >= {
        "load",
        "connect",
        "compile",
        "forward",
        "reference",
    }
    assert [e["step"] for e in events if e.get("phase") == "reference"] == [0, 1]


@pytest.mark.slow
def test_tied_embedding_verifies() -> None:
    """A weight shared by two modules: gradients summed over both uses, one copy updated."""
    plan = hap.synthesize(TIED, "2xV100")
    names = {plan.graph.tensors[t].name for t in plan.graph.params}
    assert {"embed.weight", "head.weight"} <= names
    report = hap.verify(plan, nproc=2, steps=3)
    assert report.ok, report.text()
    checked = {(c.kind, c.name) for c in report.checks}
    for name in ("embed.weight", "head.weight"):
        assert ("grad", name) in checked and ("weight", name) in checked
    assert report.max_rel < 1e-10


class HalfNorm(torch.nn.Module):
    """A bfloat16 block whose norm upcasts to float32 and casts back to the input's dtype (as Hugging Face's
    RMSNorm does): the trace holds ``bfloat16`` and ``float32`` dtype constants."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.scale * h.to(x.dtype)).sum()


@pytest.mark.slow
def test_a_model_traced_in_bfloat16_verifies_in_float64() -> None:
    """Float64 verification casts every floating dtype the trace names, not float32 alone: the bfloat16
    casts and export's dtype assertions of a bf16 trace stopped the single-device run ("Tensor dtype
    mismatch! Expected: BFloat16, Got: double")."""
    torch.manual_seed(0)
    model = HalfNorm().to(torch.bfloat16)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    plan = hap.synthesize(hap.trace(model, (x,)), "2xV100", pins={"x": "G0"})
    report = hap.verify(plan, nproc=2, steps=2)
    assert report.ok and report.max_rel < 1e-10, report.text()


@pytest.mark.slow
def test_verify_cli_zero_length_shard(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # data parallel with sufficient-factor broadcasting, rank 1 gets no samples
    plan = _mlp("3xV100", [0.5, 0.0, 0.5], pins=DP_PINS)
    assert any(i.name == "load_sfb" for i in plan.program)
    assert any(0 in ls for _, _, ls in plan.lengths)  # rank 1 holds empty shards
    path = plan.save(tmp_path / "plan.json")
    code = cli_main(["verify", "--plan", str(path), "--nproc", "3", "--steps", "2", "--stall-timeout", "120"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "OK on 3 ranks" in out
    # progress on stderr: the ranks' phases, every step once all ranks finished it, the reference run
    for text in ("ranks: load", "ranks: compile", "step 1/2: forward", "step 2/2: backward",
                 "step 1/2 done on all 3 ranks", "step 2/2 done on all 3 ranks", "single-device run: step 2/2"):  # fmt: skip
        assert text in err, err


@pytest.mark.slow
def test_corrupted_plan_fails_with_a_report(
    dp_plan: Plan, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # loading a replicated weight as "load_sfb" skips its gradient all-reduce: it runs, but is wrong
    k = next(
        i for i, ins in enumerate(dp_plan.program) if ins.kind == "load" and ins.tensor == "layers.1.weight"
    )
    assert dp_plan.program[k].form == "I"
    bad = dataclasses.replace(dp_plan.program[k], name="load_sfb")
    corrupt = dataclasses.replace(dp_plan, program=dp_plan.program[:k] + (bad,) + dp_plan.program[k + 1 :])
    path = corrupt.save(tmp_path / "corrupt.json")
    code = cli_main(["verify", "--plan", str(path), "--nproc", "2", "--steps", "2", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "MISMATCH" in out and "max relative error per tensor" in out
    assert err == ""  # --quiet: no progress lines
    fail_lines = [ln for ln in out.splitlines() if "FAIL" in ln]
    assert any("grad" in ln and "layers.1.weight" in ln for ln in fail_lines), out
    # the other weights are still right: the report points at the corrupted one
    assert not any("layers.0.weight" in ln and "grad" in ln for ln in fail_lines), out


def test_inconsistent_cuts_are_refused_before_any_rank_starts(dp_plan: Plan) -> None:
    # y is cut 5/3 while the activations are cut 6/2: the loss op could not run on any rank
    lengths = tuple((t, d, (5, 3) if t == "y" else ls) for t, d, ls in dp_plan.lengths)
    broken = dataclasses.replace(dp_plan, lengths=lengths)
    with pytest.raises(CodegenError, match=r"y dim 0 is cut \(5, 3\)"):
        verify(broken, nproc=2, steps=1, timeout=60)


def test_verify_rejects_wrong_nproc(dp_plan: Plan) -> None:
    with pytest.raises(ValueError, match="nproc=2"):
        verify(dp_plan, nproc=3)


# ============================================================================ the report


def _report(ok: bool) -> VerifyReport:
    checks = (
        TensorCheck("loss", "", 1e-16, 1e-16, True),
        TensorCheck("grad", "layers.0.weight", 2e-15, 1e-15, True),
        TensorCheck("grad", "layers.1.weight", 0.5 if not ok else 3e-16, 0.1, ok),
        TensorCheck("weight", "head.bias", float("inf") if not ok else 0.0, 0.0, ok, "" if ok else "NaN"),
    )
    return VerifyReport(ok, "mlp", 2, 3, "float64", checks, 4.25, 1e-7, 1e-9)


def test_report_summary_is_one_readable_paragraph() -> None:
    good = _report(True).summary()
    assert "\n" not in good and "dataclass" not in good and "TensorCheck" not in good
    assert good.startswith("OK: 3 steps on 2 ranks (float64)")
    assert "max relative error 2.000e-15 (worst: grad layers.0.weight)" in good
    assert "4 tensors compared" in good and "wall 4.2 s" in good
    bad = _report(False).summary()
    assert bad.startswith("MISMATCH: 3 steps on 2 ranks") and "(worst: weight head.bias)" in bad
    assert "FAILED: 2 of 4 differ beyond rtol 1e-07 + atol 1e-09" in bad
    assert "grad layers.1.weight (5.000e-01)" in bad and "weight head.bias (inf, NaN)" in bad
    # the same shape as a launch's summary: counts, the figure that matters, wall time, FAILED: why
    job = JobResult(
        1, ({"rank": 0, "step": 0, "step_s": 0.1, "loss": 1.0},), ("",), error="rank 1 died", wall_s=2.0
    )
    assert "wall 2.0 s" in job.summary() and "FAILED" in job.summary()
    assert _report(True).worst.name == "layers.0.weight" and _report(False).worst.name == "head.bias"


# ============================================================================ stalls vs slowness

# A stand-in for `python -m hapnb.run.worker BUNDLE ...`: `slow` heartbeats every second for 10 s (past an
# 8 s stall limit in total, never between two heartbeats) and then runs the real worker; `stuck` sends one
# heartbeat and hangs with a child process; `forever` heartbeats every 0.2 s and never ends.
STANDIN = textwrap.dedent(
    """
    import json, os, runpy, subprocess, sys, time
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "slow":
        for i in range(10):
            print(json.dumps({"phase": "warm-up", "i": i}), flush=True)
            time.sleep(1.0)
        sys.argv = ["hapnb.run.worker", *args]
        runpy.run_module("hapnb.run.worker", run_name="__main__")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(json.dumps({"phase": "start", "pid": os.getpid(), "child": child.pid}), flush=True)
    while mode == "forever":
        time.sleep(0.2)
        print(json.dumps({"phase": "busy"}), flush=True)
    time.sleep(600)
    """
)


@pytest.fixture()
def standin(tmp_path: Path) -> str:
    script = tmp_path / "standin_worker.py"
    script.write_text(STANDIN)
    return str(script)


def _pids(events: list[dict]) -> set[int]:
    return {e[k] for e in events for k in ("pid", "child") if k in e}


@pytest.mark.slow
def test_slow_progress_is_not_declared_stuck(dp_plan: Plan, standin: str) -> None:
    events: list[dict] = []
    t0 = time.monotonic()
    report = verify(
        dp_plan, nproc=2, steps=2, stall_timeout=8.0, worker=(standin, "slow"), progress=events.append
    )
    assert report.ok, report.text()
    assert time.monotonic() - t0 > 10.0  # longer than the stall limit, yet not stuck: it kept reporting
    assert sum(1 for e in events if e.get("phase") == "warm-up") == 20


@pytest.mark.slow
def test_stopped_heartbeats_are_stuck_within_the_stall_limit(dp_plan: Plan, standin: str) -> None:
    events: list[dict] = []
    t0 = time.monotonic()
    with pytest.raises(VerifyError) as info:
        verify(
            dp_plan, nproc=2, steps=2, stall_timeout=2.0, worker=(standin, "stuck"), progress=events.append
        )
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.status == "stuck" and err.outcome is not None and err.outcome.returncode == 124
    assert elapsed < 2.0 + 15, elapsed  # the bundle is written first; then stopped at the stall limit
    msg = str(err)
    assert "stuck" in msg and "printed nothing for 2 s (stall_timeout (--stall-timeout))" in msg
    assert "raise stall_timeout (--stall-timeout)" in msg
    pids = _pids(events)
    assert len(pids) == 4  # two ranks, each with a child: all gone
    assert_gone(pids)


@pytest.mark.slow
def test_progress_past_the_time_limit_is_slow(dp_plan: Plan, standin: str) -> None:
    events: list[dict] = []
    with pytest.raises(VerifyError) as info:
        verify(dp_plan, nproc=2, steps=2, timeout=3.0, stall_timeout=2.0, worker=(standin, "forever"),
               progress=events.append)  # fmt: skip
    assert info.value.status == "slow"
    msg = str(info.value)
    assert (
        "wall-clock limit of 3 s (timeout (--timeout)) while still progressing: it is slow, not stuck" in msg
    )
    assert "raise timeout (--timeout)" in msg
    assert_gone(_pids(events))


# ============================================================================ a plan at a smaller size


def test_verify_plan_at_a_smaller_batch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 20: ``verify --plan P --batch B`` re-derives the same program (every form, the ratios) at the
    smaller batch, cuts it again from the ratios and verifies that; a batch too small to keep every device
    of the batch busy is refused with one that is not; flags that would change the model are refused."""
    from hapnb.run.pipelined import manual_plan
    from hapnb.run.verify import batch_rows, resize

    plan = _mlp("2xV100", [0.75, 0.25], batch=16)
    small = resize(plan, batch=4)
    assert [str(i) for i in small.program] == [str(i) for i in plan.program] and small.ratios == plan.ratios
    assert small.model_spec["options"]["batch"] == 4 and batch_rows(small) == [3, 1]
    assert batch_rows(plan) == [12, 4]
    for (t, d, old), (t2, d2, new) in zip(plan.lengths, small.lengths):
        assert (t, d) == (t2, d2) and sum(new) == (sum(old) // 4 if sum(old) == 16 else sum(old))
    with pytest.raises(ValueError, match="v100-1 would hold none.*use --batch 3 or more"):
        resize(plan, batch=1)
    with pytest.raises(ValueError, match="has no sequence length; drop --seq"):
        resize(plan, seq=8)
    path = plan.save(tmp_path / "plan.json")
    code = cli_main(["verify", "--plan", str(path), "--batch", "4", "--steps", "1", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0 and "OK on 2 ranks" in out and "re-derived at --batch 4" in err, out + err
    with pytest.raises(SystemExit, match="--layers, --set hidden=8 do not apply with --plan"):
        cli_main(["verify", "--plan", str(path), "--set", "hidden=8", "--layers", "3"])
    # a pipeline plan keeps its stages, shares and micro-batches; the batch must split into them
    pp = manual_plan("gpt", {**zoo.TINY["gpt"], "batch": 8}, ("(input)", "blocks.0", "blocks.1"),
                     [(0, 2, (1.0,)), (2, 3, (0.5, 0.5))], "GPipe", 2)  # fmt: skip
    half = resize(pp, batch=4)
    assert (half.batch, half.micro_batch_size, half.stages) == (4, 2, pp.stages)
    with pytest.raises(ValueError, match="does not split into 2 equal ones. Use --batch 4"):
        resize(pp, batch=3)
