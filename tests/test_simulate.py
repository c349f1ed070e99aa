"""Timelines (hapnb.simulate): the stage model laid out in time per device, memory and OOM flags."""

from __future__ import annotations

import dataclasses

import pytest

import hapnb as hap
from hapnb import zoo
from hapnb.simulate import simulate


@pytest.fixture(scope="module")
def plan():
    return hap.synthesize("gpt", "2xA100+2xP100", **zoo.TINY["gpt"])


def test_timeline_reproduces_the_stage_model(plan):
    tl = simulate(plan)
    assert tl.iteration_s == pytest.approx(plan.cost_s, rel=1e-12)
    assert tl.devices == plan.devices
    for d in plan.devices:
        spans = sorted((s for s in tl.segments if s.device == d), key=lambda s: s.start_s)
        # back to back from 0 to the end of the iteration: communication, computation, idle per stage
        assert spans[0].start_s == 0.0 and spans[-1].end_s == pytest.approx(tl.iteration_s)
        for a, b in zip(spans, spans[1:]):
            assert b.start_s == pytest.approx(a.end_s)
    for st in plan.stages:
        for j, d in enumerate(plan.devices):
            comp = sum(
                s.duration_s
                for s in tl.segments
                if s.device == d and s.stage == st.index and s.kind == "comp"
            )
            idle = sum(
                s.duration_s
                for s in tl.segments
                if s.device == d and s.stage == st.index and s.kind == "idle"
            )
            assert comp == pytest.approx(st.comp_s[j]) and comp + idle == pytest.approx(max(st.comp_s))
    busy = tl.busy_fraction()
    assert all(0 < v <= 1 for v in busy.values())


def test_memory_and_oom(plan):
    tl = simulate(plan)
    assert tl.peak_memory_bytes == plan.memory_bytes and not any(tl.oom)
    small = plan.cluster.replace(
        devices=tuple(dataclasses.replace(d, memory_bytes=1024) for d in plan.cluster.devices)
    )
    tight = simulate(dataclasses.replace(plan, cluster=small))
    assert all(tight.oom) and "OUT OF MEMORY" in str(tight)
    js = tight.to_json()
    assert js["iteration_s"] == tl.iteration_s
    assert [d["name"] for d in js["devices"]] == list(plan.devices) and all(d["oom"] for d in js["devices"])
