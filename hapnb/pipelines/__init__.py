"""Heterogeneous pipeline templates (Ditto, shared/papers/ditto.md): the plan value and its JSON.

A *pipeline plan* cuts a model into contiguous *units* (module boundaries of the model's repeated blocks,
plus what comes before and after them) and assigns consecutive units to *stages*; each stage runs on one
or more devices of the cluster (several devices: data parallel inside the stage, each micro-batch's
samples split by the stage's ``shares``). The batch runs as ``micro_batches`` micro-batches under a GPipe
or 1F1B schedule.
"""

from __future__ import annotations

from .plan import PIPELINE_FORMAT, SCHEDULES, PipelinePlan, PipelineStage, is_pipeline_json

__all__ = ["PIPELINE_FORMAT", "SCHEDULES", "PipelinePlan", "PipelineStage", "is_pipeline_json"]
