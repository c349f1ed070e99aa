"""Live re-balancing: fit each device's (and each link's) speed from a running job's telemetry, detect a
straggler or a slow link, re-solve the ratios of the same program and re-plan the program for the measured
speeds, and decide whether resharding pays (issue 21).

The running side is :mod:`hapnb.run.telemetry` (what ranks measure and gather every ``every`` steps)
and :mod:`hapnb.run.reshard` (moving parameters, optimizer state and data shares to new ratios); this
module is the arithmetic between them, pure and deterministic, so every rank reaches the same verdict
from the same gathered numbers.

Fit
---
The plan's cost model predicts each device's compute per step (``Instruction.comp_s``: forward and
backward, at the plan's ratios). A rank measures its compute per step (step time minus the time blocked
in collectives) and, within it, its optimizer step, which the cost model does not price and which does not
shrink with the rank's share of the batch (:func:`variable`: compute minus optimizer). The quotient
``k_i = variable_i / predicted_i`` is the device's *seconds per predicted second*; its *scale* is ``k_i / median(k)``: 1.0 is a device as fast as the plan assumed relative to the
others, 3.0 one three times slower. The scale's uncertainty is the relative standard deviation of the
measured compute within the window. A device with no predicted compute (ratio 0) has no scale (1.0).

The links' fit is :mod:`hapnb.run.linkfit`: per collective kind, the fastest rank's blocked seconds (the
others' include waiting for slower peers) against the cluster's collective model for the bytes and calls
the ranks made, relative to the compute's ``median(k)``.

Detect
------
A device is a straggler (or a device faster than planned) when ``|scale - 1| > threshold`` for
``patience`` consecutive windows; a collective kind departs when its scale is off its reference by more
than a factor ``1 + threshold`` for ``patience`` windows (:class:`hapnb.run.linkfit.LinkDetector`).

Re-solve and decide
-------------------
The cluster with each device's throughput divided by its scale (:func:`hapnb.plans.explain.faster`) and
each collective kind's model slowed by its link scale (:func:`hapnb.run.linkfit.scaled_links`) is the
*measured cluster*; the ratio LP (:func:`hapnb.synth.balance.balance`) re-solves the ratios of the
plan's own program (:func:`hapnb.plans.explain.program_steps`) on it, and
:func:`hapnb.plans.packaging.make_plan` packages the program at those ratios. The predicted step time at
the new ratios, in measured seconds, is the measured non-compute time of the current step (step time minus
the largest compute) plus the largest new compute (the new plan's compute per device times
``median(k)``). The re-balance is accepted only when it saves at least ``min_gain`` of the step time and
the saving repays the estimated reshard time within ``min(payback_steps, steps left)`` steps. The reshard
time is estimated as the time to generate a rank program for the new plan (measured on rank 0) plus three
step times (the full-state gathers of the parameters and up to two optimizer states per parameter move no
more than a step's gradient all-reduces each, and a step is more than its communication); the time it
really took is reported next to the estimate (``reshard_s``).

The second option is another program: the planner on the measured cluster (``replan``: with the plan's
pins and ratio pins, what a fresh ``hapnb.synthesize`` makes there). When its program differs, its
predicted step time is the first option's plus the difference, in measured seconds (times ``median(k)``),
between the two plans' overlap-simulated iteration times on the measured cluster (what the planner ranks
programs by); its reshard estimate is the first option's with one step more (the new program's first step
warms its buckets and caches). Each option is judged as above; of those accepted, the one that saves the
most over the horizon net of its reshard is taken (``program_changed``, and both in ``options``).

After a re-balance the measured cluster is the reference: the new plan predicts its devices' compute, so
a device that keeps its new speed no longer departs. A second re-balance needs the first one's prediction
to have held (the measured step time within ``threshold`` of ``predicted_step_s``): a job whose step time
the cost model does not explain (e.g. a tiny model dominated by fixed overheads) re-balances at most once.

>>> fit = fit_speeds([1e-3, 1e-3, 3e-3], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
>>> fit.scale
(1.0, 1.0, 3.0)
>>> d = Detector(RebalanceOptions(patience=2))
>>> d.update(fit), d.update(fit)
((), (2,))
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .telemetry import Streaks

__all__ = [
    "RebalanceOptions",
    "SpeedFit",
    "Detector",
    "Proposal",
    "fit_speeds",
    "predicted_compute",
    "measured_cluster",
    "rebalanced_plan",
    "propose",
    "pool",
    "variable",
    "summarize",
    "parse_slowdown",
]


@dataclass(frozen=True)
class RebalanceOptions:
    """How a job re-balances. ``every``: steps per telemetry window (one small gather per window);
    ``patience``: consecutive windows a device must depart before it counts as a straggler;
    ``threshold``: the relative departure of a device's scale from 1.0 that counts; ``payback_steps``: the
    predicted saving must repay the reshard within this many steps (and within the steps left);
    ``min_gain``: the smallest predicted saving, as a fraction of the step time, worth a reshard;
    ``warmup``: steps at the start left out of the first window; ``max_rebalances``: at most this many;
    ``trust``: another re-balance only when the last one's predicted step time held within this fraction;
    ``links``: fit the collective kinds' speeds (:mod:`hapnb.run.linkfit`) into the measured cluster and let a
    departing link trigger a re-solve; ``program``: also run the planner on the measured cluster and take
    its program when that pays more than new ratios (else only the ratios change)."""

    every: int = 4
    patience: int = 3
    threshold: float = 0.5
    payback_steps: int = 50
    min_gain: float = 0.1
    warmup: int = 2
    max_rebalances: int = 3
    trust: float = 0.2
    links: bool = True
    program: bool = True

    def __post_init__(self) -> None:
        for name in ("every", "patience", "payback_steps", "max_rebalances"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"rebalance option {name} must be an integer >= 1, got {v!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"rebalance option warmup must be an integer >= 0, got {self.warmup!r}")
        for name in ("links", "program"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"rebalance option {name} must be true or false, got {getattr(self, name)!r}"
                )
        for name in ("threshold", "min_gain", "trust"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < 10:
                raise ValueError(f"rebalance option {name} must be a number in [0, 10), got {v!r}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def parse(items: Sequence[str]) -> dict[str, Any]:
        """Options from ``KEY=VALUE`` strings (``hapnb launch --rebalance-option``), each value read as its
        field's type (``true``/``false`` for the flags); the mapping ``launch(rebalance=...)`` takes.

        >>> RebalanceOptions.parse(["program=false", "every=2", "threshold=0.3"])
        {'program': False, 'every': 2, 'threshold': 0.3}
        """
        types = {f.name: f.type for f in dataclasses.fields(RebalanceOptions)}
        out: dict[str, Any] = {}
        for item in items:
            key, sep, text = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in types:
                raise ValueError(
                    f"rebalance option {item!r}: expected KEY=VALUE with KEY one of {', '.join(types)}"
                )
            kind = types[key]
            try:
                if kind == "bool":
                    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                        raise ValueError(text)
                    out[key] = text.lower() in ("true", "1", "yes")
                else:
                    out[key] = int(text) if kind == "int" else float(text)
            except ValueError:
                what = {"int": "an integer", "float": "a number", "bool": "true or false"}[kind]
                raise ValueError(f"rebalance option {key} takes {what}, got {text!r}") from None
        RebalanceOptions.from_json(out)  # the ranges are checked here, before any rank starts
        return out

    @staticmethod
    def from_json(d: Mapping[str, Any] | None) -> RebalanceOptions:
        """Options from a mapping (unknown keys are an error naming them)."""
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(RebalanceOptions)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown rebalance option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return RebalanceOptions(**d)


@dataclass(frozen=True)
class SpeedFit:
    """Each device's fitted speed against the plan's cost model (see the module docstring):
    ``k`` measured seconds per predicted second (None: no predicted compute), ``scale`` = k / median(k),
    ``spread`` the relative uncertainty of each measurement, ``k_ref`` = median(k)."""

    k: tuple[float | None, ...]
    scale: tuple[float, ...]
    spread: tuple[float, ...]
    k_ref: float

    def departing(self, threshold: float) -> tuple[int, ...]:
        """Devices whose scale departs from 1.0 by more than ``threshold`` (and by more than its spread)."""
        return tuple(
            i for i, (s, u) in enumerate(zip(self.scale, self.spread)) if abs(s - 1.0) > max(threshold, u)
        )


def fit_speeds(
    measured: Sequence[float], predicted: Sequence[float], spread: Sequence[float] | None = None
) -> SpeedFit:
    """Fit each device's speed from its measured compute per step and the plan's predicted compute.

    >>> fit_speeds([2.0, 6.0], [1.0, 1.0]).scale
    (0.5, 1.5)
    >>> fit_speeds([2.0, 0.1], [1.0, 0.0]).k
    (2.0, None)
    """
    if len(measured) != len(predicted):
        raise ValueError(f"fit_speeds: {len(measured)} measurements for {len(predicted)} devices")
    k = tuple(float(m) / float(p) if p > 0 and m > 0 else None for m, p in zip(measured, predicted))
    known = [x for x in k if x is not None]
    if not known:
        raise ValueError("fit_speeds: no device has both measured and predicted compute")
    ref = statistics.median(known)
    scale = tuple(1.0 if x is None else x / ref for x in k)
    u = tuple(float(s) for s in spread) if spread is not None else (0.0,) * len(k)
    return SpeedFit(k, scale, u, ref)


class Detector:
    """Counts, per device, the consecutive windows its fitted scale departs (see :class:`SpeedFit`);
    :meth:`update` returns the devices that departed for ``patience`` windows in a row."""

    def __init__(self, options: RebalanceOptions) -> None:
        self.options = options
        self._streaks = Streaks(options.patience)

    def update(self, fit: SpeedFit) -> tuple[int, ...]:
        return self._streaks.update(fit.departing(self.options.threshold), range(len(fit.scale)))

    def reset(self) -> None:
        self._streaks.reset()


def variable(window: Mapping[str, Sequence[float]]) -> list[float]:
    """Per rank, the compute that scales with its share: compute minus the optimizer step (when measured).

    >>> variable({"compute_s": [3.0, 2.0], "optimizer_s": [1.0, 0.5]})
    [2.0, 1.5]
    """
    opt = window.get("optimizer_s") or [0.0] * len(window["compute_s"])
    return [max(0.0, float(c) - float(o)) for c, o in zip(window["compute_s"], opt)]


def pool(tables: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, list[float]]:
    """Window tables pooled: per field and rank, the median over the windows (the largest spread).

    >>> pool([{"compute_s": [1.0, 3.0], "compute_rsd": [0.1, 0.0]}, {"compute_s": [2.0, 3.5], "compute_rsd": [0.2, 0.1]}])
    {'compute_s': [1.5, 3.25], 'compute_rsd': [0.2, 0.1]}
    """
    if not tables:
        raise ValueError("pool: no window tables")
    out: dict[str, list[float]] = {}
    for key in tables[0]:
        cols = list(zip(*(t[key] for t in tables)))
        agg = max if key.endswith("_rsd") else statistics.median
        out[key] = [float(agg(c)) for c in cols]
    return out


def predicted_compute(plan: Any) -> tuple[float, ...]:
    """The plan's predicted compute per device per step (seconds: the instructions' ``comp_s``)."""
    n = plan.cluster.n
    out = [0.0] * n
    for ins in plan.program:
        for i, s in enumerate(ins.comp_s[:n]):
            out[i] += float(s)
    return tuple(out)


def measured_cluster(cluster: Any, scale: Sequence[float], links: Mapping[str, float] | None = None) -> Any:
    """``cluster`` with device ``i``'s throughput divided by ``scale[i]`` and each collective kind's model
    ``links[kind]`` times slower (the measured speeds; :func:`hapnb.run.linkfit.scaled_links`)."""
    from ..plans.explain import faster
    from .linkfit import scaled_links

    if len(scale) != cluster.n:
        raise ValueError(f"measured_cluster: {len(scale)} scales for {cluster.n} devices")
    out = cluster
    for d, s in zip(cluster.devices, scale):
        if not (s > 0 and math.isfinite(s)):
            raise ValueError(f"measured_cluster: device {d.name} has scale {s!r}; need a positive number")
        if s != 1.0:
            out = faster(out, device=d.name, factor=1.0 / s)
    if links:
        out = scaled_links(out, links)
    name = cluster.name if cluster.name.endswith("(measured)") else f"{cluster.name} (measured)"
    return out.replace(name=name)


def rebalanced_plan(plan: Any, theory: Any, cluster: Any) -> Any:
    """The plan's own program at the ratios the LP finds for it on ``cluster`` (a :class:`Plan`)."""
    from ..cost.model import CostModel
    from ..plans.explain import program_steps
    from ..plans.packaging import make_plan
    from ..synth.balance import balance, parse_ratio_pins

    steps, extra = program_steps(plan, theory)
    cm = CostModel(theory, cluster)
    pins = parse_ratio_pins({d: (lo, hi) for d, lo, hi in plan.ratio_pins}, [d.name for d in cluster.devices])
    res = balance(cm, tuple(steps), pins)
    return make_plan(theory, cluster, steps, extra, res.ratios, pins=dict(plan.pins), cost_model=cm)


@dataclass(frozen=True)
class Proposal:
    """A re-balance considered at ``step``: ``accepted`` or not and why (``reason``), the ratios before
    and after, the predicted step time (measured seconds) before and after, the saving per step
    (``predicted_gain``, seconds), the estimated reshard time and the steps it needs to pay back, for the
    option taken (or, when none is, the same program at new ratios). ``program_changed``: the option taken
    is another program (the planner's on the measured cluster); ``link_scale`` / ``link_spread``: the
    fitted collective kinds (:mod:`hapnb.run.linkfit`); ``options``: both options considered (same
    program at new ratios, the planner's program), each with its prediction and verdict; ``replan_s``:
    seconds the planner took. ``plan`` is the new plan (None when rejected)."""

    step: int
    accepted: bool
    reason: str
    old_ratios: tuple[tuple[float, ...], ...]
    new_ratios: tuple[tuple[float, ...], ...]
    step_s: float
    predicted_step_s: float
    predicted_gain: float
    reshard_s_estimate: float
    payback_steps: float
    scale: tuple[float, ...] = ()
    program_changed: bool = False
    link_scale: Mapping[str, float] = field(default_factory=dict)
    link_spread: Mapping[str, float] = field(default_factory=dict)
    options: tuple[Mapping[str, Any], ...] = ()
    replan_s: float = 0.0
    plan: Any = field(default=None, compare=False, repr=False)

    def record(self) -> dict[str, Any]:
        """The JSON record (no plan)."""
        d = dataclasses.asdict(dataclasses.replace(self, plan=None))
        d.pop("plan")
        d["link_scale"], d["link_spread"] = dict(self.link_scale), dict(self.link_spread)
        d["options"] = [dict(o) for o in self.options]
        return d


@dataclass(frozen=True)
class _Option:
    """One way to re-balance: a plan, its predicted step time (measured seconds), the reshard estimate."""

    plan: Any
    program: bool
    predicted_step_s: float
    reshard_s: float


def _simulated_s(plan: Any) -> float:
    """The overlap simulation's iteration time of ``plan`` (what the planner picks programs by)."""
    from ..plans.simulation import iteration_time

    return plan.simulated_s if plan.simulated_s is not None else iteration_time(plan)


def _verdict(
    o: _Option, step_s: float, options: RebalanceOptions, horizon: int
) -> tuple[bool, str, float, float]:
    """``(accepted, why, gain, payback steps)`` of one option."""
    gain = step_s - o.predicted_step_s
    payback = o.reshard_s / gain if gain > 0 else math.inf
    if gain <= options.min_gain * step_s:
        return (
            False,
            f"predicted saving {gain * 1e3:.3g} ms/step is under {options.min_gain:.0%}",
            gain,
            payback,
        )
    if payback > horizon:
        return (
            False,
            f"the reshard (~{o.reshard_s:.3g} s) would pay back in {payback:.1f} steps > {horizon}",
            gain,
            payback,
        )
    return True, f"pays back in {payback:.1f} steps (<= {horizon})", gain, payback


def _trigger(
    plan: Any, fit: SpeedFit, stragglers: Sequence[int], slow_links: Sequence[str], links: Any
) -> str:
    names = [d.name for d in plan.cluster.devices]
    who = ", ".join(f"{names[i]} (rank {i}) at {fit.scale[i]:.2f}x the plan's time" for i in stragglers)
    parts = [f"straggler: {who}"] if who else []
    if slow_links and links is not None:
        parts.append(
            "link: " + ", ".join(f"{k} at {links.scale_of(k):.2f}x the plan's time" for k in slow_links)
        )
    return "; ".join(parts) or "straggler: speeds departed"


def propose(
    plan: Any,
    theory: Any,
    fit: SpeedFit,
    window: Mapping[str, Sequence[float]],
    options: RebalanceOptions,
    *,
    step: int,
    steps_left: int,
    stragglers: Sequence[int] = (),
    codegen_s: Callable[[Any], float] | float = 0.0,
    links: Any = None,
    slow_links: Sequence[str] = (),
    replan: Callable[[Any], Any] | None = None,
) -> Proposal:
    """Re-solve ``plan`` for the fitted speeds and decide (see the module docstring).

    ``window``: per-rank medians over the telemetry window, keys ``compute_s`` and ``step_s`` (each a
    sequence over devices) and optionally ``optimizer_s`` (the part of the compute that does not scale);
    ``codegen_s``: seconds to generate a rank program, or a function timing it for the new plan;
    ``links``: the link fit (:class:`hapnb.run.linkfit.LinkFit`, its scales go into the measured cluster)
    and ``slow_links`` the kinds that departed; ``replan``: the planner on a cluster (``cluster -> Plan``,
    e.g. ``lambda c: plan.replan(cluster=c)``), whose program is the second option."""
    comp = [float(x) for x in window["compute_s"]]
    fixed = [c - v for c, v in zip(comp, variable(window))]
    step_s = max(float(x) for x in window["step_s"])
    overhead = max(0.0, step_s - max(comp))
    measured = measured_cluster(plan.cluster, fit.scale, links.links() if links is not None else None)
    new = rebalanced_plan(plan, theory, measured)
    predicted = overhead + max(f + c * fit.k_ref for f, c in zip(fixed, predicted_compute(new)))
    gen = (lambda p: codegen_s(p)) if callable(codegen_s) else (lambda p: float(codegen_s))
    # a re-cut: program generation + the full-state gathers (<= 3 steps' worth of all-reduces)
    opts = [_Option(new, False, predicted, gen(new) + 3 * step_s)]
    replan_s = 0.0
    if replan is not None:
        t0 = time.perf_counter()
        other = replan(measured)
        replan_s = time.perf_counter() - t0
        if not other.same_program(plan):
            # the difference the planner ranks programs by (the overlap simulation's iteration time)
            # between the two programs, both on the measured cluster, in measured seconds
            p_s = predicted + (_simulated_s(other) - _simulated_s(new)) * fit.k_ref
            # another program: as a re-cut, plus its first step (new buckets, caches, allocations)
            opts.append(_Option(other, True, p_s, gen(other) + 4 * step_s))
    horizon = min(options.payback_steps, steps_left)
    verdicts = [_verdict(o, step_s, options, horizon) for o in opts]
    ok = [i for i, v in enumerate(verdicts) if v[0]]
    # the option that saves the most over the horizon, net of its reshard
    pick = max(ok, key=lambda i: verdicts[i][2] * horizon - opts[i].reshard_s) if ok else 0
    o, (verdict, why, gain, payback) = opts[pick], verdicts[pick]
    if len(opts) > 1:
        why += (
            "; "
            + ("a new program" if o.program else "the same program at new ratios")
            + (" (the other option: " + verdicts[1 - pick][1] + ")")
        )
    lrec = links.record() if links is not None else {}
    return Proposal(
        step=step,
        accepted=verdict,
        reason=f"{_trigger(plan, fit, stragglers, slow_links, links)}; {why}",
        old_ratios=tuple(tuple(r) for r in plan.ratios),
        new_ratios=tuple(tuple(r) for r in o.plan.ratios),
        step_s=step_s,
        predicted_step_s=o.predicted_step_s,
        predicted_gain=gain,
        reshard_s_estimate=o.reshard_s,
        payback_steps=payback,
        scale=fit.scale,
        program_changed=o.program,
        link_scale=lrec.get("link_scale", {}),
        link_spread=lrec.get("link_spread", {}),
        options=tuple(
            {
                "program_changed": x.program,
                "predicted_step_s": x.predicted_step_s,
                "predicted_gain": v[2],
                "reshard_s_estimate": x.reshard_s,
                "payback_steps": v[3],
                "accepted": v[0],
                "reason": v[1],
            }
            for x, v in zip(opts, verdicts)
        ),  # fmt: skip
        replan_s=replan_s,
        plan=o.plan if verdict else None,
    )


def parse_slowdown(items: Sequence[str] | Mapping[int, float] | None) -> dict[int, float]:
    """``["2=3.0"]`` or ``{2: 3.0}`` -> ``{2: 3.0}`` (rank -> factor >= 1).

    >>> parse_slowdown(["1=2.5", "0=1"])
    {1: 2.5, 0: 1.0}
    """
    if not items:
        return {}
    pairs: list[tuple[Any, Any]]
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = []
        for it in items:
            rank, sep, factor = str(it).partition("=")
            if not sep:
                raise ValueError(
                    f"slowdown {it!r}: write RANK=FACTOR, e.g. 2=3.0 (rank 2 three times slower)"
                )
            pairs.append((rank, factor))
    out: dict[int, float] = {}
    for rank, factor in pairs:
        try:
            r, f = int(rank), float(factor)
        except (TypeError, ValueError):
            raise ValueError(f"slowdown {rank}={factor}: RANK must be an integer, FACTOR a number") from None
        if r < 0 or not (f >= 1.0 and math.isfinite(f)):
            raise ValueError(f"slowdown {r}={f}: need a rank >= 0 and a factor >= 1 (1 = not slowed)")
        out[r] = f
    return out


def summarize(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The re-balancing summary of a job's metrics lines: ``losses`` (the global loss per step),
    ``step_s`` (per step, the slowest rank's), ``rebalances`` (accepted re-balances, in order),
    ``rejected`` (proposals turned down), ``step_s_before`` / ``step_s_after`` (the median step time
    before the first and after the last re-balance, or of the first and last thirds when none).

    >>> m = [{"rank": 0, "step": s, "global_loss": 1.0, "step_s": t} for s, t in enumerate([3, 2, 2, 1, 1, 1])]
    >>> r = summarize(m); r["step_s_before"], r["step_s_after"], r["rebalances"]
    (2.5, 1.0, [])
    """
    per_step: dict[int, float] = {}
    losses: dict[int, float] = {}
    done: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    for m in metrics:
        ev = m.get("event")
        if ev == "rebalance":
            (done if m["rebalance"].get("accepted") else rejected).append(dict(m["rebalance"]))
            continue
        if ev is not None or not isinstance(m.get("step"), int):
            continue
        t = m.get("step_s")
        if isinstance(t, (int, float)):
            per_step[m["step"]] = max(per_step.get(m["step"], -math.inf), float(t))
        if m.get("global_loss") is not None:
            losses[m["step"]] = float(m["global_loss"])
    steps = sorted(per_step)
    times = [per_step[s] for s in steps]
    if done:
        before = [per_step[s] for s in steps if s <= done[0]["step"]]
        after = [per_step[s] for s in steps if s > done[-1]["step"]]
    else:
        third = max(1, len(times) // 3)
        before, after = times[:third], times[-third:]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "losses": [losses.get(s) for s in sorted(losses)],
        "step_s": times,
        "rebalances": done,
        "rejected": rejected,
        "step_s_before": med(before),
        "step_s_after": med(after),
    }
