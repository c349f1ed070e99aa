"""The overlap simulation (``simulate(plan, overlap=True)``, :func:`~hapnb.plans.simulation.iteration_time`):
a discrete-event run of forward, backward and optimizer step over the program's dependencies in a fluid
model, on three streams per device (compute, feature-comm, gradient-comm). :meth:`_Overlap.build` makes the
task graph, :meth:`_Overlap.loop` runs it, and :meth:`_Overlap.run` turns the finished tasks into a
:class:`~.timeline.Timeline` with memory over time. The rules it follows are in the docstring of
:mod:`hapnb.plans.simulation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cost.ddp import ddp_buckets
from ..hardware.cluster import Cluster
from .plan import Plan
from .sim_costs import FORWARD_FRACTION, _Costs
from .timeline import Segment, Span, Timeline, _memory, _memory_parts, _shares

_EPS = 1e-12


@dataclass
class _Task:
    stream: tuple[Any, ...]  # ("compute", j) | ("feature-comm",) | ("gradient-comm",)
    work: float
    deps: list[int]
    instruction: int
    phase: str
    mb: int
    what: str
    start: float = -1.0
    end: float = -1.0
    left: float = 0.0


class _Overlap:
    """The discrete-event (fluid) simulation of one iteration with overlap."""

    def __init__(
        self, plan: Plan, cluster: Cluster, costs: _Costs, sharing: bool, gamma: tuple[float, ...]
    ) -> None:
        self.plan, self.cluster, self.costs = plan, cluster, costs
        self.sharing, self.gamma = sharing, gamma
        self.n = cluster.n
        self.tasks: list[_Task] = []
        self.queues: dict[tuple[Any, ...], list[int]] = {}
        self.labels = True  # the compute tasks' labels (spans' ``what``); iteration_time needs none

    def add(
        self, stream: tuple[Any, ...], work: float, deps: list[int], i: int, phase: str, mb: int, what: str
    ) -> int:
        """Queue a task on ``stream`` (streams run their tasks in the order queued); its index."""
        self.tasks.append(_Task(stream, max(0.0, work), list(deps), i, phase, mb, what))
        self.queues.setdefault(stream, []).append(len(self.tasks) - 1)
        return len(self.tasks) - 1

    # ---------------------------------------------------------------- the task graph
    def build(self) -> None:
        plan, costs, n = self.plan, self.costs, self.n
        prog = plan.program
        mbs = (0, 1) if plan.duplex else (0,)
        k = 0.5 if plan.duplex else 1.0
        steps = [i for i, ins in enumerate(prog) if ins.kind == "compute"]
        owner: dict[int, int] = {}  # non-compute instruction -> the step it is fused in front of
        owned: dict[int, list[int]] = {s: [] for s in steps}
        pending: list[int] = []
        for i, ins in enumerate(prog):
            if ins.kind == "compute":
                for p in pending:
                    owner[p] = i
                    owned[i].append(p)
                pending = []
            else:
                pending.append(i)
        # the producer of a collective's input: the latest earlier instruction defining that tensor
        producer: dict[int, int] = {}
        defined: dict[str, int] = {}
        for i, ins in enumerate(prog):
            if ins.kind == "collective":
                if ins.tensor in defined:
                    producer[i] = defined[ins.tensor]
                defined[ins.tensor] = i
            elif ins.kind == "load":
                defined.pop(ins.tensor, None)
            else:
                for t, _ in ins.outputs:
                    defined[t] = i

        feat: dict[tuple[int, str], float] = {}

        def feature(i: int, part: str) -> float:
            hit = feat.get((i, part))
            if hit is None:
                hit = feat[(i, part)] = k * sum(getattr(c, part) for c in costs.comm[i] if not c.gradient)
            return hit

        fwd: dict[tuple[int, int], list[int]] = {}  # (step, mb) -> its forward task per device
        bwd: dict[tuple[int, int], list[int]] = {}
        cf: dict[tuple[int, int], int] = {}  # (instruction, mb) -> forward collective task
        comm_of = {
            s: [p for p in owned[s] if prog[p].kind == "collective" or feature(p, "forward_s") or feature(p, "backward_s")]
            for s in steps
        }  # fmt: skip

        def produced(i: int, mb: int) -> list[int]:
            """The tasks after which instruction i's output exists on every device (forward)."""
            if prog[i].kind == "compute":
                return list(fwd[(i, mb)])
            return [cf[(i, mb)]] if (i, mb) in cf else []

        before: int | None = None  # the step before s
        for s in steps:
            for mb in mbs:
                for p in comm_of[s]:
                    deps = produced(producer[p], mb) if p in producer else []
                    cf[(p, mb)] = self.add(("feature-comm",), feature(p, "forward_s"), deps, p, "forward", mb, prog[p].name + " " + prog[p].tensor)  # fmt: skip
                if feature(s, "forward_s") > 0:  # an SFB step's forward part (the cost model has none)
                    prev = list(fwd[(before, mb)]) if before is not None else []  # the last step's forwards
                    cf[(s, mb)] = self.add(
                        ("feature-comm",), feature(s, "forward_s"), prev, s, "forward", mb, "sfb"
                    )
            for mb in mbs:
                deps = [cf[(p, mb)] for p in comm_of[s]] + ([cf[(s, mb)]] if (s, mb) in cf else [])
                what = str(prog[s]) if self.labels else ""
                fwd[(s, mb)] = [
                    self.add(
                        ("compute", j), k * FORWARD_FRACTION * costs.comp[s][j], deps, s, "forward", mb, what
                    )
                    for j in range(n)
                ]
            before = s
        # backward: reverse order; SFB gathers before the step's backward, collectives after it
        cb: dict[tuple[int, int], int] = {}
        block: dict[tuple[int, int], list[int]] = {}  # (instruction, mb) -> tasks its backward waits for
        for si in range(len(steps) - 1, -1, -1):
            s = steps[si]
            for mb in mbs:
                if feature(s, "backward_s") > 0:
                    nxt = list(bwd[(steps[si + 1], mb)]) if si + 1 < len(steps) else list(fwd[(s, mb)])
                    t = self.add(("feature-comm",), feature(s, "backward_s"), nxt, s, "backward", mb, "sfb gathers")  # fmt: skip
                    block.setdefault((s, mb), []).append(t)
            for mb in mbs:
                what = str(prog[s]) if self.labels else ""
                deps = block.get((s, mb), [])
                work = [k * (1 - FORWARD_FRACTION) * x for x in costs.comp[s]]
                bwd[(s, mb)] = [
                    self.add(("compute", j), work[j], deps, s, "backward", mb, what) for j in range(n)
                ]
            for mb in mbs:
                for p in reversed(comm_of[s]):
                    deps = list(bwd[(s, mb)]) + block.get((p, mb), [])
                    cb[(p, mb)] = t = self.add(("feature-comm",), feature(p, "backward_s"), deps, p, "backward", mb, prog[p].name + " " + prog[p].tensor)  # fmt: skip
                    if p in producer:
                        block.setdefault((producer[p], mb), []).append(t)
        # gradient buckets, in the order the gradients become ready (reverse order of first use)
        grads = [(i, c) for i in range(len(prog)) for c in costs.comm[i] if c.gradient]
        ready = [((i, c), c.nbytes) for i, c in reversed(grads)]
        ar = self.cluster.collective("all_reduce")
        last_bucket: list[int] = []
        for bucket in ddp_buckets(ready):
            deps = sorted({t for (i, _) in bucket for mb in mbs for t in bwd[(owner.get(i, i), mb)]})
            nbytes = sum(c.nbytes for _, c in bucket)
            names = ", ".join(prog[i].tensor for i, _ in bucket)
            ins = bucket[0][0] if len(bucket) == 1 else -1
            last_bucket = [self.add(("gradient-comm",), ar.latency_s + nbytes / ar.bandwidth_Bps, deps, ins, "backward", 0, f"grad all_reduce bucket ({nbytes} B): {names}")]  # fmt: skip
        for j in range(n):
            self.add(("compute", j), costs.optimizer[j], last_bucket, -1, "optimizer", 0, "optimizer step")
        self.steps, self.fwd, self.bwd = steps, fwd, bwd

    # ---------------------------------------------------------------- the event loop
    def loop(self) -> float:
        tasks = self.tasks
        heads = {s: 0 for s in self.queues}
        busy: dict[tuple[Any, ...], int] = {}
        finished = 0
        t = 0.0
        waiting = [len(x.deps) for x in tasks]  # per task: its dependencies not finished yet
        dependents: list[list[int]] = [[] for _ in tasks]
        for i, x in enumerate(tasks):
            x.left = x.work
            for d in x.deps:
                dependents[d].append(i)

        def done(i: int) -> None:
            for k in dependents[i]:
                waiting[k] -= 1

        while finished < len(tasks):
            progressed = True
            while progressed:  # start every task that can start now (zero-work tasks finish at once)
                progressed = False
                for s, q in self.queues.items():
                    if s in busy or heads[s] >= len(q):
                        continue
                    i = q[heads[s]]
                    if not waiting[i]:
                        x = tasks[i]
                        x.start = t
                        heads[s] += 1
                        progressed = True
                        if x.left <= 0:
                            x.end = t
                            finished += 1
                            done(i)
                        else:
                            busy[s] = i
            if not busy:
                if finished < len(tasks):
                    raise RuntimeError("simulation deadlocked (a dependency cycle in the task graph)")
                break
            comms = [i for s, i in busy.items() if s[0] != "compute"]
            share = 1.0 / len(comms) if comms and self.sharing else 1.0
            rates = {}
            for s, i in busy.items():
                if s[0] == "compute":
                    rates[i] = 1.0 / (1.0 + self.gamma[s[1]]) if comms else 1.0
                else:
                    rates[i] = share
            dt = min(tasks[i].left / r for i, r in rates.items())
            t += dt
            for s, i in list(busy.items()):
                x = tasks[i]
                if x.left / rates[i] <= dt * (1 + _EPS) + 1e-300:
                    x.left = 0.0
                    x.end = t
                    finished += 1
                    done(i)
                    del busy[s]
                else:
                    x.left -= rates[i] * dt
        return max((x.end for x in tasks), default=0.0)

    def run(self, caps: tuple[int, ...]) -> Timeline:
        self.build()
        end = self.loop()
        plan, n = self.plan, self.n
        names = plan.cluster.names
        spans: list[Span] = []
        for x in self.tasks:
            if x.end <= x.start:
                continue
            kind = x.stream[0]
            devs = [names[x.stream[1]]] if kind == "compute" else names
            for d in devs:
                spans.append(Span(d, kind, x.start, x.end, x.instruction, x.phase, x.mb, x.what))
        spans.sort(key=lambda s: (s.start_s, s.end_s))
        # memory: activations as forwards end, freed as backwards end; transient in backward and optimizer
        mbs = (0, 1) if plan.duplex else (0,)
        mems, peaks, segs = [], [], []
        for j in range(n):
            base, act, tr = _memory_parts(plan, j)
            per_step = _shares(act, len(self.steps))
            saved: dict[int, int] = {}  # task -> activation bytes its forward saves (its backward frees)
            for k, s in enumerate(self.steps):
                for mb, a in zip(mbs, _shares(per_step[k], len(mbs))):
                    saved[self.fwd[(s, mb)][j]] = a
                    saved[self.bwd[(s, mb)][j]] = a
            ev: list[tuple[float, int]] = []
            for i in self.queues[("compute", j)]:  # in the order the device runs them
                x = self.tasks[i]
                if x.phase == "forward":
                    ev.append((x.end, saved[i]))
                else:
                    ev += [(x.start, tr), (x.end, -tr - saved.get(i, 0))]
            pts, peak = _memory(ev, base)
            mems.append(pts)
            peaks.append(peak)
        stage = {i: ins.stage for i, ins in enumerate(plan.program)}
        by_device: dict[str, list[Span]] = {d: [] for d in names}
        for s in spans:
            by_device[s.device].append(s)
        for d in names:
            own = by_device[d]
            comp = sorted((s for s in own if s.stream == "compute"), key=lambda s: s.start_s)
            for s in own:
                segs.append(Segment(d, stage.get(s.instruction, -1), "comp" if s.stream == "compute" else "comm", s.start_s, s.end_s))  # fmt: skip
            t = 0.0
            for s in comp:
                if s.start_s > t:
                    segs.append(Segment(d, stage.get(s.instruction, -1), "idle", t, s.start_s))
                t = max(t, s.end_s)
        return Timeline(
            plan.name,
            names,
            tuple(segs),
            end,
            tuple(peaks),
            caps,
            tuple(spans),
            tuple(mems),
            True,
            self.sharing,
            self.gamma,
            plan.duplex,
        )
