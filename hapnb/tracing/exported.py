"""The Graph of a ``torch.export`` program (the primary tracing path): placeholders become parameters,
buffers, constants and inputs from the graph signature, each ``call_function`` node an op (tuple results
through their ``getitem`` users, symbolic sizes folded to Python values), and the output the loss. Ops
without a rule are lowered first (:mod:`.lower`); ops that only update buffers are left out.
"""

from __future__ import annotations

import re
from typing import Any

from ..ir.graph import Graph, TraceError, normalize_args
from .builder import _Builder, _canonical, _loss_of, module_path


def live_nodes(ep: Any) -> set[Any]:
    """The nodes the exported program's user outputs depend on (a lowered program also returns its
    buffer updates, e.g. batch norm's running statistics: they do not reach the loss)."""
    import torch

    sig = ep.graph_signature
    user = set(sig.user_outputs)
    out = next(n for n in ep.graph.nodes if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    todo = [o for o in outs if isinstance(o, torch.fx.Node) and (not user or o.name in user)]
    live: set[Any] = set()
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)
    return live


def mutated_buffers(program: Any) -> list[tuple[str, Any]]:
    """``(buffer name, node of its new value)`` for every buffer an exported program updates, in output
    order; the name is the graph tensor's (the model FQN). Empty for other programs (fx fallback)."""
    import torch
    from torch.export.graph_signature import OutputKind

    if not isinstance(program, torch.export.ExportedProgram):
        return []
    nodes = {nd.name: nd for nd in program.graph.nodes}
    return [
        (module_path(spec.target), nodes[spec.arg.name])
        for spec in program.graph_signature.output_specs
        if spec.kind == OutputKind.BUFFER_MUTATION and spec.target is not None
    ]


def weight_names(program: Any) -> dict[str, str]:
    """Placeholder name -> graph tensor name (the model FQN) of every parameter, buffer and lifted constant
    of an exported program: what a walk back from a buffer update meets as an old weight."""
    sig = program.graph_signature
    src = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    src.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    return {k: module_path(v) for k, v in src.items()}


def from_export(ep: Any, names: list[str], name: str, origins: dict[str, str] | None = None) -> Graph:
    """The Graph of an exported program. ``origins`` (a lowered program, :mod:`.lower`): the target each
    lowered op node came from (kept as ``Op.origin``). A program that also returns buffer updates (batch
    norm's running statistics, functionalized in-place updates) leaves out the ops that do not reach the
    loss: the distributed program computes the loss and its gradients only."""
    import torch

    live = (
        live_nodes(ep)
        if len(ep.graph_signature.output_specs) > len(ep.graph_signature.user_outputs)
        else None
    )

    sig = ep.graph_signature
    params = dict(sig.inputs_to_parameters)
    buffers = dict(sig.inputs_to_buffers)
    consts = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}))
    user_inputs = list(sig.user_inputs)
    state = dict(ep.state_dict)
    b = _Builder()
    in_ids: list[int] = []
    param_ids: list[int] = []
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                b.folded[node] = val
                continue
            if node.name in params:
                fqn = params[node.name]
                p = state.get(fqn)
                rg = bool(getattr(p, "requires_grad", True))
                tid = b.add_tensor(module_path(fqn), val, "param", requires_grad=rg)
                param_ids.append(tid)
            elif node.name in buffers:
                tid = b.add_tensor(module_path(buffers[node.name]), val, "buffer")
                param_ids.append(tid)
            elif node.name in consts:
                tid = b.add_tensor(module_path(consts[node.name]), val, "const")
                param_ids.append(tid)
            else:
                k = user_inputs.index(node.name) if node.name in user_inputs else len(in_ids)
                nm = names[k] if k < len(names) else node.name
                tid = b.add_tensor(nm, val, "input")
                in_ids.append(tid)
            b.node_tensor[node] = tid
        elif node.op == "call_function":
            if live is None or node in live:
                _export_call(b, node, (origins or {}).get(node.name, ""))
        elif node.op == "output":
            outs = node.args[0]
            user_out_names = list(sig.user_outputs)
            out_ids = []
            for o in outs if isinstance(outs, (list, tuple)) else [outs]:
                if isinstance(o, torch.fx.Node) and (not user_out_names or o.name in user_out_names):
                    if o in b.node_tensor:
                        out_ids.append(b.node_tensor[o])
            loss = _loss_of(b, out_ids, name)
            return b.finish(in_ids, param_ids, loss, ep, name)
        # get_attr nodes (submodules of higher-order ops) are carried by the program only
    raise TraceError(f"{name}: the exported graph has no output node")


def _added_by_load(getitem: Any) -> bool:
    """Whether ``getitem`` is one that ``torch.export.load`` adds, unread, for a tuple result the saved program
    does not read (``<op>_unused_<k>``, e.g. ``native_dropout``'s mask): the graph leaves it out, so a
    saved and loaded program (a bundle) gives the graph the program gave before it was saved."""
    src, k = getitem.args
    return not getitem.users and getitem.name == f"{src.name}_unused_{k}"


def _static_shapes(node: Any, val: Any, target: str, module: str) -> None:
    """Raise a TraceError naming the op and the model's line when a result of ``node`` has a size that
    depends on the data (an unbacked symbol: ``x[mask]``, ``nonzero``, ``masked_select``, ``unique``):
    a plan shards fixed shapes."""
    import operator

    import torch

    if isinstance(val, (list, tuple)):  # the results the program reads
        read = {u.args[1] for u in node.users if u.target is operator.getitem}
        vals = [v for k, v in enumerate(val) if k in read]
    else:
        vals = [val]
    for v in vals:
        if not isinstance(v, torch.Tensor) or all(isinstance(s, int) for s in v.shape):
            continue
        frames = [ln.strip() for ln in str(node.meta.get("stack_trace") or "").splitlines() if ln.strip()]
        at = ""
        if len(frames) >= 2 and frames[-2].startswith("File "):
            m = re.match(r'File "([^"]+)", line (\d+)', frames[-2])
            if m is not None:
                at = f"\n  at: {m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}: `{frames[-1]}`"
        raise TraceError(
            f"op {node.name} ({target}{f', module {module!r}' if module else ''}) makes a tensor of shape "
            f"{tuple(v.shape)}, whose size depends on the values of the data{at}\n  hint: boolean-mask "
            "indexing (`x[mask]`), `nonzero`, `masked_select` and `unique` give data-dependent shapes, and a "
            "plan shards fixed ones: pick the rows with fixed shapes instead (for one row per sample, "
            "`x[torch.arange(B), idx]` with `idx = mask.int().argmax(-1)`), or mask with `torch.where`"
        )


def _export_call(b: _Builder, node: Any, origin: str = "") -> None:
    import operator

    import torch

    val = node.meta.get("val")
    if node.target is operator.getitem:
        src, idx = node.args
        if (src, idx) in b.node_tensor:
            b.node_tensor[node] = b.node_tensor[(src, idx)]
        elif isinstance(val, torch.Tensor) and not _added_by_load(node):
            raise TraceError(f"getitem {node.name} of {src.name} has no traced tuple output")
        else:
            b.folded[node] = val
        return
    module = ""
    stack = node.meta.get("nn_module_stack")
    if stack:
        module = module_path(list(stack.values())[-1][0])
    target = _canonical(node.target)
    _static_shapes(node, val, target, module)
    if isinstance(val, torch.Tensor):
        args, kwargs = normalize_args(node.target, node.args, node.kwargs)
        b.add_op(node.name, target, args, kwargs, [(node.name, node, val)], module, origin=origin)
    elif isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val):
        outs = []
        items = []
        for user in sorted(node.users, key=lambda u: u.args[1] if u.target is operator.getitem else 1 << 30):
            if (
                user.target is operator.getitem
                and isinstance(val[user.args[1]], torch.Tensor)
                and not _added_by_load(user)
            ):
                k = user.args[1]
                if k in items:
                    continue
                items.append(k)
                outs.append((user.name, (node, k), val[k]))
        if not outs:  # a tuple op whose results are unused: keep nothing
            return
        args, kwargs = normalize_args(node.target, node.args, node.kwargs)
        b.add_op(node.name, target, args, kwargs, outs, module, tuple(items), origin)
    elif val is None:
        return  # assertions and other ops without results
    else:
        # sym-size ops and scalar arithmetic: fold to python values (static shapes)
        try:
            b.folded[node] = int(val) if not isinstance(val, (float, bool)) else val
        except (TypeError, ValueError):
            b.folded[node] = val


def _from_lowered(ep: Any, names: list[str], name: str) -> Graph:
    """The Graph of ``ep`` after :func:`.lower.lower` (unchanged when every op has a rule) and
    :func:`.constants.fold_constants` (unchanged when nothing depends on no input and no weight)."""
    from .constants import fold_constants
    from .lower import lower

    low = lower(ep)
    folded = fold_constants(low.program)
    return from_export(folded.program, names, name, low.origins or None)
