"""Calibration (hapnb.run.calibrate): a plan's predicted iteration time against a measured one."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from hapnb.cli import main as cli_main
from hapnb.cluster import Cluster
from hapnb.plan import Plan, Stage
from hapnb.run.calibrate import CalibrationReport, calibrate, calibrate_launch
from hapnb.run.launch import LaunchError


def _plan() -> Plan:
    stages = (Stage(0, 0.002, (0.008, 0.004), ()), Stage(1, 0.001, (0.003, 0.006), ()))
    return Plan(
        name="p", graph_fingerprint="x", cluster=Cluster.parse("2xV100"), ratios=((0.5, 0.5),), program=(),
        lengths=(), stages=stages, cost_s=0.017, lower_bound_s=0.005,
    )  # fmt: skip


def test_calibrate_arithmetic() -> None:
    plan = _plan()
    r = calibrate(plan, 0.034)
    assert isinstance(r, CalibrationReport)
    assert r.predicted_s == 0.017 and r.measured_s == 0.034 and r.ratio == pytest.approx(2.0)
    assert r.predicted_comm_s == pytest.approx(0.003) and r.predicted_comp_s == pytest.approx(0.014)
    # comm + comp / s = measured  ->  s = 0.014 / (0.034 - 0.003)
    assert r.throughput_scale == pytest.approx(0.014 / 0.031)
    assert [(s.index, s.predicted_s) for s in r.stages] == [
        (0, pytest.approx(0.010)),
        (1, pytest.approx(0.007)),
    ]
    scaled = r.scaled_cluster(plan.cluster)
    assert scaled.flops == pytest.approx(tuple(f * 0.014 / 0.031 for f in plan.cluster.flops))
    # metrics lines: slowest rank per step, first step dropped as warm-up, median of the rest
    lines = [
        {"rank": k, "step": s, "step_s": t + 0.001 * k}
        for s, t in enumerate([9.0, 0.02, 0.03, 0.04])
        for k in (0, 1)
    ]
    m = calibrate(plan, lines)
    assert m.measured_s == pytest.approx(0.031) and m.steps_used == 3
    assert "measured/predicted" in m.summary() and json.loads(json.dumps(m.to_json()))["ratio"] == m.ratio
    # communication alone slower than measured: no throughput scale
    fast = calibrate(plan, 0.002)
    assert fast.throughput_scale is None
    with pytest.raises(ValueError, match="re-profile"):
        fast.scaled_cluster(plan.cluster)
    with pytest.raises(ValueError, match="no step times"):
        calibrate(plan, [])
    with pytest.raises(ValueError, match="positive"):
        calibrate(plan, -1.0)


CONSTANT_WORKER = textwrap.dedent(
    """
    import json, os, sys
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    rank = int(os.environ["RANK"])
    for s in range(steps):
        print(json.dumps({"rank": rank, "step": s, "loss": 1.0, "step_s": 0.034 if s else 5.0}), flush=True)
    """
)


def test_calibrate_cli_launches_and_reports(tmp_path: Path, capsys) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    _plan().save(bundle / "plan.json")
    worker = tmp_path / "constant_worker.py"
    worker.write_text(CONSTANT_WORKER)
    argv = ["calibrate", str(bundle), "--steps", "4", "--backend", "gloo", "--worker", str(worker), "--json"]
    assert cli_main(argv) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["measured_s"] == pytest.approx(0.034) and rep["ratio"] == pytest.approx(2.0)
    assert rep["steps_used"] == 3
    # the Python entry gives the same report; a failed run is a LaunchError carrying its result
    report = calibrate_launch(bundle, steps=4, worker=(str(worker),))
    assert report.measured_s == pytest.approx(0.034) and report.steps_used == 3
    crash = tmp_path / "crash.py"
    crash.write_text("raise SystemExit(5)\n")
    with pytest.raises(LaunchError, match=r"the run failed: rank \d exited with code 5") as info:
        calibrate_launch(bundle, steps=4, worker=(str(crash),))
    assert info.value.result is not None and info.value.result.returncode == 5
    assert cli_main(["calibrate", str(bundle), "--worker", str(crash), "--backend", "gloo"]) == 5
    assert "hapnb calibrate: the run failed" in capsys.readouterr().err
