"""The memo: results of searches, LPs, simulations and packaged plans on one theory, reused by later calls.

Every search and every LP is a pure function of its inputs, so a :class:`Memo` keyed by all of them
returns exactly what recomputing would. One memo belongs to a :class:`~hapnb.plans.planner.Planner` and is
shared by every plan it makes, so a re-plan that meets the same search or LP again takes the earlier
result.

>>> m = Memo()
>>> m.get("lp", ("k",), lambda: 42), m.get("lp", ("k",), lambda: 0), m.reused["lp"]
(42, 42, 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..cost.model import CostModel
from ..hardware.cluster import Cluster
from ..triples import Theory
from .search import NoProgramError

__all__ = ["Memo"]


class Memo:
    """Results of searches and LPs on one theory, keyed by everything they depend on (the cluster, the
    ratios, the pins, the search options and budget; the program and the ratio pins), for reuse by later
    :func:`optimize` calls (a searched result is reused only when no time limit could have cut it short).
    ``reused`` / ``computed`` count the lookups by kind. A table is cleared when it grows past its limit
    (``limits[kind]``, else ``limit`` entries: an interactive session makes many plans; whole plans are
    large, so few of them are kept)."""

    def __init__(self, limit: int = 512, limits: Mapping[str, int] | None = None) -> None:
        self.limit = limit
        self.limits = {"plan": 32, "shared": 64, **(limits or {})}
        self.tables: dict[str, dict[Any, Any]] = {}
        self.reused: dict[str, int] = {}
        self.computed: dict[str, int] = {}

    def get(self, kind: str, key: Any, make: Any) -> Any:
        """The value for ``key`` in table ``kind``, made by ``make()`` on a miss (an exception it raises
        is remembered and raised again on every later lookup of the same key)."""
        table = self.tables.setdefault(kind, {})
        if key in table:
            self.reused[kind] = self.reused.get(kind, 0) + 1
            value = table[key]
        else:
            self.computed[kind] = self.computed.get(kind, 0) + 1
            try:
                value = make()
            except (NoProgramError, ValueError, RuntimeError) as e:
                value = _Raised(e)
            if len(table) >= self.limits.get(kind, self.limit):
                table.clear()
            table[key] = value
        if isinstance(value, _Raised):
            raise value.error
        return value

    def cost_model(self, th: Theory, cluster: Cluster) -> CostModel:
        """The :class:`~hapnb.cost.model.CostModel` of ``th`` on ``cluster``, kept for reuse (its caches: each op's
        times, the lower bound) by the Q/B loop and the plans packaged from it."""
        return self.get("cost_model", (self.token(cluster), id(th)), lambda: CostModel(th, cluster))

    def peek(self, kind: str, key: Any) -> Any:
        """The value for ``key`` in table ``kind`` when one was made (None when not, or when its ``make()``
        raised), without making it or counting a lookup."""
        value = self.tables.get(kind, {}).get(key)
        return None if isinstance(value, _Raised) else value

    def token(self, value: Any) -> int:
        """A small int standing for ``value`` (e.g. a cluster) in keys, hashed once per call instead of once
        per key; stable for the memo's life (the token table is never cleared)."""
        tokens = self.tables.setdefault("token", {})
        return tokens.setdefault(value, len(tokens))

    def shared(self, key: Any) -> dict[str, Any]:
        """A dict of costs shared by the searches at ``key`` (cluster and ratios, see ``Search(shared=)``; or
        cluster and ``"per_cluster"``: what does not depend on the ratios)."""
        table = self.tables.setdefault("shared", {})
        if key not in table and len(table) >= self.limits["shared"]:  # each holds a cost per op and strategy
            table.clear()
        return table.setdefault(key, {})

    def __repr__(self) -> str:
        kinds = sorted(set(self.reused) | set(self.computed))
        return (
            "Memo("
            + ", ".join(
                f"{k}: {self.reused.get(k, 0)} reused / {self.computed.get(k, 0)} computed" for k in kinds
            )
            + ")"
        )


@dataclass(frozen=True)
class _Raised:
    error: BaseException
