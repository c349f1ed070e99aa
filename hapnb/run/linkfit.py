"""Live re-balancing's link fit (issue 21): each collective kind's effective speed, from the seconds the
ranks were blocked in it, against the cluster's collective model the plan was made for.

What is measured
----------------
Per collective kind (:data:`hapnb.hardware.parts.COLLECTIVE_KINDS`), every rank's window row
(:mod:`hapnb.run.telemetry`) holds the median seconds it was blocked in that kind per step, their spread,
and the bytes and calls per step, the bytes counted as the cost model counts them for the kind. The
cluster prices them with the kind's linear model: ``model_s = calls * latency_s + bytes / bandwidth_Bps``
(:class:`hapnb.hardware.parts.Collective`).

A rank's blocked time is the transfer *plus the wait for slower peers*: a rank that reaches a collective
first waits there for the straggler. So the transfer estimate of a kind is the **minimum over the ranks**
of their blocked seconds (the rank that arrived last, usually the slowest one, waited least), taken with
that rank's bytes and calls. A slow device therefore shows as long blocked times on the *other* ranks, not
on its own, and is not mistaken for a slow link; a slow link shows on every rank, the fastest included.
Two more limits of what blocked time can say: an asynchronous collective (a gradient bucket) counts only
the part of its transfer not hidden behind the backward, so a bucketed all-reduce looks faster than its
link; and one measurement per kind and window cannot separate latency from bandwidth, so a kind's fit is
one scale of its whole linear model (latency times it, bandwidth divided by it).

The scale
---------
``k = min_s / model_s`` is the kind's measured seconds per model second. Like the devices' (see
:mod:`hapnb.run.rebalance`), it is read relative to the compute's ``k_ref`` (the median device's measured
seconds per predicted second): ``scale = k / k_ref``. 1.0 is a link as fast as the plan assumed *relative
to the devices* (what decides between programs: the same job on uniformly faster hardware keeps its plan);
4.0 a link four times slower. A kind with no call, or with no blocked time on some rank, is not measured:
its scale is the *overall* one (all measured kinds' seconds over all their model seconds, over
``k_ref``), since the kinds share the same wires. The uncertainty of a kind's scale is the relative
standard deviation of the chosen rank's blocked seconds within the window.

Detect
------
A measured kind *departs* when its scale differs from the reference by more than a factor
``1 + threshold`` (either way) and by more than its spread, for ``patience`` consecutive windows
(:class:`LinkDetector`). The reference starts at 1.0 (the plan's model); after a proposal it is the scale
that proposal was made with (a rejected one: the job knows its links are so and that re-planning did not
pay; an accepted one: the new plan was made on the measured cluster, so its model is the reference: 1.0).

>>> tab = {"all_reduce_s": [4e-3, 4e-3, 1e-3], "all_reduce_rsd": [0.0, 0.0, 0.1],
...        "all_reduce_bytes": [1e6] * 3, "all_reduce_calls": [1.0] * 3}
>>> from hapnb.hardware.cluster import Cluster
>>> c = Cluster.parse("3xV100").with_collectives(all_reduce=Collective(0.0, 1e9))
>>> f = fit_links(tab, c, k_ref=1.0)
>>> f.scale_of("all_reduce"), f.rank[f.kinds.index("all_reduce")]
(1.0, 2)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..hardware.parts import COLLECTIVE_KINDS, Collective
from .telemetry import Streaks

__all__ = ["LinkFit", "LinkDetector", "fit_links", "scaled_links"]


@dataclass(frozen=True)
class LinkFit:
    """Each collective kind's fitted speed (see the module docstring), in :data:`COLLECTIVE_KINDS` order:
    ``k`` measured seconds per model second (None: not measured), ``scale`` = k / k_ref (an unmeasured
    kind: ``overall``), ``spread`` its relative uncertainty, ``rank`` the rank whose blocked time was the
    transfer estimate (None: not measured), ``overall`` the scale of all measured kinds together (1.0 when
    none is), ``measured_s`` / ``model_s`` per kind the seconds per step measured and priced."""

    kinds: tuple[str, ...]
    k: tuple[float | None, ...]
    scale: tuple[float, ...]
    spread: tuple[float, ...]
    rank: tuple[int | None, ...]
    overall: float
    measured_s: tuple[float, ...] = ()
    model_s: tuple[float, ...] = ()

    def scale_of(self, kind: str) -> float:
        return self.scale[self.kinds.index(kind)]

    @property
    def measured(self) -> tuple[str, ...]:
        """The kinds with a measurement."""
        return tuple(k for k, x in zip(self.kinds, self.k) if x is not None)

    def departing(self, threshold: float, ref: Mapping[str, float] | None = None) -> tuple[str, ...]:
        """Measured kinds whose scale is off ``ref`` (default 1.0) by more than a factor ``1 + threshold``,
        either way, and by more than their spread.

        >>> LinkFit(("all_reduce", "all_gather"), (4.0, None), (4.0, 4.0), (0.1, 0.1), (0, None), 4.0).departing(0.5)
        ('all_reduce',)
        """
        out = []
        for kind, k, s, u in zip(self.kinds, self.k, self.scale, self.spread):
            r = (ref or {}).get(kind, 1.0)
            if k is not None and max(s / r, r / s) - 1.0 > max(threshold, u):
                out.append(kind)
        return tuple(out)

    def links(self) -> dict[str, float]:
        """kind -> scale (every kind; an unmeasured one at ``overall``)."""
        return dict(zip(self.kinds, self.scale))

    def record(self) -> dict[str, Any]:
        """The JSON of the fit: ``link_scale`` and ``link_spread`` (measured kinds only), ``link_overall``."""
        m = set(self.measured)
        return {
            "link_scale": {k: s for k, s in zip(self.kinds, self.scale) if k in m},
            "link_spread": {k: u for k, u in zip(self.kinds, self.spread) if k in m},
            "link_overall": self.overall,
        }


def fit_links(
    tab: Mapping[str, Sequence[float]], cluster: Any, k_ref: float, kinds: Sequence[str] = COLLECTIVE_KINDS
) -> LinkFit:
    """Fit each collective kind's speed from a window table (``<kind>_s``, ``_rsd``, ``_bytes``, ``_calls``
    per rank) against ``cluster``'s collective models; ``k_ref``: the compute's measured seconds per
    predicted second (:attr:`hapnb.run.rebalance.SpeedFit.k_ref`).

    A slow device (ranks 0 and 1 wait for rank 2 in the all-reduce) is not a slow link:

    >>> from hapnb.hardware.cluster import Cluster
    >>> c = Cluster.parse("3xV100").with_collectives(all_reduce=Collective(0.0, 1e9))
    >>> tab = {"all_reduce_s": [9e-3, 9e-3, 1e-3], "all_reduce_rsd": [0.0] * 3,
    ...        "all_reduce_bytes": [1e6] * 3, "all_reduce_calls": [2.0] * 3}
    >>> fit_links(tab, c, 1.0).departing(0.5), fit_links({**tab, "all_reduce_s": [9e-3, 8e-3, 4e-3]}, c, 1.0).departing(0.5)
    ((), ('all_reduce',))
    """
    if not (k_ref > 0 and math.isfinite(k_ref)):
        raise ValueError(f"fit_links: k_ref must be a positive number, got {k_ref!r}")
    rows = [_fit_kind(tab, cluster, kind) for kind in kinds]  # (k, spread, rank, measured s, model s)
    ks = [r[0] for r in rows]
    spread = [r[1] for r in rows]
    ranks = [r[2] for r in rows]
    meas = [r[3] for r in rows]
    model = [r[4] for r in rows]
    total_model = math.fsum(model)
    overall = math.fsum(meas) / total_model / k_ref if total_model > 0 else 1.0
    known = [u for k, u in zip(ks, spread) if k is not None]
    scale = tuple(overall if k is None else k / k_ref for k in ks)
    u_all = max(known, default=0.0)
    spreads = tuple(u_all if k is None else u for k, u in zip(ks, spread))
    return LinkFit(tuple(kinds), tuple(ks), scale, spreads, tuple(ranks), overall, tuple(meas), tuple(model))


def _fit_kind(
    tab: Mapping[str, Sequence[float]], cluster: Any, kind: str
) -> tuple[float | None, float, int | None, float, float]:
    """One kind's ``(k, spread, rank, measured s, model s)``; ``(None, 0, None, 0, 0)`` when not measured
    (no call on some rank, no blocked time on some rank, or nothing the model prices)."""
    secs = [float(x) for x in tab.get(f"{kind}_s", ())]
    calls = [float(x) for x in tab.get(f"{kind}_calls", ())]
    if not secs or len(calls) != len(secs) or min(calls) <= 0 or min(secs) <= 0:
        return None, 0.0, None, 0.0, 0.0
    j = min(range(len(secs)), key=lambda r: (secs[r], r))  # the fastest rank: the least wait for peers
    m_s = cluster.collective(kind).time(float(tab[f"{kind}_bytes"][j]), launches=round(calls[j]))
    if m_s <= 0:
        return None, 0.0, None, 0.0, 0.0
    rsd = float(tab.get(f"{kind}_rsd", [0.0] * len(secs))[j])
    return secs[j] / m_s, rsd, j, secs[j], m_s


def scaled_links(cluster: Any, links: Mapping[str, float]) -> Any:
    """``cluster`` with each collective kind's model ``links[kind]`` times slower (latency times it,
    bandwidth divided by it); kinds not named keep theirs.

    >>> from hapnb.hardware.cluster import Cluster
    >>> c = Cluster.parse("2xV100")
    >>> scaled_links(c, {"all_reduce": 4.0}).collective("all_reduce").bandwidth_Bps * 4 == c.collective("all_reduce").bandwidth_Bps
    True
    """
    new: dict[str, Collective] = {}
    for kind, s in links.items():
        if not (s > 0 and math.isfinite(s)):
            raise ValueError(f"scaled_links: collective {kind} has scale {s!r}; need a positive number")
        if s != 1.0:
            old = cluster.collective(kind)
            new[kind] = Collective(old.latency_s * s, old.bandwidth_Bps / s)
    return cluster.with_collectives(new) if new else cluster


class LinkDetector:
    """Counts, per collective kind, the consecutive windows its fitted scale departs from the reference
    (module docstring); :meth:`update` returns the kinds that departed for ``patience`` windows in a row."""

    def __init__(self, threshold: float, patience: int) -> None:
        self.threshold = threshold
        self.ref: dict[str, float] = {}
        self._streaks = Streaks(patience)

    def update(self, fit: LinkFit) -> tuple[str, ...]:
        return self._streaks.update(fit.departing(self.threshold, self.ref), fit.kinds)

    def reset(self, ref: Mapping[str, float] | None = None) -> None:
        """Start counting again, against ``ref`` (kind -> scale; default: the plan's model, 1.0)."""
        self._streaks.reset()
        self.ref = dict(ref or {})
