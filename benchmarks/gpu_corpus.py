"""Measure training steps of the real-model corpus on one GPU, for the device model's fidelity on code
from well-known libraries (issue 18; docs/benchmarks/fidelity.md section (e)).

Runs on a machine with a CUDA GPU, torch and transformers, from the repository (``examples/corpus.py``; the
timed loop is :func:`hapnb.run.profile.step_times`). Per model (realistic size unless ``--size tiny``): fp32 (TF32 off, as the shipped
H100 device model was fitted), a step is forward + backward + ``torch.optim.Adam`` step; median over
``--steps`` timed steps after ``--warmup``; peak ``torch.cuda.max_memory_allocated``. Writes JSON lines
(one per model) to ``--out``. The predictions are made on any machine with
``python benchmarks/gpu_corpus.py --predict docs/benchmarks/fidelity-corpus.json`` (hapnb's plan on ``1xH100``).

    python benchmarks/gpu_corpus.py --out gpu.jsonl llama vit resnet50        # on the GPU machine
    python benchmarks/gpu_corpus.py --predict gpu.jsonl --md docs/benchmarks/fidelity.md  # here: predictions
    python benchmarks/gpu_corpus.py --saved --out saved.jsonl llama            # saved bytes per SDPA kernel
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(name: str, size: str, batch: int | None, steps: int, warmup: int, device: str) -> dict[str, Any]:
    """One model's median step time and peak memory on ``device``."""
    import torch

    from examples import corpus
    from hapnb.run.profile import step_times

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = {"size": size} if batch is None else {"size": size, "batch": batch}
    model, inputs = corpus.CORPUS[name](**kw)
    model = model.to(device).train()
    inputs = tuple(x.to(device) for x in inputs)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    times, loss = step_times(model, inputs, opt, steps, warmup)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": name,
        "size": size,
        "batch": int(inputs[0].shape[0]),
        "params": params,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_memory_bytes": int(peak),
        "loss": loss,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "torch": torch.__version__,
    }


def saved(name: str, size: str, device: str) -> dict[str, Any]:
    """Bytes autograd keeps for one forward on ``device`` (fp32) against hapnb's prediction
    (:func:`hapnb.cost.memory.saved_bytes` of the traced model), and which fused attention kernels the model's
    attention may use there (a kernel that refuses the call leaves the math kernel, which keeps the
    attention probabilities)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from examples import corpus
    from hapnb.cost.memory import saved_bytes
    from hapnb.run.profile import measure_saved_bytes
    from hapnb.tracing import trace

    torch.backends.cuda.matmul.allow_tf32 = False
    model, inputs = corpus.CORPUS[name](size=size)
    predicted = saved_bytes(trace(model, inputs))
    model = model.to(device).train()
    inputs = tuple(x.to(device) for x in inputs)
    row: dict[str, Any] = {"model": name, "size": size, "predicted_saved_bytes": predicted}
    row["measured_saved_bytes"] = measure_saved_bytes(model, inputs)
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                row[f"saved_bytes_{backend.lower()}"] = measure_saved_bytes(model, inputs)
        except RuntimeError as e:
            row[f"saved_bytes_{backend.lower()}"] = f"refused: {str(e).splitlines()[0][:160]}"
        torch.cuda.empty_cache()
    return row


def predict(rows: list[dict[str, Any]], cluster: str = "1xH100") -> list[dict[str, Any]]:
    """hapnb's predicted step time and peak memory of each measured model on one device of ``cluster``."""
    import hapnb as hap

    out = []
    for r in rows:
        t0 = time.perf_counter()
        plan = hap.synthesize(
            f"examples.corpus:{r['model']}", cluster, size=r["size"], batch=r["batch"], check_memory=False
        )
        out.append(
            {
                **{
                    k: r[k]
                    for k in ("model", "size", "batch", "params", "step_s", "peak_memory_bytes", "device")
                },
                "predicted_s": plan.cost_s,
                "predicted_memory_bytes": int(plan.memory_bytes[0]),
                "step_err": plan.cost_s / r["step_s"] - 1.0,
                "memory_err": plan.memory_bytes[0] / r["peak_memory_bytes"] - 1.0
                if r["peak_memory_bytes"]
                else None,
                "plan_s": time.perf_counter() - t0,
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | params | batch | measured ms | predicted ms | error | measured peak GiB | predicted GiB "
        "| error |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        me = f"{r['memory_err']:+.1%}" if r["memory_err"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['batch']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['predicted_s'] * 1e3:.1f} | {r['step_err']:+.1%} | {r['peak_memory_bytes'] / 2**30:.2f} | "
            f"{r['predicted_memory_bytes'] / 2**30:.2f} | {me} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["llama", "gpt2", "bert", "vit", "resnet50", "convnext_t"])
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="append one JSON line per measured model here")
    ap.add_argument("--predict", default=None, help="a JSON-lines file of measurements: add predictions")
    ap.add_argument("--json", default=None, help="with --predict: write measured + predicted rows here")
    ap.add_argument("--saved", action="store_true", help="saved activation bytes per attention kernel")
    ns = ap.parse_args()
    if ns.predict:
        rows = [json.loads(line) for line in Path(ns.predict).read_text().splitlines() if line.strip()]
        pred = predict(rows)
        if ns.json:
            Path(ns.json).write_text(json.dumps(pred, indent=1) + "\n")
        print(table(pred))
        return
    for name in ns.models:
        try:
            if ns.saved:
                row = saved(name, ns.size, ns.device)
            else:
                row = measure(name, ns.size, ns.batch, ns.steps, ns.warmup, ns.device)
        except Exception as e:  # noqa: BLE001 - one model's failure (e.g. out of memory) must not stop the rest
            row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
        if ns.out:
            with open(ns.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
