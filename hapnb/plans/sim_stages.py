"""The stage-synchronous simulation (``simulate(plan, overlap=False)``): the cost model's stage model laid
out in time. Stage by stage, the stage's communication (every term of its instructions, forward then
backward part, all devices), then each device computes its instructions (forward then backward part of
each), and the next stage starts when the slowest device is done; the optimizer step runs in the last
stage, as the cost model charges it, and activations are freed at the end of the iteration.
"""

from __future__ import annotations

from .plan import Plan
from .sim_costs import FORWARD_FRACTION, _Costs
from .timeline import Segment, Span, Timeline, _memory, _memory_parts, _shares


def _stage_only(plan: Plan, caps: tuple[int, ...]) -> Timeline:
    """A plan without per-instruction costs: its stages as one communication and one computation span."""
    names = plan.cluster.names
    spans: list[Span] = []
    segs: list[Segment] = []
    t = 0.0
    for st in plan.stages:
        end_comm = t + st.comm_s
        stage_end = end_comm + (max(st.comp_s) if st.comp_s else 0.0)
        for j, d in enumerate(names):
            if st.comm_s > 0:
                what = "; ".join(st.comm) or f"stage {st.index} communication"
                spans.append(Span(d, "feature-comm", t, end_comm, -1, "forward", 0, what))
                segs.append(Segment(d, st.index, "comm", t, end_comm))
            x = st.comp_s[j] if j < len(st.comp_s) else 0.0
            if x > 0:
                spans.append(
                    Span(d, "compute", end_comm, end_comm + x, -1, "forward", 0, f"stage {st.index}")
                )
                segs.append(Segment(d, st.index, "comp", end_comm, end_comm + x))
            if end_comm + x < stage_end:
                segs.append(Segment(d, st.index, "idle", end_comm + x, stage_end))
        t = stage_end
    mem = tuple(plan.memory_bytes) or (0,) * len(names)
    return Timeline(
        plan.name, names, tuple(segs), t, mem, caps, tuple(spans), tuple(((0.0, m), (t, m)) for m in mem)
    )


def _stage_sync(plan: Plan, costs: _Costs, caps: tuple[int, ...]) -> Timeline:
    """The stage model in time: per stage its communication, then every device's computation."""
    names = plan.cluster.names
    n = len(names)
    spans: list[Span] = []
    segs: list[Segment] = []
    mem_events: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    parts = [_memory_parts(plan, j) for j in range(n)]
    computes = [i for i, ins in enumerate(plan.program) if ins.kind == "compute"]
    act = [_shares(parts[j][1], len(computes)) for j in range(n)]
    act_of = {i: k for k, i in enumerate(computes)}
    last = plan.stages[-1].index if plan.stages else 0
    t = 0.0
    dev_end = [0.0] * n
    for st in plan.stages:
        c0 = t
        for i in st.instructions:
            for cc in costs.comm[i]:
                stream = "gradient-comm" if cc.gradient else "feature-comm"
                for phase, dur in (("forward", cc.forward_s), ("backward", cc.backward_s)):
                    if dur > 0:
                        for d in names:
                            spans.append(Span(d, stream, c0, c0 + dur, i, phase, 0, cc.what))
                        c0 += dur
        comm_end = c0
        totals = []
        for j, d in enumerate(names):
            tj = comm_end
            for i in st.instructions:
                x = costs.comp[i][j] if costs.comp[i] else 0.0
                if plan.program[i].kind != "compute":
                    continue
                f = x * FORWARD_FRACTION
                what = str(plan.program[i])
                if f > 0:
                    spans.append(Span(d, "compute", tj, tj + f, i, "forward", 0, what))
                mem_events[j].append((tj + f, act[j][act_of[i]]))
                if x - f > 0:
                    spans.append(Span(d, "compute", tj + f, tj + x, i, "backward", 0, what))
                mem_events[j] += [(tj + f, parts[j][2]), (tj + x, -parts[j][2])]
                tj += x
            if st.index == last and costs.optimizer[j] > 0:
                o = costs.optimizer[j]
                spans.append(Span(d, "compute", tj, tj + o, -1, "optimizer", 0, "optimizer step"))
                mem_events[j] += [(tj, parts[j][2]), (tj + o, -parts[j][2])]
                tj += o
            totals.append(tj - comm_end)
            dev_end[j] = tj
        stage_end = comm_end + (max(totals) if totals else 0.0)
        for j, d in enumerate(names):
            if comm_end > t:
                segs.append(Segment(d, st.index, "comm", t, comm_end))
            if totals[j] > 0:
                segs.append(Segment(d, st.index, "comp", comm_end, comm_end + totals[j]))
            if comm_end + totals[j] < stage_end:
                segs.append(Segment(d, st.index, "idle", comm_end + totals[j], stage_end))
        t = stage_end
    mems, peaks = [], []
    for j in range(n):
        ev = mem_events[j] + [(dev_end[j], -parts[j][1])]  # the stage model frees activations at the end
        pts, peak = _memory(ev, parts[j][0])
        mems.append(pts)
        peaks.append(peak)
    return Timeline(
        plan.name, names, tuple(segs), t, tuple(peaks), caps, tuple(spans), tuple(mems), duplex=plan.duplex
    )
