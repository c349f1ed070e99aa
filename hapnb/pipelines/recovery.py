"""Plan recovery (Ditto §6): from a virtual template on the folded cluster back to real devices.

* **DP recovery** (Alg. 2, §6.2): the virtual template has ``S`` one-device stages (``S`` = the folded
  cluster's devices). A *choice* ``(i, x, y)`` puts ``x`` devices of class ``i`` (``1 <= x <= M_i``, at
  most one node, and at most one device per sample) on ``y = x d_i`` consecutive virtual stages, merged
  into one real stage priced with class i's real costs. Choices tile the virtual stages from the last one
  backwards; since ``sum_i N_i d_i = S``, a complete tiling uses every device. Unlike the paper's
  one-dimensional table (one best partial template per position, which can discard the partial template a
  later choice needs), a state here is the vector of devices used so far (it fixes the position) with the
  Pareto set of its partial pipelines: the result is the optimum over every tiling, i.e. exact over the
  DP's own search space, in ``O(S * prod_i (N_i + 1) * sum_i M_i)`` label extensions. When the model has
  fewer units than virtual devices (Ditto §6.4's limitation) the template has one unit per stage and a
  choice may cover ``1..x d_i`` of them, leaving devices unused when that is faster.
* **Greedy recovery** (Alg. 1, §6.1): the fastest homogeneous template (stages of several virtual
  devices) keeps its layer cuts; classes from the strongest down give each stage ``ceil(g / d_i)``
  devices, the stage picked so that the estimated iteration (unassigned stages still on their virtual
  devices) is fastest. Devices left when every stage has some join the stage they speed up most; stages
  left without devices merge into a neighbour.
* **Cut refinement** (:func:`refine_cuts`, beyond the paper): both recoveries inherit the virtual
  template's cuts, balanced for one weakest device per virtual stage; Ditto §6.4 names the cost of that
  (a merged stage gets a whole number of virtual stages whatever their real cost). For the recovered
  sequence of device groups, a DP over (groups placed, first unit placed) re-chooses every cut, exactly
  (the recovered cuts are one candidate, so it never gets slower), in ``O(K L^2)`` for ``K`` stages.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .folding import Folding
from .template import Template
from .timing import ROOT, Frontier, Pricer, stages_of

__all__ = ["Recovered", "dp_recovery", "greedy_recovery", "refine_cuts"]

Stage = tuple[int, int, tuple[int, ...]]  # (start unit, stop unit, devices per class)


@dataclass(frozen=True)
class Recovered:
    """A real pipeline: stages ``(start unit, stop unit, devices per class)`` and its time."""

    stages: tuple[Stage, ...]
    iteration_s: float
    method: str
    planning_s: float = 0.0
    note: str = ""


def dp_recovery(
    pricer: Pricer,
    folding: Folding,
    template: Template,
    widest: int | None = None,
    upper_bound: float | None = None,
) -> Recovered | None:
    """Ditto's DP recovery of ``template`` (one device per virtual stage); None when no tiling fits (or
    none beats ``upper_bound``, the time of a known pipeline: partial tilings that cannot are dropped).
    ``widest``: the most devices of a class in one stage (default one node, ``M_i``, as the paper)."""
    t0 = time.perf_counter()
    V = template.stages
    S = len(V)
    classes = pricer.classes
    d = [folding.factors[c.kind] for c in classes]
    limit = [c.count for c in classes]
    exact = S == folding.virtual_devices
    choices = []
    for i, c in enumerate(classes):
        for x in range(1, min(c.per_node if widest is None else widest, c.count, pricer.b) + 1):
            ys = [x * d[i]] if exact else list(range(1, x * d[i] + 1))
            choices += [(i, x, y) for y in ys]
    buckets: list[dict[tuple[int, ...], Frontier]] = [dict() for _ in range(S + 1)]
    root = pricer.frontier()
    root.add(ROOT)
    buckets[0][tuple(0 for _ in classes)] = root
    for pos in range(S):
        for used, front in sorted(buckets[pos].items()):
            for i, x, y in choices:
                if used[i] + x > limit[i] or pos + y > S:
                    continue
                a, b = V[S - pos - y][0], V[S - pos - 1][1]
                st = pricer.stage(a, b, pricer.counts(i, x))
                if st is None:
                    continue
                nu = tuple(u + (x if k == i else 0) for k, u in enumerate(used))
                rest = pricer.rest(a, [n - u for n, u in zip(limit, nu)]) if upper_bound is not None else 0.0
                target = buckets[pos + y].get(nu)
                for lab in front.labels:
                    new = pricer.extend(lab, st, (a, b, pricer.counts(i, x)))
                    if new is None:
                        continue
                    if upper_bound is not None and pricer.lower(new, rest) >= upper_bound:
                        continue
                    if target is None:
                        target = buckets[pos + y][nu] = pricer.frontier()
                    target.add(new)
    finals = [lab for f in buckets[S].values() for lab in f.labels]
    if not finals:
        return None
    best = pricer.best(finals)
    note = (
        "" if exact else f"{S} virtual stages for {folding.virtual_devices} virtual devices: relaxed tiling"
    )
    return Recovered(tuple(stages_of(best)), pricer.total(best), "dp", time.perf_counter() - t0, note)  # type: ignore[arg-type]


def greedy_recovery(pricer: Pricer, folding: Folding, template: Template) -> Recovered | None:
    """Ditto's greedy recovery of ``template`` (its stages keep their units); None when it does not fit."""
    t0 = time.perf_counter()
    classes = pricer.classes
    n = len(classes)
    virt = [(a, b, g) for a, b, g in template.stages]
    assign: list[tuple[int, ...] | None] = [None] * len(virt)

    def pipeline(asg: Sequence[tuple[int, ...] | None], spans: Sequence[tuple[int, int, int]]) -> list[Stage]:
        return [
            (a, b, c if c is not None else pricer.counts(template.cls, g)) for (a, b, g), c in zip(spans, asg)
        ]

    def cost(stages: Sequence[Stage]) -> float:
        lab = pricer.evaluate(stages)
        return math.inf if lab is None else pricer.total(lab)

    for i in range(n - 1, -1, -1):  # strongest class first
        left = classes[i].count
        while left > 0:
            free = [j for j, c in enumerate(assign) if c is None]
            if not free:
                break
            best = None
            for j in free:
                need = min(left, max(1, math.ceil(virt[j][2] / folding.factors[classes[i].kind])), pricer.b)
                trial = list(assign)
                trial[j] = pricer.counts(i, need)
                t = cost(pipeline(trial, virt))
                if best is None or t < best[0]:
                    best = (t, j, need)
            assert best is not None
            assign[best[1]] = pricer.counts(i, best[2])
            left -= best[2]
        while left > 0:  # every stage has devices: add the rest where they help most
            current = cost(pipeline(assign, virt))
            best = None
            for j, c in enumerate(assign):
                if c is None or sum(c) >= pricer.b:
                    continue
                trial = list(assign)
                trial[j] = tuple(x + (1 if k == i else 0) for k, x in enumerate(c))
                t = cost(pipeline(trial, virt))
                if t < current and (best is None or t < best[0]):
                    best = (t, trial)
            if best is None:
                break
            assign = best[1]
            left -= 1
    # stages left without devices merge into the neighbour that gives the faster pipeline
    spans = list(virt)
    while any(c is None for c in assign):
        j = next(k for k, c in enumerate(assign) if c is None)
        options = []
        for k in (j - 1, j + 1):
            if 0 <= k < len(spans):
                merged = (min(spans[j][0], spans[k][0]), max(spans[j][1], spans[k][1]), spans[k][2])
                s2 = [s for q, s in enumerate(spans) if q not in (j, k)]
                a2 = [c for q, c in enumerate(assign) if q not in (j, k)]
                at = min(j, k)
                s2.insert(at, merged)
                a2.insert(at, assign[k])
                options.append((cost(pipeline(a2, s2)), s2, a2))
        if not options:
            return None
        _, spans, assign = min(options, key=lambda o: o[0])
    stages = pipeline(assign, spans)
    lab = pricer.evaluate(stages)
    if lab is None:
        return None
    return Recovered(tuple(stages), pricer.total(lab), "greedy", time.perf_counter() - t0)


def refine_cuts(pricer: Pricer, rec: Recovered) -> Recovered:
    """``rec`` with the best cuts for its device groups, in order (see the module docstring)."""
    t0 = time.perf_counter()
    groups = [counts for _, _, counts in rec.stages]
    K, L = len(groups), pricer.L
    states: list[dict[int, Frontier]] = [dict() for _ in range(K + 1)]
    root = pricer.frontier()
    root.add(ROOT)
    states[0][L] = root
    bound = rec.iteration_s  # branch and bound: only cuts that beat the recovered ones are kept
    for k in range(K):
        x = groups[K - 1 - k]
        ahead = [sum(col) for col in zip(*groups[: K - 1 - k])] if k < K - 1 else []
        for u, front in sorted(states[k].items(), reverse=True):
            before = K - 1 - k  # groups still to place in front of this one, one unit each at least
            lo = before if k < K - 1 else 0
            hi = u - 1 if k < K - 1 else 0
            for v in range(hi, lo - 1, -1):
                st = pricer.stage(v, u, x)
                if st is None or (pricer.N - 1) * st.compute >= bound:
                    break  # longer stages only get slower
                rest = pricer.rest(v, ahead) if ahead else 0.0
                target = states[k + 1].get(v)
                for lab in front.labels:
                    new = pricer.extend(lab, st, (v, u, x))
                    if new is None or pricer.lower(new, rest) >= bound:
                        continue
                    if target is None:
                        target = states[k + 1][v] = pricer.frontier()
                    target.add(new)
    final = states[K].get(0)
    if final is None or not len(final):
        return rec
    best = pricer.best(final.labels)
    t = pricer.total(best)
    took = rec.planning_s + time.perf_counter() - t0
    if t >= rec.iteration_s:
        return dataclasses.replace(rec, planning_s=took)
    stages = tuple(stages_of(best))
    return dataclasses.replace(rec, stages=stages, iteration_s=t, planning_s=took)  # type: ignore[arg-type]
