"""The pipeline plan value and its JSON (hapnb.pipelines.plan): round trip, validation with clear
errors, and the SPMD plan loader refusing a pipeline plan by name."""

from __future__ import annotations

import json

import pytest

from hapnb.hardware.cluster import Cluster
from hapnb.pipelines import PipelinePlan, PipelineStage, is_pipeline_json
from hapnb.plans.plan import Plan


def _plan(**kw):
    c = Cluster.parse("2xV100+1xP100")
    stages = kw.pop(
        "stages",
        (
            PipelineStage(0, (0, 2), ("v100-0", "v100-1"), (0.6, 0.4), 1e-3, 2e-3, (10, 10)),
            PipelineStage(1, (2, 4), ("p100-0",)),
        ),
    )
    base = dict(
        name="t",
        model=(("name", "gpt"), ("options", (("layers", 2),))),
        cluster=c,
        units=("(input)", "blocks.0", "blocks.1", "norm"),
        stages=stages,
        schedule="GPipe",
        micro_batches=2,
        batch=8,
        iteration_s=0.01,
        method="dp",
    )
    base.update(kw)
    return PipelinePlan(**base)


def test_json_round_trip_and_views(tmp_path):
    p = _plan()
    q = PipelinePlan.load(p.save(tmp_path / "p.json"))
    assert q == p
    assert q.model_spec == {"name": "gpt", "options": {"layers": 2}}
    assert q.devices == ("v100-0", "v100-1", "p100-0")
    assert q.split_points() == ("blocks.1",)
    assert q.stages[1].shares == (1.0,)
    assert [q.stage_of_unit(u) for u in range(4)] == [0, 0, 1, 1]
    assert is_pipeline_json(json.loads((tmp_path / "p.json").read_text()))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(schedule="zigzag"), "schedule 'zigzag'"),
        (dict(micro_batches=3), "does not split into 3"),
        (dict(stages=(PipelineStage(0, (0, 3), ("v100-0",)),)), "cover units [0, 3) of 4"),
        (
            dict(stages=(PipelineStage(0, (0, 2), ("v100-0",)), PipelineStage(1, (3, 4), ("p100-0",)))),
            "contiguous",
        ),
        (
            dict(stages=(PipelineStage(0, (0, 2), ("v100-0",)), PipelineStage(1, (2, 4), ("v100-0",)))),
            "a device runs one",
        ),
        (dict(stages=(PipelineStage(0, (0, 4), ("a100-0",)),)), "not in cluster"),
    ],
)
def test_invalid_plans_say_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        _plan(**change)


def test_stage_checks_its_shares():
    with pytest.raises(ValueError, match="sum to 1"):
        PipelineStage(0, (0, 1), ("a", "b"), (0.5, 0.6))
    with pytest.raises(ValueError, match="2 shares for 1 devices"):
        PipelineStage(0, (0, 1), ("a",), (0.5, 0.5))


def test_spmd_loader_names_a_pipeline_plan(tmp_path):
    path = _plan().save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="pipeline plan"):
        Plan.load(path)
    d = json.loads(path.read_text())
    d["format"] = 7
    with pytest.raises(ValueError, match="format 7"):
        PipelinePlan.from_json(d)
    with pytest.raises(ValueError, match="malformed"):
        PipelinePlan.from_json({"kind": "pipeline", "format": 1})
