"""Sharded checkpoints (``hapnb.save_checkpoint`` / ``hapnb.load_checkpoint``, issue 20) against one
device in float64: 2 uneven gloo ranks train 2 AdamW steps on one plan, save (weights and Adam's state
sharded as the plan shards them), load onto another plan (other ratios, other shards) and train 2 more
steps: the weights equal one device that never stopped; the checkpoints load into the single-device
model too, and a single-device checkpoint onto a plan. This file's ``worker`` is one rank.

    python tests/run/test_checkpoint.py worker PLAN_A.json PLAN_B.json OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_training import BATCH, build

ROOT = Path(__file__).resolve().parents[2]
LR, DECAY = 0.05, 0.1


CLUSTER = "1xV100+1xP100"


def make_plan(**kw):  # type: ignore[no-untyped-def]
    import hapnb

    model, tokens, targets = build()
    return hapnb.synthesize(model, CLUSTER, example_inputs=(tokens[:BATCH], targets[:BATCH]), **kw)


def batches(tokens: torch.Tensor, targets: torch.Tensor, steps: range) -> list[tuple[torch.Tensor, ...]]:
    """The global batch of each step (rows shifted by 5 a step, so that every step's batch differs)."""
    out = []
    for s in steps:
        rows = [(5 * s + i) % len(tokens) for i in range(BATCH)]
        out.append((tokens[rows], targets[rows]))
    return out


def one_device(steps: int, model: torch.nn.Module | None = None, opt=None):  # type: ignore[no-untyped-def]
    """The single-device run (float64, no dropout): the model and optimizer after ``steps`` steps."""
    fresh, tokens, targets = build()
    if model is None:
        model = fresh.double().eval()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    done = 0 if opt is None or not opt.state else int(next(iter(opt.state.values()))["step"])
    for x, y in batches(tokens, targets, range(done, steps)):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def rel(a: dict, b: dict) -> float:
    """The largest difference of two state dicts relative to the largest weight."""
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in b)


def test_single_device_round_trip_and_clear_errors(tmp_path: Path) -> None:
    """One process, no process group: save and load the single-device model and its AdamW state; a
    checkpoint of another model is refused naming the weight."""
    import hapnb

    model, opt = one_device(2)
    hapnb.save_checkpoint(tmp_path / "c", model, opt, step=2, note=[1, "a"])
    fresh = build(seed=4)[0].double().eval()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    assert hapnb.load_checkpoint(tmp_path / "c", fresh, fopt) == {"step": 2, "note": [1, "a"]}
    assert rel(fresh.state_dict(), model.state_dict()) == 0 and fopt.param_groups[0]["lr"] == LR
    model, opt = one_device(4, model, opt)
    fresh, fopt = one_device(4, fresh, fopt)
    assert rel(fresh.state_dict(), model.state_dict()) == 0
    other = torch.nn.Linear(3, 2)
    with pytest.raises(
        ValueError, match=r"checkpoint .*c has no weight weight: it was saved from another model"
    ):
        hapnb.load_checkpoint(tmp_path / "c", other)
    with pytest.raises(FileNotFoundError, match="no .metadata file"):
        hapnb.load_checkpoint(tmp_path / "nothing", other)
    params = list(fresh.parameters())
    two = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(ValueError, match="saved with an optimizer of 1 parameter groups, this one has 2"):
        hapnb.load_checkpoint(tmp_path / "c", fresh, two)
    hapnb.save_checkpoint(tmp_path / "weights", fresh)
    with pytest.raises(ValueError, match="has no optimizer state: it was saved without an optimizer"):
        hapnb.load_checkpoint(tmp_path / "weights", fresh, fopt)
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[0\] .* is not a parameter of the module"
    ):
        hapnb.save_checkpoint(tmp_path / "bad", fresh, torch.optim.SGD(other.parameters(), lr=0.1))


@pytest.mark.slow
def test_checkpoint_reshards_onto_another_plan(tmp_path: Path) -> None:
    import hapnb

    # plan A: the tied weight ZeRO-3, the batch 9/3; plan B: the tied weight and mix.weight split on other
    # dims, the batch 6/6 (other shard boundaries: each rank reads parts written by both)
    a = make_plan(
        pins={"head.weight": hapnb.FullShard(0), "tokens": hapnb.Shard(0), "targets": hapnb.Shard(0)},
        ratios=[0.75, 0.25],
    )
    b = make_plan(
        pins={"head.weight": hapnb.FullShard(1), "mix.weight": hapnb.Shard(0), "tokens": hapnb.Shard(0)},
        ratios=[0.5, 0.5],
    )
    assert a.lengths_of("tokens", 0) == (9, 3) and b.lengths_of("tokens", 0) == (6, 6)
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    argv = [
        sys.executable,
        __file__,
        "worker",
        str(tmp_path / "a.json"),
        str(tmp_path / "b.json"),
        str(tmp_path),
    ]
    from procs import run_ranks  # tests/ helper; this file also runs as a rank worker, without it

    run_ranks(argv, 2, {"PYTHONPATH": str(ROOT)})
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for o in out:
        assert o["sharded_a"] and o["sharded_b"] and o["sharded_a"] != o["sharded_b"]
        assert o["extra"] == {"step": 2, "sched": {"last_epoch": 2}}
        assert o["lr"] == LR and o["at_load_rel"] < 1e-12
        assert o["weights_rel"] < 1e-9, o
    # each rank wrote its own shards
    assert sorted(p.name for p in (tmp_path / "ckpt2").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(2)
    ]
    # the checkpoints load into the single-device model: step 2 (plan A's layout) continued on one
    # device, and step 4 (plan B's layout) as it is
    want, _ = one_device(4)
    model = build(seed=9)[0].double().eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    assert hapnb.load_checkpoint(tmp_path / "ckpt2", model, opt)["step"] == 2
    model, opt = one_device(4, model, opt)
    assert rel(model.state_dict(), want.state_dict()) < 1e-9
    hapnb.load_checkpoint(tmp_path / "ckpt4", model)
    assert rel(model.state_dict(), want.state_dict()) < 1e-9


def worker(plan_a: str, plan_b: str, out_dir: str) -> None:
    """One rank: 2 steps on plan A, save; load onto plan B, 2 more steps; weights against one device."""
    import torch.distributed as dist

    import hapnb
    from hapnb.plans.plan import Plan

    dist.init_process_group("gloo")
    rank, res = dist.get_rank(), {}
    _, tokens, targets = build()
    steps = batches(tokens, targets, range(4))
    ex = (tokens[:BATCH], targets[:BATCH])
    dm = hapnb.distribute(build()[0].double().eval(), Plan.load(plan_a), example_inputs=ex)
    opt = torch.optim.AdamW(dm.parameters(), lr=LR, weight_decay=DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for x, y in steps[:2]:
        dm(*dm.local_inputs(x, y)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    res["sharded_a"] = [p.name for p in dm.program.params if p.sharded]
    hapnb.save_checkpoint(Path(out_dir, "ckpt2"), dm, opt, step=2, sched={"last_epoch": sched.last_epoch})
    # another plan, a fresh model and optimizer (a wrong learning rate, which the checkpoint restores)
    dm = hapnb.distribute(build()[0].double().eval(), Plan.load(plan_b), example_inputs=ex)
    opt = torch.optim.AdamW(dm.parameters(), lr=1.0, weight_decay=DECAY)
    res["extra"] = hapnb.load_checkpoint(Path(out_dir, "ckpt2"), dm, opt)
    res["lr"] = opt.param_groups[0]["lr"]
    res["sharded_b"] = [p.name for p in dm.program.params if p.sharded]
    res["at_load_rel"] = rel(hapnb.full_state_dict(dm), one_device(2)[0].state_dict())
    for x, y in steps[2:]:
        dm(*dm.local_inputs(x, y)).backward()
        opt.step()
        opt.zero_grad()
    res["weights_rel"] = rel(hapnb.full_state_dict(dm), one_device(4)[0].state_dict())
    hapnb.save_checkpoint(Path(out_dir, "ckpt4"), dm, opt, step=4)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    # garbage first: plan A's distributed module sits in a reference cycle; freed at interpreter shutdown,
    # after the groups, its gloo group aborted the process (SIGABRT, seen once in CI)
    hapnb.destroy_groups()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(*sys.argv[2:])


# ------------------------------------------------------------------------------------ the example

LM_OPTS = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "16", "--batch", "6", "--dtype", "float64",
           "--steps", "4", "--warmup", "2", "--lr", "0.01", "--clip", "0.5"]  # fmt: skip


@pytest.mark.slow
def test_train_lm_example_equals_one_device_and_resumes_on_it(tmp_path: Path) -> None:
    """examples/train_lm.py (HF GPT-2, AdamW, warmup + cosine, clipping, accumulation 2) on 2 uneven gloo
    ranks: every step's global loss and gradient norm are one device's; its checkpoint at step 2
    resumes on one device (another cluster, another number of ranks) to the same weights."""
    import io

    import hapnb
    from examples import train_lm

    model, example = train_lm.lm(batch=6, seq=16, layers=1, hidden=16, heads=2)
    plan = hapnb.synthesize(model, "1xV100+1xP100", example_inputs=example)
    shares = plan.lengths_of("input_ids", 0)
    assert len(set(shares)) == 2, f"the batch is not split unevenly: {shares}"
    plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, str(ROOT / "examples" / "train_lm.py"), str(tmp_path / "plan.json"), *LM_OPTS,
            "--ckpt-dir", str(ckpt), "--save-at", "2", "--save-at", "4", "--timeout", "120"]  # fmt: skip
    got: list[dict] = []
    from procs import run_ranks  # tests/ helper; this file also runs as a rank worker, without it

    run_ranks(argv, 2, {"PYTHONPATH": str(ROOT)}, on_heartbeat=lambda r, m: got.append(m))
    want, ref = train_lm.run(LM_OPTS, out=io.StringIO())
    assert len(got) == 8
    for m in got:
        w = want[m["step"]]
        assert m["global_loss"] == pytest.approx(w["global_loss"], rel=1e-9)
        assert m["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-9) and m["lr"] == w["lr"]
        assert m["rows"] == 2 * shares[m["rank"]]  # each rank read only its rows of both micro-batches
    assert want[-1]["global_loss"] < want[0]["global_loss"]
    # the distributed checkpoint of step 2 resumes on one device; step 4's loads into it
    resumed, model = train_lm.run([*LM_OPTS, "--resume", str(ckpt / "step2")], out=io.StringIO())
    assert [r["step"] for r in resumed] == [2, 3]
    for r, w in zip(resumed, want[2:]):
        assert r["global_loss"] == pytest.approx(w["global_loss"], rel=1e-9)
    assert rel(model.state_dict(), ref.state_dict()) < 1e-9
    hapnb.load_checkpoint(ckpt / "step4", model)
    assert rel(model.state_dict(), ref.state_dict()) < 1e-9
