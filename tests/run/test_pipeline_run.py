"""Pipeline plans on local gloo ranks (hapnb.run.pipelined): torch.distributed.pipelining's GPipe and 1F1B
schedules with uneven stages and data-parallel stages with uneven shares verify equal to one device
(loss, every gradient, weights after Adam steps, float64); ``hapnb launch`` streams their metrics; plans
that cannot run fail with a clear error before any rank starts. Plans are written by hand here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hapnb
from hapnb.cli import main
from hapnb.run.pipelined import PipelineError, load_model, manual_plan, prepare, roles

LIMITS = dict(stall_timeout=120.0, timeout=300.0)  # nothing hangs: a stuck or slow run stops with an error


GPT = dict(devices=1, layers=3, batch=8, seq=8, hidden=16, heads=2, ff=32, vocab=32, dropout=0.0)
GPT_UNITS = ("(input)", "blocks.0", "blocks.1", "blocks.2", "ln_f")
BERT = dict(devices=1, layers=2, batch=8, seq=8, hidden=16, heads=2, ff=32, vocab=40)
LM = dict(batch=8, seq=8, layers=3, vocab=32, hidden=16, heads=2)
LM_UNITS = ("(input)", "blocks.0", "blocks.1", "blocks.2")


@pytest.mark.slow
def test_gpt_gpipe_uneven_stages_verify_and_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # stages of 2 and 3 units (one block, then two blocks and the head) on two ranks, four micro-batches
    plan = manual_plan("gpt", GPT, GPT_UNITS, [(0, 2, (1.0,)), (2, 5, (1.0,))], "GPipe", 4)
    assert plan.split_points() == ("blocks.1",)
    rep = hapnb.verify(plan, nproc=2, steps=3, optimizer="adam", **LIMITS)
    assert rep.ok, rep.text()
    names = {c.name for c in rep.checks if c.kind == "weight"}
    model, inputs = load_model(plan)
    assert names == set(dict(model.named_parameters())) and "blocks.2.qkv.bias" in names

    path = plan.save(tmp_path / "pipeline.json")
    assert main(["launch", str(path), "--nproc", "2", "--steps", "2", "--json", "--timeout", "120"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    steps, summary = lines[:-1], lines[-1]
    assert summary["ok"] and summary["steps"] == 2
    assert sorted((m["rank"], m["stage"], m["step"]) for m in steps) == [
        (0, 0, 0),
        (0, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    first = next(m for m in steps if m["rank"] == 0 and m["step"] == 0)["global_loss"]
    assert first == pytest.approx(float(model(*inputs).detach()), rel=1e-5)  # float32: the batch's loss
    assert summary["final_loss"] == next(m["loss"] for m in steps if m["rank"] == 1 and m["step"] == 1)


@pytest.mark.slow
def test_bert_1f1b_data_parallel_last_stage_verify() -> None:
    # the last stage (one layer, decoder and mean loss) on two devices splitting each micro-batch 3:1
    plan = manual_plan(  # bert keeps dropout 0.1: verify runs its ranks and the reference without it
        "bert", BERT, ("(input)", "layers.0", "layers.1"), [(0, 2, (1.0,)), (2, 3, (0.7, 0.3))], "1F1B", 2
    )
    assert roles(plan)[2].rows == (3, 1)
    rep = hapnb.verify(plan, nproc=3, steps=3, **LIMITS)  # Adam is the pipeline default
    assert rep.ok, rep.text()
    assert rep.steps == 3 and rep.dtype == "float64"


@pytest.mark.slow
def test_factory_data_parallel_first_stage_cli_verify(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # an example factory; the first stage (embeddings + one block) on two devices, 3:1 rows per micro-batch
    plan = manual_plan(
        "examples.factories:prenorm_lm", LM, LM_UNITS, [(0, 2, (0.75, 0.25)), (2, 4, (1.0,))], "GPipe", 2
    )
    assert roles(plan)[0].rows == (3, 1)
    path = plan.save(tmp_path / "pipeline.json")
    assert main(["verify", "--plan", str(path), "--nproc", "3", "--quiet", "--stall-timeout", "120"]) == 0
    assert "OK on 3 ranks, 3 steps, float64" in capsys.readouterr().out


def test_bad_plans_fail_before_any_rank_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plan = manual_plan("gpt", GPT, GPT_UNITS, [(0, 2, (1.0,)), (2, 5, (0.5, 0.5))], "GPipe", 2)
    with pytest.raises(PipelineError, match=r"one rank per device, 3 in all .* nproc=3, not 2"):
        hapnb.verify(plan, nproc=2)
    path = plan.save(tmp_path / "p.json")
    assert main(["launch", str(path), "--nproc", "4"]) == 2
    assert "the plan is for 3 devices" in capsys.readouterr().err

    unknown = manual_plan(
        "gpt", GPT, ("(input)", "blocks.0", "blocks.9"), [(0, 2, (1.0,)), (2, 3, (1.0,))], "GPipe", 2
    )
    with pytest.raises(
        PipelineError, match=r"unit 'blocks.9' is not a submodule .* blocks, drop, head, ln_f"
    ):
        prepare(unknown, 2)
    assert main(["verify", "--plan", str(unknown.save(tmp_path / "u.json")), "--quiet"]) == 1
    assert "blocks.9" in capsys.readouterr().err

    few = manual_plan("gpt", GPT, GPT_UNITS, [(0, 2, (1.0,)), (2, 4, (1.0,)), (4, 5, (1.0,))], "1F1B", 2)
    with pytest.raises(PipelineError, match="1F1B schedule needs at least as many micro-batches as stages"):
        prepare(few, 3, trace=False)

    opts = dict(batch=4, seq=8, vocab=32, hidden=16)
    tied = manual_plan(
        "examples.factories:tied_lm", opts, ("(input)", "norm"), [(0, 1, (1.0,)), (1, 2, (1.0,))], "GPipe", 1
    )
    with pytest.raises(PipelineError, match=r"shared across stages \[0, 1\]: embed.weight .* head.weight"):
        prepare(tied, 2)


def test_cut_is_checked_and_keeps_only_boundary_values() -> None:
    from hapnb.run.pipestage import StageProgram, split_model

    model, inputs = load_model(manual_plan("gpt", GPT, GPT_UNITS, [(0, 5, (1.0,))], "GPipe", 1))
    split = split_model(model, [x[:4] for x in inputs], ["blocks.1", "ln_f"], 3, dropout=False)
    # the targets go straight to the last stage; only the hidden state crosses each boundary
    assert split.carries == ((), (("out", 0, 0),), (("out", 1, 0),)) and split.root_inputs(2) == ("targets",)
    assert split.reduction == "mean"
    progs = [StageProgram(split, s) for s in range(3)]
    x = [t[:4] for t in inputs]
    loss = progs[2](*progs[1](*progs[0](*x)), targets=x[1])
    model.eval()  # the reference without dropout
    torch.testing.assert_close(loss, model(*x))
    with pytest.raises(PipelineError, match="gives 2 stages, not the plan's 3"):
        split_model(model, x, ["blocks.1", "blocks.1"], 3)
