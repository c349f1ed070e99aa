"""The ``hapnb`` command line (DESIGN §3.2): plan, compare, simulate, verify, launch, profile, demo.

Flags and JSON keys here are a stable contract; ``python -m hapnb`` is the same program.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser"]

DEMO_MODEL = "bert"
DEMO_CLUSTER = "paper-hetero-8"


def _model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        help="zoo model (mlp, vgg19, vit, bert, bert-moe, gpt) or pkg.mod:factory",
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
        help="pin a tensor's form, e.g. --pin layers.0.fc1.weight=G1 (I, R, Gd, Shard(d), Replicate)",
    )
    p.add_argument("--ratios", help="fixed ratios r1,r2,... (one per device; no LP)")
    p.add_argument(
        "--ratio-pin",
        action="append",
        default=[],
        metavar="DEVICE=VALUE|LO:HI",
        help="pin a device's ratio or bound it, e.g. --ratio-pin v100-0=0.3 --ratio-pin p100-1=0.05:0.2",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hapnb",
        description="Synthesize, explain, verify and launch SPMD training "
        "programs for heterogeneous GPU clusters (HAP).",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="synthesize a plan")
    _model_args(p)
    _cluster_args(p)
    _pin_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--report", help="write an HTML report (plan, stages, Gantt, search stats)")
    p.add_argument("--no-baselines", action="store_true", help="skip the DP-EV/DP-CP baselines")

    p = sub.add_parser("compare", help="one cost model, all strategies")
    _model_args(p)
    _cluster_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("simulate", help="timeline of a plan per device")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("verify", help="run the plan on local ranks and compare with one device")
    p.add_argument("--plan", help="a plan JSON (the plan records how to rebuild its model)")
    _model_args(p, required=False)
    _cluster_args(p, required=False)
    _pin_args(p)
    p.add_argument("--nproc", type=int, help="number of local ranks (= devices of the plan)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])

    from .run.launch import add_launch_args
    from .run.profile import add_calibrate_args, add_profile_args

    add_launch_args(
        sub.add_parser("launch", help="launch a plan or bundle on local ranks (or print multi-node commands)")
    )
    add_profile_args(sub.add_parser("profile", help="profile devices and collectives -> cluster JSON"))
    add_calibrate_args(
        sub.add_parser("calibrate", help="launch a plan briefly and compare predicted vs measured time")
    )

    p = sub.add_parser("theory", help="list or check the rules")
    p.add_argument("--check", action="store_true")
    p.add_argument("ops", nargs="*")

    p = sub.add_parser("demo", help="the main job: plan BERT on a heterogeneous preset, report, verify")
    p.add_argument("--report", default="hapnb-demo-report.html")
    p.add_argument("--no-verify", action="store_true")
    return ap


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
    from .forms import parse_form

    pins = {}
    for item in ns.pin or []:
        if "=" not in item:
            raise SystemExit(f"hapnb: --pin {item!r}: expected NAME=FORM, e.g. layers.0.fc1.weight=G1")
        k, v = item.rsplit("=", 1)
        pins[k] = parse_form(v)
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
    from .cluster import Cluster
    from .synthesis import synthesize

    c = Cluster.resolve(ns.cluster)
    pins, ratios = _pins(ns) if hasattr(ns, "pin") else ({}, None)
    plan = synthesize(ns.model, c, pins=pins, ratios=ratios, **_options(ns))
    return plan, c, plan.synthesis_s


def cmd_plan(ns: argparse.Namespace) -> int:
    from .synthesis import baselines

    plan, c, synth_s = _synthesize(ns)
    base = {} if ns.no_baselines else baselines(plan.graph, c)
    if ns.output:
        plan.save(ns.output)
    if ns.report:
        from . import display

        Path(ns.report).write_text(display.report_html(plan, baselines=base))
    if ns.json:
        out = {
            "cost_s": plan.cost_s,
            "lower_bound_s": plan.lower_bound_s,
            "synthesis_s": synth_s,
            "expansions": plan.stats.get("expansions", 0),
            "iterations": len(plan.history),
            "ratios": [list(r) for r in plan.ratios],
            "program": [str(i) for i in plan.program],
            "stages": len(plan.stages),
            "baselines": {k: v.cost_s for k, v in base.items() if k in ("dp_ev", "dp_cp")},
            "devices": list(plan.devices),
        }
        print(json.dumps(out))
    else:
        print(plan.summary())
        for k, v in base.items():
            print(f"  baseline {k}: {v.cost_s * 1e3:.3f} ms ({v.cost_s / plan.cost_s:.2f}x the plan)")
        if ns.output:
            print(f"  plan written to {ns.output}")
        if ns.report:
            print(f"  report written to {ns.report}")
    return 0


def cmd_compare(ns: argparse.Namespace) -> int:
    from .synthesis import baselines

    plan, c, _ = _synthesize(ns)
    out = {"hap": plan.cost_s}
    out.update({k: v.cost_s for k, v in baselines(plan.graph, c).items()})
    if ns.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:8s} {v * 1e3:10.3f} ms  {v / out['hap']:.2f}x")
    return 0


def cmd_simulate(ns: argparse.Namespace) -> int:
    from .plan import Plan
    from .simulate import simulate

    tl = simulate(Plan.load(ns.plan))
    if ns.json:
        print(json.dumps(tl.to_json()))
    else:
        print(tl)
    return 0


def cmd_verify(ns: argparse.Namespace) -> int:
    from .plan import Plan
    from .run import runtime

    if ns.plan:
        plan = Plan.load(ns.plan)
    elif ns.model and ns.cluster:
        plan, _, _ = _synthesize(ns)
    else:
        raise SystemExit("hapnb verify: give --plan PLAN, or --model NAME and --cluster SPEC")
    rep = runtime.verify(plan, nproc=ns.nproc, steps=ns.steps, backend=ns.backend, dtype=ns.dtype)
    print(rep)
    return 0 if rep.ok else 1


def cmd_theory(ns: argparse.Namespace) -> int:
    from . import rules

    return rules.main((["--check"] if ns.check else []) + list(ns.ops))


def cmd_demo(ns: argparse.Namespace) -> int:
    from . import display
    from .cluster import Cluster
    from .synthesis import baselines, synthesize

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
        print(f"  baseline {k}: {v.cost_s * 1e3:.3f} ms -> the plan is {v.cost_s / plan.cost_s:.2f}x faster")
    Path(ns.report).write_text(display.report_html(plan, baselines=base))
    print(f"report written to {ns.report}")
    if ns.no_verify:
        return 0
    from .run import runtime

    small = Cluster.parse("1xV100+3xP100")
    print(
        f"\nverifying a small {DEMO_MODEL} (2 layers, hidden 32) planned on {small} against one device "
        "(4 local gloo ranks, float64)..."
    )
    splan = synthesize(DEMO_MODEL, small, layers=2, hidden=32, heads=4, seq=16, vocab=128, batch=8)
    rep = runtime.verify(splan, nproc=small.n, steps=2)
    print(rep)
    return 0 if rep.ok else 1


COMMANDS = {
    "plan": cmd_plan, "compare": cmd_compare, "simulate": cmd_simulate, "verify": cmd_verify,
    "theory": cmd_theory, "demo": cmd_demo,
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "launch":
            from .run.launch import launch_main

            return launch_main(ns)
        if ns.command in ("profile", "calibrate"):
            from .run.profile import calibrate_main, profile_main

            return (profile_main if ns.command == "profile" else calibrate_main)(ns)
        return COMMANDS[ns.command](ns)
    except KeyboardInterrupt:
        print("hapnb: interrupted", file=sys.stderr)
        return 130
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"hapnb {ns.command}: error: {e}", file=sys.stderr)
        return 2
