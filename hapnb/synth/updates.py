"""Buffer updates in the search's cost: the collectives a training batch norm's running-statistics update
runs after the forward (:mod:`hapnb.cost.buffers`), charged as soon as a partial program decides them.

:meth:`hapnb.cost.model.CostModel.evaluate` charges :func:`hapnb.cost.buffers.update_collectives` to the last
stage: per statistic the update reads, nothing if the program holds it replicated (``I``), an all-reduce
if it holds it only partial (``R``), an all-gather if only sharded; per weight the update reads, an
all-gather if the program loads it stored sharded. Their time adds to the iteration (no stage opens for
them), so the search adds each to a node's closed cost where it is decided: a statistic when it dies (its
last reader ran, so every form it will have is in the properties; one no op reads, when the program
completes), a weight when it is loaded. Two programs with the same properties have then paid for every
update they decided and face the same ones still open, so dominance stays exact and the search's cost is
the cost model's. Without it the search left them out: on ResNet-50 (real size, even ratios) its
program cost 0.4034 s in the search and 0.4057 s in the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cost.buffers import update_reads

__all__ = ["BufferUpdates"]

#: a statistic's row: (its form bits, the bits of its I forms, of its R forms, all-reduce s, all-gather s)
Row = tuple[int, int, int, float, float]


class BufferUpdates:
    """The update charges of one search: :meth:`step` for a step's dying statistics and loads, :meth:`end`
    for the statistics no op reads. ``rows_at[pos]`` holds the statistics whose last reader is op ``pos``."""

    def __init__(self, graph: Any, theory: Any, tables: Any, cost_model: Any) -> None:
        self.rows_at: dict[int, list[Row]] = {}
        self.end_rows: list[Row] = []
        self.weights: dict[int, float] = {}  # an update-read weight -> its all-gather when stored sharded
        if cost_model.n <= 1:
            return
        done: set[int] = set()
        for r in update_reads(graph):
            for t in (*r.activations, *r.weights):
                if t in done:
                    continue
                done.add(t)
                tr = graph.tensors[t]
                gather = cost_model._t("all_gather", float(tr.nbytes))
                if tr.role in ("param", "buffer", "const"):
                    self.weights[t] = gather
                    continue
                ibits = rbits = 0
                for f, b in zip(theory.forms[t], tables.bits_of[t]):
                    if f.kind == "I":
                        ibits |= b
                    elif f.kind == "R":
                        rbits |= b
                row = (tables.tmask[t], ibits, rbits, cost_model._t("all_reduce", float(tr.nbytes)), gather)
                last = tables.last_use[t]
                (self.rows_at.setdefault(last, []) if last >= 0 else self.end_rows).append(row)

    def __bool__(self) -> bool:
        return bool(self.rows_at or self.end_rows or self.weights)

    def step(self, rows: Sequence[Row], props: int, loads: Sequence[Any]) -> float:
        """Seconds decided by a step: its dying statistics' (``rows``, with the step's properties ``props``
        before they die) and the update-read weights it loads stored sharded."""
        v = _charge(rows, props)
        if self.weights:
            for ld in loads:
                if ld.tensor in self.weights and ld.storage.kind == "G":
                    v += self.weights[ld.tensor]
        return v

    def end(self, props: int) -> float:
        """Seconds of the statistics no op reads, from a complete program's properties."""
        return _charge(self.end_rows, props)


def _charge(rows: Sequence[Row], props: int) -> float:
    v = 0.0
    for mask, ibits, rbits, reduce_s, gather_s in rows:
        have = props & mask
        if have and not have & ibits:
            v += reduce_s if have & rbits else gather_s
    return v
