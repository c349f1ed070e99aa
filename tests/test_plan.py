"""The Plan value: deterministic, JSON round trip (format 1, never code), clear errors for bad files."""

from __future__ import annotations

import json

import pytest

import hapnb as hap
from hapnb import zoo
from hapnb.plan import Plan


def test_deterministic_and_json_round_trip(tmp_path):
    a = hap.synthesize("gpt", "2xV100+2xP100", **zoo.TINY["gpt"])
    b = hap.synthesize("gpt", "2xV100+2xP100", **zoo.TINY["gpt"])
    assert a.program == b.program and a.ratios == b.ratios and a.cost_s == b.cost_s
    p = a.save(tmp_path / "plan.json")
    c = Plan.load(p)
    assert c == a
    assert json.loads(p.read_text())["format"] == 1
    assert c.model_spec["name"] == "gpt"


def test_plan_json_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="format"):
        Plan.from_json({"format": 99})
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(bad)
    with pytest.raises(ValueError, match="malformed"):
        Plan.from_json({"format": 1, "name": "x"})
