"""Profiling (hapnb.run.profile): device throughput, collective fits -> cluster JSON."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from hapnb.cli import main as cli_main
from hapnb.cluster import COLLECTIVE_KINDS, Cluster, Collective
from hapnb.run.profile import (
    ProfileError,
    fit_collective,
    profile_collectives,
    profile_devices,
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
    argv = ["profile", "--nproc", "2", "--backend", "gloo", "--quick", "--sizes", "4K,64K,256K", "--repeats", "2",
            "-o", str(out), "--name", "here"]  # fmt: skip
    assert cli_main(argv) == 0
    c = Cluster.load(out)
    assert c.name == "here" and c.names == ("cpu-0", "cpu-1") and c.dtype_bytes == 4
    assert all(coll.bandwidth_Bps > 0 and coll.latency_s >= 0 for _, coll in c.collectives)
    assert c.intra_machine_Bps == c.collective("all_reduce").bandwidth_Bps
    assert "wrote" in capsys.readouterr().out


def test_a_failing_collective_rank_is_a_profile_error() -> None:
    # an unknown backend makes every rank fail in init_process_group: the supervisor names the rank
    with pytest.raises(
        ProfileError, match=r"(?s)collective profiling on 2 nosuchbackend ranks failed: rank \d exited"
    ):
        profile_collectives(2, "nosuchbackend", sizes=(1024, 4096), repeats=1, warmup=0, timeout_s=60)
