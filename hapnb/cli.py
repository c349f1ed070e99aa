"""The ``hapnb`` command line (docs/architecture.md §4): plan, compare, pipeline, simulate, verify, launch, profile,
calibrate, theory, demo.

Every subcommand's argument parsing lives here; the library modules it calls take plain Python
arguments. Flags and JSON keys are a stable contract; ``python -m hapnb`` is the same program.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "run", "build_parser"]

DEMO_MODEL = "bert"
DEMO_CLUSTER = "paper-hetero-8"


def _model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        help="zoo model (mlp, vgg19, vit, bert, bert-moe, gpt, lm) or pkg.mod:factory",
    )
    p.add_argument("--layers", type=int, help="number of layers (zoo models)")
    p.add_argument("--batch", type=int, help="global batch size (default 32 per device)")
    p.add_argument("--seq", type=int, help="sequence length (language models)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="other model options, e.g. --set hidden=64 --set heads=4 (repeatable)",
    )


def _cluster_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--cluster", required=required, help="preset name, cluster JSON path, or inline like 2xV100+6xP100"
    )


def _pin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME=FORM",
        help="pin a tensor's form, e.g. --pin layers.0.fc1.weight=G1 (I, R, Gd, Shard(d), Replicate), or a "
        "parameter's storage: zero3(d) / fsdp(d) (sharded, gathered before each use) or zero2(d)",
    )
    p.add_argument("--ratios", help="fixed ratios r1,r2,... (one per device; no LP)")
    p.add_argument(
        "--ratio-pin",
        action="append",
        default=[],
        metavar="DEVICE=VALUE|LO:HI",
        help="pin a device's ratio or bound it, e.g. --ratio-pin v100-0=0.3 --ratio-pin p100-1=0.05:0.2",
    )


def _pick_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pick",
        choices=["simulated", "cost"],
        default="simulated",
        help="the final program: the fastest simulated candidate (default), or the stage-model optimum as "
        "HAP picks it (paper comparisons)",
    )


def _runtime_args(p: argparse.ArgumentParser) -> None:
    """How the ranks synchronise gradients and run duplex plans (``hapnb verify`` and ``hapnb launch``)."""
    p.add_argument(
        "--grad-sync",
        choices=["buckets", "sync"],
        default="buckets",
        help="replicated gradients: DDP-like async buckets during the backward (default) or one blocking "
        "all-reduce each inside autograd",
    )
    p.add_argument("--bucket-cap-bytes", type=int, default=None, help="gradient bucket size (default 25 MiB)")
    p.add_argument(
        "--first-bucket-cap-bytes", type=int, default=None, help="the first bucket's size (default 1 MiB)"
    )
    p.add_argument(
        "--no-interleave",
        action="store_true",
        help="duplex plans: run the two micro-batches one after the other instead of interleaved",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where each rank's tensors live: auto = nccl on the rank's GPU, gloo on the CPU; cuda with "
        "gloo runs several ranks on one machine's GPUs (rank r on GPU r mod count)",
    )


def _runtime_argv(ns: argparse.Namespace) -> list[str]:
    """The worker arguments of :func:`_runtime_args`' flags (only those not at their defaults)."""
    from .run.worker import runtime_argv

    return runtime_argv(
        ns.grad_sync, ns.bucket_cap_bytes, ns.first_bucket_cap_bytes, not ns.no_interleave, ns.device
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hapnb",
        description="Synthesize, explain, verify and launch SPMD training "
        "programs for heterogeneous GPU clusters (HAP).",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    _plan_commands(sub)
    _run_commands(sub)
    _tool_commands(sub)
    return ap


def _plan_commands(sub: Any) -> None:
    """The subcommands plan, compare, pipeline, simulate: making and reading plans."""
    p = sub.add_parser("plan", help="synthesize a plan")
    _model_args(p)
    _cluster_args(p)
    _pin_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--report", help="write an HTML report (plan, stages, Gantt, search stats)")
    p.add_argument("--no-baselines", action="store_true", help="skip the DP-EV/DP-CP baselines")
    p.add_argument(
        "--duplex",
        action="store_true",
        help="HiDup's duplex schedule: two micro-batches, one computing while the other communicates",
    )
    _pick_arg(p)

    p = sub.add_parser("compare", help="one cost model, all strategies")
    _model_args(p)
    _cluster_args(p)
    p.add_argument("--json", action="store_true", help="print {strategy: iteration_s} (the stage model)")
    p.add_argument(
        "--simulated",
        action="store_true",
        help="with --json: {strategy: simulated_s} (the overlap simulator; a pipeline's schedule simulation)",
    )
    p.add_argument(
        "--detail",
        action="store_true",
        help="with --json: the whole table (times on both clocks, memory per device, fits, notes)",
    )
    p.add_argument(
        "--strategies",
        metavar="A,B,...",
        help="the strategies to compare (default all): hap, dp_ev, dp_cp, tp, ep, fsdp, pipeline",
    )
    p.add_argument("--duplex", action="store_true", help="HAP's plan with the duplex schedule")
    _pick_arg(p)

    p = sub.add_parser("pipeline", help="plan a heterogeneous pipeline (Ditto: node folding + DP recovery)")
    _model_args(p)
    _cluster_args(p)
    p.add_argument("--micro-batches", type=int, help="micro-batches per batch (default: micro-batches of 4)")
    p.add_argument("--schedule", choices=["1F1B", "GPipe"], default="1F1B")
    p.add_argument(
        "--method",
        choices=["dp", "greedy", "exhaustive"],
        default="dp",
        help="the plan to return: Ditto's DP recovery (default), its greedy recovery, or the exhaustive search",
    )
    p.add_argument(
        "--exhaustive",
        action="store_true",
        help="also run the exhaustive search (exhaustive_iteration_s, exhaustive_planning_s)",
    )
    p.add_argument(
        "--budget", type=float, default=60.0, help="seconds the exhaustive search may run (default 60)"
    )
    p.add_argument(
        "--no-prune",
        action="store_true",
        help="exhaustive search without branch and bound (Ditto's reference as published; slow)",
    )
    p.add_argument(
        "--fold",
        choices=["plain", "comm"],
        default="plain",
        help="node folding without or with communication",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", help="write the pipeline plan JSON here")

    p = sub.add_parser("simulate", help="timeline of a plan per device (overlap simulator)")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true", help="print one JSON object (iteration_s, devices, spans)")
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="stage-synchronous: every collective blocks, stage by stage (reproduces the plan's cost_s)",
    )
    p.add_argument("--no-sharing", action="store_true", help="concurrent collectives do not share bandwidth")
    p.add_argument(
        "--slowdown",
        type=float,
        default=None,
        metavar="GAMMA",
        help="compute runs 1/(1+GAMMA) as fast beside communication (default: the device model's, else 0.1)",
    )
    p.add_argument("--gantt", metavar="HTML", help="write the simulated Gantt chart (bokeh) here")


def _run_commands(sub: Any) -> None:
    """The subcommands verify, launch, profile, calibrate: running plans on ranks and measuring devices."""
    p = sub.add_parser("verify", help="run the plan on local ranks and compare with one device")
    p.add_argument("--plan", help="a plan JSON, SPMD or pipeline (the plan records how to rebuild its model)")
    _model_args(p, required=False)
    _cluster_args(p, required=False)
    _pin_args(p)
    p.add_argument("--nproc", type=int, help="number of local ranks (= devices of the plan)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument(
        "--timeout", type=float, default=None, help="limit on the whole run in seconds (default: none)"
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=300.0,
        help="the ranks are stuck when none reports progress for this many seconds (default 300)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--duplex", action="store_true", help="with --model: synthesize a duplex plan (HiDup)")
    _runtime_args(p)

    from .run.launch import BACKENDS

    p = sub.add_parser("launch", help="launch a plan or bundle on local ranks (or print multi-node commands)")
    p.add_argument(
        "plan", metavar="PLAN_OR_BUNDLE", help="a plan JSON file (SPMD or pipeline) or a bundle directory"
    )
    p.add_argument("--nproc", type=int, default=None, help="ranks on this node (default: the plan's)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv", metavar="HOST:PORT", default=None, help="node 0's address and a free port")
    p.add_argument("--print-commands", action="store_true", help="print one torchrun command per node")
    p.add_argument("--slurm", action="store_true", help="print an sbatch script (srun + torchrun)")
    p.add_argument("--bundle-dir", default=None, help="where to write the bundle of a plan JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the ranks may go without progress")
    p.add_argument("--wall-timeout", type=float, default=None, help="limit on the whole run (s)")
    p.add_argument("--worker", default="hapnb.run.worker", help="worker module (or a .py file)")
    p.add_argument("--json", action="store_true", help="print raw JSON lines and a JSON summary")
    _runtime_args(p)

    p = sub.add_parser("profile", help="profile devices and collectives -> cluster JSON")
    p.add_argument("--nproc", type=int, default=None, help="local ranks (default: GPUs, else 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("-o", "--output", default=None, help="write the cluster JSON here (else print it)")
    p.add_argument("--quick", action="store_true", help="smaller benchmark, fewer sizes and repeats")
    p.add_argument("--name", default=None, help="cluster name")
    p.add_argument(
        "--sizes", type=_sizes, default=None, help="comma-separated full-tensor sizes, e.g. 64K,1M,16M"
    )
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="limit for the collective runs (s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per CPU rank (cores/nproc)")

    p = sub.add_parser(
        "calibrate",
        help="launch a plan briefly and compare predicted vs measured time, or (--measured) fit a "
        "device model to measured training steps",
    )
    p.add_argument("plan", metavar="PLAN_OR_BUNDLE", nargs="?", help="a plan JSON file or a bundle directory")
    p.add_argument(
        "--measured",
        metavar="RUNS_JSON",
        nargs="?",
        const="shipped",
        help="fit the device model of --kind to these measured runs; without a path (or 'shipped'): the "
        "12 H100 runs that ship with hapnb (hapnb/data/h100-lm-steps.json, also the format of a runs file)",
    )
    p.add_argument("--kind", default="H100", help="device kind to fit (with --measured)")
    p.add_argument("-o", "--output", help="write the fitted one-device cluster JSON here (with --measured)")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out fits (with --measured)")
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the median")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the ranks may go without progress")
    p.add_argument("--worker", default="hapnb.run.worker", help="worker module (or a .py file)")
    p.add_argument("--json", action="store_true")


def _tool_commands(sub: Any) -> None:
    """The subcommands theory (the rules), demo (the main job)."""
    p = sub.add_parser(
        "theory",
        help="list or check the rules; --coverage: a model's ops by rule source",
        description="`hapnb theory [OP ...]` lists the rule tables (only OPs matching the names given); "
        "`--check [OP ...]` checks them against ground truth; `--coverage --model M` lists every op of a "
        "model by rule source (hand, decomposed, discovered, none).",
    )
    p.add_argument("--check", action="store_true", help="check the rules against ground truth")
    p.add_argument("--coverage", action="store_true", help="the ops of --model by rule source")
    p.add_argument("--model", default=None, help="zoo name or package.module:factory (with --coverage)")
    p.add_argument("--layers", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    p.add_argument("ops", nargs="*", help="op names to list or check (e.g. linear sdpa)")

    p = sub.add_parser("demo", help="the main job: plan BERT on a heterogeneous preset, report, verify")
    p.add_argument("--report", default="hapnb-demo-report.html")
    p.add_argument("--no-verify", action="store_true")


def _options(ns: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for k in ("layers", "batch", "seq"):
        v = getattr(ns, k, None)
        if v is not None:
            opts[k] = v
    for item in getattr(ns, "set", []) or []:
        if "=" not in item:
            raise SystemExit(f"hapnb: --set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        opts[k.strip()] = _value(v.strip())
    return opts


def _value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def _pins(ns: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from .ir.forms import parse_pin

    pins = {}
    for item in ns.pin or []:
        if "=" not in item:
            raise SystemExit(f"hapnb: --pin {item!r}: expected NAME=FORM, e.g. layers.0.fc1.weight=G1")
        k, v = item.rsplit("=", 1)
        try:
            pins[k] = parse_pin(v)
        except ValueError as e:
            raise SystemExit(f"hapnb: --pin {item!r}: {e}") from None
    ratios: Any = None
    if ns.ratios:
        ratios = [float(x) for x in ns.ratios.split(",")]
    if ns.ratio_pin:
        if ratios is not None:
            raise SystemExit("hapnb: use either --ratios (fixed) or --ratio-pin (bounds), not both")
        ratios = {}
        for item in ns.ratio_pin:
            k, v = item.split("=", 1)
            ratios[k] = tuple(float(x) for x in v.split(":")) if ":" in v else float(v)
    return pins, ratios


def _synthesize(ns: argparse.Namespace) -> tuple[Any, Any, float]:
    from .hardware.cluster import Cluster
    from .plans.synthesis import synthesize

    c = Cluster.resolve(ns.cluster)
    pins, ratios = _pins(ns) if hasattr(ns, "pin") else ({}, None)
    duplex = bool(getattr(ns, "duplex", False))
    pick = getattr(ns, "pick", "simulated")
    plan = synthesize(ns.model, c, pins=pins, ratios=ratios, duplex=duplex, pick=pick, **_options(ns))
    return plan, c, plan.synthesis_s


def cmd_plan(ns: argparse.Namespace) -> int:
    from .plans.synthesis import baselines

    plan, c, synth_s = _synthesize(ns)
    t_done = time.perf_counter()
    base = {} if ns.no_baselines else baselines(plan.graph, c)
    if ns.output:
        plan.save(ns.output)
    if ns.report:
        from . import display
        from .plans.simulation import simulate

        timeline = simulate(plan) if plan.costed else None
        Path(ns.report).write_text(display.report_html(plan, baselines=base, timeline=timeline))
    if ns.json:
        out = {
            "cost_s": plan.cost_s,
            "lower_bound_s": plan.lower_bound_s,
            "synthesis_s": synth_s,
            "expansions": plan.stats.get("expansions", 0),
            "optimal": plan.stats.get("optimal"),  # every search proved its program optimal
            "optimal_gap": plan.stats.get("gap", 0.0),  # else: how far the best may be from the A* bound
            "iterations": len(plan.history),
            "ratios": [list(r) for r in plan.ratios],
            "program": [str(i) for i in plan.program],
            "stages": len(plan.stages),
            "baselines": {k: v.cost_s for k, v in base.items() if k in ("dp_ev", "dp_cp")},
            "devices": list(plan.devices),
            "memory_bytes": list(plan.memory_bytes),  # predicted peak per device (breakdown in the plan file)
            "simulated_s": plan.simulated_s,  # the overlap simulator's iteration time (hapnb.simulate)
            "duplex": plan.duplex,
            "baselines_simulated_s": {k: v.simulated_s for k, v in base.items() if k in ("dp_ev", "dp_cp")},
            "baselines_unavailable": dict(getattr(base, "unavailable", {})),  # {name: why}
            "fallback_ops": [list(p) for p in plan.fallback_ops],  # [op, target]: no rule, run replicated
        }
        # where the command's time went (benchmarks/command.py): building and tracing the model (0 build
        # when the trace cache had it), synthesis (search_s and balance_s of it), and after synthesis
        phases = {k: plan.stats[k] for k in ("build_s", "trace_s", "trace_path", "search_s", "balance_s")
                  if k in plan.stats}  # fmt: skip
        out["phases"] = {**phases, "synthesis_s": synth_s, "after_s": time.perf_counter() - t_done}
        print(json.dumps(out))
    else:
        print(plan.summary())
        for k, v in base.items():
            print(
                f"  baseline {k}: {v.cost_s * 1e3:.3f} ms ({v.cost_s / plan.cost_s:.2f}x the plan); simulated "
                f"{v.simulated_s * 1e3:.3f} ms ({v.simulated_s / plan.simulated_s:.2f}x the plan's)"
            )
        for k, why in getattr(base, "unavailable", {}).items():
            print(f"  baseline {k}: not available: {why}")
        if ns.output:
            print(f"  plan written to {ns.output}")
        if ns.report:
            print(f"  report written to {ns.report}")
    return 0


def cmd_compare(ns: argparse.Namespace) -> int:
    from .plans.comparison import compare

    cmp = compare(
        ns.model, ns.cluster, strategies=ns.strategies, pick=ns.pick, duplex=ns.duplex, **_options(ns)
    )
    if ns.json:
        out = cmp.to_json() if ns.detail else cmp.times("simulated" if ns.simulated else "stage")
        print(json.dumps(out))
    else:
        print(cmp)
    return 0


def cmd_pipeline(ns: argparse.Namespace) -> int:
    from .pipelines.planner import pipeline, plan_json_summary

    plan = pipeline(
        ns.model,
        ns.cluster,
        micro_batches=ns.micro_batches,
        schedule=ns.schedule,
        method=ns.method,
        exhaustive_search=ns.exhaustive,
        budget_s=ns.budget,
        prune=not ns.no_prune,
        fold_comm=ns.fold == "comm",
        **_options(ns),
    )
    if ns.output:
        plan.save(ns.output)
    if ns.json:
        print(json.dumps(plan_json_summary(plan)))
        return 0
    print(plan)
    st = plan.stats
    for k in ("dp", "greedy"):
        if f"{k}_iteration_s" in st:
            print(
                f"  {k} recovery: {st[f'{k}_iteration_s'] * 1e3:.3f} ms, planned in {st[f'{k}_planning_s']:.3f} s"
            )
    ex = st.get("exhaustive")
    if ex is not None:
        state = (
            "optimal"
            if ex["finished"]
            else f"stopped at unit {ex['stopped_at']} after {ex['planning_s']:.1f} s"
        )
        t = ex["iteration_s"]
        print(
            f"  exhaustive: {'-' if t is None else f'{t * 1e3:.3f} ms'} ({state}; full unpruned run "
            f"~{ex['extrapolated_s']:.3g} s)"
        )
    print(f"  layer costs in {st['costs_s']:.2f} s ({st['costs_source']})")
    if ns.output:
        print(f"  pipeline plan written to {ns.output}")
    return 0


def cmd_simulate(ns: argparse.Namespace) -> int:
    from .plans.plan import Plan
    from .plans.simulation import simulate

    tl = simulate(
        Plan.load(ns.plan),
        overlap=not ns.no_overlap,
        bandwidth_sharing=not ns.no_sharing,
        slowdown=ns.slowdown,
    )
    if ns.gantt:
        from bokeh.embed import file_html
        from bokeh.resources import INLINE

        Path(ns.gantt).write_text(
            file_html(tl.gantt(), resources=INLINE, title=f"hapnb simulated: {tl.plan_name}")
        )
    if ns.json:
        print(json.dumps(tl.to_json()))
    else:
        print(tl)
    return 0


class _VerifyProgress:
    """``hapnb verify``'s progress lines on stderr: each phase (of each step) when the first rank enters
    it, each step when every rank has finished it, and the single-device run's steps."""

    def __init__(self, nproc: int, steps: int) -> None:
        self.nproc, self.steps = nproc, steps
        self.t0 = time.monotonic()
        self.seen: set[tuple[Any, ...]] = set()
        self.done: dict[Any, set[Any]] = {}

    def __call__(self, ev: dict[str, Any]) -> None:
        step, phase = ev.get("step"), ev.get("phase")
        if phase == "reference":
            self._say(f"single-device run: step {step + 1}/{self.steps}")
        elif phase is not None:
            key = (phase, step)
            if key not in self.seen:
                self.seen.add(key)
                self._say(f"ranks: {phase}" if step is None else f"step {step + 1}/{self.steps}: {phase}")
        elif step is not None:
            ranks = self.done.setdefault(step, set())
            ranks.add(ev.get("rank"))
            if len(ranks) == self.nproc:
                self._say(f"step {step + 1}/{self.steps} done on all {self.nproc} ranks")

    def _say(self, text: str) -> None:
        print(f"hapnb verify: [{time.monotonic() - self.t0:6.1f} s] {text}", file=sys.stderr, flush=True)


def cmd_verify(ns: argparse.Namespace) -> int:
    from .pipelines import PipelinePlan, is_pipeline_json
    from .plans.plan import Plan
    from .run.bundle import BundleError
    from .run.pipelined import PipelineError
    from .run.verify import VerifyError, verify
    from .runtime.program import CodegenError

    if ns.plan:
        pipeline = is_pipeline_json(_read_json(ns.plan))
        plan: Any = PipelinePlan.load(ns.plan) if pipeline else Plan.load(ns.plan)
    elif ns.model and ns.cluster:
        plan, _, _ = _synthesize(ns)
    else:
        raise SystemExit("hapnb verify: give --plan PLAN, or --model NAME and --cluster SPEC")
    nproc = ns.nproc or (len(plan.devices) if isinstance(plan, PipelinePlan) else plan.cluster.gpus)
    try:
        rep = verify(
            plan,
            nproc=nproc,
            steps=ns.steps,
            backend=ns.backend,
            dtype=ns.dtype,
            timeout=ns.timeout,
            stall_timeout=ns.stall_timeout,
            progress=None if ns.quiet else _VerifyProgress(nproc, ns.steps),
            grad_sync=ns.grad_sync,
            bucket_cap=ns.bucket_cap_bytes,
            first_bucket_cap=ns.first_bucket_cap_bytes,
            interleave=not ns.no_interleave,
            device=ns.device,
        )
    except (VerifyError, BundleError, CodegenError, PipelineError) as e:
        print(f"hapnb verify: {e}", file=sys.stderr)
        return 1
    print(rep)
    return 0 if rep.ok else 1


def _read_json(path: str) -> Any:
    """The JSON in ``path`` (None when unreadable: the plan loader then says why)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _worker_argv(worker: str) -> tuple[str, ...]:
    """``--worker``: a module name (run with ``-m``) or a ``.py`` file."""
    return (worker,) if worker.endswith(".py") else ("-m", worker)


def _format_metric(m: dict[str, Any]) -> str:
    parts = [f"rank {m.get('rank', '?')}", f"step {m.get('step', '?')}"]
    if "stage" in m:  # a pipeline plan's rank
        parts.insert(1, f"stage {m['stage']}")
    for key, label in (("loss", "loss"), ("global_loss", "global")):
        if isinstance(m.get(key), (int, float)):
            parts.append(f"{label} {m[key]:.6g}")
    if isinstance(m.get("step_s"), (int, float)):
        parts.append(f"{m['step_s'] * 1e3:.2f} ms")
    if isinstance(m.get("max_memory_bytes"), (int, float)):
        parts.append(f"mem {m['max_memory_bytes'] / 2**20:.1f} MiB")
    return "  ".join(parts)


def _print_commands(ns: argparse.Namespace, backend: str, worker: tuple[str, ...]) -> int:
    from .run.launch import launch_commands, plan_bundle, slurm_script, worker_for

    src = Path(ns.plan)
    worker = worker_for(src, worker)  # a pipeline plan runs hapnb.run.pipelined
    target = (Path(ns.bundle_dir) if ns.bundle_dir else src.with_suffix(".bundle")) if src.is_file() else None
    bundle, devices = plan_bundle(src, target)
    per_node = ns.nproc or (devices // ns.nnodes if devices else None)
    if not per_node:
        print("hapnb launch: pass --nproc (cannot read the plan's device count)", file=sys.stderr)
        return 2
    if ns.slurm:
        print(
            slurm_script(
                bundle,
                ns.nnodes,
                per_node,
                steps=ns.steps,
                backend=backend,
                worker=worker,
                extra_args=_runtime_argv(ns),
            )
        )
    else:
        rdzv = ns.rdzv if (ns.rdzv or ns.nnodes == 1) else "NODE0_HOST:29500"
        for cmd in launch_commands(
            bundle,
            ns.nnodes,
            per_node,
            rdzv,
            steps=ns.steps,
            backend=backend,
            worker=worker,
            extra_args=_runtime_argv(ns),
        ):
            print(cmd)
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    from .run.launch import default_backend, launch

    backend = ns.backend or default_backend()
    worker = _worker_argv(ns.worker)
    if ns.print_commands or ns.slurm:
        return _print_commands(ns, backend, worker)
    try:
        job = launch(
            ns.plan,
            ns.nproc,
            backend,
            ns.steps,
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            rdzv=ns.rdzv,
            timeout_s=ns.timeout,
            wall_timeout_s=ns.wall_timeout,
            worker=worker,
            extra_args=_runtime_argv(ns),
            bundle_dir=ns.bundle_dir,
        )
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"hapnb launch: {e}", file=sys.stderr)
        return 2
    with job:
        for m in job.metrics():
            print(json.dumps(m) if ns.json else _format_metric(m), flush=True)
        result = job.wait()
    if ns.json:
        keys = {"ok": result.ok, "returncode": result.returncode, "median_step_s": result.median_step_s}
        keys.update(final_loss=result.final_loss, steps=len(result.step_times(0)), wall_s=result.wall_s)
        print(json.dumps({**keys, "error": result.error}))
    else:
        print(result.summary())
    if not result.ok:
        print(f"hapnb launch: {result.error}", file=sys.stderr)
        return result.returncode or 1
    return 0


def _sizes(text: str) -> list[int]:
    """``--sizes 64K,1M,16M`` -> bytes."""
    out = []
    for item in text.split(","):
        t = item.strip().upper().removesuffix("B").removesuffix("I")
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
        try:
            out.append(int(float(t[:-1] if mult > 1 else t) * mult))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad size {item!r}; write bytes like 65536, 64K or 4M"
            ) from None
    return out


def cmd_profile(ns: argparse.Namespace) -> int:
    from .run.profile import ProfileError, profile_cluster

    try:
        cluster = profile_cluster(
            ns.nproc,
            ns.backend,
            ns.name,
            quick=ns.quick,
            sizes=ns.sizes,
            repeats=ns.repeats,
            timeout_s=ns.timeout,
            threads=ns.threads,
        )
    except (ProfileError, ValueError) as e:
        print(f"hapnb profile: {e}", file=sys.stderr)
        return 1
    if ns.output:
        cluster.save(ns.output)
        print(cluster)
        for kind, c in cluster.collectives:
            print(f"  {kind}: {c}")
        print(f"wrote {ns.output}")
    else:
        print(json.dumps(cluster.to_json(), indent=2))
    return 0


def cmd_calibrate(ns: argparse.Namespace) -> int:
    from .run.calibrate import calibrate_launch, fit_device_model
    from .run.launch import LaunchError, default_backend

    if ns.measured:
        try:
            fit = fit_device_model(ns.measured, ns.kind, loo=not ns.no_loo)
        except (ValueError, FileNotFoundError) as e:
            print(f"hapnb calibrate: {e}", file=sys.stderr)
            return 2
        if ns.output:
            fit.cluster().save(ns.output)
        print(json.dumps(fit.to_json()) if ns.json else fit.summary())
        if ns.output and not ns.json:
            print(f"wrote {ns.output}")
        return 0
    if not ns.plan:
        print(
            "hapnb calibrate: give a plan (or bundle) to launch, or --measured [RUNS_JSON] to fit",
            file=sys.stderr,
        )
        return 2
    try:
        report = calibrate_launch(
            ns.plan,
            ns.nproc,
            ns.backend or default_backend(),
            ns.steps,
            warmup=ns.warmup,
            timeout_s=ns.timeout,
            worker=_worker_argv(ns.worker),
        )
    except LaunchError as e:
        print(f"hapnb calibrate: {e}", file=sys.stderr)
        return (e.result.returncode if e.result is not None else 0) or 1
    except (ValueError, FileNotFoundError) as e:
        print(f"hapnb calibrate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json()) if ns.json else report.summary())
    return 0


def cmd_theory(ns: argparse.Namespace) -> int:
    from . import rules

    if ns.coverage:
        return _coverage(ns)
    if ns.check:
        return rules.main(["--check", *ns.ops])
    table = rules.registered()
    rows = [(t, fam, why) for t, (fam, why) in table.items() if not ns.ops or any(o in t for o in ns.ops)]
    if not rows:
        print(f"hapnb theory: no rule matches {' '.join(ns.ops)} (`hapnb theory` lists all)", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps({t: {"family": fam, "reason": why} for t, fam, why in rows}))
    else:
        for t, fam, why in rows:
            print(f"{fam:14s} {t:44s} {why}")
    return 0


def _coverage(ns: argparse.Namespace) -> int:
    from .hardware.cluster import Cluster
    from .tracing import resolve_model
    from .triples import coverage, theory

    if not ns.model:
        print(
            "hapnb theory --coverage: needs --model NAME (a zoo name or package.module:factory)",
            file=sys.stderr,
        )
        return 2
    g, _ = resolve_model(ns.model, Cluster.parse("2xV100"), **_options(ns))
    cov = coverage(theory(g))
    print(json.dumps(cov.to_json()) if ns.json else cov.summary())
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    from . import display
    from .hardware.cluster import Cluster
    from .plans.synthesis import baselines, synthesize

    c = Cluster.preset(DEMO_CLUSTER)
    print(
        f"hapnb demo: planning {DEMO_MODEL} (paper configuration: 12 layers, hidden 768, seq 128, batch "
        f"{32 * c.n}) on {DEMO_CLUSTER}: {c}"
    )
    t0 = time.perf_counter()
    plan = synthesize(DEMO_MODEL, c)
    print(f"(trace + synthesis {time.perf_counter() - t0:.1f} s)")
    print(plan.summary())
    base = baselines(plan.graph, c)
    for k, v in base.items():
        print(
            f"  baseline {k}: {v.cost_s * 1e3:.3f} ms -> the plan is {v.cost_s / plan.cost_s:.2f}x faster; "
            f"simulated with overlap {v.simulated_s * 1e3:.3f} ms -> {v.simulated_s / plan.simulated_s:.2f}x"
        )
    from .plans.simulation import simulate

    Path(ns.report).write_text(display.report_html(plan, baselines=base, timeline=simulate(plan)))
    print(f"report written to {ns.report}")
    if ns.no_verify:
        return 0
    from .run.verify import verify

    small = Cluster.parse("1xV100+3xP100")
    print(
        f"\nverifying a small {DEMO_MODEL} (2 layers, hidden 32) planned on {small} against one device "
        "(4 local gloo ranks, float64)..."
    )
    splan = synthesize(DEMO_MODEL, small, layers=2, hidden=32, heads=4, seq=16, vocab=128, batch=8)
    rep = verify(splan, nproc=small.n, steps=2)
    print(rep)
    return 0 if rep.ok else 1


COMMANDS = {
    "plan": cmd_plan, "compare": cmd_compare, "simulate": cmd_simulate, "verify": cmd_verify,
    "launch": cmd_launch, "profile": cmd_profile, "calibrate": cmd_calibrate, "theory": cmd_theory,
    "demo": cmd_demo,
    "pipeline": cmd_pipeline,
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return COMMANDS[ns.command](ns)
    except KeyboardInterrupt:
        print("hapnb: interrupted", file=sys.stderr)
        return 130
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"hapnb {ns.command}: error: {e}", file=sys.stderr)
        return 2


#: commands that only compute and print or write files: the program ends them without Python's teardown
FAST_EXIT = ("plan", "compare", "simulate", "theory")


def run() -> None:
    """The ``hapnb`` program (console script and ``python -m hapnb``): :func:`main` on ``sys.argv``.

    After a command of :data:`FAST_EXIT` it flushes its output and leaves with ``os._exit``: with torch
    loaded, Python's own teardown (freeing every module's objects one by one) takes about as long as a
    BERT synthesis. Commands that start processes or clean up after themselves exit normally. Output cut
    short by its reader (a closed pipe) ends the program quietly.
    """
    import logging
    import os

    try:
        code = main()
        if len(sys.argv) > 1 and sys.argv[1] in FAST_EXIT:
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(code)
    except BrokenPipeError:  # the reader went away (``hapnb theory --coverage --json | head``): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os._exit(0)
    raise SystemExit(code)
