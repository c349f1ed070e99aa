"""The baseline programs the Q/B loop is seeded with: data parallel, tensor parallel and sharded data
parallel (ZeRO-2, ZeRO-3 / FSDP), as pins, ratios and search options.

Seeding the loop with them means the plan is never worse than any of them under the same cost model
(and, where memory binds, a sharded program that fits is a candidate of the final pick).

>>> import hapnb
>>> from hapnb.tracing import zoo_graph
>>> th = hapnb.theory(zoo_graph("mlp", layers=1, hidden=8, input=6, batch=4)[0])
>>> [name for name, *_ in baseline_specs(th, hapnb.Cluster.parse("2xV100"), {})]
['dp_ev', 'dp_cp', 'tp_ev']
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..hardware.cluster import Cluster
from ..ir.forms import Form, FullShard, G, I, ShardGradOp
from ..triples import Theory
from .search import normalize_ratios

__all__ = ["baseline_specs", "seeds", "dp_pins", "fsdp_pins"]

#: a seed: (name, pins, ratios per segment, search options)
Seed = tuple[str, dict[str, Any], tuple[tuple[float, ...], ...], dict[str, bool]]


def baseline_specs(th: Theory, c: Cluster, user_pins: Mapping[str, Form]) -> list[Seed]:
    """(name, pins, ratios, search options) of the baselines: data parallel with even (``dp_ev``) and
    throughput-proportional (``dp_cp``) ratios, and Megatron-style tensor parallel (``tp_ev``)."""
    g = th.graph
    nseg = 1 + max((op.segment for op in th.graph.ops), default=0)
    even = tuple(tuple(1.0 / c.n for _ in range(c.n)) for _ in range(nseg))
    cp = normalize_ratios(None, c, nseg)
    dp = dp_pins(th)
    tp_pins = {t.name: I for t in g.tensors if t.role == "input"}
    plain = {"sfb": False, "grouped": False}
    out = []
    for name, pins, r in (("dp_ev", dp, even), ("dp_cp", dp, cp), ("tp_ev", tp_pins, even)):
        merged = {**pins, **user_pins}
        out.append((name, merged, r, plain))
    return out


def seeds(th: Theory, c: Cluster, user_pins: Mapping[str, Form], memory_bound: bool) -> Iterator[Seed]:
    """The baseline seeds of the Q/B loop: :func:`baseline_specs`, then, when memory binds by then
    (``memory_bound``), sharded data parallelism at even ratios: ZeRO-2 (``zero2``: parameters gathered once
    per step, gradients and optimizer states sharded; about data parallelism's communication) and fully
    sharded (``fsdp``, ZeRO-3, as :func:`hapnb.compare` builds it). Where memory binds, a sharded program
    that fits is a candidate of the final pick too, so the plan is never slower than it on the clock it is
    picked by."""
    specs = baseline_specs(th, c, user_pins)
    yield from specs
    if memory_bound:
        _, _, even, plain = specs[0]
        yield "zero2", fsdp_pins(th, even[0], user_pins, zero=2), even, plain
        yield "fsdp", fsdp_pins(th, even[0], user_pins), even, plain


def dp_pins(th: Theory) -> dict[str, Form]:
    """Data parallel: parameters replicated, inputs split on the batch dim (when they can be)."""
    out: dict[str, Form] = {}
    for t in th.graph.tensors:
        if t.role == "param":
            out[t.name] = I
        elif t.role == "input":
            out[t.name] = G(0) if G(0) in th.forms[t.id] else I
    return out


def fsdp_pins(
    th: Theory, ratios: Sequence[float], user_pins: Mapping[str, Any] | None = None, zero: int = 3
) -> dict[str, Any]:
    """Fully sharded data parallel (ZeRO-3 / PyTorch FSDP's FULL_SHARD): the data-parallel pins with every
    parameter stored sharded and all-gathered before each use (:func:`~hapnb.ir.forms.FullShard`), on the
    dim whose largest shard at ``ratios`` (one row) is the smallest (parameters that cannot be split stay
    replicated); ``user_pins`` win. ``zero=2``: ZeRO-2 / FSDP's SHARD_GRAD_OP instead (gathered once per
    step and kept until the backward, :func:`~hapnb.ir.forms.ShardGradOp`).

    >>> import hapnb
    >>> from hapnb.tracing import zoo_graph
    >>> th = hapnb.theory(zoo_graph("mlp", layers=1, hidden=8, input=6, batch=4)[0])
    >>> {k: str(v) for k, v in fsdp_pins(th, [0.5, 0.5]).items()}["layers.0.weight"]  # [8, 6]: 4 rows
    'zero3(0)'
    """
    out: dict[str, Any] = dict(dp_pins(th))
    for t in th.graph.tensors:
        gs = [f for f in th.forms[t.id] if f.kind == "G"]
        if t.role == "param" and gs:
            best = min(
                gs, key=lambda f: (max(th.lengths(t.id, f.dim, ratios)) / t.shape[f.dim] * t.numel, f.dim)
            )
            out[t.name] = FullShard(best.dim) if zero == 3 else ShardGradOp(best.dim)
    return {**out, **(user_pins or {})}
