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

Device model (devices whose kind has a :class:`~hapnb.hardware.devices.DeviceModel`, e.g. the H100; every other
device stays flops-only as above, so the paper presets keep HAP's numbers). Per op, forward + backward:
a launch time ``kernels * kernel_s`` (kernels from :data:`FAMILY_KERNELS`) and a GPU work time
``max(flops / (peak * eff), bytes / bandwidth)``, bytes = the op's input + output tensors forward and 2x
that backward, ``eff`` the matmul efficiency curve for :data:`MATMUL_FAMILIES` at the per-kernel flops,
``attention_eff`` for attention, 1 for the memory-bound rest (with the model's ``vector_flops``, the
:data:`VECTOR_FAMILIES` run at that rate instead of ``peak * eff``; pooling and scans at ``pool_flops``
and ``scan_flops`` if set).
The host runs ahead of the GPU, so a device is either launch bound (every op costs its launch time) or
GPU bound (every op costs its work): the larger sum over the graph decides, per device (the whole step costs ``max(sum launch, sum work)``;
a model without ``overlap``, e.g. a CPU running its own kernels, costs ``launch + work`` per op instead;
which the fit to the measured H100 steps prefers to the per-op sum: docs/benchmarks/fidelity.md). To stay linear in
the device's ratio ``r`` (so the ratio LP stays an LP), efficiency, regime (compute or memory bound) and
the device's launch/GPU bound are read at a *reference share* (the throughput-proportional ratio of the
device, each op under its first strategy); an op then costs ``const + coef * r``. The optimizer
step (Adam, foreach) is memory-bound work over the device's parameters, gradients and states,
``optimizer_kernels * kernel_s + optimizer_passes * local_param_bytes / bandwidth`` (the launches once
per local parameter tensor with ``optimizer_per_tensor``: single-tensor Adam, a CPU), charged once per
iteration to the last stage.

Memory (:meth:`CostModel.memory_breakdown`, the model in :mod:`hapnb.cost.memory`): per device, parameters,
gradients and Adam's two states by each parameter's *stored* form, inputs, the activations autograd saves
for the backward (:data:`SAVED_FOR_BACKWARD`), ZeRO-2's gathered copies, a transient of twice the largest
local activation (plus the largest re-gathered parameter) during the backward, and the device model's
allocator overhead. The peak is the larger of the backward phase and the optimizer phase. A parameter
stored sharded and all-gathered before use (:class:`Load` ``zero`` 2 or 3, ZeRO / FSDP) costs an
all-gather in the forward and a reduce-scatter of its gradient (ZeRO-3: another all-gather in the
backward), :meth:`CostModel.zero_terms`.

The search, the LP and :func:`evaluate` all use these same terms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from ..hardware.cluster import Cluster
from ..ir.collective_table import COLLECTIVES
from ..ir.forms import Form, I
from ..ir.graph import Graph, Op
from ..rules import Strategy
from ..triples import Theory
from .buffers import UpdateCollective, update_collectives
from .memory import MEMORY_CATEGORIES, SAVED_FOR_BACKWARD, memory_breakdown
from .memory import is_alias as _is_alias

__all__ = [
    "Term",
    "Step",
    "Load",
    "Conversion",
    "CostModel",
    "StageCost",
    "Evaluation",
    "FAMILY_KERNELS",
    "MATMUL_FAMILIES",
    "VECTOR_FAMILIES",
    "gemm_dims",
    "SAVED_FOR_BACKWARD",
    "MEMORY_CATEGORIES",
]

#: GPU kernels per op of each rule family, (forward, backward), eager PyTorch fp32. Views and
#: ``dropout(p=0)`` (an alias) launch none; a family not listed counts (1, 1).
FAMILY_KERNELS: Mapping[str, tuple[int, int]] = MappingProxyType(
    {
        "matmul": (1, 3),  # addmm; grad input mm, grad weight mm, bias-grad sum
        "linear": (1, 3),
        "conv": (1, 3),
        "attention": (1, 2),  # memory-efficient SDPA; its backward kernel + the delta pre-pass
        "embedding": (1, 4),  # index_select; zero-fill, sort, segment sums, index_put
        "norm": (1, 2),  # layer_norm; grad input, grad weight/bias
        "loss": (2, 3),  # log_softmax + nll_loss; fill, nll_loss_backward, log_softmax_backward
        "multiplicative": (1, 2),
        "creation": (1, 0),
        "random": (1, 0),
        "view": (0, 0),
        # logcumsumexp; its backward: |grad|, log, two masks, two reversed scans (4 flips), exps, subs
        "scan": (1, 20),
    }
)
#: Families priced on the matmul efficiency curve; the rest are memory bound (efficiency 1).
MATMUL_FAMILIES = frozenset({"matmul", "linear", "conv"})
#: Families priced at the device model's vector rate (when it has one, e.g. a profiled CPU; pooling and
#: scans at their own rates if measured, :meth:`~hapnb.hardware.devices.DeviceModel.vector_rate`): transcendental
#: pointwise ops, pooling, transcendental scans, the loss (log-softmax + nll), ops without a rule.
VECTOR_FAMILIES = frozenset({"pointwise", "pool", "scan", "loss", "unknown"})


# collectives that move no data and so do not start a stage


@dataclass(frozen=True)
class Term:
    """A communication time ``const + slope * max_j ratios[segment][j]`` (seconds)."""

    kind: str
    const: float
    slope: float = 0.0
    segment: int = 0
    what: str = ""
    segment2: int = -1  # reshard from ``segment`` to ``segment2``: slope * max_j (u_j + u_{j+1})
    #: the backward's part of ``const`` and ``slope`` (the rest runs in the forward)
    bwd_const: float = 0.0
    bwd_slope: float = 0.0
    #: a gradient synchronisation (all-reduce of a replicated parameter's gradient), not a feature's
    gradient: bool = False

    def time(self, ratios: Sequence[Sequence[float]]) -> float:
        return self._time(self.const, self.slope, ratios)

    def backward_time(self, ratios: Sequence[Sequence[float]]) -> float:
        """The part of :meth:`time` spent in the backward pass (the rest is forward)."""
        return self._time(self.bwd_const, self.bwd_slope, ratios) if self.time(ratios) > 0 else 0.0

    def _time(self, const: float, slope: float, ratios: Sequence[Sequence[float]]) -> float:
        if self.slope == 0.0:
            return const
        if self.segment2 >= 0:
            share = reshard_share(ratios[self.segment], ratios[self.segment2])
            return const + slope * share if share > 0 else 0.0
        return const + slope * max(ratios[self.segment])


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
    """Load a parameter/input/buffer in a form (``sfb``: a replicated weight whose gradient SFB syncs).

    ``zero`` 2 or 3: a parameter *stored* sharded as ``stored`` (``G(d)``: its parameter, gradient and
    Adam states are the shard) and all-gathered to ``form`` (``I``) before use; its gradient is
    reduce-scattered back to the shard. ZeRO-2 (FSDP's SHARD_GRAD_OP) keeps the gathered copy until the
    backward has used it; ZeRO-3 (FSDP's FULL_SHARD) frees it after the forward use and all-gathers it
    again in the backward. ``zero=-1`` is the search's "replicated use, storage decided at the end"
    (:mod:`hapnb.synth.memory_prune`); a finished program has none."""

    tensor: int
    form: Form
    sfb: bool = False
    zero: int = 0
    stored: Form | None = None

    @property
    def storage(self) -> Form:
        """The form the parameter is kept in between uses (``stored`` for a ZeRO load, else ``form``)."""
        return self.stored if self.zero and self.stored is not None else self.form


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

    def __hash__(self) -> int:
        # computed once per step: programs (tuples of hundreds of steps) key the memos of hapnb.synth.optimize
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.op, self.strategy, self.loads, self.conversions))
            object.__setattr__(self, "_hash", h)
        return h

    def __reduce__(self) -> tuple[Any, ...]:  # a copy in another process hashes again (str hashes are salted)
        return (Step, (self.op, self.strategy, self.loads, self.conversions))


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
        self._lower_bound: float | None = None  # lower_bound(), once
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
        self.models = tuple(d.model for d in cluster.devices)
        #: some device has a device model (which also prices the optimizer step, :meth:`optimizer_linear`;
        #: zero on flops-only devices); none: every computation is flops over flop/s
        self.modelled = any(m is not None for m in self.models)
        self.gpus = tuple(max(1, d.gpus) for d in cluster.devices)
        #: ZeRO storage is priced here: several devices, none virtual (a virtual device's inner data
        #: parallelism is priced for replicated storage only)
        self.zero_priced = self.n > 1 and all(k == 1 for k in self.gpus)
        total = sum(self.flops)
        #: the device's reference share: efficiency and regime of the device model are read there
        self.reference_share = tuple(f / total for f in self.flops)
        self._lin: dict[tuple[int, Strategy, int], tuple[float, float]] = {}
        self._comp_lin: dict[Step, tuple[dict[int, tuple[float, ...]], tuple[float, ...]]] = {}
        self._op_bytes: dict[int, tuple[float, int]] = {}
        self._bound: dict[int, bool] = {}

    # ------------------------------------------------------------------ computation
    def comp(
        self, op: int, s: Strategy, ratios: Sequence[Sequence[float]], devices: Sequence[int] | None = None
    ) -> tuple[float, ...]:
        """Seconds of ``op`` under ``s`` per device at ``ratios`` (``devices``: only those, in that order)."""
        r = ratios[self.graph.ops[op].segment]
        js = range(self.n) if devices is None else devices
        if not self.modelled:
            sf, ff, fl = s.scaled_flops, s.fixed_flops, self.flops
            return tuple([(sf * r[j] + ff) / fl[j] for j in js])
        out = []
        for j in js:
            if self.models[j] is None:
                out.append((s.scaled_flops * r[j] + s.fixed_flops) / self.flops[j])
            else:
                const, coef = self.op_linear(op, s, j)
                out.append(const + coef * r[j])
        return tuple(out)

    def op_traffic(self, op: int) -> tuple[float, int]:
        """``(bytes, kernels)`` of one op, forward + backward, on one device holding the whole op."""
        hit = self._op_bytes.get(op)
        if hit is not None:
            return hit
        g = self.graph
        o = g.ops[op]
        fwd_k, bwd_k = FAMILY_KERNELS.get(o.family, (1, 1))
        if _is_alias(o):
            fwd_k = bwd_k = 0
        nbytes = 0.0
        if fwd_k:
            ins = [g.tensors[t] for t in dict.fromkeys(o.inputs)]
            out_b = sum(g.tensors[t].nbytes for t in o.outputs)
            if o.family == "embedding" and len(ins) >= 2:
                # gathers rows (reads and writes out-sized), the backward writes the whole table grad
                nbytes = 3.0 * (ins[1].nbytes + 2 * out_b) + 2.0 * ins[0].nbytes
            else:  # backward moves ~2x the forward's bytes
                nbytes = 3.0 * (sum(t.nbytes for t in ins) + out_b)
        skipped = self._skipped_gradients(o)
        if skipped:  # autograd skips those gradient GEMMs: their kernels and share of the bytes
            nbytes *= self.grad_share(op)
            bwd_k = max(0, bwd_k - skipped)
        hit = (nbytes, fwd_k + bwd_k)
        self._op_bytes[op] = hit
        return hit

    def _skipped_gradients(self, o: Op) -> int:
        """How many of a matmul-like op's two GEMM operands need no gradient (0 for other families)."""
        if o.family not in MATMUL_FAMILIES:
            return 0
        roles = _GEMM_ROLES.get(o.target)
        operands = [t for t, r in zip(o.inputs, roles) if "K" in r] if roles else list(o.inputs[:2])
        return sum(1 for t in operands if not self.theory.requires_grad[t])

    def grad_share(self, op: int) -> float:
        """Share of the rules' training flops (forward + backward, 3x the forward) that a matmul-like op
        runs with a device model: the forward and one gradient GEMM per operand that requires grad;
        autograd skips the others (a first layer's input gradient). 1 for the other families; flops-only
        devices keep the rules' 3x (HAP's model)."""
        return (3 - self._skipped_gradients(self.graph.ops[op])) / 3

    def op_linear(self, op: int, s: Strategy, j: int) -> tuple[float, float]:
        """Device-model time of ``op`` under ``s`` on device ``j`` as ``(const, coef)``: seconds
        ``const + coef * r_j``, efficiency and regime read at the device's reference share."""
        key = (op, s, j)
        hit = self._lin.get(key)
        if hit is None:
            m = self.models[j]
            assert m is not None
            launch = self.op_traffic(op)[1] * m.kernel_s
            if not m.overlap:  # the device runs its own launches: launch + work
                const, coef = self._work_linear(op, s, j)
                hit = (launch + const, coef)
            else:
                hit = (launch, 0.0) if self.launch_bound(j) else self._work_linear(op, s, j)
            self._lin[key] = hit
        return hit

    def _work_linear(self, op: int, s: Strategy, j: int) -> tuple[float, float]:
        """GPU work of ``op`` under ``s`` on device ``j`` as ``(const, coef)`` (regime at the reference)."""
        m = self.models[j]
        assert m is not None
        o = self.graph.ops[op]
        nbytes, kernels = self.op_traffic(op)
        k = self.gpus[j]
        share_run = self.grad_share(op)
        fs, ff = s.scaled_flops * share_run, s.fixed_flops * share_run
        total = fs + ff
        if total > 0:
            bs, bf = nbytes * fs / total, nbytes * ff / total
        else:
            sharded = any(f.kind == "G" for f in s.outputs)
            bs, bf = (nbytes, 0.0) if sharded else (0.0, nbytes)
        ref = self.reference_share[j]
        eff = 1.0
        if o.family in MATMUL_FAMILIES:
            share = (fs * ref + ff) / total if total > 0 else 1.0
            eff = m.efficiency(o.flops * share / k, o.family)
            if m.sm_count is not None:  # GEMM wave quantization at the reference share
                eff *= m.gemm_wave_factor(gemm_dims(self.graph, o, s, ref, k))
        elif o.family == "attention":
            eff = m.attention_eff
        rate, bw = m.peak_flops * eff * k, m.bandwidth_Bps * k
        vector = m.vector_rate(o.family) if o.family in VECTOR_FAMILIES else None
        if vector is not None:
            rate = vector * k
        if (fs * ref + ff) / rate >= (bs * ref + bf) / bw:
            coef, const = fs / rate, ff / rate
        else:
            coef, const = bs / bw, bf / bw
        return const, coef

    def launch_bound(self, j: int) -> bool:
        """Whether device ``j`` (with a device model) is launch bound on this graph: the launch times of
        all ops (each under its first strategy of the unrestricted theory, :attr:`hapnb.triples.Theory.first`, at
        the reference share) exceed their GPU work: a restricted theory prices a program as the whole one does."""
        hit = self._bound.get(j)
        if hit is None:
            m = self.models[j]
            assert m is not None
            launch = work = 0.0
            first = self.theory.first
            for op in self.graph.ops:
                const, coef = self._work_linear(op.id, first[op.id], j)
                launch += self.op_traffic(op.id)[1] * m.kernel_s
                work += const + coef * self.reference_share[j]
            hit = self._bound[j] = launch > work
        return hit

    def lower_bound(self) -> float:
        """Total training flops over total throughput: no plan can be faster. A device with
        a device model counts its peak per GPU (no efficiency reaches more; overheads left out)."""
        if self._lower_bound is None:
            self._lower_bound = self._flops_bound()
        return self._lower_bound

    def _flops_bound(self) -> float:
        total = 0.0
        for op, ss in zip(self.graph.ops, self.theory.strategies):
            total += min(s.scaled_flops + s.fixed_flops for s in ss) * (
                self.grad_share(op.id) if self.modelled else 1.0  # device models skip what autograd skips
            )
        rate = [f if m is None else m.peak_flops * k for f, m, k in zip(self.flops, self.models, self.gpus)]
        return total / sum(rate)

    # ------------------------------------------------------------------ optimizer step
    def _param_forms(self, program: Sequence[Step]) -> dict[int, Form]:
        forms: dict[int, Form] = {}
        for st in program:
            for ld in st.loads:
                if self.graph.tensors[ld.tensor].role == "param":
                    forms.setdefault(ld.tensor, ld.storage)
        return forms

    def optimizer_linear(
        self, program: Sequence[Step]
    ) -> tuple[dict[int, tuple[float, ...]], tuple[float, ...]]:
        """The optimizer step (Adam, foreach) per device as ``(coef, const)`` like :meth:`comp_linear`: each
        loaded parameter's :meth:`optimizer_param` and the :meth:`optimizer_launches`; zero on flops-only
        devices."""
        coef: dict[int, list[float]] = {}
        forms = self._param_forms(program)
        const = list(self.optimizer_launches(len(forms)))
        for t, f in forms.items():
            seg, v = self.optimizer_param(t, f)
            row = coef.setdefault(seg, [0.0] * self.n) if seg >= 0 else const
            for j, x in enumerate(v):
                row[j] += x
        return {s: tuple(v) for s, v in coef.items()}, tuple(const)

    def optimizer_param(self, tensor: int, storage: Form) -> tuple[int, tuple[float, ...]]:
        """Parameter ``tensor``'s part of the optimizer step per device, memory-bound over its bytes: stored
        sharded (``G``), ``(its ratio segment, seconds per unit of the device's share)``; else ``(-1,
        seconds)``. Zero on flops-only devices."""
        nbytes = self.graph.tensors[tensor].nbytes
        v = tuple(
            0.0 if m is None else nbytes * m.optimizer_passes / (m.bandwidth_Bps * k)
            for m, k in zip(self.models, self.gpus)
        )
        return (self.segment_of[tensor], v) if storage.kind == "G" else (-1, v)

    def optimizer_launches(self, n_params: int) -> tuple[float, ...]:
        """Seconds of the optimizer step's kernel launches per device: once per step, or once per parameter
        tensor with ``optimizer_per_tensor`` (single-tensor Adam); zero on flops-only devices."""
        return tuple(
            0.0
            if m is None
            else m.optimizer_kernels * (n_params if m.optimizer_per_tensor else 1) * m.kernel_s
            for m in self.models
        )

    def optimizer_comp(self, program: Sequence[Step], ratios: Sequence[Sequence[float]]) -> tuple[float, ...]:
        """Seconds of the optimizer step per device at ``ratios`` (see :meth:`optimizer_linear`)."""
        coef, const = self.optimizer_linear(program)
        v = list(const)
        for s, row in coef.items():
            for j in range(self.n):
                v[j] += row[j] * ratios[s][j]
        return tuple(v)

    def load_comp(self, ld: Load, ratios: Sequence[Sequence[float]]) -> tuple[float, ...]:
        """Inner data-parallel gradient sync of a virtual device for a loaded parameter."""
        t = self.graph.tensors[ld.tensor]
        if t.role != "param" or not any(self.inner_sync_s_per_byte):
            return (0.0,) * self.n
        r = ratios[self.segment_of[ld.tensor]]
        share = [r[j] if ld.storage.kind == "G" else 1.0 for j in range(self.n)]
        return tuple(self.inner_sync_s_per_byte[j] * t.nbytes * share[j] for j in range(self.n))

    # ------------------------------------------------------------------ communication
    def _t(self, kind: str, nbytes: float, launches: int = 1) -> float:
        c = self._coll[kind]
        return launches * c.latency_s + nbytes / c.bandwidth_Bps

    def conversion_terms(self, cv: Conversion) -> tuple[Term, ...]:
        """Forward + backward communication of a collective on a tensor, priced as its entry of
        :data:`hapnb.ir.collective_table.COLLECTIVES` says (the backward part only when the tensor needs a
        gradient)."""
        spec = COLLECTIVES.get(cv.name)
        if spec is None:
            raise ValueError(f"unknown collective {cv.name!r}; known: {', '.join(COLLECTIVES)}")
        if spec.pricing == "free" or self.n == 1:
            return ()
        t = self.graph.tensors[cv.tensor]
        seg = self.segment_of[cv.tensor]
        nbytes = float(t.nbytes)
        n = self.n
        bwd = self.theory.requires_grad[cv.tensor]
        what = f"{cv.name} {t.name}"
        if spec.pricing == "grouped":  # n exact-size calls of the whole tensor: all latency-like
            bc = self._t(spec.backward, nbytes, n) if bwd else 0.0
            return (Term(cv.name, self._t(spec.forward, nbytes, n) + bc, 0.0, seg, what, bwd_const=bc),)
        if spec.pricing == "full":
            bc = self._t(spec.backward, nbytes) if bwd else 0.0
            return (Term(cv.name, self._t(spec.forward, nbytes) + bc, 0.0, seg, what, bwd_const=bc),)
        # padded (n * the largest shard) and exchange (the bytes one device sends): slopes in the ratios
        volume = n * nbytes if spec.pricing == "padded" else nbytes
        fwd_c, bwd_c = self._coll[spec.forward], self._coll[spec.backward]
        bc = bwd_c.latency_s if bwd else 0.0
        bs = volume / bwd_c.bandwidth_Bps if bwd else 0.0
        return (
            Term(
                cv.name,
                fwd_c.latency_s + bc,
                volume / fwd_c.bandwidth_Bps + bs,
                seg,
                what,
                cv.segment if spec.resegments else -1,
                bwd_const=bc,
                bwd_slope=bs,
            ),
        )

    def load_terms(self, ld: Load) -> tuple[Term, ...]:
        """A replicated trainable parameter all-reduces its gradient (unless SFB syncs it; a frozen one has
        none); a ZeRO load all-gathers the shard in the forward and reduce-scatters the gradient in the
        backward (padded, as a feature all-gather's dual), ZeRO-3 all-gathers it again in the backward.
        None on a one-device cluster (nothing to talk to), as for every communication term here."""
        t = self.graph.tensors[ld.tensor]
        if self.n == 1:
            return ()
        if ld.zero > 0 and ld.stored is not None:
            return self.zero_terms(ld.tensor, ld.stored, ld.zero)
        if t.role != "param" or not t.requires_grad or ld.form.kind != "I" or ld.sfb:
            return ()
        return (
            Term(
                "all_reduce",
                (x := self._t("all_reduce", float(t.nbytes))),
                0.0,
                0,
                f"grad all_reduce {t.name}",
                bwd_const=x,
                gradient=True,
            ),
        )

    def zero_terms(self, tensor: int, stored: Form, zero: int) -> tuple[Term, ...]:
        """Communication of a parameter stored ``stored`` and gathered before use (ZeRO-``zero``)."""
        (tm,) = self.conversion_terms(Conversion(tensor, "all_gather", stored, I))
        name = self.graph.tensors[tensor].name
        tm = replace(tm, kind=f"zero{zero}_gather", what=f"zero{zero} all_gather {name}")
        if zero == 2:
            return (tm,)
        c = self._coll["all_gather"]
        slope = self.n * self.graph.tensors[tensor].nbytes / c.bandwidth_Bps
        again = Term(
            "all_gather", c.latency_s, slope, tm.segment, f"zero3 re-gather {name}", bwd_const=c.latency_s,
            bwd_slope=slope,
        )  # fmt: skip
        return (tm, again)

    def sfb_terms(self, step: Step) -> tuple[Term, ...]:
        """SFB: all-gather the G input and the output gradient (padded) in the backward."""
        if not step.strategy.sfb or self.n == 1:
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
                        "all_gather",
                        c.latency_s,
                        (sl := self.n * tr.nbytes / c.bandwidth_Bps),
                        seg,
                        f"sfb {tr.name}",
                        bwd_const=c.latency_s,
                        bwd_slope=sl,
                    )
                )
        return tuple(out)

    def step_parts(
        self, step: Step
    ) -> tuple[tuple[tuple[Term, ...], ...], tuple[tuple[Term, ...], ...], tuple[Term, ...]]:
        """A step's communication terms by part: per load, per conversion, and its SFB sync."""
        return (
            tuple(self.load_terms(ld) for ld in step.loads),
            tuple(self.conversion_terms(cv) for cv in step.conversions),
            self.sfb_terms(step),
        )

    def step_terms(self, step: Step, parts: Any = None) -> tuple[Term, ...]:
        """Communication terms of one step (its :meth:`step_parts`, or ``parts`` when the caller has them),
        in order; none on a one-device cluster (nothing to talk to)."""
        loads, convs, sfb = self.step_parts(step) if parts is None else parts
        return tuple(tm for part in (*loads, *convs, sfb) for tm in part)

    def update_terms(self, program: Sequence[Step]) -> tuple[Term, ...]:
        """The collectives of the buffer updates after the forward (:mod:`.buffers`), forward only."""
        cs = update_collectives(self.graph, program) if self.n > 1 else ()
        return tuple(self.update_term(c) for c in cs)

    def update_term(self, c: UpdateCollective) -> Term:
        """One buffer update's collective: forward only, independent of the ratios (whole tensors)."""
        return Term(c.kind, self._t(c.kind, float(c.nbytes)), 0.0, 0, c.what)

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
        hit = self._comp_lin.get(step)
        if hit is not None:  # read-only: every LP of a context's programs asks for the same steps again
            return hit
        segs = sorted({self.graph.ops[step.op].segment} | {self.segment_of[ld.tensor] for ld in step.loads})
        zero = [(0.0,) * self.n] * self.n_segments
        const = self.step_comp(step, zero)
        coef = {}
        for s in segs:
            unit = list(zero)
            unit[s] = (1.0,) * self.n
            at = self.step_comp(step, unit)
            coef[s] = tuple(a - c for a, c in zip(at, const))
        self._comp_lin[step] = (coef, const)
        return coef, const

    # ------------------------------------------------------------------ programs
    def stages(
        self,
        program: Sequence[Step],
        ratios: Sequence[Sequence[float]] | None = None,
        terms_of: Callable[[Step], Sequence[Term]] | None = None,
        terms: Sequence[Sequence[Term]] | None = None,
    ) -> list[list[int]]:
        """Group step indices into stages: a step that communicates starts a new stage. A reshard moves
        data only where the segments' ratios differ: with ``ratios`` it counts when it moves data, without
        (the LP's view) it never starts a stage. ``terms_of``: which of a step's terms count (default all,
        :meth:`step_terms`; the duplex model counts its feature terms only); ``terms``: those terms
        already computed, one entry per step."""
        out: list[list[int]] = []
        for i, st in enumerate(program):
            tms = terms[i] if terms is not None else (terms_of or self.step_terms)(st)
            if ratios is None:
                comm = any(tm.segment2 < 0 for tm in tms)
            else:
                comm = any(tm.time(ratios) > 0 for tm in tms)
            if not out or comm:
                out.append([i])
            else:
                out[-1].append(i)
        return out

    def evaluate(
        self,
        program: Sequence[Step],
        ratios: Sequence[Sequence[float]],
        terms: Sequence[Sequence[Term]] | None = None,
        comps: Sequence[Sequence[float]] | None = None,
    ) -> Evaluation:
        """Iteration time: stages of communication + the slowest device's computation; the optimizer
        step of device-model devices and the buffer updates' collectives (:meth:`update_terms`) are
        charged to the last stage. ``terms`` / ``comps``: each step's
        :meth:`step_terms` / :meth:`step_comp` at ``ratios`` when the caller has them already."""
        stages = []
        total = 0.0
        terms = [self.step_terms(st) for st in program] if terms is None else terms
        groups = self.stages(program, ratios, terms=terms)
        opt = self.optimizer_comp(program, ratios) if any(self.models) else (0.0,) * self.n
        for k, idx in enumerate(groups):
            comm = sum(tm.time(ratios) for tm in terms[idx[0]])
            comp = [0.0] * self.n
            for i in idx:
                for j, x in enumerate(self.step_comp(program[i], ratios) if comps is None else comps[i]):
                    comp[j] += x
            if k == len(groups) - 1:
                comp = [c + x for c, x in zip(comp, opt)]
                comm += sum(tm.time(ratios) for tm in self.update_terms(program))
            sc = StageCost(k, tuple(idx), comm, tuple(comp))
            stages.append(sc)
            total += sc.time_s
        return Evaluation(total, tuple(stages))

    # ------------------------------------------------------------------ memory
    def memory(
        self, program: Sequence[Step], extra: Sequence[Conversion], ratios: Sequence[Sequence[float]]
    ) -> tuple[int, ...]:
        """Predicted peak bytes per GPU of a program (the sum of :meth:`memory_breakdown`)."""
        return tuple(sum(b.values()) for b in self.memory_breakdown(program, extra, ratios))

    def _local(
        self, tensor: int, form: Form, ratios: Sequence[Sequence[float]], seg: int = -1
    ) -> list[float]:
        t = self.graph.tensors[tensor]
        if form.kind != "G" or not t.shape:
            return [float(t.nbytes)] * self.n
        s = self.segment_of[tensor] if seg < 0 else seg
        lengths = self.theory.lengths(tensor, form.dim, ratios[s])
        per = t.nbytes / t.shape[form.dim]
        return [per * x for x in lengths]

    def memory_breakdown(
        self, program: Sequence[Step], extra: Sequence[Conversion], ratios: Sequence[Sequence[float]]
    ) -> tuple[dict[str, int], ...]:
        """Per GPU, the predicted peak split by :data:`MEMORY_CATEGORIES` (bytes; they sum to the peak).

        Parameters, gradients and Adam's two states count each parameter's stored form (a ZeRO load's
        shard); activations are what autograd keeps (:data:`SAVED_FOR_BACKWARD`, each tensor once, in the
        form its consumer uses) and ZeRO-2's gathered copies; the transient is twice the largest local
        activation, the largest re-gathered parameter and the final conversions. The peak is the larger
        phase: backward or optimizer step (:mod:`hapnb.cost.memory` has the model); ``overhead`` is the device
        model's allocator overhead (0 when flops-only). A virtual device's bytes are split over its GPUs."""
        return memory_breakdown(self, program, extra, ratios)


#: GEMM roles of the dims of each tensor input, per op target, from the right: ``K`` contracted, ``M``
#: the output's rows, ``N`` its columns; dims left of them are ``M`` for a linear layer (folded into its
#: rows) and ``B`` (batch, one GEMM each in one launch) for the batched products.
_GEMM_ROLES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "aten.linear.default": ("MK", "NK", "N"),
        "aten.mm.default": ("MK", "KN"),
        "aten.addmm.default": ("N", "MK", "KN"),
        "aten.bmm.default": ("BMK", "BKN"),
        "aten.matmul.default": ("MK", "KN"),
    }
)


def gemm_dims(g: Graph, op: Op, s: Strategy, share: float = 1.0, gpus: int = 1) -> tuple[float, ...] | None:
    """``(batch, M, N, K)`` of a matmul-like op's GEMM on one device: the dim of role ``r``
    (:data:`_GEMM_ROLES`) that strategy ``s`` shards is cut to ``share`` of it, and a virtual device's
    ``gpus`` split the batch (or the rows). None for ops without a table entry (conv, einsum) or with a
    one-dim GEMM operand.

    >>> import torch, hapnb
    >>> gr = hapnb.trace(torch.nn.Linear(512, 768), (torch.randn(4, 32, 512),), loss=lambda o: o.sum())
    >>> gemm_dims(gr, gr.ops[0], hapnb.theory(gr).strategies[0][0])  # x's 4 x 32 rows fold into M
    (1.0, 128.0, 768.0, 512.0)
    >>> gb = hapnb.trace(torch.nn.Linear(64, 32, bias=False), (torch.randn(8, 64),), loss=lambda o: o.sum())
    >>> gemm_dims(gb, gb.ops[0], hapnb.theory(gb).strategies[0][0])  # no bias
    (1.0, 8.0, 32.0, 64.0)
    """
    roles = _GEMM_ROLES.get(op.target)
    if roles is None or sum("K" in r for r in roles[: len(op.inputs)]) != 2:  # a bias may be left out
        return None
    lead = "M" if op.target == "aten.linear.default" else "B"
    size = {"B": 1.0, "M": 1.0, "N": 1.0, "K": 1.0}
    cut = ""
    for tid, form, role in zip(op.inputs, s.inputs, roles):
        shape = g.tensors[tid].shape
        if len(shape) < len(role) or ("K" in role and len(shape) < 2):
            return None
        letters = lead * (len(shape) - len(role)) + role
        if "K" in role:  # a GEMM operand: its sizes (the batch: the larger operand's, broadcast)
            own = {"B": 1.0, "M": 1.0}
            for r, n in zip(letters, shape):
                if r in own:
                    own[r] *= n
                else:
                    size[r] = float(n)
            size["B"] = max(size["B"], own["B"])
            if "M" in role:
                size["M"] = own["M"]
        if form.kind == "G":
            cut = letters[form.dim]
    if cut:
        size[cut] *= share
    size["B" if size["B"] > 1 else "M"] /= gpus
    return (size["B"], size["M"], size["N"], size["K"])


_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce")
