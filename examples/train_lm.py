"""Train a small Hugging Face GPT-2 on a local text corpus with a hapnb plan (issue 20).

Everything a training run needs around ``hapnb.distribute``: each rank loads only its share of every
global batch (``dm.batch_sampler``), AdamW with warmup + cosine learning rate, gradient clipping by the
global norm (``dm.clip_grad_norm_``), gradient accumulation, the global loss for logging
(``dm.global_loss``), sharded checkpoints that resume on another plan, cluster or number of ranks
(``hapnb.save_checkpoint`` / ``hapnb.load_checkpoint``) and, with ``--amp bf16``, bf16 autocast. Nothing is downloaded: the model is built from a
``GPT2Config`` with seeded weights, the corpus is this repository's own Markdown (or ``--corpus FILE...``)
and the tokenizer is the identity on bytes (vocabulary 256).

Plan the model (the factory :func:`lm` takes the options as ``--set``), then run the plan::

    hapnb plan --model examples.train_lm:lm --cluster 1xV100+2xP100 -o lm.json
    hapnb launch lm.json --nproc 3 --worker examples/train_lm.py --steps 60 -- --ckpt-dir ckpt --save-at 30
    torchrun --nproc-per-node 3 examples/train_lm.py lm.json --steps 60 --ckpt-dir ckpt --save-at 30
    hapnb plan --model examples.train_lm:lm --cluster 2xV100 -o lm2.json   # another cluster
    torchrun --nproc-per-node 2 examples/train_lm.py lm2.json --steps 60 --resume ckpt/step30
    python examples/train_lm.py --steps 60      # no plan: the single-device run, the reference

Every rank prints one JSON line per optimizer step (``step``, its partial ``loss``, ``global_loss``,
``grad_norm``, ``lr``, ``step_s``): the distributed run's ``global_loss`` is the single-device run's.
Under ``hapnb launch`` the script gets ``BUNDLE --steps N --backend B`` and the launcher's runtime flags
(ignored here), then its own options: everything after ``--`` on the ``hapnb launch`` line. ``--timeout S``
bounds every collective's wait (``hapnb.distribute(..., timeout=S)``): a rank whose peer stalled fails
after S seconds with an error naming it and the instruction. The model options come from the plan's
recorded factory options when it has them (``hapnb plan --model examples.train_lm:lm``), else from the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 256  # the byte-level tokenizer: a token is a byte
MODEL_OPTIONS = ("batch", "seq", "layers", "hidden", "heads")


# ---------------------------------------------------------------------------------------------- data


def corpus_text(paths: Sequence[str | os.PathLike[str]] = ()) -> bytes:
    """The training text: the given files, else this repository's README and docs (local files only)."""
    files = [Path(p) for p in paths] or [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return b"\n\n".join(f.read_bytes() for f in files)


def tokenize(text: bytes) -> torch.Tensor:
    """The trivial byte-level tokenizer: token ids are the bytes (0..255)."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.long)


def rows(text: bytes, seq: int) -> torch.Tensor:
    """The corpus cut into non-overlapping rows of ``seq`` tokens (the last partial row dropped)."""
    ids = tokenize(text)
    n = len(ids) // seq
    if n == 0:
        raise ValueError(f"the corpus has {len(ids)} bytes, fewer than one row of {seq}")
    return ids[: n * seq].view(n, seq)


# ---------------------------------------------------------------------------------------------- model


class LM(nn.Module):
    """A Hugging Face causal LM returning its next-token loss: ``forward(input_ids)`` is the mean
    cross-entropy of predicting token ``t + 1`` from tokens ``..t``. The loss is written here rather than
    with ``labels=`` because Hugging Face's loss upcasts the logits to float32, and a float64 run (the
    exact comparison with one device) should stay float64."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def lm(
    batch: int = 12, seq: int = 32, layers: int = 2, hidden: int = 64, heads: int = 4, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The factory: a GPT-2 (byte vocabulary, tied embedding and head, no dropout, no KV cache) and an
    example global batch of ``batch`` rows of ``seq`` tokens, for ``hapnb plan --model
    examples.train_lm:lm``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LM(GPT2LMHeadModel(cfg)).train()
    return model, (torch.zeros(batch, seq, dtype=torch.long),)


# ---------------------------------------------------------------------------------------------- training


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10 % at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))


def micro_batches(sampler: Any, data: torch.Tensor, start: int) -> Iterator[torch.Tensor]:
    """This rank's rows of every micro-batch from the ``start``-th on (epochs follow one another, each
    reshuffled by ``set_epoch``), through a DataLoader that reads only the rows the sampler yields."""
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(data)
    epoch, skip = divmod(start, len(sampler))
    while True:
        sampler.set_epoch(epoch)
        batches = list(sampler)[skip:]
        for (x,) in DataLoader(ds, batch_sampler=batches):
            yield x
        epoch, skip = epoch + 1, 0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "plan", nargs="?", default=None, help="a plan JSON file or a bundle folder (none: one device)"
    )
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in all (a resumed run included)")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches (global batches) per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="the data order's seed")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--amp", default=None, choices=["bf16"], help="torch.autocast around the forward")
    p.add_argument("--corpus", nargs="*", default=[], help="text files (default: this repository's docs)")
    p.add_argument("--ckpt-dir", default=None, help="write checkpoints here (ckpt-dir/stepN)")
    p.add_argument("--save-at", type=int, action="append", default=[], help="checkpoint after this step")
    p.add_argument("--resume", default=None, help="a checkpoint folder to continue from (any plan's)")
    p.add_argument("--timeout", type=float, default=None, help="seconds a collective may wait for its peers")
    for k in MODEL_OPTIONS:
        p.add_argument(
            f"--{k}", type=int, default=None, help=f"model option {k} (default: the plan's, else lm()'s)"
        )
    ns, unknown = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    ns.ignored = unknown  # the launcher's runtime flags (--grad-sync, --device, ...)
    return ns


def _plan(path: str | None) -> Any:
    if path is None:
        return None
    from hapnb.plans.plan import Plan

    p = Path(path)
    return Plan.load(p / "plan.json" if p.is_dir() else p)


def _model_options(ns: argparse.Namespace, plan: Any) -> dict[str, int]:
    """The factory's options: the plan's recorded ones (a plan of ``examples.train_lm:lm``), then flags."""
    opts: dict[str, int] = {}
    spec = getattr(plan, "model_spec", None) or {}
    if str(spec.get("name", "")).endswith("train_lm:lm"):
        opts.update({k: v for k, v in spec.get("options", {}).items() if k in MODEL_OPTIONS})
    opts.update({k: getattr(ns, k) for k in MODEL_OPTIONS if getattr(ns, k) is not None})
    return opts


def run(argv: Sequence[str] | None = None, out: Any = sys.stdout) -> tuple[list[dict[str, Any]], nn.Module]:
    """Train as the flags say; returns this rank's step records and the trained module (the
    :func:`hapnb.distribute` module, or the model on one device). Prints one JSON line a step to ``out``."""
    import torch.distributed as dist

    import hapnb
    from hapnb.run.training import ShareSampler

    ns = parse(argv)
    plan = _plan(ns.plan)
    distributed = plan is not None
    if distributed and not dist.is_initialized():
        dist.init_process_group(ns.backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    rank = dist.get_rank() if distributed else 0
    opts = _model_options(ns, plan)
    model, example = lm(**opts)
    model = model.to(getattr(torch, ns.dtype))
    data = rows(corpus_text(ns.corpus), example[0].shape[1])
    batch = example[0].shape[0]
    if distributed:
        target: nn.Module = hapnb.distribute(model, plan, example_inputs=example, timeout=ns.timeout)
        sampler: Any = target.batch_sampler(len(data), seed=ns.seed, drop_last=True)
    else:
        target = model
        sampler = ShareSampler(len(data), batch=batch, shares=None, rank=0, seed=ns.seed, drop_last=True)
    opt = torch.optim.AdamW(target.parameters(), lr=ns.lr, weight_decay=ns.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, ns.warmup, ns.steps))
    start = 0
    if ns.resume:
        extra = hapnb.load_checkpoint(ns.resume, target, opt)
        sched.load_state_dict(extra["sched"])
        start = int(extra["step"])
    micro = micro_batches(sampler, data, start * ns.accum)
    records = []
    for step in range(start, ns.steps):
        t0 = time.perf_counter()
        partial = glob = 0.0
        read = 0
        for k in range(ns.accum):
            x = next(micro)
            read += len(x)
            # inner micro-steps accumulate without syncing the replicated gradients (DDP's no_sync); the
            # last one all-reduces their sums
            inner = distributed and k < ns.accum - 1
            with target.no_sync() if inner else contextlib.nullcontext():
                with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=ns.amp == "bf16"):
                    loss = target(x) / ns.accum
                loss.backward()
            partial += float(loss.detach())
            glob += target.global_loss(loss) if distributed else float(loss.detach())
        if distributed:
            norm = target.clip_grad_norm_(ns.clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(target.parameters(), ns.clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad()
        rec = {"rank": rank, "step": step, "loss": partial, "global_loss": glob, "grad_norm": float(norm),
               "lr": lr, "rows": read, "step_s": time.perf_counter() - t0}  # fmt: skip
        records.append(rec)
        print(json.dumps(rec), file=out, flush=True)
        if ns.ckpt_dir and step + 1 in ns.save_at:
            hapnb.save_checkpoint(Path(ns.ckpt_dir, f"step{step + 1}"), target, opt, step=step + 1,
                                  sched=sched.state_dict())  # fmt: skip
    return records, target


def main(argv: Sequence[str] | None = None) -> int:
    from hapnb import destroy_groups

    try:
        run(argv)
    finally:
        destroy_groups()  # garbage first: a distributed module's groups must not outlive the interpreter
    return 0


if __name__ == "__main__":
    sys.exit(main())
