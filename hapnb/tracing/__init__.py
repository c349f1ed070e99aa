"""Trace a PyTorch model into a :class:`~hapnb.ir.graph.Graph`: reference tensors, ops, shapes and flops.

:func:`trace` runs ``torch.export`` (aten-level ops, shapes and dtypes from node meta) and falls back
to ``torch.fx.symbolic_trace`` + shape propagation; it identifies parameters, buffers, user inputs and
the loss, and asks the rule table (:mod:`hapnb.rules`) for each op's analytic forward flops.

The modules: :mod:`.tracer` (:func:`trace` and its error hints), :mod:`.patches` (trace-time patches of
torch code that torch.export cannot capture), :mod:`.exported` (the Graph of an
exported program), :mod:`.lower` (rewriting ops without a rule), :mod:`.constants` (folding what depends
on no input and no weight into lifted constants), :mod:`.fx_fallback` (torch.fx),
:mod:`.builder` (the Graph under construction) and :mod:`.folds` (unfolding a fold of the batch around
row-wise ops, e.g. seq-first attention's output projection); for zoo models :mod:`.resolve` (:func:`resolve_model`,
:func:`zoo_graph`), :mod:`.record` (the fast recorder on meta tensors) and :mod:`.cache` (the trace cache).

>>> import torch, hapnb
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 3))
>>> g = hapnb.trace(m, (torch.randn(8, 4),), loss=lambda out: out.sum())
>>> [op.target for op in g.ops]
['aten.linear.default', 'aten.sum.default']
"""

from __future__ import annotations

from ..ir.graph import TraceError
from .builder import module_path
from .exported import from_export
from .resolve import deferred_program, resolve_model, zoo_graph
from .tracer import trace

__all__ = [
    "trace",
    "resolve_model",
    "zoo_graph",
    "deferred_program",
    "from_export",
    "TraceError",
    "module_path",
]
