"""The runtime does what the overlap simulator assumes: replicated gradients all-reduced in async DDP-like
buckets during the backward (hapnb.run.buckets), and HiDup's duplex schedule (hapnb.run.duplex): two
micro-batches per rank, one's collectives in flight while the other computes. Both verify against one
device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from synthetic import DP_PINS

import hapnb as hap
from hapnb import zoo
from hapnb.plans.plan import Plan
from hapnb.plans.synthesis import synthesize
from hapnb.run.buckets import GradBuckets
from hapnb.run.duplex import DuplexError, DuplexRunner, half_plan, loss_scale, split_batch
from hapnb.run.verify import verify
from hapnb.runtime import collectives as C
from hapnb.runtime.codegen import generate
from hapnb.tracing import trace

TIED = "examples.factories:tied_lm"
MIB = 2**20


@pytest.fixture(scope="module")
def tp_plan() -> Plan:
    """The searched mlp program on two devices: an all-gather and a reduce-scatter of features."""
    plan = synthesize("mlp", "2xV100", layers=2, hidden=64, batch=8, pick="cost")
    assert {i.name for i in plan.program if i.kind == "collective"} & {"all_gather", "grouped_all_gather"}
    return plan


# ============================================================================== buckets, one process


def _meta(n: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(n, device="meta"))


def test_bucket_formation_follows_ddp_by_hand() -> None:
    """Forward order a, b, c, d (float32): gradients become ready d, c, b, a. The first bucket closes at
    >= 1 MiB: d (40 B) + c (28 MB) -> (d, c); then b (400 B) + a (1.2 MB) stay under 25 MiB -> (b, a).
    A tied parameter listed twice counts once."""
    a, b, c, d = _meta(300_000), _meta(100), _meta(7_000_000), _meta(10)
    gb = GradBuckets([("a", a), ("b", b), ("a2", a), ("c", c), ("d", d)])
    assert gb.buckets == (("d", "c"), ("b", "a"))
    # caps of one byte: every gradient alone, in ready order
    assert GradBuckets([("a", a), ("b", b), ("c", c)], cap=1, first_cap=1).buckets == (("c",), ("b",), ("a",))
    # 30 MiB cap: after the 1 MiB first bucket, everything else fits one
    e = _meta(262_144)  # exactly 1 MiB: closes the first bucket alone
    assert GradBuckets([("a", a), ("b", b), ("e", e)], cap=30 * MIB).buckets == (("e",), ("b", "a"))


def test_bucket_starts_before_the_backward_ends() -> None:
    """The last-used weight's bucket starts (its hook fires) before autograd reaches the first layer:
    the input's gradient hook, the last thing the backward computes, comes after it."""
    torch.manual_seed(0)
    w1, w2, w3 = (torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3))
    x = torch.randn(2, 4, requires_grad=True)
    log: list[str] = []
    gb = GradBuckets(
        [("w1", w1), ("w2", w2), ("w3", w3)], cap=1, first_cap=1, on_event=lambda k, b: log.append(f"{k}{b}")
    )
    x.register_hook(lambda g: log.append("input-grad"))
    (x @ w1 @ w2 @ w3).sum().backward()
    assert gb.buckets == (("w3",), ("w2",), ("w1",))
    assert log[:2] == ["start0", "start1"]  # w3 and w2 went out while the backward still ran
    assert log.index("start0") < log.index("input-grad")
    assert gb.started() == 3
    assert gb.wait() == 3
    assert log[-3:] == ["done0", "done1", "done2"]


def test_tied_weight_ready_once_and_missing_gradient_is_zero() -> None:
    """A weight used twice is ready once, after both uses accumulated (its gradient is the sum); a weight
    that gets no gradient still lets its bucket finish (zeros); buckets reset every step."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    unused = torch.nn.Parameter(torch.ones(3))
    v = torch.nn.Parameter(torch.tensor([3.0]))
    gb = GradBuckets([("w", w), ("unused", unused), ("v", v)], cap=10**9, first_cap=10**9)
    assert gb.buckets == (("v", "unused", "w"),)
    for step in range(2):
        w.grad = v.grad = unused.grad = None
        ((w * v).sum() + (w * w).sum()).backward()
        assert gb.started() == 0  # 'unused' never became ready
        gb.wait()
        assert w.grad.tolist() == [3.0 + 2.0, 3.0 + 4.0]
        assert v.grad.tolist() == [3.0]
        assert unused.grad.tolist() == [0.0, 0.0, 0.0]
        assert [e for e in gb.events if e[0] == "start"] == [("start", 0)] * (step + 1)


def test_two_backwards_before_wait_is_refused() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    gb = GradBuckets([("w", w)])
    (w * 2).sum().backward()
    (w * 3).sum().backward()  # accumulates after the bucket went out: the sum would miss it
    with pytest.raises(RuntimeError, match="two backward passes before wait"):
        gb.wait()


def test_destroy_groups_lets_go_of_live_buckets_and_a_later_backward_raises(tmp_path) -> None:
    """A script that still holds its distributed module when it ends the job: destroy_groups closes the
    buckets' own group first (a group freed after the default one can abort gloo at exit), and a backward
    after that is refused instead of syncing nothing."""
    import torch.distributed as dist

    from hapnb import destroy_groups

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        a = torch.nn.Parameter(torch.ones(3))
        gb = GradBuckets([("a", a)], group=dist.new_group([0]))
        (a * 2).sum().backward()
        assert gb.wait() == 1 and a.grad.tolist() == [2.0, 2.0, 2.0]
        destroy_groups()
        assert not dist.is_initialized() and gb.group is None
        with pytest.raises(RuntimeError, match="process groups were destroyed"):
            (a * 2).sum().backward()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_codegen_buckets_leave_replicated_gradients_partial(dp_plan: Plan) -> None:
    """grad_sync='buckets' uses replicated weights without the in-graph all-reduce and lists them in
    order of first use; 'sync' keeps the in-graph replicate and lists none."""
    sync = generate(dp_plan, dp_plan.graph, 0, grad_sync="sync")
    bucketed = generate(dp_plan, dp_plan.graph, 0, grad_sync="buckets")
    reps = [n for n in sync.module.graph.nodes if n.target is C.replicate]
    assert len(reps) == 6 and sync.grad_sync == ()
    assert not any(n.target is C.replicate for n in bucketed.module.graph.nodes)
    want = tuple(
        f"{m}_{k}".replace(".", "_") for m in ("layers.0", "layers.1", "head") for k in ("weight", "bias")
    )
    assert bucketed.grad_sync == want
    with pytest.raises(ValueError, match="grad_sync"):
        generate(dp_plan, dp_plan.graph, 0, grad_sync="later")


def test_sfb_loaded_weights_are_not_bucketed() -> None:
    """load_sfb weights get their full gradient from the SFB op itself: no bucket, no all-reduce."""
    plan = synthesize("mlp", "2xV100", ratios=[0.75, 0.25], pins=DP_PINS, **zoo.TINY["mlp"])
    sfb = {i.tensor for i in plan.program if i.name == "load_sfb"}
    assert sfb == set(DP_PINS) - {"x", "y"}
    prog = generate(plan, plan.graph, 0, grad_sync="buckets")
    assert prog.grad_sync == ()
    assert not any(n.target is C.replicate for n in prog.module.graph.nodes)


# ======================================================================== buckets, on gloo ranks


def _bucket_inputs(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    ws = [torch.randn(4, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    xs = [torch.randn(2, 4, generator=gen, dtype=torch.float64) for _ in range(world)]
    return ws, xs


def _bucket_rank(rank: int, world: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ws, xs = _bucket_inputs(world)
        params = [torch.nn.Parameter(w.clone()) for w in ws]
        x = xs[rank].clone().requires_grad_()
        log: list[str] = []
        gb = GradBuckets(
            [(f"w{k}", p) for k, p in enumerate(params)],
            group=dist.new_group(list(range(world))),
            cap=1,
            first_cap=1,
            on_event=lambda kind, b: log.append(f"{kind}{b}"),
        )
        x.register_hook(lambda g: log.append("input-grad"))
        for _ in range(2):  # two steps: the buckets reset in between
            for p in params:
                p.grad = None
            # a feature all-reduce (R -> I) whose backward all-reduce runs on the default group while
            # the buckets' all-reduces are in flight on theirs
            y = C.all_reduce(x @ params[0])
            (y @ params[1] @ params[2]).sum().backward()
            gb.wait()
        torch.save({"log": log, "grads": [p.grad for p in params]}, Path(outdir, f"rank{rank}.pt"))
    finally:
        from hapnb import destroy_groups

        destroy_groups()  # the buckets' own group goes first (freed after the default one, gloo can abort)


@pytest.mark.slow
def test_buckets_on_gloo_ranks_start_early_and_sum_exactly(tmp_path) -> None:
    """Three gloo ranks: buckets start before the backward reaches the input, and after the wait
    every rank holds the gradient of the single-device loss ``n * sum((sum_r x_r) w0 w1 w2)``."""
    import socket
    import time

    import torch.multiprocessing as mp

    world = 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        _bucket_rank, args=(world, port, str(tmp_path)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 90
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "gloo ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    ws, xs = _bucket_inputs(world)
    ref = [w.clone().requires_grad_() for w in ws]
    (world * (sum(xs) @ ref[0] @ ref[1] @ ref[2]).sum()).backward()
    for r in range(world):
        rec = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        for k in (0, 7):  # each step: w2's and w1's buckets went out before the backward reached x;
            # w0's gradient comes from the same matmul backward as x's (either order)
            log = rec["log"][k : k + 7]
            assert log[:2] == ["start0", "start1"] and set(log[2:4]) == {"start2", "input-grad"}
            assert log[4:] == ["done0", "done1", "done2"]
        for got, want in zip(rec["grads"], ref):
            torch.testing.assert_close(got, want.grad, rtol=1e-12, atol=1e-12)


# ======================================================================== buckets, verified on ranks


@pytest.mark.slow
def test_verify_buckets_data_parallel_every_gradient_its_own_bucket(dp_plan: Plan) -> None:
    """Six async all-reduces per step (one byte caps), two ranks on uneven batches (the in-graph path,
    grad_sync="sync", is what distribute and the equivalence suite run)."""
    report = verify(dp_plan, nproc=2, steps=3, bucket_cap=1, first_bucket_cap=1, timeout=120)
    assert report.ok, report.text()
    assert report.max_rel < 1e-10
    assert {c.kind for c in report.checks} == {"loss", "grad", "weight"}


@pytest.mark.slow
def test_verify_buckets_gpt_three_ranks() -> None:
    """GPT (tiny) on three ranks: layer norms, biases and the head replicated, bucketed during a
    backward that also runs feature collectives (on the default group)."""
    plan = synthesize("gpt", "3xV100", **zoo.TINY["gpt"])
    assert generate(plan, plan.graph, 0, grad_sync="buckets").grad_sync
    report = verify(plan, nproc=3, steps=2, bucket_cap=4096, first_bucket_cap=1024, timeout=150)
    assert report.ok, report.text()
    assert report.max_rel < 1e-10


@pytest.mark.slow
def test_verify_buckets_tied_weights() -> None:
    """examples.factories:tied_lm: the tied weight's gradient is ready after its last use."""
    plan = hap.synthesize(TIED, "2xV100")
    report = verify(plan, nproc=2, steps=3, bucket_cap=1, first_bucket_cap=1, timeout=120)
    assert report.ok, report.text()
    checked = {(c.kind, c.name) for c in report.checks}
    assert {("grad", "embed.weight"), ("grad", "head.weight")} <= checked
    assert report.max_rel < 1e-10


# ================================================================================ duplex, one process


def test_half_plan_halves_batch_lengths_only(tp_plan: Plan) -> None:
    model, inputs, _ = zoo.build_spec(zoo.ModelSpec.from_json(tp_plan.model_spec))
    half = trace(model, tuple(x[:4] for x in inputs))
    hp = half_plan(tp_plan, tp_plan.graph, half)
    full = {(t, d): ls for t, d, ls in tp_plan.lengths}
    for t, d, ls in hp.lengths:
        if tp_plan.graph.tensor(t).shape[d] == 8:  # the batch dim
            assert ls == tuple(n // 2 for n in full[(t, d)])
        else:
            assert ls == full[(t, d)]
    assert hp.lengths_of("y", 0) == (2, 2) and hp.graph_fingerprint == half.fingerprint


def test_half_plan_recuts_odd_segment_cuts_in_proportion(dp_plan: Plan) -> None:
    """An activation re-cut 5/3 (another segment's ratios) on a batch of 8: the half batch of 4 is cut
    in the same proportions, 2.5/1.5 rounded by largest remainder (tie -> lower rank) = 3/1, and a
    tensor cut alike gets the same cut; the inputs' even 6/2 cut halves exactly."""
    model, inputs, _ = zoo.build_spec(zoo.ModelSpec.from_json(dp_plan.model_spec))
    half = trace(model, tuple(x[:4] for x in inputs))
    odd = dataclasses.replace(dp_plan, lengths=(*dp_plan.lengths, ("linear", 0, (5, 3)), ("relu", 0, (5, 3))))
    hp = half_plan(odd, dp_plan.graph, half)
    assert hp.lengths_of("linear", 0) == hp.lengths_of("relu", 0) == (3, 1)
    assert hp.lengths_of("y", 0) == (3, 1) and dp_plan.lengths_of("y", 0) == (6, 2)
    feat = dataclasses.replace(dp_plan, lengths=(*dp_plan.lengths, ("linear", 1, (5, 3))))
    assert half_plan(feat, dp_plan.graph, half).lengths_of("linear", 1) == (5, 3)  # not a batch dim: kept
    gone = dataclasses.replace(dp_plan, lengths=(*dp_plan.lengths, ("no_such", 0, (4, 4))))
    with pytest.raises(DuplexError, match="has no tensor no_such"):
        half_plan(gone, dp_plan.graph, half)


def test_duplex_bundle_keeps_the_half_batch_trace(tp_plan: Plan, tmp_path) -> None:
    from hapnb.run.bundle import BundleError, load_bundle, write_bundle

    d = write_bundle(dataclasses.replace(tp_plan, duplex=True), tmp_path / "b")
    b = load_bundle(d)
    assert b.half_graph.tensor("x").shape == (4, 1024) and b.graph.tensor("x").shape == (8, 1024)
    assert load_bundle(write_bundle(tp_plan, tmp_path / "plain")).half_graph is None
    (d / "program_half.pt2").unlink()
    with pytest.raises(BundleError, match="duplex plan but the bundle has no half-batch program"):
        load_bundle(d)


def test_split_batch_keeps_each_ranks_samples(tp_plan: Plan, dp_plan: Plan) -> None:
    x = torch.arange(8.0)[:, None].expand(8, 1024).contiguous()
    y = torch.arange(8)
    cut, (mb0, mb1) = split_batch(tp_plan, tp_plan.graph, (x, y))
    assert cut == (4, 4)
    assert mb0[1].tolist() == [0, 1, 4, 5] and mb1[1].tolist() == [2, 3, 6, 7]
    assert mb0[0][:, 0].tolist() == [0.0, 1.0, 4.0, 5.0]
    # dp_plan cuts its batch 6/2: rank 0 keeps samples 0-5, rank 1 samples 6-7
    cut, (mb0, mb1) = split_batch(dp_plan, dp_plan.graph, (torch.zeros(8, 16), torch.arange(8)))
    assert cut == (6, 2) and mb0[1].tolist() == [0, 1, 2, 6] and mb1[1].tolist() == [3, 4, 5, 7]


def test_odd_local_batch_is_a_clear_error() -> None:
    plan = synthesize(
        "mlp",
        "2xV100",
        ratios=[0.5, 0.5],
        pins=DP_PINS,
        options={"sfb": False},
        **{**zoo.TINY["mlp"], "batch": 6},
    )
    xs = zoo.build_spec(zoo.ModelSpec.from_json(plan.model_spec))[1]
    with pytest.raises(DuplexError, match=r"input x has rank 0's local batch of length 3, which is odd"):
        split_batch(plan, plan.graph, xs)
    with pytest.raises(DuplexError, match="odd"):
        verify(dataclasses.replace(plan, duplex=True), nproc=2, steps=1)


def test_loss_scale_mean_and_sum() -> None:
    assert loss_scale(synthesize("mlp", "1xV100", **zoo.TINY["mlp"]).graph) == 0.5
    m, xs, _ = zoo.build("mlp", devices=1, **{**zoo.TINY["mlp"], "reduction": "sum"})
    assert loss_scale(trace(m, xs)) == 1.0


def _two_stage_program() -> fx.GraphModule:
    """relu -> all_gather -> *2 -> all_reduce -> sum, as a one-rank fx program."""
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    ag = g.call_function(C.all_gather, (r, 0, (3,)), {"padded": True})
    m = g.call_function(torch.mul, (ag, 2.0))
    ar = g.call_function(C.all_reduce, (m,))
    g.output(g.call_function(torch.sum, (ar,)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_duplex_runner_interleaves_the_micro_batches() -> None:
    """Micro-batch 0's all-gather starts, micro-batch 1 computes its first segment, and only then is
    micro-batch 0's result waited for (at its first use); the losses equal running each alone."""
    gm = _two_stage_program()
    a = torch.tensor([-1.0, 2.0, 3.0], requires_grad=True)
    b = torch.tensor([4.0, -5.0, 6.0], requires_grad=True)
    run = DuplexRunner(gm)
    la, lb = run((a,), (b,))
    assert (la.item(), lb.item()) == (gm(a).item(), gm(b).item()) == (10.0, 20.0)
    ev = run.events
    assert ev[:3] == [("compute", 0, "x"), ("start", 0, "all_gather"), ("compute", 1, "x")]
    assert ev.index(("start", 1, "all_gather")) < ev.index(("wait", 0, "all_gather"))
    assert ev.index(("start", 0, "all_reduce")) < ev.index(("wait", 1, "all_gather"))
    (la + lb).backward()  # the async results are attached to autograd
    assert a.grad.tolist() == [0.0, 2.0, 2.0] and b.grad.tolist() == [2.0, 0.0, 2.0]
    seq = DuplexRunner(gm, interleave=False)
    seq((a,), (b,))
    assert not any(e[0] == "start" for e in seq.events)
    assert [mb for _, mb, _ in seq.events] == [0, 1]


# ============================================================================= duplex, verified on ranks


@pytest.mark.slow
def test_verify_duplex_with_feature_collectives(tp_plan: Plan) -> None:
    report = verify(dataclasses.replace(tp_plan, duplex=True), nproc=2, steps=3, timeout=120)
    assert report.ok, report.text()
    assert report.max_rel < 1e-10
    assert {c.kind for c in report.checks} == {"loss", "grad", "weight"}


@pytest.mark.slow
def test_verify_duplex_all_to_all_both_schedules() -> None:
    """A pinned plan with an all-to-all (started async too): interleaved with buckets, and the two
    micro-batches one after the other with the in-graph gradient all-reduce."""
    pins = {"linear": hap.Shard(1), "relu": hap.Shard(0)}
    plan = dataclasses.replace(synthesize("mlp", "2xV100", pins=pins, **zoo.TINY["mlp"]), duplex=True)
    assert "all_to_all" in {i.name for i in plan.program if i.kind == "collective"}
    report = verify(plan, nproc=2, steps=2, timeout=120)
    assert report.ok, report.text()
    seq = verify(plan, nproc=2, steps=2, interleave=False, grad_sync="sync", timeout=120)
    assert seq.ok, seq.text()
    assert max(report.max_rel, seq.max_rel) < 1e-10


@pytest.mark.slow
def test_verify_duplex_gpt_uneven_and_data_parallel(dp_plan: Plan) -> None:
    plan = synthesize("gpt", "2xV100", duplex=True, **zoo.TINY["gpt"])  # searched for the duplex cost
    assert plan.duplex
    report = verify(plan, nproc=2, steps=2, timeout=150)
    assert report.ok, report.text()
    dp = verify(dataclasses.replace(dp_plan, duplex=True), nproc=2, steps=2, timeout=120)
    assert dp.ok, dp.text()  # batch cut 6/2: micro-batches of 3 + 1 samples


@pytest.mark.slow
def test_launch_runs_a_duplex_plan_json(tp_plan: Plan, tmp_path) -> None:
    """`hapnb launch` path: a duplex plan JSON (no graph in memory) is bundled with its half-batch trace
    rebuilt from the zoo spec, and the ranks' summed loss follows the single-device training run."""
    from hapnb.run.bundle import load_bundle
    from hapnb.run.launch import launch
    from hapnb.run.verify import run_reference

    path = dataclasses.replace(tp_plan, duplex=True).save(tmp_path / "plan.json")
    args = ["--no-dropout", "--dtype", "float64", "--optimizer", "sgd", "--grad-sync", "buckets"]
    res = launch(path, steps=3, extra_args=args, bundle_dir=tmp_path / "bundle").wait(120)
    assert res.ok, res.error
    b = load_bundle(tmp_path / "bundle")
    assert b.half_graph is not None and b.half_graph.tensor("y").shape == (4,)
    ref = run_reference(b.graph, b.inputs, 3, optimizer="sgd", dtype="float64")
    got = [m["global_loss"] for m in sorted(res.metrics, key=lambda m: m["step"]) if m["rank"] == 0]
    assert got == pytest.approx(ref["losses"], rel=1e-12)


@pytest.mark.slow
def test_verify_duplex_virtual_plan_with_segment_reshards() -> None:
    """Two machines of two GPUs (virtual devices, expanded to 4 ranks), per-layer segments: activations
    re-cut between segments (reshard, started async too) with odd cuts re-cut in proportion."""
    from hapnb.hardware.cluster import Cluster

    c = Cluster.parse("2xV100+2xP100").virtual()
    plan = synthesize(
        "gpt", c, segments="layer", pick="cost", **{**zoo.TINY["gpt"], "layers": 3, "batch": 16}
    )
    assert any(i.name == "reshard" for i in plan.program)
    report = verify(dataclasses.replace(plan, duplex=True), steps=2, timeout=150)
    assert report.ok, report.text()
    assert report.nproc == 4 and report.max_rel < 1e-10
