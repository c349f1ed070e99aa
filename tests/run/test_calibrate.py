"""Calibration (hapnb.run.calibrate): a plan's predicted iteration time against a measured one."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from hapnb.cli import main as cli_main
from hapnb.hardware.cluster import Cluster
from hapnb.plans.plan import Plan, Stage
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


# --------------------------------------------------------------------------- fitting a device model


def test_the_measured_h100_runs_ship_with_the_package():
    """hapnb/data/h100-lm-steps.json is package data: shipped_runs() finds it, load_measured() and the
    word 'shipped' read it, and `hapnb calibrate --measured` without a path means it."""
    import hapnb
    from hapnb.cli import build_parser
    from hapnb.run.calibrate import SHIPPED, load_measured, shipped_runs

    path = shipped_runs()
    assert path.is_file() and path.name == "h100-lm-steps.json"
    assert path.parent == Path(hapnb.__file__).resolve().parent / "data"
    data = load_measured(path)
    assert load_measured() == data == load_measured(SHIPPED)
    assert len(data["runs"]) == 12 and data["gpu"].startswith("NVIDIA H100")
    assert build_parser().parse_args(["calibrate", "--measured"]).measured == SHIPPED
    assert build_parser().parse_args(["calibrate", "--measured", "r.json"]).measured == "r.json"
    assert build_parser().parse_args(["calibrate", "b"]).measured is None


def _synthetic_runs(truth):
    """Hand-made run features: matmuls of several sizes, attention, memory-bound ops; launch-bound small
    runs and GPU-bound large ones. The 'measured' times come from the model itself."""
    import numpy as np

    from hapnb.run.calibrate import RunFeatures, predict_step_s

    runs = []
    for i, (n_ops, w) in enumerate([(20, 1e6), (40, 2e6), (80, 1e6), (20, 1e9), (40, 3e9), (30, 3e10),
                                    (60, 1e10), (10, 1e8), (10, 3e11), (5, 1e12)]):  # fmt: skip
        mm = np.arange(3 * n_ops) % 3 == 0
        att = np.arange(3 * n_ops) % 3 == 1
        kflops = np.where(mm, w, 0.0)
        flops = np.where(mm, 3 * w, np.where(att, (0.2 + i % 3) * w, 0.0))
        nbytes = np.where(mm | att, 1e4, 40 * w / 1e3)
        kernels = np.where(mm, 4.0, 2.0)
        f = RunFeatures(f"r{i}", 1.0, None, flops, nbytes, kernels, kflops, mm, att, 1e6 * (i + 1), 0.0, 0)
        runs.append(dataclasses.replace(f, measured_s=predict_step_s(truth, f)))
    return runs


def test_fit_recovers_known_parameters_from_synthetic_runs():
    from hapnb.hardware.catalogue import H100_MODEL
    from hapnb.run.calibrate import fit_device_model, predict_step_s

    truth = dataclasses.replace(
        H100_MODEL,
        kernel_s=3e-5,
        matmul_eff=0.9,
        matmul_half_flops=2e9,
        attention_eff=0.4,
        optimizer_kernels=8.0,
    )
    feats = _synthetic_runs(truth)
    rep = fit_device_model({"runs": []}, "H100", loo=False, features=feats)
    m = rep.model
    for f in feats:
        assert predict_step_s(m, f) == pytest.approx(f.measured_s, rel=2e-3)
    assert m.kernel_s == pytest.approx(3e-5, rel=0.02)
    assert m.matmul_eff == pytest.approx(0.9, rel=0.02)
    assert m.matmul_half_flops == pytest.approx(2e9, rel=0.05)
    assert m.attention_eff == pytest.approx(0.4, rel=0.02)
    assert rep.stats["step time, fitted on all"]["mean_abs_pct"] < 0.2
    assert m.source.startswith("fit to 10 measured runs")


def _tiny_runs(path: Path) -> Path:
    runs = [
        {"name": f"tiny{i}", "layers": l, "hidden": 32, "seq": s, "batch": 8, "step_s_median": t,
         "peak_mem_bytes": mem}
        for i, (l, s, t, mem) in enumerate([(1, 8, 0.004, 9e7), (2, 8, 0.006, 9.5e7), (2, 16, 0.0065, 1e8),
                                            (3, 8, 0.0085, 1.01e8)])
    ]  # fmt: skip
    path.write_text(json.dumps({"model": {"vocab": 64}, "runs": runs}))
    return path


def test_features_price_like_the_cost_model():
    """The fit's closed form equals what `hapnb plan` predicts for one device (time and peak memory)."""
    import hapnb as hap
    from hapnb.hardware.catalogue import H100_MODEL
    from hapnb.run.calibrate import predict_step_s, run_features

    opts = dict(layers=2, hidden=32, seq=16, batch=8, vocab=64)
    f = run_features({"name": "t", "step_s_median": 1.0, **opts})
    plan = hap.synthesize("lm", "1xH100", **opts)
    assert predict_step_s(H100_MODEL, f) == pytest.approx(plan.cost_s, rel=1e-9)
    want = (1 + H100_MODEL.memory_overhead) * f.raw_memory + H100_MODEL.memory_const_bytes
    assert plan.memory_bytes[0] == pytest.approx(want, abs=8)
    # a device model without overlap (a CPU): launches and work add up, in the fit as in the cost model
    cpu = dataclasses.replace(H100_MODEL, overlap=False)
    c = Cluster.parse("1xH100")
    c = c.replace(devices=(dataclasses.replace(c.devices[0], model=cpu),))
    assert predict_step_s(cpu, f) == pytest.approx(hap.synthesize("lm", c, **opts).cost_s, rel=1e-9)
    assert predict_step_s(cpu, f) > predict_step_s(H100_MODEL, f)


def test_shipped_h100_model_predicts_a_measured_run():
    from hapnb.hardware.catalogue import H100_MODEL
    from hapnb.run.calibrate import load_measured, predict_step_s, run_features, shipped_runs

    data = load_measured(shipped_runs())
    run = data["runs"][0]
    f = run_features(run, {"vocab": data["model"]["vocab"]})
    assert predict_step_s(H100_MODEL, f) == pytest.approx(run["step_s_median"], rel=0.1)
    peak = f.raw_memory * (1 + H100_MODEL.memory_overhead) + H100_MODEL.memory_const_bytes
    assert peak == pytest.approx(run["peak_mem_bytes"], rel=0.15)


def test_cli_calibrate_measured_writes_a_cluster(tmp_path, capsys):
    runs = _tiny_runs(tmp_path / "runs.json")
    out = tmp_path / "fitted.json"
    assert cli_main(["calibrate", "--measured", str(runs), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "leave-one-out" in text and "tiny3" in text and "Spearman" in text
    c = Cluster.load(out)
    assert c.n == 1 and c.devices[0].kind == "H100" and c.devices[0].model.source.startswith("fit to 4")
    assert cli_main(["calibrate", "--measured", str(runs), "--json", "--no-loo"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["runs"]) == 4 and d["model"]["kernel_s"] > 0
    assert cli_main(["calibrate", "--measured", str(tmp_path / "missing.json")]) == 2
    assert cli_main(["calibrate"]) == 2


def test_prediction_stats_counts_pairs_ordered_beyond_the_spread():
    from hapnb.run.calibrate import prediction_stats

    meas = [1.0, 2.0, 3.0, 3.1]
    spread = [(0.9, 1.1), (1.9, 2.1), (2.8, 3.2), (3.0, 3.3)]  # the last two overlap: not ordered
    s = prediction_stats([1.0, 3.05, 2.9, 3.0], meas, spread)
    assert s["ordered_pairs"] == 5  # (0,1) (0,2) (0,3) (1,2) (1,3)
    assert s["ordered_pairs_kept"] == 3  # run 1 is predicted above runs 2 and 3
    assert s["rank_kept"] is False
    assert "ordered_pairs" not in prediction_stats([1.0, 2.0], [1.0, 2.0])
