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

from ..hardware.cluster import Cluster
from ..plans.plan import Plan
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


# ----------------------------------------------------------------------------------------------------
# Fitting a device model to measured training steps (``hapnb calibrate --measured runs.json``)
#
# A runs file (the shipped one, :func:`shipped_runs`: hapnb/data/h100-lm-steps.json, is one) lists
# measured steps of known models: ``runs`` with
# ``step_s_median`` (seconds), optional ``peak_mem_bytes``, and the model options (``layers``, ``hidden``,
# ``seq``, ``batch``, and optionally ``model`` = a zoo name, default ``lm``; top-level ``model.vocab`` is
# passed on). Every run is traced once; for one device the cost model's time is a closed form of the
# per-op features (kernels, flops, bytes, matmul-ness) that :class:`~hapnb.cost.model.CostModel` reads, so the
# fit evaluates it vectorised (numpy) and a test checks it against ``hapnb.synthesize(...).cost_s``.

#: The device-model parameters the fit moves (peak_flops, bandwidth_Bps and optimizer_passes stay as given).
FIT_PARAMETERS = ("kernel_s", "matmul_eff", "matmul_half_flops", "attention_eff", "optimizer_kernels")
#: Where the fit starts (the free parameters; the others come from the kind's shipped model).
FIT_START = {"kernel_s": 2e-5, "matmul_eff": 0.85, "matmul_half_flops": 5e8, "attention_eff": 0.3,
             "optimizer_kernels": 12.0}  # fmt: skip
_RUN_OPTIONS = ("layers", "hidden", "seq", "batch", "heads", "ff", "vocab")


@dataclass(frozen=True)
class RunFeatures:
    """One measured run, traced: what the single-device cost model needs to price it."""

    name: str
    measured_s: float
    measured_peak: float | None
    flops: Any  # numpy arrays, one entry per op
    nbytes: Any
    kernels: Any
    kernel_flops: Any
    matmul: Any
    attention: Any
    param_bytes: float
    raw_memory: float  # predicted peak without allocator overhead
    params: int
    #: per op, its GEMM's (batch, M, N, K) (:func:`hapnb.cost.model.gemm_dims`) or None: wave quantization
    gemm: tuple[tuple[float, float, float, float] | None, ...] | None = None


def _single_device_program(th: Any) -> list[Any]:
    from ..cost.model import Load, Step

    g = th.graph
    loaded: set[int] = set()
    prog = []
    for op in g.ops:
        s = th.strategies[op.id][0]
        loads = []
        for t, f in zip(op.inputs, s.inputs):
            if g.tensors[t].role != "activation" and t not in loaded:
                loaded.add(t)
                loads.append(Load(t, f))
        prog.append(Step(op.id, s, tuple(loads)))
    return prog


def run_features(run: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> RunFeatures:
    """Trace the run's model (zoo ``run['model']``, default ``lm``) and read its per-op features."""
    import numpy as np

    from .. import zoo
    from ..cost.model import MATMUL_FAMILIES, CostModel, gemm_dims
    from ..hardware.devices import DeviceModel
    from ..tracing import trace
    from ..triples import theory

    opts = {k: run[k] for k in _RUN_OPTIONS if k in run}
    for k, v in (defaults or {}).items():
        opts.setdefault(k, v)
    name = str(run.get("name", "run"))
    model, inputs, _ = zoo.build(str(run.get("model", "lm")), devices=1, **opts)
    n_params = sum(p.numel() for p in model.parameters())
    if "params" in run and int(run["params"]) != n_params:
        raise ValueError(f"run {name}: the zoo model has {n_params} parameters, the run says {run['params']}")
    g = trace(model, inputs, name=name)
    th = theory(g)
    dm = DeviceModel(1e12, 1e12, 1e-6, 1.0, 1.0, source="features")
    c = Cluster.parse("1e12").replace(
        devices=(dataclasses.replace(Cluster.parse("1e12").devices[0], model=dm),)
    )
    cm = CostModel(th, c)
    rows = []
    for op in g.ops:
        s = th.strategies[op.id][0]
        nbytes, kernels = cm.op_traffic(op.id)
        fam = op.family
        flops = (s.scaled_flops + s.fixed_flops) * cm.grad_share(op.id)  # gradients autograd runs
        rows.append((flops, nbytes, kernels, op.flops, fam in MATMUL_FAMILIES, fam == "attention"))
    a = np.array(rows, dtype=float).reshape(-1, 6)
    raw = float(cm.memory(_single_device_program(th), (), ((1.0,),) * cm.n_segments)[0])
    peak = run.get("peak_mem_bytes")
    gemm = tuple(gemm_dims(g, op, th.strategies[op.id][0]) for op in g.ops)
    return RunFeatures(
        name, float(run["step_s_median"]), float(peak) if peak else None, a[:, 0], a[:, 1], a[:, 2],
        a[:, 3], a[:, 4] > 0, a[:, 5] > 0, float(g.param_bytes), raw, n_params, gemm,
    )  # fmt: skip


def predict_step_s(m: Any, f: RunFeatures) -> float:
    """The single-device step time of run ``f`` under device model ``m`` (what :meth:`CostModel.evaluate`
    gives for one device: the larger of the summed launch and GPU work times, plus the optimizer step)."""
    import numpy as np

    w = f.kernel_flops
    eff = np.where(f.matmul, m.matmul_eff * w / np.maximum(w + m.matmul_half_flops, 1e-30), 1.0)
    eff = np.where(f.matmul & (w <= 0), m.matmul_eff, eff)
    if m.sm_count is not None and f.gemm is not None:
        eff = np.where(f.matmul, eff * _wave_factors(m, f), eff)
    eff = np.where(f.attention, m.attention_eff, eff)
    work = np.maximum(f.flops / (m.peak_flops * eff), f.nbytes / m.bandwidth_Bps).sum()
    launch = (f.kernels * m.kernel_s).sum()
    opt = m.optimizer_kernels * m.kernel_s + m.optimizer_passes * f.param_bytes / m.bandwidth_Bps
    return float((max(launch, work) if m.overlap else launch + work) + opt)


_WAVES: dict[tuple[int, int | None, int | None], tuple[Any, Any]] = {}


def _wave_factors(m: Any, f: RunFeatures) -> Any:
    """Per op, ``m.gemm_wave_factor`` of its GEMM dims (1 for the rest); cached per run and wave
    parameters, which no fit moves."""
    import numpy as np

    key = (id(f), m.sm_count, m.gemm_tile)
    hit = _WAVES.get(key)
    if hit is None or hit[0] is not f:
        hit = _WAVES[key] = (f, np.array([m.gemm_wave_factor(d) for d in (f.gemm or ())], dtype=float))
    return hit[1]


def _nelder_mead(fn: Any, x0: Any, step: float = 0.5, iters: int = 3000, tol: float = 1e-12) -> Any:
    """Minimise ``fn`` over R^d from ``x0`` (plain Nelder-Mead; reflection, expansion, contraction, shrink)."""
    import numpy as np

    d = len(x0)
    pts = [np.asarray(x0, float)] + [np.asarray(x0, float) + step * np.eye(d)[i] for i in range(d)]
    vals = [fn(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        centre = np.mean(pts[:-1], axis=0)
        xr = centre + (centre - pts[-1])
        fr = fn(xr)
        if fr < vals[0]:
            xe = centre + 2 * (centre - pts[-1])
            fe = fn(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centre + 0.5 * (pts[-1] - centre)
            fc = fn(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [fn(p) for p in pts[1:]]
    return pts[int(np.argmin(vals))]


def _to_model(x: Any, base: Any, source: str) -> Any:
    import numpy as np

    k, eff, half, att, kern = (float(v) for v in x)
    return dataclasses.replace(
        base, kernel_s=float(np.exp(k)), matmul_eff=float(1 / (1 + np.exp(-eff))),
        matmul_half_flops=float(np.exp(half)), attention_eff=float(1 / (1 + np.exp(-att))),
        optimizer_kernels=float(np.exp(kern)), source=source,
    )  # fmt: skip


def _from_model(m: Any) -> Any:
    import numpy as np

    e = min(max(m.matmul_eff, 1e-6), 1 - 1e-6)
    a = min(max(m.attention_eff, 1e-6), 1 - 1e-6)
    return np.log([m.kernel_s or 1e-7, e / (1 - e), m.matmul_half_flops or 1.0, a / (1 - a),
                   m.optimizer_kernels or 1e-3])  # fmt: skip


def fit_time(feats: Sequence[RunFeatures], base: Any, source: str = "fit") -> Any:
    """Device model whose single-device step times best match ``feats`` (least squares on log ratio),
    ``peak_flops`` kept from ``base``; Nelder-Mead from ``base`` and from a few restarts."""
    import numpy as np

    meas = np.array([f.measured_s for f in feats])

    def loss(x: Any) -> float:
        m = _to_model(x, base, source)
        pred = np.array([predict_step_s(m, f) for f in feats])
        return float(np.mean(np.log(pred / meas) ** 2))

    best = None
    x0 = _from_model(base)
    for shift in (0.0, 1.0, -1.0):
        x = _nelder_mead(loss, x0 + shift * np.array([0.5, 0.5, 1.0, 0.5, 0.5]))
        x = _nelder_mead(loss, x, step=0.1)
        if best is None or loss(x) < loss(best):
            best = x
    return _to_model(best, base, source)


def fit_memory(feats: Sequence[RunFeatures]) -> tuple[float, float]:
    """``(memory_overhead, memory_const_bytes)`` with ``peak = (1 + overhead) * raw + const`` closest to
    the measured peaks in relative terms (linear least squares; both kept >= 0)."""
    import numpy as np

    fs = [f for f in feats if f.measured_peak]
    if not fs:
        return 0.0, 0.0
    raw = np.array([f.raw_memory for f in fs])
    meas = np.array([f.measured_peak for f in fs])
    a = np.stack([raw / meas, 1 / meas], axis=1)
    (scale, const), *_ = np.linalg.lstsq(a, np.ones(len(fs)), rcond=None)
    if scale < 1.0:  # the overhead is never negative: constant only
        scale, const = 1.0, float(np.sum((meas - raw) / meas**2) / np.sum(1 / meas**2))
    if const < 0 or len(fs) < 2:
        scale, const = max(1.0, float(np.sum(raw / meas) / np.sum((raw / meas) ** 2))), 0.0
    return float(scale - 1.0), float(const)


def prediction_stats(
    pred: Sequence[float], meas: Sequence[float], spread: Sequence[tuple[float, float]] | None = None
) -> dict[str, float]:
    """Mean and max absolute % error of ``pred`` against ``meas``, Pearson, Spearman, and whether the
    rank order is kept (the fidelity studies' summary numbers). With ``spread`` (each measurement's
    (min, max) over its repeats), also the pairs the measurements order beyond their spread (ranges that
    do not overlap) and how many of those the prediction orders the same way.

    >>> s = prediction_stats([1.0, 2.2, 2.0], [1.0, 2.0, 2.1], [(0.9, 1.1), (1.8, 2.2), (1.9, 2.3)])
    >>> s["rank_kept"], s["ordered_pairs"], s["ordered_pairs_kept"]
    (False, 2, 2)
    """
    import numpy as np

    p, m = np.asarray(pred, float), np.asarray(meas, float)
    err = np.abs(p / m - 1) * 100
    rank = lambda v: np.argsort(np.argsort(v)).astype(float)  # noqa: E731
    pearson = float(np.corrcoef(p, m)[0, 1]) if len(p) > 1 else 1.0
    spearman = float(np.corrcoef(rank(p), rank(m))[0, 1]) if len(p) > 1 else 1.0
    out = {"mean_abs_pct": float(err.mean()), "max_abs_pct": float(err.max()), "pearson": pearson,
           "spearman": spearman, "rank_kept": bool((np.argsort(p) == np.argsort(m)).all())}  # fmt: skip
    if spread is not None:
        pairs = [(i, j) for i in range(len(p)) for j in range(len(p)) if spread[i][1] < spread[j][0]]
        out["ordered_pairs"] = len(pairs)
        out["ordered_pairs_kept"] = sum(1 for i, j in pairs if p[i] < p[j])
    return out


@dataclass(frozen=True)
class FitReport:
    """A device model fitted to measured runs, with per-run predictions (fitted on all runs and
    leave-one-out) and summary statistics (:func:`fit_device_model`)."""

    kind: str
    model: Any  # DeviceModel
    rows: tuple[dict[str, Any], ...]
    stats: Mapping[str, Mapping[str, float]]

    def cluster(self) -> Cluster:
        """One device of ``kind`` carrying the fitted model (the cluster JSON ``-o`` writes)."""
        c = Cluster.parse(self.kind) if self.kind in _known_kinds() else Cluster.parse("1e12")
        d = dataclasses.replace(c.devices[0], model=self.model)
        return c.replace(name=f"1x{self.kind} (fitted)", devices=(d,))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model.to_json(), "runs": [dict(r) for r in self.rows],
                "stats": {k: dict(v) for k, v in self.stats.items()}}  # fmt: skip

    def summary(self) -> str:
        lines = [f"device model for {self.kind}: {self.model}", "",
                 f"{'run':<24} {'measured ms':>11} {'fit ms':>8} {'LOO ms':>8} {'LOO err':>8}"
                 f" {'peak MB':>9} {'LOO MB':>9} {'LOO err':>8}"]  # fmt: skip
        for r in self.rows:
            mp, lp = r.get("measured_peak_bytes"), r.get("loo_peak_bytes")
            mem = f" {mp / 1e6:9.1f} {lp / 1e6:9.1f} {100 * (lp / mp - 1):+7.1f}%" if mp and lp else ""
            lines.append(
                f"{r['name']:<24} {r['measured_s'] * 1e3:11.3f} {r['fit_s'] * 1e3:8.3f} {r['loo_s'] * 1e3:8.3f}"
                f" {100 * (r['loo_s'] / r['measured_s'] - 1):+7.1f}%{mem}"
            )
        lines.append("")
        for k, s in self.stats.items():
            lines.append(
                f"{k}: mean |err| {s['mean_abs_pct']:.2f} %, max {s['max_abs_pct']:.2f} %, Pearson "
                f"{s['pearson']:.4f}, Spearman {s['spearman']:.4f}, rank order kept: {s['rank_kept']}"
                + (
                    f"; pairs ordered beyond the measured min-max spread kept: {s['ordered_pairs_kept']}"
                    f" of {s['ordered_pairs']}"
                    if "ordered_pairs" in s
                    else ""
                )
            )
        return "\n".join(lines)

    __str__ = summary


def _known_kinds() -> Mapping[str, Any]:
    from ..hardware.catalogue import KINDS

    return KINDS


#: The word that names the shipped runs file where a path is expected (``hapnb calibrate --measured shipped``).
SHIPPED = "shipped"


def shipped_runs() -> Path:
    """The runs file that ships with hapnb as package data (hapnb/data/h100-lm-steps.json, found through
    ``importlib.resources``): the 12 measured H100 steps that the shipped ``H100`` device model
    (:data:`hapnb.hardware.catalogue.H100_MODEL`) is fitted to; hapnb/data/README.md describes it."""
    from importlib import resources

    return Path(str(resources.files("hapnb") / "data" / "h100-lm-steps.json"))


def load_measured(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Read a runs file (see the section comment; None or :data:`SHIPPED`: :func:`shipped_runs`); errors
    name the file and the missing field."""
    import json

    p = shipped_runs() if path is None or path == SHIPPED else Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"measured runs file {str(p)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{p}: needs a non-empty list 'runs'")
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or not isinstance(r.get("step_s_median"), (int, float)):
            raise ValueError(f"{p}: runs[{i}] needs step_s_median (seconds)")
    return data


def fit_device_model(
    measured: Mapping[str, Any] | str | os.PathLike[str],
    kind: str = "H100",
    *,
    loo: bool = True,
    features: Sequence[RunFeatures] | None = None,
) -> FitReport:
    """Fit ``kind``'s device model to measured runs (a runs file, :data:`SHIPPED` for :func:`shipped_runs`,
    or a runs file's parsed JSON): the free parameters (:data:`FIT_PARAMETERS`) on the step times, the
    allocator overhead on the peak memory; with ``loo``, every run is also predicted by a fit on the
    others (leave-one-out)."""
    from ..hardware.catalogue import DEVICE_MODELS, KINDS
    from ..hardware.devices import DeviceModel

    data = measured if isinstance(measured, Mapping) else load_measured(measured)
    if kind not in KINDS:
        raise ValueError(f"unknown device kind {kind!r}; known kinds: {', '.join(KINDS)}")
    shipped = DEVICE_MODELS.get(kind) or DeviceModel(KINDS[kind].peak_tflops * 1e12, 1e12, 1e-5, 0.8, 1e9)
    # a fixed start (not the shipped fit), so the documented command reproduces the shipped numbers
    base = dataclasses.replace(shipped, **FIT_START)
    defaults = (
        {"vocab": data["model"]["vocab"]}
        if isinstance(data.get("model"), dict) and "vocab" in data["model"]
        else {}
    )
    feats = list(features) if features is not None else [run_features(r, defaults) for r in data["runs"]]
    n = len(feats)
    source = f"fit to {n} measured runs ({data.get('gpu', kind)}; hapnb calibrate --measured)"

    def fit(fs: Sequence[RunFeatures]) -> Any:
        m = fit_time(fs, base, source)
        over, const = fit_memory(fs)
        return dataclasses.replace(m, memory_overhead=over, memory_const_bytes=const)

    def peak(m: Any, f: RunFeatures) -> float:
        return (1 + m.memory_overhead) * f.raw_memory + m.memory_const_bytes

    model = fit(feats)
    rows = []
    for i, f in enumerate(feats):
        lm = fit(feats[:i] + feats[i + 1 :]) if loo and n > 2 else model
        row = {"name": f.name, "measured_s": f.measured_s, "fit_s": predict_step_s(model, f),
               "loo_s": predict_step_s(lm, f), "params": f.params}  # fmt: skip
        if f.measured_peak:
            row.update(measured_peak_bytes=f.measured_peak, fit_peak_bytes=peak(model, f),
                       loo_peak_bytes=peak(lm, f))  # fmt: skip
        rows.append(row)
    runs = data["runs"]
    spread = None
    if all("step_s_min" in r and "step_s_max" in r for r in runs) and len(runs) == n:
        spread = [(float(r["step_s_min"]), float(r["step_s_max"])) for r in runs]
    meas = [r["measured_s"] for r in rows]
    stats = {
        "step time, fitted on all": prediction_stats([r["fit_s"] for r in rows], meas, spread),
        "step time, leave-one-out": prediction_stats([r["loo_s"] for r in rows], meas, spread),
    }
    mem = [r for r in rows if "measured_peak_bytes" in r]
    if mem:
        stats["peak memory, leave-one-out"] = prediction_stats(
            [r["loo_peak_bytes"] for r in mem], [r["measured_peak_bytes"] for r in mem]
        )
    return FitReport(kind, model, tuple(rows), stats)
