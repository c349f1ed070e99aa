"""Heterogeneous pipeline templates (Ditto: Zhu, Wang, Senta, Reddy and Kaplan, "Ditto: Automating Hybrid
Parallelism for Large Model Training on Heterogeneous Cluster"): the plan value and its JSON.

A *pipeline plan* cuts a model into contiguous *units* (module boundaries of the model's repeated blocks,
plus what comes before and after them) and assigns consecutive units to *stages*; each stage runs on one
or more devices of the cluster (several devices: data parallel inside the stage, each micro-batch's
samples split by the stage's ``shares``). The batch runs as ``micro_batches`` micro-batches under a GPipe
or 1F1B schedule.

The planner (Ditto's algorithm, one module per stage of it): :mod:`~hapnb.pipelines.costs` (units and
their costs from hapnb's cost model), :mod:`~hapnb.pipelines.timing` (the pipeline time and memory model
every planner shares), :mod:`~hapnb.pipelines.folding` (node folding), :mod:`~hapnb.pipelines.template`
(the homogeneous template search), :mod:`~hapnb.pipelines.recovery` (DP and greedy recovery),
:mod:`~hapnb.pipelines.exhaustive` (the reference search) and :mod:`~hapnb.pipelines.planner`
(:func:`pipeline`, loaded on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

from .plan import PIPELINE_FORMAT, SCHEDULES, PipelinePlan, PipelineStage, is_pipeline_json

__all__ = ["PIPELINE_FORMAT", "SCHEDULES", "PipelinePlan", "PipelineStage", "is_pipeline_json", "pipeline"]


def __getattr__(name: str) -> Any:
    if name == "pipeline":  # the planner imports the cost model: load it only when asked for
        return importlib.import_module(".planner", __name__).pipeline
    raise AttributeError(f"module 'hapnb.pipelines' has no attribute {name!r}")
