"""Per-op sharding rules: which forms an op accepts and produces, its flops, and how it runs locally.

A rule turns one traced :class:`~hapnb.ir.graph.Op` into its :class:`Strategy` list (the op's Hoare
triples ``{inputs} op {outputs}``) and, for a chosen strategy, into the :class:`LocalCall` every rank
runs on its local tensors. Ops without a hand rule get the strategies ground truth confirms
(:mod:`.discover`; :func:`rule_source` says which) and always the replicated one (all inputs ``I``).

The package has DTensor's ``_ops/`` shape: rules are documented tables, one module per algebra
family, each registering into one registry, and every op target has exactly one rule (registering
it twice raises).

========================== ========================================================================
module                     tables (families) and the algebra that makes them sound
========================== ========================================================================
:mod:`.registry`           Strategy / LocalCall types, the table, flop formulas, the lookups (bottom)
:mod:`.pointwise`          pointwise, linear, additive, multiplicative, select, convert: elementwise
:mod:`.reductions`         reduction: kept dims shard; sum/mean of a sharded dim is a partial sum
:mod:`.dimwise`            dimwise, scan, norm: act along some dims, independent across the others
:mod:`.einsum`             matmul, embedding: one einsum generator (kept -> G, contracted -> R)
:mod:`.views`              view: data movement; the sharded dim moves with the op; linear
:mod:`.indexing`           index: tensor-indexed reads/writes; non-indexed dims or the indices' batch shard
:mod:`.creation`           creation, random: no tensor inputs; create the whole tensor or a slice
:mod:`.attention`          attention: independent across batch, heads and (non-causal) query rows
:mod:`.losses`             loss: per-sample terms; a sharded batch sums to R (global-count mean)
:mod:`.conv`               conv, pool: contraction over in-channels; spatial dims never shard
:mod:`.cachedir`           where hapnb's on-disk caches live (discovery's and the trace cache's)
:mod:`.truth`              ground-truth helpers: split per form, reassemble, compare (checker and discovery)
:mod:`.discover`           ops without a hand rule: strategies found by ground truth (uneven splits)
:mod:`.cases`              the checker's sample cases per kind of op (besides the families' own samples)
:mod:`.checker`            the ground-truth checker and ``--check`` CLI body (top)
========================== ========================================================================

>>> from hapnb.rules import family, flops
>>> family("aten.linear.default"), family("aten.frobnicate.default")
('matmul', 'unknown')
>>> flops("aten.linear.default", [(8, 4), (3, 4), (3,)], [(8, 3)], (), ())
216.0
"""

from __future__ import annotations

# the family modules register their tables on import
from . import (
    attention,
    conv,
    creation,
    dimwise,
    discover,  # installs the registry's fallback for ops without a hand rule
    einsum,
    indexing,
    losses,
    pointwise,
    reductions,
    views,
)
from .checker import CheckReport, CheckRow, check, main
from .registry import (
    RULE_SOURCES,
    LocalCall,
    LocalContext,
    Strategy,
    family,
    flops,
    localize,
    registered,
    rule_source,
    strategies,
)

__all__ = [
    "Strategy",
    "LocalContext",
    "LocalCall",
    "CheckRow",
    "CheckReport",
    "strategies",
    "flops",
    "family",
    "localize",
    "registered",
    "rule_source",
    "RULE_SOURCES",
    "discover",
    "check",
    "main",
]

#: The family modules, in the order above (each registers its op targets into the one registry).
_FAMILY_MODULES = (pointwise, reductions, dimwise, einsum, views, indexing, creation, attention, losses, conv)
