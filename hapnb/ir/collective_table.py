"""HAP's collective instructions, declared once: what each one does to a tensor's form, what it costs
(the hardware collective kinds of its forward and of its dual in the backward, and how the bytes are
counted), and which runtime function runs it.

Read by the theory (:mod:`hapnb.triples`: the collective triples), the A* heuristic and the search
(:mod:`hapnb.synth.heuristic`: which names turn one form kind into another), the cost model
(:meth:`hapnb.cost.model.CostModel.conversion_terms`), the simulator (:mod:`hapnb.plans.simulation`:
the kinds and launches it re-prices), the plan (:attr:`hapnb.plans.plan.Instruction.communicates`) and
code generation (:mod:`hapnb.runtime.codegen`: the :mod:`hapnb.runtime.collectives` function).

Pricing (``n`` devices, ``bytes`` the whole tensor, ``t_k(b, launches)`` the cluster's linear model of
kind ``k``; the backward part only when the tensor needs a gradient):

============  =====================================================================================
pricing       forward (+ backward) time
============  =====================================================================================
``free``      nothing moves
``padded``    ``t_fwd(n * max_shard_bytes)`` (+ ``t_bwd`` of the same): shards padded to the largest
``grouped``   ``t_fwd(bytes, launches=n)`` (+ ``t_bwd`` of the same): one exact-size call per device
``full``      ``t_fwd(bytes)`` (+ ``t_bwd(bytes)``)
``exchange``  ``t_fwd(bytes one device sends)`` (+ ``t_bwd`` of the same)
============  =====================================================================================

>>> COLLECTIVES["grouped_all_gather"].forward, COLLECTIVES["grouped_all_gather"].backward
('broadcast', 'reduce')
>>> conversions("G", "I")
('all_gather', 'grouped_all_gather')
>>> sorted(FREE)
['slice', 'to_partial']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["CollectiveDef", "COLLECTIVES", "FREE", "PRICINGS", "conversions"]

#: how a collective's bytes are counted (see the module docstring)
PRICINGS = ("free", "padded", "grouped", "full", "exchange")


@dataclass(frozen=True)
class CollectiveDef:
    """One collective instruction: ``src`` -> ``dst`` form kinds (``"G"``, ``"I"``, ``"R"``), the
    hardware kinds of its forward and backward (:data:`hapnb.hardware.parts.COLLECTIVE_KINDS`; None when
    nothing moves), its ``pricing`` (:data:`PRICINGS`), the :mod:`hapnb.runtime.collectives` function
    that runs it (``runtime``, with ``padded`` for the gathers and scatters), and where the theory offers
    it: ``searched`` (a conversion the search enumerates), ``loss_only`` (only for the loss),
    ``resegments`` (it moves a tensor between ratio segments: inserted at segment edges, not searched)."""

    name: str
    src: str
    dst: str
    forward: str | None
    backward: str | None
    pricing: str
    runtime: str
    note: str
    padded: bool = False
    searched: bool = True
    loss_only: bool = False
    resegments: bool = False

    @property
    def launches_per_device(self) -> bool:
        """One call per device (the grouped broadcasts and reduces)."""
        return self.pricing == "grouped"


_TABLE = (
    CollectiveDef("all_gather", "G", "I", "all_gather", "reduce_scatter", "padded", "all_gather",
                  "padded all-gather: pad shards to the largest, gather, trim", padded=True),
    CollectiveDef("grouped_all_gather", "G", "I", "broadcast", "reduce", "grouped", "all_gather",
                  "grouped broadcast: one exact-size broadcast per device"),
    CollectiveDef("all_reduce", "R", "I", "all_reduce", "all_reduce", "full", "all_reduce",
                  "sum the partial tensors on every device"),
    CollectiveDef("reduce_scatter", "R", "G", "reduce_scatter", "all_gather", "padded", "reduce_scatter",
                  "padded reduce-scatter: sum and keep the own slice", padded=True),
    CollectiveDef("grouped_reduce_scatter", "R", "G", "reduce", "broadcast", "grouped", "reduce_scatter",
                  "grouped reduce: one exact-size reduce per device"),
    CollectiveDef("all_to_all", "G", "G", "all_to_all", "all_to_all", "exchange", "all_to_all",
                  "switch the sharded dim"),
    CollectiveDef("slice", "I", "G", None, None, "free", "shard", "keep the own slice (no communication)"),
    CollectiveDef("to_partial", "I", "R", None, None, "free", "to_partial",
                  "rank 0 keeps the value, others hold zero (no communication)", searched=False,
                  loss_only=True),
    CollectiveDef("reshard", "G", "G", "all_to_all", "all_to_all", "exchange", "reshard",
                  "move a shard to another segment's ratios (same dim)", searched=False, resegments=True),
)  # fmt: skip

#: every collective instruction by name
COLLECTIVES: Mapping[str, CollectiveDef] = MappingProxyType({c.name: c for c in _TABLE})

#: the instructions that move no data
FREE = frozenset(c.name for c in _TABLE if c.pricing == "free")


def conversions(src: str, dst: str) -> tuple[str, ...]:
    """The searched collectives that turn form kind ``src`` into ``dst``, in table order."""
    return tuple(c.name for c in _TABLE if c.searched and c.src == src and c.dst == dst)
