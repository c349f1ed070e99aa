"""Load balancing: the sharding ratios B that minimise a fixed program's cost (paper §5), as an LP.

Variables: ratios ``r[s][j]`` per segment s and device j (on the simplex, within the ratio pins), one
computation maximum ``P_k`` per stage and one maximum ``M_{k,c}`` per ratio-dependent collective.
Constraints: ``P_k >= comp_{k,j}(r)`` and ``M_{k,c} >= const_c + slope_c * r[s][j]`` for every device.
Objective: ``sum_k P_k + sum M + constant terms`` — exactly :meth:`CostModel.evaluate`, constants kept.
Solved with PuLP: HiGHS (via highspy) when installed, CBC otherwise.

``duplex=True`` minimises HiDup's duplex time (:mod:`hapnb.synth.duplex`) instead. Expanded, ``ψ_m = sum_k
[max(p_{k-1}, c_k) + max(c_k, p_k)] + p_m`` (``p_0 = 0``; the ``-comp_{k-1}`` of stage k cancels the
``+comp_{k-1}`` stage k-1 left): a sum of maxima with coefficients 1. Epigraph variables: ``P_k >= comp_kj(r)
/ 2`` per device, ``C_k = (constant terms + sum_c M_{k,c}) / 2`` with ``M_{k,c}`` as above, ``A_k >=
P_{k-1}, C_k`` and ``D_k >= C_k, P_k``; objective ``sum_k (A_k + D_k) + P_m + gradient syncs + T_inner +
T_opt`` with ``T_inner >= inner_j(r)`` and ``T_opt >= optimizer_j(r)``. Every variable appears with a
non-negative coefficient in a minimisation, so each epigraph is tight at the optimum: the LP's optimum is
the duplex time's minimum over the ratios (for the LP's stage grouping: any feature collective but a
reshard starts a stage, reshards are charged to their stage).

Sensitivity: :func:`ratio_lp` builds the LP without solving it, :func:`solve_lp` solves it and reads
every constraint's dual value (``pi``: seconds of optimum per unit of the row's right-hand side) and
slack, and :func:`lp_changes` prices changes of the cost model to first order by the LP's duals (the
envelope theorem, with the dual that is right for each change: the ratio LP is degenerate, so its duals
are not unique), whatever rows the LP has. :func:`row_role` names what a row of the LP stands for.

Memory (:func:`memory_lp`, :func:`balance_in_memory`): ``ratio_lp(..., memory=)`` adds every device's
memory cap as rows ``mem_opt_j`` and ``mem_bwd_j`` (the peak of the optimizer step and of the backward,
linear in the ratios, in GiB): their duals say what a GiB more of that device's memory would save.

>>> shares = proportional_ratios([2.0, 1.0, 1.0])
>>> [round(x, 3) for x in shares]
[0.5, 0.25, 0.25]
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..cost.memory import MemoryLinear, lean_linear, memory_linear
from ..cost.model import CostModel, Step
from ..hardware.cluster import Cluster
from .duplex import duplex_cost, duplex_stages, feature_terms, gradient_terms

__all__ = [
    "RatioPin",
    "balance",
    "balance_in_memory",
    "memory_lp",
    "memory_start_ratios",
    "MemoryCapError",
    "proportional_ratios",
    "solver_name",
    "BalanceResult",
    "apply_ratio_pins",
    "RatioLP",
    "LPSolution",
    "ratio_lp",
    "solve_lp",
    "lp_changes",
    "row_role",
    "device_classes",
]


@dataclass(frozen=True)
class RatioPin:
    """Bounds on one device's ratio (every segment); a fixed value is ``lo == hi``."""

    device: str
    lo: float = 0.0
    hi: float = 1.0

    def __str__(self) -> str:
        return (
            f"{self.device}={self.lo:g}"
            if self.lo == self.hi
            else f"{self.device} in [{self.lo:g}, {self.hi:g}]"
        )


@dataclass(frozen=True)
class BalanceResult:
    ratios: tuple[tuple[float, ...], ...]
    cost: float  # LP objective (equals CostModel.evaluate at these ratios)
    seconds: float
    solver: str


def proportional_ratios(flops: Sequence[float]) -> tuple[float, ...]:
    tot = float(sum(flops))
    return tuple(f / tot for f in flops)


@functools.cache
def solver_name() -> str:
    """The LP solver PuLP uses here ("HiGHS" when highspy is installed, else "CBC"); probed once per
    process (the first call imports PuLP)."""
    try:
        import pulp

        if pulp.HiGHS(msg=False).available():
            return "HiGHS"
    except Exception:  # noqa: BLE001 - any failure means HiGHS is not usable
        pass
    return "CBC"


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence the solver's own printing at the file-descriptor level (HiGHS >= 1.16 prints a banner to
    fd 1 even with msg=False, which would corrupt ``hapnb plan --json``)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real fd 1 (some notebook frontends): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _solver():  # noqa: ANN202
    import pulp

    if solver_name() == "HiGHS":
        return pulp.HiGHS(msg=False)
    return pulp.PULP_CBC_CMD(msg=False)


def parse_ratio_pins(
    pins: Mapping[str, object] | Sequence[RatioPin] | None, names: Sequence[str]
) -> tuple[RatioPin, ...]:
    """Ratio pins from ``{"v100-0": 0.4, "p100-1": (0.05, 0.2)}`` (or RatioPin values); checks names/values."""
    if not pins:
        return ()
    items = pins.items() if isinstance(pins, Mapping) else [(p.device, (p.lo, p.hi)) for p in pins]
    out = []
    for name, v in items:
        if name not in names:
            raise ValueError(f"ratio pin {name!r}: no device of that name; devices are {list(names)}")
        lo, hi = (float(v), float(v)) if isinstance(v, (int, float)) else (float(v[0]), float(v[1]))  # type: ignore[index]
        if not (0.0 <= lo <= hi <= 1.0):
            raise ValueError(f"ratio pin {name}: need 0 <= lo <= hi <= 1, got ({lo}, {hi})")
        out.append(RatioPin(name, lo, hi))
    lo_sum = sum(p.lo for p in out)
    free = len(names) - len(out)
    hi_sum = sum(p.hi for p in out) + free
    if lo_sum > 1 + 1e-9 or hi_sum < 1 - 1e-9:
        raise ValueError(
            f"ratio pins {', '.join(map(str, out))} cannot be satisfied: ratios must sum to 1 "
            f"(pinned lower bounds sum to {lo_sum:g}, upper bounds allow at most {hi_sum:g})"
        )
    return tuple(out)


def apply_ratio_pins(
    ratios: Sequence[float], pins: Sequence[RatioPin], names: Sequence[str], weights: Sequence[float]
) -> tuple[float, ...]:
    """Move ``ratios`` into the pinned bounds, spreading the rest over free devices by ``weights``."""
    if not pins:
        return tuple(ratios)
    bounds = {p.device: (p.lo, p.hi) for p in pins}
    r = list(ratios)
    fixed: dict[int, float] = {}
    for _ in range(len(r) + 1):
        free = [j for j in range(len(r)) if j not in fixed]
        mass = 1.0 - sum(fixed.values())
        wsum = sum(weights[j] for j in free) or 1.0
        for j in free:
            r[j] = mass * weights[j] / wsum
        for j in fixed:
            r[j] = fixed[j]
        changed = False
        for j in free:
            lo, hi = bounds.get(names[j], (0.0, 1.0))
            if r[j] < lo - 1e-12 or r[j] > hi + 1e-12:
                fixed[j] = min(max(r[j], lo), hi)
                changed = True
        if not changed:
            break
    s = sum(r)
    return tuple(x / s for x in r)


@dataclass(frozen=True)
class RatioLP:
    """The ratio LP of one program, built and not solved: the PuLP problem, the ratio variables ``r[s][j]``
    and ``unit``, the objective's units per second (1 for the plain LP; the duplex LP is scaled); with
    memory rows, their parts and slack (pass them to :func:`ratio_lp` for the same LP on a changed cluster)."""

    prob: Any
    r: tuple[tuple[Any, ...], ...]
    unit: float = 1.0
    duplex: bool = False
    memory: MemoryLinear | None = (
        None  # the memory rows' parts (ratio_lp(memory=)), to build a changed LP alike
    )
    memory_slack: tuple[float, ...] = ()

    def rows(self) -> dict[str, Any]:
        """The LP's constraints by name."""
        return {c.name: c for c in self.prob.constraints()}


@dataclass(frozen=True)
class LPSolution:
    """A solved ratio LP: ``cost`` (seconds, the LP's optimum), every variable's value by name, every
    constraint's dual value ``pi`` (seconds per unit of its right-hand side; >= 0 for a binding ``>=`` row
    of the minimisation) and slack, and the ratios (normalised rows per segment)."""

    ratios: tuple[tuple[float, ...], ...]
    cost: float
    values: Mapping[str, float]
    duals: Mapping[str, float]
    slacks: Mapping[str, float]
    unit: float
    solver: str


def ratio_lp(
    cm: CostModel,
    program: Sequence[Step],
    ratio_pins: Sequence[RatioPin] = (),
    *,
    duplex: bool = False,
    unit: float | None = None,
    memory: MemoryLinear | None = None,
    memory_slack: Sequence[float] | None = None,
    symmetric: bool = False,
) -> RatioLP:
    """Build the ratio LP of ``program`` under the cost model ``cm`` (see the module docstring).
    ``unit`` (duplex only): the objective's units per second; default: one over the duplex time at
    throughput-proportional ratios (pass the base LP's ``unit`` to compare a perturbed LP with it).
    ``memory`` (the program's :func:`hapnb.cost.memory.memory_linear`): every device's memory caps the ratios,
    less ``memory_slack[j]`` bytes (rows ``mem_opt_j`` and ``mem_bwd_j``, see :func:`balance_in_memory`).
    ``symmetric``: identical devices (:func:`device_classes`) share one ratio variable and one row per
    constraint (one segment, no duplex, no ratio pins): the LP is convex and symmetric in them, so some
    optimum is symmetric and the cost is the same, from an LP as large as the number of device kinds
    (its rows name the first device of each class)."""
    import pulp

    n, S = cm.n, cm.n_segments
    names = [d.name for d in cm.cluster.devices]
    bounds = {p.device: (p.lo, p.hi) for p in ratio_pins}
    prob = pulp.LpProblem("hapnb_ratios", pulp.LpMinimize)
    classes = device_classes(cm.cluster) if symmetric and S == 1 and not duplex and not ratio_pins else None
    if classes is not None:
        shared = [prob.add_variable(f"r_0_{c[0]}", 0.0, 1.0) for c in classes]
        of = {j: shared[k] for k, c in enumerate(classes) for j in c}
        r = [[of[j] for j in range(n)]]
    else:
        r = [
            [prob.add_variable(f"r_{s}_{j}", *bounds.get(names[j], (0.0, 1.0))) for j in range(n)]
            for s in range(S)
        ]
    reps = [c[0] for c in classes] if classes is not None else range(n)
    for s in range(S):
        prob += pulp.lpSum(r[s]) == 1, f"simplex_{s}"
    slack = tuple(memory_slack) if memory_slack else (0.0,) * n
    if memory is not None:
        _memory_caps(prob, cm, memory, r, slack)
    rt = tuple(tuple(row) for row in r)
    mem = dict(memory=memory, memory_slack=slack if memory is not None else ())
    if duplex:
        return RatioLP(prob, rt, _duplex_objective(prob, cm, program, r, unit), True, **mem)
    objective = []
    constant = 0.0
    groups = cm.stages(program)
    opt_coef, opt_const = cm.optimizer_linear(program)
    for k, idx in enumerate(groups):
        # computation: P_k >= sum over the stage's steps of device j's time (the cost model's own terms);
        # the last stage also carries the optimizer step of device-model devices
        coef = [[0.0] * n for _ in range(S)]
        const = [0.0] * n
        if k == len(groups) - 1:
            for s, row in opt_coef.items():
                coef[s] = [a + b for a, b in zip(coef[s], row)]
            const = list(opt_const)
        for i in idx:
            step_coef, step_const = cm.comp_linear(program[i])
            for s, row in step_coef.items():
                for j in range(n):
                    coef[s][j] += row[j]
            for j in range(n):
                const[j] += step_const[j]
        P = prob.add_variable(f"P_{k}", 0)
        objective.append(P)
        for j in reps:
            _at_least(
                prob, f"comp_{k}_{j}", P, [(r[s][j], coef[s][j]) for s in range(S) if coef[s][j]], const[j]
            )
        for c, tm in enumerate(cm.step_terms(program[idx[0]])):
            if tm.slope == 0.0:
                constant += tm.const
                continue
            objective.append(_comm_epigraph(prob, f"M_{k}_{c}", tm, r, reps=reps))
    prob += pulp.lpSum(objective) + constant
    return RatioLP(prob, rt, **mem)


def balance(
    cm: CostModel,
    program: Sequence[Step],
    ratio_pins: Sequence[RatioPin] = (),
    *,
    duplex: bool = False,
) -> BalanceResult:
    """Solve for the ratios minimising ``cm.evaluate(program, ratios)`` (``duplex``: minimising
    :func:`hapnb.synth.duplex.duplex_cost`; ``cost`` is then the duplex time at the ratios found). Identical devices
    share one ratio (:func:`ratio_lp` ``symmetric``: the same optimum from an LP with a row per device kind,
    not per device; without ratio pins, duplex or segments), so they get exactly equal ratios."""
    t0 = time.perf_counter()
    sol = solve_lp(ratio_lp(cm, program, ratio_pins, duplex=duplex, symmetric=True), ratio_pins, duals=False)
    return _result(cm, program, sol, duplex, t0)


def _result(
    cm: CostModel, program: Sequence[Step], sol: LPSolution, duplex: bool, t0: float
) -> BalanceResult:
    """A solved LP as a :class:`BalanceResult`: its ratios, costed by the cost model (or duplex time)."""
    cost = duplex_cost(cm, program, sol.ratios) if duplex else cm.evaluate(program, sol.ratios).cost_s
    return BalanceResult(sol.ratios, cost, time.perf_counter() - t0, sol.solver)


def solve_lp(lp: RatioLP, ratio_pins: Sequence[RatioPin] = (), *, duals: bool = True) -> LPSolution:
    """Solve the LP; read the ratios (normalised), every variable's value, and every row's dual and slack
    (``duals=False``: the ratios and the cost only; values, duals and slacks are left empty)."""
    import pulp

    prob = lp.prob
    with _quiet_stdout():
        status = prob.solve(_solver())
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(
            f"the ratio LP is {pulp.LpStatus[status]}: check the ratio pins {', '.join(map(str, ratio_pins))}"
        )
    ratios = []
    for row_vars in lp.r:
        row = [max(0.0, v.value() or 0.0) for v in row_vars]
        tot = sum(row)
        ratios.append(tuple(x / tot for x in row))
    if not duals:
        cost = float(pulp.value(prob.objective) or 0.0) / lp.unit
        return LPSolution(tuple(ratios), cost, {}, {}, {}, lp.unit, solver_name())
    values = {v.name: float(v.value() or 0.0) for v in prob.variables()}
    rows = lp.rows()
    duals = {name: float(c.pi or 0.0) for name, c in rows.items()}
    # each row's value at the optimum (``expr + constant``, >= 0 for a ">=" row), computed here rather than
    # read from the solver: not every PuLP solver interface reports slacks
    slacks = {name: _at(c, values) for name, c in rows.items()}
    cost = float(pulp.value(prob.objective) or 0.0) / lp.unit
    return LPSolution(tuple(ratios), cost, values, duals, slacks, lp.unit, solver_name())


def _at(expr: Any, values: Mapping[str, float]) -> float:
    """A PuLP affine expression (or constraint: its ``expr + constant``) evaluated at ``values`` by name."""
    return sum(a * values.get(v.name, 0.0) for v, a in expr.items()) + float(expr.constant)


def lp_changes(
    base: RatioLP, sol: LPSolution, others: Sequence[RatioLP], tol: float = 1e-9
) -> list[float | None]:
    """The first-order change of the optimum, in seconds, for each LP in ``others`` (the same program's LP
    under a changed cost model: a faster device, a faster collective; rows matched by name) against
    ``base``, solved as ``sol``.

    A change moves every row ``g_i(x) >= 0`` by ``d_i = g'_i(x*) - g_i(x*)`` at the optimum ``x*`` and the
    objective by ``d_0``; to first order the optimum moves by ``d_0 + max over the optimal duals y of
    -sum_i y_i d_i``. The ratio LP is degenerate as a rule (a balanced stage has every device's row
    tight), so its dual values are not unique and the one a solver returns can be wrong for a given change
    (seen: 18 % off for one device of BERT-12); the maximum over the optimal duals is the LP's dual, the
    *tangent LP* ``d_0 + min c.h`` over moves ``h`` with ``g_i(x* + h) + d_i >= 0`` for the rows tight at
    ``x*`` (equalities kept, bounds that hold ``x*`` kept), built once and re-solved per change. ``None``
    for a change whose LP does not have ``base``'s rows or unit (its structure changed: re-solve it)."""
    x = sol.values
    cons = base.rows()
    tangent = _Tangent(base, sol, tol)
    out: list[float | None] = []
    for other in others:
        b = other.rows()
        if cons.keys() != b.keys() or abs(base.unit - other.unit) > 1e-12 * base.unit:
            out.append(None)
            continue
        d0 = _at(other.prob.objective, x) - _at(base.prob.objective, x)
        best = tangent.solve({name: _at(b[name], x) - _at(cons[name], x) for name in tangent.rows})
        out.append(None if best is None else (d0 + best) / base.unit)
    return out


class _Tangent:
    """The tangent LP of a solved LP at its optimum ``x*`` (see :func:`lp_changes`): variables ``h`` (one
    per LP variable; ``>= 0`` where ``x*`` sits at its lower bound, ``<= 0`` at its upper bound), one row per
    tight row ``a_i . h + d_i (sense) 0``, objective ``c . h``; built once, re-solved per right-hand side
    ``d`` (with HiGHS directly when it is installed: a warm-started dual simplex; else through PuLP)."""

    def __init__(self, base: RatioLP, sol: LPSolution, tol: float) -> None:
        import pulp

        x = sol.values
        self.vars = list(base.prob.variables())
        col = {v.name: k for k, v in enumerate(self.vars)}
        self.bounds = []
        for v in self.vars:
            lo, hi, at = v.lowBound, v.upBound, x.get(v.name, 0.0)
            at_lo = lo is not None and at <= lo + tol
            at_hi = hi is not None and at >= hi - tol
            self.bounds.append((0.0 if at_lo else None, 0.0 if at_hi else None))
        self.cost = [0.0] * len(self.vars)
        for v, a in base.prob.objective.items():
            self.cost[col[v.name]] = a
        self.rows: dict[str, tuple[int, list[int], list[float]]] = {}
        for name, c in base.rows().items():
            if c.sense != pulp.LpConstraintEQ and abs(sol.slacks.get(name, 1.0)) > tol * max(
                1.0, abs(_at(c, x))
            ):
                continue  # not tight: a small change leaves it slack
            items = [(col[v.name], a) for v, a in c.items() if a]
            self.rows[name] = (c.sense, [k for k, _ in items], [a for _, a in items])
        self._highs = self._build_highs() if solver_name() == "HiGHS" else None

    def _build_highs(self) -> object:
        import highspy

        inf = highspy.kHighsInf
        with _quiet_stdout():
            hs = highspy.Highs()
        hs.setOptionValue("output_flag", False)
        for (lo, hi), c in zip(self.bounds, self.cost):
            hs.addCol(c, -inf if lo is None else lo, inf if hi is None else hi, 0, [], [])
        for _, idx, vals in self.rows.values():
            hs.addRow(-inf, inf, len(idx), idx, vals)
        return hs

    def solve(self, d: Mapping[str, float]) -> float | None:
        """``min c . h`` subject to the tight rows moved by ``d`` (None if the solver finds no optimum)."""
        if self._highs is not None:
            import highspy

            hs = self._highs
            inf = highspy.kHighsInf
            for k, (name, (sense, _, _)) in enumerate(self.rows.items()):
                # a . h + d (sense) 0  ->  bounds on a . h
                lo = -d[name] if sense >= 0 else -inf
                hi = -d[name] if sense <= 0 else inf
                hs.changeRowBounds(k, lo, hi)
            with _quiet_stdout():
                hs.run()
            if hs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None
            return float(hs.getInfo().objective_function_value)
        return self._solve_pulp(d)

    def _solve_pulp(self, d: Mapping[str, float]) -> float | None:
        import pulp

        prob = pulp.LpProblem("hapnb_tangent", pulp.LpMinimize)
        h = [prob.add_variable(f"h{k}", lo, hi) for k, (lo, hi) in enumerate(self.bounds)]
        for name, (sense, idx, vals) in self.rows.items():
            expr = pulp.lpSum(a * h[k] for k, a in zip(idx, vals))
            prob += pulp.LpConstraint(expr, sense, name, -d[name])
        prob += pulp.lpSum(c * h[k] for k, c in enumerate(self.cost) if c)
        with _quiet_stdout():
            status = prob.solve(_solver())
        if pulp.LpStatus[status] != "Optimal":
            return None
        return float(pulp.value(prob.objective) or 0.0)


def row_role(name: str) -> tuple[str, int, int, int]:
    """What a row of the ratio LP stands for: ``("comp", stage, device, -1)`` (device j's computation
    bounds stage k's maximum), ``("comm", stage, device, term)`` (device j's shard bounds the time of the
    stage's ``term``-th collective), ``("simplex", segment, -1, -1)``, ``("memory", -1, device, phase)``
    (device j's memory cap in the optimizer step, phase 0, or the backward, phase 1: :func:`memory_lp`),
    ``("memory", segment, device, 2)`` (a row of device j's largest-output epigraph), or ``("other", -1,
    -1, -1)`` (any other row, e.g. of the duplex LP; its dual still counts in :func:`lp_changes`).

    >>> row_role("comp_3_1"), row_role("M_2_0_5"), row_role("mem_bwd_4"), row_role("P_0_2")
    (('comp', 3, 1, -1), ('comm', 2, 5, 0), ('memory', -1, 4, 1), ('other', -1, -1, -1))
    """
    parts = name.split("_")
    digits = all(p.isdigit() for p in parts[2:])
    if parts[0] == "comp" and len(parts) == 3 and all(p.isdigit() for p in parts[1:]):
        return ("comp", int(parts[1]), int(parts[2]), -1)
    if parts[0] == "M" and len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
        return ("comm", int(parts[1]), int(parts[3]), int(parts[2]))
    if parts[0] == "simplex" and len(parts) == 2 and parts[1].isdigit():
        return ("simplex", int(parts[1]), -1, -1)
    if parts[0] == "mem" and digits and len(parts) == 3 and parts[1] in ("opt", "bwd"):
        return ("memory", -1, int(parts[2]), 0 if parts[1] == "opt" else 1)
    if parts[0] == "mem" and digits and len(parts) == 4 and parts[1] == "L":
        return ("memory", int(parts[3]), int(parts[2]), 2)
    return ("other", -1, -1, -1)


def _linear(cm: CostModel, fn, segs) -> tuple[dict[int, tuple[float, ...]], tuple[float, ...]]:  # noqa: ANN001
    """``fn(ratios)`` (per device, linear in the device's own ratio of each segment in ``segs``) as
    ``(coef per segment, const)``, read off at zero ratios and a unit ratio per segment."""
    zero = [(0.0,) * cm.n] * cm.n_segments
    const = tuple(fn(zero))
    coef = {}
    for s in segs:
        unit = list(zero)
        unit[s] = (1.0,) * cm.n
        coef[s] = tuple(a - c for a, c in zip(fn(unit), const))
    return coef, const


def _epigraph(prob, name: str, rows, r) -> object:  # noqa: ANN001
    """A variable ``X >= sum_s coef[s][j] r[s][j] + const[j]`` for every device j; ``rows`` is a list of
    ``(coef, const, scale)`` summed per device."""
    X = prob.add_variable(name, 0)
    n = len(r[0])
    for j in range(n):
        terms = []
        const = 0.0
        for coef, cst, k in rows:
            const += k * cst[j]
            terms += [(r[s][j], k * row[j]) for s, row in coef.items() if row[j]]
        _at_least(prob, f"{name}_{j}", X, terms, const)
    return X


def _at_least(prob, name: str, X, terms, const: float) -> None:  # noqa: ANN001
    """The row ``X >= sum(a * v for v, a in terms) + const`` (built directly: PuLP's operators copy
    expressions, several times slower on LPs of thousands of rows)."""
    import pulp

    coef = {X.name: (X, 1.0)}
    for v, a in terms:  # a variable may come several times: sum its coefficients
        w = coef.get(v.name)
        coef[v.name] = (v, -a if w is None else w[1] - a)
    expr = pulp.LpAffineExpression(list(coef.values()), -const)
    prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintGE, name))


def _comm_epigraph(prob, name: str, tm, r, unit: float = 1.0, reps=None) -> object:  # noqa: ANN001
    """``M >= unit * tm.time(r)``: ``const + slope * max_j r[seg][j]`` (a reshard: its boundary shares);
    ``reps``: the devices that need a row (one per class of identical devices; default all)."""
    import pulp

    n = len(r[0])
    M = prob.add_variable(name, 0)
    if tm.segment2 >= 0:
        a, b2 = tm.segment, tm.segment2
        u = [None] + [prob.add_variable(f"{name}_u{j}", 0) for j in range(1, n)] + [None]
        for j in range(1, n):
            diff = pulp.lpSum(r[a][i] for i in range(j)) - pulp.lpSum(r[b2][i] for i in range(j))
            prob += u[j] >= diff, f"{name}_ua{j}"
            prob += u[j] >= -diff, f"{name}_ub{j}"
        for j in range(n):
            share = pulp.lpSum(x for x in (u[j], u[j + 1]) if x is not None)
            prob += M >= unit * tm.const + unit * tm.slope * share, f"{name}_{j}"
    else:
        for j in range(n) if reps is None else reps:
            _at_least(prob, f"{name}_{j}", M, [(r[tm.segment][j], unit * tm.slope)], unit * tm.const)
    return M


def device_classes(cluster: Cluster) -> list[list[int]]:
    """Devices the cost and memory models cannot tell apart (same throughput, device model, GPUs and
    memory), as lists of indices in device order.

    >>> device_classes(Cluster.parse("2xV100+1xP100+1xV100"))
    [[0, 1, 3], [2]]
    """
    groups: dict[Any, list[int]] = {}
    for j, d in enumerate(cluster.devices):
        groups.setdefault((d.flops, repr(d.model), d.gpus, d.memory_bytes), []).append(j)
    return list(groups.values())


def _duplex_objective(prob, cm: CostModel, program: Sequence[Step], r, unit: float | None = None) -> float:  # noqa: ANN001
    """Set the duplex LP's objective (see the module docstring), in units of the duplex time at
    throughput-proportional ratios (so that the solver's absolute tolerances do not swamp programs of
    nanoseconds)."""
    import pulp

    if unit is None:
        ref = duplex_cost(cm, program, [proportional_ratios(cm.flops)] * cm.n_segments)
        unit = 1.0 / ref if ref > 0 else 1.0

    objective: list = []
    constant = 0.0
    inner_rows = []
    for i, st in enumerate(program):
        for c, tm in enumerate(gradient_terms(cm, st)):  # once per iteration, full size
            if tm.slope == 0.0:
                constant += unit * tm.const
            else:
                objective.append(_comm_epigraph(prob, f"G_{i}_{c}", tm, r, unit))
        for ld in st.loads:
            inner_rows.append(
                (*_linear(cm, lambda rt, ld=ld: cm.load_comp(ld, rt), [cm.segment_of[ld.tensor]]), unit)
            )
    groups = duplex_stages(cm, program)
    prev = None
    for k, idx in enumerate(groups):
        rows = []
        for i in idx:
            st = program[i]
            seg = cm.graph.ops[st.op].segment
            rows.append((*_linear(cm, lambda rt, st=st: cm.comp(st.op, st.strategy, rt), [seg]), 0.5 * unit))
        P = _epigraph(prob, f"P_{k}", rows, r)
        comm: list = []
        comm_const = 0.0
        for i in idx:
            for c, tm in enumerate(feature_terms(cm, program[i])):
                if tm.slope == 0.0:
                    comm_const += 0.5 * unit * tm.const
                else:
                    comm.append(0.5 * _comm_epigraph(prob, f"M_{k}_{i}_{c}", tm, r, unit))
        C = pulp.lpSum(comm) + comm_const
        A = prob.add_variable(f"A_{k}", 0)
        D = prob.add_variable(f"D_{k}", 0)
        if prev is not None:
            prob += A >= prev, f"A_{k}_prev"
        prob += A >= C, f"A_{k}_comm"
        prob += D >= C, f"D_{k}_comm"
        prob += D >= P, f"D_{k}_comp"
        objective += [A, D]
        prev = P
    if prev is not None:
        objective.append(prev)
    if inner_rows and any(cm.inner_sync_s_per_byte):
        objective.append(_epigraph(prob, "T_inner", inner_rows, r))
    if any(cm.models):
        objective.append(_epigraph(prob, "T_opt", [(*cm.optimizer_linear(program), unit)], r))
    prob += pulp.lpSum(objective) + constant
    return unit


class MemoryCapError(RuntimeError):
    """No ratios fit a program in every device's memory (within the ratio pins)."""


def memory_lp(
    cm: CostModel,
    program: Sequence[Step],
    extra: Sequence[Any] = (),
    ratio_pins: Sequence[RatioPin] = (),
    *,
    duplex: bool = False,
    rounds: int = 4,
    symmetric: bool = True,
) -> tuple[RatioLP, LPSolution]:
    """The ratio LP with every device's memory capped (:func:`ratio_lp` ``memory=``), solved: the two
    phases of :mod:`hapnb.cost.memory` (backward and optimizer step) as linear constraints on the ratios (a
    G-form tensor's local bytes are its bytes times the device's ratio; the largest output through one
    epigraph variable per device). Integer shard lengths can round a shard up, so a device whose exact
    peak (:meth:`CostModel.memory`) still exceeds its memory gets its cap lowered by that excess and the LP
    is solved again (up to ``rounds`` times). Returns the last LP and its solution (what a sensitivity
    reads its duals from, ``symmetric=False``); raises :class:`MemoryCapError` when no ratios fit."""
    ml = memory_linear(cm, program, extra)
    devs = cm.cluster.devices
    slack = [0.0] * cm.n
    for _ in range(rounds):
        lp = ratio_lp(
            cm, program, ratio_pins, duplex=duplex, memory=ml, memory_slack=slack, symmetric=symmetric
        )
        try:
            sol = solve_lp(lp, ratio_pins)
        except RuntimeError as e:
            raise MemoryCapError(f"no ratios fit this program in device memory ({e})") from None
        peak = cm.memory(program, extra, sol.ratios)
        over = [m * d.gpus - d.memory_bytes for m, d in zip(peak, devs)]
        if max(over) <= 0:
            return lp, sol
        slack = [s + (1.25 * o + 4096 if o > 0 else 0.0) for s, o in zip(slack, over)]
    raise MemoryCapError(f"no ratios fit this program in device memory after {rounds} rounds of rounding")


def balance_in_memory(
    cm: CostModel,
    program: Sequence[Step],
    extra: Sequence[Any] = (),
    ratio_pins: Sequence[RatioPin] = (),
    *,
    duplex: bool = False,
    rounds: int = 4,
) -> BalanceResult:
    """:func:`balance` with every device's memory capped (:func:`memory_lp`; identical devices share
    their ratio). Raises :class:`MemoryCapError` when no ratios fit."""
    t0 = time.perf_counter()
    _, sol = memory_lp(cm, program, extra, ratio_pins, duplex=duplex, rounds=rounds)
    return _result(cm, program, sol, duplex, t0)


def _memory_caps(prob, cm: CostModel, ml: MemoryLinear, r, slack: Sequence[float]) -> None:  # noqa: ANN001
    """Each device's peak (both phases, :func:`hapnb.cost.memory.peak_raw`) at most its memory, in GiB."""
    import pulp

    gib = 2.0**30

    def part(p: tuple[float, dict[int, float]], j: int) -> Any:
        return p[0] / gib + pulp.lpSum(c / gib * r[s][j] for s, c in p[1].items() if c)

    # devices that share their ratio variables (ratio_lp(symmetric=True)) need one row, with the most slack
    rows: dict[tuple[int, ...], int] = {}
    for j in range(cm.n):
        key = tuple(id(r[s][j]) for s in range(len(r)))
        k = rows.setdefault(key, j)
        if slack[j] > slack[k]:
            rows[key] = j
    for j in sorted(rows.values()):
        d = cm.cluster.devices[j]
        m = d.model
        sc = 1.0 + (m.memory_overhead if m is not None else 0.0)
        c0 = (m.memory_const_bytes * d.gpus if m is not None else 0.0) / gib
        cap = (d.memory_bytes - slack[j]) / gib
        L = prob.add_variable(f"mem_L_{j}", ml.L_const / gib)
        for s, c in ml.L_coef.items():
            prob += L >= c / gib * r[s][j], f"mem_L_{j}_{s}"
        P, In, A, X = (part(x, j) for x in (ml.P, ml.In, ml.A, ml.X))
        prob += sc * (5.0 * P + In) + c0 <= cap, f"mem_opt_{j}"
        prob += sc * (3.0 * P + In + A + 2.0 * L + ml.F / gib + X) + c0 <= cap, f"mem_bwd_{j}"


def memory_start_ratios(
    cm: CostModel,
    pins: Mapping[int, Any],
    ratio_pins: Sequence[RatioPin] = (),
    margin: float = 0.8,
    start: Sequence[float] | None = None,
) -> tuple[float, ...] | None:
    """Ratios ``start`` (default throughput-proportional) moved so that a lean program
    (:func:`hapnb.cost.memory.lean_linear`) takes at most ``margin`` of every device's memory: each device's
    ratio is capped where its lean peak reaches that, the rest spread in proportion to ``start``
    (:func:`apply_ratio_pins`); unchanged where no cap binds. The memory-aware search starts there (a
    search at ratios where not even a lean program fits would only prove that slowly). None when even the
    caps leave less than the whole batch (no ratios give the lean program room)."""
    ml = lean_linear(cm, pins)
    names = [d.name for d in cm.cluster.devices]
    (p0, p1), (i0, i1), (a0, a1) = ((p[0], sum(p[1].values())) for p in (ml.P, ml.In, ml.A))  # one row
    l0, l1 = ml.L_const, max(ml.L_coef.values(), default=0.0)
    hi = []
    for d in cm.cluster.devices:
        m = d.model
        sc = 1.0 + (m.memory_overhead if m is not None else 0.0)
        room = (margin * d.memory_bytes - (m.memory_const_bytes * d.gpus if m is not None else 0.0)) / sc
        r = 1.0
        for c0, c1 in ((5 * p0 + i0, 5 * p1 + i1), (3 * p0 + i0 + a0 + 2 * l0, 3 * p1 + i1 + a1 + 2 * l1)):
            if c0 > room:
                return None
            if c1 > 0:
                r = min(r, (room - c0) / c1)
        hi.append(max(0.0, r))
    if sum(hi) < 1.0:
        return None
    bounds = {p.device: (p.lo, p.hi) for p in ratio_pins}
    caps = [
        RatioPin(n, min(bounds.get(n, (0.0, 1.0))[0], h), min(bounds.get(n, (0.0, 1.0))[1], h))
        for n, h in zip(names, hi)
    ]
    row = tuple(start) if start is not None else proportional_ratios(cm.flops)
    if all(r <= h + 1e-12 for r, h in zip(row, hi)):
        return row
    return apply_ratio_pins(row, caps, names, [max(r, 1e-9) for r in row])
