"""Step time of ``hapnb.distribute`` against PyTorch DDP on local gloo ranks (issue 20: distribute was several
times slower than DDP when every replicated gradient went in its own blocking all-reduce).

The same model and batch run three ways on ``--nproc`` CPU ranks: DDP on the plain model with the
batch split evenly, ``distribute(..., grad_sync="sync")`` (one all-reduce per gradient inside autograd)
and ``distribute(..., grad_sync="buckets")`` (the default: DDP-like buckets started during the backward),
each with a data-parallel plan on ``nproc`` equal devices (so the three split the batch alike). Median
step time (forward, backward, SGD step) over ``--steps`` steps after 3 warm-up steps, per rank the
slowest.

    python benchmarks/distribute_speed.py --nproc 3 --steps 20 --out docs/benchmarks/distribute-speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hapnb  # noqa: E402
from hapnb import zoo  # noqa: E402

MODEL = dict(layers=4, hidden=256, heads=4, seq=64, vocab=512)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(step, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for k in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if k >= 3:
            out.append(float(dt))
    return out


def _rank(rank: int, nproc: int, port: int, plan_json: dict, batch: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    plan = hapnb.Plan.from_json(plan_json)
    model, inputs, _ = zoo.build("gpt", devices=nproc, batch=batch, **MODEL)
    share = batch // nproc
    local = tuple(x[rank * share : (rank + 1) * share] for x in inputs)
    res = {}
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def ddp_step() -> None:
        ddp(*local).backward()
        opt.step()
        opt.zero_grad()

    res["ddp"] = _timed(ddp_step, steps)
    for mode in ("sync", "buckets"):
        fresh, full, _ = zoo.build("gpt", devices=nproc, batch=batch, **MODEL)
        dm = hapnb.distribute(fresh, plan, example_inputs=full, grad_sync=mode)
        mine = dm.local_inputs(*full)
        opt = torch.optim.SGD(dm.parameters(), lr=1e-3)

        def step(dm=dm, mine=mine, opt=opt) -> None:
            dm(*mine).backward()
            opt.step()
            opt.zero_grad()

        res[mode] = _timed(step, steps)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    hapnb.destroy_groups()  # garbage first: a distributed module must not outlive the groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--out", default="")
    ns = ap.parse_args()
    cluster = f"{ns.nproc}xV100"
    plan = hapnb.baselines("gpt", cluster, batch=ns.batch, **MODEL)["dp_ev"]  # data parallel, even shares
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"distribute_speed_{os.getpid()}.json"
    mp.spawn(_rank, args=(ns.nproc, _port(), plan.to_json(), ns.batch, ns.steps, str(tmp)), nprocs=ns.nproc)
    raw = json.loads(tmp.read_text())
    tmp.unlink()
    rows = {k: {"median_s": statistics.median(v), "steps": len(v)} for k, v in raw.items()}
    ddp = rows["ddp"]["median_s"]
    for r in rows.values():
        r["vs_ddp"] = r["median_s"] / ddp
    result = {"nproc": ns.nproc, "batch": ns.batch, "model": {"name": "gpt", **MODEL}, "rows": rows,
              "machine": f"{os.cpu_count()} cores, torch {torch.__version__}"}  # fmt: skip
    print(json.dumps(result, indent=1))
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
