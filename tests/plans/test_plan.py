"""The Plan value: deterministic, JSON round trip (format 1, never code), clear errors for bad files."""

from __future__ import annotations

import json

import pytest

import hapnb as hap
from hapnb import zoo
from hapnb.plans.plan import Plan


def test_deterministic_and_json_round_trip(tmp_path):
    a = hap.synthesize("gpt", "2xV100+2xP100", **zoo.TINY["gpt"])
    b = hap.synthesize("gpt", "2xV100+2xP100", **zoo.TINY["gpt"])
    assert a.program == b.program and a.ratios == b.ratios and a.cost_s == b.cost_s
    p = a.save(tmp_path / "plan.json")
    c = Plan.load(p)
    assert c == a
    assert json.loads(p.read_text())["format"] == 1
    assert c.model_spec["name"] == "gpt"


def test_memory_breakdown_sums_to_memory_bytes_and_round_trips(tmp_path):
    a = hap.synthesize("lm", "1xH100", **zoo.TINY["lm"])
    (b,) = a.memory_breakdown
    assert sum(v for _, v in b) == a.memory_bytes[0]
    assert dict(b)["overhead"] > 0 and dict(b)["activations"] > 0
    c = Plan.load(a.save(tmp_path / "plan.json"))
    assert c == a and c.memory_breakdown == a.memory_breakdown
    d = json.loads((tmp_path / "plan.json").read_text())
    assert d["memory_breakdown"][0]["parameters"] == dict(b)["parameters"]
    del d["memory_breakdown"]  # plans written before the breakdown still load
    assert Plan.from_json(d).memory_breakdown == ()


def test_plan_json_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="format"):
        Plan.from_json({"format": 99})
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(bad)
    with pytest.raises(ValueError, match="malformed"):
        Plan.from_json({"format": 1, "name": "x"})
