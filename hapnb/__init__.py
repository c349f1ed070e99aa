"""hapnb — HAP in a notebook: synthesize, explain, verify and launch SPMD training programs for
heterogeneous GPU clusters.

>>> import hapnb as hap
>>> c = hap.Cluster.parse("2xV100+6xP100")
>>> c.n
8

The main entry points (docs/architecture.md §4): :func:`trace`, :func:`theory`, :class:`Search`, :func:`synthesize`,
:class:`Plan`, :func:`baselines`, :func:`verify`, :func:`distribute`, :func:`full_state_dict`,
:func:`launch`, :func:`destroy_groups` (a training job's last call), :func:`pipeline` (Ditto's
heterogeneous pipelines), :func:`compare` (every strategy under one cost model) and :class:`Cluster`.
Heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .hardware.cluster import Cluster
from .hardware.parts import Collective, Device
from .ir.forms import (
    FullShard,
    G,
    I,
    Partial,
    R,
    Replicate,
    Shard,
    ShardGradOp,
    Storage,
    parse_form,
    parse_pin,
    shard_lengths,
)

__version__ = "0.1.0"

_LAZY = {
    "trace": "tracing",
    "Graph": "ir.graph",
    "TraceError": "ir.graph",
    "theory": "triples",
    "Theory": "triples",
    "Search": "synth.search",
    "PinError": "synth.search",
    "NoProgramError": "synth.search",
    "synthesize": "plans.synthesis",
    "baselines": "plans.synthesis",
    "compare": "plans.comparison",
    "OutOfMemoryError": "plans.synthesis",
    "Plan": "plans.plan",
    "Planner": "plans.planner",
    "PipelinePlan": "pipelines",
    "pipeline": "pipelines",
    "simulate": "plans.simulation",
    "Timeline": "plans.simulation",
    "Session": "session",
    "verify": "run.verify",
    "distribute": "run.distribute",
    "full_state_dict": "run.distribute",
    "save_checkpoint": "run.checkpoint",
    "load_checkpoint": "run.checkpoint",
    "destroy_groups": "run.buckets",
    "launch": "run.launch",
    "zoo": "zoo",
    "rules": "rules",
    "collectives": "runtime.collectives",
    "display": "display",
}

#: the names in :data:`_LAZY` that are modules (the value is the module's path, not the module holding them)
_MODULES = frozenset({"zoo", "rules", "collectives", "display"})

__all__ = [
    "Cluster", "Collective", "Device", "G", "I", "R", "Partial", "Replicate", "Shard", "parse_form",
    "shard_lengths", "FullShard", "ShardGradOp", "Storage", "parse_pin", *sorted(_LAZY),
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = _LAZY[name]
        if name in _MODULES:
            return importlib.import_module(f".{mod}", __name__)
        return getattr(importlib.import_module(f".{mod}", __name__), name)
    raise AttributeError(f"module 'hapnb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
