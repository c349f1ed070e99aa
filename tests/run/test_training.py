"""The training helpers of ``hapnb.distribute`` (tied weights once, eval() without dropout, the batch
shares, the global loss, clipping by the global norm, the strict state-dict round trip, fail-fast checks)
against one device in float64, and bf16 autocast on a row-parallel plan against one device's autocast
run, and both float32 plans applied to their models cast to bfloat16 against one device's bfloat16 run,
on 3 uneven gloo ranks (1xV100+2xP100) run as this file's ``worker``.

    python tests/run/test_training.py worker PLAN.json OUT_DIR AMP_PLAN.json    # one rank, under torchrun's env
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "1xV100+2xP100"
ROWS, BATCH, SEQ, VOCAB = 40, 12, 6, 16  # 3 global batches of 12 rows and a short one of 4


class TinyTiedLM(nn.Module):
    """An LM whose output projection is its embedding (tied, as GPT-2's), with dropout."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.4)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.drop(torch.tanh(self.mix(self.norm(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class Conv1D(nn.Module):
    """GPT-2's linear layer: ``addmm(bias, x, weight)`` with the weight stored (in, out)."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o) * 0.3)
        self.bias = nn.Parameter(torch.randn(o) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class RowParallelMLP(nn.Module):
    """Two Conv1D layers and a linear head, for a plan with a row-parallel ``addmm`` (bias on rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = Conv1D(8, 16), Conv1D(16, 8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.down(torch.relu(self.up(x)))), y)


def build_mlp() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return RowParallelMLP(), (
        torch.randn(BATCH, 8, generator=gen),
        torch.randint(0, 5, (BATCH,), generator=gen),
    )


def build(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and a dataset of ``ROWS`` rows (tokens, next tokens)."""
    torch.manual_seed(seed)
    model = TinyTiedLM()
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)
    return model, data[:, :-1].contiguous(), data[:, 1:].contiguous()


def make_plan(**kw):  # type: ignore[no-untyped-def]
    import hapnb

    model, tokens, targets = build()
    return hapnb.synthesize(model, CLUSTER, example_inputs=(tokens[:BATCH], targets[:BATCH]), **kw)


# ------------------------------------------------------------------------------------ in one process


def test_pin_on_the_unused_name_of_a_tied_weight_is_refused() -> None:
    """The program uses the tied tensor as head.weight only: a pin on embed.weight would be ignored."""
    import hapnb
    from hapnb.runtime.codegen import generate
    from hapnb.runtime.program import CodegenError

    plan = make_plan(pins={"embed.weight": hapnb.FullShard(0)})
    loaded = {i.tensor for i in plan.program if i.kind == "load"}
    assert "head.weight" in loaded and "embed.weight" not in loaded
    with pytest.raises(
        CodegenError, match=r"pins embed.weight=zero3\(0\).*tied to head.weight.*pin head.weight="
    ):
        generate(plan, plan.graph, 0)


def test_sampler_shares_and_refusals() -> None:
    from hapnb.run.training import ShareSampler, batch_share

    mine = ShareSampler(28, batch=12, shares=(6, 3, 3), rank=1, seed=5)
    every = ShareSampler(28, batch=12, shares=None, rank=1, seed=5)
    assert len(mine) == 3 and [len(b) for b in mine] == [3, 3, 1]  # the short batch of 4 rows: 2, 1, 1
    assert [b[6:9] for b in list(every)[:2]] == list(mine)[:2] and list(every)[2][2:3] == list(mine)[2]
    first = list(mine)
    mine.set_epoch(1)
    assert list(mine) != first
    assert len(ShareSampler(30, batch=12, shares=(6, 3, 3), rank=0, drop_last=True)) == 2
    with pytest.raises(
        ValueError, match=r"short last batch of 6 rows.*\(6, 3, 3\) of 12 rows do not split 6.*drop_last"
    ):
        ShareSampler(30, batch=12, shares=(6, 3, 3), rank=0)
    assert batch_share(("x", "y"), ((0, 6, 3), (0, 6, 3)), (12, 12), lambda n, d: (6, 3, 3)) == (
        12,
        (6, 3, 3),
    )
    with pytest.raises(ValueError, match="cut alike on dim 0"):
        batch_share(("x", "y"), ((0, 6, 3), (-1, 0, 12)), (12, 12), lambda n, d: (6, 3, 3))


def test_example_inputs_come_from_the_plans_model_spec() -> None:
    """A plan loaded from JSON keeps no graph; its zoo model spec rebuilds the example inputs."""
    import hapnb
    from hapnb import zoo
    from hapnb.plans.plan import Plan
    from hapnb.run.distribute import _example_inputs
    from hapnb.runtime.codegen import generate

    made = hapnb.synthesize("mlp", "2xV100", **zoo.TINY["mlp"])
    plan = Plan.from_json(made.to_json())
    assert plan.graph is None
    _, inputs, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    # and a rank program refuses a global batch of another shape (it used to cut a bigger one short)
    prog = generate(made, made.graph, 1, inputs="local")
    assert [tuple(x.shape) for x in prog.local_inputs(*inputs)] != [tuple(x.shape) for x in inputs]
    bigger = tuple(torch.cat([x, x]) for x in inputs)
    with pytest.raises(
        ValueError, match=r"rank 1: input .* has shape \(16, .*takes the global batch as \(8, "
    ):
        prog.local_inputs(*bigger)
    got = _example_inputs(plan, None)
    assert [x.shape for x in got] == [x.shape for x in inputs]
    with pytest.raises(ValueError, match="needs example_inputs"):
        _example_inputs(Plan.from_json({**plan.to_json(), "model": {}}), None)


@contextlib.contextmanager
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process, destroyed on the way out."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_eval_is_refused_where_the_program_updates_batch_norm_statistics(tmp_path: Path) -> None:
    import hapnb

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.net(x), y)

    wrapped = Loss()
    plan = hapnb.synthesize(wrapped, "1xV100", example_inputs=(x, y))
    with one_rank_group(tmp_path):
        dm = hapnb.distribute(wrapped, plan, example_inputs=(x, y))
        assert float(dm(x, y).detach()) == pytest.approx(float(wrapped(x, y).detach()), rel=1e-6)
        dm.eval()
        with pytest.raises(RuntimeError, match="eval\\(\\) on a model that updates buffers"):
            dm(x, y)


def test_gpt2_full_state_dict_loads_strictly(tmp_path: Path) -> None:
    """A Hugging Face GPT-2 with eager attention (the tracer lifts constants) and tied head: the
    gathered state dict loads into the model with strict=True, and a float32 plan runs it in float64 and
    in bfloat16."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import hapnb
    from examples.corpus import TokensLoss, _finish

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_embd=8, n_layer=1, n_head=2, n_positions=8, attn_implementation="eager")
    model = _finish(
        GPT2LMHeadModel(cfg), "gpt2", lambda m, ids: m(input_ids=ids, labels=ids).loss, TokensLoss
    )
    ids = torch.randint(0, 32, (2, 8))
    plan = hapnb.synthesize(model, "1xV100", example_inputs=(ids,))
    assert any(plan.graph.tensors[t].role == "const" for t in plan.graph.params)
    with one_rank_group(tmp_path):
        model64 = copy.deepcopy(model).double().eval()
        dm = hapnb.distribute(model64, plan, example_inputs=(ids,))
        state = hapnb.full_state_dict(dm)
        fresh = copy.deepcopy(model64)
        for p in fresh.parameters():
            p.data.zero_()
        fresh.load_state_dict(state, strict=True)
        assert sorted(state) == sorted(model64.state_dict())
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model64.state_dict().items())
        assert fresh.model.lm_head.weight is fresh.model.transformer.wte.weight
        with torch.no_grad():
            want = float(model64(ids))  # HF's loss upcasts the logits to float32; the program keeps float64
            assert dm.global_loss(dm(*dm.local_inputs(ids))) == pytest.approx(want, rel=1e-6)
        # and in bfloat16: HF's loss upcasts the logits to float32, the program (a float32 trace) does not
        model16 = copy.deepcopy(model).to(torch.bfloat16).eval()
        dm16 = hapnb.distribute(model16, plan, example_inputs=(ids,))
        with torch.no_grad():
            loss16 = dm16(*dm16.local_inputs(ids))
            assert loss16.dtype == torch.bfloat16
            assert dm16.global_loss(loss16) == pytest.approx(float(model16(ids)), rel=2e-2)


# ------------------------------------------------------------------------------------ on 3 ranks


@pytest.mark.slow
def test_training_helpers_equal_one_device(tmp_path: Path) -> None:
    import hapnb

    # the tied weight stored sharded (ZeRO-3), the batch in uneven shares (6, 3, 3 rows)
    pins = {"head.weight": hapnb.FullShard(0), "tokens": hapnb.Shard(0), "targets": hapnb.Shard(0)}
    plan = make_plan(pins=pins, ratios=[0.5, 0.25, 0.25])
    assert plan.lengths_of("tokens", 0) == plan.lengths_of("targets", 0) == (6, 3, 3)
    plan.save(tmp_path / "plan.json")
    # bf16 autocast on a plan with a row-parallel addmm (its bias added on rank 0 only): issue 20
    mlp, ex = build_mlp()
    pins = {"up.weight": hapnb.Shard(1), "down.weight": hapnb.Shard(0)}
    amp = hapnb.synthesize(mlp, CLUSTER, example_inputs=ex, pins=pins, ratios=[0.5, 0.25, 0.25])
    assert any(
        i.kind == "compute" and i.target == "aten.addmm.default" and i.outputs[0][1] == "R"
        for i in amp.program
    )
    assert any(i.name == "load_sfb" for i in amp.program), "no SFB op: its custom backward is untested"
    amp.save(tmp_path / "amp.json")
    paths = (tmp_path / "plan.json", tmp_path, tmp_path / "amp.json")
    argv = [sys.executable, __file__, "worker", *map(str, paths)]
    from procs import run_ranks  # tests/ helper; this file also runs as a rank worker, without it

    run_ranks(argv, 3, {"PYTHONPATH": str(ROOT)})
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    r0 = out[0]
    # a tied weight once: in the program's list and in parameters()
    assert r0["tied"] == [["embed.weight", "head.weight"]] and r0["locals_once"]
    assert r0["n_params"] == r0["n_model_params"]
    assert r0["sharded"], "the plan shards no weight: clipping is not tested on shards"
    # each rank read only its rows (the short last batch of 4 split 2, 1, 1); together every batch, once
    rows = [o["rows"] for o in out]
    assert [[len(b) for b in rows[r]] for r in range(3)] == [[6, 6, 6, 2], [3, 3, 3, 1], [3, 3, 3, 1]]
    for b in range(4):
        assert sorted(sum((rows[r][b] for r in range(3)), [])) == sorted(r0["global_rows"][b])
    assert sorted(sum(r0["global_rows"], [])) == list(range(ROWS))
    # global loss, clipped norm and weights after 3 steps: those of one device
    for o in out:
        for gl, rl, norm, rnorm in o["steps"]:
            assert gl == pytest.approx(rl, rel=1e-10) and norm == pytest.approx(rnorm, rel=1e-10)
        assert o["clipped"] and o["weights_rel"] < 1e-10
        assert o["no_sync_events"] == 0  # replicated gradients waited for the synced backward
        assert o["eval_no_grad"] == pytest.approx(o["eval_ref"], rel=1e-10)
        assert o["train_losses_differ"], "dropout is off while training"
        assert o["state_keys"] == sorted(TinyTiedLM().state_dict())
        assert o["stream_seed"] == 100  # rank 0's seed, on every rank
    msgs = r0["errors"]
    for o in out:  # a global batch of 16 rows runs the same program split 8, 4, 4
        assert o["batch16"] == pytest.approx(o["batch16_ref"], rel=1e-10)
    assert "10 rows do not give every rank a whole share" in msgs["batch10"]
    assert "global (12, 6)" in msgs["batch10"] and "synthesize a plan" in msgs["batch10"]
    assert "short last batch of 10 rows" in msgs["short_sampler"]
    assert all(
        "rank 2's model starts from other weights than rank 0's" in o["errors"]["weights"] for o in out
    )
    assert all("rank 1's plan differs from rank 0's in 'ratios'" in o["errors"]["plan"] for o in out)
    assert all("dm.no_sync()" in o["errors"]["accumulate"] for o in out)
    for o in out:  # bf16 autocast: one device's loss and step, to bf16 precision
        assert o["amp_dtype"] == "torch.float32" and o["amp_loss"] == pytest.approx(o["amp_ref"], rel=1e-2)
        assert o["amp_weights_rel"] < 2e-2
    for o in out:  # float32 plans on the models cast to bfloat16 (issue 20): one device's bf16 run
        for key in ("bf16_tied", "bf16_rowpar"):
            got = o[key]
            assert got["dtypes"] == ["torch.bfloat16"], f"{key}: the program does not run in bfloat16"
            assert got["loss"] == pytest.approx(got["ref"], rel=2e-2), key
            assert got["grad_rel"] < 5e-2, f"{key}: gradients {got['grad_rel']:.3g} off one device's"


def _error(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return ""


def worker(plan_path: str, out_dir: str, amp_path: str) -> None:
    """One rank: train 3 steps on its share with clipping (eval mode: no dropout) beside one device;
    then one step under bf16 autocast on the row-parallel plan ``amp_path``."""
    import dataclasses

    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from hapnb import destroy_groups
    from hapnb.plans.plan import Plan
    from hapnb.run.distribute import distribute, full_state_dict
    from hapnb.run.training import check_same_everywhere, plan_digests, weight_sums

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = Plan.load(plan_path)
    model, tokens, targets = build()
    model = model.double()  # the plan was made at float32
    ref = copy.deepcopy(model).eval()
    ex = (tokens[:BATCH], targets[:BATCH])
    dm = distribute(model, plan, example_inputs=ex)
    res: dict = {"errors": {}}
    from hapnb.run.training import rank0_seed

    torch.manual_seed(100 + rank)  # ranks seeded apart still agree on their random ops' stream
    res["stream_seed"] = rank0_seed()
    res["tied"] = [sorted(p.names) for p in dm.program.params if p.aliases]
    res["locals_once"] = len({p.local_name for p in dm.program.params}) == len(dm.program.params)
    res["n_params"] = len(list(dm.parameters()))
    res["n_model_params"] = len(list(model.parameters()))
    res["sharded"] = [p.name for p in dm.program.params if p.sharded and p.kind == "param"]
    dm.eval()
    opt = torch.optim.SGD(dm.parameters(), lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    sampler = dm.batch_sampler(ROWS, seed=3)
    loader = DataLoader(TensorDataset(tokens, targets), batch_sampler=sampler)
    res["rows"], res["global_rows"], res["steps"] = list(sampler), [], []
    clipped = False
    for (x, y), mine in zip(loader, res["rows"]):
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        rows = sum(every, [])
        res["global_rows"].append(rows)
        loss = dm(x, y)
        loss.backward()
        norm = float(dm.clip_grad_norm_(0.05))
        gl = dm.global_loss(loss)
        opt.step()
        opt.zero_grad()
        rl = ref(tokens[rows], targets[rows])
        rl.backward()
        rnorm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        clipped = clipped or rnorm > 0.05
        ropt.step()
        ropt.zero_grad()
        res["steps"].append([gl, float(rl), norm, rnorm])
    res["clipped"] = clipped
    # gradient accumulation over two global batches: the first backward under no_sync starts no all-reduce,
    # the second all-reduces the accumulated sums (DDP's no_sync), equal to one device's two backwards
    events = len(dm.buckets.events)
    with dm.no_sync():
        dm(*dm.local_inputs(tokens[:BATCH], targets[:BATCH])).backward()
    res["no_sync_events"] = len(dm.buckets.events) - events
    dm(*dm.local_inputs(tokens[BATCH : 2 * BATCH], targets[BATCH : 2 * BATCH])).backward()
    opt.step()
    opt.zero_grad()
    ref(tokens[:BATCH], targets[:BATCH]).backward()
    ref(tokens[BATCH : 2 * BATCH], targets[BATCH : 2 * BATCH]).backward()
    ropt.step()
    ropt.zero_grad()
    # a second backward onto gradients that already hold all-reduced sums would count them once per rank
    first = dm.local_inputs(tokens[:BATCH], targets[:BATCH])
    dm(*first).backward()
    res["errors"]["accumulate"] = _error(lambda: dm(*first).backward())
    opt.zero_grad()
    full, want = full_state_dict(dm), ref.state_dict()
    res["state_keys"] = sorted(full)
    res["weights_rel"] = max(float((full[k] - v).abs().max() / v.abs().max()) for k, v in want.items())
    local = dm.local_inputs(*ex)
    with torch.no_grad():
        res["eval_no_grad"] = dm.global_loss(dm(*local))
        res["eval_ref"] = float(ref(*ex))
        dm.train()
        res["train_losses_differ"] = dm.global_loss(dm(*local)) != dm.global_loss(dm(*local))
        dm.eval()
        res["batch16"] = dm.global_loss(dm(*dm.local_inputs(tokens[:16], targets[:16])))
        res["batch16_ref"] = float(ref(tokens[:16], targets[:16]))
    res["errors"]["batch10"] = _error(lambda: dm.local_inputs(tokens[:10], targets[:10]))
    res["errors"]["short_sampler"] = _error(lambda: dm.batch_sampler(46))
    # the fail-fast check distribute makes once (here without tracing again): a rank built with another
    # seed, a rank holding another plan
    other, _, _ = build(seed=7 if rank == 2 else 0)
    info = {
        "error": None,
        "plan": plan_digests(plan),
        "graph": "g",
        "weights": weight_sums(other.state_dict()),
    }
    res["errors"]["weights"] = _error(lambda: check_same_everywhere(info))
    if rank == 1:
        plan = dataclasses.replace(plan, ratios=tuple(tuple(reversed(r)) for r in plan.ratios))
    info = {"error": None, "plan": plan_digests(plan), "graph": "g", "weights": {}}
    res["errors"]["plan"] = _error(lambda: check_same_everywhere(info))
    res.update(autocast_step(Plan.load(amp_path)))
    tied, _, _ = build()
    res["bf16_tied"] = bf16_step(Plan.load(plan_path), tied.eval(), ex)
    mlp, mlp_ex = build_mlp()
    res["bf16_rowpar"] = bf16_step(Plan.load(amp_path), mlp, mlp_ex)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    destroy_groups()


def autocast_step(plan) -> dict:  # type: ignore[no-untyped-def]
    """One SGD step with the forward under bf16 autocast, on the plan and on one device."""
    from hapnb.run.distribute import distribute, full_state_dict

    model, ex = build_mlp()
    ref = copy.deepcopy(model)
    dm = distribute(model, plan, example_inputs=ex)
    opt, ropt = torch.optim.SGD(dm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = dm(*dm.local_inputs(*ex))
        rl = ref(*ex)
    loss.backward()
    rl.backward()
    opt.step()
    ropt.step()
    full, want = full_state_dict(dm), ref.state_dict()
    rel = max(float((full[k] - v).abs().max() / v.abs().max()) for k, v in want.items())
    return {
        "amp_dtype": str(loss.dtype),
        "amp_loss": dm.global_loss(loss),
        "amp_ref": float(rl),
        "amp_weights_rel": rel,
    }


def bf16_step(plan, model: nn.Module, ex: tuple) -> dict:  # type: ignore[no-untyped-def]
    """A float32 plan on ``model`` cast to bfloat16: one forward and backward on the plan and on one
    device (the same bf16 model, the whole batch); the dtypes the program ran in, both losses, and the
    largest gradient difference relative to each tensor's largest one-device gradient."""
    from hapnb.run.distribute import distribute
    from hapnb.runtime import collectives as C

    model = model.to(torch.bfloat16)
    ex = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in ex)
    ref = copy.deepcopy(model)
    dm = distribute(model, plan, example_inputs=ex)
    loss = dm(*dm.local_inputs(*ex))
    loss.backward()
    rl = ref(*ex)
    rl.backward()
    dtypes = {str(loss.dtype)} | {str(p.grad.dtype) for p in dm.parameters() if p.grad is not None}
    own = dict(dm.module.named_parameters())
    want = dict(ref.named_parameters(remove_duplicate=False))
    rel = 0.0
    with torch.no_grad():
        for p in dm.program.unique_params:
            if p.kind != "param":
                continue
            g = own[p.local_name].grad.contiguous()
            full = C.all_gather(g, p.dim, p.lengths) if p.sharded else g
            w = want[p.name].grad
            rel = max(rel, float((full.float() - w.float()).abs().max() / w.float().abs().max()))
    return {"dtypes": sorted(dtypes), "loss": dm.global_loss(loss), "ref": float(rl), "grad_rel": rel}


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(*sys.argv[2:])
