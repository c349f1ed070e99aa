"""What each ``hapnb`` subcommand does: ``cmd_NAME(ns) -> exit status`` for the parsed arguments of
:func:`hapnb.cli.build_parser`, and the helpers that turn those arguments into the library's plain Python
arguments (:func:`options`, :func:`pins`). :mod:`hapnb.cli` parses and dispatches; ``docs/architecture.md``
§3 says how to add a command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

DEMO_MODEL = "bert"
DEMO_CLUSTER = "paper-hetero-8"


def _runtime_argv(ns: argparse.Namespace) -> list[str]:
    """The worker arguments of :func:`_runtime_args`' flags (only those not at their defaults)."""
    from .run.worker import runtime_argv

    return runtime_argv(
        ns.grad_sync, ns.bucket_cap_bytes, ns.first_bucket_cap_bytes, not ns.no_interleave, ns.device
    )


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


def _budget(ns: argparse.Namespace) -> dict[str, Any]:
    """The A* budget flags that were given (``--max-expansions``, ``--max-seconds``) as synthesis keywords."""
    out: dict[str, Any] = {}
    n = getattr(ns, "max_expansions", None)
    if n is not None:
        if n < 1:
            raise SystemExit(
                f"hapnb: --max-expansions {n}: expected a positive number of expansions per search"
            )
        out["max_expansions"] = n
    sec = getattr(ns, "max_seconds", None)
    if sec is not None:
        if sec <= 0:
            raise SystemExit(f"hapnb: --max-seconds {sec}: expected a positive number of seconds per search")
        out["max_seconds"] = sec
    return out


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


def _synthesize(ns: argparse.Namespace, duplex: bool | None = None) -> tuple[Any, Any, float]:
    """The plan of the command's model, cluster and pins (``duplex``: as given, else as ``--duplex`` says)."""
    from .hardware.cluster import Cluster
    from .plans.synthesis import synthesize

    c = Cluster.resolve(ns.cluster)
    pins, ratios = _pins(ns) if hasattr(ns, "pin") else ({}, None)
    if duplex is None:
        duplex = getattr(ns, "duplex", None) not in (None, False)  # on, auto or True (verify's flag)
    pick = getattr(ns, "pick", "simulated")
    plan = synthesize(
        ns.model, c, pins=pins, ratios=ratios, duplex=duplex, pick=pick, **_budget(ns), **_options(ns)
    )
    return plan, c, plan.synthesis_s


def _predicted_s(plan: Any, pick: str) -> tuple[float, str]:
    """The plan's predicted iteration time on the clock ``--pick`` chooses by, and the clock's name."""
    if pick == "simulated" and plan.simulated_s is not None:
        return plan.simulated_s, "simulated"
    return plan.cost_s, "stage model"


def _with_plain(ns: argparse.Namespace, duplex: Any) -> tuple[Any, dict[str, Any], str]:
    """``hapnb plan --duplex [auto]``: the plain plan beside the duplex one. Returns the plan to keep (with
    ``auto``, duplex only where it is predicted faster), the JSON keys it adds and the line to print."""
    plain, _, _ = _synthesize(ns, duplex=False)
    dup_s, clock = _predicted_s(duplex, ns.pick)
    plain_s, _ = _predicted_s(plain, ns.pick)
    faster = dup_s < plain_s
    keep = plain if ns.duplex == "auto" and not faster else duplex
    rel = abs(dup_s / plain_s - 1) if plain_s > 0 else 0.0
    change = (
        f"{rel * 100:.1f} % {'faster' if faster else 'slower'}" if rel >= 5e-4 else "as fast (within 0.05 %)"
    )
    line = f"  duplex: {dup_s * 1e3:.3f} ms against the plain plan's {plain_s * 1e3:.3f} ms ({clock}"
    if clock == "simulated":
        line += f"; stage model {duplex.cost_s * 1e3:.3f} ms against {plain.cost_s * 1e3:.3f} ms"
    line += f"): the duplex plan is predicted {change}"
    if ns.duplex == "auto":
        line += f"; --duplex auto kept the {'duplex' if keep is duplex else 'plain'} plan"
    elif not faster:
        line += "; --duplex auto keeps the plain plan where duplex does not pay"
    keys = {
        "plain_cost_s": plain.cost_s,
        "plain_simulated_s": plain.simulated_s,
        "duplex_cost_s": duplex.cost_s,
        "duplex_simulated_s": duplex.simulated_s,
        "duplex_faster": faster,  # on the --pick clock (simulated unless --pick cost)
    }
    return keep, keys, line


def cmd_plan(ns: argparse.Namespace) -> int:
    from .plans.synthesis import baselines

    plan, c, synth_s = _synthesize(ns)
    duplex_keys: dict[str, Any] = {}
    duplex_line = ""
    if ns.duplex:
        plan, duplex_keys, duplex_line = _with_plain(ns, plan)
        synth_s = plan.synthesis_s  # the kept plan's (the other one's synthesis ran too)
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
            **duplex_keys,  # with --duplex: the plain plan's times beside the duplex plan's
        }
        # where the command's time went (benchmarks/command.py): building and tracing the model (0 build
        # when the trace cache had it), synthesis (search_s and balance_s of it), and after synthesis
        phases = {k: plan.stats[k] for k in ("build_s", "trace_s", "trace_path", "search_s", "balance_s")
                  if k in plan.stats}  # fmt: skip
        out["phases"] = {**phases, "synthesis_s": synth_s, "after_s": time.perf_counter() - t_done}
        print(json.dumps(out))
    else:
        print(plan.summary())
        if duplex_line:
            print(duplex_line)
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
        ns.model, ns.cluster, strategies=ns.strategies, pick=ns.pick, duplex=ns.duplex, **_budget(ns),
        **_options(ns),
    )  # fmt: skip
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
        **({"schedule": ns.schedule} if ns.schedule else {}),
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
    if st.get("schedule_note"):
        print(f"  schedule: {st['schedule_note']}")
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


def cmd_verify(ns: argparse.Namespace) -> int:
    from .pipelines import PipelinePlan, is_pipeline_json
    from .plans.plan import Plan
    from .run.bundle import BundleError
    from .run.pipelined import PipelineError
    from .run.verify import ProgressLines, VerifyError, verify
    from .runtime.program import CodegenError

    if ns.plan:
        batch, seq = _plan_sizes(ns)
        pipeline = is_pipeline_json(_read_json(ns.plan))
        plan: Any = PipelinePlan.load(ns.plan) if pipeline else Plan.load(ns.plan)
        if batch is not None or seq is not None:
            plan = _resized(plan, batch, seq)
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
            progress=None if ns.quiet else ProgressLines(nproc, ns.steps),
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


#: ``hapnb verify`` flags that describe a model or a program to synthesize: a plan already records both
_NOT_WITH_PLAN = ("model", "cluster", "layers", "pin", "ratios", "ratio_pin", "duplex")


def _plan_sizes(ns: argparse.Namespace) -> tuple[int | None, int | None]:
    """``hapnb verify --plan P``: the batch and sequence length to re-derive the plan at (``--batch``,
    ``--seq``, or ``--set batch=``/``--set seq=``); every flag that would change the model or the program
    is refused (SystemExit naming them and what to do instead)."""
    sizes: dict[str, Any] = {"batch": ns.batch, "seq": ns.seq}
    bad = [f"--{k.replace('_', '-')}" for k in _NOT_WITH_PLAN if getattr(ns, k, None)]
    for item in ns.set or []:
        k, _, v = item.partition("=")
        k = k.strip()
        if k in sizes and sizes[k] is None:
            sizes[k] = _value(v.strip())
        else:
            bad.append(f"--set {item}")
    if bad:
        raise SystemExit(
            f"hapnb verify: {', '.join(bad)} do{'es' * (len(bad) == 1)} not apply with --plan {ns.plan}: the plan "
            "records its model, cluster and program. With --plan, only --batch and --seq apply (the same "
            "program at another size). To verify another model or program, plan it first (hapnb plan "
            "--model ... -o PLAN) or drop --plan and give --model and --cluster"
        )
    for k, v in sizes.items():
        if v is not None and not isinstance(v, int):
            raise SystemExit(f"hapnb verify: --set {k}={v}: expected a whole number")
    return sizes["batch"], sizes["seq"]


def _resized(plan: Any, batch: int | None, seq: int | None) -> Any:
    """The plan's program at ``batch``/``seq`` (:func:`hapnb.run.verify.resize`), said on stderr."""
    from .pipelines import PipelinePlan
    from .run.verify import batch_rows, resize

    small = resize(plan, batch, seq)
    sizes = " ".join(f"--{k} {v}" for k, v in (("batch", batch), ("seq", seq)) if v is not None)
    if isinstance(small, PipelinePlan):
        how = (
            f"the same stages, shares and {small.schedule} schedule, {small.micro_batches} micro-batches of "
            f"{small.micro_batch_size}"
        )
    else:
        rows = batch_rows(small)
        how = "the same program and ratios" + (
            f"; rows of the batch per device: {', '.join(map(str, rows))}" if rows is not None else ""
        )
    print(f"hapnb verify: plan {plan.name} re-derived at {sizes}: {how}", file=sys.stderr)
    return small


def _read_json(path: str) -> Any:
    """The JSON in ``path`` (None when unreadable: the plan loader then says why)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _worker_argv(worker: str) -> tuple[str, ...]:
    """``--worker``: a module name (run with ``-m``) or a ``.py`` file."""
    return (worker,) if worker.endswith(".py") else ("-m", worker)


def _rebalance(ns: Any) -> bool | dict[str, Any]:
    """``--rebalance`` / ``--rebalance-option KEY=VALUE``: False, True, or the options (which imply it)."""
    from .run.rebalance import RebalanceOptions

    return RebalanceOptions.parse(ns.rebalance_option) if ns.rebalance_option else bool(ns.rebalance)


def _format_rebalance_summary(metrics: Any) -> str:
    from .run.rebalance import summarize

    s = summarize(metrics)
    ms = lambda x: "n/a" if x is None else f"{x * 1e3:.2f} ms"  # noqa: E731
    n = len(s["rebalances"])
    if not n:
        return f"never re-balanced: median step {ms(s['step_s_before'])} (first third), {ms(s['step_s_after'])} (last)"
    before, after = ms(s["step_s_before"]), ms(s["step_s_after"])
    return f"re-balanced {n} time{'s' * (n != 1)}: median step {before} before, {after} after"


def _format_metric(m: dict[str, Any]) -> str:
    from . import display

    if m.get("event") == "rebalance":
        return display.rebalance_text(m["rebalance"])
    if m.get("event") == "telemetry":
        return f"telemetry at {display.telemetry_text(m)}"
    parts = [f"rank {m.get('rank', '?')}", f"step {m.get('step', '?')}"]
    if "stage" in m:  # a pipeline plan's rank
        parts.insert(1, f"stage {m['stage']}")
    for key, label in (("loss", "loss"), ("global_loss", "global")):
        if isinstance(m.get(key), (int, float)):
            parts.append(f"{label} {m[key]:.6g}")
    if isinstance(m.get("step_s"), (int, float)):
        parts.append(f"{m['step_s'] * 1e3:.2f} ms")
    if isinstance(m.get("compute_s"), (int, float)) and isinstance(m.get("comm_s"), (int, float)):
        parts.append(f"(compute {m['compute_s'] * 1e3:.2f}, collectives {m['comm_s'] * 1e3:.2f})")
    if isinstance(m.get("max_memory_bytes"), (int, float)):
        parts.append(f"mem {m['max_memory_bytes'] / 2**20:.1f} MiB")
    return "  ".join(parts)


def _print_commands(ns: argparse.Namespace, backend: str, worker: tuple[str, ...]) -> int:
    from .run.launch import DEFAULT_WORKER, launch_commands, live_argv, plan_bundle, slurm_script, worker_for
    from .run.pipelined import PIPELINE_WORKER_ARGV

    src = Path(ns.plan)
    worker = worker_for(src, worker)  # a pipeline plan runs hapnb.run.pipelined
    target = (Path(ns.bundle_dir) if ns.bundle_dir else src.with_suffix(".bundle")) if src.is_file() else None
    bundle, devices = plan_bundle(src, target)
    per_node = ns.nproc or (devices // ns.nnodes if devices else None)
    if not per_node:
        print("hapnb launch: pass --nproc (cannot read the plan's device count)", file=sys.stderr)
        return 2
    try:  # issue 21: --rebalance, --slowdown and --dtype travel to every rank
        own = worker in (DEFAULT_WORKER, PIPELINE_WORKER_ARGV)  # hapnb's workers take the collective timeout
        extra = [
            *live_argv(_rebalance(ns), ns.slowdown, False, ns.dtype, per_node * ns.nnodes),
            *_runtime_argv(ns),
            *(["--timeout", f"{ns.timeout:g}"] if own else []),
            *ns.worker_args,
        ]
    except ValueError as e:
        print(f"hapnb launch: {e}", file=sys.stderr)
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
                extra_args=extra,
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
            extra_args=extra,
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
            extra_args=[*_runtime_argv(ns), *ns.worker_args],  # the worker's own arguments (after --) last
            bundle_dir=ns.bundle_dir,
            rebalance=_rebalance(ns),
            slowdown=ns.slowdown,
            dtype=ns.dtype,
        )
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"hapnb launch: {e}", file=sys.stderr)
        return 2
    with job:
        for m in job.metrics():
            print(json.dumps(m) if ns.json else _format_metric(m), flush=True)
        result = job.wait()
    live = bool(_rebalance(ns)) or bool(ns.slowdown)
    if ns.json:
        keys = {"ok": result.ok, "returncode": result.returncode, "median_step_s": result.median_step_s}
        keys.update(final_loss=result.final_loss, steps=len(result.step_times(0)), wall_s=result.wall_s)
        if live:  # issue 21: losses, step_s, rebalances, step_s_before, step_s_after (and rejected)
            from .run.rebalance import summarize

            keys.update(summarize(result.metrics))
        print(json.dumps({**keys, "error": result.error}))
    else:
        print(result.summary())
        if live:
            print(_format_rebalance_summary(result.metrics))
    if not result.ok:
        print(f"hapnb launch: {result.error}", file=sys.stderr)
        return result.returncode or 1
    return 0


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
