"""Golden test of the public surface (docs/architecture.md §4): renaming a public name or a CLI flag is a
decision made here, in one reviewed line, not a side effect. Also: no module is shadowed by a function
of the same name (``import hapnb.x.y as m`` always gives the module)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import types

import hapnb

PUBLIC = [
    "Cluster", "Collective", "Device", "G", "Graph", "I", "NoProgramError", "OutOfMemoryError", "Partial",
    "PinError", "PipelinePlan", "Plan", "pipeline", "R", "Replicate", "Search", "Session", "Shard", "Theory", "TraceError", "baselines",
    "collectives", "compare", "display", "distribute", "full_state_dict", "launch", "parse_form", "rules",
    "shard_lengths", "simulate", "synthesize", "theory", "Timeline", "trace", "verify", "zoo",
    "FullShard", "ShardGradOp", "Storage", "parse_pin",  # issue 10: parameter storage pins (ZeRO-3 / ZeRO-2)
    "Planner",  # issue 19: one Planner owns the theory, the arguments and every cache; Plan is a value
    "save_checkpoint", "load_checkpoint",  # issue 20: sharded checkpoints
    "destroy_groups",  # issue 18 (closing note): end a job's process groups after collecting garbage
]  # fmt: skip

FUNCTIONS = ["baselines", "compare", "distribute", "full_state_dict", "launch", "parse_form", "parse_pin", "pipeline", "shard_lengths",
             "simulate", "synthesize", "theory", "trace", "verify",
             "save_checkpoint", "load_checkpoint",  # issue 20: sharded checkpoints
             "destroy_groups",
             ]  # fmt: skip
MODULES = ["collectives", "display", "rules", "zoo"]


def test_public_names_are_the_golden_list():
    assert sorted(hapnb.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        obj = getattr(hapnb, name)
        if name in FUNCTIONS:
            assert inspect.isfunction(obj), name
        elif name in MODULES:
            assert isinstance(obj, types.ModuleType), name
    assert set(dir(hapnb)) >= set(PUBLIC)


def test_public_functions_keep_their_documented_signatures():
    sig = {
        n: list(inspect.signature(getattr(hapnb, n)).parameters) for n in ("trace", "synthesize", "theory")
    }
    assert sig["trace"][:3] == ["model", "example_inputs", "loss"]
    assert sig["synthesize"][:4] == ["model_or_graph", "cluster", "pins", "example_inputs"]
    assert sig["theory"][0] == "graph"
    assert list(inspect.signature(hapnb.Search).parameters)[:4] == ["graph", "cluster", "ratios", "pins"]


def _all_modules() -> list[str]:
    out = []
    for info in pkgutil.walk_packages(hapnb.__path__, "hapnb."):
        if not info.name.endswith("__main__"):
            out.append(info.name)
    return out


def test_no_module_is_shadowed_by_a_function():
    """``hapnb.theory`` and ``hapnb.launch`` used to be functions sharing their module's name, so
    ``import hapnb.theory as T`` gave the function. Modules and attributes now have distinct names."""
    for name in _all_modules():
        mod = importlib.import_module(name)
        parent, _, leaf = name.rpartition(".")
        attr = getattr(importlib.import_module(parent), leaf)
        assert attr is mod, f"{parent}.{leaf} is {type(attr).__name__}, not the module {name}"
    # and the public functions stay functions after every module was imported
    for name in FUNCTIONS:
        assert inspect.isfunction(getattr(hapnb, name)), name


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for cmd, sp in sorted(subs.choices.items()):
        flags = sorted(s for a in sp._actions for s in a.option_strings if s.startswith("--"))
        out[cmd] = flags
    return out


def test_cli_surface_is_the_golden_list():
    from hapnb import cli

    got = _subcommands(cli.build_parser())
    assert got == CLI, (
        "CLI changed: update CLI in tests/test_api.py (and docs/architecture.md / README) on purpose"
    )


CLI: dict[str, list[str]] = {
    "calibrate": [
        "--backend", "--help", "--json", "--kind", "--measured", "--no-loo", "--nproc", "--output", "--steps",
        "--timeout", "--warmup", "--worker",
    ],
    "compare": ["--batch", "--cluster", "--detail", "--duplex", "--help", "--json", "--layers", "--model", "--pick",
                "--seq", "--set", "--simulated", "--strategies"],
    "demo": ["--help", "--no-verify", "--report"],
    "launch": ["--backend", "--bucket-cap-bytes", "--bundle-dir", "--device", "--first-bucket-cap-bytes", "--grad-sync",
               "--help", "--json", "--nnodes", "--no-interleave", "--node-rank", "--nproc", "--print-commands",
               "--rdzv", "--slurm", "--steps", "--timeout", "--wall-timeout", "--worker"],
    "pipeline": ["--batch", "--budget", "--cluster", "--exhaustive", "--fold", "--help", "--json", "--layers",
                 "--method", "--micro-batches", "--model", "--no-prune", "--output", "--schedule", "--seq", "--set"],
    "plan": ["--batch", "--cluster", "--duplex", "--help", "--json", "--layers", "--model", "--no-baselines",
             "--output", "--pick", "--pin", "--ratio-pin", "--ratios", "--report", "--seq", "--set"],
    "profile": ["--backend", "--help", "--name", "--nproc", "--output", "--quick", "--repeats", "--sizes",
                "--threads", "--timeout"],
    "simulate": ["--gantt", "--help", "--json", "--no-overlap", "--no-sharing", "--slowdown"],
    "theory": ["--batch", "--check", "--coverage", "--help", "--json", "--layers", "--model", "--seq", "--set"],
    "verify": ["--backend", "--batch", "--bucket-cap-bytes", "--cluster", "--device", "--dtype", "--duplex",
               "--first-bucket-cap-bytes", "--grad-sync", "--help", "--layers", "--model", "--no-interleave",
               "--nproc", "--pin", "--plan", "--quiet", "--ratio-pin", "--ratios", "--seq", "--set",
               "--stall-timeout", "--steps", "--timeout"],
}  # fmt: skip
CLI["launch"] = sorted(
    [*CLI["launch"], "--dtype", "--rebalance", "--rebalance-option", "--slowdown"]
)  # issue 21: live rebalance
for _cmd, _flags in (("plan", ["--max-expansions", "--max-seconds"]), ("verify", ["--max-expansions", "--max-seconds"]),
                     ("compare", ["--max-expansions"])):  # fmt: skip
    CLI[_cmd] = sorted([*CLI[_cmd], *_flags])  # issue 18: the A* budget per search from the command line
