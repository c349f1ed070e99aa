"""Profiling (device throughput, collective fits -> cluster JSON) and calibration."""

from __future__ import annotations

import argparse
import json
import math
import random
import textwrap
from pathlib import Path

import pytest

from hapnb.cluster import COLLECTIVE_KINDS, Cluster, Collective
from hapnb.plan import Plan, Stage
from hapnb.run.profile import (
    CalibrationReport,
    add_calibrate_args,
    add_profile_args,
    calibrate,
    calibrate_main,
    fit_collective,
    profile_collectives,
    profile_devices,
    profile_main,
    training_flops,
)

# ----------------------------------------------------------------------------------------------------
# fits


@pytest.mark.parametrize("launches", [1, 4])
def test_fit_recovers_known_latency_and_bandwidth(launches: int) -> None:
    true = Collective(latency_s=25e-6, bandwidth_Bps=3.2e9)
    sizes = [1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26]
    exact = fit_collective("broadcast", [(x, launches, true.time(x, launches)) for x in sizes])
    assert exact.latency_s == pytest.approx(25e-6, rel=1e-9)
    assert exact.bandwidth_Bps == pytest.approx(3.2e9, rel=1e-9)
    assert exact.r2 == pytest.approx(1.0) and not exact.clamped
    assert exact.predict(1e8, launches) == pytest.approx(true.time(1e8, launches))
    # 1 % multiplicative noise, several repeats per size: still close
    rng = random.Random(0)
    noisy = [(x, launches, true.time(x, launches) * (1 + rng.uniform(-0.01, 0.01))) for x in sizes * 5]
    fit = fit_collective("broadcast", noisy)
    assert fit.latency_s == pytest.approx(25e-6, rel=0.1)
    assert fit.bandwidth_Bps == pytest.approx(3.2e9, rel=0.02)


def test_fit_constraints_keep_coefficients_physical() -> None:
    # time falls with size (noise): latency-only fit, bandwidth at its cap, still a valid Collective
    f = fit_collective("all_gather", [(1e3, 1, 3e-4), (1e4, 1, 2e-4), (1e5, 1, 1e-4)])
    assert f.clamped and f.latency_s == pytest.approx(2e-4) and f.bandwidth_Bps == pytest.approx(1e15)
    assert f.collective.time(0) == pytest.approx(2e-4)
    # a negative intercept: refit through the origin
    g = fit_collective("all_reduce", [(1e6, 1, 0.9e-3), (2e6, 1, 2.0e-3), (4e6, 1, 4.1e-3)])
    assert g.clamped and g.latency_s == 0.0 and 0.9e9 < g.bandwidth_Bps < 1.1e9
    with pytest.raises(ValueError, match="2 different sizes"):
        fit_collective("all_reduce", [(1e6, 1, 1e-3), (1e6, 1, 1.1e-3)])


# ----------------------------------------------------------------------------------------------------
# devices


def test_training_flops_use_the_cost_models_formulas() -> None:
    from hapnb import zoo
    from hapnb.tracing import trace

    model, inputs, _ = zoo.build("mlp", devices=1, layers=2, hidden=32, input=16, batch=8)
    ops = trace(model, inputs).ops
    got = training_flops(model, inputs)
    assert got == pytest.approx(3 * sum(op.flops for op in ops))
    # ground truth for the matmuls: 2*B*in*out per Linear (16->32, 32->32, 32->10), x3 for training
    matmuls = 2 * 8 * (16 * 32 + 32 * 32 + 32 * 10)
    assert 3 * matmuls <= got <= 3 * matmuls * 1.2


def test_profile_devices_cpu() -> None:
    devs = profile_devices(2, "cpu", quick=True, steps=3, warmup=1)
    assert [d.name for d in devs] == ["cpu-0", "cpu-1"] and {d.kind for d in devs} == {"CPU"}
    d = devs[0]
    assert [name for name, _, _ in d.details] == ["mlp", "gpt"]
    assert d.training_flops == pytest.approx(sum(f for _, f, _ in d.details))
    assert d.flops == pytest.approx(d.training_flops / d.step_s) and d.flops > 1e6
    assert d.device().flops == d.flops and d.memory_bytes > 0


# ----------------------------------------------------------------------------------------------------
# collectives on 2 gloo ranks -> cluster JSON


def test_profile_collectives_two_gloo_ranks() -> None:
    sizes = (8 << 10, 64 << 10, 256 << 10)
    fits = profile_collectives(2, "gloo", sizes=sizes, repeats=2, warmup=1, timeout_s=60)
    assert sorted(fits) == sorted(COLLECTIVE_KINDS)
    for kind, f in fits.items():
        assert f.latency_s >= 0 and 0 < f.bandwidth_Bps < math.inf, f
        assert len(f.points) == 3 and all(t > 0 for _, _, t in f.points)
        # byte conventions of hapnb.cluster: full = n * shard bytes, n launches for grouped kinds
        assert [x for x, _, _ in f.points] == [float(s) for s in sizes]
        assert {n for _, n, _ in f.points} == ({2} if kind in ("broadcast", "reduce") else {1})
    tiny = [("mlp", {"batch": 4, "hidden": 8, "input": 8, "layers": 1})]
    devices = tuple(d.device() for d in profile_devices(2, "cpu", steps=1, warmup=0, models=tiny))
    cluster = Cluster("profiled-test", devices, {k: f.collective for k, f in fits.items()})
    again = Cluster.from_json(json.loads(json.dumps(cluster.to_json())))
    assert again == cluster


def test_profile_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown collective kind"):
        profile_collectives(2, "gloo", kinds=["gather"])
    with pytest.raises(ValueError, match="two different positive sizes"):
        profile_collectives(2, "gloo", sizes=(1024,))
    with pytest.raises(ValueError, match="device must be"):
        profile_devices(1, "tpu")


def test_profile_main_writes_cluster_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cluster.json"
    ns = add_profile_args(argparse.ArgumentParser()).parse_args(
        ["--nproc", "2", "--backend", "gloo", "--quick", "--sizes", "4K,64K,256K", "--repeats", "2",
         "-o", str(out), "--name", "here"]
    )  # fmt: skip
    assert profile_main(ns) == 0
    c = Cluster.load(out)
    assert c.name == "here" and c.names == ("cpu-0", "cpu-1") and c.dtype_bytes == 4
    assert all(coll.bandwidth_Bps > 0 and coll.latency_s >= 0 for _, coll in c.collectives)
    assert c.intra_machine_Bps == c.collective("all_reduce").bandwidth_Bps
    assert "wrote" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------
# calibration


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


def test_calibrate_main_launches_and_reports(tmp_path: Path, capsys) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    _plan().save(bundle / "plan.json")
    worker = tmp_path / "constant_worker.py"
    worker.write_text(CONSTANT_WORKER)
    ns = add_calibrate_args(argparse.ArgumentParser()).parse_args(
        [str(bundle), "--steps", "4", "--backend", "gloo", "--worker", str(worker), "--json"]
    )
    assert calibrate_main(ns) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["measured_s"] == pytest.approx(0.034) and rep["ratio"] == pytest.approx(2.0)
    assert rep["steps_used"] == 3
