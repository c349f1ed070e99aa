"""Calibration: compare a plan's predicted iteration time with a measured one (``hapnb calibrate``).

:func:`calibrate` compares a plan's predicted iteration time (``plan.cost_s``, and per stage) with a
measured one — a number of seconds, or the metrics lines of a launch (the slowest rank's ``step_s`` per
step, median over steps after ``warmup``). The :class:`CalibrationReport` gives ``ratio`` = measured /
predicted, and ``throughput_scale``: the factor by which every device's ``flops`` would have to be
multiplied for the model to predict the measured time if communication were modelled exactly
(``comp / (measured - comm)``; None when the predicted communication alone exceeds the measurement).
:meth:`CalibrationReport.scaled_cluster` applies it. :func:`calibrate_launch` launches the plan
(:func:`hapnb.run.launch.launch`) for a few steps and calibrates against that run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cluster import Cluster
from ..plan import Plan
from .launch import DEFAULT_WORKER, LaunchError, launch, step_times

__all__ = ["CalibrationReport", "StageCalibration", "calibrate", "calibrate_launch"]


@dataclass(frozen=True)
class StageCalibration:
    """A stage's predicted time: ``comm_s + comp_s`` (comp = the slowest device)."""

    index: int
    predicted_s: float
    comm_s: float
    comp_s: float


@dataclass(frozen=True)
class CalibrationReport:
    """Predicted vs measured iteration time of a plan (see the module docstring)."""

    plan: str
    predicted_s: float
    measured_s: float
    ratio: float  # measured / predicted
    predicted_comm_s: float
    predicted_comp_s: float
    throughput_scale: float | None
    stages: tuple[StageCalibration, ...]
    steps_used: int

    def scaled_cluster(self, cluster: Cluster) -> Cluster:
        """``cluster`` with every device's flops multiplied by :attr:`throughput_scale`."""
        if self.throughput_scale is None:
            raise ValueError(
                "no throughput scale: the predicted communication alone exceeds the measured time, so "
                "the collectives are modelled too slow; re-profile them (hapnb profile) instead"
            )
        devices = tuple(
            dataclasses.replace(d, flops=d.flops * self.throughput_scale) for d in cluster.devices
        )
        return cluster.replace(devices=devices)

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "ratio": self.ratio,
            "predicted_comm_s": self.predicted_comm_s,
            "predicted_comp_s": self.predicted_comp_s,
            "throughput_scale": self.throughput_scale,
            "steps_used": self.steps_used,
            "stages": [
                {"index": s.index, "predicted_s": s.predicted_s, "comm_s": s.comm_s, "comp_s": s.comp_s}
                for s in self.stages
            ],
        }

    def summary(self) -> str:
        ms = 1e3
        lines = [
            f"plan {self.plan}: predicted {self.predicted_s * ms:.4g} ms/iteration "
            f"(comm {self.predicted_comm_s * ms:.4g} + comp {self.predicted_comp_s * ms:.4g}), measured "
            f"{self.measured_s * ms:.4g} ms (median of {self.steps_used} step{'s' * (self.steps_used != 1)});"
            " "
            f"measured/predicted = {self.ratio:.3g}",
        ]
        if self.throughput_scale is not None:
            lines.append(
                f"to match, scale device flops by {self.throughput_scale:.3g} "
                "(report.scaled_cluster(plan.cluster)), assuming communication is modelled right"
            )
        else:
            lines.append("predicted communication alone exceeds the measurement: re-profile the collectives")
        for s in self.stages:
            lines.append(
                f"  stage {s.index}: {s.predicted_s * ms:.4g} ms "
                f"(comm {s.comm_s * ms:.4g}, comp {s.comp_s * ms:.4g})"
            )
        return "\n".join(lines)

    __str__ = summary


def calibrate(
    plan: Any, measured_step_s: float | Sequence[Mapping[str, Any]] | Any, *, warmup: int = 1
) -> CalibrationReport:
    """Compare ``plan``'s predicted iteration time with a measured one.

    ``measured_step_s``: seconds per iteration, or metrics lines from a launch (``job.steps``,
    ``JobResult.metrics`` or a JobResult): the slowest rank's ``step_s`` per step, median over the steps
    after the first ``warmup``.

    >>> from types import SimpleNamespace as NS
    >>> p = NS(name="p", cost_s=0.01, stages=[NS(index=0, comm_s=0.002, comp_s=(0.008, 0.004))])
    >>> r = calibrate(p, 0.018)
    >>> round(r.ratio, 6), round(r.throughput_scale, 6)
    (1.8, 0.5)
    """
    if hasattr(measured_step_s, "metrics") and not callable(measured_step_s.metrics):
        measured_step_s = measured_step_s.metrics
    if isinstance(measured_step_s, (int, float)) and not isinstance(measured_step_s, bool):
        measured, used = float(measured_step_s), 1
    else:
        times = step_times(list(measured_step_s), warmup)
        if not times:
            raise ValueError(
                "no step times in the metrics (lines need 'step' and 'step_s'); did the launch run?"
            )
        measured, used = statistics.median(times), len(times)
    if not (measured > 0 and math.isfinite(measured)):
        raise ValueError(f"measured step time must be a positive number of seconds, got {measured!r}")
    predicted = float(plan.cost_s)
    if not predicted > 0:
        raise ValueError(
            f"plan {getattr(plan, 'name', '?')} predicts {predicted} s per iteration; nothing to compare"
        )
    stages = tuple(
        StageCalibration(
            int(s.index),
            float(s.comm_s) + (max(s.comp_s) if s.comp_s else 0.0),
            float(s.comm_s),
            float(max(s.comp_s)) if s.comp_s else 0.0,
        )
        for s in plan.stages
    )
    comm = math.fsum(s.comm_s for s in stages)
    comp = math.fsum(s.comp_s for s in stages)
    if not stages:  # no stage breakdown: treat everything as computation
        comp = predicted
    scale = comp / (measured - comm) if measured > comm and comp > 0 else None
    return CalibrationReport(
        plan=str(getattr(plan, "name", "plan")),
        predicted_s=predicted,
        measured_s=measured,
        ratio=measured / predicted,
        predicted_comm_s=comm,
        predicted_comp_s=comp,
        throughput_scale=scale,
        stages=stages,
        steps_used=used,
    )


def calibrate_launch(
    plan_or_bundle: Plan | str | os.PathLike[str],
    nproc: int | None = None,
    backend: str = "gloo",
    steps: int = 10,
    *,
    warmup: int = 1,
    timeout_s: float | None = 300.0,
    worker: Sequence[str] = DEFAULT_WORKER,
) -> CalibrationReport:
    """Launch ``plan_or_bundle`` (a Plan, a plan JSON file or a bundle directory) for ``steps`` steps
    and compare its predicted iteration time with the measured one (see :func:`calibrate`).

    Raises :class:`~hapnb.run.launch.LaunchError` (with the run's result) when the run fails.
    """
    if isinstance(plan_or_bundle, Plan):
        plan = plan_or_bundle
    else:
        src = Path(plan_or_bundle)
        plan = Plan.load(src / "plan.json" if src.is_dir() else src)
    job = launch(plan_or_bundle, nproc, backend, steps, timeout_s=timeout_s, worker=worker)
    with job:
        result = job.wait()
    if not result.ok:
        raise LaunchError(f"the run failed: {result.error}", result)
    return calibrate(plan, result.metrics, warmup=warmup)
