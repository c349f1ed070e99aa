"""Duplex execution (HiDup): each rank runs its batch as two micro-batches, one communicating while the
other computes, gradients of both accumulated before one update.

A duplex plan (``plan.duplex``) has the same program as a plain one; only the schedule differs. The
generated program has static shard lengths, so duplex runs the program of the *half* batch:

* the model is traced once more at half the batch (:func:`half_inputs`; the bundle keeps it,
  :mod:`hapnb.run.bundle`), and :func:`half_plan` halves every shard length of every dim whose size
  halves (the batch and the dims it is folded into); a length that cannot be halved is an error;
* :func:`split_batch` cuts the global batch into the two micro-batches: micro-batch ``k`` holds, of every
  rank's local batch slice, the ``k``-th half (so each rank keeps its own samples); an odd local batch is
  a :class:`DuplexError` naming the input and its length;
* :class:`DuplexRunner` runs the half program on both micro-batches, interleaved node by node through the
  segments between communicating collectives: micro-batch 0's collective (all-gather, reduce-scatter,
  all-reduce, all-to-all, reshard) starts asynchronously (``async_op``), micro-batch 1 computes its
  segment meanwhile, and the other way round; the result is waited for where it is first used;
* the step's loss is ``loss_scale * (loss0 + loss1)`` (:func:`loss_scale`: 1/2 for a mean-reduced loss,
  1 for a sum) and one ``backward`` over it accumulates both micro-batches' gradients, so replicated
  gradients are all-reduced once (:class:`hapnb.run.buckets.GradBuckets`) and the optimizer steps once.

The backward is not interleaved by hand: autograd on CPU runs one ready queue in one thread and the
collectives' backward duals are synchronous, so in the backward only the gradient buckets overlap with
compute. Micro-batching is exact for per-sample losses; ops that mix samples (batch norm) or a mean over
a data-dependent count (``ignore_index`` targets spread unevenly) make the two halves differ from one
batch, as in HiDup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..ir.forms import parse_form, shard_lengths, shard_offsets
from ..ir.graph import Graph
from ..runtime import collectives as C

__all__ = [
    "DuplexError",
    "DuplexRunner",
    "batch_size",
    "half_inputs",
    "half_plan",
    "loss_reduction",
    "loss_scale",
    "split_batch",
]


class DuplexError(ValueError):
    """A plan or batch cannot run as two micro-batches (names the tensor and the length that is odd)."""


#: the collectives that start asynchronously in a duplex schedule and their async variants
ASYNC_OF: dict[Callable[..., Any], Callable[..., Any]] = {
    C.all_gather: C.all_gather_async,
    C.reduce_scatter: C.reduce_scatter_async,
    C.all_reduce: C.all_reduce_async,
    C.all_to_all: C.all_to_all_async,
    C.reshard: C.reshard_async,
}


def batch_size(inputs: Sequence[torch.Tensor]) -> int:
    """The batch: dim 0 of the first input (inputs with that dim 0 are split into micro-batches)."""
    if not inputs or inputs[0].dim() == 0:
        raise DuplexError("duplex needs a first input with a batch dimension (dim 0)")
    return int(inputs[0].shape[0])


def half_inputs(inputs: Sequence[torch.Tensor], names: Sequence[str] = ()) -> tuple[torch.Tensor, ...]:
    """Example inputs at half the batch (the first half of every input whose dim 0 is the batch), to
    trace the half-batch program with.

    >>> [tuple(x.shape) for x in half_inputs([torch.zeros(4, 3), torch.zeros(4), torch.zeros(2, 2)])]
    [(2, 3), (2,), (2, 2)]
    """
    b = batch_size(inputs)
    if b % 2:
        raise DuplexError(f"duplex: input {names[0] if names else 0} has batch {b}, which is odd")
    return tuple(x.narrow(0, 0, b // 2) if x.dim() and x.shape[0] == b else x for x in inputs)


def loss_scale(graph: Graph) -> float:
    """How the two micro-batch losses add up to the batch's: ``0.5`` when the loss is a mean over the
    batch (a ``*_loss`` op with ``reduction`` mean, ``aten.mean``), ``1.0`` for a sum; a
    :class:`DuplexError` when the loss's last op says neither."""
    op = next((o for o in graph.ops if graph.loss in o.outputs), None)
    target = str(op.target) if op is not None else ""
    how = loss_reduction(target, op.args, op.kwargs) if op is not None else None
    if how is not None:
        return 0.5 if how == "mean" else 1.0
    raise DuplexError(
        f"duplex: cannot tell whether the loss of {graph.name} ({target or 'no op'}) is a mean or a sum "
        "over the batch; pass loss_scale=0.5 (mean) or 1.0 (sum)"
    )


def loss_reduction(target: str, args: Any, kwargs: Any) -> str | None:
    """``"mean"`` or ``"sum"``: how the op ``target`` (``"aten.<op>.<overload>"``) that makes a loss
    reduces over the batch (``aten.mean``/``aten.sum``, or a ``*_loss`` op's ``reduction`` argument);
    None when it says neither. Micro-batched runs (duplex, pipelines) add their losses up by it.

    >>> loss_reduction("aten.cross_entropy_loss.default", (None, None), {}), loss_reduction("aten.sum.default", (), {})
    ('mean', 'sum')
    """
    if target.startswith("aten.mean."):
        return "mean"
    if target.startswith("aten.sum."):
        return "sum"
    schema = getattr(_aten(target), "_schema", None)
    if schema is None:
        return None
    for k, a in enumerate(schema.arguments):
        if a.name == "reduction":
            pos = tuple(args) if args is not None else ()
            v = kwargs.get("reduction") if isinstance(kwargs, dict) else None
            if v is None:
                v = pos[k] if k < len(pos) else a.default_value
            return {1: "mean", 2: "sum"}.get(int(v))
    return None


def _aten(target: str) -> Any:
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    return getattr(getattr(torch.ops.aten, parts[1], None), parts[2], None)


def half_plan(plan: Any, graph: Graph, half: Graph) -> Any:
    """``plan`` (physical, over ``graph``) for the half-batch graph ``half``: every shard length of a dim
    whose size halves is halved (also a reshard's new lengths). A cut with odd lengths (activations
    re-cut for another segment's ratios) becomes the half batch cut in the same proportions; raises
    :class:`DuplexError` when that is impossible or a tensor's size changes otherwise. (Inputs must cut
    evenly: :func:`split_batch` checks them.)"""

    def size(g: Graph, name: str, dim: int) -> int:
        try:
            return int(g.tensor(name).shape[dim])
        except (KeyError, IndexError):
            raise DuplexError(
                f"duplex: the half-batch trace of {graph.name} has no tensor {name} with dim {dim}; the model "
                "traces to a different graph at half the batch"
            ) from None

    def halve(name: str, dim: int, ls: tuple[int, ...]) -> tuple[int, ...]:
        full, h = size(graph, name, dim), size(half, name, dim)
        if h == full:
            return tuple(ls)
        if 2 * h != full:
            raise DuplexError(f"duplex: {name} dim {dim} has size {full} but {h} at half the batch")
        # a dim of k x batch cut k x a batch cut (whole samples): halve the batch cut -- exactly when it is
        # even, else (activations re-cut for another segment's ratios) in the same proportions -- so
        # equal cuts stay equal and the tensors of one op stay proportional
        k = full // batch if full % batch == 0 else 0
        if k and all(n % k == 0 for n in ls) and any(ls):
            base = [n // k for n in ls]
            if any(n % 2 for n in base):
                base = list(shard_lengths(batch // 2, base))
            else:
                base = [n // 2 for n in base]
            return tuple(k * n for n in base)
        odd = [r for r, n in enumerate(ls) if n % 2]
        if not odd:
            return tuple(n // 2 for n in ls)
        r = odd[0]
        raise DuplexError(
            f"duplex: {name} dim {dim} is cut {tuple(ls)}: rank {r}'s length {ls[r]} is odd, so it cannot "
            "be split into two micro-batches; use an even local batch"
        )
        return tuple(n // 2 for n in ls)

    batch = int(graph.tensors[graph.inputs[0]].shape[0])
    lengths = tuple((t, d, halve(t, d, ls)) for t, d, ls in plan.lengths)
    program = []
    for ins in plan.program:
        if ins.kind == "collective" and ins.name == "reshard" and ins.lengths:
            ins = dataclasses.replace(ins, lengths=halve(ins.tensor, ins.form_value.dim, tuple(ins.lengths)))
        program.append(ins)
    return dataclasses.replace(
        plan, lengths=lengths, program=tuple(program), graph=half, graph_fingerprint=half.fingerprint
    )


def split_batch(
    plan: Any, graph: Graph, inputs: Sequence[torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """The two global micro-batches of the full ``inputs`` of ``plan`` (physical): micro-batch ``k`` is,
    rank by rank, the ``k``-th half of the rank's batch slice (the cut of the first input loaded
    ``G(0)``; the whole batch as one slice when no input is). Returns ``(cut, (mb0, mb1))``.

    >>> import types
    >>> x = torch.arange(6.0)
    >>> ins = types.SimpleNamespace(kind="load", tensor="x", form="G0")
    >>> p = types.SimpleNamespace(program=[ins], lengths_of=lambda t, d: (4, 2))
    >>> g = types.SimpleNamespace(inputs=[0], tensors={0: types.SimpleNamespace(name="x")})
    >>> cut, ((a,), (b,)) = split_batch(p, g, [x])
    >>> cut, a.tolist(), b.tolist()
    ((4, 2), [0.0, 1.0, 4.0], [2.0, 3.0, 5.0])
    """
    names = [graph.tensors[t].name for t in graph.inputs]
    b = batch_size(inputs)
    cut: tuple[int, ...] | None = None
    who = names[0]
    for ins in plan.program:
        if ins.kind == "load" and ins.tensor in names and parse_form(ins.form) == parse_form("G0"):
            if inputs[names.index(ins.tensor)].shape[0] == b:
                cut, who = tuple(int(n) for n in plan.lengths_of(ins.tensor, 0)), ins.tensor
                break
    if cut is None:
        cut = (b,)
    for r, n in enumerate(cut):
        if n % 2:
            where = f"rank {r}'s local batch" if len(cut) > 1 else "the batch"
            raise DuplexError(
                f"duplex: input {who} has {where} of length {n}, which is odd; two micro-batches need an "
                "even local batch on every rank"
            )
    offs = shard_offsets(cut)

    def part(x: torch.Tensor, k: int) -> torch.Tensor:
        if x.dim() == 0 or x.shape[0] != b:
            return x
        return torch.cat([x.narrow(0, o + k * (n // 2), n // 2) for o, n in zip(offs, cut)], 0)

    return cut, (tuple(part(x, 0) for x in inputs), tuple(part(x, 1) for x in inputs))


class DuplexRunner:
    """Runs a rank's (half-batch) program on two micro-batches at once: ``runner(inputs0, inputs1)``
    returns both partial losses. ``interleave=True`` walks the program's segments (each ending in an
    async-capable collective) alternately for micro-batch 0 and 1, so one's collective is in flight while
    the other computes; ``False`` runs micro-batch 0, then 1, with synchronous collectives. ``events``
    records ``("start"|"wait"|"compute", mb, node)`` in order (``compute``: the first node of a segment)."""

    def __init__(self, module: fx.GraphModule, *, interleave: bool = True) -> None:
        self.module = module
        self.interleave = interleave
        self.events: list[tuple[str, int, str]] = []
        self.segments: list[list[fx.Node]] = [[]]
        for nd in module.graph.nodes:
            self.segments[-1].append(nd)
            if interleave and nd.op == "call_function" and nd.target in ASYNC_OF:
                self.segments.append([])

    def __call__(self, inputs0: Sequence[Any], inputs1: Sequence[Any]) -> tuple[Any, Any]:
        envs: list[dict[fx.Node, Any]] = [{}, {}]
        feeds = [list(inputs0), list(inputs1)]
        outs: list[Any] = [None, None]
        order = [(s, mb) for s in range(len(self.segments)) for mb in (0, 1)]
        if not self.interleave:
            order = [(s, mb) for mb in (0, 1) for s in range(len(self.segments))]
        for s, mb in order:
            seg = self.segments[s]
            if seg:
                self.events.append(("compute", mb, seg[0].name))
            for nd in seg:
                res = self._node(nd, envs[mb], feeds[mb], mb)
                if nd.op == "output":
                    outs[mb] = res
                else:
                    envs[mb][nd] = res
        for mb, env in enumerate(envs):  # results nobody used: still finish the communication
            for nd, v in env.items():
                if isinstance(v, C.AsyncCollective):
                    self.events.append(("wait", mb, nd.name))
                    env[nd] = v.wait()
        return outs[0], outs[1]

    def _node(self, nd: fx.Node, env: dict[fx.Node, Any], feed: list[Any], mb: int) -> Any:
        def get(a: fx.Node) -> Any:
            v = env[a]
            if isinstance(v, C.AsyncCollective):
                self.events.append(("wait", mb, a.name))
                v = env[a] = v.wait()
            return v

        if nd.op == "placeholder":
            return feed.pop(0)
        if nd.op == "get_attr":
            obj: Any = self.module
            for part in str(nd.target).split("."):
                obj = getattr(obj, part)
            return obj
        args = fx.node.map_arg(nd.args, get)
        kwargs = fx.node.map_arg(nd.kwargs, get)
        if nd.op == "output":
            return args[0]
        if nd.op == "call_function":
            fn = nd.target
            if self.interleave and fn in ASYNC_OF:
                self.events.append(("start", mb, nd.name))
                return ASYNC_OF[fn](*args, **kwargs)
            return fn(*args, **kwargs)  # type: ignore[operator]
        if nd.op == "call_method":
            return getattr(args[0], str(nd.target))(*args[1:], **kwargs)
        if nd.op == "call_module":
            return self.module.get_submodule(str(nd.target))(*args, **kwargs)
        raise DuplexError(f"duplex: cannot run node {nd.name} ({nd.op})")
