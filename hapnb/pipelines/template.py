"""The homogeneous template search (Oobleck §4.1.2 as Ditto uses it, §3 and §6): the best pipeline of
the model's units on ``devices`` identical devices (the folded cluster's weakest class), stages of
``widths`` devices each, minimising ``T1 + T2 + T3`` (:mod:`hapnb.pipelines.timing`).

Dynamic programming over suffixes: a state is ``(u, used)`` — units ``[u, L)`` already placed on
``used`` devices — holding the Pareto set of its partial pipelines (sum of stage times, the maxima the
schedule's steady state and tail need, stages so far), so the optimum of the non-additive objective is
exact. Every device is used; a stage gets at most one node's devices (Oobleck) and at most one device per
sample of the micro-batch.

>>> from hapnb.hardware.cluster import Cluster
>>> from hapnb.pipelines.costs import model_costs
>>> from hapnb.pipelines.timing import Pricer
>>> c = Cluster.parse("4xV100")
>>> p = Pricer(model_costs("gpt", c, micro_batch=2, layers=4, hidden=32, heads=4, seq=8, vocab=64), c, 8)
>>> t = homogeneous_template(p, 4, (1,))
>>> len(t.stages), [b - a for a, b, _ in t.stages]
(4, [2, 2, 1, 1])
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from .timing import ROOT, Frontier, Pricer, stages_of

__all__ = ["Template", "homogeneous_template"]


@dataclass(frozen=True)
class Template:
    """A homogeneous pipeline template: stages ``(start unit, stop unit, devices)`` on class ``cls``."""

    stages: tuple[tuple[int, int, int], ...]
    iteration_s: float
    cls: int
    planning_s: float = 0.0

    @property
    def devices(self) -> int:
        return sum(g for _, _, g in self.stages)


def homogeneous_template(
    pricer: Pricer, devices: int, widths: Sequence[int], cls: int = 0
) -> Template | None:
    """The fastest template of the units on ``devices`` devices of class ``cls`` with stage widths from
    ``widths`` (every device used), or None when none fits in memory."""
    t0 = time.perf_counter()
    L = pricer.L
    widths = sorted({w for w in widths if 1 <= w <= min(devices, pricer.b)})
    if not widths:
        return None
    widest = widths[-1]
    states: list[dict[int, Frontier]] = [dict() for _ in range(L + 1)]
    root = pricer.frontier()
    root.add(ROOT)
    states[L][0] = root
    for u in range(L, 0, -1):
        for used, front in sorted(states[u].items()):
            for v in range(u - 1, -1, -1):
                for g in widths:
                    left = devices - used - g
                    if left < 0 or (v == 0) != (left == 0) or v < -(-left // widest) or left > v * widest:
                        continue
                    st = pricer.stage(v, u, pricer.counts(cls, g))
                    if st is None:
                        continue
                    target = states[v].get(used + g)
                    for lab in front.labels:
                        new = pricer.extend(lab, st, (v, u, g))
                        if new is None:
                            continue
                        if target is None:
                            target = states[v][used + g] = pricer.frontier()
                        target.add(new)
    final = states[0].get(devices)
    if final is None or not len(final):
        return None
    best = pricer.best(final.labels)
    stages = tuple(stages_of(best))
    return Template(stages, pricer.total(best), cls, time.perf_counter() - t0)  # type: ignore[arg-type]
