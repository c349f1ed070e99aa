"""The pipeline time and memory model every planner shares (Ditto §3 / Oobleck §4.1.2, made exact for
uneven stages), the device classes of a cluster, and the Pareto labels the searches keep.

A pipeline has stages ``k = 0..S-1``; stage k runs units ``[a_k, b_k)`` data parallel on its devices
(each device gets an integer number of the micro-batch's samples; gradients summed over the stage's
devices once per iteration). Per micro-batch, stage k takes

* ``F_k`` = the slowest device's forward on its samples, ``B_k`` = its backward;
* once per iteration ``A_k`` = the stage's gradient all-reduce (each parameter tensor as the cluster's
  ``all_reduce``, exactly as HAP's stage model prices a replicated parameter, :meth:`CostModel.load_terms`;
  none for a one-device stage) + the optimizer step (device-model devices, :meth:`CostModel.optimizer_linear`).

Between stage k and k+1 the activations of cut ``b_k`` travel forward and their gradient backward, each
a point-to-point transfer ``P_k`` priced as one launch of the cluster's ``broadcast`` collective (the
boundary bytes of one micro-batch). Sends are asynchronous (``torch.distributed.pipelining`` posts
``isend``/``irecv``), so a boundary is a pipeline stage of its own with ``F = B = P_k``, not time added
to its neighbours. Over stages and boundaries ``j``, with ``N`` micro-batches the iteration takes
``T = T1 + T2 + T3``:

* ``T1 = sum_j (F_j + B_j)`` — filling and draining the pipeline (one micro-batch through every stage
  and back; Oobleck's/Ditto's T1);
* ``T2`` — the steady state, paced by the slowest stage ``k*``: ``(N - 1) * max_j (F_j + B_j)`` under
  1F1B, ``(N - 1) * (max_j F_j + max_j B_j)`` under GPipe (all forwards, then all backwards);
* ``T3 = max_k A_k`` — the tail: gradient synchronisation and optimizer step after the last backward.

For equal stages this is exactly the schedule's makespan; for uneven ones ``T1 + T2`` is the makespan
of a flow shop of identical jobs (exact for GPipe's two phases, an upper bound for 1F1B:
:func:`schedule_makespan` simulates the schedules and tests compare). Ditto's eq. (2)-(3) split the same
quantity differently (a steady state of ``N - S + k* - 1`` micro-batches plus a T3 over the stages after
``k*``), which undercounts when the slowest stage comes early; docs/benchmarks/pipelines.md shows the case.

Memory per stage device (bytes; parameters, gradients and Adam's two states of the stage's units, the
activations of the micro-batches in flight at its share, the backward's transient, or the optimizer
step's parameter-sized temporary, plus the device model's allocator overhead) must fit the device: under
1F1B stage k keeps ``min(N, S - k)`` micro-batches in flight, under GPipe all ``N``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..hardware.cluster import Cluster
from ..hardware.devices import DeviceModel
from ..hardware.parts import Device
from .costs import LayerCosts, kind_keys

__all__ = [
    "DeviceClass",
    "device_classes",
    "StageCost",
    "Pricer",
    "Label",
    "ROOT",
    "Frontier",
    "stages_of",
    "schedule_events",
    "schedule_makespan",
]


@dataclass(frozen=True)
class DeviceClass:
    """One device type of the cluster (Ditto's ``device_i``): its devices, GPUs per machine (``per_node``,
    Ditto's M) and memory per GPU."""

    kind: str
    devices: tuple[str, ...]
    per_node: int
    memory_bytes: int
    model: DeviceModel | None = None

    @property
    def count(self) -> int:
        return len(self.devices)


def device_classes(cluster: Cluster, costs: LayerCosts | None = None) -> tuple[DeviceClass, ...]:
    """The cluster's device classes, weakest first (most time for the model per ``costs``, else least
    flops), ties by name."""
    groups: dict[str, list[Device]] = {}
    for d, key in zip(cluster.devices, kind_keys(cluster)):
        if d.gpus != 1:
            raise ValueError(
                f"device {d.name} stands for {d.gpus} GPUs; pipeline plans place stages on single GPUs: "
                "use the cluster with one device per GPU (not Cluster.virtual())"
            )
        groups.setdefault(key, []).append(d)
    out = []
    for k, ds in groups.items():
        per_machine: dict[str, int] = {}
        for d in ds:
            per_machine[d.machine] = per_machine.get(d.machine, 0) + 1
        out.append(
            DeviceClass(
                kind=k,
                devices=tuple(d.name for d in ds),
                per_node=max(per_machine.values()),
                memory_bytes=min(d.memory_bytes for d in ds),
                model=ds[0].model,
            )
        )
    flops = {k: min(d.flops for d in ds) for k, ds in groups.items()}
    if costs is not None:
        out.sort(key=lambda c: (-costs.total_time(c.kind), c.kind))
    else:
        out.sort(key=lambda c: (flops[c.kind], c.kind))
    return tuple(out)


@dataclass(frozen=True)
class StageCost:
    """One stage's per-micro-batch forward ``F`` and backward ``B`` (seconds), the transfer ``link`` across
    its last cut, its once-per-iteration tail ``A``, the samples each of its devices runs (per class, in
    ``counts`` order), its memory per device and how many micro-batches it can keep in flight."""

    F: float
    B: float
    A: float
    samples: tuple[tuple[int, ...], ...]  # per class: samples of each of its devices in this stage
    max_inflight: int
    #: per device (samples order): bytes with no micro-batch in flight, and per micro-batch in flight
    memory: tuple[tuple[float, float], ...]
    compute: float = 0.0  # F + B (grows with every unit added)
    link: float = 0.0  # the transfer across the stage's last cut to the next stage (0 for the last stage)


#: A search label: (sum of F+B over stages and boundaries, max F+B (1F1B) or max F (GPipe), 0 or max B,
#: max A, stages so far, the label it extends, this stage's descriptor).
Label = tuple
#: The label of the empty pipeline (searches start from it and build right to left).
ROOT: Label = (0.0, 0.0, 0.0, 0.0, 0, None, None)


class Pricer:
    """Prices stages for one model, cluster, micro-batch count and schedule (see the module docstring),
    with a cache: ``stage(a, b, counts)`` for units ``[a, b)`` on ``counts[i]`` devices of class ``i``."""

    def __init__(
        self,
        costs: LayerCosts,
        cluster: Cluster,
        micro_batches: int,
        schedule: str = "1F1B",
        boundaries: bool = True,
        memory: bool = True,
    ) -> None:
        if schedule not in ("1F1B", "GPipe"):
            raise ValueError(f"schedule {schedule!r} is not 1F1B or GPipe")
        self.costs = costs
        self.cluster = cluster
        self.N = micro_batches
        self.schedule = schedule
        self.b = costs.micro_batch
        self.L = len(costs)
        self.classes = device_classes(cluster, costs)
        self.p2p = cluster.collective("broadcast")
        self.ar = cluster.collective("all_reduce")
        self._cache: dict[tuple[int, int, tuple[int, ...]], StageCost | None] = {}
        # for lower bounds: the units' work on the weakest class (the share-proportional part) and each
        # class's largest speed-up over the weakest on any unit
        weak = self.classes[0].kind
        self.work = [0.0]
        for u in costs.units:
            self.work.append(self.work[-1] + u.forward[weak][1] + u.backward[weak][1])
        self.speedup = []
        for c in self.classes:
            best = 1.0 if c.kind == weak else 0.0
            for u in costs.units:
                w = u.forward[weak][1] + u.backward[weak][1]
                x = u.forward[c.kind][1] + u.backward[c.kind][1]
                if w > 0:
                    best = max(best, w / x if x > 0 else math.inf)
            self.speedup.append(best)
        self._bytes = [u.boundary_bytes for u in costs.units] + [0]
        #: whether stage boundaries are priced (templates are not: Oobleck's generator, and so Ditto's
        #: virtual templates, leave communication between nodes out)
        self.boundaries = boundaries
        #: whether stages must fit in memory (virtual templates need not: they never run, and Ditto's
        #: folding and template ignore memory; the recoveries check it on the real devices)
        self.memory = memory

    def for_templates(self) -> Pricer:
        """The pricer of virtual templates: no boundary transfers (Oobleck's generator, and so Ditto's
        templates, leave communication between nodes out) and no memory limit."""
        return Pricer(self.costs, self.cluster, self.N, self.schedule, boundaries=False, memory=False)

    # -------------------------------------------------------------------------------- stages
    def boundary_s(self, cut: int) -> float:
        """Seconds to move the activations (or their gradients) across cut ``cut`` for one micro-batch."""
        if not self.boundaries or cut <= 0 or cut >= self.L or self._bytes[cut] == 0:
            return 0.0
        return self.p2p.time(self._bytes[cut])

    def stage(self, a: int, b: int, counts: Sequence[int]) -> StageCost | None:
        key = (a, b, tuple(counts))
        if key in self._cache:
            return self._cache[key]
        out = self._price(a, b, tuple(counts))
        self._cache[key] = out
        return out

    def _price(self, a: int, b: int, counts: tuple[int, ...]) -> StageCost | None:
        n = sum(counts)
        if n < 1 or n > self.b or not 0 <= a < b <= self.L:
            return None  # every device needs at least one sample of the micro-batch
        lc = self.costs
        spans = [lc.span_time(c.kind, a, b) if x else None for c, x in zip(self.classes, counts)]
        # integer split of the micro-batch: each sample to the device that finishes it first
        devs = [(i, spans[i]) for i, x in enumerate(counts) for _ in range(x)]
        got = [1] * n
        for _ in range(self.b - n):
            j = min(
                range(n),
                key=lambda j: (_busy(devs[j][1], got[j] + 1, self.b), j),
            )
            got[j] += 1
        F = max(s[0] + s[1] * g / self.b for (_, s), g in zip(devs, got))
        B = max(s[2] + s[3] * g / self.b for (_, s), g in zip(devs, got))
        pbytes, ptensors = lc.span_params(a, b)
        A = (ptensors * self.ar.latency_s + pbytes / self.ar.bandwidth_Bps) if n > 1 else 0.0
        A += max(
            (lc.span_optimizer(self.classes[i].kind, a, b) for i, x in enumerate(counts) if x), default=0.0
        )
        act, trans = lc.span_activations(a, b), lc.span_transient(a, b)
        inflight = 1 << 30
        memory = []
        for (i, _), g in zip(devs, got):
            c = self.classes[i]
            share = g / self.b
            m = c.model  # the device model's allocator overhead, as CostModel.memory_breakdown adds it
            over = 1.0 + (m.memory_overhead if m is not None else 0.0)
            const = m.memory_const_bytes if m is not None else 0.0
            base = (4.0 * pbytes + trans * share) * over + const  # params, grads, Adam m and v; transient
            per = act * share * over
            memory.append((base, per))
            if not self.memory:
                continue
            if 5.0 * pbytes * over + const > c.memory_bytes or base > c.memory_bytes:
                inflight = 0  # the optimizer step's temporary or the stage's states alone do not fit
            elif per > 0:
                inflight = min(inflight, int((c.memory_bytes - base) // per))
        samples = []
        at = 0
        for x in counts:
            samples.append(tuple(got[at : at + x]))
            at += x
        return StageCost(F, B, A, tuple(samples), inflight, tuple(memory), F + B, self.boundary_s(b))

    def inflight(self, after: int) -> int:
        """Micro-batches a stage keeps in flight when ``after`` stages follow it."""
        return self.N if self.schedule == "GPipe" else min(self.N, after + 1)

    # -------------------------------------------------------------------------------- labels
    def extend(self, lab: Label, st: StageCost, stage: object) -> Label | None:
        """The label of ``lab`` with ``st`` placed in front of it (right-to-left), None when the stage
        cannot hold its micro-batches in flight there."""
        s, m1, m2, m3, c = lab[:5]
        if st.max_inflight < self.inflight(c):
            return None
        lk = st.link
        if self.schedule == "1F1B":
            fb = st.F + st.B
            return (s + fb + 2 * lk, max(m1, fb, 2 * lk), 0.0, max(m3, st.A), c + 1, lab, stage)
        return (
            s + st.F + st.B + 2 * lk,
            max(m1, st.F, lk),
            max(m2, st.B, lk),
            max(m3, st.A),
            c + 1,
            lab,
            stage,
        )

    def total(self, lab: Label) -> float:
        """T1 + T2 + T3 of a complete label."""
        return lab[0] + (self.N - 1) * (lab[1] + lab[2]) + lab[3]

    def best(self, labels: Iterable[Label]) -> Label:
        """The fastest complete label (:meth:`total`), the one with fewer stages on a tie."""
        return min(labels, key=lambda lab: (self.total(lab), lab[4]))

    def parts(self, lab: Label) -> tuple[float, float, float]:
        return lab[0], (self.N - 1) * (lab[1] + lab[2]), lab[3]

    def rest(self, v: int, devices: Sequence[int]) -> float:
        """A lower bound on the slowest stage that units ``[0, v)`` can have on ``devices`` (per class):
        their work spread perfectly over the devices at each class's best speed-up."""
        if v <= 0:
            return 0.0
        phi = sum(s * n for s, n in zip(self.speedup, devices))
        return self.work[v] / phi if phi > 0 else (math.inf if self.work[v] > 0 else 0.0)

    def lower(self, lab: Label, rest: float) -> float:
        """A lower bound on the time of any pipeline completing ``lab`` whose missing stages' slowest is at
        least ``rest`` (see :meth:`rest`)."""
        return lab[0] + rest + (self.N - 1) * max(lab[1] + lab[2], rest) + lab[3]

    def frontier(self) -> Frontier:
        """An empty :class:`Frontier` for this pricer's objective."""
        return Frontier(self.N - 1, self.memory)

    def counts(self, cls: int, x: int) -> tuple[int, ...]:
        """The counts vector of ``x`` devices of class ``cls``."""
        return tuple(x if i == cls else 0 for i in range(len(self.classes)))

    def evaluate(self, stages: Sequence[tuple[int, int, Sequence[int]]]) -> Label | None:
        """The label of a whole pipeline ``[(a, b, counts), ...]`` (first stage first), or None when a
        stage is infeasible."""
        lab: Label | None = ROOT
        for a, b, counts in reversed(list(stages)):
            st = self.stage(a, b, counts)
            if st is None:
                return None
            lab = self.extend(lab, st, (a, b, tuple(counts)))
            if lab is None:
                return None
        return lab

    def why_infeasible(self, stages: Sequence[tuple[int, int, Sequence[int]]]) -> str:
        """Which stage of a pipeline does not fit, and why (for error messages)."""
        n = len(stages)
        for k, (a, b, counts) in enumerate(stages):
            st = self.stage(a, b, counts)
            names = self.costs.names
            what = (
                f"stage {k} (units {names[a]}..{names[b - 1]} on "
                + ", ".join(f"{x}x{c.kind}" for c, x in zip(self.classes, counts) if x)
                + ")"
            )
            if st is None:
                return f"{what}: more devices than the micro-batch's {self.b} samples"
            need = self.inflight(n - 1 - k)
            if st.max_inflight < need:
                worst = max(st.memory, key=lambda m: m[0] + need * m[1])
                return (
                    f"{what} needs {(worst[0] + need * worst[1]) / 2**30:.2f} GiB per device with {need} "
                    f"micro-batches in flight, more than the device holds"
                )
        return ""


def _busy(span: tuple[float, float, float, float], samples: int, b: int) -> float:
    return span[0] + span[2] + (span[1] + span[3]) * samples / b


def stages_of(lab: Label) -> list[object]:
    """The stage descriptors of a label, first stage first (labels are built right to left)."""
    out = []
    while lab[6] is not None:
        out.append(lab[6])
        lab = lab[5]
    return out


class Frontier:
    """The labels at one search state that may still lead to the best pipeline.

    A label ``A`` makes ``B`` useless when, whatever the rest of the pipeline adds (``X`` to the sum,
    ``Y`` to the steady-state maxima, ``Z`` to the tail), ``A`` finishes no later and stays feasible:
    ``c_A <= c_B`` (fewer stages after: no more micro-batches in flight) and
    ``s_A - s_B + w max(0, m1_A - m1_B) + w max(0, m2_A - m2_B) + max(0, m3_A - m3_B) <= 0`` with ``w = N - 1``
    (the worst case of ``T = s + X + w (max(m1, Y1) + max(m2, Y2)) + max(m3, Z)`` over ``X, Y, Z >= 0``).
    This is exact and prunes more than comparing each measure alone. ``count=False`` ignores the stage
    count (when memory is not checked it cannot make a stage infeasible)."""

    __slots__ = ("labels", "w", "count")

    def __init__(self, w: float, count: bool = True) -> None:
        self.labels: list[Label] = []
        self.w = w
        self.count = count

    def add(self, lab: Label) -> bool:
        s, m1, m2, m3, c = lab[:5]
        w, count = self.w, self.count
        keep = []
        for o in self.labels:
            d = o[0] - s  # how much later o is than lab, in the worst case of the rest
            e1, e2, e3 = o[1] - m1, o[2] - m2, o[3] - m3
            worse = (
                d + (w * e1 if e1 > 0.0 else 0.0) + (w * e2 if e2 > 0.0 else 0.0) + (e3 if e3 > 0.0 else 0.0)
            )
            if worse <= 0.0 and (not count or o[4] <= c):
                return False
            better = (
                -d
                + (-w * e1 if e1 < 0.0 else 0.0)
                + (-w * e2 if e2 < 0.0 else 0.0)
                + (-e3 if e3 < 0.0 else 0.0)
            )
            if better > 0.0 or (count and c > o[4]):
                keep.append(o)
        keep.append(lab)
        self.labels = keep
        return True

    def __iter__(self) -> Iterable[Label]:  # type: ignore[override]
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)


# ----------------------------------------------------------------------------------------------------
# schedule simulation (the reference the closed form is checked against)


def schedule_events(
    F: Sequence[float], B: Sequence[float], N: int, schedule: str = "1F1B"
) -> tuple[tuple[str, int, int, float, float], ...]:
    """Every operation of ``N`` micro-batches through stages with per-micro-batch times ``F``/``B``, as
    ``(kind, stage, micro_batch, start_s, end_s)`` (kind ``"F"`` or ``"B"``), under GPipe (all forwards,
    then all backwards) or 1F1B (``min(S-k-1, N)`` warm-up forwards on stage k, then one forward and one
    backward alternately, then the remaining backwards), every operation starting as soon as its inputs
    and its stage are ready; in the order they were scheduled (what a Gantt chart of the schedule draws).

    >>> [e[:3] for e in schedule_events([1, 1], [2, 2], 2, "GPipe")][:4]
    [('F', 0, 0), ('F', 0, 1), ('F', 1, 0), ('F', 1, 1)]
    """
    S = len(F)
    order: list[list[tuple[str, int]]] = []
    for k in range(S):
        if schedule == "GPipe":
            ops = [("F", m) for m in range(N)] + [("B", m) for m in range(N)]
        else:
            warm = min(S - k - 1, N)
            ops = [("F", m) for m in range(warm)]
            for i in range(N - warm):
                ops += [("F", warm + i), ("B", i)]
            ops += [("B", m) for m in range(N - warm, N)]
        order.append(ops)
    done: dict[tuple[str, int, int], float] = {}
    events: list[tuple[str, int, int, float, float]] = []
    pos = [0] * S
    free = [0.0] * S
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for k in range(S):
            while pos[k] < len(order[k]):
                kind, m = order[k][pos[k]]
                if kind == "F":
                    deps = [("F", k - 1, m)] if k > 0 else []
                else:
                    deps = [("F", k, m)] + ([("B", k + 1, m)] if k < S - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[k]] + [done[d] for d in deps])
                end = start + (F[k] if kind == "F" else B[k])
                done[(kind, k, m)] = end
                events.append((kind, k, m, start, end))
                free[k] = end
                pos[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocked (a bug in the schedule order)")
    return tuple(events)


def schedule_makespan(F: Sequence[float], B: Sequence[float], N: int, schedule: str = "1F1B") -> float:
    """The makespan of :func:`schedule_events`: when the last operation of the schedule ends.

    >>> schedule_makespan([1, 1], [2, 2], 4, "1F1B")
    15.0
    """
    return max(e[4] for e in schedule_events(F, B, N, schedule))


def closed_form(F: Sequence[float], B: Sequence[float], N: int, schedule: str = "1F1B") -> float:
    """``T1 + T2`` of the module docstring for per-stage times ``F``/``B``.

    >>> closed_form([1, 1], [2, 2], 4, "1F1B")
    15.0
    """
    t1 = math.fsum(F) + math.fsum(B)
    if schedule == "1F1B":
        return t1 + (N - 1) * max(f + b for f, b in zip(F, B))
    return t1 + (N - 1) * (max(F) + max(B))
