"""The ``hapnb`` command line (docs/architecture.md §4): plan, compare, pipeline, simulate, verify, launch, profile,
calibrate, theory, demo.

Every subcommand's argument parsing lives here, with the program itself (:func:`main`, :func:`run`); what
each subcommand does (``cmd_NAME``) is in :mod:`hapnb.cli_commands`, and the library modules those call
take plain Python arguments. Flags and JSON keys are a stable contract; ``python -m hapnb`` is the same
program.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from . import cli_commands as _c

__all__ = ["main", "run", "build_parser"]


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


def _budget_args(p: argparse.ArgumentParser, seconds: bool = True) -> None:
    """How long each A* search of the synthesis may run (``synthesize``'s ``max_expansions`` / ``max_seconds``;
    ``hapnb compare`` takes the expansions only)."""
    p.add_argument(
        "--max-expansions",
        type=int,
        default=None,
        metavar="N",
        help="expansions per A* search (default 30000; memory-aware searches get 1000 + 4 per op, scaled by "
        "N / 30000); a plan whose search stopped there reports its optimal_gap",
    )
    if seconds:
        p.add_argument(
            "--max-seconds",
            type=float,
            default=None,
            metavar="S",
            help="seconds per A* search (default: none)",
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
    _budget_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--report", help="write an HTML report (plan, stages, Gantt, search stats)")
    p.add_argument("--no-baselines", action="store_true", help="skip the DP-EV/DP-CP baselines")
    p.add_argument(
        "--duplex",
        nargs="?",
        const="on",
        choices=["on", "auto"],
        default=None,
        help="HiDup's duplex schedule: two micro-batches, one computing while the other communicates; the "
        "plain plan's time is reported beside it. --duplex auto keeps duplex only where it is predicted "
        "faster (on the --pick clock) and says which plan it kept",
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
    _budget_args(p, seconds=False)

    p = sub.add_parser("pipeline", help="plan a heterogeneous pipeline (Ditto: node folding + DP recovery)")
    _model_args(p)
    _cluster_args(p)
    p.add_argument("--micro-batches", type=int, help="micro-batches per batch (default: micro-batches of 4)")
    p.add_argument(
        "--schedule",
        choices=["1F1B", "GPipe"],
        default=None,
        help="default: 1F1B where it runs (at least as many micro-batches as stages: with the default "
        "micro-batches, more of them if needed), else GPipe, whichever is faster; the plan says which",
    )
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
    p = sub.add_parser(
        "verify",
        help="run the plan on local ranks and compare with one device",
        description="Run a plan (--plan, or one synthesized from --model and --cluster) on local ranks and "
        "compare it with one device. With --plan, --batch and --seq re-derive the plan's program (the same "
        "forms and ratios) at that size, e.g. to check a paper-size plan on a CPU machine; the other model, "
        "cluster and pin flags apply to --model only.",
    )
    p.add_argument("--plan", help="a plan JSON, SPMD or pipeline (the plan records how to rebuild its model)")
    _model_args(p, required=False)
    _cluster_args(p, required=False)
    _pin_args(p)
    _budget_args(p)
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

    p = sub.add_parser(
        "launch",
        help="launch a plan or bundle on local ranks (or print multi-node commands)",
        usage="hapnb launch PLAN_OR_BUNDLE [options] [-- WORKER_ARGS ...]",
        epilog="Everything after `--` is passed to the worker as it is, after hapnb's own arguments, e.g. "
        "`hapnb launch lm.json --worker examples/train_lm.py -- --ckpt-dir ckpt --save-at 30`.",
    )
    p.set_defaults(worker_args=[])
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
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a collective may wait for its peers (hapnb's workers then fail naming the rank and the "
        "instruction) and the ranks may go without progress (default 300)",
    )
    p.add_argument("--wall-timeout", type=float, default=None, help="limit on the whole run (s)")
    p.add_argument("--worker", default="hapnb.run.worker", help="worker module (or a .py file)")
    p.add_argument("--json", action="store_true", help="print raw JSON lines and a JSON summary")
    _runtime_args(p)
    p.add_argument(
        "--rebalance",
        action="store_true",
        help="measure the ranks and reshard live to new ratios when a straggler's slowdown pays for it",
    )
    p.add_argument(
        "--rebalance-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a re-balancing option (implies --rebalance), e.g. program=false (ratios only), links=false, "
        "every=4, patience=3, threshold=0.5, payback_steps=50, min_gain=0.1, max_rebalances=3",
    )
    p.add_argument(
        "--slowdown",
        action="append",
        default=[],
        metavar="RANK=FACTOR",
        help="make RANK's compute FACTOR times slower (it sleeps in proportion; try --rebalance locally)",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "float64"], help="the ranks' floating dtype")

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


#: subcommand -> its implementation in :mod:`hapnb.cli_commands`
COMMANDS = {
    "plan": _c.cmd_plan, "compare": _c.cmd_compare, "simulate": _c.cmd_simulate, "verify": _c.cmd_verify,
    "launch": _c.cmd_launch, "profile": _c.cmd_profile, "calibrate": _c.cmd_calibrate, "theory": _c.cmd_theory,
    "demo": _c.cmd_demo,
    "pipeline": _c.cmd_pipeline,
}  # fmt: skip


def _split_worker_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``hapnb launch ... -- ARGS``: hapnb's arguments, and those after the first ``--`` (the worker's own,
    verbatim; other commands take none).

    >>> _split_worker_args(["launch", "p.json", "--nproc", "2", "--", "--my-flag", "3", "--", "x"])
    (['launch', 'p.json', '--nproc', '2'], ['--my-flag', '3', '--', 'x'])
    """
    argv = list(argv)
    if argv[:1] == ["launch"] and "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1 :]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    argv, worker_args = _split_worker_args(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    if worker_args:
        ns.worker_args = worker_args
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
