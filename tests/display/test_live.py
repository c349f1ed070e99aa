"""The live telemetry views (hapnb.display.live): a job's metrics lines to columns, the decisions in words and
as a table, and the bokeh chart with its re-balance markers (pure functions: no processes)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("bokeh")

from hapnb.display import live  # noqa: E402

ACCEPTED = {
    "step": 5, "accepted": True, "reason": "straggler: v100-2 (rank 2) at 3.00x the plan's time; pays back in 4.0 steps",
    "old_ratios": [[1 / 3, 1 / 3, 1 / 3]], "new_ratios": [[0.43, 0.43, 0.14]], "step_s": 0.030,
    "predicted_step_s": 0.018, "predicted_gain": 0.012, "reshard_s_estimate": 0.1, "payback_steps": 4.0,
    "scale": [1.0, 1.0, 3.0], "reshard_s": 0.02,
}  # fmt: skip
DECLINED = {"step": 9, "accepted": False, "reason": "re-solve failed: no LP"}


def job_lines(steps: int = 12, telemetry: bool = True) -> list[dict]:
    """What a 3-rank job with rank 2 three times slower prints: step lines (rank 2 computes 3x as long until
    the re-balance after step 5, the others wait for it), rank 0's telemetry windows and two decisions."""
    out: list[dict] = []
    for s in range(steps):
        slow = s <= ACCEPTED["step"]
        comp = [0.01, 0.01, 0.03 if slow else 0.016]
        step_s = max(comp) + 0.002 + (0.05 if s == 0 else 0.0)  # a slow first step (warm-up)
        for r in range(3):
            m = {
                "rank": r,
                "step": s,
                "loss": 1.0 / (s + 1),
                "global_loss": 3.0 / (s + 1) if r == 0 else None,
            }
            m["step_s"] = step_s + 0.0001 * r
            if telemetry:
                m.update(compute_s=comp[r], comm_s=m["step_s"] - comp[r], optimizer_s=0.001)
            out.append(m)
        if telemetry and s % 4 == 1:
            window = {"compute_s": comp, "comm_s": [step_s - c for c in comp], "step_s": [step_s] * 3}
            out.append(
                {"rank": 0, "event": "telemetry", "step": s, "window": window, "scale": [1.0, 1.0, 3.0]}
            )
        if telemetry and s == ACCEPTED["step"]:
            out.append({"rank": 0, "event": "rebalance", "rebalance": dict(ACCEPTED)})
        if telemetry and s == DECLINED["step"]:
            out.append({"rank": 0, "event": "rebalance", "rebalance": dict(DECLINED)})
        out.append({"rank": 1, "phase": "forward", "step": s, "t": 0.0})  # a heartbeat: not a metric
    return out


def renderer(fig, name):
    (r,) = [r for r in fig.renderers if r.name == name]
    return r.data_source.data


def test_rows_decisions_and_iteration_times_read_the_lines():
    lines = job_lines()
    rows = live.live_rows(lines)
    assert sorted(rows) == [0, 1, 2]
    assert rows[2]["step"] == list(range(12)) and rows[2]["compute_s"][:6] == [0.03] * 6
    assert rows[1]["step_s"] == [m["step_s"] for m in lines if m.get("rank") == 1 and "loss" in m]
    assert live.decisions(lines) == [ACCEPTED, DECLINED]
    assert [w["step"] for w in live.windows(lines)] == [1, 5, 9]
    steps, times = live.iteration_times(lines)
    assert steps == list(range(12)) and times == [rows[2]["step_s"][s] for s in steps]  # the slowest rank
    plain = live.live_rows(job_lines(telemetry=False))
    assert plain[0]["compute_s"] == [None] * 12 and live.decisions(job_lines(telemetry=False)) == []


def test_decisions_in_words_and_in_a_table():
    text = live.rebalance_text(ACCEPTED)
    assert text.startswith("after step 5: re-balanced (straggler: v100-2 (rank 2)")
    assert "ratios 0.333/0.333/0.333 -> 0.430/0.430/0.140" in text
    assert "step 30 ms -> 18 ms predicted (saves 12 ms per step)" in text and "took 0.02 s" in text
    assert live.rebalance_text(DECLINED) == "after step 9: declined (re-solve failed: no LP)"
    table = live.rebalance_html(job_lines())
    assert table.count("<tr") == 3 and "<b>re-balanced</b>" in table and "declined" in table
    assert "0.1 / 0.02</td>" in table  # the reshard estimate / what it took (s)
    assert "no re-balance decision yet" in live.rebalance_html(job_lines(telemetry=False))
    line = live.windows(job_lines())[0]
    assert live.telemetry_text(line) == (
        "step 1: compute 10 / 10 / 30 ms, blocked in collectives 22 / 22 / 2 ms per rank; "
        "time against the plan 1.00 / 1.00 / 3.00x"
    )


def test_chart_draws_each_rank_the_iteration_and_the_decisions():
    lines = job_lines()
    col = live.live_chart(lines, steps=16)
    top, inner = col.children
    k = 1e3  # milliseconds: the steps after the first are tens of ms
    rows = live.live_rows(lines)
    for r in range(3):
        assert renderer(top, f"step rank {r}")["y"] == pytest.approx([t * k for t in rows[r]["step_s"]])
        assert renderer(inner, f"compute rank {r}")["y"] == pytest.approx(
            [t * k for t in rows[r]["compute_s"]]
        )
        assert renderer(inner, f"blocked rank {r}")["y"] == pytest.approx([t * k for t in rows[r]["comm_s"]])
    assert renderer(top, "iteration")["y"] == pytest.approx([t * k for t in live.iteration_times(lines)[1]])
    done, declined = renderer(top, "decision re-balanced"), renderer(top, "decision declined")
    assert done["x"] == [5.5] and declined["x"] == [9.5]  # decided at the end of the step
    assert done["before"] == ["0.333/0.333/0.333"] and done["after"] == ["0.430/0.430/0.140"]
    assert declined["after"] == ["(unchanged)"] and renderer(inner, "decision2 re-balanced")["x"] == [5.5]
    predicted = renderer(top, "predicted")
    assert predicted["x"][0] == 5.5 and predicted["y"] == pytest.approx([18.0, 18.0])
    assert inner.x_range is top.x_range and top.x_range.end == 15.5  # the steps asked for
    # the warm-up step runs off the top: the axis fits the steps after it
    assert top.y_range.end == pytest.approx(max(live.iteration_times(lines)[1][1:]) * k * 1.08)
    for fig in (top, inner):  # legends beside the data, not over it
        assert fig.legend and all(lg not in fig.center for lg in fig.legend)
    assert "ratios 0.333/0.333/0.333 -> 0.430/0.430/0.140; 1 declined" in top.title.text


def test_chart_without_telemetry_and_with_a_baseline():
    plain = job_lines(telemetry=False)
    col = live.live_chart(plain, baseline=[dict(m, step_s=m["step_s"] * 2) for m in plain if "step_s" in m])
    (fig,) = col.children  # no compute or blocked time without telemetry
    assert not [r for r in fig.renderers if (r.name or "").startswith("decision")]
    base = renderer(fig, "baseline")["y"]
    assert base == pytest.approx([2 * y for y in renderer(fig, "iteration")["y"]])
    assert fig.x_range.end == 11.5
    empty = live.live_chart([])
    assert empty.children[0].title.text.startswith("waiting")


def test_page_and_frame_are_self_contained():
    lines = job_lines()
    page = live.live_chart_html(lines, steps=12)
    assert page.startswith("<!DOCTYPE html>") and "Bokeh" in page
    assert not re.search(r"<script[^>]*\ssrc=", page)  # BokehJS inline: no CDN
    assert "after step 5: re-balanced" in page and "after step 9: declined" in page
    frame = live.live_frame(lines, steps=12)
    assert frame.startswith("<iframe srcdoc=") and "sandbox='allow-scripts'" in frame
    assert live.live_frame([]) == "<div>waiting for the first step...</div>"


def test_launch_table_lists_step_lines_only():
    from hapnb.display import launch_html
    from hapnb.run.launch import JobState

    lines = [m for m in job_lines() if "phase" not in m]  # the Job keeps heartbeats out of its metrics
    page = launch_html(JobState(True, tuple(lines), (), 12, 0.01))
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>([^<]*)</td>", page)
    assert len(rows) == 30 and all(loss for _, _, loss in rows)  # the last 30 step lines, no event line
    assert rows[-1][:2] == ("2", "11")
