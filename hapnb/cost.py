"""Cost model: stages, per-device computation, and collectives as ``latency + bytes/bandwidth``.

A program is a sequence of :class:`Step` values: one computation with the loads and collectives fused
in front of it (paper §4.5). A step that communicates starts a new *stage* (all devices synchronise);
the iteration time is ``sum over stages (comm + max_j comp_j)`` (paper §3.2).

* Computation on device j: ``(scaled_flops * r_j + fixed_flops) / flops_j`` (forward + backward, the
  rule fixes both parts), where ``r_j`` is the device's ratio in the op's segment.
* Every communication term is ``const + slope * max_j r_j`` (the slowest participant moves the largest
  shard), in seconds; bytes, never elements. The backward of each collective is its dual and is
  charged to the same stage: padded all-gather ⇄ padded reduce-scatter, grouped broadcast ⇄ grouped
  reduce, all-reduce ⇄ all-reduce, all-to-all ⇄ all-to-all; a replicated parameter all-reduces its
  gradient; an SFB step all-gathers its sufficient factors instead.
* Virtual devices (a machine of k GPUs, data parallel inside) add the inner gradient all-reduce of the
  parameters they load: ``2 (k-1)/k * bytes / intra_machine_Bps`` to that device's computation.

The search, the LP and :func:`evaluate` all use these same terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cluster import Cluster
from .forms import Form
from .rules import Strategy
from .triples import Theory

__all__ = ["Term", "Step", "Load", "Conversion", "CostModel", "StageCost", "Evaluation"]

# collectives that move no data and so do not start a stage
FREE = frozenset({"slice", "to_partial"})


@dataclass(frozen=True)
class Term:
    """A communication time ``const + slope * max_j ratios[segment][j]`` (seconds)."""

    kind: str
    const: float
    slope: float = 0.0
    segment: int = 0
    what: str = ""
    segment2: int = -1  # reshard from ``segment`` to ``segment2``: slope * max_j (u_j + u_{j+1})

    def time(self, ratios: Sequence[Sequence[float]]) -> float:
        if self.slope == 0.0:
            return self.const
        if self.segment2 >= 0:
            share = reshard_share(ratios[self.segment], ratios[self.segment2])
            return self.const + self.slope * share if share > 0 else 0.0
        return self.const + self.slope * max(ratios[self.segment])


def reshard_share(a: Sequence[float], b: Sequence[float]) -> float:
    """Upper bound of the share of a tensor one device moves when its shards change from ratios a to b:
    the data crossing the device's two boundaries, ``max_j (u_j + u_{j+1})`` with ``u_j = |A_j - B_j|``
    the difference of the prefix sums (0 when the ratios are equal)."""
    u = [0.0]
    pa = pb = 0.0
    for x, y in zip(a, b):
        pa += x
        pb += y
        u.append(abs(pa - pb))
    u[-1] = 0.0
    return max(u[j] + u[j + 1] for j in range(len(a)))


@dataclass(frozen=True)
class Load:
    """Load a parameter/input/buffer in a form (``sfb``: a replicated weight whose gradient SFB syncs)."""

    tensor: int
    form: Form
    sfb: bool = False


@dataclass(frozen=True)
class Conversion:
    """A collective on ``tensor`` from form ``src`` to ``dst`` (``name`` from theory.COLLECTIVES, or
    ``reshard``: the same G form re-cut for the ratios of ``segment``, at a segment boundary)."""

    tensor: int
    name: str
    src: Form
    dst: Form
    segment: int = -1


@dataclass(frozen=True)
class Step:
    """One computation with the loads and collectives fused in front of it."""

    op: int
    strategy: Strategy
    loads: tuple[Load, ...] = ()
    conversions: tuple[Conversion, ...] = ()


@dataclass(frozen=True)
class StageCost:
    index: int
    steps: tuple[int, ...]  # indices into the program
    comm_s: float
    comp_s: tuple[float, ...]  # per device

    @property
    def time_s(self) -> float:
        return self.comm_s + max(self.comp_s)


@dataclass(frozen=True)
class Evaluation:
    cost_s: float
    stages: tuple[StageCost, ...]


class CostModel:
    """Per-device computation vectors and communication terms for one theory on one cluster."""

    def __init__(self, th: Theory, cluster: Cluster) -> None:
        self.theory = th
        self.graph = g = th.graph
        self.cluster = cluster
        self.n = cluster.n
        self.flops = tuple(d.flops for d in cluster.devices)
        self.n_segments = 1 + max((op.segment for op in g.ops), default=0)
        seg = [0] * len(g.tensors)
        for t in g.tensors:
            if t.producer is not None:
                seg[t.id] = g.ops[t.producer].segment
            elif t.consumers:
                seg[t.id] = g.ops[t.consumers[0]].segment
        self.segment_of = tuple(seg)
        self._coll = {k: cluster.collective(k) for k in _KINDS}
        inner = []
        for d in cluster.devices:
            k = d.gpus
            inner.append(2.0 * (k - 1) / k / cluster.intra_machine_Bps if k > 1 else 0.0)
        self.inner_sync_s_per_byte = tuple(inner)

    # ------------------------------------------------------------------ computation
    def comp(self, op: int, s: Strategy, ratios: Sequence[Sequence[float]]) -> tuple[float, ...]:
        r = ratios[self.graph.ops[op].segment]
        return tuple((s.scaled_flops * r[j] + s.fixed_flops) / self.flops[j] for j in range(self.n))

    def lower_bound(self) -> float:
        """Total training flops over total throughput: no plan can be faster (DESIGN §3.2)."""
        total = 0.0
        for ss in self.theory.strategies:
            total += min(s.scaled_flops + s.fixed_flops for s in ss)
        return total / sum(self.flops)

    def load_comp(self, ld: Load, ratios: Sequence[Sequence[float]]) -> tuple[float, ...]:
        """Inner data-parallel gradient sync of a virtual device for a loaded parameter."""
        t = self.graph.tensors[ld.tensor]
        if t.role != "param" or not any(self.inner_sync_s_per_byte):
            return (0.0,) * self.n
        r = ratios[self.segment_of[ld.tensor]]
        share = [r[j] if ld.form.kind == "G" else 1.0 for j in range(self.n)]
        return tuple(self.inner_sync_s_per_byte[j] * t.nbytes * share[j] for j in range(self.n))

    # ------------------------------------------------------------------ communication
    def _t(self, kind: str, nbytes: float, launches: int = 1) -> float:
        c = self._coll[kind]
        return launches * c.latency_s + nbytes / c.bandwidth_Bps

    def conversion_terms(self, cv: Conversion) -> tuple[Term, ...]:
        """Forward + backward communication of a collective on a tensor."""
        t = self.graph.tensors[cv.tensor]
        seg = self.segment_of[cv.tensor]
        nbytes = float(t.nbytes)
        n = self.n
        bwd = self.theory.requires_grad[cv.tensor]
        name = cv.name
        what = f"{name} {t.name}"
        if name in FREE:
            return ()
        c = self._coll
        if name in ("all_gather", "reduce_scatter"):
            fwd_k, bwd_k = (
                ("all_gather", "reduce_scatter") if name == "all_gather" else ("reduce_scatter", "all_gather")
            )
            const = c[fwd_k].latency_s + (c[bwd_k].latency_s if bwd else 0.0)
            slope = n * nbytes / c[fwd_k].bandwidth_Bps + (
                n * nbytes / c[bwd_k].bandwidth_Bps if bwd else 0.0
            )
            return (Term(name, const, slope, seg, what),)
        if name in ("grouped_all_gather", "grouped_reduce_scatter"):
            fwd_k, bwd_k = (
                ("broadcast", "reduce") if name == "grouped_all_gather" else ("reduce", "broadcast")
            )
            const = self._t(fwd_k, nbytes, n) + (self._t(bwd_k, nbytes, n) if bwd else 0.0)
            return (Term(name, const, 0.0, seg, what),)
        if name == "all_reduce":
            return (Term(name, self._t("all_reduce", nbytes) * (2 if bwd else 1), 0.0, seg, what),)
        if name == "reshard":
            k = 2 if bwd else 1
            c2 = c["all_to_all"]
            return (Term(name, k * c2.latency_s, k * nbytes / c2.bandwidth_Bps, seg, what, cv.segment),)
        if name == "all_to_all":
            k = 2 if bwd else 1
            return (
                Term(
                    name, k * c["all_to_all"].latency_s, k * nbytes / c["all_to_all"].bandwidth_Bps, seg, what
                ),
            )
        raise ValueError(f"unknown collective {name!r}")

    def load_terms(self, ld: Load) -> tuple[Term, ...]:
        """A replicated trainable parameter all-reduces its gradient (unless SFB syncs it)."""
        t = self.graph.tensors[ld.tensor]
        if t.role != "param" or ld.form.kind != "I" or ld.sfb:
            return ()
        return (
            Term("all_reduce", self._t("all_reduce", float(t.nbytes)), 0.0, 0, f"grad all_reduce {t.name}"),
        )

    def sfb_terms(self, step: Step) -> tuple[Term, ...]:
        """SFB: all-gather the G input and the output gradient (padded) in the backward."""
        if not step.strategy.sfb:
            return ()
        g = self.graph
        op = g.ops[step.op]
        seg = op.segment
        c = self._coll["all_gather"]
        out = []
        for t, f in list(zip(op.inputs, step.strategy.inputs)) + list(zip(op.outputs, step.strategy.outputs)):
            tr = g.tensors[t]
            if f.kind == "G" and tr.role not in ("param",):
                out.append(
                    Term(
                        "all_gather", c.latency_s, self.n * tr.nbytes / c.bandwidth_Bps, seg, f"sfb {tr.name}"
                    )
                )
        return tuple(out)

    def step_terms(self, step: Step) -> tuple[Term, ...]:
        terms: list[Term] = []
        for ld in step.loads:
            terms += self.load_terms(ld)
        for cv in step.conversions:
            terms += self.conversion_terms(cv)
        terms += self.sfb_terms(step)
        return tuple(terms)

    def step_comp(self, step: Step, ratios: Sequence[Sequence[float]]) -> tuple[float, ...]:
        v = list(self.comp(step.op, step.strategy, ratios))
        for ld in step.loads:
            for j, x in enumerate(self.load_comp(ld, ratios)):
                v[j] += x
        return tuple(v)

    def comp_linear(self, step: Step) -> tuple[dict[int, tuple[float, ...]], tuple[float, ...]]:
        """:meth:`step_comp` as the linear function the LP needs: ``(coef, const)`` with device j's time
        ``sum_s coef[s][j] * ratios[s][j] + const[j]``. Read off the cost model itself (at zero ratios and
        at a unit ratio per segment the step touches), so the LP prices computation exactly as
        :meth:`evaluate` does; every computation term must be linear in the device's own ratio."""
        segs = sorted({self.graph.ops[step.op].segment} | {self.segment_of[ld.tensor] for ld in step.loads})
        zero = [(0.0,) * self.n] * self.n_segments
        const = self.step_comp(step, zero)
        coef = {}
        for s in segs:
            unit = list(zero)
            unit[s] = (1.0,) * self.n
            at = self.step_comp(step, unit)
            coef[s] = tuple(a - c for a, c in zip(at, const))
        return coef, const

    # ------------------------------------------------------------------ programs
    def stages(
        self, program: Sequence[Step], ratios: Sequence[Sequence[float]] | None = None
    ) -> list[list[int]]:
        """Group step indices into stages: a step that communicates starts a new stage. A reshard moves
        data only where the segments' ratios differ: with ``ratios`` it counts when it moves data, without
        (the LP's view) it never starts a stage."""
        out: list[list[int]] = []
        for i, st in enumerate(program):
            terms = self.step_terms(st)
            if ratios is None:
                comm = any(tm.segment2 < 0 for tm in terms)
            else:
                comm = any(tm.time(ratios) > 0 for tm in terms)
            if not out or comm:
                out.append([i])
            else:
                out[-1].append(i)
        return out

    def evaluate(self, program: Sequence[Step], ratios: Sequence[Sequence[float]]) -> Evaluation:
        stages = []
        total = 0.0
        for k, idx in enumerate(self.stages(program, ratios)):
            comm = sum(tm.time(ratios) for tm in self.step_terms(program[idx[0]]))
            comp = [0.0] * self.n
            for i in idx:
                for j, x in enumerate(self.step_comp(program[i], ratios)):
                    comp[j] += x
            sc = StageCost(k, tuple(idx), comm, tuple(comp))
            stages.append(sc)
            total += sc.time_s
        return Evaluation(total, tuple(stages))

    # ------------------------------------------------------------------ memory
    def memory(
        self, program: Sequence[Step], extra: Sequence[Conversion], ratios: Sequence[Sequence[float]]
    ) -> tuple[int, ...]:
        """Per-GPU bytes of a program: parameters + gradients + Adam state (4x the local parameter bytes)
        + inputs + activations kept for the backward (every computed tensor's local part), per device;
        a virtual device's share is split over its GPUs."""
        g = self.graph
        mem = [0.0] * self.n

        def add(tensor: int, form: Form, k: float = 1.0) -> None:
            t = g.tensors[tensor]
            if form.kind != "G":
                for j in range(self.n):
                    mem[j] += k * t.nbytes
                return
            lengths = self.theory.lengths(tensor, form.dim, ratios[self.segment_of[tensor]])
            for j, x in enumerate(lengths):
                mem[j] += k * t.nbytes / t.shape[form.dim] * x

        for st in program:
            for ld in st.loads:
                add(ld.tensor, ld.form, 4.0 if g.tensors[ld.tensor].role == "param" else 1.0)
            for cv in st.conversions:
                if cv.name == "reshard":
                    t = g.tensors[cv.tensor]
                    for j, x in enumerate(self.theory.lengths(cv.tensor, cv.dst.dim, ratios[cv.segment])):
                        mem[j] += t.nbytes / t.shape[cv.dst.dim] * x
                else:
                    add(cv.tensor, cv.dst)
            for t, f in zip(g.ops[st.op].outputs, st.strategy.outputs):
                add(t, f)
        for cv in extra:
            add(cv.tensor, cv.dst)
        gpus = [max(1, d.gpus) for d in self.cluster.devices]
        return tuple(int(m / k) if k > 1 else int(m) for m, k in zip(mem, gpus))


_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce")
