"""Runtime: bundles, local multi-rank verification against one device, the worker CLI, and
distribute/full_state_dict under local ranks. Every multi-process run has a timeout and is cleaned up."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hapnb import zoo
from hapnb.codegen import CodegenError, generate, program_weights
from hapnb.plan import Plan
from hapnb.run.runtime import (
    BundleError,
    VerifyError,
    load_bundle,
    spawn_ranks,
    verify,
    verify_main,
    write_bundle,
)
from hapnb.synthesis import synthesize

ROOT = Path(__file__).resolve().parent.parent


def _mlp(cluster: str, ratios, **kw) -> Plan:
    return synthesize("mlp", cluster, ratios=ratios, **{**zoo.TINY["mlp"], **kw})


DP_PINS = {
    "x": "G0",
    "y": "G0",
    **{f"{m}.{k}": "I" for m in ("layers.0", "layers.1", "head") for k in ("weight", "bias")},
}


@pytest.fixture(scope="module")
def dp_plan() -> Plan:
    """Plain data parallel on uneven ratios: every weight replicated (gradient all-reduce), batch 6/2."""
    plan = _mlp("2xV100", [0.75, 0.25], pins=DP_PINS, options={"sfb": False})
    assert all(i.name == "load" for i in plan.program if i.kind == "load")
    return plan


def _descendants_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.slow
def test_verify_uneven_two_ranks(dp_plan: Plan) -> None:
    tp = _mlp("2xV100", [0.7, 0.3])  # the searched (tensor-parallel) program
    assert any(i.kind == "load" and i.form.startswith("G") and "weight" in i.tensor for i in tp.program)
    report = verify(tp, nproc=2, steps=2, timeout=90)
    assert report.ok, report.text()
    names = {c.name for c in report.checks}
    params = {tp.graph.tensors[t].name for t in tp.graph.params}
    assert params <= names  # every gradient and weight was compared
    assert {c.kind for c in report.checks} == {"loss", "grad", "weight"}
    assert report.max_rel < 1e-10
    assert "OK" in report.text() and "OK" in report._repr_html_()


@pytest.mark.slow
def test_verify_main_zero_length_shard(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # data parallel with sufficient-factor broadcasting, rank 1 gets no samples
    plan = _mlp("3xV100", [0.5, 0.0, 0.5], pins=DP_PINS)
    assert any(i.name == "load_sfb" for i in plan.program)
    assert any(0 in ls for _, _, ls in plan.lengths)  # rank 1 holds empty shards
    path = plan.save(tmp_path / "plan.json")
    code = verify_main(argparse.Namespace(plan=str(path), nproc=3, backend="gloo", steps=2))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK on 3 ranks" in out


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
    code = verify_main(argparse.Namespace(plan=str(path), nproc=2, steps=2))
    out = capsys.readouterr().out
    assert code == 1
    assert "MISMATCH" in out and "max relative error per tensor" in out
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


@pytest.mark.slow
def test_crashing_rank_gives_its_traceback(tmp_path: Path) -> None:
    script = (
        "import os, time\n"
        "print(os.getpid(), flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('rank one exploded')\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(VerifyError, match=r"(?s)rank 1 of 2 failed.*Traceback.*rank one exploded"):
        spawn_ranks(2, ["-c", script], tmp_path, 30)
    pids = [int((tmp_path / f"rank{r}.log").read_text().split()[0]) for r in range(2)]
    assert _descendants_alive(pids) == []  # the surviving rank was killed


@pytest.mark.slow
def test_hung_rank_is_killed(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match="still running after") as info:
        spawn_ranks(
            2, ["-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"], tmp_path, 3
        )
    assert "ranks [0, 1]" in str(info.value)
    pids = [int((tmp_path / f"rank{r}.log").read_text().split()[0]) for r in range(2)]
    assert _descendants_alive(pids) == []


def test_verify_rejects_wrong_nproc(dp_plan: Plan) -> None:
    with pytest.raises(ValueError, match="nproc=2"):
        verify(dp_plan, nproc=3)


def test_bundle_round_trip(dp_plan: Plan, tmp_path: Path) -> None:
    d = write_bundle(dp_plan, tmp_path / "b")
    assert {p.name for p in d.iterdir()} >= {"plan.json", "program.pt2", "cluster.json", "inputs.pt"}
    b = load_bundle(d)
    assert b.plan == dp_plan
    assert b.graph.fingerprint == dp_plan.graph_fingerprint
    _, inputs, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    assert all(torch.equal(a, c) for a, c in zip(b.inputs, inputs))
    w0, w1 = program_weights(dp_plan.graph), program_weights(b.graph)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    for rank in range(2):
        assert generate(b.plan, b.graph, rank).code == generate(dp_plan, dp_plan.graph, rank).code
    # a plan read back from JSON has no graph: the bundle is rebuilt from the plan's zoo spec
    loaded = Plan.load(dp_plan.save(tmp_path / "p.json"))
    assert loaded.graph is None
    b2 = load_bundle(write_bundle(loaded, tmp_path / "b2"))
    assert b2.graph.fingerprint == dp_plan.graph_fingerprint
    (tmp_path / "b2" / "inputs.pt").unlink()
    with pytest.raises(BundleError, match="missing inputs.pt"):
        load_bundle(tmp_path / "b2")
    wrong_model, wrong_inputs, _ = zoo.build("mlp", devices=2, **{**zoo.TINY["mlp"], "hidden": 16})
    with pytest.raises(BundleError, match="made for graph"):
        write_bundle(dp_plan, tmp_path / "b3", model=wrong_model, example_inputs=wrong_inputs)


@pytest.mark.slow
def test_worker_cli_metrics(dp_plan: Plan, tmp_path: Path) -> None:
    d = write_bundle(dp_plan, tmp_path / "bundle")
    metrics = tmp_path / "m{rank}.jsonl"
    args = ["-m", "hapnb.run.worker", str(d), "--steps", "3", "--metrics", str(metrics), "--optimizer", "sgd"]
    spawn_ranks(2, args, tmp_path, 90)
    rows = [[json.loads(ln) for ln in (tmp_path / f"m{r}.jsonl").read_text().splitlines()] for r in range(2)]
    keys = {"rank", "step", "loss", "global_loss", "step_s", "max_memory_bytes"}
    for r, rs in enumerate(rows):
        assert [m["step"] for m in rs] == [0, 1, 2]
        assert all(set(m) == keys and m["rank"] == r and m["step_s"] > 0 for m in rs)
    for s in range(3):
        total = rows[0][s]["loss"] + rows[1][s]["loss"]
        assert rows[0][s]["global_loss"] == pytest.approx(total, rel=1e-6)
        assert rows[1][s]["global_loss"] is None
    assert rows[0][2]["global_loss"] < rows[0][0]["global_loss"]  # it trains


def test_worker_cli_reports_bad_bundle(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hapnb.run.worker", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"},
    )
    assert r.returncode == 1
    assert "is not a hapnb bundle" in r.stderr


@pytest.mark.slow
def test_distribute_and_full_state_dict_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "trained.pt"
    args = [
        str(ROOT / "examples" / "train.py"), "--model", "mlp", "--ratios", "0.7,0.3", "--steps", "3",
        "--check", "--out", str(out), "--layers", "2", "--hidden", "32", "--input", "16", "--batch", "8",
    ]  # fmt: skip
    logs = spawn_ranks(2, args, tmp_path, 90)
    assert all("full_state_dict round trip exact" in log for log in logs)
    steps = [json.loads(ln) for ln in logs[0].splitlines() if ln.startswith('{"step"')]
    assert len(steps) == 3 and steps[-1]["loss"] < steps[0]["loss"]
    final = json.loads(next(ln for ln in logs[0].splitlines() if "trained_single_device_loss" in ln))
    # the gathered weights, loaded into the single-device model, are the trained ones
    assert final["trained_single_device_loss"] < steps[-1]["loss"]
    state = torch.load(out, weights_only=True)
    model, _, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    model.load_state_dict(state)
    assert set(state) == set(model.state_dict())


# ================================================================== virtual devices (hapnb.expand)

VIRTUAL = "2xV100+2xP100"  # two machines of two GPUs: 2 virtual devices, 4 ranks


@pytest.fixture(scope="module")
def virtual_plans() -> dict[str, Plan]:
    from hapnb.cluster import Cluster

    c = Cluster.parse(VIRTUAL).virtual()
    assert [d.gpus for d in c.devices] == [2, 2]
    gpt3 = {**zoo.TINY["gpt"], "layers": 3}
    return {
        "gpt": synthesize("gpt", c, **zoo.TINY["gpt"]),
        "mlp": synthesize("mlp", c, **zoo.TINY["mlp"]),
        # per-layer segments: the plan re-cuts activations between segments (reshard lengths)
        "gpt-segments": synthesize("gpt", c, segments="layer", **gpt3),
        # machine m0 gets no share at all (both its GPUs hold empty shards)
        "mlp-zero": synthesize("mlp", c, ratios=[0.0, 1.0], **zoo.TINY["mlp"]),
    }


def _check_expansion(plan: Plan) -> Plan:
    """Ground truth for expand_virtual: devices, ratios and every cut, against the virtual plan."""
    from hapnb import theory
    from hapnb.expand import expand_virtual
    from hapnb.forms import parse_form

    e = expand_virtual(plan, plan.graph)
    vc, pc = plan.cluster, e.cluster
    assert pc.n == vc.gpus == 4 and all(d.gpus == 1 for d in pc.devices)
    assert e.devices == ("m0.g0", "m0.g1", "m1.g0", "m1.g1")
    for j, v in enumerate(vc.devices):
        for d in pc.devices[2 * j : 2 * j + 2]:
            assert d.machine == v.machine and d.kind == v.kind
            assert d.flops == pytest.approx(v.flops / 2) and d.memory_bytes == v.memory_bytes // 2
    for vrow, prow in zip(plan.ratios, e.ratios, strict=True):
        assert prow == pytest.approx([vrow[0] / 2, vrow[0] / 2, vrow[1] / 2, vrow[1] / 2])
    th = theory(plan.graph)
    g = plan.graph

    def check_cut(name: str, dim: int, virt: tuple[int, ...], phys: tuple[int, ...]) -> None:
        t = g.tensor(name)
        unit, _ = th.units.get((t.id, dim), (1, t.shape[dim]))
        assert sum(phys) == t.shape[dim], (name, dim, phys)
        assert all(x % unit == 0 for x in phys), (name, dim, unit, phys)
        assert (phys[0] + phys[1], phys[2] + phys[3]) == virt  # each machine keeps its share
        assert abs(phys[0] - phys[1]) <= unit and abs(phys[2] - phys[3]) <= unit  # split evenly

    assert [(t, d) for t, d, _ in e.lengths] == [(t, d) for t, d, _ in plan.lengths]
    for (t, d, virt), (_, _, phys) in zip(plan.lengths, e.lengths):
        check_cut(t, d, virt, phys)
    assert len(e.program) == len(plan.program)
    for vi, pi in zip(plan.program, e.program):
        assert dataclasses.replace(pi, lengths=vi.lengths) == vi  # only reshard lengths change
        if vi.lengths:
            check_cut(vi.tensor, parse_form(vi.form.partition("@")[0]).dim, vi.lengths, pi.lengths)
    assert [len(s.comp_s) for s in e.stages] == [4] * len(plan.stages)  # the virtual estimate, per GPU
    assert e.cost_s == plan.cost_s
    return e


@pytest.mark.parametrize("name", ["gpt", "mlp", "gpt-segments", "mlp-zero"])
def test_expand_virtual_cuts(virtual_plans: dict[str, Plan], name: str) -> None:
    plan = virtual_plans[name]
    e = _check_expansion(plan)
    if name == "gpt-segments":
        assert any(i.name == "reshard" and len(i.lengths) == 4 for i in e.program)
    if name == "mlp-zero":
        assert e.ratios[0][:2] == (0.0, 0.0)
        assert all(ls[:2] == (0, 0) for _, _, ls in e.lengths)
    # codegen runs a virtual plan as its expansion: rank r is physical GPU r
    for rank in (0, 3):
        assert generate(plan, plan.graph, rank).code == generate(e, plan.graph, rank).code
    # a plan without virtual devices is left alone; the expansion is a plain plan with a JSON round trip
    from hapnb.expand import expand_virtual

    assert expand_virtual(e) is e
    assert Plan.from_json(e.to_json()) == e


def test_virtual_plan_rank_counts(virtual_plans: dict[str, Plan], tmp_path: Path) -> None:
    from hapnb.run.launch import _plan_devices

    plan = virtual_plans["mlp"]
    with pytest.raises(ValueError, match=r"is for 4 GPUs \(2 virtual devices of 2\+2 GPUs.*nproc=4, not 2"):
        verify(plan, nproc=2)
    assert _plan_devices(plan.save(tmp_path / "plan.json")) == 4  # launch's default nproc


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-segments", "mlp-zero"])
def test_verify_virtual_plan_on_gpus(virtual_plans: dict[str, Plan], name: str) -> None:
    # the bundle keeps the virtual plan; verify and every worker expand it to one rank per GPU
    report = verify(virtual_plans[name], steps=2, timeout=120)
    assert report.ok, report.text()
    assert report.nproc == 4 and "OK on 4 ranks" in report.text()
    assert report.max_rel < 1e-10
