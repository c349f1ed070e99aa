"""Renderers: hapnb objects as HTML tables, graphviz drawings, SVG pictures and bokeh Gantt charts.

Every function here is pure: it reads a hapnb value (Graph, Theory, Search, Plan, Cluster) and returns
an HTML string, a ``graphviz.Digraph`` or a bokeh figure. This package is a leaf: it imports no other
hapnb module and knows the values by their attributes (duck typing), so every layer may render through
it — each value's ``_repr_html_`` imports it lazily. Optional packages (graphviz, bokeh) are imported
inside the functions, so ``import hapnb.display`` is cheap and works without them. :func:`safe_html`
never raises: a broken renderer shows the object's plain text and a one-line note instead of a
traceback.

Modules: ``basics`` (escaping, tables, units, form notation), ``drawings`` (graphviz), ``tables`` (graph,
cluster, theory, search HTML), ``plans`` (plan HTML, diffs, sharding, static timeline), ``charts`` (bokeh
Gantt), ``report`` (a whole page), ``tuning`` (what bounds the step, why not, what if), ``comparison``
(a strategy comparison: table and chart), ``pipeline_views`` (a pipeline plan: stages on the cluster,
its schedule's Gantt chart), ``live`` (a running job's telemetry and its live re-balances).

Renderers (all accept the value as first argument):

======================  =====================================================================
HTML                    ``graph_html``, ``theory_html`` (filter by op/tensor/kind, highlight triple
                        ids), ``search_html``, ``frontier_html``, ``plan_html``, ``history_html``,
                        ``plan_diff_html(old, new)``, ``sharding_html(plan, tensor)``,
                        ``cluster_html``, ``gantt_svg`` (static timeline, no JavaScript),
                        ``report_html(plan, baselines=...)`` (a whole self-contained page),
                        ``sensitivity_html``, ``why_not_html``, ``what_if_html`` (hapnb.plans.explain's values),
                        ``comparison_html`` (hapnb.compare), ``pipeline_html`` (a PipelinePlan),
                        ``rebalance_html(metrics)`` (a job's re-balance decisions; ``decisions(metrics)``
                        gives them as records), ``live_frame(metrics)`` (the live chart as an iframe for a
                        widget)
graphviz                ``graph_dot(graph, plan=None)``, ``search_tree_dot(search, around=None,
                        depth=2, event=None)``, ``proof_dot(plan)``, ``pipeline_dot(pipeline_plan)``
                        (its stages on the cluster); ``svg(drawing)`` renders one to an SVG string
                        (``None`` when the ``dot`` program is missing)
bokeh                   ``gantt(plan, measured=None)`` (a figure), ``gantt_html(plan)`` (a standalone
                        page with inline BokehJS: no CDN, works offline), ``comparison_chart(cmp)``
                        (grouped bars per strategy), ``pipeline_gantt(timeline)`` (a pipeline's
                        schedule), ``live_chart(metrics, steps=None, baseline=None)`` (a job's step,
                        compute and blocked time per rank and step, re-balances marked),
                        ``live_chart_html(metrics)`` (its standalone page)
helpers                 ``enabled_triples(search, node)``: ids of the triples enabled at a search node;
                        ``rebalance_text(record)``, ``telemetry_text(line)``: a decision, a telemetry
                        window in words
======================  =====================================================================

A drawing returned without the ``dot`` program still displays in a notebook (as its dot source).

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)  # doctest: +SKIP
>>> from hapnb import display
>>> html = display.plan_html(plan)  # doctest: +SKIP
>>> fig = display.gantt(plan)  # doctest: +SKIP
>>> display.graph_dot(plan)  # doctest: +SKIP
"""

from __future__ import annotations

from .basics import FORM_COLORS, esc, form_text, safe_html, short_target, time_unit
from .charts import gantt, gantt_frame, gantt_html
from .comparison import comparison_chart, comparison_html
from .drawings import graph_dot, has_dot, proof_dot, search_tree_dot, svg
from .live import (
    decisions,
    live_chart,
    live_chart_html,
    live_frame,
    rebalance_html,
    rebalance_text,
    telemetry_text,
)
from .pipeline_views import pipeline_dot, pipeline_gantt, pipeline_html
from .plans import forms_by_tensor, gantt_svg, history_html, plan_diff_html, plan_html, sharding_html
from .report import launch_html, report_html, verify_status_html
from .tables import (
    cluster_html,
    enabled_triples,
    event_html,
    frontier_html,
    graph_html,
    search_html,
    theory_html,
    triple_text,
)
from .tuning import sensitivity_html, what_if_html, why_not_html

__all__ = [
    "safe_html",
    "graph_html",
    "theory_html",
    "search_html",
    "frontier_html",
    "event_html",
    "plan_html",
    "history_html",
    "plan_diff_html",
    "forms_by_tensor",
    "cluster_html",
    "sharding_html",
    "gantt",
    "gantt_html",
    "gantt_frame",
    "gantt_svg",
    "report_html",
    "launch_html",
    "verify_status_html",
    "sensitivity_html",
    "why_not_html",
    "what_if_html",
    "comparison_html",
    "comparison_chart",
    "pipeline_html",
    "pipeline_dot",
    "pipeline_gantt",
    "decisions",
    "live_chart",
    "live_chart_html",
    "live_frame",
    "rebalance_html",
    "rebalance_text",
    "telemetry_text",
    "graph_dot",
    "search_tree_dot",
    "proof_dot",
    "svg",
    "has_dot",
    "enabled_triples",
    "triple_text",
    "form_text",
    "short_target",
    "time_unit",
    "esc",
    "FORM_COLORS",
]
