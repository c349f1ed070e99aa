"""One comparison of every strategy under one cost model (:func:`compare`, ``hapnb.compare`` and
``hapnb compare``).

Every strategy is priced by the same device model and the same cost model (:mod:`hapnb.cost.model`): the same
per-op computation terms, the same collective fits, the same memory breakdown. Rows (:data:`STRATEGIES`,
in table order):

============  ==============================================================================================
strategy      what it is, and how its row is computed
============  ==============================================================================================
``hap``       HAP: the synthesized program with LP-balanced ratios (:func:`hapnb.synthesize`, ``pick`` as
              given: ``"simulated"`` by default, ``"cost"`` for HAP's own stage-model choice)
``dp_ev``     data parallel (PyTorch DDP), even ratios: parameters replicated, inputs sharded on the batch
``dp_cp``     data parallel, ratios proportional to the devices' throughput
``tp``        Megatron-style tensor parallel: the batch whole on every device (no tensor split on it), weights
              split by the search, even ratios (:func:`hapnb.baselines`' ``tp_ev``; absent when splitting no
              weight is cheaper)
``ep``        expert parallel as DeepSpeed-MoE runs it (MoE models only): expert weights sharded on their
              expert dim with even ratios, the expert count padded to a multiple of the devices (every
              device holds ``ceil(E/n)`` expert slots), everything else data parallel (even ratios)
``fsdp``      fully sharded data parallel as PyTorch FSDP (FULL_SHARD) / ZeRO-3 runs it: the ``dp_ev`` pins
              with every parameter stored sharded (:func:`hapnb.synth.optimize.fsdp_pins`), all-gathered before
              each use in the forward and again in the backward, its gradient reduce-scattered; even ratios
``pipeline``  a heterogeneous pipeline (Ditto: node folding + DP recovery, 1F1B, :func:`hapnb.pipeline`)
============  ==============================================================================================

Per row: ``iteration_s`` (the stage model: HAP's cost ``sum over stages (comm + max_j comp_j)`` for the
SPMD strategies; for ``pipeline`` the pipeline time model ``T1 + T2 + T3`` of
:mod:`hapnb.pipelines.timing`, built from the same per-op computation terms, with each stage's gradient
all-reduce priced by the cluster's ``all_reduce`` as the stage model prices a replicated parameter's, and
each boundary as one ``broadcast`` launch), ``simulated_s`` (the overlap simulator :func:`hapnb.simulate`
for SPMD plans; for a pipeline its operation-by-operation schedule simulation plus the tail, which the
overlap simulator does not model), peak memory per device and whether it fits (strategies that do not fit
stay in the table, marked), and a short note (why a strategy is absent).

**Expert weights** (:func:`expert_groups`) are found from the graph, not by name: a parameter is an
expert weight, with expert dim ``d``, when a matmul-family op (``mm``, ``bmm``, ``matmul``, ``einsum``)
that consumes it has a strategy sharding it on ``d`` together with a non-parameter input while its output
stays sharded (``G``, never ``R``): ``d`` is a batch dimension of a batched matmul, so each slice along it
is an independent weight matrix (an expert). A linear layer's weight never qualifies (no strategy shards
both it and its input without a partial sum), nor do norms and biases (not matmuls). The tensors that
share the expert partition are the expert dim's *dim class* (:func:`hapnb.triples.dim_class`).

**Padding** (:func:`pad_experts`): DeepSpeed needs the expert count to divide the devices, so ``E``
experts on ``n`` devices run as ``E' = n * ceil(E/n)``: every tensor dim of the expert dim class of size
``E`` becomes ``E'`` and every op touching one does ``E'/E`` times the work (ops are linear in the expert
dim: einsums, pointwise ops, reductions over other dims). The padded graph is for costing only (its plan
records no model to rebuild); when ``n`` divides ``E`` the ``ep`` plan is the real, runnable one.

>>> import hapnb
>>> cmp = hapnb.compare("mlp", "2xV100+2xP100", strategies=["hap", "dp_ev", "dp_cp"], layers=2, hidden=64,
...                     batch=16)
>>> sorted(cmp.times()), cmp.times()["hap"] <= cmp.times()["dp_ev"] * (1 + 1e-9)
(['dp_cp', 'dp_ev', 'hap'], True)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..hardware.cluster import Cluster
from ..ir.forms import G
from ..ir.graph import Graph
from ..synth.search import NoProgramError
from ..synth.seeds import baseline_specs, fsdp_pins
from ..tracing import resolve_model
from ..triples import Theory, dim_class, theory
from .plan import Plan, freeze_mapping
from .synthesis import Baselines, OutOfMemoryError, baselines, fixed_plan, synthesize

__all__ = [
    "STRATEGIES",
    "CLOCKS",
    "StrategyResult",
    "Comparison",
    "compare",
    "ExpertGroup",
    "expert_groups",
    "pad_experts",
]

#: The strategies :func:`compare` knows, in table order: name -> one line on what it is.
STRATEGIES: Mapping[str, str] = {
    "hap": "HAP: synthesized program, LP-balanced ratios",
    "dp_ev": "data parallel, even ratios (DDP)",
    "dp_cp": "data parallel, throughput-proportional ratios",
    "tp": "Megatron-style tensor parallel, even ratios",
    "ep": "expert parallel (DeepSpeed-MoE: even, padded experts; the rest data parallel)",
    "fsdp": "fully sharded data parallel (parameters sharded, gathered before use)",
    "pipeline": "heterogeneous pipeline (Ditto: node folding + DP recovery, 1F1B)",
}
#: The two clocks of a row: the stage model (``iteration_s``) and the simulators (``simulated_s``).
CLOCKS = ("stage", "simulated")


@dataclass(frozen=True)
class StrategyResult:
    """One strategy's row: its times on both clocks, memory per device, whether it fits, and a note.

    ``available`` is False when the strategy does not apply or could not be built (``note`` says why;
    times are None). ``memory_bytes``/``capacity_bytes``: predicted peak and capacity per device of the
    cluster (a device a pipeline leaves idle holds 0). ``plan``: the Plan or PipelinePlan behind the row.
    """

    strategy: str
    available: bool
    iteration_s: float | None = None
    simulated_s: float | None = None
    simulator: str = ""  # "hapnb.simulate" or "pipeline schedule"
    memory_bytes: tuple[int, ...] = ()
    capacity_bytes: tuple[int, ...] = ()
    fits: bool | None = None
    note: str = ""
    planning_s: float = 0.0
    plan: Any = field(default=None, compare=False, repr=False)

    def time(self, clock: str = "stage") -> float | None:
        """``iteration_s`` (``clock="stage"``) or ``simulated_s`` (``"simulated"``)."""
        if clock not in CLOCKS:
            raise ValueError(f"clock {clock!r} is not one of {', '.join(CLOCKS)}")
        return self.iteration_s if clock == "stage" else self.simulated_s

    @property
    def peak_bytes(self) -> int:
        return max(self.memory_bytes, default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "available": self.available,
            "iteration_s": self.iteration_s,
            "simulated_s": self.simulated_s,
            "simulator": self.simulator,
            "memory_bytes": list(self.memory_bytes),
            "capacity_bytes": list(self.capacity_bytes),
            "fits": self.fits,
            "note": self.note,
            "planning_s": self.planning_s,
        }


@dataclass(frozen=True)
class Comparison:
    """Every strategy's :class:`StrategyResult` for one model on one cluster (:func:`compare`).

    ``times(clock)`` gives ``{strategy: seconds}`` of the available rows; ``best(clock)`` the fastest that
    fits; ``to_json()`` the whole table (``hapnb compare --detail``); ``chart()`` a bokeh chart.
    """

    model: str
    cluster: Cluster
    results: tuple[StrategyResult, ...]
    batch: int | None = None
    pick: str = "simulated"
    trace_s: float = 0.0

    def __iter__(self) -> Iterator[StrategyResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, strategy: str) -> StrategyResult:
        for r in self.results:
            if r.strategy == strategy:
                return r
        raise KeyError(f"no strategy {strategy!r} in this comparison; it has {', '.join(self.strategies)}")

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(r.strategy for r in self.results)

    def times(self, clock: str = "stage") -> dict[str, float]:
        """``{strategy: seconds}`` on ``clock`` (``"stage"`` or ``"simulated"``) for every available row
        (strategies that do not fit included: ``fits`` says which)."""
        out = {}
        for r in self.results:
            t = r.time(clock)
            if r.available and t is not None:
                out[r.strategy] = t
        return out

    def best(self, clock: str = "stage") -> str | None:
        """The fastest strategy on ``clock`` among those that fit (None when none does)."""
        ok = {k: v for k, v in self.times(clock).items() if self[k].fits is not False}
        return min(ok, key=lambda k: (ok[k], list(self.strategies).index(k))) if ok else None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "cluster": self.cluster.name,
            "devices": list(self.cluster.names),
            "batch": self.batch,
            "pick": self.pick,
            "trace_s": self.trace_s,
            "strategies": [r.to_json() for r in self.results],
        }

    def __str__(self) -> str:
        head = f"comparison: {self.model} on {self.cluster.name} ({self.cluster.n} devices"
        head += f", batch {self.batch})" if self.batch else ")"
        best = {c: self.best(c) for c in CLOCKS}
        ref = {c: (self[best[c]].time(c) if best[c] else None) for c in CLOCKS}
        rows = [
            f"{'strategy':10s} {'stage model':>13s} {'':>6s} {'simulated':>13s} {'':>6s} {'peak GiB':>9s} "
            f"{'fits':>4s}  note"
        ]
        for r in self.results:
            cells = []
            for c in CLOCKS:
                t = r.time(c) if r.available else None
                if t is None:
                    cells += [f"{'-':>13s}", f"{'':>6s}"]
                else:
                    rel = f"{t / ref[c]:5.2f}x" if ref[c] else ""
                    cells += [f"{t * 1e3:10.3f} ms", f"{rel:>6s}"]
            peak = f"{r.peak_bytes / 2**30:9.2f}" if r.memory_bytes else f"{'-':>9s}"
            fits = {True: "yes", False: "OOM", None: "-"}[r.fits]
            rows.append(f"{r.strategy:10s} {' '.join(cells)} {peak} {fits:>4s}  {r.note}")
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        return f"Comparison({self.model} on {self.cluster.name}: {', '.join(self.strategies)})"

    def _repr_html_(self) -> str:
        from .. import display

        return display.safe_html(display.comparison_html, self)

    def chart(self, **kw: Any) -> Any:
        """A bokeh chart: per strategy a bar on each clock, strategies that do not fit marked OOM (see
        :func:`hapnb.display.comparison_chart`)."""
        from .. import display

        return display.comparison_chart(self, **kw)


# ================================================================================================ experts


@dataclass(frozen=True)
class ExpertGroup:
    """The expert weights sharing one expert partition (usually one MoE layer's ``w1``/``w2``): their
    names and expert dims, the expert count, and the dim class (tensor id, dim) of the partition."""

    weights: tuple[tuple[str, int], ...]
    experts: int
    dims: tuple[tuple[int, int], ...]


def expert_groups(th: Theory) -> tuple[ExpertGroup, ...]:
    """The graph's expert weights, grouped by expert partition (see the module docstring for the rule);
    empty for a model without experts.

    >>> import hapnb
    >>> from hapnb.tracing import zoo_graph
    >>> g, _ = zoo_graph("bert-moe", devices=2, layers=2, hidden=16, heads=2, vocab=32, seq=8, batch=4)
    >>> [(e.weights, e.experts) for e in expert_groups(hapnb.theory(g))]
    [((('layers.1.moe.w1', 0), ('layers.1.moe.w2', 0)), 4)]
    """
    g = th.graph
    found: dict[tuple[int, int], None] = {}
    for op, ss in zip(g.ops, th.strategies):
        if op.family != "matmul":
            continue
        for s in ss:
            if any(f.kind != "G" for f in s.outputs):
                continue
            ins = list(zip(op.inputs, s.inputs))
            for t, f in ins:
                if f.kind != "G" or g.tensors[t].role != "param":
                    continue
                if any(u != t and h.kind == "G" and g.tensors[u].role != "param" for u, h in ins):
                    found[(t, f.dim)] = None
    groups: dict[tuple[tuple[int, int], ...], list[tuple[int, int]]] = {}
    for t, d in found:
        groups.setdefault(dim_class(th, t, d), []).append((t, d))
    out = []
    for dims, ws in groups.items():
        out.append(
            ExpertGroup(
                weights=tuple(sorted((g.tensors[t].name, d) for t, d in ws)),
                experts=g.tensors[ws[0][0]].shape[ws[0][1]],
                dims=dims,
            )
        )
    return tuple(sorted(out, key=lambda e: e.weights))


def pad_experts(th: Theory, groups: Sequence[ExpertGroup], devices: int) -> tuple[Graph, dict[str, int]]:
    """The graph with every expert partition padded to a multiple of ``devices`` (see the module
    docstring), and ``{weight name: padded expert count}``; the graph itself when nothing needs padding.
    Tensors keep their ids; the padded graph is for costing only (no traced program)."""
    g = th.graph
    shape = {t.id: list(t.shape) for t in g.tensors}
    factor = [1.0] * len(g.tensors)
    padded: dict[str, int] = {}
    for grp in groups:
        e = grp.experts
        e2 = devices * math.ceil(e / devices)
        if e2 == e:
            continue
        for t, d in grp.dims:
            if g.tensors[t].shape[d] == e:  # a dim of another size (e.g. flattened with others) is left
                shape[t][d] = e2
                factor[t] = max(factor[t], e2 / e)
        for name, _ in grp.weights:
            padded[name] = e2
    if not padded:
        return g, {}
    tensors = tuple(dataclasses.replace(t, shape=tuple(shape[t.id])) for t in g.tensors)
    ops = tuple(
        dataclasses.replace(op, flops=op.flops * max(factor[t] for t in op.inputs + op.outputs))
        if op.inputs + op.outputs
        else op
        for op in g.ops
    )
    out = dataclasses.replace(
        g,
        tensors=tensors,
        ops=ops,
        program=None,
        fingerprint=f"{g.fingerprint}/padded",
        name=f"{g.name}/padded",
    )
    return out, padded


# ================================================================================================ compare


@dataclass
class _Inputs:
    """What the strategy builders share (not a value: it caches the baselines)."""

    model: Any
    cluster: Cluster
    theory: Theory
    spec: dict[str, Any] | None
    example_inputs: Sequence[Any] | None
    loss: Any
    zoo: dict[str, Any]
    pick: str
    duplex: bool
    max_expansions: int | None
    pipeline_options: dict[str, Any]
    _baselines: Baselines | None = field(default=None, init=False, repr=False)

    def baselines(self) -> Baselines:
        if self._baselines is None:
            self._baselines = baselines(self.theory, self.cluster, max_expansions=self.max_expansions)
        return self._baselines


def _dp_ev(th: Theory, c: Cluster) -> tuple[dict[str, Any], Any, dict[str, bool]]:
    """The pins, ratios and search options of the ``dp_ev`` baseline (:func:`hapnb.synth.seeds.baseline_specs`),
    which ``ep`` and ``fsdp`` start from."""
    _, pins, ratios, opts = next(s for s in baseline_specs(th, c, {}) if s[0] == "dp_ev")
    return pins, ratios, opts


def _capacity(c: Cluster) -> tuple[int, ...]:
    return tuple(int(d.memory_bytes / d.gpus) for d in c.devices)


def _spmd_row(name: str, plan: Plan, note: str = "") -> StrategyResult:
    """The row of an SPMD plan: its two clocks, memory per device against capacity, and whether it fits."""
    cap = _capacity(plan.cluster)
    mem = tuple(int(m) for m in plan.memory_bytes)
    fits = all(m <= k for m, k in zip(mem, cap)) if mem else None
    over = [f"{d} {m / 2**30:.1f}/{k / 2**30:.1f} GiB" for d, m, k in zip(plan.devices, mem, cap) if m > k]
    if over:
        more = " ..." if len(over) > 3 else ""
        note = "; ".join(x for x in (note, f"does not fit: {', '.join(over[:3])}{more}") if x)
    return StrategyResult(
        strategy=name,
        available=True,
        iteration_s=plan.cost_s,
        simulated_s=plan.simulated_s,
        simulator="hapnb.simulate",
        memory_bytes=mem,
        capacity_bytes=cap,
        fits=fits,
        note=note,
        planning_s=plan.synthesis_s,
        plan=plan,
    )


def _absent(name: str, note: str) -> StrategyResult:
    return StrategyResult(name, False, note=note)


def _hap(x: _Inputs) -> StrategyResult:
    """hapnb's plan: memory-aware synthesis (the program and ratios HAP picks where memory does not bind);
    when no program fits, the plan ignoring memory, marked out of memory."""
    kw = dict(pick=x.pick, duplex=x.duplex, max_expansions=x.max_expansions)
    note = f"pick={x.pick}" + (", duplex" if x.duplex else "")
    try:
        plan = synthesize(x.theory, x.cluster, **kw)
    except OutOfMemoryError as e:
        plan = synthesize(x.theory, x.cluster, check_memory=False, **kw)
        note += ", no program fits" + (f" ({e.need})" if e.need else "") + "; the plan ignoring memory"
    if x.spec:
        plan = dataclasses.replace(plan, model=freeze_mapping(x.spec))
    chosen = plan.stats.get("chosen", "search")
    if chosen != "search":
        note += f", program of {chosen.removeprefix('baseline ')}"
    return _spmd_row("hap", plan, note)


def _baseline(key: str, name: str) -> Callable[[_Inputs], StrategyResult]:
    def build(x: _Inputs) -> StrategyResult:
        built = x.baselines()
        plan = built.get(key)
        if plan is None:
            why = built.unavailable.get(key)
            return _absent(
                name, why or "no program with these pins (the inputs cannot be split on the batch dim)"
            )
        return _spmd_row(name, plan)

    return build


def _ep(x: _Inputs) -> StrategyResult:
    groups = expert_groups(x.theory)
    if not groups:
        return _absent("ep", "no expert weights (no parameter is a batch dim of a batched matmul)")
    c = x.cluster
    g, padded = pad_experts(x.theory, groups, c.n)
    th = theory(g) if padded else x.theory
    pins, ratios, opts = _dp_ev(th, c)
    for grp in groups:
        for w, d in grp.weights:
            pins[w] = G(d)
    try:
        plan = fixed_plan(th, c, pins, ratios, opts, name="ep", model=None if padded else x.spec,
                          max_expansions=x.max_expansions)  # fmt: skip
    except (NoProgramError, ValueError) as e:
        return _absent("ep", f"no expert-parallel program: {str(e).splitlines()[0][:200]}")
    per = sorted({math.ceil(grp.experts / c.n) for grp in groups})
    note = f"{'/'.join(str(grp.experts) for grp in groups)} experts, {'/'.join(map(str, per))} per device"
    if padded:
        note += f", padded to {'/'.join(str(v) for v in sorted(set(padded.values())))} (costing only)"
    return _spmd_row("ep", plan, note)


def _fsdp(x: _Inputs) -> StrategyResult:
    c = x.cluster
    _, ratios, opts = _dp_ev(x.theory, c)
    pins = fsdp_pins(x.theory, ratios[0])
    try:
        plan = fixed_plan(x.theory, c, pins, ratios, opts, name="fsdp", model=x.spec,
                          max_expansions=x.max_expansions)  # fmt: skip
    except (NoProgramError, ValueError) as e:
        return _absent("fsdp", f"no fully sharded program: {str(e).splitlines()[0][:200]}")
    sharded = sum(1 for i in plan.program if i.kind == "load" and i.name == "load_zero3")
    return _spmd_row("fsdp", plan, f"{sharded} parameters stored sharded (ZeRO-3), even ratios")


def _pipeline(x: _Inputs) -> StrategyResult:
    from ..pipelines.planner import NoPipelineError, default_micro_batches, pipeline

    c = x.cluster
    if isinstance(x.model, (Graph, Theory)):
        return _absent("pipeline", "needs the model (zoo name, factory or module), not a traced graph")
    opts = dict(x.pipeline_options)
    try:
        if isinstance(x.model, str):
            pp = pipeline(x.model, c, **x.zoo, **opts)
        else:
            inputs = list(x.example_inputs or ())
            batch = x.theory.graph.tensors[x.theory.graph.inputs[0]].shape[0]
            k = opts.pop("micro_batches", None) or default_micro_batches(batch)
            mb = batch // k
            sliced = [t[:mb] if getattr(t, "ndim", 0) and t.shape[0] == batch else t for t in inputs]
            pp = pipeline(x.model, c, example_inputs=sliced, loss=x.loss, micro_batches=k, **opts)
    except NoPipelineError as e:
        return StrategyResult("pipeline", False, fits=False, note=str(e).splitlines()[0][:300])
    except ValueError as e:
        return _absent("pipeline", str(e).splitlines()[0][:300])
    mem = dict.fromkeys(c.names, 0)
    for s in pp.stages:
        for d, m in zip(s.devices, s.memory_bytes):
            mem[d] = int(m)
    cap = _capacity(c)
    memory = tuple(mem[d] for d in c.names)
    idle = c.n - len(pp.devices)
    note = (
        f"{len(pp.stages)} stages, {pp.micro_batches} micro-batches of {pp.micro_batch_size}, {pp.schedule}"
    )
    if idle:
        note += f", {idle} devices idle"
    return StrategyResult(
        strategy="pipeline",
        available=True,
        iteration_s=pp.iteration_s,
        simulated_s=pp.stats.get("simulated_s"),
        simulator="pipeline schedule",
        memory_bytes=memory,
        capacity_bytes=cap,
        fits=all(m <= k for m, k in zip(memory, cap)),
        note=note,
        planning_s=pp.planning_s,
        plan=pp,
    )


#: How each strategy's row is built (one function per row of :data:`STRATEGIES`).
_BUILDERS: Mapping[str, Callable[[_Inputs], StrategyResult]] = {
    "hap": _hap,
    "dp_ev": _baseline("dp_ev", "dp_ev"),
    "dp_cp": _baseline("dp_cp", "dp_cp"),
    "tp": _baseline("tp_ev", "tp"),
    "ep": _ep,
    "fsdp": _fsdp,
    "pipeline": _pipeline,
}


def compare(
    model: Any,
    cluster: Cluster | str,
    *,
    strategies: Sequence[str] | str | None = None,
    example_inputs: Sequence[Any] | None = None,
    loss: Any = None,
    pick: str = "simulated",
    duplex: bool = False,
    max_expansions: int | None = 30_000,
    pipeline_options: Mapping[str, Any] | None = None,
    **zoo_options: Any,
) -> Comparison:
    """Price every strategy (:data:`STRATEGIES`; or those named in ``strategies``, a list or ``"a,b"``)
    for ``model`` on ``cluster`` under one cost model; see the module docstring.

    ``model``: a zoo name or ``package.module:factory`` (with ``zoo_options`` such as ``layers=4``), an
    ``nn.Module`` with ``example_inputs`` (the whole batch, batch-first: the pipeline row traces one
    micro-batch of it), or a Graph/Theory (no pipeline row). ``pick``/``duplex``: HAP's
    :func:`hapnb.synthesize` options. ``pipeline_options``: :func:`hapnb.pipeline`'s planning keywords
    (``schedule``, ``micro_batches``, ``method``, ...). A strategy that cannot be built is a row with
    ``available=False`` and a note; nothing here raises for one strategy's failure.
    """
    if strategies is None:
        names = list(STRATEGIES)
    else:
        names = [s.strip() for s in (strategies.split(",") if isinstance(strategies, str) else strategies)]
        names = [s for s in names if s]
        bad = [s for s in names if s not in STRATEGIES]
        if bad or not names:
            raise ValueError(
                f"unknown strateg{'ies' if len(bad) > 1 else 'y'} {', '.join(bad) or '(none given)'}; "
                f"choose from {', '.join(STRATEGIES)} (tp_ev is called tp here)"
            )
    if pick not in ("simulated", "cost"):
        raise ValueError(f"pick must be 'simulated' or 'cost', got {pick!r}")
    c = cluster if isinstance(cluster, Cluster) else Cluster.resolve(cluster)
    t0 = time.perf_counter()
    if isinstance(model, Theory):
        th, spec = model, None
    else:
        graph, spec = resolve_model(model, c, example_inputs, loss, **zoo_options)
        th = theory(graph)
    trace_s = time.perf_counter() - t0
    x = _Inputs(
        model=model, cluster=c, theory=th, spec=spec, example_inputs=example_inputs, loss=loss,
        zoo=dict(zoo_options), pick=pick, duplex=duplex, max_expansions=max_expansions,
        pipeline_options=dict(pipeline_options or {}),
    )  # fmt: skip
    g = th.graph
    batch = g.tensors[g.inputs[0]].shape[0] if g.inputs and g.tensors[g.inputs[0]].shape else None
    name = model if isinstance(model, str) else getattr(g, "name", type(model).__name__)
    rows = tuple(_BUILDERS[n](x) for n in dict.fromkeys(names))
    return Comparison(name, c, rows, batch, pick, trace_s)
