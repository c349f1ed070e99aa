"""Fit: does a plan fit every device's memory, and when nothing fits, what the leanest program needs.

:func:`check_memory` raises :class:`OutOfMemoryError` for a plan whose predicted peak exceeds a device's
memory, naming the device and what fills it; :func:`out_of_memory` is the error for "no program fits",
measured on the leanest programs hapnb can build (ZeRO-3 data parallelism, and the cheapest program
ignoring memory), with the smallest memory every device would need.

>>> _size(3 * 2**30)
'3.00 GiB'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..cost.memory import largest_pieces
from ..cost.model import CostModel
from ..hardware.cluster import Cluster
from ..synth.search import NoProgramError, Search
from ..synth.seeds import fsdp_pins
from ..triples import Theory
from .plan import Plan

__all__ = ["OutOfMemoryError", "check_memory", "out_of_memory"]


class OutOfMemoryError(RuntimeError):
    """No plan fits every device's memory (the message says what the leanest program needs and what fills
    it); ``need``: the same in one line, for reports (hapnb.compare's note)."""

    def __init__(self, message: str, need: str = "") -> None:
        super().__init__(message)
        self.need = need


def _size(n: float) -> str:
    """Bytes for people: ``_size(3 * 2**30) == '3.00 GiB'``, ``_size(5000) == '4.88 KiB'``."""
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 2**k:
            return f"{n / 2**k:.2f} {unit}"
    return f"{int(n)} B"


def _filling(pieces: Iterable[tuple[str, float]]) -> str:
    """What fills a device, largest first: ``_filling([("grads", 1024), ("acts", 0), ("weights", 2048)])
    == 'weights 2.00 KiB, grads 1.00 KiB'``."""
    return ", ".join(f"{k} {_size(v)}" for k, v in sorted(pieces, key=lambda kv: -kv[1]) if v)


_TO_FIT = (
    "To fit: a smaller batch (--batch) or sequence (--seq), fewer or narrower layers, devices with more memory, "
    "or more devices; pass check_memory=False to get a plan anyway."
)


def check_memory(plan: Plan) -> None:
    bad = []
    worst = (0.0, -1)
    for j, (d, m) in enumerate(zip(plan.cluster.devices, plan.memory_bytes)):
        cap = d.memory_bytes / d.gpus
        if m > cap:
            bad.append(f"{d.name} needs {_size(m)} of {_size(cap)}")
            worst = max(worst, (m / cap, j))
    if bad:
        j = worst[1]
        fill = _filling(plan.memory_breakdown[j]) if plan.memory_breakdown else ""
        raise OutOfMemoryError(
            "the best plan does not fit in device memory: "
            + "; ".join(bad)
            + (f". On {plan.cluster.devices[j].name}: {fill}" if fill else "")
            + ". Pin parameters to be stored sharded (e.g. pins={'<weight>': hapnb.FullShard(0)}, ZeRO-3). "
            + _TO_FIT
        )


def out_of_memory(th: Theory, c: Cluster, pins: Mapping[str, Any] | None = None) -> OutOfMemoryError:
    """The error for "no program fits": the leaner of two programs at ratios proportional to memory (data
    parallel with every parameter stored sharded and gathered before each use, ZeRO-3 / FSDP; and the
    cheapest program ignoring memory), what it needs per device, the smallest uniform capacity that would
    hold it, and what fills the fullest device."""
    cm = CostModel(th, c)
    caps = [d.memory_bytes for d in c.devices]
    ratios = [x / sum(caps) for x in caps]
    lean = fsdp_pins(th, ratios, pins)
    head = "no program fits in device memory (the search pruned every candidate that does not fit)"
    tried = []
    for what, pins_, opts in (
        ("data parallel, every parameter stored sharded and gathered before each use: ZeRO-3 / FSDP", lean,
         {"sfb": False, "grouped": False}),
        ("the cheapest program ignoring memory", dict(pins or {}), {}),
    ):  # fmt: skip
        try:
            s = Search(th, c, ratios=ratios, pins=pins_, options=opts)
            # a diagnosis, not a plan: a short search (its dives complete a program) is enough to measure
            res = s.run(max_expansions=6_000)
        except (NoProgramError, ValueError):
            continue
        peak = cm.memory(res.program, s.final_conversions(), s.ratios)
        per = [m / (d.memory_bytes / d.gpus) for m, d in zip(peak, c.devices)]
        tried.append((max(per), what, res.program, s.final_conversions(), s.ratios, peak, per))
    if not tried:
        return OutOfMemoryError(f"{head}; no program could be built to measure what it needs. {_TO_FIT}")
    worst, what, prog, extra, r, peak, per = min(tried, key=lambda x: x[0])
    j = max(range(c.n), key=lambda k: (per[k], -k))
    d = c.devices[j]
    fill = _filling(cm.memory_breakdown(prog, extra, r)[j].items())
    top = "; ".join(f"{n}: {w} {_size(b)}" for n, w, b in largest_pieces(cm, prog, extra, r, j))
    over = [f"{dv.name} {_size(m)}" for dv, m in zip(c.devices, peak) if m > dv.memory_bytes / dv.gpus]
    need = ", ".join(over[:4]) + (f" and {len(over) - 4} more" if len(over) > 4 else "")
    return OutOfMemoryError(
        f"{head}. The leanest program hapnb tried ({what}; ratios proportional to memory) needs "
        f"{_size(peak[j])} on {d.name}, which has {_size(d.memory_bytes / d.gpus)}: every device would need "
        f"at least {worst:.2f}x its memory"
        + (f" (over: {need})" if need else "")
        + f". What fills {d.name}: {fill}. Largest: {top}. "
        + _TO_FIT,
        need=f"leanest program needs {_size(peak[j])} on {d.name} of {_size(d.memory_bytes / d.gpus)}, "
        f"{worst:.2f}x its memory",
    )
