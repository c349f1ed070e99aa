"""hapnb — HAP in a notebook: synthesize, explain, verify and launch SPMD training programs for
heterogeneous GPU clusters.

>>> import hapnb as hap
>>> c = hap.Cluster.parse("2xV100+6xP100")
>>> c.n
8

The main entry points (DESIGN §3.1): :func:`trace`, :func:`theory`, :class:`Search`, :func:`synthesize`,
:class:`Plan`, :func:`baselines`, :func:`verify`, :func:`distribute`, :func:`full_state_dict`,
:func:`launch`, and :class:`Cluster`. Heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .cluster import Cluster, Collective, Device
from .forms import G, I, Partial, R, Replicate, Shard, parse_form, shard_lengths

# these functions share their module's name (DESIGN §3.1): importing them here binds the name to the
# function for good (Python sets a package attribute to a submodule only on the submodule's first import)
from .launch import launch
from .theory import theory

__version__ = "0.1.0"

_LAZY = {
    "trace": "graph",
    "Graph": "graph",
    "TraceError": "graph",
    "Theory": "theory",
    "Search": "search",
    "PinError": "search",
    "NoProgramError": "search",
    "synthesize": "optimize",
    "baselines": "optimize",
    "OutOfMemoryError": "optimize",
    "Plan": "plan",
    "verify": "runtime",
    "distribute": "runtime",
    "full_state_dict": "runtime",
    "zoo": None,
    "rules": None,
    "collectives": None,
    "display": None,
}

__all__ = [
    "Cluster", "Collective", "Device", "G", "I", "R", "Partial", "Replicate", "Shard", "parse_form",
    "shard_lengths", "theory", "launch", *sorted(_LAZY),
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = _LAZY[name]
        if mod is None:
            return importlib.import_module(f".{name}", __name__)
        return getattr(importlib.import_module(f".{mod}", __name__), name)
    raise AttributeError(f"module 'hapnb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
