"""Train a model with a hapnb plan under torchrun: ``distribute`` + ``full_state_dict``.

    torchrun --nproc-per-node 2 examples/train.py --model mlp --cluster 2xV100 --steps 20
    torchrun --nproc-per-node 4 examples/train.py --model gpt --cluster 2xV100+2xP100 --layers 2 \
        --hidden 64 --heads 4 --vocab 128 --seq 16 --out trained.pt

Every rank builds the same model (same seed), rank 0 synthesizes the plan (or loads ``--plan``) and
sends it to the others as JSON, each rank keeps its own slice of the weights, and the program's
collectives synchronise the gradients (no DDP). At the end the full weights are gathered on every rank;
rank 0 checks them against a single-device evaluation and can save them (``--out``) as a plain
``state_dict`` for ``model.load_state_dict``. ``--check`` also asserts that gathering the untouched
weights gives back the original model exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from hapnb import destroy_groups, zoo
from hapnb.plans.plan import Plan
from hapnb.run.distribute import distribute, full_state_dict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", help="zoo model name or package.module:factory")
    ap.add_argument("--cluster", default=None, help="cluster spec (default: WORLD_SIZE x V100)")
    ap.add_argument("--plan", default=None, help="a plan JSON made for this model (skips synthesis)")
    ap.add_argument("--ratios", default=None, help="fixed ratios r1,r2,... (no LP)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--out", default=None, help="rank 0 saves the trained full state_dict here")
    ap.add_argument("--check", action="store_true", help="assert the full_state_dict round trip is exact")
    for opt in ("layers", "hidden", "batch", "seq", "heads", "vocab", "input"):
        ap.add_argument(f"--{opt}", type=int, default=None)
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    try:
        train(args)
    finally:
        destroy_groups()  # garbage first: a distributed module's groups must not outlive the interpreter
    return 0


def train(args: argparse.Namespace) -> None:
    """Plan (rank 0), distribute, train ``args.steps`` steps and check the gathered weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)

    opts = {k: getattr(args, k) for k in ("layers", "hidden", "batch", "seq", "heads", "vocab", "input")}
    model, inputs, _ = zoo.build(
        args.model, devices=world, **{k: v for k, v in opts.items() if v is not None}
    )

    # the plan is computed once (rank 0) and shipped to every rank
    box: list = [None]
    if rank == 0:
        if args.plan:
            box[0] = json.dumps(Plan.load(args.plan).to_json())
        else:
            from hapnb.plans.synthesis import synthesize

            ratios = [float(x) for x in args.ratios.split(",")] if args.ratios else None
            plan0 = synthesize(
                args.model,
                args.cluster or f"{world}xV100",
                ratios=ratios,
                **{k: v for k, v in opts.items() if v is not None},
            )
            box[0] = json.dumps(plan0.to_json())
    dist.broadcast_object_list(box, src=0)
    plan = Plan.from_json(json.loads(box[0]))
    if rank == 0:
        print(plan.summary(), flush=True)

    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dm = distribute(model.to(device), plan, example_inputs=inputs, inputs="local")
    if args.check:
        full = full_state_dict(dm)
        missing = sorted(k for k, _ in model.named_parameters() if k not in full)
        assert not missing, f"full_state_dict lacks {missing}"
        for k, v in full.items():
            if k in original:
                assert torch.equal(v.cpu(), original[k]), f"rank {rank}: {k} does not round-trip"
        print(f"rank {rank}: full_state_dict round trip exact ({len(full)} tensors)", flush=True)

    batch = tuple(x.to(device) for x in dm.local_inputs(*inputs))
    opt = torch.optim.Adam([p for p in dm.parameters() if p.requires_grad], lr=args.lr)
    last = float("nan")
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = dm(*batch)  # this rank's partial loss
        loss.backward()  # the program's collectives synchronise every gradient
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        last = float(total)
        if rank == 0:
            print(json.dumps({"step": step, "loss": last}), flush=True)

    full = full_state_dict(dm)
    if rank == 0:
        model.load_state_dict({k: v.cpu() for k, v in full.items() if k in original}, strict=False)
        model.eval()  # the single-device check runs without dropout
        with torch.no_grad():
            single = float(model.cpu()(*inputs))
        print(json.dumps({"trained_single_device_loss": single, "last_step_loss": last}), flush=True)
        if args.out:
            torch.save({k: v.cpu() for k, v in full.items()}, args.out)
            print(f"saved the full state_dict to {args.out}", flush=True)
    dist.barrier()  # let every rank finish before the group goes away


if __name__ == "__main__":
    sys.exit(main())
