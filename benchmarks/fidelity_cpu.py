"""Fidelity of the cost model on one CPU process (issue 8, 5(b)): predicted vs measured step time and
peak memory of >= 10 models (zoo models at small sizes and the example factories).

    .venv/bin/python benchmarks/fidelity_cpu.py --calibrate        # the study (~5 min on 2 cores)
    .venv/bin/python benchmarks/fidelity_cpu.py --cluster cpu.json  # a profile from `hapnb profile`

1. The device: ``--rounds`` profiles of this CPU (:func:`hapnb.run.profile.profile_device_model`, one
   torch thread, CPU clock, each timing the fastest of 7 repeats), one per round, interleaved with the
   step timings; the device model is each parameter's median over the rounds. ``--cluster``: the first
   device's model of a cluster JSON instead (no profiling).
2. Per model: ``hapnb.synthesize`` on a one-device cluster carrying that model gives ``cost_s`` (forward,
   backward and Adam step) and the predicted peak memory (``memory_bytes``, with its breakdown).
3. Measured, same process, one torch thread, after ``--warmup`` steps: ``--rounds`` rounds, each of
   ``--steps`` timed steps per model of ``zero_grad(set_to_none); model(*inputs).backward();
   torch.optim.Adam(lr=1e-4).step()``, in round-robin bursts of ``--burst`` steps, so whatever else the
   machine runs hits every model (and the profiles) alike. Each step is timed on the process's CPU clock
   (``time.process_time``: with one thread it is the step's wall time minus the time the process was
   descheduled, so a shared machine's other processes do not add to it; on a quiet machine the two
   agree, and the JSON keeps the wall times too). The study compares with the fastest timed step
   (``--stat min``, the default: the profile's numbers are each the fastest of 7 repeats, so this is
   like for like, and it moves least between runs on a shared machine; ``--stat median``: the median;
   the tables show both). Then one more step under ``torch.profiler`` with
   ``profile_memory=True``: the CPU allocator's events in time order give the peak of live bytes above
   the step's start, to which the bytes live at the start (parameters, Adam states, buffers, inputs:
   unique storages) are added.
4. Variants: "before" is the same profile without the CPU refinements (Adam per tensor; vector, pool and
   scan rates; the conv curve), i.e. the roofline as it was before them; ``--calibrate`` adds
   leave-one-out predictions of the device model fitted to the other runs (``hapnb calibrate``'s fit,
   started from the profile; see docs/benchmarks/fidelity-cpu.md).

Writes ``--out`` (default docs/benchmarks/fidelity-cpu.json) and prints the tables of docs/benchmarks/fidelity-cpu.md, ready to
paste, with the load average before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
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
from hapnb.cost.model import MATMUL_FAMILIES, VECTOR_FAMILIES, CostModel  # noqa: E402
from hapnb.hardware.cluster import Cluster  # noqa: E402
from hapnb.hardware.devices import DeviceModel  # noqa: E402
from hapnb.run.calibrate import RunFeatures, fit_time, predict_step_s, prediction_stats  # noqa: E402
from hapnb.run.profile import profile_device_model  # noqa: E402

_LM = dict(layers=2, hidden=128, heads=4, vocab=1024, seq=64, batch=8, dropout=0.0)
#: (label, zoo name or factory, options): small sizes, one CPU thread takes ~5-400 ms per step
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
#: Device-model fields the CPU refinements set; "before" is the profile with them at their defaults.
REFINEMENTS = dict(optimizer_per_tensor=False, vector_flops=None, pool_flops=None, scan_flops=None,
                   conv_eff=None, conv_half_flops=None)  # fmt: skip


def build(name: str, options: dict[str, Any]) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs, _ = zoo.build(name, devices=1, **options)
    return model, inputs


class Trainer:
    """One model under training: ``step()`` runs one Adam step; ``cpu``/``wall`` collect timed steps."""

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.model, self.inputs = build(name, options)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def step(self, timed: bool = True) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        self.opt.zero_grad(set_to_none=True)
        self.model(*self.inputs).backward()
        self.opt.step()
        if timed:
            self.cpu.append(time.process_time() - c0)
            self.wall.append(time.perf_counter() - w0)


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


def median_model(models: list[DeviceModel]) -> DeviceModel:
    """Each numeric parameter's median over ``models`` (profiles of one device); flags and source from
    the first (None where any round has None)."""
    first = models[0]
    out = {}
    for f in dataclasses.fields(DeviceModel):
        vals = [getattr(m, f.name) for m in models]
        if isinstance(vals[0], (int, float)) and not isinstance(vals[0], bool) and None not in vals:
            out[f.name] = statistics.median(vals)
    src = first.source + (f"; median of {len(models)} profiles" if len(models) > 1 else "")
    return dataclasses.replace(first, **out, source=src)


def features(g: Any, th: Any, cm: CostModel, label: str, measured_s: float, dm: DeviceModel) -> Any:
    """The per-op features :func:`hapnb.run.calibrate.fit_time` fits on (as ``run_features`` reads them
    for zoo LMs, here for any traced model): each op under its first strategy on one device. The fit's
    closed form knows neither the vector rates nor the conv curve, so a vector op's bytes become
    ``max(bytes, flops * bandwidth / rate)`` and a conv's become its profiled time x bandwidth (the same
    time; the fit leaves them as profiled); it charges ``optimizer_kernels`` once per step (foreach),
    which the fit moves freely."""
    rows = []
    for op in g.ops:
        s = th.strategies[op.id][0]
        nbytes, kernels = cm.op_traffic(op.id)
        flops = (s.scaled_flops + s.fixed_flops) * cm.grad_share(op.id)
        rate = dm.vector_rate(op.family) if op.family in VECTOR_FAMILIES else None
        matmul = op.family in MATMUL_FAMILIES
        if rate is not None:
            nbytes = max(nbytes, flops * dm.bandwidth_Bps / rate)
        if op.family == "conv" and dm.conv_eff is not None:
            const, coef = cm.op_linear(op.id, s, 0)
            nbytes, flops, matmul = (const + coef - kernels * dm.kernel_s) * dm.bandwidth_Bps, 0.0, False
        rows.append((flops, nbytes, kernels, op.flops, matmul, op.family == "attention"))
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


def one_cpu(m: DeviceModel) -> Cluster:
    """A one-device cluster whose CPU carries device model ``m``."""
    base = Cluster.parse("1e11")
    return base.replace(
        name="1xCPU (profiled)", devices=(dataclasses.replace(base.devices[0], kind="CPU", model=m),)
    )


def predict(g: Any, m: DeviceModel) -> Any:
    return hapnb.synthesize(g, one_cpu(m), seed_baselines=False, check_memory=False)


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else math.nan


def table(rows: list[dict[str, Any]], summary: dict[str, dict[str, float]], dm: DeviceModel) -> str:
    """The per-model and summary tables of docs/benchmarks/fidelity-cpu.md (Markdown)."""

    def pct(p: float, m: float) -> str:
        return f"{100 * (p / m - 1):+.1f} %" if math.isfinite(p) else "-"

    out = ["| model | params | param tensors | measured ms (median / min; wall median) | predicted ms | err |"
           " before ms | err | calibrated, LOO | err | peak MB measured | predicted | err |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        m, loo = r["measured_s"], r.get("calibrated_loo_s", math.nan)
        out.append(
            f"| {r['label']} | {r['params'] / 1e6:.2f} M | {r['param_tensors']} | "
            f"{r['measured_median_s'] * 1e3:.2f} / {r['measured_min_s'] * 1e3:.2f}; "
            f"{r['measured_wall_median_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} | "
            f"{pct(r['predicted_s'], m)} | {r['before_s'] * 1e3:.2f} | {pct(r['before_s'], m)} | "
            f"{loo * 1e3:.2f} | {pct(loo, m)} | {r['measured_peak_bytes'] / 1e6:.2f} | "
            f"{r['predicted_peak_bytes'] / 1e6:.2f} | {pct(r['predicted_peak_bytes'], r['measured_peak_bytes'])} |"
        )
    out += ["", "| comparison | mean abs % | max abs % | Pearson | Spearman |", "|---|---:|---:|---:|---:|"]
    for k, s in summary.items():
        out.append(f"| {k} | {s['mean_abs_pct']:.1f} | {s['max_abs_pct']:.1f} | {s['pearson']:.3f} | "
                   f"{s['spearman']:.3f} |")  # fmt: skip
    fields = ", ".join(
        f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in dm.to_json().items()
    )
    return "\n".join(out + ["", f"Profiled device model: {fields}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=None, help="a profiled cluster JSON (default: profile each round)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (profile, timed steps of every model)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model per round")
    ap.add_argument("--burst", type=int, default=5, help="consecutive steps of one model (round-robin)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--stat",
        choices=("min", "median"),
        default="min",
        help="the measured step compared (default: fastest)",
    )
    ap.add_argument("--calibrate", action="store_true", help="also fit the device model, leave-one-out")
    ap.add_argument("--only", default=None, help="comma-separated labels to run (default: all; no JSON)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "fidelity-cpu.json"))
    ns = ap.parse_args(argv)
    if ns.rounds < 1 or ns.steps < 1 or ns.burst < 1:
        raise SystemExit("--rounds, --steps and --burst must be >= 1")
    torch.set_num_threads(1)
    t_start, load_before = time.perf_counter(), _load()
    only = set(ns.only.split(",")) if ns.only else None
    chosen = [(label, name, opts) for label, name, opts in MODELS if not only or label in only]
    trainers = {label: Trainer(name, opts) for label, name, opts in chosen}
    for tr in trainers.values():
        for _ in range(ns.warmup):
            tr.step(timed=False)
    profiles: list[DeviceModel] = []
    fixed = None
    if ns.cluster:
        fixed = Cluster.load(ns.cluster).devices[0].model
        if fixed is None:
            raise SystemExit(f"{ns.cluster}: its first device has no device model; run `hapnb profile`")
    loads = []
    for rnd in range(ns.rounds):
        loads.append(_load())
        if fixed is None:
            profiles.append(profile_device_model("cpu", threads=1).model)
            print(f"round {rnd + 1}: {profiles[-1]}", flush=True)
        first = {label: len(tr.cpu) for label, tr in trainers.items()}
        while any(len(tr.cpu) - first[label] < ns.steps for label, tr in trainers.items()):
            for label, tr in trainers.items():
                for _ in range(min(ns.burst, ns.steps - (len(tr.cpu) - first[label]))):
                    tr.step()
    loads.append(_load())
    dm = fixed or median_model(profiles)
    print(f"device model: {dm}")
    before = dataclasses.replace(dm, **REFINEMENTS)
    rows, feats = [], []
    per_round: list[list[tuple[float, float]]] = [[] for _ in profiles]
    for label, name, options in chosen:
        tr = trainers[label]
        model, inputs = build(name, options)  # traced on fresh weights
        g = hapnb.trace(model, inputs)
        th = hapnb.theory(g)
        plan, plan_before = predict(g, dm), predict(g, before)
        cm = CostModel(th, one_cpu(dm))
        peak, start = measure_peak_bytes(tr.model, tr.inputs, tr.opt)
        med, low = statistics.median(tr.cpu), min(tr.cpu)
        row = {
            "label": label, "model": name, "options": options, "params": sum(p.numel() for p in model.parameters()),
            "param_tensors": sum(1 for t in g.tensors if t.role == "param"), "ops": len(g.ops),
            "kernels": sum(cm.op_traffic(op.id)[1] for op in g.ops),
            "predicted_s": plan.cost_s, "measured_median_s": med, "measured_min_s": low,
            "measured_s": med if ns.stat == "median" else low,
            "measured_wall_median_s": statistics.median(tr.wall), "measured_wall_min_s": min(tr.wall),
            "measured_cpu_s": tr.cpu, "before_s": plan_before.cost_s,
            "predicted_peak_bytes": int(plan.memory_bytes[0]), "measured_peak_bytes": int(peak),
            "measured_start_bytes": int(start), "predicted_memory_breakdown": dict(plan.memory_breakdown[0]),
        }  # fmt: skip
        for k, m in enumerate(profiles):  # each round's own profile against that round's steps
            mine = tr.cpu[k * ns.steps : (k + 1) * ns.steps]
            per_round[k].append(
                (predict(g, m).cost_s, min(mine) if ns.stat == "min" else statistics.median(mine))
            )
        feats.append(features(g, th, cm, label, row["measured_s"], dm))
        rows.append(row)
        print(
            f"{label:<18} pred {plan.cost_s * 1e3:8.2f} ms  before {row['before_s'] * 1e3:8.2f} ms  measured "
            f"{med * 1e3:8.2f} ms (min {low * 1e3:.2f}, wall {row['measured_wall_median_s'] * 1e3:.2f})  "
            f"err {100 * (plan.cost_s / row['measured_s'] - 1):+6.1f}%  "
            f"mem {plan.memory_bytes[0] / 1e6:7.2f} / {peak / 1e6:7.2f} MB",
            flush=True,
        )
    meas = [r["measured_s"] for r in rows]
    other = "min" if ns.stat == "median" else "median"
    name = {"min": "fastest", "median": "median"}
    summary = {
        f"step time (profiled model) vs the {name[ns.stat]} step": prediction_stats(
            [r["predicted_s"] for r in rows], meas
        ),
        f"step time (profiled model) vs the {name[other]} step": prediction_stats(
            [r["predicted_s"] for r in rows], [r[f"measured_{other}_s"] for r in rows]
        ),
        "step time (profiled model) vs the wall-clock median": prediction_stats(
            [r["predicted_s"] for r in rows], [r["measured_wall_median_s"] for r in rows]
        ),
        "step time (before: no CPU refinements)": prediction_stats([r["before_s"] for r in rows], meas),
        "peak memory": prediction_stats([r["predicted_peak_bytes"] for r in rows], [r["measured_peak_bytes"] for r in rows]),
    }  # fmt: skip
    for k, pairs in enumerate(per_round):
        summary[f"step time, round {k + 1} alone (its profile, its steps)"] = prediction_stats(
            [p for p, _ in pairs], [m for _, m in pairs]
        )
    fitted = None
    if ns.calibrate and len(rows) > 2:
        loo, fitted = loo_calibrated(feats, dm)
        for r, p in zip(rows, loo):
            if math.isfinite(p):
                r["calibrated_loo_s"] = p
        ok = [i for i, p in enumerate(loo) if math.isfinite(p)]
        if len(ok) > 2:
            key = "step time (calibrated, leave-one-out)"
            summary[key] = prediction_stats([loo[i] for i in ok], [meas[i] for i in ok])
            summary[key]["runs"] = len(ok)
        print(f"calibrated on all runs: {fitted} ({len(rows) - len(ok)} leave-one-out fits diverged)")
    minutes = (time.perf_counter() - t_start) / 60
    print()
    print(table(rows, summary, dm))
    print(f"\nload average (1 min) before {load_before:.2f}, at each round {', '.join(f'{x:.2f}' for x in loads)}; "
          f"{minutes:.1f} min")  # fmt: skip
    out = {
        "what": "one CPU process: predicted (hapnb.synthesize on a 1-device cluster with the profiled "
        "DeviceModel, the median of the rounds' profiles) vs measured (Adam training steps, process CPU "
        "time, round-robin over the models; peak from torch.profiler CPU allocator events)",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": 1,
        "rounds": ns.rounds,
        "steps": ns.steps,
        "burst": ns.burst,
        "warmup": ns.warmup,
        "stat": ns.stat,
        "clock": "process CPU time (time.process_time)",
        "load_average": {"before": load_before, "rounds": loads},
        "minutes": minutes,
        "cores": os.cpu_count(),
        "command": "python benchmarks/fidelity_cpu.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "device_model": dm.to_json(),
        "round_device_models": [m.to_json() for m in profiles],
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
