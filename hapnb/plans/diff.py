"""Plan diffs: how one plan differs from another (cost, pins, forms per tensor, ratios per device), what a
session shows after every change.

>>> from hapnb.plans.synthesis import synthesize
>>> a = synthesize("mlp", "2xV100+2xP100", layers=2, hidden=32, input=16, batch=8)
>>> diff_plans(a, a).same_program
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import display
from .plan import Plan

__all__ = ["AUTO", "PlanDiff", "diff_plans"]

#: the pin value that lets the search choose (no pin)
AUTO = "auto"


@dataclass(frozen=True)
class PlanDiff:
    """How plan ``new`` differs from plan ``old``: cost, pins, forms per tensor, ratios per device.

    ``pins``/``forms``/``ratios`` list only what changed: ``(tensor, old pin, new pin)`` (``None`` =
    not pinned), ``(tensor, old forms, new forms)`` in program order, ``(device, old ratio, new ratio)``
    of the first segment (old ``None`` for a device the old cluster lacks).
    """

    old_cost_s: float
    new_cost_s: float
    pins: tuple[tuple[str, str | None, str | None], ...]
    forms: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]
    ratios: tuple[tuple[str, float | None, float], ...]
    cluster: tuple[str, str] | None  # (old name, new name) when the cluster changed
    stages: tuple[int, int]
    instructions: tuple[int, int]
    same_program: bool
    old: Plan = field(compare=False, repr=False)
    new: Plan = field(compare=False, repr=False)

    @property
    def delta_s(self) -> float:
        return self.new_cost_s - self.old_cost_s

    @property
    def names(self) -> tuple[str, ...]:
        """Tensors whose pin or forms changed."""
        return tuple(dict.fromkeys([p[0] for p in self.pins] + [f[0] for f in self.forms]))

    def summary(self) -> str:
        """One line: cost change, then what changed.

        >>> from hapnb.plans.synthesis import synthesize
        >>> a = synthesize("mlp", "2xV100+2xP100", layers=2, hidden=32, input=16, batch=8)
        >>> diff_plans(a, a).summary()  # doctest: +ELLIPSIS
        'cost ... ms -> ... ms (+0 ms, +0.0%); same program'
        """
        rel = self.delta_s / self.old_cost_s if self.old_cost_s else 0.0
        parts = [
            f"cost {self.old_cost_s * 1e3:.4g} ms -> {self.new_cost_s * 1e3:.4g} ms "
            f"({'+' if self.delta_s >= 0 else ''}{self.delta_s * 1e3:.3g} ms, {rel:+.1%})"
        ]
        if self.cluster:
            parts.append(f"cluster {self.cluster[0]} -> {self.cluster[1]}")
        if self.pins:
            parts.append("pins " + ", ".join(f"{t}: {a or AUTO} -> {b or AUTO}" for t, a, b in self.pins))
        if self.ratios:
            parts.append(
                "ratios "
                + ", ".join(f"{d}: {'-' if a is None else f'{a:.3f}'} -> {b:.3f}" for d, a, b in self.ratios)
            )
        if self.forms:
            shown = ", ".join(
                f"{t}: {'/'.join(a) or '-'} -> {'/'.join(b) or '-'}" for t, a, b in self.forms[:8]
            )
            more = f" (+{len(self.forms) - 8} more)" if len(self.forms) > 8 else ""
            parts.append(f"forms {shown}{more}")
        parts.append("same program" if self.same_program else f"stages {self.stages[0]} -> {self.stages[1]}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return display.safe_html(display.plan_diff_html, self.old, self.new)


def diff_plans(old: Plan, new: Plan) -> PlanDiff:
    """The :class:`PlanDiff` from ``old`` to ``new``."""
    po, pn = dict(old.pins), dict(new.pins)
    pins = tuple((t, po.get(t), pn.get(t)) for t in dict.fromkeys([*po, *pn]) if po.get(t) != pn.get(t))
    fo, fn = display.forms_by_tensor(old), display.forms_by_tensor(new)
    forms = tuple(
        (t, fo.get(t, ()), fn.get(t, ())) for t in dict.fromkeys([*fo, *fn]) if fo.get(t) != fn.get(t)
    )
    names_old = old.cluster.names
    ratios = []
    for j, d in enumerate(new.cluster.names):
        a = old.ratios[0][names_old.index(d)] if d in names_old else None
        b = new.ratios[0][j]
        if a is None or abs(a - b) > 5e-4:
            ratios.append((d, a, b))
    return PlanDiff(
        old.cost_s,
        new.cost_s,
        pins,
        forms,
        tuple(ratios),
        (old.cluster.name, new.cluster.name) if old.cluster != new.cluster else None,
        (len(old.stages), len(new.stages)),
        (len(old.program), len(new.program)),
        old.same_program(new),
        old,
        new,
    )
