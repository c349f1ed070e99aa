"""From what a user names to a Graph: :func:`resolve_model` takes a Graph, an nn.Module with example
inputs, or a zoo name / factory; :func:`zoo_graph` gives a zoo model's Graph through the fast path (the
trace cache, :mod:`.cache`, else the meta recorder, :mod:`.record`) or the full one (build with weights,
then :func:`~.tracer.trace`); :func:`deferred_program` traces a model with its weights only when a
program is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..ir.graph import DeferredProgram, Graph, TraceError
from .tracer import trace


def resolve_model(
    model_or_graph: Any,
    cluster: Any,
    example_inputs: Sequence[Any] | None = None,
    loss: Any = None,
    timings: dict[str, Any] | None = None,
    **zoo_options: Any,
) -> tuple[Graph, dict[str, Any] | None]:
    """A Graph from a Graph, an nn.Module (+ example inputs) or a zoo name / ``pkg.mod:factory``
    (:func:`zoo_graph`, which fills ``timings``)."""
    if isinstance(model_or_graph, Graph):
        return model_or_graph, None
    if isinstance(model_or_graph, str):
        return zoo_graph(model_or_graph, timings, devices=cluster.n, **zoo_options)
    if example_inputs is None:
        raise ValueError(
            "synthesize(model, ...) needs example_inputs=(...) to trace an nn.Module; "
            "or pass a zoo name such as 'bert', or a Graph from hapnb.trace"
        )
    return trace(model_or_graph, tuple(example_inputs), loss=loss), None


def zoo_graph(
    name: str, timings: dict[str, Any] | None = None, **options: Any
) -> tuple[Graph, dict[str, Any]]:
    """The Graph of zoo model ``name`` (or factory ``pkg.mod:factory``) built with ``options`` (see
    :func:`hapnb.zoo.build`), and its model spec as JSON.

    Zoo models come from the trace cache (:mod:`hapnb.tracing.cache`) or are recorded on meta tensors
    (:mod:`hapnb.tracing.record`: no weights, no torch.export; the same Graph, checked by the tests for
    every zoo model) and stored there; they get a :class:`DeferredProgram` that traces the model with its
    weights when a program is needed. Factories, models the recorder cannot reproduce exactly, and
    ``HAPNB_TRACE=export`` in the environment take the full path: build with weights, then :func:`trace`.
    ``timings`` (when given) receives ``build_s``, ``trace_s`` and ``trace_path`` (``cache``,
    ``recorded`` or ``export``).
    """
    import dataclasses
    import logging
    import os
    import time

    from .. import zoo

    t = timings if timings is not None else {}
    label = name.split(":")[-1]
    spec = zoo.model_spec(name, **options).to_json()
    if ":" not in name and os.environ.get("HAPNB_TRACE", "fast") != "export":
        from . import cache
        from .record import trace_zoo_meta

        t0 = time.perf_counter()
        g = cache.load(spec)
        if g is not None:
            t.update(build_s=0.0, trace_s=time.perf_counter() - t0, trace_path="cache")
            return dataclasses.replace(g, program=deferred_program(spec, label, g.fingerprint)), spec
        try:
            g, _ = trace_zoo_meta(name, timings=t, **options)
        except Exception as exc:  # noqa: BLE001 - the full path below reports real errors
            logging.getLogger(__name__).info(
                "%s: recording on meta tensors failed (%s); using torch.export", name, exc
            )
        else:
            cache.save(spec, g)
            t["trace_path"] = "recorded"
            return dataclasses.replace(g, program=deferred_program(spec, label, g.fingerprint)), spec
    t0 = time.perf_counter()
    model, inputs, _ = zoo.build(name, **options)
    t1 = time.perf_counter()
    g = trace(model, inputs, name=label)
    t.update(build_s=t1 - t0, trace_s=time.perf_counter() - t1, trace_path="export")
    return g, spec


def deferred_program(spec: dict[str, Any], name: str, fingerprint: str) -> DeferredProgram:
    """A :class:`DeferredProgram` that rebuilds the model of ``spec`` with its weights, traces it with
    :func:`trace` and checks it gives the graph ``fingerprint`` (the one recorded or cached)."""

    def make() -> Any:
        from .. import zoo

        model, inputs, _ = zoo.build_spec(zoo.ModelSpec.from_json(spec))
        full = trace(model, inputs, name=name)
        if full.fingerprint != fingerprint:
            raise TraceError(
                f"{name}: traced with its weights the model gives graph {full.fingerprint}, but the graph it "
                f"was planned with (recorded on meta tensors or read from the trace cache) is {fingerprint}. "
                "Set HAPNB_TRACE=export to trace with torch.export only, and please report this."
            )
        return full.program

    return DeferredProgram(make, f"{spec.get('name', name)}, traced with its weights on first use")
