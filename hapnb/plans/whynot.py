"""Why not: why the search did not choose some forms, asked of a plan (``plan.why_not(pins)``).

:func:`why_not` re-plans with the pins added (the plan's :class:`~hapnb.plans.planner.Planner`, reusing its
memo) and answers with a :class:`WhyNot`: the best plan with those forms, its cost and the difference
against the chosen plan block by block (:class:`BlockDiff`: op ranges where both plans start a stage), or,
when no program satisfies the pins, the pin or op where the search found none and why.

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=32, input=16, batch=8)
>>> w = plan.why_not({"x": "I"})
>>> w.other.cost_s >= plan.cost_s
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..ir.forms import Form, Storage, parse_pin
from ..ir.graph import Graph
from ..synth.optimize import without_gc
from ..synth.search import NoProgramError, PinError, Search
from ..triples import Theory
from .explain import _planner, _Shown, _zero_level
from .plan import Plan

__all__ = ["WhyNot", "BlockDiff", "why_not"]


@dataclass(frozen=True)
class BlockDiff:
    """An op range where both plans start a stage at its first op and after its last: the stages each plan
    spends on it (``*_s`` seconds, ``*_stages`` count) and what they communicate."""

    first: int
    last: int
    ops: str  # "linear_3 .. add_7 (layers.1)"
    chosen_s: float
    other_s: float
    chosen_stages: int
    other_stages: int
    chosen_comm: tuple[str, ...]
    other_comm: tuple[str, ...]

    @property
    def delta_s(self) -> float:
        return self.other_s - self.chosen_s


@dataclass(frozen=True)
class WhyNot(_Shown):
    """The answer of :func:`why_not`: the asked ``pins`` and either ``other``, the best plan with them
    (``blocks``: where it differs from the chosen plan), or ``reason`` (and ``where``: the pin or op) why
    no program satisfies them. ``already``: the chosen plan already gives those forms."""

    _renderer: ClassVar[str] = "why_not_html"

    pins: tuple[tuple[str, str], ...]
    cost_s: float
    other: Plan | None = field(default=None, compare=False, repr=False)
    reason: str = ""
    where: str = ""
    blocks: tuple[BlockDiff, ...] = ()
    already: bool = False

    @property
    def possible(self) -> bool:
        return self.other is not None

    @property
    def delta_s(self) -> float | None:
        """How much slower the best program with the pins is (None when there is none)."""
        return None if self.other is None else self.other.cost_s - self.cost_s

    def summary(self) -> str:
        asked = ", ".join(f"{t}={f}" for t, f in self.pins)
        if self.other is None:
            return (
                f"why not {asked}? No program satisfies it"
                + (f" (at {self.where})" if self.where else "")
                + f": {self.reason}"
            )
        head = (
            f"why not {asked}? The best plan with it costs {self.other.cost_s * 1e3:.4g} ms against "
            f"{self.cost_s * 1e3:.4g} ms ({self.delta_s * 1e3:+.4g} ms)"  # type: ignore[operator]
        )
        if self.already:
            head += "; the chosen plan already gives these forms"
        lines = [head]
        for b in self.blocks:
            lines.append(
                f"  {b.ops}: {b.chosen_s * 1e3:.4g} ms in {b.chosen_stages} stage(s) -> {b.other_s * 1e3:.4g} ms "
                f"in {b.other_stages} ({b.delta_s * 1e3:+.4g} ms)"
                + (f"; communicates {', '.join(b.other_comm)}" if b.other_comm else "")
            )
        return "\n".join(lines)


@without_gc
def why_not(plan: Plan, pins: Mapping[str, Form | Storage | str], *, planner: Any = None) -> WhyNot:
    """Why the search did not choose ``pins`` (tensor -> form): see :class:`WhyNot`. ``planner``: the
    :class:`~hapnb.plans.planner.Planner` to use (default: the plan's own)."""
    if not pins:
        raise ValueError("why_not needs at least one pin, e.g. {'layers.0.linear1.weight': 'G1'}")
    asked = tuple(sorted((str(t), str(parse_pin(f) if isinstance(f, str) else f)) for t, f in pins.items()))
    p = _planner(plan, planner, "why_not")
    th = p.theory
    already = all(f in _forms(plan, t) for t, f in asked)
    try:
        other = p.replan(plan, pins=dict(asked))
    except PinError as e:
        return WhyNot(asked, plan.cost_s, reason=str(e), where=_pin_where(str(e)), already=already)
    except NoProgramError as e:
        where, why = _diagnose(plan, th, dict(asked))
        return WhyNot(asked, plan.cost_s, reason=why or str(e), where=where, already=already)
    except RuntimeError as e:  # e.g. the plan with the pins does not fit in memory, or the LP fails
        return WhyNot(asked, plan.cost_s, reason=str(e), already=already)
    return WhyNot(asked, plan.cost_s, other, blocks=_blocks(plan, other, th.graph), already=already)


def _forms(plan: Plan, tensor: str) -> set[str]:
    """The forms the plan gives ``tensor`` and, for a parameter it stores sharded, that storage's pin."""
    out = set(plan.form_of(tensor))
    for ins in plan.program:
        if ins.kind == "load" and ins.tensor == tensor and _zero_level(ins.name):
            out.add(str(Storage(_zero_level(ins.name), ins.src_value.dim)))
    return out


def _pin_where(message: str) -> str:
    """The op a PinError names (``op NAME (target)``), or the pin."""
    if " op " in message:
        return message.split(" op ", 1)[1].split(" ", 1)[0]
    return message.split(":", 1)[0].removeprefix("pin ").strip()


def _diagnose(plan: Plan, th: Theory, pins: Mapping[str, str], max_steps: int = 20_000) -> tuple[str, str]:
    """Step a search under the merged pins at the plan's ratios until it gives up, and name the op after
    the deepest partial program with the reasons its children were pruned."""
    merged = {**dict(plan.pins), **pins}
    options = {k: v for k, v in dict(plan.options).items() if isinstance(v, bool)}
    s = Search(
        th,
        plan.cluster,
        ratios=plan.ratios,
        pins={k: parse_pin(v) for k, v in merged.items()},
        options=options,
    )
    deepest, reasons = -1, []
    for _ in range(max_steps):
        ev = s.step()
        if ev.popped is None:
            break
        if not ev.popped.complete and not ev.children:  # a dead end: every child was pruned
            pos = ev.popped.position
            if pos > deepest:
                deepest, reasons = pos, []
            if pos == deepest:
                reasons += [r for _, r in ev.pruned if r not in reasons]
        if ev.done:
            break
    if deepest < 0:
        return "", ""
    op = th.graph.ops[deepest]
    where = f"op {op.name} ({op.target}{', ' + op.module if op.module else ''})"
    return where, f"after {deepest} ops every way to run {op.name} was pruned: " + "; ".join(reasons[:6])


def _starts(plan: Plan) -> list[tuple[int, int]]:
    """(index of its first computation, stage) for every stage of the plan, in order."""
    out = []
    k = 0
    first: dict[int, int] = {}
    for ins in plan.program:
        if ins.kind == "compute":
            first.setdefault(ins.stage, k)
            k += 1
    for st in plan.stages:
        if st.index in first:
            out.append((first[st.index], st.index))
    return out


def _blocks(a: Plan, b: Plan, g: Graph) -> tuple[BlockDiff, ...]:
    """The two plans' stages grouped by op ranges both plans start a stage at; only ranges that differ."""
    sa, sb = _starts(a), _starts(b)
    common = sorted({p for p, _ in sa} & {p for p, _ in sb}) + [len(g.ops)]
    stage = {st.index: st for st in a.stages}, {st.index: st for st in b.stages}

    def within(starts: list[tuple[int, int]], lo: int, hi: int, which: int) -> list[Any]:
        return [stage[which][k] for p, k in starts if lo <= p < hi]

    out = []
    for lo, hi in zip(common, common[1:]):
        xa, xb = within(sa, lo, hi, 0), within(sb, lo, hi, 1)
        ta, tb = sum(s.time_s for s in xa), sum(s.time_s for s in xb)
        ca = tuple(w for s in xa for w in s.comm)
        cb = tuple(w for s in xb for w in s.comm)
        if abs(ta - tb) <= 1e-12 * max(ta, tb, 1e-30) and ca == cb and len(xa) == len(xb):
            continue
        first, last = g.ops[lo], g.ops[hi - 1]
        mod = first.module or last.module
        ops = first.name if lo == hi - 1 else f"{first.name} .. {last.name}"
        out.append(
            BlockDiff(lo, hi - 1, ops + (f" ({mod})" if mod else ""), ta, tb, len(xa), len(xb), ca, cb)
        )
    return tuple(out)
