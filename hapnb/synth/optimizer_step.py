"""The optimizer step in the search's cost: on device-model devices
:meth:`hapnb.cost.model.CostModel.evaluate` adds the optimizer step (Adam over each device's parameter bytes,
:meth:`~hapnb.cost.model.CostModel.optimizer_param`) to the last stage's computation, so the last stage costs
its communication plus ``max_j (computation_j + optimizer_j)``.

The step depends on the program only through how each parameter is stored: its whole bytes when kept
replicated, its share when stored sharded. The search adds each parameter's part, per device class, to a
node's ``tail`` when the program loads it (its storage is decided there; a storage deferred under memory
pruning counts its shard, the least, and its realised storage at the end), and the launches (the same
for every program) when it completes, where the last stage closes at ``max(acc + tail)``. Dominance
compares the tails too, so the search stays exact. Without it the search's cost left the step out: on the
``h100x8`` preset its optimum was 3.5-5 % below the cost model's cost of the same program, and a program
that stores its weights sharded (less optimizer work) was not credited for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cost.model import Load

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """The optimizer step's parts for one search over ``cost_model`` at ``ratios``, per device class of
    ``reps`` (one device index per class, :func:`hapnb.synth.tables.ratio_classes`)."""

    def __init__(
        self, cost_model: Any, theory: Any, ratios: Sequence[Sequence[float]], reps: Sequence[int]
    ) -> None:
        self.cm, self.theory, self.ratios, self.reps = cost_model, theory, ratios, tuple(reps)
        g = cost_model.graph
        n_params = sum(1 for t in g.params if g.tensors[t].role == "param" and g.tensors[t].consumers)
        launches = cost_model.optimizer_launches(n_params)
        self.launches = tuple(launches[j] for j in self.reps)
        self._of: dict[tuple[int, Any], tuple[float, ...] | None] = {}

    def part(self, ld: Load) -> tuple[float, ...] | None:
        """A load's part per device class (None: not a parameter)."""
        key = (ld.tensor, ld.storage)
        v = self._of.get(key)
        if v is None and key not in self._of:
            if self.cm.graph.tensors[ld.tensor].role == "param":
                seg, per = self.cm.optimizer_param(ld.tensor, ld.storage)
                v = tuple(per[j] * (self.ratios[seg][j] if seg >= 0 else 1.0) for j in self.reps)
            self._of[key] = v
        return v

    def add(self, tail: tuple[float, ...], loads: Sequence[Load]) -> tuple[float, ...]:
        """``tail`` with the parts of the parameters ``loads`` loads."""
        for ld in loads:
            v = self.part(ld)
            if v is not None:
                tail = tuple(a + b for a, b in zip(tail, v))
        return tail

    def realized(
        self, tail: tuple[float, ...], deferred: Sequence[Load], real: Sequence[Load]
    ) -> tuple[float, ...]:
        """``tail`` with deferred storages (counted as their shard) replaced by their realised loads."""
        for d, r in zip(deferred, real):
            a, b = self.part(d), self.part(r)
            if a is not None and b is not None:
                tail = tuple(x - u + w for x, u, w in zip(tail, a, b))
        return tail

    def close(self, acc: tuple[float, ...], tail: tuple[float, ...]) -> float:
        """The last stage's computation: the slowest device class's with its optimizer step."""
        return max(a + t + c for a, t, c in zip(acc, tail, self.launches))

    def least(self, t: int, f: Any, lean: bool) -> tuple[float, ...]:
        """Parameter ``t`` used in form ``f``: its part stored as ``f`` (``lean``: where its storage may still
        be sharded, as a deferred or ZeRO-pinned one, the least over its sharded forms and ``f``)."""
        return self._least(
            t, [f, *(x for x in self._forms(t) if x.kind == "G")] if lean and f.kind == "I" else [f]
        )

    def excess(self, t: int, f: Any, lean: bool, j: int) -> float:
        """What parameter ``t`` used in form ``f`` adds on device class ``j`` to the least part over its
        storage forms, which :meth:`bounds` counts for a weight that several ops take: the bound adds it where
        it prices that weight's load (:mod:`hapnb.synth.heuristic_side`), so the weight's step is counted
        once, in full."""
        if self.cm.graph.tensors[t].role != "param":
            return 0.0  # a buffer or constant: no optimizer step
        return self.least(t, f, lean)[j] - self._least(t, self._forms(t))[j]

    def bounds(
        self, rem: Sequence[tuple[float, ...]], jstar: int, single: Sequence[bool]
    ) -> tuple[list[tuple[float, ...]], list[float]]:
        """The search heuristic's parts, per position (0 .. number of ops): the remaining computation
        ``rem`` with the least step the program still adds from there (the launches, and each parameter not
        loaded yet, its first consumer at or after the position, in its leanest storage), and that least step
        on device class ``jstar`` without the single-consumer weights (``single``), whose parts the spine
        terms price with their loads (:func:`hapnb.synth.heuristic.local_pricer`)."""
        g = self.cm.graph
        every = [[0.0] * len(self.reps) for _ in range(len(g.ops) + 1)]  # by the position first loaded
        off_spine = [0.0] * (len(g.ops) + 1)
        for t in g.params:
            tr = g.tensors[t]
            if tr.role != "param" or not tr.consumers:
                continue
            v, first = self._least(t, self._forms(t)), min(tr.consumers)
            for j, x in enumerate(v):
                every[first][j] += x
            if not single[t]:
                off_spine[first] += v[jstar]
        with_step, on_j = [], []
        acc, acc_j = list(self.launches), self.launches[jstar]
        for pos in range(len(g.ops), -1, -1):  # suffix sums, from the end
            acc = [a + b for a, b in zip(acc, every[pos])]
            acc_j += off_spine[pos]
            with_step.append(tuple(a + b for a, b in zip(rem[pos], acc)))
            on_j.append(acc_j)
        return with_step[::-1], on_j[::-1]

    def _least(self, t: int, forms: Sequence[Any]) -> tuple[float, ...]:
        """Parameter ``t``'s least part over its storage ``forms``, per device class."""
        return tuple(map(min, zip(*(self.part(Load(t, f)) for f in forms))))

    def _forms(self, t: int) -> list[Any]:
        """The storage forms parameter ``t`` can have (replicated or sharded)."""
        return [f for f in self.theory.forms[t] if f.kind in "GI"]
