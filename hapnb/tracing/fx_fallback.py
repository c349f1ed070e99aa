"""The fallback tracing path: ``torch.fx.symbolic_trace`` with shape propagation, for models torch.export
cannot capture. It covers models written with torch functions, Tensor methods and the common leaf modules
listed in ``_FX_MODULES`` (Linear, Conv2d, norms, activations, dropout, pooling, Embedding, common
losses), mapping each to the same canonical aten names as torch.export; other calls keep a descriptive
target (``torch.foo``) and run replicated.
"""

from __future__ import annotations

from typing import Any

from ..ir.graph import Graph, TraceError
from .builder import _Builder, _canonical, _FxState, _loss_of, module_path

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


#: torch functions and Tensor methods that draw random numbers
_RANDOM = frozenset(
    "rand randn randint randperm rand_like randn_like randint_like bernoulli bernoulli_ multinomial normal "
    "normal_ uniform_ exponential_ geometric_ cauchy_ log_normal_ random_ poisson".split()
)


def _no_random_draws() -> Any:
    """A torch function mode for symbolic tracing that refuses a random draw made on no traced value (as
    LayerDrop's ``torch.rand([]) < p``): fx runs it once, at trace time, and would freeze that draw (a
    layer always kept, or always skipped) into the program."""
    import torch.fx as fx
    from torch.overrides import TorchFunctionMode

    class NoRandomDraws(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            fname = getattr(func, "__name__", "")
            if fname in _RANDOM and not any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
                raise RuntimeError(  # not a TraceError: the tracer reports it as this path's failure
                    f"the model draws a random number ({fname}) on no traced value, so symbolic tracing would "
                    "fix that one draw into the program (a branch on it, as LayerDrop's "
                    "`torch.rand([]) < p`, taken the same way in every step)"
                )
            return func(*args, **kwargs)

    return NoRandomDraws()


def _from_fx(wrapper: Any, example: tuple, names: list[str], name: str) -> Graph:
    import operator

    import torch.fx as fx
    from torch.fx.passes.shape_prop import ShapeProp

    with _no_random_draws():
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
