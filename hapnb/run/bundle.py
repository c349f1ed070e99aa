"""Bundles: a plan plus its traced program in one folder, so a worker runs it without the user's code.

A bundle holds ``plan.json``, ``program.pt2`` (torch.export's own format, weights included),
``cluster.json``, ``inputs.pt`` (plain tensors, loaded with ``weights_only=True``) and ``meta.json``.
:func:`write_bundle` makes one; :func:`load_bundle` rebuilds the graph from it and checks that it is the
graph the plan was made for. Nothing here executes pickled code.

>>> from hapnb.run.bundle import write_bundle, load_bundle
>>> b = load_bundle(write_bundle(plan, "plan.bundle"))  # doctest: +SKIP
>>> b.graph.fingerprint == plan.graph_fingerprint  # doctest: +SKIP
True
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..ir.graph import Graph
from ..plans.plan import Plan

__all__ = [
    "BUNDLE_FORMAT",
    "Bundle",
    "BundleError",
    "half_graph",
    "load_bundle",
    "program_inputs",
    "resolve_graph",
    "write_bundle",
]

BUNDLE_FORMAT = 1


class BundleError(ValueError):
    """A bundle is missing, malformed, or does not match its plan."""


@dataclass(frozen=True, eq=False)
class Bundle:
    """A loaded bundle: the plan (with ``plan.graph`` attached), the exported program, the example
    inputs and the rebuilt graph."""

    path: Path
    plan: Plan
    program: Any
    inputs: tuple[torch.Tensor, ...]
    graph: Graph
    #: duplex plans: the model traced at half the batch (``program_half.pt2``), else None
    half_graph: Graph | None = None


def program_inputs(g: Graph) -> tuple[torch.Tensor, ...] | None:
    """The example inputs kept by the graph's traced program (None when it keeps none, or keywords)."""
    ex = getattr(g.traced_program(), "example_inputs", None)
    if ex is None:
        return None
    args, kwargs = ex
    if kwargs:
        return None
    return tuple(args)


def resolve_graph(
    plan: Plan, model: Any = None, example_inputs: Sequence[Any] | None = None
) -> tuple[Graph, tuple[torch.Tensor, ...]]:
    """The plan's graph and example inputs: ``plan.graph`` when it is there, else traced from ``model``
    (with ``example_inputs``), else rebuilt from the plan's zoo/factory spec. Checks the fingerprint."""
    from ..tracing import trace

    g = plan.graph
    if g is not None and model is None:
        inputs = tuple(example_inputs) if example_inputs is not None else program_inputs(g)
        if inputs is None:
            raise BundleError(
                f"plan {plan.name}: its traced program keeps no example inputs; pass example_inputs=(...)"
            )
        return g, inputs
    if model is None:
        from .. import zoo

        missing = BundleError(
            f"plan {plan.name} has no graph in memory and no model spec to rebuild it; "
            "pass model=... and example_inputs=(...)"
        )
        model, built_inputs = zoo.rebuild(plan.model_spec, missing)
        if example_inputs is None:
            example_inputs = built_inputs
    if example_inputs is None:
        raise BundleError("example_inputs=(...) are needed to trace the model")
    inputs = tuple(example_inputs)
    g = trace(model, inputs, name=plan.name)
    _check_fingerprint(plan, g)
    return g, inputs


def _check_fingerprint(plan: Plan, g: Graph) -> None:
    if plan.graph_fingerprint != g.fingerprint:
        raise BundleError(
            f"plan {plan.name} was made for graph {plan.graph_fingerprint}, but the model traces to "
            f"{g.fingerprint}: the model, its options or the batch shape differ. Synthesize a new plan."
        )


def custom_op_imports(g: Graph) -> list[dict[str, str]]:
    """The Python modules that define the graph's custom ops (``torch.library.custom_op``), with the
    folder to import them from: a worker imports them before it loads the exported program (torch.export
    cannot load a program whose ops are not registered). Raises :class:`BundleError` for a custom op
    defined where a worker cannot import it (``__main__``: a script or a notebook)."""
    import importlib
    import sys

    from torch._library import custom_ops

    out: list[dict[str, str]] = []
    for target in sorted({op.target for op in g.ops}):
        ns, _, rest = target.partition(".")
        if ns in ("aten", "prims", "_operator", "operator") or not rest:
            continue
        opdef = custom_ops.OPDEFS.get(f"{ns}::{rest.split('.')[0]}")
        fn = getattr(opdef, "_init_fn", None)
        mod = getattr(fn, "__module__", None)
        if mod is None:
            continue  # registered some other way (torch.library.Library): the worker must import it itself
        if mod == "__main__" or mod not in sys.modules:
            raise BundleError(
                f"custom op {target} is defined in {mod!r}, which a worker process cannot import; define "
                "it in an importable module (a .py file next to your code) and import that"
            )
        file = getattr(importlib.import_module(mod), "__file__", None) or ""
        root = Path(file).resolve().parent
        for _ in range(mod.count(".") + (1 if Path(file).name == "__init__.py" else 0)):
            root = root.parent
        entry = {"module": mod, "path": str(root)}
        if entry not in out:
            out.append(entry)
    return out


def _import_custom_ops(entries: Sequence[dict[str, str]]) -> None:
    """Import the modules that define a bundle's custom ops (see :func:`custom_op_imports`)."""
    import importlib
    import sys

    for e in entries:
        if e.get("path") and e["path"] not in sys.path:
            sys.path.append(e["path"])
        try:
            importlib.import_module(e["module"])
        except ImportError as exc:
            raise BundleError(
                f"the bundle's program uses custom ops defined in {e['module']!r}, which cannot be imported "
                f"here ({exc}); install or copy that module onto this machine"
            ) from None


def write_bundle(
    plan: Plan,
    directory: str | os.PathLike[str],
    *,
    model: Any = None,
    example_inputs: Sequence[Any] | None = None,
) -> Path:
    """Write a self-contained bundle for ``plan`` into ``directory`` (created) and return its path.

    The graph comes from :func:`resolve_graph` (``plan.graph``, else ``model``, else the plan's spec).
    """
    g, inputs = resolve_graph(plan, model, example_inputs)
    half = half_graph(plan, g, inputs, model) if plan.duplex else None
    program = g.traced_program()
    if not isinstance(program, torch.export.ExportedProgram):
        raise BundleError(
            f"{plan.name} was traced with the torch.fx fallback, which cannot be saved; bundles need a "
            "model that torch.export can capture"
        )
    for k, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise BundleError(f"example input {k} is a {type(x).__name__}; bundles hold tensors only")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    plan.save(d / "plan.json")
    plan.cluster.save(d / "cluster.json")
    torch.export.save(program, d / "program.pt2")
    torch.save([x.detach().cpu().contiguous() for x in inputs], d / "inputs.pt")
    meta = {
        "format": BUNDLE_FORMAT,
        "name": g.name,
        "graph_fingerprint": g.fingerprint,
        "inputs": [g.tensors[t].name for t in g.inputs],
        "torch": torch.__version__,
        "imports": custom_op_imports(g),  # modules that define the program's custom ops
    }
    if half is not None:
        torch.export.save(half.traced_program(), d / "program_half.pt2")
        meta["half_graph_fingerprint"] = half.fingerprint
    (d / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return d


def load_bundle(directory: str | os.PathLike[str]) -> Bundle:
    """Load a bundle written by :func:`write_bundle`; rebuilds the graph and checks its fingerprint."""
    from ..tracing import from_export

    d = Path(directory)
    missing = [f for f in ("plan.json", "program.pt2", "inputs.pt", "meta.json") if not (d / f).is_file()]
    if missing:
        raise BundleError(f"{d} is not a hapnb bundle: missing {', '.join(missing)}")
    plan = Plan.load(d / "plan.json")
    try:
        meta = json.loads((d / "meta.json").read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{d / 'meta.json'}: not valid JSON ({e})") from None
    if meta.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{d}: bundle format {meta.get('format')!r} is not supported")
    _import_custom_ops(meta.get("imports", ()))
    ep = torch.export.load(d / "program.pt2")
    inputs = tuple(torch.load(d / "inputs.pt", weights_only=True))
    g = from_export(ep, list(meta["inputs"]), str(meta.get("name", plan.name)))
    _check_fingerprint(plan, g)
    plan = dataclasses.replace(plan, graph=g)
    half = None
    if (d / "program_half.pt2").is_file():
        half = from_export(torch.export.load(d / "program_half.pt2"), list(meta["inputs"]), g.name)
        if half.fingerprint != meta.get("half_graph_fingerprint"):
            raise BundleError(f"{d}: program_half.pt2 does not trace to the graph the bundle was made with")
    elif plan.duplex:
        raise BundleError(
            f"{d}: plan {plan.name} is a duplex plan but the bundle has no half-batch program "
            "(program_half.pt2); write the bundle again with this hapnb"
        )
    return Bundle(d, plan, ep, inputs, g, half)


def half_graph(plan: Plan, graph: Graph, inputs: Sequence[torch.Tensor], model: Any = None) -> Graph:
    """The model traced at half the batch (for duplex plans, :mod:`hapnb.run.duplex`): ``model`` when
    given, else rebuilt from the plan's zoo/factory spec, else the traced program itself re-exported."""
    from ..tracing import TraceError, trace
    from .duplex import DuplexError, half_inputs

    names = [graph.tensors[t].name for t in graph.inputs]
    try:
        half = half_inputs(inputs, names)
    except DuplexError as e:
        raise BundleError(str(e)) from None
    if model is None and plan.model_spec:
        from .. import zoo

        model = zoo.rebuild(plan.model_spec)[0]
    program = graph.traced_program() if model is None else None
    if isinstance(program, torch.export.ExportedProgram):
        model = program.module()
    if model is None:
        raise BundleError(f"plan {plan.name} is duplex: pass model=... to trace it at half the batch")
    try:
        return trace(model, half, name=graph.name)
    except (TraceError, RuntimeError, ValueError) as e:
        raise BundleError(
            f"plan {plan.name} is duplex but the model does not trace at half the batch "
            f"({type(e).__name__}: {e}); pass the model (model=...) if its spec cannot rebuild it"
        ) from e
