"""Trace a PyTorch model into a :class:`~hapnb.ir.graph.Graph`: reference tensors, ops, shapes and flops.

:func:`trace` runs ``torch.export`` (aten-level ops, shapes and dtypes from node meta) and falls back
to ``torch.fx.symbolic_trace`` + shape propagation; it identifies parameters, buffers, user inputs and
the loss, and asks the rule table (:mod:`hapnb.rules`) for each op's analytic forward flops.

>>> import torch, hapnb
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 3))
>>> g = hapnb.trace(m, (torch.randn(8, 4),), loss=lambda out: out.sum())
>>> [op.target for op in g.ops]
['aten.linear.default', 'aten.sum.default']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..ir.graph import (
    DeferredProgram,
    Graph,
    Op,
    TensorArg,
    TensorRef,
    TraceError,
    fingerprint,
    normalize_args,
)

__all__ = [
    "trace",
    "resolve_model",
    "zoo_graph",
    "deferred_program",
    "from_export",
    "TraceError",
    "module_path",
]

# # Tracing turns ``loss(model(*inputs), *targets)`` into a Graph. The primary path is torch.export
# (non-strict first, then strict) in train mode, which yields aten-level ops with shapes in
# ``node.meta["val"]``. The fallback is torch.fx.symbolic_trace + ShapeProp; it covers models written
# with torch functions, Tensor methods and the common leaf modules listed in ``_FX_MODULES`` (Linear,
# Conv2d, norms, activations, dropout, pooling, Embedding, common losses), mapping each to the same
# canonical aten names; other calls keep a descriptive target (``torch.foo``) and run replicated.

_HINTS = (
    (
        ("data-dependent", "DataDependent", "GuardOnDataDependent", "control flow", "Could not guard"),
        "the model branches on tensor values (e.g. `if x.sum() > 0:`); make the branch static "
        "(depend on shapes or Python flags) or use torch.cond / torch.where",
    ),
    (
        ("Dynamic", "dynamic shape", "SymInt"),
        "the model uses shapes that depend on data; make them static for the example inputs",
    ),
    (("not supported", "Unsupported"), "the model uses a Python feature the tracer cannot capture"),
)


def _hint(reason: str) -> str:
    for keys, hint in _HINTS:
        if any(k.lower() in reason.lower() for k in keys):
            return hint
    return "simplify the module's forward (no data-dependent Python, no in-place tricks on inputs)"


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def _make_wrapper(model: Any, loss: Callable[..., Any] | None, n_inputs: int) -> Any:
    import torch

    class _Traced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            if isinstance(loss, torch.nn.Module):
                self.loss_fn = loss
            else:
                self.__dict__["loss_fn"] = loss

        def forward(self, *args: Any) -> Any:
            out = self.model(*args[:n_inputs])
            if self.loss_fn is not None:
                out = self.loss_fn(out, *args[n_inputs:])
            return out

    return _Traced()


def _input_names(model: Any, n_inputs: int, n_targets: int) -> list[str]:
    import inspect

    names: list[str] = []
    try:
        fwd = model.forward if hasattr(model, "forward") else model
        params = [
            p
            for p in inspect.signature(fwd).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        names = [p.name for p in params[:n_inputs]]
    except (TypeError, ValueError):
        pass
    while len(names) < n_inputs:
        names.append(f"input{len(names)}")
    if n_targets == 1:
        names.append("target")
    else:
        names.extend(f"target{i}" for i in range(n_targets))
    # a target named like an input would clash
    seen: dict[str, int] = {}
    out = []
    for nm in names:
        k = seen.get(nm, 0)
        seen[nm] = k + 1
        out.append(nm if k == 0 else f"{nm}_{k}")
    return out


def module_path(path: str) -> str:
    """Module path inside the user's model: drop the wrapper prefix ``model.``."""
    for junk in ("L['self'].", "L__self___"):
        if path.startswith(junk):
            path = path[len(junk) :]
    if path == "model":
        return ""
    if path.startswith("model."):
        return path[len("model.") :]
    return path


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _canonical(target: Any) -> str:
    import torch

    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.linear.default"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target}.default"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or str(target)
    return f"{mod}.{name}" if mod else name


class _ModuleTracker:
    """Forward pre/post hooks that keep the stack of executing modules (for error messages)."""

    def __init__(self, root: Any) -> None:
        self.stack: list[str] = []
        self.handles: list[Any] = []
        self.at_error: list[str] = []
        for name, mod in root.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre(module_path(name))))
            self.handles.append(mod.register_forward_hook(self._post()))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(mod: Any, args: Any) -> None:
            self.stack.append(name)

        return hook

    def _post(self) -> Callable[..., None]:
        def hook(mod: Any, args: Any, out: Any) -> None:
            if self.stack:
                self.stack.pop()

        return hook

    def innermost(self) -> str:
        named = [s for s in self.stack if s]
        return named[-1] if named else "<top-level model>"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@dataclass(frozen=True)
class _FxState:
    """A parameter of a leaf module in the fx fallback (resolved to its tensor id)."""

    tid: int


class _Builder:
    """Accumulates TensorRefs and Ops while walking an fx graph."""

    def __init__(self) -> None:
        self.tensors: list[dict[str, Any]] = []
        self.ops: list[Op] = []
        self.node_tensor: dict[Any, int] = {}  # fx node (or (node, item)) -> tensor id
        self.folded: dict[Any, Any] = {}  # fx node -> python value (sym ints etc.)
        self.names: set[str] = set()

    def add_tensor(self, name: str, val: Any, role: str, requires_grad: bool = False) -> int:
        base, k = name, 1
        while name in self.names:
            name = f"{base}_{k}"
            k += 1
        self.names.add(name)
        tid = len(self.tensors)
        shape = tuple(int(s) for s in val.shape)
        self.tensors.append(
            dict(
                id=tid,
                name=name,
                shape=shape,
                dtype=_dtype_name(val.dtype),
                role=role,
                producer=None,
                requires_grad=requires_grad,
            )
        )
        return tid

    def convert(self, value: Any, inputs: list[int]) -> Any:
        """Replace fx nodes in an argument by TensorArg placeholders / folded values."""
        import torch.fx as fx

        if isinstance(value, _FxState):
            inputs.append(value.tid)
            return TensorArg(len(inputs) - 1)
        if isinstance(value, fx.Node):
            if value in self.node_tensor:
                tid = self.node_tensor[value]
                inputs.append(tid)
                return TensorArg(len(inputs) - 1)
            if value in self.folded:
                return self.folded[value]
            raise TraceError(f"argument {value.name} has no traced value (op {value.op} {value.target})")
        if isinstance(value, (list, tuple)):
            return tuple(self.convert(v, inputs) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, self.convert(v, inputs)) for k, v in value.items()))
        return value

    def add_op(
        self,
        name: str,
        target: str,
        args: tuple,
        kwargs: dict,
        outs: list[tuple[str, Any, Any]],
        module: str,
        items: tuple[int, ...] = (),
        origin: str = "",
    ) -> None:
        from .. import rules

        inputs: list[int] = []
        cargs = tuple(self.convert(a, inputs) for a in args)
        ckw = tuple(sorted((k, self.convert(v, inputs)) for k, v in kwargs.items()))
        out_ids = []
        for out_name, key, val in outs:
            tid = self.add_tensor(out_name, val, "activation")
            self.tensors[tid]["producer"] = len(self.ops)
            self.node_tensor[key] = tid
            out_ids.append(tid)
        in_shapes = [self.tensors[t]["shape"] for t in inputs]
        out_shapes = [self.tensors[t]["shape"] for t in out_ids]
        try:
            fl = float(rules.flops(target, in_shapes, out_shapes, cargs, ckw))
        except Exception:  # a flop formula must never break tracing
            fl = 0.0
        self.ops.append(
            Op(
                id=len(self.ops),
                name=name,
                target=target,
                inputs=tuple(inputs),
                outputs=tuple(out_ids),
                args=cargs,
                kwargs=ckw,
                module=module,
                flops=fl,
                family=rules.family(target),
                output_items=items,
                origin=origin,
            )
        )

    def finish(self, inputs: list[int], params: list[int], loss: int, program: Any, name: str) -> Graph:
        consumers: dict[int, list[int]] = {}
        for op in self.ops:
            for t in op.inputs:
                lst = consumers.setdefault(t, [])
                if op.id not in lst:
                    lst.append(op.id)
        tensors = tuple(TensorRef(consumers=tuple(consumers.get(d["id"], ())), **d) for d in self.tensors)
        ops = tuple(self.ops)
        return Graph(
            tensors=tensors,
            ops=ops,
            inputs=tuple(inputs),
            params=tuple(params),
            loss=loss,
            program=program,
            fingerprint=fingerprint(tensors, ops),
            name=name,
        )


def _loss_of(b: _Builder, out_ids: list[int], where: str) -> int:
    cands = [
        t
        for t in out_ids
        if b.tensors[t]["shape"] == () and b.tensors[t]["dtype"].startswith(("float", "bfloat"))
    ]
    if len(cands) != 1:
        desc = ", ".join(f"{b.tensors[t]['name']}{list(b.tensors[t]['shape'])}" for t in out_ids) or "nothing"
        raise TraceError(
            f"{where}: the traced program must return exactly one scalar floating-point loss, but it returns "
            f"{desc}. Fix: pass loss=fn(output, *targets) to hapnb.trace, or make forward return a scalar."
        )
    return cands[0]


def _live_nodes(ep: Any) -> set[Any]:
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


def from_export(ep: Any, names: list[str], name: str, origins: dict[str, str] | None = None) -> Graph:
    """The Graph of an exported program. ``origins`` (a lowered program, :mod:`.lower`): the target each
    lowered op node came from (kept as ``Op.origin``). A program that also returns buffer updates (batch
    norm's running statistics, functionalized in-place updates) leaves out the ops that do not reach the
    loss: the distributed program computes the loss and its gradients only."""
    import torch

    live = (
        _live_nodes(ep)
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


def _export_call(b: _Builder, node: Any, origin: str = "") -> None:
    import operator

    import torch

    val = node.meta.get("val")
    if node.target is operator.getitem:
        src, idx = node.args
        if (src, idx) in b.node_tensor:
            b.node_tensor[node] = b.node_tensor[(src, idx)]
        elif isinstance(val, torch.Tensor):
            raise TraceError(f"getitem {node.name} of {src.name} has no traced tuple output")
        else:
            b.folded[node] = val
        return
    module = ""
    stack = node.meta.get("nn_module_stack")
    if stack:
        module = module_path(list(stack.values())[-1][0])
    target = _canonical(node.target)
    if isinstance(val, torch.Tensor):
        args, kwargs = normalize_args(node.target, node.args, node.kwargs)
        b.add_op(node.name, target, args, kwargs, [(node.name, node, val)], module, origin=origin)
    elif isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val):
        outs = []
        items = []
        for user in sorted(node.users, key=lambda u: u.args[1] if u.target is operator.getitem else 1 << 30):
            if user.target is operator.getitem and isinstance(val[user.args[1]], torch.Tensor):
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


# fx fallback: leaf module -> (aten target, function(module, args) -> (args, param names))
_FX_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "Linear": ("aten.linear.default", ("weight", "bias")),
    "Conv2d": ("aten.conv2d.default", ("weight", "bias")),
    "Conv1d": ("aten.conv1d.default", ("weight", "bias")),
    "LayerNorm": ("aten.layer_norm.default", ("weight", "bias")),
    "RMSNorm": ("aten.rms_norm.default", ("weight",)),
    "Embedding": ("aten.embedding.default", ("weight",)),
    "ReLU": ("aten.relu.default", ()),
    "GELU": ("aten.gelu.default", ()),
    "SiLU": ("aten.silu.default", ()),
    "Tanh": ("aten.tanh.default", ()),
    "Sigmoid": ("aten.sigmoid.default", ()),
    "Dropout": ("aten.dropout.default", ()),
    "Identity": ("aten.alias.default", ()),
    "Flatten": ("aten.flatten.using_ints", ()),
    "Softmax": ("aten.softmax.int", ()),
    "LogSoftmax": ("aten.log_softmax.int", ()),
    "MaxPool2d": ("aten.max_pool2d.default", ()),
    "AdaptiveAvgPool2d": ("aten.adaptive_avg_pool2d.default", ()),
    "CrossEntropyLoss": ("aten.cross_entropy_loss.default", ()),
    "NLLLoss": ("aten.nll_loss_nd.default", ()),
    "MSELoss": ("aten.mse_loss.default", ()),
}


def _fx_module_args(mod: Any, x_args: tuple) -> tuple[tuple, dict]:
    """Non-tensor arguments of a leaf module call in aten schema order (tensors are fx nodes)."""
    kind = type(mod).__name__
    x = x_args[0] if x_args else None
    red = {"none": 0, "mean": 1, "sum": 2}
    if kind == "Linear":
        return (x, "weight", "bias" if mod.bias is not None else None), {}
    if kind in ("Conv2d", "Conv1d"):
        b = "bias" if mod.bias is not None else None
        return (x, "weight", b, list(mod.stride), list(mod.padding), list(mod.dilation), mod.groups), {}
    if kind == "LayerNorm":
        w = "weight" if mod.weight is not None else None
        bb = "bias" if getattr(mod, "bias", None) is not None else None
        return (x, list(mod.normalized_shape), w, bb, mod.eps, True), {}
    if kind == "RMSNorm":
        w = "weight" if mod.weight is not None else None
        return (x, list(mod.normalized_shape), w, mod.eps), {}
    if kind == "Embedding":
        return ("weight", x, -1 if mod.padding_idx is None else mod.padding_idx, False, False), {}
    if kind == "Dropout":
        return (x, mod.p, True), {}
    if kind == "GELU":
        return (x,), {"approximate": mod.approximate}
    if kind == "Flatten":
        return (x, mod.start_dim, mod.end_dim), {}
    if kind in ("Softmax", "LogSoftmax"):
        return (x, mod.dim, None), {}
    if kind == "MaxPool2d":
        return (x, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode), {}
    if kind == "AdaptiveAvgPool2d":
        return (x, mod.output_size), {}
    if kind == "CrossEntropyLoss":
        return (x, x_args[1], None, red[mod.reduction], mod.ignore_index, mod.label_smoothing), {}
    if kind == "NLLLoss":
        return (x, x_args[1], None, red[mod.reduction], mod.ignore_index), {}
    if kind == "MSELoss":
        return (x, x_args[1], red[mod.reduction]), {}
    return tuple(x_args), {}


def _fx_target(node: Any) -> str:
    """Canonical aten name for an fx call_function / call_method target, when one exists."""
    import torch

    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    aliases = {"add": "add.Tensor", "mul": "mul.Tensor", "sub": "sub.Tensor", "truediv": "div.Tensor",
               "matmul": "matmul.default", "getitem": "getitem", "size": "size"}  # fmt: skip
    if name in aliases and name not in ("getitem", "size"):
        return f"aten.{aliases[name]}"
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return _canonical(node.target) if node.op == "call_function" else f"Tensor.{name}"
    overloads = packet.overloads()
    for pref in ("default", "Tensor", "int", "dim", "using_ints", "dim_IntList"):
        if pref in overloads:
            return f"aten.{name}.{pref}"
    return f"aten.{name}.{overloads[0]}" if overloads else f"aten.{name}.default"


def _named_forward(wrapper: Any, names: list[str]) -> Any:
    """fx cannot trace ``forward(*args)``: give the wrapper a forward with one named arg per input."""
    import keyword

    safe = [n if n.isidentifier() and not keyword.iskeyword(n) else f"arg{i}" for i, n in enumerate(names)]
    params = ", ".join(safe)
    scope: dict[str, Any] = {}
    exec(f"def forward(self, {params}):\n    return self._forward_all({params})\n", scope)  # noqa: S102
    cls = type(wrapper)
    named = type(cls.__name__, (cls,), {"forward": scope["forward"], "_forward_all": cls.forward})
    wrapper.__class__ = named
    return wrapper


def _from_fx(wrapper: Any, example: tuple, names: list[str], name: str) -> Graph:
    import operator

    import torch.fx as fx
    from torch.fx.passes.shape_prop import ShapeProp

    gm = fx.symbolic_trace(_named_forward(wrapper, names))
    ShapeProp(gm).propagate(*example)
    b = _Builder()
    in_ids: list[int] = []
    param_ids: list[int] = []
    state = dict(wrapper.named_parameters())
    buffers = dict(wrapper.named_buffers())

    def state_tensor(fqn: str) -> int:
        key = ("state", fqn)
        if key in b.node_tensor:
            return b.node_tensor[key]
        if fqn in state:
            t = state[fqn]
            tid = b.add_tensor(module_path(fqn), t, "param", t.requires_grad)
        else:
            tid = b.add_tensor(module_path(fqn), buffers[fqn], "buffer")
        param_ids.append(tid)
        b.node_tensor[key] = tid
        return tid

    def meta(node: Any) -> Any:
        tm = node.meta.get("tensor_meta")
        return tm

    k_in = 0
    for node in gm.graph.nodes:
        tm = meta(node)
        if node.op == "placeholder":
            nm = names[k_in] if k_in < len(names) else node.name
            k_in += 1
            tid = b.add_tensor(nm, tm, "input")
            in_ids.append(tid)
            b.node_tensor[node] = tid
        elif node.op == "get_attr":
            tid = state_tensor(node.target)
            b.node_tensor[node] = tid
        elif node.op in ("call_function", "call_method", "call_module"):
            if node.op == "call_function" and node.target is operator.getitem and node.args[0] in b.folded:
                b.folded[node] = b.folded[node.args[0]][node.args[1]]
                continue
            if node.op == "call_method" and node.target == "size":
                shape = b.tensors[b.node_tensor[node.args[0]]]["shape"]
                b.folded[node] = shape if len(node.args) == 1 else shape[node.args[1]]
                continue
            if tm is None or not hasattr(tm, "shape"):
                if isinstance(tm, (list, tuple)) and tm and hasattr(tm[0], "shape"):
                    outs, items = [], []
                    for user in node.users:
                        if user.target is operator.getitem:
                            items.append(user.args[1])
                            outs.append((user.name, user, tm[user.args[1]]))
                    for user in node.users:
                        if user.target is operator.getitem:
                            user.meta["hapnb_skip"] = True
                    b.add_op(node.name, _fx_target(node), tuple(node.args), dict(node.kwargs), outs, "",
                             tuple(items))  # fmt: skip
                continue
            if node.meta.get("hapnb_skip"):
                continue
            if node.op == "call_module":
                mod = gm.get_submodule(node.target)
                kind = type(mod).__name__
                target, pnames = _FX_MODULES.get(kind, (f"module.{kind}", ()))
                args, kwargs = _fx_module_args(mod, tuple(node.args))
                fixed = []
                for a in args:
                    if isinstance(a, str) and a in pnames:
                        fixed.append(_FxState(state_tensor(f"{node.target}.{a}")))
                    else:
                        fixed.append(a)
                module = module_path(node.target)
                b.add_op(node.name, target, tuple(fixed), kwargs, [(node.name, node, tm)], module)
            else:
                b.add_op(node.name, _fx_target(node), tuple(node.args), dict(node.kwargs),
                         [(node.name, node, tm)], "")  # fmt: skip
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            out_ids = [b.node_tensor[o] for o in outs if isinstance(o, fx.Node) and o in b.node_tensor]
            loss = _loss_of(b, out_ids, name)
            return b.finish(in_ids, param_ids, loss, gm, name)
    raise TraceError(f"{name}: the fx graph has no output node")


def _from_lowered(ep: Any, names: list[str], name: str) -> Graph:
    """The Graph of ``ep`` after :func:`.lower.lower` (unchanged when every op has a rule)."""
    from .lower import lower

    low = lower(ep)
    if low.program is ep:
        return from_export(ep, names, name)
    return from_export(low.program, names, name, low.origins)


def trace(
    model: Any,
    example_inputs: Sequence[Any],
    loss: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    targets: Sequence[Any] = (),
) -> Graph:
    """Trace ``model`` (plus an optional ``loss(output, *targets)``) into a :class:`Graph`.

    ``model(*example_inputs)`` must return a scalar loss unless ``loss`` is given, in which case the
    traced program is ``loss(model(*example_inputs), *targets)``. Raises :class:`TraceError` naming the
    module and the reason when the model cannot be traced.

    torch.export (non-strict, then strict) runs in train mode; if both fail, torch.fx.symbolic_trace with
    ShapeProp is tried (it covers torch functions, Tensor methods and common leaf modules).
    ``model`` may also be a ``torch.export.ExportedProgram`` that returns the scalar loss.
    """
    import torch

    from .lower import cumulative_batch_norm

    if isinstance(model, torch.export.ExportedProgram):  # already exported: use it as is
        specs = model.graph_signature.user_inputs
        return _from_lowered(model, list(specs), name or "model")
    if not isinstance(example_inputs, (list, tuple)):
        example_inputs = (example_inputs,)
    inputs = tuple(example_inputs)
    targets = tuple(targets)
    gname = name or type(model).__name__
    n_in = len(inputs)
    wrapper = _make_wrapper(model, loss, n_in)
    names = _input_names(model, n_in, len(targets))
    example = inputs + targets
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    wrapper.train()
    errors: list[str] = []
    where = "<top-level model>"
    try:
        tracker = _ModuleTracker(wrapper)
        try:
            with cumulative_batch_norm(wrapper):
                ep = torch.export.export(wrapper, example, strict=False)
            return _from_lowered(ep, names, gname)
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported below
            where = tracker.innermost()
            errors.append(f"torch.export (non-strict): {_first_line(exc)}")
        finally:
            tracker.remove()
        try:
            with cumulative_batch_norm(wrapper):
                ep = torch.export.export(wrapper, example, strict=True)
            return _from_lowered(ep, names, gname)
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001
            errors.append(f"torch.export (strict): {_first_line(exc)}")
        try:
            return _from_fx(wrapper, example, names, gname)
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001
            errors.append(f"torch.fx.symbolic_trace: {_first_line(exc)}")
    finally:
        for m, mode in modes:  # restore every submodule's own train/eval flag
            m.training = mode
    reason = errors[0]
    raise TraceError(
        f"cannot trace {gname}: module {where!r} failed — {reason}\n"
        f"  hint: {_hint(reason)}\n  all attempts:\n    " + "\n    ".join(errors)
    )


def resolve_model(
    model_or_graph: Any,
    cluster: Any,
    example_inputs: Sequence[Any] | None = None,
    loss: Any = None,
    timings: dict[str, Any] | None = None,
    **zoo_options: Any,
) -> tuple[Graph, dict[str, Any] | None]:
    """A Graph from a Graph, an nn.Module (+ example inputs) or a zoo name / ``pkg.mod:factory``
    (:func:`zoo_graph`, which fills ``timings``)."""
    if isinstance(model_or_graph, Graph):
        return model_or_graph, None
    if isinstance(model_or_graph, str):
        return zoo_graph(model_or_graph, timings, devices=cluster.n, **zoo_options)
    if example_inputs is None:
        raise ValueError(
            "synthesize(model, ...) needs example_inputs=(...) to trace an nn.Module; "
            "or pass a zoo name such as 'bert', or a Graph from hapnb.trace"
        )
    return trace(model_or_graph, tuple(example_inputs), loss=loss), None


def zoo_graph(
    name: str, timings: dict[str, Any] | None = None, **options: Any
) -> tuple[Graph, dict[str, Any]]:
    """The Graph of zoo model ``name`` (or factory ``pkg.mod:factory``) built with ``options`` (see
    :func:`hapnb.zoo.build`), and its model spec as JSON.

    Zoo models come from the trace cache (:mod:`hapnb.tracing.cache`) or are recorded on meta tensors
    (:mod:`hapnb.tracing.record`: no weights, no torch.export; the same Graph, checked by the tests for
    every zoo model) and stored there; they get a :class:`DeferredProgram` that traces the model with its
    weights when a program is needed. Factories, models the recorder cannot reproduce exactly, and
    ``HAPNB_TRACE=export`` in the environment take the full path: build with weights, then :func:`trace`.
    ``timings`` (when given) receives ``build_s``, ``trace_s`` and ``trace_path`` (``cache``,
    ``recorded`` or ``export``).
    """
    import dataclasses
    import logging
    import os
    import time

    from .. import zoo

    t = timings if timings is not None else {}
    label = name.split(":")[-1]
    spec = zoo.model_spec(name, **options).to_json()
    if ":" not in name and os.environ.get("HAPNB_TRACE", "fast") != "export":
        from . import cache
        from .record import trace_zoo_meta

        t0 = time.perf_counter()
        g = cache.load(spec)
        if g is not None:
            t.update(build_s=0.0, trace_s=time.perf_counter() - t0, trace_path="cache")
            return dataclasses.replace(g, program=deferred_program(spec, label, g.fingerprint)), spec
        try:
            g, _ = trace_zoo_meta(name, timings=t, **options)
        except Exception as exc:  # noqa: BLE001 - the full path below reports real errors
            logging.getLogger(__name__).info(
                "%s: recording on meta tensors failed (%s); using torch.export", name, exc
            )
        else:
            cache.save(spec, g)
            t["trace_path"] = "recorded"
            return dataclasses.replace(g, program=deferred_program(spec, label, g.fingerprint)), spec
    t0 = time.perf_counter()
    model, inputs, _ = zoo.build(name, **options)
    t1 = time.perf_counter()
    g = trace(model, inputs, name=label)
    t.update(build_s=t1 - t0, trace_s=time.perf_counter() - t1, trace_path="export")
    return g, spec


def deferred_program(spec: dict[str, Any], name: str, fingerprint: str) -> DeferredProgram:
    """A :class:`DeferredProgram` that rebuilds the model of ``spec`` with its weights, traces it with
    :func:`trace` and checks it gives the graph ``fingerprint`` (the one recorded or cached)."""

    def make() -> Any:
        from .. import zoo

        model, inputs, _ = zoo.build_spec(zoo.ModelSpec.from_json(spec))
        full = trace(model, inputs, name=name)
        if full.fingerprint != fingerprint:
            raise TraceError(
                f"{name}: traced with its weights the model gives graph {full.fingerprint}, but the graph it "
                f"was planned with (recorded on meta tensors or read from the trace cache) is {fingerprint}. "
                "Set HAPNB_TRACE=export to trace with torch.export only, and please report this."
            )
        return full.program

    return DeferredProgram(make, f"{spec.get('name', name)}, traced with its weights on first use")
