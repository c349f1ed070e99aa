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

from ..cost.buffers import UpdateCollective, update_inputs, update_kind

__all__ = ["BufferUpdates"]


class BufferUpdates:
    """The update charges of one search: :meth:`step` for a step's dying statistics and loads, :meth:`end`
    for the statistics no op reads. ``rows_at[pos]`` holds the statistics (tensor, its form bits) whose last
    reader is op ``pos``. The rule and the price are the cost model's
    (:func:`hapnb.cost.buffers.update_kind`, :meth:`hapnb.cost.model.CostModel.update_term`), kept per
    (tensor, present forms)."""

    def __init__(self, graph: Any, tables: Any, cost_model: Any) -> None:
        self.graph, self.tables, self.cm = graph, tables, cost_model
        self.rows_at: dict[int, list[tuple[int, int]]] = {}
        self.end_rows: list[tuple[int, int]] = []
        self.weights: dict[int, float] = {}  # an update-read weight -> its all-gather when stored sharded
        self._s: dict[tuple[int, int], float] = {}
        if cost_model.n <= 1:
            return
        for _, t in update_inputs(graph):
            gather = self._seconds(t, update_kind(graph, t, (), True))
            if gather:  # a weight: charged when it is loaded stored sharded
                self.weights[t] = gather
                continue
            last = tables.last_use[t]
            (self.rows_at.setdefault(last, []) if last >= 0 else self.end_rows).append((t, tables.tmask[t]))

    def __bool__(self) -> bool:
        return bool(self.rows_at or self.end_rows or self.weights)

    def step(self, rows: Sequence[tuple[int, int]], props: int, loads: Sequence[Any]) -> float:
        """Seconds decided by a step: its dying statistics' (``rows``, with the step's properties ``props``
        before they die) and the update-read weights it loads stored sharded."""
        v = self._charge(rows, props)
        if self.weights:
            for ld in loads:
                if ld.tensor in self.weights and ld.storage.kind == "G":
                    v += self.weights[ld.tensor]
        return v

    def form_prices(self) -> dict[int, list[float]]:
        """Per statistic an update reads (by tensor id), its update's price if the program held it in each of its
        forms alone (``theory.forms`` order): what the A* bound charges it as one more consumer
        (:mod:`hapnb.synth.heuristic_side`). With more forms present the update costs at least the least of
        theirs (nothing with ``I``, an all-reduce with ``R``, else an all-gather), so the bound stays below it."""
        bits_of = self.tables.bits_of
        return {t: [self._price(t, b) for b in bits_of[t]] for rows in self.rows_at.values() for t, _ in rows}

    def end(self, props: int) -> float:
        """Seconds of the statistics no op reads, from a complete program's properties."""
        return self._charge(self.end_rows, props)

    def _charge(self, rows: Sequence[tuple[int, int]], props: int) -> float:
        v = 0.0
        for t, mask in rows:
            have = props & mask
            if have:
                v += self._price(t, have)
        return v

    def _price(self, t: int, have: int) -> float:
        """The update's seconds for statistic ``t`` held in the forms of property bits ``have`` (kept)."""
        x = self._s.get((t, have))
        if x is None:
            forms, bits = [], have
            while bits:
                low = bits & -bits
                forms.append(self.tables.forms_of_bit[low][1])
                bits ^= low
            x = self._s[(t, have)] = self._seconds(t, update_kind(self.graph, t, forms, False))
        return x

    def _seconds(self, t: int, kind: str) -> float:
        """The cost model's price of an update's ``kind`` collective on tensor ``t`` (0 for none)."""
        if not kind:
            return 0.0
        nbytes = self.graph.tensors[t].nbytes
        return self.cm.update_term(UpdateCollective(kind, t, nbytes, "")).const  # no ratio in it
