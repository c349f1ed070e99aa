"""Fidelity of the cost model on one CPU process (issue 8, 5(b)): predicted vs measured step time and
peak memory of >= 10 models (zoo models at small sizes and the example factories).

    .venv/bin/python benchmarks/fidelity_cpu.py [--threads 1] [--cluster cpu.json] [--steps 15]

1. The device: ``--cluster`` (a cluster JSON from ``hapnb profile``, its first device's model) or, by
   default, :func:`hapnb.run.profile.profile_device_model` on this CPU with ``--threads`` torch threads.
2. Per model: ``hapnb.synthesize`` on a one-device cluster carrying that model gives ``cost_s`` (forward,
   backward and Adam step) and the predicted peak memory (``memory_bytes``, with its breakdown).
3. Measured, same process, same thread count: ``--warmup`` steps, then ``--steps`` timed steps of
   ``zero_grad(set_to_none); loss = model(*inputs); loss.backward(); torch.optim.Adam(lr=1e-4).step()``
   (median and min), then one more step under ``torch.profiler`` with ``profile_memory=True``: the CPU
   allocator's allocation/free events in time order give the peak of live bytes above the step's start,
   to which the bytes live at the start (parameters, Adam states, buffers, inputs: unique storages) are
   added.
4. Variants of the device model: without its CPU refinements (``optimizer_per_tensor``: single-tensor
   Adam's kernels per parameter tensor; ``vector_flops``: transcendental, pooling and loss ops priced
   as compute at the profiled vector rate), i.e. the model as it was before them, and with Adam per
   tensor only; with ``--calibrate``, leave-one-out predictions of the device model fitted to the other
   runs (``hapnb calibrate``'s fit, started from the profile; see docs/fidelity-cpu.md).

Writes ``--out`` (default docs/fidelity-cpu.json) and prints a table. Timings on a shared machine are
noisy: the JSON keeps median and min per model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples.factories

import hapnb  # noqa: E402
from hapnb import zoo  # noqa: E402
from hapnb.cluster import Cluster  # noqa: E402
from hapnb.cost import MATMUL_FAMILIES, VECTOR_FAMILIES, CostModel  # noqa: E402
from hapnb.devices import DeviceModel  # noqa: E402
from hapnb.run.calibrate import RunFeatures, fit_time, predict_step_s, prediction_stats  # noqa: E402
from hapnb.run.profile import profile_device_model  # noqa: E402

_LM = dict(layers=2, hidden=128, heads=4, vocab=1024, seq=64, batch=8, dropout=0.0)
#: (label, zoo name or factory, options): small sizes, one CPU thread takes ~5-300 ms per step
MODELS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("mlp-512", "mlp", dict(layers=4, hidden=512, input=512, batch=64)),
    ("mlp-1024", "mlp", dict(layers=2, hidden=1024, input=1024, batch=128)),
    ("gpt", "gpt", _LM),
    ("bert", "bert", _LM),
    ("bert-moe", "bert-moe", dict(_LM, experts=2)),
    ("vit", "vit", dict(layers=2, hidden=128, heads=4, image=32, patch=4, batch=16, dropout=0.0)),
    ("vgg19", "vgg19", dict(width=0.25, hidden=256, batch=8, dropout=0.0)),
    ("lm-L2-H128", "lm", dict(layers=2, hidden=128, seq=64, batch=8, vocab=2048)),
    ("lm-L2-H256", "lm", dict(layers=2, hidden=256, seq=64, batch=16, vocab=4096)),
    ("lm-L4-H256-S128", "lm", dict(layers=4, hidden=256, seq=128, batch=8, vocab=4096)),
    ("small_convnet", "examples.factories:small_convnet", dict(batch=32, channels=16, image=32)),
    ("prenorm_lm", "examples.factories:prenorm_lm",
     dict(batch=8, seq=64, vocab=1024, hidden=128, heads=4, layers=2)),
    ("cumulative_mix_lm", "examples.factories:cumulative_mix_lm", dict(batch=8, seq=64, vocab=1024, hidden=128)),
    ("tied_lm", "examples.factories:tied_lm", dict(batch=8, seq=64, vocab=1024, hidden=128)),
)  # fmt: skip


def build(name: str, options: dict[str, Any]) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs, _ = zoo.build(name, devices=1, **options)
    return model, inputs


def measure_steps(model: torch.nn.Module, inputs: tuple, steps: int, warmup: int) -> tuple[float, float, Any]:
    """(median s, min s, the optimizer) of ``steps`` Adam training steps after ``warmup``."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(*inputs).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), opt


def _live_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure_peak_bytes(model: torch.nn.Module, inputs: tuple, opt: Any) -> tuple[int, int]:
    """(peak bytes, bytes live at the step's start) of one steady-state step, from torch.profiler's
    CPU allocator events (``profile_memory=True``), in time order."""
    from torch.profiler import ProfilerActivity, profile

    opt.zero_grad(set_to_none=True)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    start = _live_bytes(list(model.parameters()) + list(model.buffers()) + state + list(inputs))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(*inputs).backward()
        opt.step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return start + peak, start


def features(g: Any, th: Any, cm: CostModel, label: str, measured_s: float, dm: DeviceModel) -> Any:
    """The per-op features :func:`hapnb.run.calibrate.fit_time` fits on (as ``run_features`` reads them
    for zoo LMs, here for any traced model): each op under its first strategy on one device. The fit's
    closed form does not know ``dm.vector_flops``, so a vector op's bytes become
    ``max(bytes, flops * bandwidth / vector_flops)`` (the same time); it charges ``optimizer_kernels``
    once per step (foreach), which the fit moves freely (a per-tensor row made it run off to a
    kernel_s -> 0, optimizer_kernels -> inf corner)."""
    rows = []
    for op in g.ops:
        s = th.strategies[op.id][0]
        nbytes, kernels = cm.op_traffic(op.id)
        flops = s.scaled_flops + s.fixed_flops
        rate = dm.pool_flops if op.family == "pool" and dm.pool_flops else dm.vector_flops
        if rate is not None and op.family in VECTOR_FAMILIES:
            nbytes = max(nbytes, flops * dm.bandwidth_Bps / rate)
        rows.append((flops, nbytes, kernels, op.flops, op.family in MATMUL_FAMILIES,
                     op.family == "attention"))  # fmt: skip
    a = np.array(rows, dtype=float).reshape(-1, 6)
    n_params = int(sum(t.nbytes for t in g.tensors if t.role == "param") // 4)
    return RunFeatures(label, measured_s, None, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4] > 0, a[:, 5] > 0,
                       float(g.param_bytes), 0.0, n_params)  # fmt: skip


def loo_calibrated(feats: list[Any], base: DeviceModel) -> tuple[list[float], DeviceModel | None]:
    """Leave-one-out: each run predicted by the device model fitted (``hapnb calibrate``'s ``fit_time``:
    kernel_s, matmul_eff, matmul_half_flops, attention_eff, optimizer_kernels; from the profiled model)
    to the other runs; and the model fitted to all runs."""
    src = f"profile + fit to {len(feats)} CPU runs (benchmarks/fidelity_cpu.py)"
    loo = []
    for i, f in enumerate(feats):
        m = _fit_or_none(feats[:i] + feats[i + 1 :], base, src)
        loo.append(predict_step_s(m, f) if m else math.nan)
    return loo, _fit_or_none(feats, base, src)


def _fit_or_none(feats: list[Any], base: DeviceModel, src: str) -> DeviceModel | None:
    """``fit_time``, or None when its unbounded Nelder-Mead runs a parameter off to infinity (noisy
    timings can make ``kernel_s -> 0, optimizer_kernels -> inf`` a descent direction)."""
    try:
        return fit_time(feats, base, src)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (profile and measure)")
    ap.add_argument("--cluster", default=None, help="a profiled cluster JSON (default: profile now)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="the measured step the summary compares with",
    )
    ap.add_argument("--calibrate", action="store_true", help="also fit the device model, leave-one-out")
    ap.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "fidelity-cpu.json"))
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    if ns.cluster:
        dm = Cluster.load(ns.cluster).devices[0].model
        if dm is None:
            raise SystemExit(f"{ns.cluster}: its first device has no device model; run `hapnb profile`")
    else:
        dm = profile_device_model("cpu", threads=ns.threads).model
    print(f"device model: {dm}")
    base = Cluster.parse("1e11")

    def one_cpu(m: DeviceModel) -> Cluster:
        return base.replace(
            name="1xCPU (profiled)", devices=(dataclasses.replace(base.devices[0], kind="CPU", model=m),)
        )

    cluster = one_cpu(dm)
    plain = dict(vector_flops=None, pool_flops=None)
    before = one_cpu(dataclasses.replace(dm, optimizer_per_tensor=False, **plain))
    adam_only = one_cpu(dataclasses.replace(dm, optimizer_per_tensor=True, **plain))
    only = set(ns.only.split(",")) if ns.only else None
    rows, feats = [], []
    for label, name, options in MODELS:
        if only and label not in only:
            continue
        model, inputs = build(name, options)
        g = hapnb.trace(model, inputs)
        th = hapnb.theory(g)
        plan = hapnb.synthesize(g, cluster, seed_baselines=False, check_memory=False)
        plan_before = hapnb.synthesize(g, before, seed_baselines=False, check_memory=False)
        plan_adam = hapnb.synthesize(g, adam_only, seed_baselines=False, check_memory=False)
        cm = CostModel(th, cluster)
        n_tensors = sum(1 for t in g.tensors if t.role == "param")
        kernels = sum(cm.op_traffic(op.id)[1] for op in g.ops)
        model, inputs = build(name, options)  # fresh weights for the measurement
        med, low, opt = measure_steps(model, inputs, ns.steps, ns.warmup)
        peak, start = measure_peak_bytes(model, inputs, opt)
        row = {
            "label": label, "model": name, "options": options, "params": sum(p.numel() for p in model.parameters()),
            "param_tensors": n_tensors, "ops": len(g.ops), "kernels": kernels,
            "predicted_s": plan.cost_s, "measured_median_s": med, "measured_min_s": low,
            "measured_s": med if ns.stat == "median" else low,
            "launch_bound": cm.launch_bound(0),
            "before_s": plan_before.cost_s, "adam_per_tensor_s": plan_adam.cost_s,
            "predicted_peak_bytes": int(plan.memory_bytes[0]), "measured_peak_bytes": int(peak),
            "measured_start_bytes": int(start), "predicted_memory_breakdown": dict(plan.memory_breakdown[0]),
        }  # fmt: skip
        feats.append(features(g, th, cm, label, row["measured_s"], dm))
        # the calibration's closed form: = predicted_s less single-tensor Adam's further launches
        row["features_s"] = predict_step_s(dm, feats[-1])
        rows.append(row)
        print(
            f"{label:<18} pred {plan.cost_s * 1e3:8.2f} ms  before {row['before_s'] * 1e3:8.2f} ms  "
            f"measured {med * 1e3:8.2f} ms (min {low * 1e3:.2f})  "
            f"err {100 * (plan.cost_s / row['measured_s'] - 1):+6.1f}%  "
            f"mem {plan.memory_bytes[0] / 1e6:7.2f} / {peak / 1e6:7.2f} MB",
            flush=True,
        )
    meas = [r["measured_s"] for r in rows]
    other = "min" if ns.stat == "median" else "median"
    summary = {
        "step time (profiled model)": prediction_stats([r["predicted_s"] for r in rows], meas),
        f"step time (profiled model) vs the {other} step": prediction_stats(
            [r["predicted_s"] for r in rows], [r[f"measured_{other}_s"] for r in rows]
        ),
        "step time (before: no CPU refinements)": prediction_stats([r["before_s"] for r in rows], meas),
        f"step time (before: no CPU refinements) vs the {other} step": prediction_stats(
            [r["before_s"] for r in rows], [r[f"measured_{other}_s"] for r in rows]
        ),
        "step time (Adam per tensor only)": prediction_stats([r["adam_per_tensor_s"] for r in rows], meas),
        "peak memory": prediction_stats([r["predicted_peak_bytes"] for r in rows], [r["measured_peak_bytes"] for r in rows]),
    }  # fmt: skip
    fitted = None
    if ns.calibrate and len(rows) > 2:
        loo, fitted = loo_calibrated(feats, dm)
        for r, p in zip(rows, loo):
            if math.isfinite(p):
                r["calibrated_loo_s"] = p
        ok = [i for i, p in enumerate(loo) if math.isfinite(p)]
        if len(ok) > 2:
            summary["step time (calibrated, leave-one-out)"] = prediction_stats(
                [loo[i] for i in ok], [meas[i] for i in ok]
            )
            summary["step time (calibrated, leave-one-out)"]["runs"] = len(ok)
        print(f"calibrated on all runs: {fitted} ({len(rows) - len(ok)} leave-one-out fits diverged)")
    print()
    print(f"{'model':<18} {'measured ms':>11} {'pred ms':>8} {'err':>7} {'before':>8} {'err':>7} "
          f"{'LOO cal':>8} {'err':>7} {'pred MB':>8} {'meas MB':>8} {'err':>7}")  # fmt: skip
    for r in rows:
        m = r["measured_s"]
        print(
            f"{r['label']:<18} {m * 1e3:11.2f} {r['predicted_s'] * 1e3:8.2f} {100 * (r['predicted_s'] / m - 1):+6.1f}%"
            f" {r['before_s'] * 1e3:8.2f} {100 * (r['before_s'] / m - 1):+6.1f}%"
            f" {r.get('calibrated_loo_s', math.nan) * 1e3:8.2f} {100 * (r.get('calibrated_loo_s', math.nan) / m - 1):+6.1f}%"
            f" {r['predicted_peak_bytes'] / 1e6:8.2f} {r['measured_peak_bytes'] / 1e6:8.2f}"
            f" {100 * (r['predicted_peak_bytes'] / r['measured_peak_bytes'] - 1):+6.1f}%"
        )
    print()
    for k, s in summary.items():
        print(f"{k}: mean |err| {s['mean_abs_pct']:.1f} %, max {s['max_abs_pct']:.1f} %, "
              f"Pearson {s['pearson']:.3f}, Spearman {s['spearman']:.3f}")  # fmt: skip
    out = {
        "what": "one CPU process: predicted (hapnb.synthesize on a 1-device cluster with the profiled "
        "DeviceModel) vs measured (Adam training steps; peak from torch.profiler CPU allocator events)",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": ns.threads,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "stat": ns.stat,
        "command": "python benchmarks/fidelity_cpu.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "device_model": dm.to_json(),
        "calibrated_device_model": fitted.to_json() if fitted else None,
        "summary": summary,
        "runs": rows,
    }
    if not only:
        Path(ns.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {ns.out}")
    return 0 if all(math.isfinite(r["predicted_s"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
