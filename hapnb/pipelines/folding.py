"""Node folding (Ditto §5.3): a heterogeneous cluster seen as a homogeneous one of its weakest devices.

Each device class ``i`` has a whole-model cost ``c_i = sum_j (forward_j + backward_j)`` on one of its
devices (one micro-batch, from the layer costs); the *weakest* class ``w`` has the largest. A device of
class i then counts as ``d_i`` weakest devices:

* without communication (§5.3.1, what Ditto's evaluation and DP recovery use):
  ``d_i = round(c_w / c_i)`` (at least 1);
* with communication (§5.3.2): ``p(d) = c_w / d + c_across(d) + c_in(d)`` is the cost of the workload on
  ``d = n' M + d'`` weakest devices (``n'`` whole nodes of ``M`` and ``d'`` more on one node), with
  ``c_across(d) = n' * l_across`` and ``c_in(d) = L d' / d * l_in[d'] + L n' M / d * l_in[M]``; ``l_in[k]``
  and ``l_across`` are the per-unit averages of a unit's gradient all-reduce within a node of ``k``
  devices (the cost model's intra-machine rate, as for a virtual device) and across nodes (the cluster's
  ``all_reduce``). Our stages synchronise gradients once per iteration, not per micro-batch, so these are
  amortised over the ``N`` micro-batches. ``d_i`` is the ``d`` in ``1..d_i*`` (``d_i*`` the value
  without communication) minimising ``|p(d) - c_i|``.

The folded cluster has ``S = sum_i N_i d_i`` virtual devices (``N_i`` devices of class i) in nodes of the
weakest class's ``M``.

>>> from hapnb.hardware.cluster import Cluster
>>> from hapnb.pipelines.costs import model_costs
>>> c = Cluster.preset("ditto-ex1")
>>> lc = model_costs("gpt", c, micro_batch=2, layers=4, hidden=32, heads=4, seq=8, vocab=64)
>>> f = fold(lc, c)
>>> dict(f.factors), f.virtual_devices
({'V100': 1, 'RTX3090': 2}, 12)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..hardware.cluster import Cluster
from .costs import LayerCosts
from .timing import DeviceClass, device_classes

__all__ = ["Folding", "fold"]


@dataclass(frozen=True)
class Folding:
    """The folded cluster: ``factors[kind]`` weakest devices per device of that class."""

    classes: tuple[DeviceClass, ...]  # weakest first
    factors: Mapping[str, int]
    ratios: Mapping[str, float]  # c_w / c_i before rounding
    comm: bool

    @property
    def weakest(self) -> DeviceClass:
        return self.classes[0]

    @property
    def virtual_devices(self) -> int:
        """``S = sum_i N_i d_i``: the folded cluster's devices (and the DP template's stages)."""
        return sum(c.count * self.factors[c.kind] for c in self.classes)

    def to_json(self) -> dict[str, object]:
        return {
            "weakest": self.weakest.kind,
            "factors": dict(self.factors),
            "ratios": {k: round(v, 6) for k, v in self.ratios.items()},
            "virtual_devices": self.virtual_devices,
            "with_communication": self.comm,
        }


def fold(costs: LayerCosts, cluster: Cluster, *, comm: bool = False, micro_batches: int = 1) -> Folding:
    """Fold ``cluster`` for the model of ``costs`` (see the module docstring)."""
    classes = device_classes(cluster, costs)
    total = {c.kind: costs.total_time(c.kind) for c in classes}
    cw = total[classes[0].kind]
    ratios = {k: cw / v if v > 0 else 1.0 for k, v in total.items()}
    factors = {k: max(1, round(r)) for k, r in ratios.items()}
    if comm:
        factors = {c.kind: _fold_comm(costs, cluster, classes[0], total[c.kind], factors[c.kind], cw, micro_batches)
                   for c in classes}  # fmt: skip
    return Folding(classes, factors, ratios, comm)


def _fold_comm(
    costs: LayerCosts, cluster: Cluster, weak: DeviceClass, ci: float, dmax: int, cw: float, N: int
) -> int:
    L = len(costs)
    M = weak.per_node
    ar = cluster.collective("all_reduce")
    units = costs.units

    def l_in(k: int) -> float:
        if k <= 1:
            return 0.0
        return sum(2.0 * (k - 1) / k * u.param_bytes / cluster.intra_machine_Bps for u in units) / L / N

    l_across = (
        sum(ar.time(u.param_bytes, len(u.param_tensors)) if u.param_bytes else 0.0 for u in units) / L / N
    )

    def p(d: int) -> float:
        n1, d1 = divmod(d, M)
        c_across = n1 * l_across
        c_in = L * d1 / d * l_in(d1) + L * n1 * M / d * l_in(M)
        return cw / d + c_across + c_in

    best = min(range(1, dmax + 1), key=lambda d: (abs(p(d) - ci), -d))
    return max(1, best) if math.isfinite(p(best)) else dmax
