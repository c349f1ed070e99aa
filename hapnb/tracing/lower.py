"""Lower an exported program to ops that have sharding rules (issue 18: coverage by construction).

torch.export gives aten ops as the model wrote them: composite ops (``aten.pad``, ``aten.__and__``,
``aten.diff``), in-place ops (``add_``, ``masked_fill_``, ``copy_``) and training ``batch_norm``. An op
without a rule runs replicated and, worse, forces every tensor it touches to be replicated: one
``aten.pad`` in a library's label shift replicates the whole batch. :func:`lower` rewrites such a program
with ``ExportedProgram.run_decompositions``:

* it inlines the regions torch.export keeps as higher-order ops (:data:`REGIONS`): a ``torch.autocast``
  block (mixed-precision training) becomes the ops in it with the casts autocast makes, and the results
  of a ``torch.no_grad()`` block are detached (:func:`detach_no_grad_regions`), as the model's are; after
  decomposing, autocast's repeated casts of one tensor are one (:func:`merge_duplicate_casts`);
* it functionalizes in-place ops (``add_`` -> ``add``, buffer updates become outputs); an in-place dropout
  (``nn.Dropout(inplace=True)``, ``aten.dropout_``) first becomes ``native_dropout``
  (:func:`functional_dropout`), what an out-of-place dropout traces to, since torch would decompose it into
  a ``bernoulli`` mask that neither ``eval()`` nor verification (dropout off) could tell from other math;
* a product with a transposed weight, ``x @ W.T`` (``matmul(x, permute(W))``: Falcon's ``FalconLinear``), is
  the ``linear(x, W)`` it is (:func:`matmul_as_linear`), so the weight is loaded by the op that uses it and
  its rules and bounds are a linear layer's;
* a ``cat`` drops its legacy empty inputs (1-d tensors of size 0, which torch's ``cat`` skips at any
  rank; :func:`drop_empty_cat_inputs`): a Hugging Face model run with the key/value cache on (its
  configs' default, also in training) concatenates each layer's keys and values to the cache's
  ``torch.tensor([])``, and a replicated empty tensor beside a batch-sharded one left no strategy that
  kept the batch sharded;
* an embedding bag over equal bags (``nn.EmbeddingBag`` on a 2-d input) is the embedding of the ``(B, L)``
  indices reduced over ``L`` (:func:`equal_bags`), which shards with the batch;
* it decomposes, with torch's own core-ATen table (:func:`torch.export.default_decompositions`), every
  op that has no rule, and keeps whole every op that has one (``linear``, ``scaled_dot_product_attention``,
  ``embedding``, ``layer_norm``, ``cross_entropy_loss``, ... are never decomposed);
* it applies hapnb's own decompositions (:data:`HAPNB_DECOMPOSITIONS`), written so that the rules can
  shard them: training-mode batch norm computes its statistics as sums over the batch and spatial dims,
  so a batch-sharded input gives partial sums (``R``) that the search all-reduces: SyncBatchNorm
  semantics, exact against one device.

A program whose ops all have rules and that mutates nothing is returned unchanged (the zoo's graphs do
not move). One more rewrite happens on the Graph every tracing path builds, after lowering:
:mod:`.folds` removes a fold of leading dims around row-wise ops (seq-first attention's
``(S, B, E) -> (S*B, E)``, out-projection, ``-> (S, B, E)``), so the batch can stay sharded there. Each op that lowering produced keeps the target it came from (:attr:`Lowered.origins`, by
node name; the tracer stores it as ``Op.origin``).

>>> import torch
>>> class Shift(torch.nn.Module):
...     def forward(self, x):
...         return torch.nn.functional.pad(x, (0, 1)).sum()
>>> ep = torch.export.export(Shift(), (torch.randn(4, 3),), strict=False)
>>> low = lower(ep)
>>> sorted(set(low.origins.values()))
['aten.pad.default']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Lowered", "lower", "needs_lowering", "cumulative_batch_norm", "functional_dropout", "matmul_as_linear",
    "equal_bags", "drop_empty_cat_inputs", "detach_no_grad_regions", "merge_duplicate_casts",
    "HAPNB_DECOMPOSITIONS",
]  # fmt: skip

#: in-place dropouts, rewritten to ``native_dropout`` by :func:`functional_dropout`
INPLACE_DROPOUT = ("aten.dropout_.default",)
#: the regions torch.export keeps as higher-order ops around a submodule: lowering inlines them, with the
#: casts autocast makes (``torch.autocast``, mixed-precision training) or the grad mode set
REGIONS = ("wrap_with_autocast", "wrap_with_set_grad_enabled")


def _batch_norm_stats(x: Any) -> tuple[Any, Any, Any, int]:
    """Mean, ``x - mean`` and biased variance of ``x`` per channel (dim 1), the statistics kept as
    ``[1, C, 1, ...]``, as sums over every other dim divided by the count (two passes: the mean, then the
    centred squares)."""
    import torch

    dims = [0] + list(range(2, x.dim()))
    count = x.numel() // x.shape[1]
    mean = torch.sum(x, dims, keepdim=True) / count
    centred = x - mean
    var = torch.sum(centred * centred, dims, keepdim=True) / count
    return mean, centred, var, count


def _normalize(centred: Any, var: Any, weight: Any, bias: Any, eps: float) -> tuple[Any, Any]:
    """``(x - mean) * (rsqrt(var + eps) * weight) + bias`` per channel (dim 1), and the ``rstd``.

    The per-channel scale is formed first, so the one full-size tensor autograd keeps is ``centred``
    (which the variance keeps too): as much as the fused kernel keeps (its input), where normalizing
    and then scaling would keep two more."""
    import torch

    shape = [1, centred.shape[1]] + [1] * (centred.dim() - 2)
    rstd = torch.rsqrt(var + eps)
    y = centred * (rstd if weight is None else rstd * weight.reshape(shape))
    if bias is not None:
        y = y + bias.reshape(shape)
    return y, rstd


def _batch_norm_functional(
    x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool, momentum: float,
    eps: float,
) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
    """``aten._native_batch_norm_legit_functional`` with its statistics as sums over the batch and spatial
    dims, so a batch-sharded ``x`` gives partial sums that one all-reduce each completes (SyncBatchNorm).
    Returns ``(y, mean, rstd, new_running_mean, new_running_var)`` like the aten op (running variance
    unbiased, ``momentum`` as torch uses it)."""
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    if training:
        mean, centred, var, count = _batch_norm_stats(x)
        new_mean = running_mean * (1 - momentum) + mean.reshape(-1) * momentum
        new_var = running_var * (1 - momentum) + var.reshape(-1) * (count / max(count - 1, 1)) * momentum
    else:
        mean, var = running_mean.reshape(shape), running_var.reshape(shape)
        centred = x - mean
        new_mean, new_var = running_mean, running_var
    y, rstd = _normalize(centred, var, weight, bias, eps)
    return y, mean.reshape(-1), rstd.reshape(-1), new_mean, new_var


def _batch_norm_no_stats(
    x: Any, weight: Any, bias: Any, training: bool, momentum: float, eps: float
) -> tuple[Any, Any, Any]:
    """``aten._native_batch_norm_legit`` without running statistics: always the batch's statistics."""
    mean, centred, var, _ = _batch_norm_stats(x)
    y, rstd = _normalize(centred, var, weight, bias, eps)
    return y, mean.reshape(-1), rstd.reshape(-1)


def _hapnb_table() -> dict[Any, Callable[..., Any]]:
    import torch

    aten = torch.ops.aten
    return {
        aten._native_batch_norm_legit_functional.default: _batch_norm_functional,
        aten._native_batch_norm_legit.no_stats: _batch_norm_no_stats,
    }


#: hapnb's own decompositions, by op target: written so that the rules can shard the result.
HAPNB_DECOMPOSITIONS: dict[str, str] = {
    "aten._native_batch_norm_legit_functional.default": "training batch norm (what aten.batch_norm "
    "becomes): statistics as sums over the batch and spatial dims, so a batch-sharded input gives partial "
    "sums that one all-reduce each completes (SyncBatchNorm); running statistics updated as torch does",
    "aten._native_batch_norm_legit.no_stats": "batch norm without running statistics: the same sums",
}


def _cumulative_forward(self: Any, x: Any) -> Any:
    """A BatchNorm module's training forward with ``momentum=None`` (cumulative moving average) that
    torch.export can capture: torch computes the factor ``1 / num_batches_tracked`` as a Python float
    (data-dependent); here it is a tensor. The batch statistics come from the functional batch norm
    with momentum 1 (its "running" results are the batch mean and unbiased variance), which
    :func:`_batch_norm_functional` lowers to sums like any training batch norm."""
    import torch

    if self.momentum is not None or not self.training or self.running_mean is None:
        return type(self).forward(self, x)
    self._check_input_dim(x)
    self.num_batches_tracked.add_(1)
    factor = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)
    y, _, _, mean, var = torch.ops.aten._native_batch_norm_legit_functional(
        x, self.weight, self.bias, self.running_mean, self.running_var, True, 1.0, self.eps
    )
    self.running_mean.mul_(1 - factor).add_(mean * factor)
    self.running_var.mul_(1 - factor).add_(var * factor)
    return y


@contextmanager
def cumulative_batch_norm(model: Any) -> Iterator[None]:
    """While the block runs, BatchNorm modules of ``model`` with ``momentum=None`` use a forward that
    torch.export can capture (:func:`_cumulative_forward`: the same updates, as torch makes them)."""
    import types

    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    mods = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.momentum is None] if isinstance(
        model, torch.nn.Module
    ) else []  # fmt: skip
    own = [(m, m.__dict__.get("forward")) for m in mods]
    try:
        for m in mods:
            m.forward = types.MethodType(_cumulative_forward, m)
        yield
    finally:
        for m, fwd in own:
            if fwd is None:
                del m.forward
            else:
                m.forward = fwd


@dataclass(frozen=True)
class Lowered:
    """The lowered program and, for each of its op nodes made by lowering, the target it came from."""

    program: Any
    origins: dict[str, str] = field(default_factory=dict)
    lowered: tuple[str, ...] = ()  # the targets that were lowered (no rule, in-place, or hapnb's own)


def _tensor_result(node: Any) -> bool:
    import torch

    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val)


def _region(node: Any) -> str:
    """The name of the region of :data:`REGIONS` fx node ``node`` opens, else ''."""
    import torch

    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
        return target.__name__ if target.__name__ in REGIONS else ""
    return ""


def needs_lowering(ep: Any, has_rule: Callable[[str], bool]) -> tuple[str, ...]:
    """The op targets of ``ep`` that lowering would rewrite: in-place (mutating) ops, ops with a hapnb
    decomposition, aten ops with a tensor result but no rule (``has_rule(target)`` is False), and the
    regions of :data:`REGIONS` (as ``higher_order.NAME``)."""
    import torch

    own = {str(k) for k in _hapnb_table()}
    out: list[str] = []
    for node in ep.graph.nodes:
        region = _region(node)
        if region:
            if f"higher_order.{region}" not in out:
                out.append(f"higher_order.{region}")
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        t = str(node.target)
        if t in out:
            continue
        mutable = node.target._schema.is_mutable
        if mutable or t in own or (_tensor_result(node) and not has_rule(t) and t.startswith("aten.")):
            out.append(t)
    return tuple(out)


def functional_dropout(ep: Any) -> int:
    """Rewrite, in ``ep``'s graph, each in-place dropout ``dropout_(x, p, train)`` of an intermediate tensor
    as ``native_dropout(x, p, train)[0]`` and point the later readers of ``x`` at that result (what the
    in-place op did to them). Returns how many were rewritten. A dropout of a graph input, or one whose
    result the program returns, is left to :func:`lower` (the program's signature names them)."""
    import operator

    import torch

    graph = ep.graph_module.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) not in INPLACE_DROPOUT:
            continue
        x = node.args[0]
        if x.op == "placeholder" or any(u.op == "output" for u in node.users):
            continue
        p, train = (list(node.args[1:]) + [node.kwargs.get("p"), node.kwargs.get("train")])[:2]
        val = node.meta.get("val")
        with graph.inserting_after(node):
            nd = graph.call_function(torch.ops.aten.native_dropout.default, (x, p, train))
        with graph.inserting_after(nd):
            out = graph.call_function(operator.getitem, (nd, 0))
        if val is not None:
            with val.fake_mode:
                nd.meta["val"] = torch.ops.aten.native_dropout.default(val, p, train)
            out.meta["val"] = val
        _source_meta(node, nd, out)
        node.replace_all_uses_with(out)
        for user in list(x.users):
            if user is not nd and order.get(user, len(order)) > order[node]:
                user.replace_input_with(x, out)
        graph.erase_node(node)
        done += 1
    if done:
        ep.graph_module.recompile()
    return done


def detach_no_grad_regions(ep: Any) -> int:
    """Detach, in ``ep``'s graph, each result of a ``torch.no_grad()`` region (``wrap_with_set_grad_enabled``
    with grad off): inlined by :func:`lower`, its ops would otherwise pass gradients that the model's do
    not. Returns how many regions were marked.

    >>> import torch
    >>> class Scaled(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(3, 3)
    ...     def forward(self, x):
    ...         with torch.no_grad():
    ...             s = self.fc.weight.abs().sum()
    ...         return (self.fc(x) / s).sum()
    >>> ep = torch.export.export(Scaled(), (torch.randn(2, 3),), strict=False)
    >>> detach_no_grad_regions(ep)
    1
    """
    import operator

    import torch

    graph = ep.graph_module.graph
    done = 0
    for node in list(graph.nodes):
        if _region(node) != "wrap_with_set_grad_enabled" or node.args[0] is not False:
            continue
        results = [u for u in node.users if u.target is operator.getitem] or [node]
        for r in results:
            val = r.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            with graph.inserting_after(r):
                d = graph.call_function(torch.ops.aten.detach.default, (r,))
            d.meta["val"] = val.detach()
            _source_meta(r, d)
            r.replace_all_uses_with(d, delete_user_cb=lambda u, d=d: u is not d)
        done += 1
    if done:
        ep.graph_module.recompile()
    return done


def merge_duplicate_casts(ep: Any) -> int:
    """Merge, in ``ep``'s graph, the dtype casts (``aten._to_copy``) of one tensor with the same arguments
    into the first: ``torch.autocast`` casts a layer's input once per linear layer that reads it (the query,
    key and value projections each cast the same hidden state). One cast computes the same values, and the
    projections are then consumers of one tensor, whose form the search and its bounds share among them.
    Returns how many casts were removed."""
    import torch

    graph = ep.graph_module.graph
    seen: dict[Any, Any] = {}
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default:
            continue
        key = (node.args, tuple(sorted((k, str(v)) for k, v in node.kwargs.items())))
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            done += 1
    if done:
        ep.graph_module.recompile()
    return done


def _transposed_weight(ep: Any, node: Any) -> Any:
    """The 2-d parameter ``W`` when ``node`` is ``W.T`` (``numpy_T(W)``, ``permute(W, [1, 0])``, ``t(W)``,
    ``transpose(W, 0, 1)``), else None."""
    import torch

    aten = torch.ops.aten
    if node.op != "call_function" or not node.args:
        return None
    w = node.args[0]
    if getattr(w, "op", None) != "placeholder" or w.name not in ep.graph_signature.inputs_to_parameters:
        return None
    val = w.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    rest = [a % 2 if isinstance(a, int) else a for a in node.args[1:]]
    swaps = {
        aten.permute.default: rest == [[1, 0]],
        aten.t.default: rest == [],
        aten.numpy_T.default: rest == [],
        aten.transpose.int: sorted(rest) == [0, 1],
    }
    return w if swaps.get(node.target, False) else None


def matmul_as_linear(ep: Any) -> int:
    """Rewrite, in ``ep``'s graph, each ``matmul(x, W.T)`` of a 2-d parameter ``W`` whose transpose nothing
    else reads as ``linear(x, W)`` (the same product). Returns how many were rewritten."""
    import torch

    graph = ep.graph_module.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.matmul.default or node.kwargs:
            continue
        x, wt = node.args
        w = _transposed_weight(ep, wt)
        if w is None or len(wt.users) != 1:
            continue
        node.target, node.args = torch.ops.aten.linear.default, (x, w)
        graph.erase_node(wt)
        done += 1
    if done:
        ep.graph_module.recompile()
    return done


def _legacy_empty(node: Any) -> bool:
    """Whether fx node ``node`` is a 1-d tensor of size 0 (what ``torch.cat`` skips beside tensors of any rank)."""
    import torch

    val = getattr(node, "meta", {}).get("val")
    return isinstance(val, torch.Tensor) and tuple(val.shape) == (0,)


def drop_empty_cat_inputs(ep: Any) -> int:
    """Remove, in ``ep``'s graph, the legacy empty inputs of each ``aten.cat`` that has another input of rank
    2 or more (torch skips them: the result is the same). Returns how many cats were rewritten.

    >>> import torch
    >>> class Cache(torch.nn.Module):
    ...     def forward(self, k):
    ...         return torch.cat([torch.tensor([]), k], dim=-2).sum()
    >>> ep = torch.export.export(Cache(), (torch.randn(2, 3, 4),), strict=False)
    >>> drop_empty_cat_inputs(ep)
    1
    """
    import torch

    graph = ep.graph_module.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        parts = list(node.args[0])
        keep = [a for a in parts if not _legacy_empty(a)]
        vals = [getattr(a, "meta", {}).get("val") for a in keep]
        if len(keep) < len(parts) and any(isinstance(v, torch.Tensor) and v.dim() > 1 for v in vals):
            node.args = (keep, *node.args[1:])
            done += 1
    if done:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return done


#: the embedding bags :func:`equal_bags` rewrites
EMBEDDING_BAGS = ("aten.embedding_bag.default", "aten.embedding_bag.padding_idx")


def _bag_args(node: Any) -> dict[str, Any]:
    """An ``embedding_bag`` call's arguments by schema name (defaults filled in)."""
    out = {a.name: a.default_value if a.has_default_value() else None for a in node.target._schema.arguments}
    out.update(zip(out, node.args))
    out.update(node.kwargs)
    return out


def _equal_bag_shape(node: Any) -> tuple[int, int] | None:
    """``(bags, bag length)`` when ``node`` is an embedding bag over equal bags that :func:`equal_bags` can
    rewrite, else None."""
    import operator

    import torch

    a = _bag_args(node)
    idx, off, psw, pad = a["indices"], a["offsets"], a["per_sample_weights"], a.get("padding_idx")
    val = getattr(idx, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or a["scale_grad_by_freq"] or a["sparse"]:
        return None
    if a["include_last_offset"] or a["mode"] not in (0, 1, 2) or (psw is not None and a["mode"] != 0):
        return None
    if pad is not None and (pad < 0 or a["mode"] == 2):
        return None
    if getattr(off, "target", None) is not torch.ops.aten.arange.start_step or len(off.args) < 3:
        return None
    start, stop, step = off.args[:3]
    n = int(val.shape[0])
    if start != 0 or stop != n or not isinstance(step, int) or step <= 0 or n % step:
        return None
    if any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in node.users):
        return None  # offset2bag, bag sizes or max indices are read
    return n // step, step


def equal_bags(ep: Any) -> int:
    """Rewrite, in ``ep``'s graph, each embedding bag over equal bags as the embedding it is.

    ``nn.EmbeddingBag`` on a 2-d input ``(B, L)`` (a recommender's multi-hot features) traces to
    ``embedding_bag(weight, indices.reshape(-1), arange(0, B*L, L), ...)``; it has no rule, and a discovered
    one cannot shard it (its other results number the bags globally), so it ran replicated with the batch.
    When the offsets are that ``arange``, nothing reads the other results, and the bag neither scales
    gradients by frequency nor makes them sparse, the bag is ``embedding(weight, indices.reshape(B, L))``
    reduced over ``L``: a sum (times ``per_sample_weights``), a mean, or a max (``max.dim``'s values, which
    send the gradient to one row as the bag does); entries equal to ``padding_idx`` count as absent (a mask,
    and a mean over the rest, 0 for a bag of padding alone). Every op has a rule; the batch shards.
    Returns the names of the nodes it made, each with the target of the bag it came from."""

    graph = ep.graph_module.graph
    origins: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) not in EMBEDDING_BAGS:
            continue
        shape = _equal_bag_shape(node)
        if shape is not None:
            target = str(node.target)
            origins.update(dict.fromkeys(_lower_bag(graph, node, shape), target))
    if origins:
        ep.graph_module.recompile()
    return origins


def _call_like(graph: Any, like: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
    """A new node ``target(*args, **kwargs)`` before ``like``, with its value's meta (computed in the trace's
    fake mode) and ``like``'s source and module meta."""
    import torch

    nd = graph.call_function(target, args, kwargs)
    vals = torch.fx.node.map_aggregate(args, lambda x: x.meta["val"] if isinstance(x, torch.fx.Node) else x)
    with like.args[0].meta["val"].fake_mode:
        nd.meta["val"] = target(*vals, **kwargs)
    _source_meta(like, nd)
    return nd


def _source_meta(like: Any, *nodes: Any) -> None:
    """Give new ``nodes`` the source and module meta of the node ``like`` they replace (the module path and
    the line of code the Graph's ops report)."""
    for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if k in like.meta:
            for nd in nodes:
                nd.meta[k] = like.meta[k]


def _lower_bag(graph: Any, node: Any, shape: tuple[int, int]) -> list[str]:
    """Replace embedding bag ``node`` (equal bags of ``shape``) by its embedding reduced (:func:`equal_bags`);
    the names of the nodes made."""
    import operator

    import torch

    aten = torch.ops.aten
    a = _bag_args(node)
    weight, mode, psw, pad = a["weight"], a["mode"], a["per_sample_weights"], a.get("padding_idx")

    made: list[str] = []

    def call(target: Any, *args: Any, **kwargs: Any) -> Any:
        nd = _call_like(graph, node, target, *args, **kwargs)
        made.append(nd.name)
        return nd

    with graph.inserting_before(node):
        ids = call(aten.reshape.default, a["indices"], list(shape))
        rows = call(aten.embedding.default, weight, ids)
        if psw is not None:
            rows = call(aten.mul.Tensor, rows, call(aten.reshape.default, psw, [*shape, 1]))
        keep = None
        if pad is not None:
            mask = call(aten.unsqueeze.default, call(aten.ne.Scalar, ids, pad), -1)
            keep = call(aten._to_copy.default, mask, dtype=weight.meta["val"].dtype)
            rows = call(aten.mul.Tensor, rows, keep)
        if mode == 2:
            out = call(operator.getitem, call(aten.max.dim, rows, 1), 0)
        elif mode == 1 and keep is not None:
            count = call(aten.clamp_min.default, call(aten.sum.dim_IntList, keep, [1]), 1)
            out = call(aten.div.Tensor, call(aten.sum.dim_IntList, rows, [1]), count)
        else:
            out = call(aten.mean.dim if mode == 1 else aten.sum.dim_IntList, rows, [1])
    off = a["offsets"]
    for u in list(node.users):
        if u.args[1] == 0:
            u.replace_all_uses_with(out)
        graph.erase_node(u)
    graph.erase_node(node)
    if not off.users:
        graph.erase_node(off)
    return made


def _root(node: Any) -> tuple[str, str] | None:
    """The name and target of the node of the exported program that ``node`` of a decomposed one came from."""
    src = node.meta.get("from_node")
    s = src[-1] if src else None
    while s is not None and getattr(s, "from_node", None):
        s = s.from_node[-1]
    return None if s is None else (str(getattr(s, "name", "")), str(getattr(s, "target", "") or ""))


def lower(ep: Any, has_rule: Callable[[str], bool] | None = None) -> Lowered:
    """Functionalize and decompose ``ep`` until the ops without rules are gone (see the module doc).

    ``has_rule(target)`` says whether an op has a rule (default: the hand rules of :mod:`hapnb.rules`).
    Ops that have one are kept whole; ops without one are decomposed when torch has a decomposition for
    them and kept otherwise (rule discovery, :mod:`hapnb.rules.discover`, takes them from there).
    """
    import torch

    if has_rule is None:
        from ..rules import registered

        known = set(registered())
        has_rule = known.__contains__
    functional_dropout(ep)
    detach_no_grad_regions(ep)
    matmul_as_linear(ep)
    drop_empty_cat_inputs(ep)
    bags = equal_bags(ep)
    todo = needs_lowering(ep, has_rule)
    if not todo:
        return Lowered(ep, bags, tuple(sorted(set(bags.values()))))
    table = {k: v for k, v in torch.export.default_decompositions().items() if not has_rule(str(k))}
    table.update(_hapnb_table())
    low = ep.run_decompositions(table)
    merge_duplicate_casts(low)
    own = {str(k) for k in _hapnb_table()}
    origins: dict[str, str] = {}
    for node in low.graph.nodes:
        if node.op != "call_function":
            continue
        root = _root(node)
        if root is None:
            continue
        name, target = root
        if target in REGIONS:  # inlined from a region: its own op (the region keeps no finer source)
            continue
        if name in bags:  # made by equal_bags
            origins[node.name] = bags[name]
        elif target and target != str(node.target) and (not has_rule(target) or target in own):
            origins[node.name] = target
    return Lowered(low, origins, tuple(sorted({*todo, *bags.values()})))
