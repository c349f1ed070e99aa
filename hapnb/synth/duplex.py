"""HiDup's duplex cost (SoCC'22 §4, eqs. 4-5): two micro-batches, one computing while the other communicates.

The batch runs as two micro-batches of half the size on the same program. Per micro-batch, a stage's
computation on device j is half its full-batch computation (``p_i = max_j comp_ij / 2``) and a feature
collective takes half its time (``c_i``: the stage's conversions and SFB factors, halved; latencies and
kernel launches halve too, an optimistic simplification). The stages follow HiDup's recurrence with
``φ_0 = ψ_0 = 0``::

    φ_i = -p_i
    ψ_i = ψ_{i-1} + φ_{i-1} + max(-φ_{i-1}, c_i) + max(c_i, p_i) - φ_i

(micro-batch 2 computes stage i-1 while micro-batch 1 communicates for stage i, then micro-batch 1
computes stage i while micro-batch 2 communicates, then micro-batch 2 computes stage i). Expanded,
``ψ_m = sum_i [max(p_{i-1}, c_i) + max(c_i, p_i)] + p_m``: a sum of maxima with non-negative
coefficients, which :func:`hapnb.synth.balance.balance` (``duplex=True``) turns into an LP.

Once per iteration, after both micro-batches (the two micro-batches' gradients are accumulated first,
HiDup §3.2), and not overlapped with any computation:

* the gradient all-reduces of replicated parameters (``Term.gradient``, at their full size, once);
* a virtual device's inner data-parallel gradient sync (per device), then the optimizer step of
  device-model devices (per device): ``max_j inner_j + max_j optimizer_j``.

So ``duplex time = ψ_m + gradient syncs + max_j inner_j + max_j optimizer_j``. Stages: a step whose
feature communication takes time starts a stage (a step that only syncs gradients does not: its sync is
moved to the end). On flops-only devices the duplex time never exceeds the plain
:meth:`~hapnb.cost.model.CostModel.evaluate` time of the same program: ``ψ_m <= sum_i 2 (c_i + p_i)``, the
plain stage sum, and the gradient syncs cost the same; without feature communication they are equal
when the same device is the slowest in every plain stage (e.g. on one device). With device models or
virtual devices the duplex can cost more: the plain model lets a device's optimizer step or inner sync
fill its idle time in the last stage, the duplex charges them after both micro-batches.

The forward and backward collectives of a stage are charged together, as the plain model does (HiDup: the
backward's pairs overlap as the forward's do).

For the search (:class:`~hapnb.synth.search.Search` with ``duplex=True``): :func:`priority`, an admissible
bound of the duplex time from a partial program's label, and :func:`dominates`, HiDup's Pareto
dominance generalised to a stage that is still open (proofs in their docstrings).

>>> psi_phi([(0.0, 2.0), (3.0, 1.0)])  # stage 1: compute 2; stage 2: comm 3, compute 1 (per micro-batch)
(((4.0, -2.0), (9.0, -1.0)), 9.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cost.model import CostModel, Step, Term

__all__ = [
    "DuplexStage",
    "DuplexEvaluation",
    "duplex_cost",
    "duplex_evaluate",
    "duplex_stages",
    "psi_phi",
    "next_psi",
    "feature_terms",
    "gradient_terms",
    "priority",
    "dominates",
    "label_step",
    "label_close",
]


def next_psi(psi: float, phi: float, comm: float, comp: float) -> tuple[float, float]:
    """HiDup eq. (4)-(5): ``(ψ_i, φ_i)`` from ``(ψ_{i-1}, φ_{i-1})`` and stage i's per-micro-batch
    communication and computation."""
    return psi + phi + max(-phi, comm) + max(comm, comp) + comp, -comp


def psi_phi(stages: Sequence[tuple[float, float]]) -> tuple[tuple[tuple[float, float], ...], float]:
    """``((ψ_i, φ_i) per stage, ψ_m)`` for per-micro-batch ``(comm_i, comp_i)`` pairs."""
    psi = phi = 0.0
    out = []
    for comm, comp in stages:
        psi, phi = next_psi(psi, phi, comm, comp)
        out.append((psi, phi))
    return tuple(out), psi


def feature_terms(cm: CostModel, step: Step) -> tuple[Term, ...]:
    """The step's per-batch communication (conversions, SFB factors): halved per micro-batch."""
    return tuple(tm for tm in cm.step_terms(step) if not tm.gradient)


def gradient_terms(cm: CostModel, step: Step) -> tuple[Term, ...]:
    """The step's gradient all-reduces: once per iteration, after both micro-batches."""
    return tuple(tm for tm in cm.step_terms(step) if tm.gradient)


def duplex_stages(
    cm: CostModel, program: Sequence[Step], ratios: Sequence[Sequence[float]] | None = None
) -> list[list[int]]:
    """Group step indices into duplex stages: a step whose feature communication takes time (at
    ``ratios``; without ratios, the LP's view: any feature term but a reshard) starts a stage."""
    return cm.stages(program, ratios, lambda st: feature_terms(cm, st))


@dataclass(frozen=True)
class DuplexStage:
    """One duplex stage, per micro-batch: ``comm_s`` and per-device ``comp_s``; ``psi``/``phi`` after it."""

    index: int
    steps: tuple[int, ...]
    comm_s: float
    comp_s: tuple[float, ...]
    psi: float
    phi: float


@dataclass(frozen=True)
class DuplexEvaluation:
    """``cost_s = psi + gradient_s + inner_s + optimizer_s`` (see the module docstring)."""

    cost_s: float
    psi: float
    gradient_s: float
    inner_s: float
    optimizer_s: float
    stages: tuple[DuplexStage, ...]


def duplex_evaluate(
    cm: CostModel, program: Sequence[Step], ratios: Sequence[Sequence[float]]
) -> DuplexEvaluation:
    """The duplex iteration time of ``program`` at ``ratios``, with the per-stage ψ/φ breakdown."""
    n = cm.n
    grad = 0.0
    inner = [0.0] * n
    for st in program:
        grad += sum(tm.time(ratios) for tm in gradient_terms(cm, st))
        for ld in st.loads:
            for j, x in enumerate(cm.load_comp(ld, ratios)):
                inner[j] += x
    psi = phi = 0.0
    stages = []
    for k, idx in enumerate(duplex_stages(cm, program, ratios)):
        comm = 0.5 * sum(tm.time(ratios) for i in idx for tm in feature_terms(cm, program[i]))
        comp = [0.0] * n
        for i in idx:
            for j, x in enumerate(cm.comp(program[i].op, program[i].strategy, ratios)):
                comp[j] += 0.5 * x
        psi, phi = next_psi(psi, phi, comm, max(comp))
        stages.append(DuplexStage(k, tuple(idx), comm, tuple(comp), psi, phi))
    opt = cm.optimizer_comp(program, ratios) if any(cm.models) else (0.0,) * n
    inner_s, opt_s = max(inner, default=0.0), max(opt, default=0.0)
    return DuplexEvaluation(psi + grad + inner_s + opt_s, psi, grad, inner_s, opt_s, tuple(stages))


def duplex_cost(cm: CostModel, program: Sequence[Step], ratios: Sequence[Sequence[float]]) -> float:
    """The duplex iteration time (seconds) of ``program`` at ``ratios``."""
    return duplex_evaluate(cm, program, ratios).cost_s


# ---------------------------------------------------------------------------------- for the search
#: A search label: ``(base, acc, copen, tail)``. ``base`` is HiDup's ``ψ_{i-1} + φ_{i-1} + max(-φ_{i-1},
#: c_i)`` of the open stage i plus the gradient syncs so far, ``acc`` the open stage's per-device
#: computation, ``copen`` its feature communication (both full batch), ``tail`` the per-device inner syncs.
Label = tuple[float, tuple[float, ...], float, tuple[float, ...]]


def label_step(
    base: float,
    copen: float,
    acc: tuple[float, ...],
    opens: bool,
    comm_s: float,
    gradient_s: float,
    comp: tuple[float, ...],
) -> tuple[float, float, tuple[float, ...]]:
    """A search label's ``(base, copen, acc)`` after one more step (``comm_s``: its feature communication,
    ``gradient_s``: its gradient syncs, charged whole, once; ``comp``: its per-device computation, full
    batch). A step that communicates (or the first) closes the open stage i with HiDup's eq. (4)-(5) at
    half batch and opens the next; any other joins the open stage.

    >>> label_step(0.0, 0.0, (2.0, 1.0), True, 4.0, 0.5, (3.0, 3.0))
    (3.5, 4.0, (3.0, 3.0))
    """
    if comm_s > 0.0 or opens:
        p = 0.5 * max(acc)
        return base + max(0.5 * copen, p) + max(p, 0.5 * comm_s) + gradient_s, comm_s, comp
    return base + gradient_s, copen, tuple(a + b for a, b in zip(acc, comp))


def label_close(copen: float, acc: Sequence[float], tail: Sequence[float]) -> float:
    """What closing a complete program's label adds to its ``base``: the open stage at half batch (its
    communication, then its computation) and the per-device inner syncs at the end.

    >>> label_close(2.0, (4.0, 2.0), (0.5, 0.25))
    4.5
    """
    p = 0.5 * max(acc)
    return max(0.5 * copen, p) + p + max(tail)


def priority(
    base: float,
    copen: float,
    acc: Sequence[float],
    tail: Sequence[float],
    rem: Sequence[float],
    w: Sequence[float],
    spine: float | None = None,
    spine_comm: float | None = None,
) -> float:
    """A lower bound of the complete program's duplex time from a label (the duplex A* priority).

    With ``p_k``/``c_k`` the per-micro-batch computation/communication of stage k (i the open one),
    ``ψ_m = base + max(c_i, p_i) + sum_{k>i} [max(p_{k-1}, c_k) + max(c_k, p_k)] + p_m``:

    * computation: ``>= base + max(c_i + p_i, 2 p_i) + 2 sum_{k>i} p_k``; each ``2 p_k`` is at least any
      device's full-batch computation of stage k, so ``2 sum_{k>=i} p_k >= M = max_j (acc_j + rem_j)``
      (``rem``: the remaining computation at infinite bandwidth) and ``p_i + 2 sum_{k>i} p_k >= M/2``:
      ``ψ_m >= base + max(M, copen/2 + M/2)``;
    * half of everything: taking ``c_i``, then ``p_{k-1}`` and ``c_k`` from the later maxima, and
      ``p_m``: ``ψ_m >= base + c_i + sum_{k>=i} p_k + sum_{k>i} c_k``, half the full-batch computation
      (on any one device, weights ``w``) and communication still to come, at least half the plain spine
      bound ``spine`` (whose gradient syncs the duplex charges whole): ``base + (copen + w.acc +
      spine)/2``;
    * communication: ``c_k`` from both maxima of every later stage: ``ψ_m >= base + c_i + sum_{k>i} 2
      c_k``, all feature communication still to come at full batch, at least the spine's communication
      alone ``spine_comm``: ``base + copen/2 + spine_comm``.

    The inner syncs at the end only grow: ``+ max_j tail_j``.

    >>> priority(1.0, 2.0, (3.0, 1.0), (0.0, 0.0), (1.0, 5.0), (1.0, 0.0))  # 1 + max_j(acc_j + rem_j)
    7.0
    >>> priority(1.0, 2.0, (3.0, 1.0), (0.0, 0.0), (1.0, 5.0), (1.0, 0.0), None, 8.0)  # 1 + 2/2 + 8
    10.0
    """
    m = max(a + r for a, r in zip(acc, rem))
    h = max(m, 0.5 * (copen + m))
    if spine is not None:
        h = max(h, 0.5 * (copen + sum(x * a for x, a in zip(w, acc)) + spine))
    if spine_comm is not None:
        h = max(h, 0.5 * copen + spine_comm)
    return base + h + max(tail, default=0.0)


def dominates(a: Label, b: Label, eps: float = 0.0) -> bool:
    """Whether label ``a`` is no worse than ``b`` at the same search state (HiDup Theorem 1, generalised
    to a stage still open).

    Two labels at one state have the same completions. For a completion, the final time is ``base +
    max(copen/2, q) + G(q) + max_j (tail_j + T_j)`` where ``q`` is the open stage's final per-micro-batch
    computation (``max_j (acc_j + Δ_j) / 2``) and ``G`` is non-decreasing and 1-Lipschitz (``max(q,
    c_{i+1})`` and the rest, or ``q`` alone). With ``D = max(0, max_j (acc_a,j - acc_b,j))`` and ``E``
    likewise for ``tail``, ``q_a <= q_b + D/2``, so ``a`` is no worse for every completion if ``base_a +
    D + E <= base_b`` and ``base_a + (copen_a + D)/2 + E <= base_b + max(copen_b, max acc_b)/2`` (``q_b``
    is at least ``max acc_b / 2``). HiDup's rule (ψ and φ no larger; φ = -p: more computation in the
    last stage leaves more room to overlap the next communication) is the case of labels that have just
    opened a stage with the same step: ``base = ψ + φ + max(-φ, c_i)`` grows with ψ and with φ, and D = E
    = 0.

    >>> dominates((1.0, (2.0, 2.0), 0.0, (0.0,)), (1.5, (1.8, 2.0), 0.0, (0.0,)))
    True
    >>> dominates((1.0, (2.0, 2.0), 4.0, (0.0,)), (1.0, (2.0, 2.0), 0.0, (0.0,)))
    False
    """
    b0, a0, c0, t0 = a
    b1, a1, c1, t1 = b
    d = max(0.0, max(x - y for x, y in zip(a0, a1)))
    e = max(0.0, max((x - y for x, y in zip(t0, t1)), default=0.0))
    return b0 + d + e <= b1 + eps and b0 + 0.5 * (c0 + d) + e <= b1 + 0.5 * max(c1, max(a1)) + eps
