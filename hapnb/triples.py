"""The background theory: every Hoare triple the rules generate for one single-device program.

A *property* ``(t, f)`` says a distributed tensor relates to reference tensor ``t`` by form ``f``
(:mod:`hapnb.ir.forms`). A triple ``{pre} instruction {post}`` says that running the instruction on every
device when ``pre`` holds establishes ``post`` (paper §4.2). The theory holds three kinds of triples:

* **compute**: one per (op, strategy) from :mod:`hapnb.rules`;
* **load**: ``{} load {p:I}`` and ``{} load {p:G(d)}`` for parameters, buffers, constants and inputs, and
  for parameters ``{} load_zero2(G(d)) {p:I}`` / ``{} load_zero3(G(d)) {p:I}``: stored sharded on ``d``
  (parameter, gradient and optimizer state) and all-gathered before use (:class:`hapnb.cost.model.Load`);
* **collective**: ``{G(d)} all_gather {I}`` (padded) and ``{G(d)} grouped_all_gather {I}``,
  ``{R} all_reduce {I}``, ``{R} reduce_scatter(d) {G(d)}`` (padded and grouped),
  ``{G(a)} all_to_all(a,b) {G(b)}``, ``{I} slice(d) {G(d)}`` (free), and for the loss ``{I} to_partial {R}``
  (rank 0 keeps the value, the others hold zero).

The theory also fixes how G(d) shards are cut: all G-form dims that one strategy shards together are
the same partition, so they form a *dim class*; a class shares a base length (the gcd of its dims'
lengths) and each dim is ``unit * base`` with lengths ``unit * shard_lengths(base, ratios)``.

>>> import torch, hapnb
>>> g = hapnb.trace(torch.nn.Linear(4, 2), (torch.randn(6, 4),), loss=lambda y: y.sum())
>>> t = hapnb.theory(g)
>>> any(tr.instr.kind == "collective" for tr in t)
True
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .ir.collective_table import COLLECTIVES as COLLECTIVE_TABLE
from .ir.collective_table import conversions
from .ir.forms import Form, G, I, R, shard_lengths
from .ir.graph import Graph, Op, TensorRef
from .rules import RULE_SOURCES, Strategy
from .tracing.constants import folded_constants

__all__ = [
    "Prop", "Instr", "Triple", "Theory", "theory", "dim_class", "COLLECTIVES", "LOADABLE_ROLES",
    "Coverage", "CoverageRow", "coverage", "RULE_SOURCES", "batch_tensors",
]  # fmt: skip

Prop = tuple[int, Form]
LOADABLE_ROLES = ("input", "param", "buffer", "const")

#: collective name -> (source form kind, destination form kind, description)
#: the collectives of the theory, name -> (source kind, destination kind, what it does): the table of
#: :mod:`hapnb.ir.collective_table` less ``reshard`` (inserted at segment edges, not a triple)
COLLECTIVES: Mapping[str, tuple[str, str, str]] = {
    c.name: (c.src, c.dst, c.note) for c in COLLECTIVE_TABLE.values() if not c.resegments
}


@dataclass(frozen=True)
class Instr:
    """An instruction of a distributed program.

    ``kind`` is ``compute`` (``op`` and ``strategy`` set), ``load`` (``tensor`` and ``form``) or
    ``collective`` (``tensor``, ``name`` from :data:`COLLECTIVES`, ``src`` and ``form``).
    """

    kind: str
    name: str
    op: int = -1
    tensor: int = -1
    strategy: Strategy | None = None
    src: Form | None = None
    form: Form | None = None


@dataclass(frozen=True)
class Triple:
    """A Hoare triple ``{pre} instr {post}`` over properties ``(tensor id, form)``."""

    id: int
    pre: tuple[Prop, ...]
    instr: Instr
    post: tuple[Prop, ...]

    def format(self, graph: Graph) -> str:
        def props(ps: Sequence[Prop]) -> str:
            return ", ".join(f"{graph.tensors[t].name}:{f}" for t, f in ps)

        i = self.instr
        if i.kind == "compute":
            label = f"{graph.ops[i.op].name}[{i.name}]"
        elif i.kind == "load":
            stored = f"({i.src})" if i.src is not None else ""
            label = f"{i.name}{stored} {graph.tensors[i.tensor].name}"
        else:
            label = i.name
        return f"{{{props(self.pre)}}} {label} {{{props(self.post)}}}"


def _valid_forms(t: TensorRef) -> list[Form]:
    forms = [I]
    if t.is_float and t.role not in LOADABLE_ROLES:
        forms.append(R)
    forms += [G(d) for d, s in enumerate(t.shape) if s >= 2]
    return forms


class _DimClasses:
    """Union-find over (tensor, dim) pairs that one strategy shards as the same partition."""

    def __init__(self) -> None:
        self.parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(self, x: tuple[int, int]) -> tuple[int, int]:
        p = self.parent.setdefault(x, x)
        while p != x:
            gp = self.parent.setdefault(p, p)
            self.parent[x] = gp
            x, p = p, gp
        return x

    def union(self, a: tuple[int, int], b: tuple[int, int]) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


class _Triples(Sequence):  # type: ignore[type-arg]
    """The triples of a theory, made on first use: the search reads the theory's per-op strategies,
    forms and dim classes, never the triples themselves (the displays and the checker do)."""

    def __init__(self, make: Callable[[], list[Triple]]) -> None:
        self._make: Callable[[], list[Triple]] | None = make
        self._items: tuple[Triple, ...] = ()

    def _all(self) -> tuple[Triple, ...]:
        if self._make is not None:
            self._items, self._make = tuple(self._make()), None
        return self._items

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[Triple]:
        return iter(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


@dataclass(eq=False)
class Theory:
    """All triples of one program, indexed for the search and filterable for display."""

    #: What each collective does, one line each (renderers show it next to collective triples).
    collective_notes: ClassVar[Mapping[str, str]] = {k: v[2] for k, v in COLLECTIVES.items()}

    graph: Graph
    triples: Sequence[Triple]  # a tuple, or made on first use (theory())
    strategies: tuple[tuple[Strategy, ...], ...]  # per op
    forms: tuple[tuple[Form, ...], ...]  # valid forms per tensor
    units: dict[tuple[int, int], tuple[int, int]] = field(repr=False)  # (t, d) -> (unit, base)
    requires_grad: tuple[bool, ...] = ()
    #: per op, the first strategy of the unrestricted theory (:meth:`without` keeps it; by default each op's
    #: first): what the cost model weighs an op's work by when it decides whether a device is launch bound, so
    #: that a restricted space prices every program as the whole theory does
    first: tuple[Strategy, ...] = ()
    _cuts: dict[tuple[int, tuple[float, ...]], tuple[int, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.first:
            self.first = tuple(ss[0] for ss in self.strategies)

    def __iter__(self) -> Iterator[Triple]:
        return iter(self.triples)

    def __len__(self) -> int:
        return len(self.triples)

    def __getitem__(self, i: int) -> Triple:
        return self.triples[i]

    def filter(
        self, *, op: str | int | None = None, tensor: str | int | None = None, kind: str | None = None
    ) -> list[Triple]:
        """Triples of one op (name or id), touching one tensor (name or id), or of one kind."""
        g = self.graph
        op_id = g.ops[op].id if isinstance(op, int) else None
        if isinstance(op, str):
            op_id = next((o.id for o in g.ops if o.name == op or o.target == op), None)
            if op_id is None and not any(op in o.target for o in g.ops):
                raise KeyError(f"no op named {op!r}")
        t_id = g.tensor(tensor).id if tensor is not None else None
        out = []
        for tr in self.triples:
            if kind is not None and tr.instr.kind != kind:
                continue
            if op is not None:
                if tr.instr.kind != "compute":
                    continue
                o = g.ops[tr.instr.op]
                if op_id is not None and o.id != op_id:
                    continue
                if op_id is None and isinstance(op, str) and op not in o.target:
                    continue
            if t_id is not None and all(t != t_id for t, _ in tr.pre + tr.post):
                continue
            out.append(tr)
        return out

    def lengths(self, tensor: int, dim: int, ratios: Sequence[float]) -> tuple[int, ...]:
        """Integer shard lengths of ``tensor`` on ``dim`` for one segment's ``ratios``."""
        size = self.graph.tensors[tensor].shape[dim]
        unit, base = self.units.get((tensor, dim), (1, size))
        # many tensors share a base length: cut each (base, ratios) once (plans and the cost model ask often)
        key = (base, ratios if isinstance(ratios, tuple) else tuple(ratios))
        lens = self._cuts.get(key)
        if lens is None:
            lens = self._cuts[key] = shard_lengths(base, key[1])
        return tuple(unit * n for n in lens) if unit != 1 else lens

    def without(self, drop: Callable[[Op, Strategy], bool]) -> Theory:
        """This theory less the compute strategies ``drop(op, strategy)`` rejects, with the same graph,
        forms and shard cuts: a smaller program space (the tensor-parallel baseline keeps the batch whole,
        :func:`hapnb.synth.seeds.batch_replicated`). Raises ValueError naming an op left without a strategy.

        >>> import torch, hapnb
        >>> g = hapnb.trace(torch.nn.Linear(4, 2), (torch.randn(6, 4),), loss=lambda y: y.sum())
        >>> th = hapnb.theory(g)
        >>> len(th.without(lambda op, s: s.name != "replicate").strategies[0])
        1
        """
        g, forms = self.graph, self.forms
        per_op: list[tuple[Strategy, ...]] = []
        for op, ss in zip(g.ops, self.strategies):
            kept = tuple(s for s in ss if not drop(op, s))
            if not kept:
                raise ValueError(f"op {op.name} ({op.target}) has no strategy left in the restricted theory")
            per_op.append(kept)
        return Theory(
            g,
            _Triples(lambda: _all_triples(g, per_op, forms)),
            tuple(per_op),
            forms,
            self.units,
            self.requires_grad,
            self.first,
        )

    def format(self, tr: Triple) -> str:
        return tr.format(self.graph)

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for tr in self.triples:
            kinds[tr.instr.kind] = kinds.get(tr.instr.kind, 0) + 1
        parts = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
        return f"Theory of {self.graph.name}: {len(self.triples)} triples ({parts})"

    def _repr_html_(self) -> str:
        from . import display

        return display.safe_html(display.theory_html, self)


def _requires_grad(g: Graph) -> tuple[bool, ...]:
    """Per tensor, whether the backward computes its gradient: a trainable parameter (``requires_grad``;
    a frozen one, as a LoRA fine-tune's base weights, is not) and every float result of an op that
    takes one."""
    rg = [t.role == "param" and t.requires_grad for t in g.tensors]
    for op in g.ops:
        if any(rg[t] for t in op.inputs):
            for t in op.outputs:
                rg[t] = g.tensors[t].is_float
    return tuple(rg)


def theory(graph: Graph, strategies: Callable[[Graph, Op], Sequence[Strategy]] | None = None) -> Theory:
    """Build the theory of ``graph``: compute triples from the rules plus loader and collective triples."""
    if strategies is None:
        from . import rules

        strategies = rules.strategies
        signature = _op_signature  # the rules' answer depends only on it: one call per signature
    else:
        signature = _no_signature
    g = graph
    forms = [tuple(_valid_forms(t)) for t in g.tensors]
    classes = _DimClasses()
    per_op: list[tuple[Strategy, ...]] = []
    answered: dict[Any, Sequence[Strategy]] = {}
    for op in g.ops:
        ok = []
        key = signature(g, op)
        found = answered.get(key) if key is not None else None
        if found is None:
            found = strategies(g, op)
            if key is not None:
                answered[key] = found
        for s in found:
            pairs = [(t, f) for t, f in zip(op.inputs, s.inputs)] + [
                (t, f) for t, f in zip(op.outputs, s.outputs)
            ]
            if any(f not in forms[t] for t, f in pairs):
                continue  # a form the tensor cannot take (e.g. G on a size-1 dim)
            ok.append(s)
            gdims = [(t, f.dim) for t, f in pairs if f.kind == "G"]
            for a in gdims[1:]:
                classes.union(gdims[0], a)
        if not ok:
            raise ValueError(f"op {op.name} ({op.target}) has no valid strategy; its rule is broken")
        per_op.append(tuple(ok))
    # every (t, d) gets unit/base from its class's gcd
    members: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t, fs in enumerate(forms):
        for f in fs:
            if f.kind == "G":
                members.setdefault(classes.find((t, f.dim)), []).append((t, f.dim))
    units: dict[tuple[int, int], tuple[int, int]] = {}
    for ms in members.values():
        base = 0
        for t, d in ms:
            base = math.gcd(base, g.tensors[t].shape[d])
        for t, d in ms:
            units[(t, d)] = (g.tensors[t].shape[d] // base, base)

    def make() -> list[Triple]:
        return _all_triples(g, per_op, forms)

    return Theory(g, _Triples(make), tuple(per_op), tuple(forms), units, _requires_grad(g))


def _op_signature(g: Graph, op: Op) -> Any:
    """What :func:`hapnb.rules.strategies` reads of an op (its target, family, flops, non-tensor arguments,
    the shapes and dtypes of its tensors, which inputs are the same tensor, which results it keeps): ops
    with equal signatures (a model's repeated layers) get equal strategies. None when an argument cannot
    be hashed."""
    ts = g.tensors
    key = (
        op.target, op.family, op.flops, op.args, op.kwargs, op.output_items,
        tuple(op.inputs.index(t) for t in op.inputs),
        tuple((ts[t].shape, ts[t].dtype) for t in op.inputs),
        tuple((ts[t].shape, ts[t].dtype) for t in op.outputs),
    )  # fmt: skip
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _no_signature(g: Graph, op: Op) -> Any:
    """A caller's own strategies function may read anything: no sharing."""
    return None


def _all_triples(
    g: Graph, per_op: Sequence[tuple[Strategy, ...]], forms: Sequence[tuple[Form, ...]]
) -> list[Triple]:
    """Loader, compute and collective triples of ``g`` (the body of :func:`theory`'s triples)."""
    triples: list[Triple] = []

    def add(pre: Sequence[Prop], instr: Instr, post: Sequence[Prop]) -> None:
        triples.append(Triple(len(triples), tuple(pre), instr, tuple(post)))

    for t in g.tensors:
        if t.role in LOADABLE_ROLES:
            for f in forms[t.id]:
                add((), Instr("load", "load", tensor=t.id, form=f), ((t.id, f),))
        if t.role == "param":  # stored sharded, all-gathered before use (ZeRO-2 keeps it, ZeRO-3 re-gathers)
            for f in forms[t.id]:
                if f.kind == "G":
                    for z in (2, 3):
                        add((), Instr("load", f"load_zero{z}", tensor=t.id, src=f, form=I), ((t.id, I),))
    for op, ss in zip(g.ops, per_op):
        for s in ss:
            add(
                tuple(zip(op.inputs, s.inputs)),
                Instr("compute", s.name, op=op.id, strategy=s),
                tuple(zip(op.outputs, s.outputs)),
            )
    for t in g.tensors:
        if t.role in LOADABLE_ROLES or not t.is_float:
            continue  # parameters and inputs are loaded in the form they are needed, never communicated
        fs = forms[t.id]
        gs = [f for f in fs if f.kind == "G"]
        for f in gs:
            for name in conversions("G", "I"):
                add(((t.id, f),), Instr("collective", name, tensor=t.id, src=f, form=I), ((t.id, I),))
            add(((t.id, I),), Instr("collective", "slice", tensor=t.id, src=I, form=f), ((t.id, f),))
            if R in fs:
                for name in conversions("R", "G"):
                    add(((t.id, R),), Instr("collective", name, tensor=t.id, src=R, form=f), ((t.id, f),))
            for f2 in gs:
                if f2 != f:
                    add(
                        ((t.id, f),),
                        Instr("collective", "all_to_all", tensor=t.id, src=f, form=f2),
                        ((t.id, f2),),
                    )
        if R in fs:
            add(((t.id, R),), Instr("collective", "all_reduce", tensor=t.id, src=R, form=I), ((t.id, I),))
        if t.id == g.loss:
            add(((t.id, I),), Instr("collective", "to_partial", tensor=t.id, src=I, form=R), ((t.id, R),))
    return triples


def dim_class(th: Theory, tensor: int, dim: int) -> tuple[tuple[int, int], ...]:
    """The ``(tensor, dim)`` pairs in the same *dim class* as ``(tensor, dim)`` (see the module docstring:
    the dims some chain of the theory's strategies shards as one partition), sorted; ``((tensor, dim),)``
    when no strategy shards it.

    >>> import torch, hapnb
    >>> g = hapnb.trace(torch.nn.Linear(4, 2), (torch.randn(6, 4),), loss=lambda y: y.sum())
    >>> [(g.tensors[t].name, d) for t, d in dim_class(hapnb.theory(g), g.tensor("weight").id, 0)]
    [('weight', 0), ('bias', 0), ('linear', 1)]
    """
    classes = _DimClasses()
    for op, ss in zip(th.graph.ops, th.strategies):
        for s in ss:
            gdims = [
                (t, f.dim) for t, f in zip(op.inputs + op.outputs, s.inputs + s.outputs) if f.kind == "G"
            ]
            for a in gdims[1:]:
                classes.union(gdims[0], a)
    root = classes.find((tensor, dim))
    return tuple(sorted(k for k in list(classes.parent) if classes.find(k) == root)) or ((tensor, dim),)


@dataclass(frozen=True)
class CoverageRow:
    """One op of the program: where its rule comes from and how many strategies it offers."""

    op: str
    target: str
    source: str  # a key of hapnb.rules.RULE_SOURCES
    strategies: int  # the replicated one included
    origin: str = ""  # the op it was lowered from (source "decomposed")
    module: str = ""


#: why an op that no strategy lets shard the batch blocks it, by target (the hint :class:`Coverage` shows)
_BLOCKER_HINTS = {
    "aten.sort.default": "a sort over the whole batch: Hugging Face MoE layers dispatch tokens so by default "
    "(sort by expert, index_put back); experts_implementation='batched_mm' shards the batch",
}


@dataclass(frozen=True)
class Coverage:
    """Every op of a program by rule source (:func:`coverage`); ``fallback`` lists the ops without any
    rule, which run replicated; ``folded`` names the constants that replaced work depending on no input,
    weight or state (:mod:`hapnb.tracing.constants`: those ops are not in the program); ``blockers`` the
    ops (names) that work on batch data (:func:`batch_tensors`) but have no strategy that shards it: they
    replicate the batch whatever the cluster (ops without a rule, and rules that cannot split the op's
    use, such as a sort over all tokens)."""

    name: str
    rows: tuple[CoverageRow, ...]
    folded: tuple[str, ...] = ()
    blockers: tuple[str, ...] = ()

    @property
    def batch_blockers(self) -> tuple[CoverageRow, ...]:
        names = set(self.blockers)
        return tuple(r for r in self.rows if r.op in names)

    @property
    def fallback(self) -> tuple[CoverageRow, ...]:
        return tuple(r for r in self.rows if r.source == "none")

    def counts(self) -> dict[str, int]:
        """Ops per rule source (every source listed, zero included)."""
        out = dict.fromkeys(RULE_SOURCES, 0)
        for r in self.rows:
            out[r.source] += 1
        return out

    def targets(self, source: str) -> dict[str, int]:
        """The op targets of one source with their counts, most frequent first."""
        out: dict[str, int] = {}
        for r in self.rows:
            if r.source == source:
                out[r.target] = out.get(r.target, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "counts": self.counts(),
            "targets": {s: self.targets(s) for s in RULE_SOURCES},
            "lowered_from": sorted({r.origin for r in self.rows if r.origin}),
            "fallback_ops": [[r.op, r.target] for r in self.fallback],
            "folded_constants": list(self.folded),
            "batch_blockers": [[r.op, r.target, r.module] for r in self.batch_blockers],
        }

    def summary(self) -> str:
        c = self.counts()
        lines = [f"rule coverage of {self.name}: {len(self.rows)} ops"]
        for src, what in RULE_SOURCES.items():
            lines.append(f"  {src:10s} {c[src]:5d}  ({what})")
            for t, k in self.targets(src).items():
                if src != "hand":
                    lines.append(f"      {k:4d} x {t}")
        lowered = sorted({r.origin for r in self.rows if r.origin})
        if lowered:
            lines.append(f"  lowered at trace time: {', '.join(lowered)}")
        if self.folded:
            shown = ", ".join(self.folded[:4]) + (
                f", ... ({len(self.folded)} in all)" if len(self.folded) > 4 else ""
            )
            lines.append(
                f"  computed once at trace time (no input, weight or state), loaded as constants: {shown}"
            )
        if self.fallback:
            lines.append(
                "  ops without a rule run replicated and force their tensors to I; see docs/benchmarks/models.md "
                "('Bring your own model') for what to do"
            )
        blockers = self.batch_blockers
        if blockers:
            lines.append(
                f"  {len(blockers)} ops on batch data that no strategy shards (they replicate the batch):"
            )
            for target in dict.fromkeys(r.target for r in blockers):
                where = sorted({r.module or "<top>" for r in blockers if r.target == target})
                shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
                hint = _BLOCKER_HINTS.get(target)
                lines.append(f"      {target} in {shown}" + (f" ({hint})" if hint else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


def coverage(th: Theory) -> Coverage:
    """Every op of ``th``'s program by rule source: ``hand`` (a rule table), ``decomposed`` (lowered at
    trace time to ops with hand rules, :mod:`hapnb.tracing.lower`), ``discovered`` (strategies found by
    ground truth) or ``none`` (runs replicated).

    >>> import torch, hapnb
    >>> g = hapnb.trace(torch.nn.Linear(4, 2), (torch.randn(6, 4),), loss=lambda y: y.sum())
    >>> coverage(hapnb.theory(g)).counts()["none"]
    0
    """
    g = th.graph
    rows = []
    batchy = batch_tensors(g)
    blockers = []
    for op, strats in zip(g.ops, th.strategies):
        if op.family != "unknown":
            src = "decomposed" if op.origin else "hand"
        else:
            src = "discovered" if len(strats) > 1 else "none"
        rows.append(CoverageRow(op.name, op.target, src, len(strats), op.origin, op.module))
        ins = [k for k, t in enumerate(op.inputs) if t in batchy]
        if op.flops > 0 and ins:
            if not any(s.scaled_flops > 0 and any(s.inputs[k].kind == "G" for k in ins) for s in strats):
                blockers.append(op.name)
    return Coverage(g.name, tuple(rows), folded_constants(g), tuple(blockers))


def batch_tensors(graph: Graph) -> frozenset[int]:
    """Ids of the tensors of ``graph`` that carry the batch: reachable from a graph input by data flow,
    with a leading dim that is a positive multiple of the batch (``B``, ``B x S``, ...; the batch is the
    first input's dim 0). Empty for a batch under 2 or a graph without inputs."""
    if not graph.inputs:
        return frozenset()
    first = graph.tensors[graph.inputs[0]]
    batch = first.shape[0] if first.shape else 0
    if batch < 2:
        return frozenset()
    reached = set(graph.inputs)
    for op in graph.ops:  # ops are in program order
        if any(t in reached for t in op.inputs):
            reached.update(op.outputs)
    return frozenset(t for t in reached if graph.tensors[t].shape and graph.tensors[t].shape[0] % batch == 0)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hapnb.triples --check [OP ...]``: check every rule against ground truth."""
    from . import rules

    return rules.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
