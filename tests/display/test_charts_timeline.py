"""bokeh charts of simulated timelines (hapnb.display.charts.timeline_gantt, memory_chart)."""

from __future__ import annotations

import pytest

pytest.importorskip("bokeh")

import hapnb as hap  # noqa: E402
from hapnb import zoo  # noqa: E402
from hapnb.display import charts  # noqa: E402
from hapnb.plans.simulation import simulate  # noqa: E402


@pytest.fixture(scope="module")
def plan():
    return hap.synthesize("gpt", "2xV100+2xP100", **zoo.TINY["gpt"])


def spans_source(fig):
    (r,) = [r for r in fig.renderers if r.name == "spans"]
    return r.data_source.data


def test_gantt_draws_every_span_on_its_stream_lane(plan):
    for tl in (simulate(plan), simulate(plan, overlap=False)):
        fig = tl.gantt()
        data = spans_source(fig)
        assert len(data["left"]) == len(tl.spans) > 0
        assert data["lane"] == [f"{s.device} / {s.stream}" for s in tl.spans]
        assert data["color"] == [charts.PHASE_COLORS[(s.stream, s.phase)] for s in tl.spans]
        assert data["instruction"] == [s.instruction for s in tl.spans]
        # sub-lanes: every device's compute stream, and each communication stream it has spans on
        lanes = charts.timeline_lanes(tl)
        assert list(fig.y_range.factors) == list(reversed(lanes))
        expected = {f"{d} / compute" for d in tl.devices} | {f"{s.device} / {s.stream}" for s in tl.spans}
        assert set(lanes) == expected
        assert len(lanes) == len(tl.devices) * len({s.stream for s in tl.spans} | {"compute"})
        assert fig.x_range.end == pytest.approx(tl.iteration_s * charts.time_unit(tl.iteration_s)[1] * 1.02)
    # the plan renderer hands a timeline to the timeline chart
    tl = simulate(plan)
    assert spans_source(charts.gantt(tl))["left"] == spans_source(tl.gantt())["left"]


def test_memory_chart_has_a_line_per_device(plan):
    tl = simulate(plan)
    fig = tl.memory_chart()
    for d, pts, peak in zip(tl.devices, tl.memory, tl.peak_memory_bytes):
        (r,) = [r for r in fig.renderers if r.name == f"memory {d}"]
        data = r.data_source.data
        assert len(data["t"]) in (len(pts), len(pts) + 1)
        assert max(data["mib"]) == pytest.approx(peak / 2**20)
        assert data["mib"][0] == pytest.approx(pts[0][1] / 2**20)
