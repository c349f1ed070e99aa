"""Optimize: alternate the program search (Q) and the ratio LP (B) until no improvement (paper §3.1).

``synthesize`` starts from throughput-proportional ratios B0 (moved into any ratio pins), then repeats
``Q_k = search(B_{k-1})``, ``B_k = LP(Q_k)`` while the cost strictly improves, keeps the history, and
returns the best program paired with the ratios optimised *for it*. The data-parallel and
tensor-parallel programs of :func:`baselines` are also balanced by the LP and used as seeds, so the
result is never worse than any baseline under the same cost model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from .balance import RatioPin, apply_ratio_pins, balance, parse_ratio_pins
from .cluster import Cluster
from .cost import Conversion, CostModel, Step
from .forms import Form, G, I, parse_form
from .graph import Graph
from .plan import Instruction, Plan, Round, Stage, freeze_mapping
from .search import NoProgramError, Search, normalize_ratios
from .triples import Theory, theory

__all__ = ["synthesize", "baselines", "make_plan", "resolve_model", "memory_estimate", "OutOfMemoryError"]


class OutOfMemoryError(RuntimeError):
    """The best plan does not fit in some device's memory."""


def resolve_model(
    model_or_graph: Any,
    cluster: Cluster,
    example_inputs: Sequence[Any] | None = None,
    loss: Any = None,
    **zoo_options: Any,
) -> tuple[Graph, dict[str, Any] | None]:
    """A Graph from a Graph, an nn.Module (+ example inputs) or a zoo name / ``pkg.mod:factory``."""
    if isinstance(model_or_graph, Graph):
        return model_or_graph, None
    if isinstance(model_or_graph, Theory):
        return model_or_graph.graph, None
    from .tracing import trace

    if isinstance(model_or_graph, str):
        from . import zoo

        model, inputs, spec = zoo.build(model_or_graph, devices=cluster.n, **zoo_options)
        name = model_or_graph.split(":")[-1]
        return trace(model, inputs, name=name), spec.to_json()
    if example_inputs is None:
        raise ValueError(
            "synthesize(model, ...) needs example_inputs=(...) to trace an nn.Module; "
            "or pass a zoo name such as 'bert', or a Graph from hapnb.trace"
        )
    return trace(model_or_graph, tuple(example_inputs), loss=loss), None


def assign_segments(graph: Graph, segments: Any) -> Graph:
    """Give every op a ratio segment: ``None`` (one segment), ``"layer"`` (one per numbered module such
    as ``layers.3``; ops outside any layer share segment 0), a mapping from module-path prefix to a label
    (user markers; unmatched ops go to segment 0), or a function ``op -> label``. Labels are renumbered
    0, 1, ... in order of first appearance."""
    import dataclasses
    import re

    if segments is None:
        return graph
    if segments == "layer":
        pat = re.compile(r"^((?:[^.]+\.)*?[^.]+\.\d+)(?:\.|$)")

        def label(op: Any) -> Any:
            m = pat.match(op.module or "")
            return m.group(1) if m else ""
    elif isinstance(segments, Mapping):
        prefixes = sorted(segments, key=len, reverse=True)

        def label(op: Any) -> Any:
            for p in prefixes:
                if op.module == p or op.module.startswith(p + "."):
                    return segments[p]
            return ""
    elif callable(segments):
        label = segments
    else:
        raise ValueError(
            f"segments={segments!r}: use None, 'layer', a mapping module-prefix -> label, or a function"
        )
    labels: dict[Any, int] = {"": 0}
    ops = []
    for op in graph.ops:
        lab = label(op)
        if lab not in labels:
            labels[lab] = len(labels)
        ops.append(dataclasses.replace(op, segment=labels[lab]))
    used = sorted({op.segment for op in ops})
    renum = {s: k for k, s in enumerate(used)}
    ops = [dataclasses.replace(op, segment=renum[op.segment]) for op in ops]
    return dataclasses.replace(graph, ops=tuple(ops))


def _pins(pins: Mapping[str, Any] | None) -> dict[str, Form]:
    out = {}
    for k, v in (pins or {}).items():
        out[k] = parse_form(v) if isinstance(v, str) else v
    return out


def _without_gc(fn: Any) -> Any:
    """Run ``fn`` with the cyclic garbage collector paused: the search allocates many small acyclic
    values, and after tracing the heap is large, so each full collection would rescan it (seen: 0.7 s of
    a 1.4 s synthesis). Reference counting still frees everything; the collector resumes afterwards."""
    import functools
    import gc

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return wrapper


@_without_gc
def synthesize(
    model_or_graph: Any,
    cluster: Cluster | str,
    pins: Mapping[str, Any] | None = None,
    example_inputs: Sequence[Any] | None = None,
    *,
    ratios: Mapping[str, Any] | Sequence[float] | Sequence[Sequence[float]] | None = None,
    loss: Any = None,
    options: Mapping[str, bool] | None = None,
    max_iterations: int = 10,
    max_expansions: int | None = 30_000,
    max_seconds: float | None = None,
    segments: Any = None,
    seed_baselines: bool = True,
    check_memory: bool = True,
    progress: bool = False,
    **zoo_options: Any,
) -> Plan:
    """Synthesize a plan: the program Q and ratios B minimising the per-iteration time.

    ``max_expansions`` / ``max_seconds`` bound each A* search (the default budget proves optimality for
    the paper's transformers many times over; when a search hits it, the best program found by A* plus
    greedy dives is used and ``plan.stats["optimal"]`` is False).
    ``segments``: ``None`` (one ratio vector), ``"layer"`` or markers (see :func:`assign_segments`).
    ``ratios``: a mapping of ratio pins (``{"v100-0": 0.3, "p100-1": (0.05, 0.2)}``), or a list of
    per-device ratios (one list, or one per segment) to use as they are (no LP).
    """
    c = cluster if isinstance(cluster, Cluster) else Cluster.resolve(cluster)
    graph, spec = resolve_model(model_or_graph, c, example_inputs, loss, **zoo_options)
    t0 = time.perf_counter()
    if segments is not None:
        graph = assign_segments(graph, segments)
    th = model_or_graph if isinstance(model_or_graph, Theory) and segments is None else theory(graph)
    cm = CostModel(th, c)
    form_pins = _pins(pins)
    fixed: tuple[tuple[float, ...], ...] | None = None
    ratio_pins: tuple[RatioPin, ...] = ()
    if isinstance(ratios, Mapping):
        ratio_pins = parse_ratio_pins(ratios, c.names)
    elif ratios is not None:
        fixed = normalize_ratios(ratios, c, cm.n_segments)
    if fixed is None:
        row = apply_ratio_pins(normalize_ratios(None, c, 1)[0], ratio_pins, c.names, c.flops)
        B = tuple(row for _ in range(cm.n_segments))
    else:
        B = fixed
    history: list[Round] = []
    best: tuple[float, tuple[Step, ...], tuple[Conversion, ...], tuple[tuple[float, ...], ...]] | None = None
    stats = {
        "expansions": 0,
        "generated": 0,
        "pruned_dominated": 0,
        "pruned_bound": 0,
        "search_s": 0.0,
        "balance_s": 0.0,
        "optimal": True,
    }

    def search(
        ratios_: Any, pins_: Mapping[str, Form], opts: Mapping[str, bool] | None = None
    ) -> tuple[Any, Search]:
        s = Search(th, c, ratios=ratios_, pins=pins_, options={**(options or {}), **(opts or {})})
        res = s.run(max_expansions=max_expansions, max_seconds=max_seconds, progress=progress)
        st = s.stats
        for k in ("expansions", "generated", "pruned_dominated", "pruned_bound"):
            stats[k] += st[k]
        stats["search_s"] += res.seconds
        stats["optimal"] = stats["optimal"] and res.optimal
        return res, s

    def consider(
        prog: tuple[Step, ...],
        extra: tuple[Conversion, ...],
        cost_before: float,
        it: int,
        exp: int,
        s_sec: float,
        source: str = "search",
    ) -> bool:
        nonlocal best
        if fixed is not None:
            ratios_k, cost_k, b_sec = fixed, cm.evaluate(prog, fixed).cost_s, 0.0
        else:
            bal = balance(cm, prog, ratio_pins)
            ratios_k, cost_k, b_sec = bal.ratios, bal.cost, bal.seconds
            stats["balance_s"] += b_sec
        accepted = best is None or cost_k < best[0] * (1 - 1e-9)
        history.append(
            Round(it, cost_before, cost_k, ratios_k, exp, s_sec, b_sec, len(prog), accepted, source)
        )
        if accepted:
            best = (cost_k, prog, extra, ratios_k)
        return accepted

    def alternate(B: tuple[tuple[float, ...], ...], it: int, limit: int) -> int:
        """Q/B rounds from ratios B while the cost strictly improves; returns the iteration count."""
        while it < limit:
            it += 1
            res, s = search(B, form_pins)
            improved = consider(
                res.program, s.final_conversions(), res.cost, it, s.stats["expansions"], res.seconds
            )
            if fixed is not None or not improved:
                break
            if _same_ratios(best[3], B):  # type: ignore[index]
                break  # the LP kept the ratios: the next search would return the same program
            B = best[3]  # type: ignore[index]
        return it

    it = alternate(B, 0, max_iterations)
    if seed_baselines and fixed is None:
        tried = {best[1]}  # type: ignore[index]
        for _name, bpins, bratios, bopts in _baseline_specs(th, c, form_pins):
            try:
                res, s = search(bratios, bpins, bopts)
            except (NoProgramError, ValueError):
                continue
            if res.program in tried:
                continue  # the same program was balanced already
            tried.add(res.program)
            it += 1
            if consider(
                res.program,
                s.final_conversions(),
                res.cost,
                it,
                s.stats["expansions"],
                res.seconds,
                f"seed {_name}",
            ):
                it = alternate(best[3], it, it + max_iterations)  # type: ignore[index]
    assert best is not None
    cost, prog, extra, ratios_best = best
    elapsed = time.perf_counter() - t0
    plan = make_plan(
        th,
        c,
        prog,
        extra,
        ratios_best,
        history=tuple(history),
        pins=form_pins,
        ratio_pins=ratio_pins,
        stats=stats,
        model=spec,
        options={**(options or {}), "segments": _segments_label(segments)},
        synthesis_s=elapsed,
    )
    if check_memory:
        _check_memory(plan)
    return plan


def _segments_label(segments: Any) -> str:
    if segments is None or isinstance(segments, str):
        return segments or "none"
    if isinstance(segments, Mapping):
        return "markers"
    return getattr(segments, "__name__", "custom")


def _same_ratios(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], tol: float = 1e-9) -> bool:
    return all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _baseline_specs(
    th: Theory, c: Cluster, user_pins: Mapping[str, Form]
) -> list[tuple[str, dict[str, Form], tuple[tuple[float, ...], ...], dict[str, bool]]]:
    g = th.graph
    nseg = 1 + max((op.segment for op in th.graph.ops), default=0)
    even = tuple(tuple(1.0 / c.n for _ in range(c.n)) for _ in range(nseg))
    cp = normalize_ratios(None, c, nseg)
    dp_pins: dict[str, Form] = {}
    for t in g.tensors:
        if t.role == "param":
            dp_pins[t.name] = I
        elif t.role == "input":
            dp_pins[t.name] = G(0) if G(0) in th.forms[t.id] else I
    tp_pins = {t.name: I for t in g.tensors if t.role == "input"}
    plain = {"sfb": False, "grouped": False}
    out = []
    for name, pins, r in (("dp_ev", dp_pins, even), ("dp_cp", dp_pins, cp), ("tp_ev", tp_pins, even)):
        merged = {**pins, **user_pins}
        out.append((name, merged, r, plain))
    return out


@_without_gc
def baselines(
    model_or_graph: Any,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[Any] | None = None,
    max_expansions: int | None = 30_000,
    **zoo_options: Any,
) -> dict[str, Plan]:
    """Data parallel with even (``dp_ev``) and throughput-proportional (``dp_cp``) ratios, and Megatron-style
    tensor parallel (``tp_ev``: replicated batch, weights split by the search, even ratios), all under the
    same cost model. A baseline that cannot be built for this model is left out."""
    c = cluster if isinstance(cluster, Cluster) else Cluster.resolve(cluster)
    graph, spec = resolve_model(model_or_graph, c, example_inputs, **zoo_options)
    th = model_or_graph if isinstance(model_or_graph, Theory) else theory(graph)
    out: dict[str, Plan] = {}
    for name, pins, ratios, opts in _baseline_specs(th, c, {}):
        t0 = time.perf_counter()
        try:
            s = Search(th, c, ratios=ratios, pins=pins, options=opts)
            res = s.run(max_expansions=max_expansions)
        except (NoProgramError, ValueError):
            continue
        st = s.stats
        stats = {k: st[k] for k in ("expansions", "generated", "pruned_dominated", "pruned_bound")}
        stats["optimal"] = res.optimal
        out[name] = make_plan(
            th,
            c,
            res.program,
            s.final_conversions(),
            s.ratios,
            pins=pins,
            stats=stats,
            model=spec,
            options={**opts, "baseline": name},
            synthesis_s=time.perf_counter() - t0,
        )
    if "tp_ev" in out and not any(
        i.kind == "load" and i.form.startswith("G") and _is_param(th, i.tensor) for i in out["tp_ev"].program
    ):
        del out["tp_ev"]  # no weight could be split: tensor parallelism does not apply
    return out


def _is_param(th: Theory, name: str) -> bool:
    return th.graph.tensor(name).role == "param"


def make_plan(
    th: Theory,
    cluster: Cluster,
    program: Sequence[Step],
    extra: Sequence[Conversion],
    ratios: tuple[tuple[float, ...], ...],
    *,
    history: tuple[Round, ...] = (),
    pins: Mapping[str, Form] | None = None,
    ratio_pins: Sequence[RatioPin] = (),
    stats: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    synthesis_s: float = 0.0,
) -> Plan:
    """Turn a searched program and its ratios into a :class:`Plan` (instructions, lengths, stages)."""
    g = th.graph
    cm = CostModel(th, cluster)
    ev = cm.evaluate(program, ratios)
    stage_of_step = {}
    for sc in ev.stages:
        for i in sc.steps:
            stage_of_step[i] = sc.index
    instrs: list[Instruction] = []
    used: set[tuple[int, int]] = set()
    stage_instrs: dict[int, list[int]] = {}
    stage_comm: dict[int, list[str]] = {}

    def emit(ins: Instruction) -> None:
        stage_instrs.setdefault(ins.stage, []).append(len(instrs))
        instrs.append(ins)

    def name(t: int) -> str:
        return g.tensors[t].name

    for k, st in enumerate(program):
        stage = stage_of_step[k]
        op = g.ops[st.op]
        for ld in st.loads:
            emit(
                Instruction(
                    "load", "load_sfb" if ld.sfb else "load", stage, tensor=name(ld.tensor), form=str(ld.form)
                )
            )
            if ld.form.kind == "G":
                used.add((ld.tensor, ld.form.dim))
            for tm in cm.load_terms(ld):
                stage_comm.setdefault(stage, []).append(tm.what)
        resharded = {}
        for cv in st.conversions:
            if cv.name == "reshard":
                dst = f"{cv.dst}@{cv.segment}"
                resharded[cv.tensor] = dst
                emit(
                    Instruction(
                        "collective",
                        "reshard",
                        stage,
                        tensor=name(cv.tensor),
                        src=str(cv.src),
                        form=dst,
                        lengths=th.lengths(cv.tensor, cv.dst.dim, ratios[cv.segment]),
                    )
                )
            else:
                emit(
                    Instruction(
                        "collective",
                        cv.name,
                        stage,
                        tensor=name(cv.tensor),
                        src=str(cv.src),
                        form=str(cv.dst),
                    )
                )
            for f in (cv.src, cv.dst):
                if f.kind == "G":
                    used.add((cv.tensor, f.dim))
            for tm in cm.conversion_terms(cv):
                stage_comm.setdefault(stage, []).append(tm.what)
        for tm in cm.sfb_terms(st):
            stage_comm.setdefault(stage, []).append(tm.what)
        s = st.strategy
        for t, f in list(zip(op.inputs, s.inputs)) + list(zip(op.outputs, s.outputs)):
            if f.kind == "G":
                used.add((t, f.dim))
        emit(
            Instruction(
                "compute",
                s.name,
                stage,
                op=op.name,
                target=op.target,
                inputs=tuple(
                    (name(t), resharded[t] if f.kind == "G" and t in resharded else str(f))
                    for t, f in zip(op.inputs, s.inputs)
                ),
                outputs=tuple((name(t), str(f)) for t, f in zip(op.outputs, s.outputs)),
            )
        )
    last_stage = ev.stages[-1].index if ev.stages else 0
    for cv in extra:
        emit(
            Instruction(
                "collective", cv.name, last_stage, tensor=name(cv.tensor), src=str(cv.src), form=str(cv.dst)
            )
        )
    lengths = tuple((name(t), d, th.lengths(t, d, ratios[cm.segment_of[t]])) for t, d in sorted(used))
    stages = tuple(
        Stage(
            sc.index,
            sc.comm_s,
            sc.comp_s,
            tuple(stage_instrs.get(sc.index, ())),
            tuple(stage_comm.get(sc.index, ())),
        )
        for sc in ev.stages
    )
    fallback = tuple((op.name, op.target) for op in g.ops if op.family == "unknown")
    plan = Plan(
        name=g.name,
        graph_fingerprint=g.fingerprint,
        cluster=cluster,
        ratios=tuple(tuple(float(x) for x in r) for r in ratios),
        program=tuple(instrs),
        lengths=lengths,
        stages=stages,
        cost_s=ev.cost_s,
        lower_bound_s=cm.lower_bound(),
        history=history,
        pins=tuple(sorted((k, str(v)) for k, v in (pins or {}).items())),
        ratio_pins=tuple((p.device, p.lo, p.hi) for p in ratio_pins),
        search=freeze_mapping(stats),
        fallback_ops=fallback,
        model=freeze_mapping(model),
        options=freeze_mapping(
            {
                **(options or {}),
                "inputs": [t.name for t in g.tensors if t.role == "input"],
                "params": [t.name for t in g.tensors if t.role == "param"],
            }
        ),
        synthesis_s=synthesis_s,
        graph=g,
    )
    return plan.__class__(**{**plan.__dict__, "memory_bytes": memory_estimate(plan, th)})


def memory_estimate(plan: Plan, th: Theory) -> tuple[int, ...]:
    """Per-GPU bytes: parameters + gradients + Adam state (4x the local parameter bytes) + inputs +
    activations kept for the backward (every computed tensor's local part), per device."""
    g = th.graph
    n = plan.cluster.n
    mem = [0.0] * n
    lengths = {(t, d): ls for t, d, ls in plan.lengths}

    def local(tname: str, form: str) -> list[float]:
        t = g.tensor(tname)
        f = parse_form(form)
        if f.kind != "G":
            return [float(t.nbytes)] * n
        ls = lengths[(tname, f.dim)]
        return [t.nbytes / t.shape[f.dim] * x for x in ls]

    for ins in plan.program:
        if ins.kind == "load":
            t = g.tensor(ins.tensor)
            k = 4.0 if t.role == "param" else 1.0
            for j, b in enumerate(local(ins.tensor, ins.form)):
                mem[j] += k * b
        elif ins.kind == "collective" and ins.name == "reshard":
            t = g.tensor(ins.tensor)
            d = parse_form(ins.src).dim
            for j, x in enumerate(ins.lengths):
                mem[j] += t.nbytes / t.shape[d] * x
        elif ins.kind == "collective":
            for j, b in enumerate(local(ins.tensor, ins.form)):
                mem[j] += b
        else:
            for tname, form in ins.outputs:
                for j, b in enumerate(local(tname, form)):
                    mem[j] += b
    out = []
    for j, d in enumerate(plan.cluster.devices):
        k = getattr(d, "gpus", 1)
        out.append(int(mem[j] / k) if k > 1 else int(mem[j]))
    return tuple(out)


def _check_memory(plan: Plan) -> None:
    bad = []
    for d, m in zip(plan.cluster.devices, plan.memory_bytes):
        cap = d.memory_bytes / max(1, getattr(d, "gpus", 1))
        if m > cap:
            bad.append(f"{d.name} needs {m / 2**30:.2f} GiB of {cap / 2**30:.2f} GiB")
    if bad:
        raise OutOfMemoryError(
            "the best plan does not fit in device memory: "
            + "; ".join(bad)
            + ". Use a smaller batch or model, more or larger devices, or pin large weights to be sharded "
            "(e.g. pins={'<weight>': hapnb.Shard(0)}); pass check_memory=False to get the plan anyway."
        )
