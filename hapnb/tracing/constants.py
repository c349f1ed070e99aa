"""Constant folding: the parts of an exported program that depend on no input and no weight become lifted
constants (issue 18: T5's relative position buckets kept its search from proving its plan optimal).

Library models compute tables from shapes alone in every step: T5's relative position buckets
(``arange``, ``abs``, ``log``, ``where``, ... on ``(S, S)`` integers), Hugging Face's causal and padding
masks. To the search each such op is one more tensor whose form it must choose, and because they sit
between the layers' own ops, every choice multiplies the partial programs it keeps: on T5 (8+8 layers,
seq 512) the A* stopped at its budget 0.6 % below the optimum. Their values are known when the model is
traced, so :func:`fold_constants` computes them once and hands them to the program as constants, as a
compiler's constant folding does; the search then loads each in the form its consumer wants, at no cost,
like a weight, and each rank computes nothing of them per step.

What is folded (the rest of the program is left as it is):

* a **constant op** is a ``call_function`` of an aten overload with one tensor result that no later op
  changes in place, that is neither random (``nondeterministic_seeded``: ``rand``, ``dropout``,
  ``bernoulli``, ...), nor in-place, nor uninitialized memory (``empty``), and whose tensor arguments
  are lifted constants, frozen buffers (non-persistent buffers the program never updates: no checkpoint
  holds them and no step changes them, e.g. a rotary embedding's ``inv_freq``) or results of constant
  ops (a size read from an input's shape is a number: shapes are static);
* a constant op's result that a non-constant op uses is **materialized** (becomes a lifted constant,
  named ``<module path>.folded_<node name>``) unless it is a lone factory (an op without tensor arguments, such
  as GPT's position ``arange``, is already as cheap to choose a form for as a constant), or it is large:
  above :data:`MAX_BYTES` (a constant stays in every device's memory; a causal mask expanded to the
  batch, ``(64, 1, 512, 512)``, is computed in each step as before), or above :data:`SMALL_BYTES` and
  larger than every tensor argument of its op (it *grows*: an ``expand``, a broadcasting comparison).
  A result that is not materialized keeps its op in the program, and that op's arguments are considered
  in turn;
* an **index by aranges** (``x[arange(B)[:, None, None, None], arange(S)[None, None, None, :]]``, how
  Hugging Face's mask functions read a padding mask ``(B, S)`` into ``(B, 1, 1, S)``) is a reshape of
  ``x``: when every index of ``aten.index.Tensor`` is the value of a constant op (integers) that holds
  ``arange(n_k)`` (``n_k`` the length of the dim of ``x`` it indexes) along one axis ``a_k`` and 1 elsewhere,
  the axes increase with ``k``, and the indices address the leading dims of ``x``, the op becomes
  ``reshape(x, broadcast shape + the dims of x not indexed)``, which holds the same elements in the same
  order. The index rule cannot shard a dim that a tensor index addresses, so the padding mask (and the
  batch with it) had to be whole on every device; a reshape shards it like any view;
* constant ops nothing uses any more are removed.

Folding is exact: the constants hold the values the removed ops would compute in every step. A program
with nothing to fold is returned unchanged (the same object; every zoo model), and folding a folded
program changes nothing.

>>> import torch
>>> class Bias(torch.nn.Module):
...     def forward(self, x):
...         pos = torch.arange(x.shape[1])
...         rel = (pos[None, :] - pos[:, None]).abs()   # depends on the shape alone
...         return (x + rel).sum()
>>> ep = torch.export.export(Bias(), (torch.randn(2, 3, 3),), strict=False)
>>> out = fold_constants(ep)
>>> [out.program.constants[c].tolist() for c in out.folded]
[[[0, 1, 2], [1, 0, 1], [2, 1, 0]]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Folded", "fold_constants", "folded_constants", "SMALL_BYTES", "MAX_BYTES"]

#: a constant that grows past its op's arguments is still materialized up to this size (bytes)
SMALL_BYTES = 64 * 1024
#: no constant larger than this (bytes) is materialized
MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Folded:
    """The program after :func:`fold_constants` and the names (FQNs) of the constants it added."""

    program: Any
    folded: tuple[str, ...] = ()


def _nbytes(val: Any) -> int:
    return int(val.numel()) * int(val.element_size())


def _tensor_args(node: Any) -> list[Any]:
    """The fx nodes among ``node``'s arguments whose values are tensors."""
    import torch

    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _is_constant_op(node: Any, constant: set[Any]) -> bool:
    import torch

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor) or target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or "empty" in target._schema.name:
        return False
    if any(_mutates(u) for u in node.users):  # changed in place later (a program not functionalized yet)
        return False
    return all(a in constant for a in _tensor_args(node))


def _mutates(node: Any) -> bool:
    """Whether ``node`` is an in-place op (``x.add_(1)`` in a program not functionalized yet)."""
    import torch

    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _sources(ep: Any) -> dict[str, str]:
    """Placeholder name -> name in ``ep.constants`` of every value the program reads but no step changes:
    its lifted constants and its *frozen buffers*, the non-persistent buffers the program never updates
    (in no state dict, so no checkpoint restores them; e.g. a rotary embedding's ``inv_freq``)."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    out = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    updated = {s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    for spec in sig.input_specs:
        if spec.kind == InputKind.BUFFER and spec.persistent is False and spec.target not in updated:
            out[spec.arg.name] = spec.target
    return out


def _constant_ops(ep: Any, consts: dict[str, str]) -> set[Any]:
    """The constant ops of ``ep`` (module doc), given its :func:`_sources`."""
    constant = {n for n in ep.graph.nodes if n.op == "placeholder" and n.name in consts}
    ops: set[Any] = set()
    for node in ep.graph.nodes:  # topological order: arguments first
        if _is_constant_op(node, constant):
            constant.add(node)
            ops.add(node)
    return ops


def _materialize(ep: Any, ops: set[Any], views: set[Any]) -> list[Any]:
    """The constant ops (of ``ops``) whose results become lifted constants (module doc), in graph order;
    ``views``: index ops that become reshapes (their indices are not needed)."""
    todo = [
        a for n in ep.graph.nodes if n not in ops and n not in views for a in n.all_input_nodes if a in ops
    ]
    chosen: set[Any] = set()
    kept: set[Any] = set()
    while todo:
        node = todo.pop()
        if node in chosen or node in kept:
            continue
        args = _tensor_args(node)
        size = _nbytes(node.meta["val"])
        grows = size > SMALL_BYTES and all(size > _nbytes(a.meta["val"]) for a in args)
        if args and not grows and size <= MAX_BYTES:
            chosen.add(node)
        else:  # the op stays in the program; its constant arguments are considered in turn
            kept.add(node)
            todo.extend(a for a in args if a in ops)
    return [n for n in ep.graph.nodes if n in chosen]


def _evaluate(ep: Any, wanted: list[Any], consts: dict[str, str]) -> dict[Any, Any]:
    """The values of ``wanted`` (constant ops), computed from the values of ``consts`` (:func:`_sources`)."""
    import torch

    need: set[Any] = set()
    stack = list(wanted)
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(n.all_input_nodes)
    env: dict[Any, Any] = {}

    def value(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return env[a] if a in env else a.meta.get("val")
        return a

    with torch.no_grad():
        for n in ep.graph.nodes:
            if n not in need:
                continue
            if n.op == "placeholder":
                env[n] = ep.constants[consts[n.name]]
            elif n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor):
                args = torch.fx.node.map_aggregate(n.args, value)
                kwargs = torch.fx.node.map_aggregate(n.kwargs, value)
                env[n] = n.target(*args, **kwargs)
    return {n: env[n].clone() for n in wanted}


def _arange_axis(value: Any, n: int, rank: int) -> int | None:
    """The axis (of ``rank`` axes, aligned to the right) along which integer tensor ``value`` holds
    ``arange(n)`` with every other axis of length 1; -1 for ``n == 1`` (a zero, on no axis); None otherwise."""
    import torch

    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim() > rank:
        return None
    shape = (1,) * (rank - value.dim()) + tuple(value.shape)
    long = [a for a, m in enumerate(shape) if m != 1]
    if n == 1:
        return -1 if not long and int(value.reshape(-1)[0]) == 0 else None
    if len(long) != 1 or shape[long[0]] != n:
        return None
    return long[0] if torch.equal(value.reshape(-1).long(), torch.arange(n)) else None


def _arange_views(ep: Any, ops: set[Any], consts: dict[str, str]) -> dict[Any, list[int]]:
    """The ``aten.index.Tensor`` ops of ``ep`` that are reshapes (module doc), each with its shape."""
    import torch

    cands = []
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.index.Tensor:
            continue
        x, idx = node.args[0], node.args[1]
        if x in ops or not idx or not all(isinstance(i, torch.fx.Node) and i in ops for i in idx):
            continue
        cands.append(node)
    if not cands:
        return {}
    values = _evaluate(ep, [i for n in cands for i in n.args[1]], consts)
    out: dict[Any, list[int]] = {}
    for node in cands:
        x, idx = node.args[0].meta["val"], node.args[1]
        rank = max(values[i].dim() for i in idx)
        axes = [_arange_axis(values[i], int(x.shape[k]), rank) for k, i in enumerate(idx)]
        placed = [a for a in axes if a is not None and a >= 0]
        if any(a is None for a in axes) or placed != sorted(set(placed)):
            continue
        shape = [1] * rank
        for k, a in enumerate(axes):
            if a is not None and a >= 0:
                shape[a] = int(x.shape[k])
        shape += [int(m) for m in x.shape[len(idx) :]]
        if tuple(shape) == tuple(node.meta["val"].shape):
            out[node] = shape
    return out


def folded_constants(graph: Any) -> tuple[str, ...]:
    """The names of a traced Graph's folded constants (``<module path>.folded_<node name>``, :func:`_fqn`)."""
    return tuple(
        t.name for t in graph.tensors if t.role == "const" and t.name.rsplit(".", 1)[-1].startswith("folded_")
    )


def _fqn(node: Any, taken: Any) -> str:
    """The constant's name: ``<module path>.folded_<node name>`` (a bare node name such as ``to`` would
    shadow a module attribute when the program is unlifted), unique among ``taken``."""
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    base = f"{path}.folded_{node.name}" if path else f"folded_{node.name}"
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def fold_constants(ep: Any) -> Folded:
    """Fold the constant parts of the exported program ``ep`` into lifted constants (module doc); ``ep``
    itself is not changed."""
    import torch
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument

    sources = _sources(ep)
    ops = _constant_ops(ep, sources)
    views = _arange_views(ep, ops, sources)
    chosen = _materialize(ep, ops, set(views))
    if not chosen and not views:
        return Folded(ep)
    values = _evaluate(ep, chosen, sources)
    graph = torch.fx.Graph()
    remap: dict[Any, Any] = {}
    out = graph.graph_copy(ep.graph, remap)
    graph.output(out)
    for node, shape in views.items():
        new = remap[node]
        new.target, new.args, new.kwargs = torch.ops.aten.reshape.default, (new.args[0], shape), {}
    sig = ep.graph_signature
    specs = list(sig.input_specs)
    first_user = next((k for k, s in enumerate(specs) if s.kind == InputKind.USER_INPUT), len(specs))
    users = {remap[n] for n in ep.graph.nodes if n.op == "placeholder" and n.name in sig.user_inputs}
    # the new placeholders go where their specs go: before the user inputs (after every other placeholder)
    anchor = next(n for n in graph.nodes if n in users or n.op != "placeholder")
    constants = dict(ep.constants)
    taken = set(ep.state_dict) | set(constants)
    new_specs: list[Any] = []
    names: list[str] = []
    for node in chosen:
        fqn = _fqn(node, taken)
        taken.add(fqn)
        with graph.inserting_before(anchor):
            holder = graph.placeholder(f"c_{node.name}")
        holder.meta.update(remap[node].meta)
        remap[node].replace_all_uses_with(holder)
        constants[fqn] = values[node]
        new_specs.append(InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name=holder.name), target=fqn))
        names.append(fqn)
    removable = {remap[n] for n in ops}
    for node in reversed(list(graph.nodes)):  # the folded ops and the constant ops only they used
        if node in removable and not node.users:
            graph.erase_node(node)
    gm = torch.fx.GraphModule(ep.graph_module, graph)
    new_sig = ExportGraphSignature(
        input_specs=specs[:first_user] + new_specs + specs[first_user:], output_specs=list(sig.output_specs)
    )
    program = torch.export.ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=new_sig,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=ep.module_call_graph,
        example_inputs=ep.example_inputs,
        constants=constants,
        verifiers=ep.verifiers,
    )
    return Folded(program, tuple(names))
