"""The generated program against the plain model on one GPU: what running through hapnb costs.

On a machine with one CUDA GPU: per model, a one-device plan (``1xH100``) is synthesized, the plan's
rank-0 program is built with :func:`hapnb.distribute` inside a one-rank NCCL process group, and the same
timed loop (:func:`hapnb.run.profile.step_times`: zero_grad, forward, backward, ``torch.optim.Adam``
step, CUDA synchronised) runs the plain model and the program in turn (fp32, TF32 off; the order
alternates over ``--rounds``). Also the loss of both at the first step (same weights, same batch), and
their peak memory. Writes one JSON line per model to ``--out``.

    python benchmarks/gpu_overhead.py --out overhead.jsonl gpt2 vit resnet50 zoo:gpt   # on the GPU

Models: ``examples.corpus`` names (``--size``) or ``zoo:NAME`` (the zoo's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(name: str, size: str) -> tuple[Any, tuple[Any, ...]]:
    """A model and its example batch: ``zoo:NAME`` or a corpus name."""
    if name.startswith("zoo:"):
        from hapnb import zoo

        model, inputs, _ = zoo.build(name[4:], devices=1)
        return model, inputs
    from examples import corpus

    return corpus.CORPUS[name](size=size)


def _timed(module: Any, batch: tuple[Any, ...], steps: int, warmup: int) -> tuple[list[float], int]:
    import torch

    from hapnb.run.profile import step_times

    gpu = torch.cuda.is_available()
    opt = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-6)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    times, _ = step_times(module, batch, opt, steps, warmup)
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    del opt
    if gpu:
        torch.cuda.empty_cache()
    return times, int(peak)


def measure(name: str, size: str, steps: int, warmup: int, rounds: int, device: str) -> dict[str, Any]:
    """Median step (s) and peak memory of the plain model and of hapnb's one-device program."""
    import torch

    import hapnb as hap

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model, inputs = build(name, size)
    t0 = time.perf_counter()
    plan = hap.synthesize(model, "1xH100", example_inputs=inputs, check_memory=False)
    plan_s = time.perf_counter() - t0
    dev = torch.device(device)
    model = model.to(dev).train()
    batch = tuple(x.to(dev) for x in inputs)
    dm = hap.distribute(model, plan, example_inputs=batch)
    dm.train()
    local = tuple(x.to(dev) for x in dm.local_inputs(*batch))
    with torch.no_grad():
        loss_plain = float(model(*batch))
        loss_prog = float(dm(*local))
    plain: list[float] = []
    prog: list[float] = []
    peaks = {"plain": 0, "program": 0}
    for r in range(rounds):
        order = [("plain", model, batch, plain), ("program", dm, local, prog)]
        for what, module, b, out in order if r % 2 == 0 else order[::-1]:
            times, peak = _timed(module, b, steps, warmup)
            out += times
            peaks[what] = max(peaks[what], peak)
    mp, mg = statistics.median(plain), statistics.median(prog)
    return {
        "model": name,
        "size": size,
        "params": sum(p.numel() for p in model.parameters()),
        "plain_step_s": mp,
        "program_step_s": mg,
        "overhead": mg / mp - 1.0,
        "plain_peak_bytes": peaks["plain"],
        "program_peak_bytes": peaks["program"],
        "loss_plain": loss_plain,
        "loss_program": loss_prog,
        "predicted_s": plan.cost_s,
        "plan_s": plan_s,
        "steps": steps * rounds,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def main() -> None:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["gpt2", "vit", "resnet50", "zoo:gpt"])
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="plain/program alternations")
    ap.add_argument("--out", default=None, help="append one JSON line per model here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a gloo dry run")
    ns = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if ns.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if ns.device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        for name in ns.models:
            try:
                row = measure(name, ns.size, ns.steps, ns.warmup, ns.rounds, ns.device)
            except Exception as e:  # noqa: BLE001 - one model's failure must not stop the rest
                row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(json.dumps(row), flush=True)
            if ns.out:
                with open(ns.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
