"""The stages of a pipeline plan: the model cut by torch.distributed.pipelining, and a stage run data
parallel over several devices (used by :mod:`hapnb.run.pipelined`, which documents the whole runtime).

* :func:`split_model` traces the model at one micro-batch size with
  ``torch.distributed.pipelining.pipeline`` (torch.export), cut where stages 1, 2, ... begin, and checks
  the cut: one stage per plan stage, each split point's module in the stage it begins, no parameter used
  by two stages (weights tied across stages), one scalar loss out of the last stage. The result, a
  :class:`Split`, names every value that crosses a stage boundary by a :data:`Key`.
* :class:`StageProgram` runs one stage as a chain link: it takes the values live at the boundary before
  it (and the model inputs it reads, as keyword inputs) and returns those live at the boundary after it
  (the loss for the last stage), so the library's one-rank-per-stage P2P chain carries every value a
  later stage needs.
* :class:`ShardedStage` (the stage leader's module) and :func:`serve` (the other devices of the stage)
  run one stage data parallel: the leader keeps its rows of every micro-batch and sends every other
  device its rows; two autograd functions, :class:`_Dispatch` and :class:`_Collect`, send the rows out
  before the leader computes its own and bring the outputs back after (backward: output gradients out,
  input gradients back, the other devices' backward overlapping the leader's). :class:`Sharding` says
  which boundary values are batch-sized (split by rows, concatenated back) and which are whole (sent
  whole, gradients summed), found by comparing the traces at two row counts.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ..runtime.program import tied_groups
from ..runtime.program import zero_dropout as _zero_dropout
from .duplex import loss_reduction

__all__ = [
    "Key", "Peers", "PipelineError", "ShardedStage", "Sharding", "Split", "StageProgram", "check_units", "remote_keys",
    "serve", "split_model",
]  # fmt: skip

#: A value of the cut model: ``("in", name)`` a model input, ``("out", stage, index)`` an output of a stage.
Key = tuple

_FORWARD, _BACKWARD, _END = 1, 2, 0  # the leader's requests to the other devices of its stage


class PipelineError(ValueError):
    """A pipeline plan cannot run: the model does not cut at its units, shares weights across stages, the
    plan does not fit the job (ranks, schedule, batch). The message says what and how to fix it."""


# ============================================================================================== split


@dataclass(eq=False)
class Split:
    """The model cut into stages (see the module docstring); ``pipe`` is the library's ``Pipe``."""

    pipe: Any
    rows: int  # the micro-batch rows it was traced at
    roots: tuple[str, ...]  # the model's inputs, in order
    feeds: tuple[tuple[Key, ...], ...]  # per stage: the arguments of its traced module
    produces: tuple[tuple[Key, ...], ...]  # per stage: its module's outputs
    tupled: tuple[bool, ...]  # per stage: whether its module returns a tuple
    carries: tuple[tuple[Key, ...], ...]  # carries[s]: stage outputs live at the boundary into stage s
    loss: Key
    metas: dict[Key, tuple[tuple[int, ...], torch.dtype]]
    reduction: str | None  # "mean" / "sum": how the loss reduces over the batch

    @property
    def stages(self) -> int:
        return len(self.feeds)

    def module(self, s: int) -> nn.Module:
        return self.pipe.get_stage_module(s)

    def inputs(self, s: int) -> tuple[Key, ...]:
        """Stage ``s``'s positional inputs: the model's inputs for stage 0, else its boundary values."""
        return tuple(("in", r) for r in self.roots) if s == 0 else self.carries[s]

    def root_inputs(self, s: int) -> tuple[str, ...]:
        """The model inputs stage ``s > 0`` reads (given to it as keyword inputs)."""
        return () if s == 0 else tuple(k[1] for k in self.feeds[s] if k[0] == "in")

    def outputs(self, s: int) -> tuple[Key, ...]:
        return (self.loss,) if s == self.stages - 1 else self.carries[s + 1]


@contextlib.contextmanager
def _restored_forwards(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """The library wraps each split module's ``forward`` to mark the cut; undo it afterwards so the
    model can be cut again (at another row count)."""
    saved = {n: dict(model.get_submodule(n).__dict__) for n in names}
    try:
        yield
    finally:
        for n, d in saved.items():
            m = model.get_submodule(n)
            for attr in ("forward", "_orig_forward"):
                if attr in d:
                    m.__dict__[attr] = d[attr]
                else:
                    m.__dict__.pop(attr, None)


def check_units(model: nn.Module, units: Sequence[str], what: str) -> None:
    """Every unit after ``units[0]`` must name a submodule of ``model``: a clear error otherwise."""
    known = {n for n, _ in model.named_modules() if n}
    bad = [u for u in units[1:] if u not in known]
    if bad:
        tops = sorted({n.split(".")[0] for n in known})
        raise PipelineError(
            f"{what}: unit {bad[0]!r} is not a submodule of the model (the plan's units are module names "
            f"where a stage may begin); the model's top-level modules are {', '.join(tops)}. "
            "Was the plan made for another model or other options?"
        )


def split_model(
    model: nn.Module,
    example: Sequence[torch.Tensor],
    points: Sequence[str],
    stages: int,
    *,
    dropout: bool = True,
    what: str = "pipeline plan",
) -> Split:
    """Cut ``model`` at ``points`` (module names where stages 1.. begin), traced at ``example`` (one
    micro-batch), into ``stages`` stages; ``dropout=False`` replaces dropout by identity."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    check_units(model, ["", *points], what)
    with _restored_forwards(model, points):
        try:
            pipe = pipeline(model, tuple(example), split_spec={p: SplitPoint.BEGINNING for p in points})
        except Exception as e:  # noqa: BLE001 - reported with the model and the cut
            raise PipelineError(
                f"{what}: torch.distributed.pipelining could not trace and cut the model at "
                f"{list(points)} ({type(e).__name__}: {e}); the model must export with torch.export"
            ) from e
    split = _structure(pipe, model, example, points, stages, what)
    if not dropout:
        for s in range(split.stages):
            _strip_dropout(split.module(s))
    return split


def _structure(
    pipe: Any,
    model: nn.Module,
    example: Sequence[torch.Tensor],
    points: Sequence[str],
    stages: int,
    what: str,
) -> Split:
    graph = pipe.split_gm.graph
    roots = [n for n in graph.nodes if n.op == "placeholder"]
    subs = [n for n in graph.nodes if n.op == "call_module"]
    if len(subs) != stages:
        calls = _call_counts(model, example, points)
        odd = [f"{p} ({c} calls)" for p, c in calls.items() if c != 1]
        why = (
            f"split modules not called exactly once per forward: {', '.join(odd)}"
            if odd
            else "two split points fall together or a stage would be empty"
        )
        raise PipelineError(
            f"{what}: cutting the model at {list(points)} gives {len(subs)} stages, not the plan's {stages} "
            f"({why}); a unit must be a module the forward calls once, in the order of the units"
        )
    key: dict[fx.Node, Key] = {n: ("in", str(n.target)) for n in roots}
    produces, tupled, feeds = [], [], []
    for s, n in enumerate(subs):
        if n.kwargs:
            raise PipelineError(f"{what}: stage {s} of the cut takes keyword arguments; not supported")
        gets = [u for u in n.users if u.op == "call_function" and u.target is operator.getitem]
        outs = _output_nodes(pipe.get_stage_module(s))
        if gets and len(gets) == len(n.users):
            for u in gets:
                key[u] = ("out", s, int(u.args[1]))
            produces.append(tuple(("out", s, i) for i in range(len(outs))))
            tupled.append(True)
        else:
            key[n] = ("out", s, 0)
            produces.append((("out", s, 0),))
            tupled.append(False)
        feeds.append(tuple(key[a] for a in n.args))
    out = next(n for n in graph.nodes if n.op == "output")
    flat = list(_flatten(out.args))
    if len(flat) != 1 or key.get(flat[0], ("in",))[:2] != ("out", stages - 1):
        raise PipelineError(
            f"{what}: the model must return one scalar loss, computed in its last stage "
            f"(it returns {len(flat)} values)"
        )
    loss = key[flat[0]]
    carries: list[tuple[Key, ...]] = [()]
    for s in range(1, stages):
        live = {k for t in range(s, stages) for k in feeds[t] if k[0] == "out" and k[1] < s}
        carries.append(tuple(sorted(live)))
    metas: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}
    for n, x in zip(roots, example):
        metas[key[n]] = (tuple(x.shape), x.dtype)
    for s in range(stages):
        for k, node in zip(produces[s], _output_nodes(pipe.get_stage_module(s))):
            v = node.meta.get("val") if isinstance(node, fx.Node) else None
            if not isinstance(v, torch.Tensor):
                raise PipelineError(
                    f"{what}: stage {s} output {k[2]} is not a tensor with a traced shape ({v!r})"
                )
            metas[k] = (tuple(int(d) for d in v.shape), v.dtype)
    if metas.get(loss, ((0,), None))[0] != ():
        raise PipelineError(
            f"{what}: the model must return a scalar loss; it returns shape {metas.get(loss)}"
        )
    split = Split(
        pipe, int(example[0].shape[0]), tuple(str(n.target) for n in roots), tuple(feeds), tuple(produces),
        tuple(tupled), tuple(carries), loss, metas, _reduction(pipe.get_stage_module(stages - 1)),
    )  # fmt: skip
    _check_params(split, model, points, what)
    return split


def _flatten(v: Any) -> Iterator[Any]:
    if isinstance(v, (tuple, list)):
        for x in v:
            yield from _flatten(x)
    else:
        yield v


def _output_nodes(gm: nn.Module) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")  # type: ignore[union-attr]
    return list(_flatten(out.args))


def _call_counts(model: nn.Module, example: Sequence[torch.Tensor], points: Sequence[str]) -> dict[str, int]:
    counts = dict.fromkeys(points, 0)
    hooks = []
    for p in points:

        def hook(*_: Any, p: str = p) -> None:
            counts[p] += 1

        hooks.append(model.get_submodule(p).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(*example)
    except Exception:  # noqa: BLE001 - only a diagnosis
        pass
    finally:
        for h in hooks:
            h.remove()
    return counts


def _reduction(gm: nn.Module) -> str | None:
    """How the last stage's loss reduces over the batch, read from the op that makes it."""
    node = _output_nodes(gm)[0]
    while isinstance(node, fx.Node) and node.op == "call_module":
        gm = gm.get_submodule(str(node.target))
        node = _output_nodes(gm)[0]
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    return loss_reduction(str(node.target), node.args, node.kwargs)


def _check_params(split: Split, model: nn.Module, points: Sequence[str], what: str) -> None:
    holders: dict[str, list[int]] = {}
    for s in range(split.stages):
        for n, _ in split.module(s).named_parameters(remove_duplicate=False):
            holders.setdefault(n, []).append(s)
    named = dict(model.named_parameters(remove_duplicate=False))
    groups = tied_groups({n: p.detach() for n, p in named.items()}, list(named))
    for n in named:
        members = groups.get(n, [n])
        where = sorted({s for m in members for s in holders.get(m, [])})
        if len(where) > 1:
            names = ", ".join(f"{m} (stage {'/'.join(map(str, holders.get(m, ['-'])))})" for m in members)
            raise PipelineError(
                f"{what}: weights are shared across stages {where}: {names} "
                f"{'are one parameter' if len(members) > 1 else 'is used by several stages'}; a stage "
                "cannot share a weight with another. Move the cut so they fall into one stage, or untie them"
            )
    for s, p in enumerate(points, start=1):
        own = [n for n, _ in model.get_submodule(p).named_parameters()]
        if own and not any(s in holders.get(f"{p}.{n}", []) for n in own):
            raise PipelineError(
                f"{what}: unit {p!r} should begin stage {s}, but its weights ended up in another stage: "
                "the units are not in the order the forward calls them"
            )


def _strip_dropout(module: nn.Module) -> None:
    """Dropout as identity in every graph of a traced stage (exact verification), as codegen does."""
    for m in module.modules():
        g = getattr(m, "graph", None)
        if not isinstance(g, fx.Graph):
            continue
        changed = False
        for nd in list(g.nodes):
            if nd.op != "call_function":
                continue
            a, kw = _zero_dropout(nd.target, tuple(nd.args), dict(nd.kwargs), all_dropout=True)
            if a != tuple(nd.args) or kw != dict(nd.kwargs):
                nd.args, nd.kwargs, changed = a, kw, True
        if changed:
            if isinstance(m, fx.GraphModule):
                m.recompile()
            elif hasattr(m, "finalize"):  # torch.export's InterpreterModule
                m.finalize()


# ======================================================================================= stage program


class StageProgram(nn.Module):
    """Stage ``s`` of a :class:`Split` as a link of the chain (see the module docstring).

    ``forward(*inputs, **model_inputs)`` takes :meth:`Split.inputs` positionally and :meth:`Split.root_inputs`
    by name and returns :meth:`Split.outputs` (a tuple; the loss tensor for the last stage).
    ``on_forward(k)`` is called with the micro-batch count of each forward (progress heartbeats).
    """

    def __init__(self, split: Split, s: int, on_forward: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.body = split.module(s)
        self.stage, self.last = s, s == split.stages - 1
        self.feeds, self.produces, self.tupled = split.feeds[s], split.produces[s], split.tupled[s]
        self.in_keys, self.kw_names, self.out_keys = split.inputs(s), split.root_inputs(s), split.outputs(s)
        self.on_forward = on_forward
        self.calls = 0

    def bind(self, args: Sequence[torch.Tensor], kwargs: dict[str, torch.Tensor]) -> dict[Key, torch.Tensor]:
        if len(args) != len(self.in_keys):
            raise PipelineError(f"stage {self.stage} got {len(args)} inputs, expected {len(self.in_keys)}")
        env = dict(zip(self.in_keys, args))
        env.update({("in", n): kwargs[n] for n in self.kw_names})
        return env

    def compute(self, env: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        """Run the traced stage on the values it reads; its outputs by key."""
        out = self.body(*(env[k] for k in self.feeds))
        outs = tuple(out) if self.tupled else (out,)
        return dict(zip(self.produces, outs))

    def emit(self, env: dict[Key, torch.Tensor]) -> Any:
        if self.last:
            return env[self.out_keys[0]]
        # a value passed on unchanged leaves as a view, so its gradient flows back through this stage
        return tuple(
            env[k].view_as(env[k]) if k not in self.produces and env[k].requires_grad else env[k]
            for k in self.out_keys
        )

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        if self.on_forward is not None:
            self.on_forward(self.calls)
        self.calls += 1
        env = self.bind(args, kwargs)
        env.update(self.compute(env))
        return self.emit(env)


# ===================================================================================== data parallel


@dataclass(frozen=True)
class Sharding:
    """How a data-parallel stage cuts its values: ``rows[i]`` rows of each micro-batch on stage device
    ``i`` (in order, contiguous), ``dims[key] = (dim, per_row)`` for batch-sized values (``dim`` has
    ``per_row * rows`` entries) and None for whole ones; ``weights[i]``: device ``i``'s share of the
    stage's loss (rows / micro-batch for a mean loss, 1 for a sum)."""

    rows: tuple[int, ...]
    dims: tuple[tuple[Key, tuple[int, int] | None], ...]
    weights: tuple[float, ...]

    def dim(self, k: Key) -> tuple[int, int] | None:
        return dict(self.dims)[k]

    def offset(self, i: int) -> int:
        return sum(self.rows[:i])

    def piece(self, k: Key, x: torch.Tensor, i: int) -> torch.Tensor:
        """Device ``i``'s part of value ``k`` (the whole value when it is not batch-sized)."""
        d = self.dim(k)
        if d is None:
            return x
        return x.narrow(d[0], self.offset(i) * d[1], self.rows[i] * d[1])

    def piece_shape(self, k: Key, shape: Sequence[int], i: int) -> tuple[int, ...]:
        d = self.dim(k)
        out = list(shape)
        if d is not None:
            out[d[0]] = self.rows[i] * d[1]
        return tuple(out)

    @staticmethod
    def compare(
        full: Split,
        part: Split,
        keys: Sequence[Key],
        rows: Sequence[int],
        weights: Sequence[float],
        what: str,
    ) -> Sharding:
        """Find the batch dim of every value in ``keys`` from the traces at the full micro-batch (``full``)
        and at fewer rows (``part``): the one dim whose size scales with the rows."""
        dims: list[tuple[Key, tuple[int, int] | None]] = []
        for k in keys:
            if k == full.loss:
                dims.append((k, None))
                continue
            (a, ta), (b, tb) = full.metas[k], part.metas[k]
            diff = [d for d in range(len(a)) if len(a) == len(b) and a[d] != b[d]]
            if len(a) != len(b) or ta != tb or len(diff) > 1:
                raise PipelineError(
                    f"{what}: value {k} has shape {a} at {full.rows} rows but {b} at {part.rows}"
                )
            if not diff:
                dims.append((k, None))
                continue
            d = diff[0]
            per = a[d] // full.rows
            if per * full.rows != a[d] or per * part.rows != b[d]:
                raise PipelineError(
                    f"{what}: value {k} dim {d} is {a[d]} at {full.rows} rows and {b[d]} at {part.rows}: "
                    "not a whole number of entries per sample, so the stage cannot split it by samples"
                )
            dims.append((k, (d, per)))
        return Sharding(tuple(rows), tuple(dims), tuple(weights))


class Peers:
    """Point-to-point with the other devices of a stage (global ranks) on the stage's own group."""

    def __init__(self, ranks: Sequence[int], group: Any, device: torch.device) -> None:
        self.ranks, self.group, self.device = tuple(ranks), group, device

    def send(self, x: torch.Tensor, i: int) -> None:
        dist.send(x.detach().contiguous(), dst=self.ranks[i], group=self.group)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, i: int) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dist.recv(t, src=self.ranks[i], group=self.group)
        return t

    def request(self, op: int, mb: int, i: int) -> None:
        self.send(torch.tensor([op, mb], dtype=torch.int64, device=self.device), i)


def _floating(t: torch.dtype) -> bool:
    return t.is_floating_point or t.is_complex


def remote_keys(program: StageProgram, sharding: Sharding) -> tuple[Key, ...]:
    """The outputs of a data-parallel stage that the other devices send back: its batch-sized outputs
    and, in the last stage, the loss (a whole output is the leader's own)."""
    loss = program.out_keys[0] if program.last else None
    return tuple(
        k for k in program.produces if k in program.out_keys and (sharding.dim(k) is not None or k == loss)
    )


class ShardedStage(nn.Module):
    """The leader's module of a data-parallel stage (the library's ``PipelineStage`` runs it): it sends
    the other devices their rows (:class:`_Dispatch`), computes its own rows through ``program`` (traced
    at that many rows) meanwhile, then gathers their outputs (:class:`_Collect`): outputs concatenated
    in row order, the loss summed by ``sharding.weights``. In the backward the other devices' backward
    runs while the leader backpropagates its own rows. ``metas``: every value at the full micro-batch."""

    def __init__(
        self, program: StageProgram, sharding: Sharding, peers: Peers, me: int, metas: dict[Key, Any]
    ) -> None:
        super().__init__()
        self.program, self.sharding, self.peers, self.me, self.metas = program, sharding, peers, me, metas
        self.consumed = tuple(dict.fromkeys(program.feeds))
        self.remote = remote_keys(program, sharding)
        self.others = tuple(i for i, r in enumerate(sharding.rows) if i != me and r > 0)
        self.grad_in = program.stage > 0  # boundary values of later stages carry gradients

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        p = self.program
        mb = p.calls
        if p.on_forward is not None:
            p.on_forward(mb)
        p.calls += 1
        env = p.bind(args, kwargs)
        # the anchor requires grad, so autograd runs the other devices' backward (_Collect, _Dispatch)
        # even when no input does (the first stage)
        anchor = torch.zeros((), device=self.peers.device, requires_grad=True)
        token = _Dispatch.apply(self, mb, anchor, *(env[k] for k in self.consumed))
        mine = p.compute({k: self.sharding.piece(k, env[k], self.me) for k in self.consumed})
        theirs = _Collect.apply(self, mb, token)
        for k, r in zip(self.remote, theirs):
            d = self.sharding.dim(k)
            if d is None:  # the loss: each device's share weighted
                mine[k] = mine[k] * self.sharding.weights[self.me] + r
            else:
                mine[k] = torch.cat([mine[k], r], d[0])
        env.update(mine)
        return p.emit(env)

    def finish(self) -> None:
        """End of a step: release the other devices from :func:`serve`."""
        for i in self.others:
            self.peers.request(_END, 0, i)


class _Dispatch(torch.autograd.Function):
    """Forward: send the other devices of the stage their rows of the values it reads (they compute
    while the leader does). Backward: receive the gradients of those rows (whole values: summed)."""

    @staticmethod
    def forward(ctx: Any, st: ShardedStage, mb: int, anchor: torch.Tensor, *values: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.st, ctx.meta = st, [(tuple(v.shape), v.dtype) for v in values]
        for i in st.others:
            st.peers.request(_FORWARD, mb, i)
            for k, v in zip(st.consumed, values):
                st.peers.send(st.sharding.piece(k, v, i), i)
        return anchor.detach().clone()  # a token that orders _Collect after this

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> Any:  # type: ignore[override]
        st, sh, peers = ctx.st, ctx.st.sharding, ctx.st.peers
        ins: list[torch.Tensor | None] = [
            torch.zeros(s, dtype=t, device=peers.device) if st.grad_in and _floating(t) else None
            for s, t in ctx.meta
        ]
        for i in st.others:
            for j, (k, (shape, dtype)) in enumerate(zip(st.consumed, ctx.meta)):
                acc = ins[j]
                if acc is None:
                    continue
                got = peers.recv(sh.piece_shape(k, shape, i), dtype, i)
                d = sh.dim(k)
                if d is None:  # a whole value: every device's gradient adds up
                    acc += got
                else:
                    acc.narrow(d[0], sh.offset(i) * d[1], sh.rows[i] * d[1]).copy_(got)
        return (None, None, None, *ins)


class _Collect(torch.autograd.Function):
    """Forward: gather the other devices' outputs (rows in order; the loss weighted). Backward: send
    them their output gradients and start their backward."""

    @staticmethod
    def forward(ctx: Any, st: ShardedStage, mb: int, token: torch.Tensor) -> Any:  # type: ignore[override]
        sh = st.sharding
        ctx.st, ctx.mb = st, mb
        pieces: dict[Key, list[torch.Tensor]] = {k: [] for k in st.remote}
        for i in st.others:
            for k in st.remote:
                shape, dtype = st.metas[k]
                got = st.peers.recv(sh.piece_shape(k, shape, i), dtype, i)
                pieces[k].append(got * sh.weights[i] if sh.dim(k) is None else got)
        outs = []
        for k in st.remote:
            d = sh.dim(k)
            outs.append(torch.stack(pieces[k]).sum(0) if d is None else torch.cat(pieces[k], d[0]))
        ctx.mark_non_differentiable(*(o for o in outs if not _floating(o.dtype)))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        st, sh, peers = ctx.st, ctx.st.sharding, ctx.st.peers
        first = sh.offset(st.others[0])
        for i in st.others:
            peers.request(_BACKWARD, ctx.mb, i)
            for k, g in zip(st.remote, grads):
                if not _floating(st.metas[k][1]):
                    continue
                d = sh.dim(k)
                if d is None:  # the loss: d(sum_i w_i loss_i) / d loss_i = w_i
                    peers.send(g * sh.weights[i], i)
                else:
                    peers.send(g.narrow(d[0], (sh.offset(i) - first) * d[1], sh.rows[i] * d[1]), i)
        return (None, None, torch.zeros((), device=peers.device))


def serve(
    program: StageProgram, peers: Peers, leader: int, remote: Sequence[Key], metas: dict[Key, Any]
) -> int:
    """A non-leader device of a data-parallel stage: serve the leader's requests until it ends the step.
    Forward: receive my rows of the values the stage reads, compute, send back my ``remote`` outputs;
    backward: receive their gradients (the loss's already weighted), backpropagate, send the gradients
    of my floating inputs (later stages only). ``metas``: shapes at my row count. Returns the forwards."""
    consumed = tuple(dict.fromkeys(program.feeds))
    grad_in = program.stage > 0
    saved: dict[int, tuple[list[torch.Tensor], dict[Key, torch.Tensor]]] = {}
    forwards = 0
    while True:
        op, mb = (int(v) for v in peers.recv((2,), torch.int64, leader))
        if op == _END:
            if saved:
                raise PipelineError(f"the step ended with micro-batches {sorted(saved)} not backpropagated")
            return forwards
        if op == _FORWARD:
            if program.on_forward is not None:
                program.on_forward(mb)
            xs = []
            for k in consumed:
                shape, dtype = metas[k]
                xs.append(peers.recv(shape, dtype, leader).requires_grad_(grad_in and _floating(dtype)))
            out = program.compute(dict(zip(consumed, xs)))
            for k in remote:
                peers.send(out[k], leader)
            saved[mb] = (xs, out)
            forwards += 1
        elif op == _BACKWARD:
            xs, out = saved.pop(mb)
            ts, gs = [], []
            for k in remote:
                shape, dtype = metas[k]
                if not _floating(dtype):
                    continue
                g = peers.recv(shape, dtype, leader)
                if out[k].requires_grad:
                    ts.append(out[k])
                    gs.append(g)
            if ts:
                torch.autograd.backward(ts, gs)
            for x in xs:
                if x.requires_grad:
                    peers.send(x.grad if x.grad is not None else torch.zeros_like(x), leader)
        else:
            raise PipelineError(f"unknown request {op} from the stage leader (rank {peers.ranks[leader]})")
