"""Exercises graded by the theory: choose forms for a model's tensors, and hapnb says whether they hold.

A learner gets a small model from the zoo (an MLP, an attention block, an MoE layer) on a small, often
mixed, cluster, and writes a form for some of its tensors: ``"I"`` (replicated), ``"G(d)"`` / ``"Gd"``
(sharded on dim d, uneven lengths allowed) or ``"R"`` (partial sums), or a parameter storage such as
``"zero3(0)"``. :meth:`Exercise.check` grades the answer against the Hoare-triple theory
(:mod:`hapnb.triples`) and the search (:mod:`hapnb.synth.search`), with nothing keyed to the exercise:

* **valid or not**: every op touched by the answer needs a compute triple whose pre- and postcondition
  agree with the answer, where a computed input may first pass through the theory's collective triples
  (``G(d) -> I``, ``R -> I``, ``R -> G(d)``, ``I -> G(d)``, ``G(a) -> G(b)``). The first op without one is
  the failing triple, named with the forms it was asked for and the nearest triples the theory has.
  A locally consistent answer is then re-planned with the answer as pins (``plan.replan``), which
  decides whether one program satisfies all of it at once (``plan.why_not`` says why not when none does);
* **the collectives it implies**: every communication of that program, with its time;
* **its cost against the optimum**: the best program under the answer (the optimum re-planned with the
  answer's pins, ``plan.replan(exact=False)``: the Q/B loop from the optimum's ratios) against the optimum,
  the best program under the exercise's own givens (:func:`hapnb.synthesize`, ``pick="cost"``);
* **a hint**: for an invalid answer, the nearest triple of the failing op; for a slower one, the single
  change toward the optimum (a form, the ratios, SFB) that saves the most, found by re-planning;
* **the proof chain** of a valid answer: its program as a chain of triples ending at ``loss : R``.

>>> from hapnb import teach
>>> ex = teach.exercise("shard-linear")
>>> ex.check({"x": "G0", "layers.0.weight": "G0"}).status
'invalid'
>>> grade = ex.check({"x": "G0", "layers.0.weight": "I"})
>>> grade.valid, grade.gap_s >= 0
(True, True)
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from . import display
from .hardware.cluster import Cluster
from .ir.forms import Form, I, Storage, parse_pin
from .ir.graph import Graph, Op
from .plans.plan import Plan
from .plans.synthesis import synthesize
from .rules import Strategy
from .synth.search import NoProgramError, PinError
from .triples import LOADABLE_ROLES, Theory, theory

__all__ = ["Exercise", "Grade", "Failure", "EXERCISES", "exercise", "check", "AnswerError"]

#: relative cost difference under which an answer counts as optimal (solver rounding)
_TIE = 1e-9


class AnswerError(ValueError):
    """An answer the grader cannot read: an unknown tensor, a malformed form, bad ratios. The message
    says what is wrong, why, and how to write it instead."""


@dataclass(frozen=True)
class Failure:
    """Why an answer is invalid: the op whose triple fails (empty when the failure is a form a tensor
    cannot take at all, or a conflict only the whole program shows), the triple the answer asks for,
    the reason, and the theory's nearest triples for that op."""

    op: str
    target: str
    asked: str
    reason: str
    nearest: tuple[str, ...] = ()


@dataclass(frozen=True)
class Grade:
    """The grade of one answer (:meth:`Exercise.check`). ``status``: ``"optimal"``, ``"valid"`` (a correct
    program, slower than the optimum by :attr:`gap_s`) or ``"invalid"`` (:attr:`failure` says which
    triple fails). ``collectives``: what the answer's program communicates; ``proof``: its chain of
    triples; ``plan`` / ``optimum``: the two plans compared."""

    exercise: str
    answer: tuple[tuple[str, str], ...]
    status: str
    optimum_s: float
    cost_s: float | None = None
    failure: Failure | None = None
    collectives: tuple[str, ...] = ()
    hint: str = ""
    proof: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    plan: Plan | None = field(default=None, compare=False, repr=False)
    optimum: Plan | None = field(default=None, compare=False, repr=False)

    @property
    def valid(self) -> bool:
        return self.status != "invalid"

    @property
    def gap_s(self) -> float | None:
        """Seconds per iteration the answer loses against the optimum (None when invalid)."""
        return None if self.cost_s is None else self.cost_s - self.optimum_s

    @property
    def gap(self) -> float | None:
        """The gap relative to the optimum (0.25: 25 % slower)."""
        return None if self.cost_s is None else self.cost_s / self.optimum_s - 1.0

    def summary(self) -> str:
        asked = ", ".join(f"{t}={f}" for t, f in self.answer) or "(no forms)"
        head = {
            "optimal": "OPTIMAL: a valid program, as fast as the best one",
            "valid": "VALID, but slower than the best program",
            "invalid": "INVALID: no program satisfies it",
        }[self.status]
        lines = [f"{self.exercise}: {asked}", f"  {head}"]
        if self.cost_s is not None:
            lines.append(
                f"  cost {_ms(self.cost_s)} per iteration against the optimum {_ms(self.optimum_s)} "
                f"(gap {_ms(self.gap_s or 0.0)}, {100 * (self.gap or 0.0):+.1f} %)"
            )
        if self.failure is not None:
            f = self.failure
            where = f"op {f.op} ({f.target})" if f.op else "the answer"
            lines.append(f"  fails at {where}: {f.asked}")
            lines.append(f"  why: {f.reason}")
            lines += [f"    nearest: {t}" for t in f.nearest]
        if self.valid:
            more = f"; and {len(self.collectives) - 8} more" if len(self.collectives) > 8 else ""
            lines.append("  communicates: " + ("; ".join(self.collectives[:8]) + more or "nothing"))
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.proof:
            lines.append(f"  proof ({len(self.proof)} triples, ending at loss : R):")
            shown = self.proof if len(self.proof) <= 14 else (*self.proof[:6], "...", *self.proof[-6:])
            lines += [f"    {p}" for p in shown]
        return "\n".join(lines)

    __str__ = summary

    def _repr_html_(self) -> str:
        return display.safe_html(_grade_html, self)

    def chart(self, *, width: int = 640, height: int | None = None) -> Any:
        """A bokeh chart of where each device's time goes (communication, computation, waiting for the
        slowest device), for the answer's program and the optimum side by side; None when invalid."""
        if self.plan is None or self.optimum is None:
            return None
        return _time_chart({"your answer": self.plan, "optimum": self.optimum}, width=width, height=height)


@dataclass(frozen=True)
class Exercise:
    """One exercise: a zoo model (``model`` with ``options``) on ``cluster``; ``asks``: the tensors the
    learner gives forms for; ``givens``: forms the exercise fixes (e.g. the data loader shards the batch);
    ``ratios`` / ``sfb``: the learner also gives per-device ratios / decides whether SFB may be used.

    >>> ex = exercise("shard-linear")
    >>> ex.asks
    ('x', 'layers.0.weight')
    """

    key: str
    title: str
    task: str
    model: str
    options: tuple[tuple[str, Any], ...]
    cluster: str
    asks: tuple[str, ...]
    givens: tuple[tuple[str, str], ...] = ()
    ratios: bool = False
    sfb: bool = False
    lesson: str = ""
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ what the learner reads
    @property
    def optimum(self) -> Plan:
        """The best plan under the exercise's givens (synthesized once, ``pick="cost"``)."""
        plan = self._cache.get("optimum")
        if plan is None:
            plan = self._cache["optimum"] = synthesize(
                self.model, self.cluster, dict(self.givens), pick="cost", **dict(self.options)
            )
        return plan

    @property
    def theory(self) -> Theory:
        """The theory of the exercise's program (its triples render as a table)."""
        th = self._cache.get("theory")
        if th is None:
            th = self._cache["theory"] = theory(self.optimum.graph)
        return th

    @property
    def graph(self) -> Graph:
        return self.theory.graph

    def triples(self, op: str) -> list[str]:
        """The compute triples of one op (its name, e.g. ``"linear"``), one line each.

        >>> exercise("shard-linear").triples("linear")[1]
        '{x:G0, layers.0.weight:I, layers.0.bias:I} linear[shard:a] {linear:G0}'
        """
        th = self.theory
        return [
            _strategy_text(th.graph, th.graph.ops[tr.instr.op], tr.instr.strategy) for tr in th.filter(op=op)
        ]

    def sheet(self) -> list[tuple[str, str, tuple[int, ...], tuple[str, ...]]]:
        """The answer sheet: per asked tensor its role, shape and the forms the theory lets it take.

        >>> exercise("shard-linear").sheet()[1]
        ('layers.0.weight', 'param', (512, 512), ('I', 'G0', 'G1'))
        """
        g, th = self.graph, self.theory
        return [
            (n, g.tensor(n).role, tuple(g.tensor(n).shape), tuple(map(str, th.forms[g.tensor(n).id])))
            for n in self.asks
        ]

    def variant(self, **options: Any) -> Exercise:
        """The same exercise on the model built with other zoo options (e.g. ``batch=256``).

        >>> exercise("sfb").variant(batch=64).options[-1]
        ('batch', 64)
        """
        merged = {**dict(self.options), **options}
        return replace(self, options=tuple(merged.items()), _cache={})

    def __str__(self) -> str:
        lines = [
            f"Exercise {self.key}: {self.title}",
            self.task,
            f"{self.model} {dict(self.options)} on {self.cluster}",
        ]
        lines += [f"  given: {t} = {f}" for t, f in self.givens]
        lines += [f"  {n} ({r}, shape {shape}): one of {', '.join(fs)}" for n, r, shape, fs in self.sheet()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return display.safe_html(_exercise_html, self)

    # ------------------------------------------------------------------ grading
    def check(
        self,
        answer: Mapping[str, str | Form | Storage],
        *,
        ratios: Mapping[str, float] | Sequence[float] | None = None,
        sfb: bool | None = None,
    ) -> Grade:
        """Grade ``answer`` (tensor name -> form) against the theory; see the module docstring.

        ``ratios``: the per-device shares of every sharded dim (by device name or in device order),
        used as they are instead of the ratio LP. ``sfb``: False forbids sufficient factor broadcasting,
        True allows it (the default: the search decides).

        >>> g = exercise("shard-linear").check({"x": "G0", "layers.0.weight": "G5"})
        >>> g.status, g.failure.op
        ('invalid', '')
        """
        forms = self._parse(answer)
        fixed = self._parse_ratios(ratios)
        asked = tuple((n, str(f)) for n, f in forms.items())
        opt = self.optimum
        failure = self._local_failure(forms, sfb)
        if failure is not None:
            hint = (
                f"make {failure.op} one of its triples, e.g. {failure.nearest[0]}" if failure.nearest else ""
            )
            hint = hint or "pick one of the forms the tensor can take (ex.sheet() lists them)"
            return Grade(self.key, asked, "invalid", opt.cost_s, failure=failure, hint=hint)
        pins = {**dict(self.givens), **{n: str(f) for n, f in forms.items()}}
        try:
            plan = self._replan(pins, fixed, sfb)
        except (PinError, NoProgramError, RuntimeError) as e:
            why = opt.why_not(pins) if fixed is None and sfb is None else None
            reason = why.reason if why is not None and not why.possible else str(e)
            where = why.where if why is not None else ""
            failure = Failure("", "", ", ".join(f"{t}:{f}" for t, f in asked), f"{reason} {where}".strip())
            hint = "each op has a triple for these forms, but no program has them all at once: change one"
            return Grade(self.key, asked, "invalid", opt.cost_s, failure=failure, hint=hint)
        notes = self._notes(plan, fixed, sfb, ratios)
        best = min(opt.cost_s, plan.cost_s)
        status = "optimal" if plan.cost_s <= best * (1 + _TIE) else "valid"
        if plan.cost_s < opt.cost_s * (1 - _TIE):
            notes += ("cheaper than the plan hapnb found on its own: the Q/B loop is a local search",)
        hint = "" if status == "optimal" else self._hint(forms, fixed, sfb, plan)
        comm = _collectives(plan)
        return Grade(
            self.key, asked, status, opt.cost_s, plan.cost_s, None, comm, hint, _proof(plan), notes, plan, opt
        )

    def solution(self) -> Grade:
        """The optimum graded as an answer: the forms it gives the asked tensors, its collectives, its
        proof chain and the exercise's lesson (the notebooks keep this hidden until the learner asks).

        >>> exercise("shard-linear").solution().status
        'optimal'
        """
        opt = self.optimum
        answer = {n: _chosen_form(opt, n) for n in self.asks}
        kw: dict[str, Any] = {}
        if self.sfb:
            kw["sfb"] = any(i.name == "load_sfb" for i in opt.program)
        if self.ratios:
            kw["ratios"] = dict(zip(opt.cluster.names, opt.ratios[0]))
        grade = self.check(answer, **kw)
        return replace(grade, notes=(*grade.notes, self.lesson)) if self.lesson else grade

    # ------------------------------------------------------------------ helpers
    def _parse(self, answer: Mapping[str, str | Form | Storage]) -> dict[str, Form | Storage]:
        if not isinstance(answer, Mapping):
            raise AnswerError(
                f"an answer is a dict of tensor name -> form, got {type(answer).__name__}: write e.g. "
                f"{{{self.asks[0]!r}: 'G0'}}"
            )
        g = self.graph
        names = [t.name for t in g.tensors]
        out: dict[str, Form | Storage] = {}
        for name, value in answer.items():
            if not isinstance(name, str) or name not in names:
                near = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
                raise AnswerError(
                    f"unknown tensor {name!r} in the answer to {self.key!r}: the model has no tensor of that "
                    f"name. The exercise asks for {', '.join(self.asks)}"
                    + (f"; did you mean {', '.join(map(repr, near))}?" if near else "")
                    + " (ex.graph lists every tensor)"
                )
            if isinstance(value, (Form, Storage)):
                out[name] = value
                continue
            if not isinstance(value, str):
                raise AnswerError(
                    f"{name}: a form is a string such as 'I', 'G0', 'G(1)' or 'R', got {value!r}"
                )
            try:
                out[name] = parse_pin(value)
            except ValueError as e:
                raise AnswerError(f"{name}: {e}") from None
        missing = [n for n in self.asks if n not in out]
        if missing:
            raise AnswerError(
                f"the answer to {self.key!r} gives no form for {', '.join(missing)}: give one for each of "
                f"{', '.join(self.asks)} (e.g. {{{missing[0]!r}: 'I'}}); ex.sheet() lists their forms"
            )
        return out

    def _parse_ratios(self, ratios: Mapping[str, float] | Sequence[float] | None) -> list[float] | None:
        names = Cluster.resolve(self.cluster).names
        how = f"give one share per device, ratios={{device: share}} for {', '.join(names)} (or a list)"
        if ratios is None:
            if self.ratios:
                raise AnswerError(f"exercise {self.key!r} asks for ratios too: {how}")
            return None
        if isinstance(ratios, Mapping):
            odd = sorted(set(map(str, ratios)) ^ set(names))
            if odd:
                raise AnswerError(f"ratios: devices {', '.join(odd)} are unknown or missing; {how}")
            ratios = [ratios[k] for k in names]
        try:
            values = [float(v) for v in ratios]
        except (TypeError, ValueError):
            raise AnswerError(f"ratios must be numbers, got {ratios!r}; {how}") from None
        if len(values) != len(names) or any(v < 0 for v in values) or sum(values) <= 0:
            raise AnswerError(f"ratios {values}: {len(names)} non-negative numbers, not all zero; {how}")
        return [v / sum(values) for v in values]

    def _base(self, sfb: bool | None) -> Plan:
        """The optimum, or with ``sfb`` set the best plan with SFB allowed / forbidden (synthesized once)."""
        if sfb is None or (sfb and dict(self.optimum.options).get("sfb", True)):
            return self.optimum  # SFB allowed: the optimum's own search options
        key = f"sfb={bool(sfb)}"
        plan = self._cache.get(key)
        if plan is None:
            opts = {"sfb": bool(sfb)}
            plan = synthesize(
                self.model, self.cluster, dict(self.givens), pick="cost", options=opts, **dict(self.options)
            )
            self._cache[key] = plan
        return plan

    def _replan(self, pins: Mapping[str, str], fixed: list[float] | None, sfb: bool | None) -> Plan:
        """The best plan under ``pins`` (and fixed ratios / the SFB switch): the optimum re-planned (the Q/B
        loop from its ratios, reusing every search and LP made so; a fixpoint that keeps every pin, see
        :meth:`~hapnb.plans.plan.Plan.replan`); fixed ratios are a ratio pin on every device."""
        key = repr((sorted(pins.items()), fixed, sfb))
        plan = self._cache.get(key)
        if plan is None:
            base = self._base(sfb)
            ratio_pins = None if fixed is None else dict(zip(base.cluster.names, fixed))
            plan = self._cache[key] = base.replan(pins=pins, ratio_pins=ratio_pins, exact=False)
        return plan

    def _wanted(self, forms: Mapping[str, Form | Storage]) -> dict[int, Form] | Failure:
        """The answer and the givens as tensor id -> form (a storage computes with ``I``), or the
        :class:`Failure` of a form no triple gives the tensor, or of an answer that contradicts a given."""
        th, g = self.theory, self.graph
        givens = dict(self.givens)
        want: dict[int, Form] = {}
        for name, f in {**{t: parse_pin(f) for t, f in self.givens}, **forms}.items():
            t = g.tensor(name)
            if name in givens and name in forms and str(parse_pin(givens[name])) != str(forms[name]):
                why = f"the exercise fixes {name} = {givens[name]}: leave it out of the answer or give that"
                return Failure("", "", f"{name}:{forms[name]}", why)
            form = f.form if isinstance(f, Storage) else f
            if form not in th.forms[t.id] or (isinstance(f, Storage) and t.role != "param"):
                why = (
                    f"no triple of the theory gives {name} (shape {tuple(t.shape)}, role {t.role}) the form "
                    f"{f}: it can take only {', '.join(map(str, th.forms[t.id]))}. G(d) needs a dim of size "
                    ">= 2, R is only for computed tensors, a storage only for parameters"
                )
                return Failure("", "", f"{name}:{f}", why)
            want[t.id] = I if isinstance(f, Storage) else form
        return want

    def _local_failure(self, forms: Mapping[str, Form | Storage], sfb: bool | None) -> Failure | None:
        """The first triple the answer breaks, op by op in program order (see the module docstring)."""
        th, g = self.theory, self.graph
        want = self._wanted(forms)
        if isinstance(want, Failure):
            return want
        reach = _reachable(th)
        for op in g.ops:
            if not any(t in want for t in (*op.inputs, *op.outputs)):
                continue
            near = []
            for s in th.strategies[op.id]:
                bad = _mismatches(g, op, s, want, reach) if not (s.sfb and sfb is False) else None
                if bad == []:
                    break  # a triple of the op holds
                if bad is not None:
                    near.append((len(bad), s, bad))
            else:
                near.sort(key=lambda x: x[0])
                pre = ", ".join(f"{g.tensors[t].name}:{want.get(t, '?')}" for t in op.inputs)
                post = ", ".join(f"{g.tensors[t].name}:{want.get(t, '?')}" for t in op.outputs)
                nearest = tuple(dict.fromkeys(_strategy_text(g, op, s) for _, s, _ in near))[:3]
                clash = ", ".join(sorted({g.tensors[t].name for t in near[0][2]})) if near else "every tensor"
                why = (
                    f"the theory has no triple for {op.name} with these forms (a computed input may first "
                    "pass through a collective: G->I, R->I, R->G, I->G, G->G); the nearest triple disagrees "
                    f"on {clash}"
                )
                return Failure(op.name, op.target, f"{{{pre}}} {op.name} {{{post}}}", why, nearest)
        return None

    def _notes(self, plan: Plan, fixed: list[float] | None, sfb: bool | None, given: Any) -> tuple[str, ...]:
        out = []
        if fixed is not None and isinstance(given, Sequence) and abs(sum(map(float, given)) - 1.0) > 1e-9:
            out.append("the ratios were scaled to sum to 1")
        if sfb and not any(i.name == "load_sfb" for i in plan.program):
            out.append("SFB was allowed, but the best program with these forms does not use it")
        if fixed is not None:
            out.append(
                "ratios as given: " + ", ".join(f"{d} {r:.3f}" for d, r in zip(plan.cluster.names, fixed))
            )
        return tuple(out)

    def _hint(
        self, forms: Mapping[str, Form | Storage], fixed: list[float] | None, sfb: bool | None, plan: Plan
    ) -> str:
        """The single change toward the optimum that saves the most, found by re-planning each."""
        opt = self.optimum
        pins = {**dict(self.givens), **{n: str(f) for n, f in forms.items()}}
        changes: list[tuple[str, dict[str, str], list[float] | None, bool | None]] = []
        for name, f in forms.items():
            best = _chosen_form(opt, name)
            if best != str(f):
                changes.append(
                    (f"give {name} the form {best} instead of {f}", {**pins, name: best}, fixed, sfb)
                )
        if fixed is not None:
            lp = ", ".join(f"{d} {r:.3f}" for d, r in zip(opt.cluster.names, opt.ratios[0]))
            changes.append((f"let the ratio LP choose the ratios ({lp})", pins, None, sfb))
        uses = any(i.name == "load_sfb" for i in opt.program)
        if sfb is not None and bool(sfb) != uses:
            changes.append((f"{'allow' if uses else 'forbid'} SFB (sfb={uses})", pins, fixed, uses))
        tried = []
        for what, p, r, s in changes:
            try:
                other = self._replan(p, r, s)
            except (PinError, NoProgramError, RuntimeError):
                continue
            tried.append((plan.cost_s - other.cost_s, what, other))
        if not tried or max(t[0] for t in tried) <= plan.cost_s * _TIE:
            differ = [n for n in forms if _chosen_form(opt, n) != str(forms[n])]
            return (
                "no single change helps; the optimum differs in " + ", ".join(differ)
                if differ
                else "the optimum makes other choices for the tensors you left to the search: look at its "
                "collectives"
            )
        saving, what, other = max(tried, key=lambda t: t[0])
        mine, theirs = _comm_times(plan), _comm_times(other)
        gone = sorted((w for w in mine if w not in theirs), key=lambda w: -mine[w])
        return f"{what}: saves {_ms(saving)} of the {_ms(plan.cost_s - opt.cost_s)} gap" + (
            f" (no more {'; '.join(gone[:3])})" if gone else ""
        )


# ============================================================================================ theory


def _reachable(th: Theory) -> dict[int, dict[Form, set[Form]]]:
    """Per computed tensor, the forms its collective triples reach from each form (transitively)."""
    steps: dict[int, dict[Form, set[Form]]] = {}
    for tr in th.triples:
        ins = tr.instr
        if ins.kind == "collective" and ins.src is not None and ins.form is not None:
            steps.setdefault(ins.tensor, {}).setdefault(ins.src, set()).add(ins.form)
    out: dict[int, dict[Form, set[Form]]] = {}
    for t, edges in steps.items():
        out[t] = {}
        for start in edges:
            seen, todo = {start}, [start]
            while todo:
                for nxt in edges.get(todo.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            out[t][start] = seen
    return out


def _mismatches(
    g: Graph, op: Op, s: Strategy, want: Mapping[int, Form], reach: Mapping[int, Mapping[Form, set[Form]]]
) -> list[int]:
    """The tensors of ``op`` whose wanted form strategy ``s`` cannot use: an output must be made in its
    form, a loaded input loaded in it, a computed input reach the needed form through collectives."""
    bad = []
    for t, f in zip(op.outputs, s.outputs):
        if t in want and want[t] != f:
            bad.append(t)
    for t, f in zip(op.inputs, s.inputs):
        if t not in want or want[t] == f:
            continue
        if g.tensors[t].role in LOADABLE_ROLES or f not in reach.get(t, {}).get(want[t], {want[t]}):
            bad.append(t)
    return bad


def _strategy_text(g: Graph, op: Op, s: Strategy) -> str:
    """A compute triple of ``op`` under strategy ``s``, with tensor names."""
    ins = ", ".join(f"{g.tensors[t].name}:{f}" for t, f in zip(op.inputs, s.inputs))
    outs = ", ".join(f"{g.tensors[t].name}:{f}" for t, f in zip(op.outputs, s.outputs))
    return f"{{{ins}}} {op.name}[{s.name}] {{{outs}}}" + (" (SFB)" if s.sfb else "")


def _chosen_form(plan: Plan, tensor: str) -> str:
    """The form a plan gives ``tensor`` first: its load form (or ZeRO storage) or the form it is made in."""
    for ins in plan.program:
        if ins.kind == "load" and ins.tensor == tensor:
            if ins.name.startswith("load_zero"):
                return f"zero{ins.name.removeprefix('load_zero')}({ins.src.removeprefix('G')})"
            return ins.form
        for t, f in ins.outputs:
            if t == tensor:
                return f
    forms = plan.form_of(tensor)
    return forms[0] if forms else "I"


def _comm_times(plan: Plan) -> dict[str, float]:
    """Every communication of the plan's program (a collective, a gradient all-reduce, an SFB gather,
    a ZeRO gather) by what it moves, with its seconds (forward and backward); free collectives left out."""
    out: dict[str, float] = {}
    for ins in plan.program:
        for c in ins.comm:
            what = c.what if ins.kind != "collective" else f"{ins.name} {ins.tensor} {ins.src}->{ins.form}"
            out[what] = out.get(what, 0.0) + c.time_s
    return out


def _collectives(plan: Plan) -> tuple[str, ...]:
    """Every communication of the plan's program, one line each with its time, in program order."""
    return tuple(f"{w} ({_ms(s)})" for w, s in _comm_times(plan).items())


def _proof(plan: Plan) -> tuple[str, ...]:
    """The plan's program as a chain of Hoare triples, one per instruction."""
    out = []
    for ins in plan.program:
        if ins.kind == "load":
            stored = f"({ins.src})" if ins.src else ""
            out.append(f"{{}} {ins.name}{stored} {ins.tensor} {{{ins.tensor}:{ins.form}}}")
        elif ins.kind == "collective":
            out.append(f"{{{ins.tensor}:{ins.src}}} {ins.name} {{{ins.tensor}:{ins.form}}}")
        else:
            pre = ", ".join(f"{t}:{f}" for t, f in ins.inputs)
            post = ", ".join(f"{t}:{f}" for t, f in ins.outputs)
            out.append(f"{{{pre}}} {ins.op}[{ins.name}] {{{post}}}")
    return tuple(out)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


# ============================================================================================ rendering


def _time_chart(plans: Mapping[str, Plan], *, width: int = 640, height: int | None = None) -> Any:
    """Stacked bars per plan and device: communication, computation and waiting (the stage model: every
    stage waits for its slowest device), the legend outside the bars."""
    from bokeh.models import FactorRange, Legend
    from bokeh.plotting import figure

    rows: list[tuple[str, str]] = []
    comm, comp, wait = [], [], []
    for label, plan in plans.items():
        for j, d in enumerate(plan.cluster.names):
            rows.append((label, d))
            comm.append(sum(st.comm_s for st in plan.stages) * 1e3)
            comp.append(sum(st.comp_s[j] for st in plan.stages) * 1e3)
            wait.append(sum(max(st.comp_s) - st.comp_s[j] for st in plan.stages) * 1e3)
    data = {"row": rows, "communication": comm, "computation": comp, "waiting": wait}
    fig = figure(
        y_range=FactorRange(*reversed(rows)),
        width=width,
        height=height or 90 + 30 * len(rows),
        x_axis_label="ms per iteration (stage model)",
        title="Where each device's time goes",
    )
    parts = ("communication", "computation", "waiting")
    bars = fig.hbar_stack(parts, y="row", height=0.7, source=data, color=("#e6550d", "#3182bd", "#dddddd"))
    legend = Legend(items=[(p, [b]) for p, b in zip(parts, bars)], location="center")
    fig.add_layout(legend, "right")
    fig.ygrid.grid_line_color = None
    return fig


def _grade_html(g: Grade) -> str:
    e = display.esc
    color = {"optimal": "#2ca02c", "valid": "#e6a100", "invalid": "#d62728"}[g.status]
    asked = ", ".join(f"<code>{e(t)}</code> = <b>{e(f)}</b>" for t, f in g.answer) or "(no forms)"
    out = [
        f"<div style='border-left:4px solid {color};padding:4px 10px;font-size:13px'>",
        f"<div><b>{e(g.exercise)}</b>: {asked}</div>",
        f"<div style='color:{color};font-weight:bold'>{e(g.status.upper())}</div>",
    ]
    if g.cost_s is not None:
        top = max(g.cost_s, g.optimum_s)
        for label, v, c in (("your answer", g.cost_s, color), ("optimum", g.optimum_s, "#2ca02c")):
            w = int(240 * v / top) if top > 0 else 0
            out.append(
                f"<div style='font-family:monospace'>{label:>12}: <span style='display:inline-block;"
                f"width:{w}px;height:10px;background:{c}'></span> {e(_ms(v))}</div>"
            )
        out.append(f"<div>gap: {e(_ms(g.gap_s or 0.0))} ({100 * (g.gap or 0.0):+.1f} %)</div>")
    if g.failure is not None:
        f = g.failure
        where = f"op <code>{e(f.op)}</code> ({e(f.target)})" if f.op else "the answer"
        out.append(f"<div>fails at {where}: <code>{e(f.asked)}</code></div><div>why: {e(f.reason)}</div>")
        if f.nearest:
            out.append("<div>nearest triples of the theory:</div><ul>")
            out += [f"<li><code>{e(t)}</code></li>" for t in f.nearest]
            out.append("</ul>")
    if g.valid:
        items = [f"<li><code>{e(c)}</code></li>" for c in g.collectives] or ["<li>nothing</li>"]
        more = f"<details><summary>and {len(items) - 8} more</summary><ul>{''.join(items[8:])}</ul></details>"
        out.append(
            f"<div>communicates:</div><ul>{''.join(items[:8])}</ul>" + (more if len(items) > 8 else "")
        )
    if g.hint:
        out.append(f"<div><b>hint</b>: {e(g.hint)}</div>")
    out += [f"<div style='color:#555'>note: {e(n)}</div>" for n in g.notes]
    if g.proof:
        chain = "".join(f"<li><code>{e(p)}</code></li>" for p in g.proof)
        out.append(
            f"<details><summary>proof: {len(g.proof)} triples to loss : R</summary><ol>{chain}</ol></details>"
        )
    out.append("</div>")
    return "".join(out)


def _exercise_html(ex: Exercise) -> str:
    e = display.esc
    rows = "".join(
        f"<tr><td><code>{e(n)}</code></td><td>{e(r)}</td><td>{e(shape)}</td><td>{e(', '.join(f))}</td></tr>"
        for n, r, shape, f in ex.sheet()
    )
    head = "<tr><th>tensor</th><th>role</th><th>shape</th><th>forms it can take</th></tr>"
    given = "".join(f"<li><code>{e(t)}</code> = <b>{e(f)}</b></li>" for t, f in ex.givens)
    extra = ["ratios: <code>ratios={device: share}</code>"] if ex.ratios else []
    extra += ["whether SFB may be used: <code>sfb=True</code> or <code>False</code>"] if ex.sfb else []
    opts = ", ".join(f"{k}={v}" for k, v in ex.options)
    return (
        f"<div style='font-size:13px'><h4 style='margin:4px 0'>{e(ex.title)} <code>({e(ex.key)})</code></h4>"
        f"<p>{e(ex.task)}</p><div>model <code>{e(ex.model)}</code> ({e(opts)}) on</div>"
        + display.cluster_html(ex.optimum.cluster)
        + (f"<div>given:</div><ul>{given}</ul>" if given else "")
        + (f"<div>your answer gives:</div><table>{head}{rows}</table>" if rows else "")
        + ("<div>and " + "; ".join(extra) + "</div>" if extra else "")
        + "</div>"
    )


# ============================================================================================ exercises

_SMALL_MLP = (("layers", 1), ("hidden", 512), ("input", 512), ("batch", 32))

EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "shard-linear", "Shard a linear layer",
        "The first layer of an MLP computes linear = x @ W.T + b on two V100s. Choose forms for the batch x "
        "[batch, in] and the weight W [out, in] (PyTorch's layout). Any pair that one of linear's triples "
        "accepts is valid; which one needs the least communication?",
        "mlp", _SMALL_MLP, "2xV100", ("x", "layers.0.weight"),
        lesson="Data parallelism (x:G0, W:I) must sum W's gradient over the devices (an all-reduce, or SFB's "
        "gathers of its factors); sharding W instead keeps the batch whole on every device and makes the "
        "layer's output sharded (W:G0) or partial (x:G1, W:G1).",
    ),
    Exercise(
        "megatron-mlp", "Column, then row: a tensor-parallel MLP",
        "Every device holds the whole (small) batch, x = I. Make the two linears of the MLP tensor parallel "
        "without gathering the wide hidden activation: give forms to the first weight, the activation after "
        "relu and the head's weight.",
        "mlp", (("layers", 1), ("hidden", 4096), ("input", 1024), ("batch", 8)), "2xV100",
        ("layers.0.weight", "relu", "head.weight"), givens=(("x", "I"),),
        lesson="Column-parallel W1 (G0) makes the activation sharded on its features (G1); a row-parallel "
        "head (G1) then sums partial results (R), reduced once for the loss.",
    ),
    Exercise(
        "attention-heads", "Shard attention by heads",
        "A GPT block on two A100s reads one long sequence (tokens = I). Choose forms for the fused qkv "
        "weight, the attention output (after "
        "scaled_dot_product_attention, [batch, heads, seq, head_dim]) and the output projection's weight.",
        "gpt", (("layers", 1), ("hidden", 1024), ("heads", 16), ("vocab", 64), ("seq", 1024), ("batch", 1)),
        "2xA100", ("blocks.0.qkv.weight", "scaled_dot_product_attention", "blocks.0.proj.weight"),
        givens=(("tokens", "I"),),
        lesson="Heads are independent: split qkv's rows (G0), each device attends over its heads (G1 of the "
        "attention output), and the projection's input columns follow (G1), leaving partial sums.",
    ),
    Exercise(
        "moe-experts", "Place 6 experts on 4 devices",
        "The odd layer of this BERT is a mixture of 6 experts (w1 [experts, hidden, ff], w2 [experts, ff, "
        "hidden]) on 2 A100 + 2 P100. Choose forms for the two expert weights: replicate them, or split "
        "the experts (uneven shards are allowed: 6 experts need not be padded to 8)?",
        "bert-moe",
        (("layers", 2), ("hidden", 64), ("heads", 4), ("vocab", 64), ("seq", 24), ("batch", 16),
         ("experts", 6)),
        "2xA100+2xP100", ("layers.1.moe.w1", "layers.1.moe.w2"),
        lesson="Splitting dim 0 is expert parallelism; the ratios decide how many experts each device holds.",
    ),
    Exercise(
        "uneven-ratios", "Uneven ratios on a mixed cluster",
        "Data parallelism on one V100 and two P100s (x is sharded by the data loader). The V100 is the "
        "faster GPU (the cluster table gives each device's flop/s). Give each device its share of the batch "
        "(ratios) and the form of the first weight.",
        "mlp", (("layers", 2), ("hidden", 256), ("input", 256), ("batch", 8192)), "1xV100+2xP100",
        ("layers.0.weight",), givens=(("x", "G0"),), ratios=True,
        lesson="Even shares make the fast GPU wait; shares proportional to speed balance the computation, "
        "and the ratio LP also weighs the communication that the largest shard sets.",
    ),
    Exercise(
        "sfb", "When does SFB pay?",
        "x is sharded by rows (the data loader) over 2 V100 + 2 P100 and the weights are replicated. Either "
        "all-reduce each weight's gradient, or use sufficient factor broadcasting (SFB): all-gather the "
        "layer's input and output gradient, B x (in + out) numbers instead of in x out. Decide with sfb=True "
        "or sfb=False; then try ex.variant(batch=...) to find where the answer flips.",
        "mlp", (("layers", 1), ("hidden", 1024), ("input", 1024), ("batch", 4)), "2xV100+2xP100",
        ("layers.0.weight",), givens=(("x", "G0"),), sfb=True,
        lesson="SFB pays when the batch is small against the weight: B (in + out) < in x out.",
    ),
)  # fmt: skip


def exercise(key: str | int) -> Exercise:
    """An exercise by key (``"shard-linear"``) or number (1 = the first of :data:`EXERCISES`).

    >>> exercise(1).key
    'shard-linear'
    """
    if isinstance(key, int) and not isinstance(key, bool):
        if not 1 <= key <= len(EXERCISES):
            raise AnswerError(f"exercise numbers run from 1 to {len(EXERCISES)}, got {key}")
        return EXERCISES[key - 1]
    for ex in EXERCISES:
        if ex.key == key:
            return ex
    raise AnswerError(f"no exercise {key!r}: the exercises are {', '.join(x.key for x in EXERCISES)}")


def check(
    key: str | int | Exercise,
    answer: Mapping[str, str | Form | Storage],
    *,
    ratios: Mapping[str, float] | Sequence[float] | None = None,
    sfb: bool | None = None,
) -> Grade:
    """Grade ``answer`` for an exercise (its key, number or the :class:`Exercise`): :meth:`Exercise.check`.

    >>> check("shard-linear", {"x": "I", "layers.0.weight": "G0"}).valid
    True
    """
    ex = key if isinstance(key, Exercise) else exercise(key)
    return ex.check(answer, ratios=ratios, sfb=sfb)
