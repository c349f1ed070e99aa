"""Profiling (hapnb.run.profile): device throughput, collective fits -> cluster JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from hapnb.cli import main as cli_main
from hapnb.hardware.cluster import Cluster
from hapnb.hardware.devices import DeviceModel
from hapnb.hardware.parts import COLLECTIVE_KINDS, Collective
from hapnb.run.profile import (
    ProfileError,
    fit_collective,
    fit_matmul_curve,
    profile_collectives,
    profile_device_model,
    profile_devices,
    profile_overlap_slowdown,
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
# device model (roofline parameters)


def test_matmul_fit_recovers_a_known_curve() -> None:
    rate, half = 90e9, 1.5e5  # achieved = rate * w / (w + half)  <=>  seconds = (w + half) / rate
    flops = [2.0 * n**3 for n in (16, 32, 64, 128, 256, 512)]
    r, h = fit_matmul_curve([(w, (w + half) / rate) for w in flops])
    assert r == pytest.approx(rate, rel=1e-9) and h == pytest.approx(half, rel=1e-6)
    rng = random.Random(1)  # 2 % multiplicative noise, three timings per size
    noisy = [(w, (w + half) / rate * (1 + rng.uniform(-0.02, 0.02))) for w in flops * 3]
    r, h = fit_matmul_curve(noisy)
    assert r == pytest.approx(rate, rel=0.05) and h == pytest.approx(half, rel=0.25)
    # pure throughput (no fixed cost) and a negative intercept both give half_flops = 0
    assert fit_matmul_curve([(w, w / rate) for w in flops])[1] == pytest.approx(0.0, abs=1e-3)
    r, h = fit_matmul_curve([(1e6, 0.9e-5), (2e6, 2.0e-5), (4e6, 4.1e-5)])
    assert h == 0.0 and 0.9e11 < r < 1.1e11
    with pytest.raises(ValueError, match=">= 2 sizes"):
        fit_matmul_curve([(1e6, 1e-5), (1e6, 2e-5)])
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_matmul_curve([(1e6, 1e-5), (2e6, 0.0)])


def test_profile_device_model_quick_is_sane() -> None:
    import torch

    p = profile_device_model("cpu", quick=True, threads=1)
    m = p.model
    assert isinstance(m, DeviceModel)
    for name in ("peak_flops", "bandwidth_Bps", "kernel_s", "matmul_eff", "attention_eff",
                 "optimizer_passes", "optimizer_kernels"):  # fmt: skip
        assert getattr(m, name) > 0 and math.isfinite(getattr(m, name)), name
    assert m.matmul_half_flops >= 0 and m.matmul_eff <= 1 and m.attention_eff <= 1
    # physically plausible for any CPU: 1e8..1e14 flop/s, 1e8..1e13 B/s, 10 ns..10 ms per kernel
    assert 1e8 < m.peak_flops < 1e14 and 1e8 < m.bandwidth_Bps < 1e13 and 1e-8 < m.kernel_s < 1e-2
    assert m.source.startswith("profile: ") and f"torch {torch.__version__}" in m.source
    assert "1 threads" in m.source and torch.get_num_threads() >= 1
    assert m.overlap is False  # a CPU dispatches and computes on the same thread: launch + work
    assert m.optimizer_per_tensor is True  # CPU Adam is single-tensor: its launches per parameter tensor
    assert m.vector_flops is not None and 1e7 < m.vector_flops < m.peak_flops * 10
    assert p.vector is not None and p.vector[0] / p.vector[1] == pytest.approx(m.vector_flops)
    assert (
        m.pool_flops is not None
        and p.pool is not None
        and p.pool[0] / p.pool[1] == pytest.approx(m.pool_flops)
    )
    assert len(p.matmul) >= 4 and all(w > 0 and t > 0 for w, t in p.matmul)
    # logcumsumexp in the rules' flops (12 per element, x3 for training) and the conv curve of 3x3 chains
    assert p.scan is not None and p.scan[0] == 3 * 12 * 4 * 32 * 64
    assert m.scan_flops == pytest.approx(p.scan[0] / p.scan[1]) and m.scan_flops < m.vector_flops
    assert m.conv_eff is not None and 0 < m.conv_eff <= 1 and m.conv_half_flops >= 0
    assert "cpu clock" in m.source  # one thread on a CPU: timed on the process's CPU clock
    with pytest.raises(ValueError, match="clock must be"):
        profile_device_model("cpu", quick=True, clock="sundial")
    with pytest.raises(ValueError, match="device must be"):
        profile_device_model("tpu")
    with pytest.raises(ValueError, match="stat must be"):
        profile_device_model("cpu", quick=True, stat="mean")


def test_profiled_device_model_round_trips_through_cluster_json(tmp_path: Path) -> None:
    tiny = [("mlp", {"batch": 4, "hidden": 8, "input": 8, "layers": 1})]
    (d,) = profile_devices(1, "cpu", quick=True, steps=1, warmup=0, models=tiny, device_model=True)
    assert d.model is not None and d.device().model == d.model
    c = Cluster("one-cpu", (d.device(),), {"all_reduce": Collective(1e-5, 1e9)})
    again = Cluster.load(c.save(tmp_path / "c.json"))
    assert again == c and again.devices[0].model == d.model
    assert "device model" in str(again)


# ----------------------------------------------------------------------------------------------------
# collectives on 2 gloo ranks -> cluster JSON


def test_profile_collectives_two_gloo_ranks() -> None:
    sizes = (8 << 10, 64 << 10, 256 << 10)
    fits = profile_collectives(2, "gloo", sizes=sizes, repeats=2, warmup=1, timeout_s=60)
    assert sorted(fits) == sorted(COLLECTIVE_KINDS)
    for kind, f in fits.items():
        assert f.latency_s >= 0 and 0 < f.bandwidth_Bps < math.inf, f
        assert len(f.points) == 3 and all(t > 0 for _, _, t in f.points)
        # byte conventions of hapnb.hardware.cluster: full = n * shard bytes, n launches for grouped kinds
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
            "-o", str(out), "--name", "here", "--threads", "1"]  # fmt: skip
    assert cli_main(argv) == 0
    c = Cluster.load(out)
    assert c.name == "here" and c.names == ("cpu-0", "cpu-1") and c.dtype_bytes == 4
    assert all(coll.bandwidth_Bps > 0 and coll.latency_s >= 0 for _, coll in c.collectives)
    assert c.intra_machine_Bps == c.collective("all_reduce").bandwidth_Bps
    # every device carries the measured device model (the same one: the ranks share this CPU)
    models = {d.model for d in c.devices}
    assert len(models) == 1 and all(isinstance(m, DeviceModel) for m in models)
    assert next(iter(models)).source.startswith("profile: ") and "1 threads" in next(iter(models)).source
    # and the overlap slowdown γ measured beside a gloo all-reduce loop (>= 0; the simulator's input)
    gamma = next(iter(models)).overlap_slowdown
    assert gamma is not None and 0 <= gamma < math.inf
    assert json.loads(out.read_text())["devices"][0]["model"]["overlap_slowdown"] == gamma
    assert "wrote" in capsys.readouterr().out


def test_a_failing_collective_rank_is_a_profile_error() -> None:
    # an unknown backend makes every rank fail in init_process_group: the supervisor names the rank
    with pytest.raises(
        ProfileError, match=r"(?s)collective profiling on 2 nosuchbackend ranks failed: rank \d exited"
    ):
        profile_collectives(2, "nosuchbackend", sizes=(1024, 4096), repeats=1, warmup=0, timeout_s=60)


def test_overlap_slowdown_field_and_arguments() -> None:
    m = DeviceModel(1e12, 1e11, 5e-6, 0.8, 1e9)
    assert "overlap_slowdown" not in m.to_json()  # left out at its default: older readers, same bytes
    g = dataclasses.replace(m, overlap_slowdown=0.2)
    assert g.to_json()["overlap_slowdown"] == 0.2 and DeviceModel.from_json(g.to_json()) == g
    with pytest.raises(ValueError, match="overlap_slowdown"):
        dataclasses.replace(m, overlap_slowdown=-0.1)
    with pytest.raises(ValueError, match="backend"):
        profile_overlap_slowdown("mpi")
