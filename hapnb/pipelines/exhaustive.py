"""The exhaustive heterogeneous search (Ditto §3: Oobleck's template search extended to device-type
vectors), the reference Ditto's planner is measured against.

The space: any number of stages, any contiguous cut of the units, each stage on any non-empty vector
``x' = (d'_1, ..., d'_m)`` of devices per class (classes may mix inside a stage; its micro-batch samples
go to whichever device finishes them first), at most one device per sample, devices of one stage not
used by another; devices may stay idle. Dynamic programming over suffixes: state ``(u, used)`` — units
``[u, L)`` placed on the device vector ``used`` — with the Pareto set of partial pipelines
(:class:`~hapnb.pipelines.timing.Frontier`), so the result is the optimum of ``T1 + T2 + T3`` over the
whole space. Its size is what makes it slow: ``L^2/2 * prod_i (N_i + 1)`` states-and-cuts times the
stage vectors, Ditto's ``O((L - n) L^3 (n_max M + 1)^m)``.

``budget_s`` bounds the wall time: when it runs out the result says so (``finished=False``), how far it
got (the suffix start ``stopped_at`` it was expanding, the share of transitions done) and the best
complete pipeline seen so far (a single first stage in front of a finished suffix), and extrapolates
the full run's time from the measured rate (an underestimate: later states hold more partial pipelines;
on ditto-ex1 the extrapolation from 30 s said 42 s, the full run took 79 s).

``prune=True`` adds branch and bound: a partial pipeline is dropped when even a perfectly balanced rest
(the remaining units' work spread over the remaining devices at each class's best speed-up over the
weakest) cannot beat ``upper_bound`` or the best complete pipeline so far — still exact when it
finishes.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from .timing import ROOT, Frontier, Label, Pricer, stages_of

__all__ = ["ExhaustiveResult", "exhaustive"]


@dataclass(frozen=True)
class ExhaustiveResult:
    stages: tuple[tuple[int, int, tuple[int, ...]], ...]  # best found (empty if none)
    iteration_s: float  # math.inf when none found
    finished: bool
    planning_s: float
    transitions: int  # (state, cut, device vector) triples expanded
    total_transitions: int  # of the full, unpruned run
    stopped_at: int | None  # the suffix start being expanded when the budget ran out
    labels: int  # partial pipelines kept
    pruned: bool

    @property
    def optimal(self) -> bool:
        return self.finished and bool(self.stages)

    @property
    def extrapolated_s(self) -> float:
        """The full unpruned run's time at the measured rate (the measured time when it finished
        unpruned). An underestimate: the states expanded later hold more partial pipelines."""
        if self.finished and not self.pruned:
            return self.planning_s
        rate = self.transitions / self.planning_s if self.planning_s > 0 else 0.0
        return self.total_transitions / rate if rate > 0 else math.inf

    def to_json(self) -> dict[str, object]:
        return {
            "finished": self.finished,
            "optimal": self.optimal,
            "iteration_s": self.iteration_s if math.isfinite(self.iteration_s) else None,
            "planning_s": self.planning_s,
            "transitions": self.transitions,
            "total_transitions": self.total_transitions,
            "stopped_at": self.stopped_at,
            "labels": self.labels,
            "pruned": self.pruned,
            "extrapolated_s": self.extrapolated_s if math.isfinite(self.extrapolated_s) else None,
        }


def _vectors(limit: tuple[int, ...], most: int) -> list[tuple[int, ...]]:
    """Every non-zero vector ``<= limit`` with at most ``most`` devices in all."""
    out = []
    for v in itertools.product(*(range(n + 1) for n in limit)):
        if 0 < sum(v) <= most:
            out.append(v)
    out.sort(key=lambda v: (sum(v), v))
    return out


def _total_transitions(pricer: Pricer, limit: tuple[int, ...], vecs: list[tuple[int, ...]]) -> int:
    """Transitions of the full run: for every suffix start u and device vector used, u cuts times the
    stage vectors that still fit (an upper bound: some states are never reached)."""
    L = pricer.L
    per_used = 0
    for used in itertools.product(*(range(n + 1) for n in limit)):
        per_used += sum(1 for v in vecs if all(a + b <= n for a, b, n in zip(used, v, limit)))
    return per_used * L * (L + 1) // 2


def exhaustive(
    pricer: Pricer,
    *,
    budget_s: float | None = 60.0,
    upper_bound: float | None = None,
    prune: bool = True,
) -> ExhaustiveResult:
    """The exhaustive search (module docstring); ``upper_bound``: the time of a known pipeline."""
    t0 = time.perf_counter()
    L, N = pricer.L, pricer.N
    classes = pricer.classes
    limit = tuple(c.count for c in classes)
    vecs = _vectors(limit, pricer.b)
    best: Label | None = None
    best_t = upper_bound if (prune and upper_bound is not None) else math.inf
    best_t_found = math.inf

    states: list[dict[tuple[int, ...], Frontier]] = [dict() for _ in range(L + 1)]
    root = pricer.frontier()
    root.add(ROOT)
    states[L][tuple(0 for _ in classes)] = root
    transitions = 0
    kept = 1
    stopped_at = None
    finished = True
    n_cls = len(classes)
    for u in range(L, 0, -1):
        if stopped_at is not None:
            break
        for used, front in sorted(states[u].items()):
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                stopped_at, finished = u, False
                break
            labels = front.labels
            low_sum = min(lab[0] for lab in labels)
            low_max = min(lab[1] + lab[2] for lab in labels)
            room = tuple(n - x for n, x in zip(limit, used))
            for x in vecs:
                if any(x[i] > room[i] for i in range(n_cls)):
                    continue
                nu = tuple(used[i] + x[i] for i in range(n_cls))
                left = tuple(limit[i] - nu[i] for i in range(n_cls))
                for v in range(u - 1, -1, -1):
                    transitions += 1
                    st = pricer.stage(v, u, x)
                    if st is None:
                        break  # more devices than samples: no cut helps
                    if prune and (N - 1) * st.compute >= best_t:
                        break  # every longer stage is slower still
                    rest = pricer.rest(v, left)
                    if prune:
                        fb = st.F + st.B + 2 * st.link
                        if low_sum + fb + rest + (N - 1) * max(low_max, st.compute, rest) + st.A >= best_t:
                            continue
                    target = states[v].get(nu) if v > 0 else None
                    for lab in labels:
                        new = pricer.extend(lab, st, (v, u, x))
                        if new is None:
                            continue
                        if v == 0:
                            t = pricer.total(new)
                            if t < best_t_found:
                                best, best_t_found = new, t
                                best_t = min(best_t, t)
                            continue
                        if prune and pricer.lower(new, rest) >= best_t:
                            continue
                        if target is None:
                            target = states[v][nu] = pricer.frontier()
                        if target.add(new):
                            kept += 1
        states[u] = {}  # expanded: free the memory
    total = _total_transitions(pricer, limit, vecs) if not finished or prune else transitions
    stages = tuple(stages_of(best)) if best is not None else ()
    return ExhaustiveResult(
        stages=stages,  # type: ignore[arg-type]
        iteration_s=best_t_found,
        finished=finished,
        planning_s=time.perf_counter() - t0,
        transitions=transitions,
        total_transitions=total,
        stopped_at=stopped_at,
        labels=kept,
        pruned=prune,
    )
