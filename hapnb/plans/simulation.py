"""Simulate: a plan's iteration as a timeline of spans per device and stream (Proteus-style).

Two modes (:func:`simulate`):

* **Stage-synchronous** (``overlap=False``): the cost model's stage model laid out in time. Stage by
  stage, the stage's communication (every term of its instructions, forward then backward part, all
  devices), then each device computes its instructions (forward then backward part of each), and the next
  stage starts when the slowest device is done; the optimizer step runs in the last stage, as the cost
  model charges it. ``iteration_s`` equals ``plan.cost_s``.
* **Overlap** (``overlap=True``): a discrete-event run of forward, backward and optimizer step over the
  program's dependencies, in a fluid model (every running task progresses at a rate; the next event is
  the first task to finish). Three streams per device, as Proteus' executor has: ``compute``,
  ``feature-comm`` and ``gradient-comm``; each runs its tasks one at a time in issue order.

  - Forward: the compute steps in program order, each its forward share :data:`FORWARD_FRACTION` of the
    step's computation (the rules count backward = 2x forward). A feature collective is issued once its
    input is produced on every device (HAP's collectives span all devices) and blocks only the step that
    consumes it (the step it is fused in front of).
  - Backward: the steps in reverse order; a collective's backward runs after its consumer's backward and
    before its producer's; an SFB step's gathers run before the step's backward.
  - Gradients of replicated parameters are all-reduced on the gradient-comm stream in DDP buckets
    (:func:`hapnb.cost.model.ddp_buckets`; ready in reverse order of first use), a bucket once every device
    has all its gradients; a bucket costs the cluster's ``all_reduce`` ``latency + bytes/bandwidth``.
    Each device's optimizer step runs after the last bucket.
  - Comp-comm overlap (Proteus' overlap factor γ): a compute task runs at ``1/(1+γ)`` while any
    collective runs (every collective spans every device). γ: ``slowdown=`` if given, else the device
    model's ``overlap_slowdown``, else :data:`DEFAULT_OVERLAP_SLOWDOWN`.
  - Bandwidth sharing (``bandwidth_sharing=True``): every HAP collective spans every device, so any two
    running collectives cross the same links (each machine's NIC when the cluster has several machines,
    the machine's NVLink/PCIe fabric when it has one): ``k`` running collectives each progress at
    ``1/k`` (Proteus' fair share). Without it, feature and gradient collectives run side by side at full
    speed.
  - Duplex plans (HiDup, ``plan.duplex``): two micro-batches, each with half of every step's
    computation and half of every feature collective, interleaved per step on each stream (mb 0 step i,
    mb 1 step i, ...); gradients all-reduced once per iteration, one optimizer step.

Memory per device (``Timeline.memory``, (time, bytes) points at task boundaries): the plan's
persistent bytes (parameters, gradients, optimizer states, inputs, overhead of ``memory_breakdown``),
activations allocated in equal shares as each step's forward ends (the plan keeps no per-step split)
and freed as its backward ends (stage-synchronous: at the end of the iteration), the breakdown's
transient during every backward and optimizer task. The peak equals the plan's ``memory_bytes``.

>>> Span("v100-0", "compute", 0.0, 1e-3, 3, "forward").duration_s
0.001
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..cost.model import ddp_buckets
from ..hardware.cluster import Cluster
from ..ir.collective_table import COLLECTIVES
from .plan import CommCost, Plan

__all__ = [
    "Span",
    "Segment",
    "iteration_time",
    "iteration_lower_bound",
    "plan_lower_bound",
    "Timeline",
    "simulate",
    "STREAMS",
    "PHASES",
    "FORWARD_FRACTION",
    "DEFAULT_OVERLAP_SLOWDOWN",
    "SPAN_FIELDS",
]

#: The streams of a device: computation, feature collectives, gradient all-reduces (Proteus' queues).
STREAMS = ("compute", "feature-comm", "gradient-comm")
PHASES = ("forward", "backward", "optimizer")
#: The forward's share of a step's computation: the rules charge forward + backward as 3x the forward
#: flops (backward = 2x forward), so the forward is a third.
FORWARD_FRACTION = 1.0 / 3.0
#: Proteus' overlap factor γ: a computation slows by ``1 + γ`` while a collective runs beside it (the
#: collective's kernels take SMs and memory bandwidth). Proteus profiles γ per machine and model (the
#: backward pass of data-parallel training with and without overlap) and publishes no single value; 0.1
#: (10 %) is our default for a GPU running NCCL until ``hapnb profile`` measures the local device
#: (``DeviceModel.overlap_slowdown``).
DEFAULT_OVERLAP_SLOWDOWN = 0.1
#: The order of a span's fields in the JSON (``"spans"``: one compact list per span).
SPAN_FIELDS = ("device", "stream", "start_s", "end_s", "instruction", "phase", "micro_batch", "what")

_EPS = 1e-12


@dataclass(frozen=True)
class Span:
    """One task on one stream of one device: ``instruction`` indexes ``plan.program`` (-1: none, e.g. a
    gradient bucket of several loads or a stage of a plan without per-instruction costs)."""

    device: str
    stream: str  # one of STREAMS
    start_s: float
    end_s: float
    instruction: int
    phase: str  # one of PHASES
    micro_batch: int = 0
    what: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> list[Any]:
        return [getattr(self, f) for f in SPAN_FIELDS]

    @staticmethod
    def from_json(row: Sequence[Any]) -> Span:
        d, s, a, b, i, p, m, w = row
        return Span(str(d), str(s), float(a), float(b), int(i), str(p), int(m), str(w))


@dataclass(frozen=True)
class Segment:
    """The per-stage view of a device's time (``comm`` / ``comp`` / ``idle``), kept for older readers:
    stage-synchronous timelines have one per stage and kind; overlap timelines one per span (``comm`` may
    then overlap ``comp``) and ``idle`` for the gaps of the compute stream."""

    device: str
    stage: int
    kind: str  # "comm" | "comp" | "idle"
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """A simulated iteration: spans per device and stream, memory over time, peak memory and OOM flags."""

    plan_name: str
    devices: tuple[str, ...]
    segments: tuple[Segment, ...]
    iteration_s: float
    peak_memory_bytes: tuple[int, ...]
    memory_capacity_bytes: tuple[int, ...]
    spans: tuple[Span, ...] = ()
    #: per device: (time, bytes) points, a step function (the value holds until the next point)
    memory: tuple[tuple[tuple[float, int], ...], ...] = ()
    overlap: bool = False
    bandwidth_sharing: bool = False
    slowdown: tuple[float, ...] = ()  # γ per device (overlap mode)
    duplex: bool = False

    @property
    def oom(self) -> tuple[bool, ...]:
        return tuple(m > c for m, c in zip(self.peak_memory_bytes, self.memory_capacity_bytes))

    def busy_fraction(self) -> dict[str, float]:
        """Fraction of the iteration each device's compute stream is busy."""
        out = {d: 0.0 for d in self.devices}
        for s in self.spans:
            if s.stream == "compute":
                out[s.device] += s.duration_s
        return {d: v / self.iteration_s if self.iteration_s else 0.0 for d, v in out.items()}

    def spans_of(self, device: str, stream: str | None = None) -> tuple[Span, ...]:
        """The spans of one device (and stream), by start time."""
        got = [s for s in self.spans if s.device == device and (stream is None or s.stream == stream)]
        return tuple(sorted(got, key=lambda s: (s.start_s, s.end_s)))

    def to_json(self) -> dict[str, Any]:
        """``iteration_s``, ``devices`` [{name, peak_memory_bytes, capacity_bytes, oom, busy_fraction,
        memory: [[t, bytes], ...]}], ``mode`` ("overlap" | "stage"), ``bandwidth_sharing``, ``duplex``,
        ``slowdown`` (γ per device), ``span_fields`` (:data:`SPAN_FIELDS`) and ``spans`` (one list per
        span in that order)."""
        busy = self.busy_fraction()
        mem = self.memory or ((),) * len(self.devices)
        return {
            "iteration_s": self.iteration_s,
            "mode": "overlap" if self.overlap else "stage",
            "bandwidth_sharing": self.bandwidth_sharing,
            "duplex": self.duplex,
            "slowdown": list(self.slowdown),
            "devices": [
                {
                    "name": d,
                    "peak_memory_bytes": m,
                    "capacity_bytes": c,
                    "oom": m > c,
                    "busy_fraction": busy[d],
                    "memory": [[t, b] for t, b in pts],
                }
                for d, m, c, pts in zip(self.devices, self.peak_memory_bytes, self.memory_capacity_bytes, mem)
            ],
            "span_fields": list(SPAN_FIELDS),
            "spans": [s.to_json() for s in self.spans],
        }

    def gantt(self, **kw: Any) -> Any:
        """A bokeh Gantt chart of the spans: a lane per device with a sub-lane per stream (needs bokeh)."""
        from ..display import charts

        return charts.timeline_gantt(self, **kw)

    def memory_chart(self, **kw: Any) -> Any:
        """A bokeh line chart of each device's memory over the iteration (needs bokeh)."""
        from ..display import charts

        return charts.memory_chart(self, **kw)

    def __str__(self) -> str:
        busy = self.busy_fraction()
        mode = "overlap" if self.overlap else "stage-synchronous"
        lines = [f"Timeline of {self.plan_name} ({mode}): {self.iteration_s * 1e3:.3f} ms per iteration"]
        for d, m, c in zip(self.devices, self.peak_memory_bytes, self.memory_capacity_bytes):
            lines.append(
                f"  {d:10s} busy {busy[d] * 100:5.1f}%  memory {m / 2**30:7.2f} / {c / 2**30:.1f} GiB"
                + ("  OUT OF MEMORY" if m > c else "")
            )
        return "\n".join(lines)


# ============================================================================================ pricing


def _kinds(kind: str, n: int, on_compute: bool) -> tuple[tuple[str, int], tuple[str, int]]:
    """The collective kinds and launches of a term's forward and backward part (cost/model.py's pricing)."""
    if on_compute:  # SFB: all-gathers of the input and the output gradient
        return ("all_gather", 1), ("all_gather", 1)
    spec = COLLECTIVES.get(kind)
    if spec is None or spec.forward is None:  # a gradient all-reduce, a ZeRO gather: one kind both ways
        return (kind, 1), (kind, 1)
    launches = n if spec.launches_per_device else 1
    return (spec.forward, launches), (spec.backward or spec.forward, launches)


def _reprice_time(t: float, kind: str, launches: int, old: Cluster, new: Cluster) -> float:
    if t <= 0:
        return t
    a, b = old.collective(kind), new.collective(kind)
    return launches * b.latency_s + max(0.0, t - launches * a.latency_s) * a.bandwidth_Bps / b.bandwidth_Bps


@dataclass(frozen=True)
class _Costs:
    """Per-instruction costs of a plan on the cluster simulated."""

    comp: tuple[tuple[float, ...], ...]  # per instruction, per device (empty: not compute)
    comm: tuple[tuple[CommCost, ...], ...]
    optimizer: tuple[float, ...]


def _costs(plan: Plan, cluster: Cluster) -> _Costs:
    """The plan's per-instruction costs, re-priced for ``cluster`` when it is not the plan's."""
    old = plan.cluster
    n = old.n
    comp = tuple(tuple(i.comp_s) for i in plan.program)
    comm = tuple(tuple(i.comm) for i in plan.program)
    opt = tuple(plan.optimizer_s) or (0.0,) * n
    if cluster == old:
        return _Costs(comp, comm, opt)
    scale = []
    for a, b in zip(old.devices, cluster.devices):
        if a.model != b.model or a.gpus != b.gpus:
            raise ValueError(
                f"cannot re-price the plan for cluster {cluster.name!r}: device {a.name} has a different "
                f"{'device model' if a.model != b.model else 'number of GPUs'} than in the plan's cluster "
                f"{old.name!r}; only flops-only devices' flops and the collectives can change. Synthesize a "
                "plan for that cluster instead (hapnb.synthesize(model, cluster))"
            )
        scale.append(a.flops / b.flops if a.model is None else 1.0)
    comp = tuple(tuple(x * s for x, s in zip(row, scale)) for row in comp)
    out = []
    for ins, row in zip(plan.program, comm):
        new_row = []
        for c in row:
            (kf, lf), (kb, lb) = _kinds(c.kind, n, ins.kind == "compute")
            new_row.append(
                dataclasses.replace(
                    c,
                    forward_s=_reprice_time(c.forward_s, kf, lf, old, cluster),
                    backward_s=_reprice_time(c.backward_s, kb, lb, old, cluster),
                )
            )
        out.append(tuple(new_row))
    return _Costs(comp, tuple(out), opt)


def _check_cluster(plan: Plan, cluster: Cluster | None) -> Cluster:
    if cluster is None:
        return plan.cluster
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a hapnb Cluster or None, got {type(cluster).__name__}")
    if cluster.names != plan.cluster.names:
        raise ValueError(
            f"cluster {cluster.name!r} has devices {', '.join(cluster.names)} but the plan was made for "
            f"{', '.join(plan.cluster.names)}; simulate on a cluster with the same device names (or "
            "synthesize a plan for that cluster)"
        )
    return cluster


def _slowdowns(cluster: Cluster, slowdown: float | None) -> tuple[float, ...]:
    if slowdown is not None:
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not slowdown >= 0:
            raise ValueError(f"slowdown (γ) must be a number >= 0, got {slowdown!r}")
        return (float(slowdown),) * cluster.n
    out = []
    for d in cluster.devices:
        g = getattr(d.model, "overlap_slowdown", None) if d.model is not None else None
        out.append(DEFAULT_OVERLAP_SLOWDOWN if g is None else float(g))
    return tuple(out)


# ============================================================================================ memory


def _memory_parts(plan: Plan, j: int) -> tuple[int, int, int]:
    """(persistent, activations, transient) bytes of device j from the plan's breakdown."""
    if j < len(plan.memory_breakdown):
        b = dict(plan.memory_breakdown[j])
        act, tr = int(b.get("activations", 0)), int(b.get("transient", 0))
        return sum(int(v) for v in b.values()) - act - tr, act, tr
    peak = plan.memory_bytes[j] if j < len(plan.memory_bytes) else 0
    return int(peak), 0, 0


def _shares(total: int, k: int) -> list[int]:
    """``total`` bytes in ``k`` integer shares that sum to it exactly."""
    if k <= 0:
        return []
    q, r = divmod(total, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def _memory(events: list[tuple[float, int]], base: int) -> tuple[tuple[tuple[float, int], ...], int]:
    """``events`` (time, bytes delta) in the order they happen on the device's compute stream (a stable
    sort by time keeps that order at equal times) -> ((time, bytes) after each distinct time, peak)."""
    pts = [(0.0, base)]
    cur = peak = base
    for t, delta in sorted(events, key=lambda e: e[0]):
        cur += delta
        peak = max(peak, cur)
        if pts[-1][0] == t:
            pts[-1] = (t, cur)
        else:
            pts.append((t, cur))
    return tuple(pts), peak


# ============================================================================================ simulate


def simulate(
    plan: Plan,
    cluster: Cluster | None = None,
    overlap: bool = True,
    bandwidth_sharing: bool = True,
    slowdown: float | None = None,
) -> Timeline:
    """Simulate one training iteration of ``plan`` (see the module docstring for the two modes).

    ``cluster``: None (the plan's) or a cluster with the same device names: flops-only devices are
    re-priced by their flops, collectives by their kinds' latency and bandwidth; a device whose device
    model or GPU count differs cannot be re-priced (ValueError). ``slowdown``: γ for every device
    (default: each device model's ``overlap_slowdown``, else :data:`DEFAULT_OVERLAP_SLOWDOWN`).
    ``overlap=False`` is the stage model (``bandwidth_sharing`` has nothing to share there). A plan made
    before per-instruction costs (``not plan.costed``) supports only ``overlap=False``.
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"simulate needs a hapnb Plan, got {type(plan).__name__}")
    c = _check_cluster(plan, cluster)
    caps = tuple(int(d.memory_bytes / max(1, d.gpus)) for d in c.devices)
    if not plan.costed:
        if overlap:
            raise ValueError(
                f"plan {plan.name!r} carries no per-instruction costs (made by an older hapnb), so only the "
                "stage model can be simulated: call simulate(plan, overlap=False) (hapnb simulate "
                "--no-overlap), or re-synthesize the plan"
            )
        if c != plan.cluster:
            raise ValueError(
                f"plan {plan.name!r} carries no per-instruction costs (made by an older hapnb), so it "
                "cannot be re-priced for another cluster; re-synthesize it"
            )
        return _stage_only(plan, caps)
    costs = _costs(plan, c)
    if not overlap:
        return _stage_sync(plan, costs, caps)
    return _Overlap(plan, c, costs, bandwidth_sharing, _slowdowns(c, slowdown)).run(caps)


def iteration_time(plan: Plan, slowdown: float | None = None) -> float:
    """The overlap simulation's iteration time of ``plan`` on its own cluster — ``simulate(plan).iteration_s``
    without building the timeline (spans, segments, memory over time): what :func:`hapnb.synthesize`
    ranks its candidate programs by."""
    if not isinstance(plan, Plan) or not plan.costed:
        return simulate(plan, slowdown=slowdown).iteration_s
    c = plan.cluster
    costs, gamma = _costs(plan, c), _slowdowns(c, slowdown)
    # devices with the same computation per instruction, optimizer step and slowdown run the same
    # timeline (they meet the others only in collectives, which span every device): simulate one of each
    reps: dict[Any, int] = {}
    for j in range(c.n):
        key = (tuple(row[j] if row else None for row in costs.comp), costs.optimizer[j], gamma[j])
        reps.setdefault(key, j)
    keep = list(reps.values())
    if len(keep) < c.n:
        comp = tuple(tuple(row[j] for j in keep) if row else row for row in costs.comp)
        costs = _Costs(comp, costs.comm, tuple(costs.optimizer[j] for j in keep))
        gamma = tuple(gamma[j] for j in keep)
    sim = _Overlap(plan, c, costs, True, gamma)
    sim.n = len(keep)
    sim.labels = False
    sim.build()
    return sim.loop()


def iteration_lower_bound(
    comp: Sequence[Sequence[float]],
    feature: Sequence[tuple[float, float]],
    gradient_bytes: Sequence[int],
    optimizer: Sequence[float],
    cluster: Cluster,
    duplex: bool = False,
) -> float:
    """A lower bound of :func:`iteration_time` of a plan on its own ``cluster``, from its costs alone:
    ``comp`` the per-device seconds of each compute instruction (``Instruction.comp_s``), ``feature`` each
    instruction's feature communication (forward, backward seconds: the sums of its non-gradient
    ``CommCost`` parts), ``gradient_bytes`` the bytes of each gradient all-reduce in program order and
    ``optimizer`` the optimizer step per device (``plan.optimizer_s``). :func:`hapnb.synthesize` skips the
    candidates whose bound is above the fastest simulated one (:func:`plan_lower_bound`: a plan's).

    Why it holds (the overlap simulation with bandwidth sharing, :func:`iteration_time`): the collectives
    together progress at a rate of at most 1, so they take at least their total work ``C`` (feature parts
    and the gradient buckets); a device's compute tasks run one at a time at a rate of at most 1, and at
    ``1 / (1 + γ)`` while a collective runs, so the iteration lasts at least its compute work
    ``W + C γ / (1 + γ)``; a device runs every forward before any backward, and every backward collective
    and gradient bucket waits for backwards on every device, so they all start after the slowest device's
    forward work ``S``: the iteration lasts at least ``S`` + the backward communication, and ``S`` + the
    gradient buckets + the optimizer step (which waits for the last bucket). A duplex plan's two
    micro-batches each carry half of every step's computation and feature communication. 0 when a γ is
    negative (a rate above 1 would break the bound).

    >>> from hapnb.hardware.cluster import Cluster
    >>> c = Cluster.resolve("2xV100")
    >>> round(iteration_lower_bound([(3e-3, 6e-3), (1e-3, 2e-3)], [], [], (0.0, 1e-3), c), 9)  # compute
    0.009
    >>> round(iteration_lower_bound([(3e-3, 3e-3)], [(0.0, 5e-3)], [], (0.0, 0.0), c), 9)  # fwd, then comm
    0.006
    """
    gamma = _slowdowns(cluster, None)
    if any(g < 0 for g in gamma):
        return 0.0
    k, mbs = (0.5, 2) if duplex else (1.0, 1)
    fwd = [0.0] * cluster.n
    work = [max(0.0, x) for x in optimizer] or [0.0] * cluster.n
    for j, col in enumerate(zip(*comp)):  # the simulator's forward and backward task of each micro-batch
        if min(col) >= 0:
            fwd[j] = mbs * k * FORWARD_FRACTION * sum(col)
            work[j] += mbs * k * sum(col)
        else:
            fwd[j] = sum(mbs * max(0.0, k * FORWARD_FRACTION * x) for x in col)
            work[j] += fwd[j] + sum(mbs * max(0.0, k * (1 - FORWARD_FRACTION) * x) for x in col)
    f_fwd = sum(mbs * max(0.0, k * f) for f, _ in feature)
    f_bwd = sum(mbs * max(0.0, k * b) for _, b in feature)
    ar = cluster.collective("all_reduce")
    ready = [(i, b) for i, b in reversed(list(enumerate(gradient_bytes)))]
    buckets = [sum(gradient_bytes[i] for i in bucket) for bucket in ddp_buckets(ready)]
    grad = sum(max(0.0, ar.latency_s + b / ar.bandwidth_Bps) for b in buckets)
    total = f_fwd + f_bwd + grad
    if (
        duplex and comp
    ):  # the last step's first micro-batch may start its backward gathers before the second's forward
        fwd = [f - max(0.0, k * FORWARD_FRACTION * x) for f, x in zip(fwd, comp[-1])]
    start = max(fwd, default=0.0)
    out = max(total, start + f_bwd + grad)
    if buckets:
        out = max(out, start + grad + max(max(0.0, x) for x in optimizer or (0.0,)))
    return max([out] + [w + total * g / (1 + g) for w, g in zip(work, gamma)])


def plan_lower_bound(plan: Plan) -> float:
    """:func:`iteration_lower_bound` of a costed plan (0 for one without per-instruction costs)."""
    if not plan.costed:
        return 0.0
    comp = [i.comp_s for i in plan.program if i.kind == "compute"]
    feature = [
        (
            sum(c.forward_s for c in i.comm if not c.gradient),
            sum(c.backward_s for c in i.comm if not c.gradient),
        )
        for i in plan.program
    ]
    grads = [c.nbytes for i in plan.program for c in i.comm if c.gradient]
    return iteration_lower_bound(comp, feature, grads, plan.optimizer_s, plan.cluster, plan.duplex)


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
