"""The fast tracer for zoo models: build the model on the meta device and record its forward at torch's
pre-dispatch level, giving the same Graph as :func:`hapnb.trace` (same ops, tensors, names, shapes, module
paths, flops and fingerprint) without torch.export.

Why: ``torch.export`` (and ``make_fx``) import ``torch._dynamo`` on first use (~1.4 s on the development
machine, as long as ``import torch`` itself), and building the paper's BERT with its weights costs ~1 s of
random initialisation. Here the model is built with its weights on the meta device and their in-place
initialisers skipped (:func:`meta_build`, :func:`to_meta`), and the forward runs once on meta tensors under
a dispatch mode installed at the ``PreDispatch`` key — the key torch.export's own pre-dispatch tracing
records at — so each op is seen exactly as export sees it (``aten.linear``, ``aten.dropout``,
``aten.scaled_dot_product_attention``, ... before autograd and composite decompositions), under the same
global flags export sets (:func:`_as_export`). Node names come from torch.fx's own namespace in export's
order (one ``getitem`` per element of a tuple result; every op kept: training IR has no dead-code pass),
module paths from forward hooks (the innermost module running, as export's ``nn_module_stack``),
argument defaults from the op schema (:func:`normalize_args`). Meta kernels that would import
``torch._dynamo`` get a stand-in for the duration (:func:`without_dynamo`); a few ops get their result
made here (:data:`_RESULTS`: layouts export's fake CPU tensors have, and slow Python meta kernels).

What it refuses (:class:`Unsupported`, and the caller falls back to torch.export): in-place ops in the
forward, non-persistent buffers (export folds the ops that read only them, :mod:`.constants`), tensors
that are neither a parameter, buffer, input nor an op's result (lifted constants), and
results other than tensors, tuples of tensors and None.
``tests/tracing/test_fasttrace.py`` checks the recorded Graph against torch.export for every zoo model.

>>> from hapnb.tracing.record import trace_zoo_meta
>>> g, spec = trace_zoo_meta("mlp", devices=2, layers=1, hidden=8, input=4, batch=4)
>>> [op.target for op in g.ops]
['aten.linear.default', 'aten.relu.default', 'aten.linear.default', 'aten.cross_entropy_loss.default']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..ir.graph import Graph, TensorArg, TraceError, normalize_args
from .builder import _Builder, _loss_of, module_path
from .tracer import _input_names, _make_wrapper

__all__ = ["Unsupported", "meta_build", "to_meta", "record", "trace_zoo_meta", "without_dynamo"]

#: constructors that make the big tensors of a module (their meta kernels are in C++)
_META_NATIVE = ("empty", "empty_strided", "empty_permuted")


class Unsupported(TraceError):
    """The model does something the fast tracer does not reproduce exactly (use torch.export)."""


def _is_meta_target(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    import torch

    t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
    return t if isinstance(t, torch.Tensor) and t.is_meta else None


@contextlib.contextmanager
def without_dynamo() -> Iterator[None]:
    """Run meta kernels without importing ``torch._dynamo``.

    Many meta kernels are Python reference implementations wrapped by ``torch._disable_dynamo``, whose
    first call imports ``torch._dynamo`` (~1.4 s) only to wrap the function with ``torch._dynamo.disable``
    — which changes nothing outside ``torch.compile``. While no real ``torch._dynamo`` is loaded, a stand-in
    module whose ``disable`` returns the function itself is installed for the duration; afterwards it is
    removed and every function it saw forgets the cached wrapper, so a later real ``torch._dynamo``
    wraps them as usual. (If anything else of ``torch._dynamo`` is asked for, the stand-in raises
    AttributeError and the caller falls back to torch.export.)
    """
    import sys
    import types

    import torch

    if "torch._dynamo" in sys.modules:
        yield
        return
    seen: list[Any] = []

    def disable(fn: Any = None, recursive: bool = True, **_: Any) -> Any:
        seen.append(fn)
        return fn

    stub = types.ModuleType("torch._dynamo", "hapnb's stand-in while recording on meta tensors")
    stub.disable = disable  # type: ignore[attr-defined]
    sys.modules["torch._dynamo"] = stub
    try:
        yield
    finally:
        if sys.modules.get("torch._dynamo") is stub:
            del sys.modules["torch._dynamo"]
        if torch.__dict__.get("_dynamo") is stub:
            del torch._dynamo
        for fn in seen:
            if getattr(fn, "__dict__", {}).get("__dynamo_disable") is fn:
                del fn.__dict__["__dynamo_disable"]


@contextlib.contextmanager
def meta_build() -> Iterator[None]:
    """Within it, the big tensors of an ``nn.Module`` being built have no storage: ``torch.empty`` (what
    ``nn.Linear``, ``nn.Embedding`` and the zoo's expert weights start from) makes meta tensors, and
    in-place initialisers of meta tensors do nothing.

    Other constructors (``zeros``, ``arange``, ``randn``, ``full``, ...) run on the CPU, and so does
    arithmetic on their results (a bias, a sinusoidal table, a causal mask): they are small, and the meta
    versions of those ops are Python reference implementations that import sympy and torch._dynamo.
    Move the built module and its inputs to the meta device afterwards (:func:`to_meta`).
    """
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    ctors = _device_constructors()
    native = {getattr(torch, n) for n in _META_NATIVE}

    class _MetaBuild(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func in native and kwargs.get("device") is None:
                kwargs["device"] = "meta"
                return func(*args, **kwargs)
            if func not in ctors:
                name = getattr(func, "__name__", "")
                if name.endswith("_") and not name.endswith("__"):
                    t = _is_meta_target(args, kwargs)
                    if t is not None:
                        return t  # an initialiser (normal_, uniform_, zero_, ...): no values on meta
            return func(*args, **kwargs)

    with _MetaBuild():
        yield


def to_meta(model: Any, inputs: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
    """``model`` (moved in place) and ``inputs`` on the meta device."""
    import torch

    model.to("meta")
    return model, tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)


def _recorder(on_op: Callable[[Any, tuple, dict], Any]) -> Any:
    """A dispatch mode for the PreDispatch key (torch accepts only its own mode types there: this one
    derives from the schema-check mode and replaces what it does by ``on_op``)."""
    import torch
    from torch._subclasses.schema_check_mode import SchemaCheckMode

    class _Recorder(SchemaCheckMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # never compiled: no torch._dynamo.disable wrapper (importing dynamo costs ~1.4 s)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return on_op(func, tuple(args), dict(kwargs or {}))

    mode = _Recorder()
    mode._dispatch_key = torch._C.DispatchKey.PreDispatch
    return mode


@dataclass(frozen=True)
class _Ref:
    """A tensor argument resolved when the op ran: ``(event, item)`` of an op result, or ``(-1, k)``
    for the k-th placeholder (parameters, buffers, then inputs)."""

    event: int
    item: int


@dataclass(frozen=True)
class _Val:
    """What the Builder reads of a result tensor (its shape and dtype)."""

    shape: tuple[int, ...]
    dtype: Any


@dataclass
class _Event:
    name: str
    func: Any
    args: tuple
    kwargs: dict
    outs: list[_Val]
    items: list[str]  # getitem names of a tuple result (empty for one tensor)
    module: str


class _RefBuilder(_Builder):
    """The Builder with :class:`_Ref` values in place of fx nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[_Ref, int] = {}

    def convert(self, value: Any, inputs: list[int]) -> Any:
        if isinstance(value, _Ref):
            inputs.append(self.ids[value])
            return TensorArg(len(inputs) - 1)
        if isinstance(value, (list, tuple)):
            return tuple(self.convert(v, inputs) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, self.convert(v, inputs)) for k, v in value.items()))
        return value


def _resolve(value: Any, where: dict[int, tuple[_Ref, Any]]) -> Any:
    """``value`` with every tensor replaced by its :class:`_Ref` and meta devices by the CPU (the model is
    built on the CPU when it is traced with weights). Entries of ``where`` hold weak references: an id
    counts only while its tensor is the same object."""
    import torch

    if isinstance(value, torch.Tensor):
        hit = where.get(id(value))
        if hit is None or hit[1]() is not value:
            raise Unsupported(
                f"a tensor of shape {list(value.shape)} is neither a parameter, buffer, input nor a "
                "result of a recorded op (a constant made outside the forward?)"
            )
        return hit[0]
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, list):
        return [_resolve(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, where) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, where) for k, v in value.items()}
    return value


def _sdpa_result(args: tuple, kwargs: dict) -> Any:
    """The result torch.export's fake CPU tensors give ``aten.scaled_dot_product_attention``: CPU picks
    its flash kernel (whose meta kernel returns ``empty_like(query)``, query's strides) or the math path (a
    contiguous result), while on the meta device the math path always runs. The layout matters: a later
    ``.contiguous()`` is an op only where the tensor is not contiguous already."""
    import torch

    q, k, v, mask = args[:4]

    def cpu(t: Any) -> Any:
        if t is None:
            return None
        x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        return x.requires_grad_() if t.requires_grad else x

    choice = torch._fused_sdp_choice(cpu(q), cpu(k), cpu(v), cpu(mask), *args[4:], **kwargs)
    if choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return torch.empty_like(q)
    return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)


def _contiguous(shape: Sequence[int], like: Any) -> Any:
    import torch

    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)


def _linear_result(args: tuple, kwargs: dict) -> Any:
    """``linear(x, w, b)``: a fresh contiguous ``[*x.shape[:-1], w.shape[0]]`` (addmm/matmul + view)."""
    x, w = args[:2]
    return _contiguous((*x.shape[:-1], w.shape[0]), x)


def _layer_norm_result(args: tuple, kwargs: dict) -> Any:
    """``layer_norm``: a fresh contiguous tensor of the input's shape (the CPU kernel's ``empty_like``
    with contiguous memory)."""
    return _contiguous(args[0].shape, args[0])


def _like_input(args: tuple, kwargs: dict) -> Any:
    """Elementwise on one tensor (dropout): the input's shape, dtype and layout (``empty_like``)."""
    import torch

    return torch.empty_like(args[0])


#: ops whose result is made here instead of running the op on meta tensors: where the meta device's
#: layout differs from torch.export's fake CPU tensors (SDPA), and the hot ops whose meta kernels are slow
#: Python references (layer_norm ~18 ms, linear and dropout ~4 ms each). Each gives the shape, dtype and
#: strides the fake CPU tensor has; tests/tracing/test_fasttrace.py compares the whole Graph with torch.export's.
_RESULTS: dict[str, Callable[[tuple, dict], Any]] = {
    "aten.scaled_dot_product_attention.default": _sdpa_result,
    "aten.linear.default": _linear_result,
    "aten.layer_norm.default": _layer_norm_result,
    "aten.dropout.default": _like_input,
}


def _meta_to_cpu(value: Any) -> Any:
    import torch

    if (isinstance(value, torch.device) and value.type == "meta") or (
        isinstance(value, str) and value == "meta"
    ):
        return torch.device("cpu")
    return value


def record(
    model: Any, example: Sequence[Any], *, loss: Callable[..., Any] | None = None, n_inputs: int | None = None,
    name: str = "model", names: Sequence[str] | None = None,
) -> Graph:  # fmt: skip
    """The Graph of ``loss(model(*example[:n_inputs]), *example[n_inputs:])`` for a model whose parameters,
    buffers and example inputs live on the meta device (built under :func:`meta_build`).

    Raises :class:`Unsupported` where the recording could differ from torch.export's.
    """
    import operator
    import weakref

    import torch
    from torch._dispatch.python import enable_python_dispatcher
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    n_in = len(example) if n_inputs is None else n_inputs
    wrapper = _make_wrapper(model, loss, n_in)
    names = list(names) if names is not None else _input_names(model, n_in, len(example) - n_in)
    fx_graph = torch.fx.Graph()
    namespace = fx_graph._graph_namespace
    getitem_name = fx_graph._target_to_str(operator.getitem)
    stack: list[str] = []
    events: list[_Event] = []
    # id(tensor) -> (its ref, a weak reference). No strong references to results while an op returns:
    # autograd wraps a constructor's result without copying only when nothing else holds it.
    where: dict[int, tuple[_Ref, Any]] = {}
    holders = [(fqn, p, "param") for fqn, p in wrapper.named_parameters()]
    holders += [(fqn, b, "buffer") for fqn, b in wrapper.named_buffers()]
    for path, mod in wrapper.named_modules():
        if mod._non_persistent_buffers_set:  # export folds what depends on them alone (..constants)
            first = sorted(mod._non_persistent_buffers_set)[0]
            raise Unsupported(f"{path + '.' if path else ''}{first} is a non-persistent buffer")
    for k, x in enumerate(example):
        if not isinstance(x, torch.Tensor):
            raise Unsupported(f"example input {k} is a {type(x).__name__}, not a tensor")
        holders.append((names[k] if k < len(names) else f"input{k}", x, "input"))
    for k, (_, x, _) in enumerate(holders):
        if id(x) in where:
            raise Unsupported(f"{holders[k][0]} is the same tensor as {holders[where[id(x)][0].item][0]}")
        where[id(x)] = (_Ref(-1, k), weakref.ref(x))

    def on_op(func: Any, args: tuple, kwargs: dict) -> Any:
        if func._schema.is_mutable:
            raise Unsupported(f"in-place op {func} in the forward")
        rargs, rkwargs = _resolve(args, where), _resolve(kwargs, where)
        if "device" in kwargs and not any(isinstance(x, _Ref) for x in _leaves((rargs, rkwargs))):
            # a constructor: its meta version may go through Python references (torch._dynamo)
            out = func(*args, **{k: _meta_to_cpu(v) for k, v in kwargs.items()})
            out = out.to("meta") if isinstance(out, torch.Tensor) else out
        elif str(func) in _RESULTS:
            out = _RESULTS[str(func)](*normalize_args(func, args, kwargs))
        else:
            out = func(*args, **kwargs)
        op_name = namespace.create_name(fx_graph._target_to_str(func.overloadpacket.__name__), None)
        if out is None:
            return out  # assertions (aten._assert_tensor_metadata): no result, no tensor
        if isinstance(out, torch.Tensor):
            outs, items = [out], []
        elif isinstance(out, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in out):
            outs = list(out)
            items = [namespace.create_name(getitem_name, None) for _ in outs]
        else:
            raise Unsupported(f"{func} returns {type(out).__name__}, not tensors")
        k = len(events)
        for j, x in enumerate(outs):
            where[id(x)] = (_Ref(k, j), weakref.ref(x))
        vals = [_Val(tuple(x.shape), x.dtype) for x in outs]
        events.append(_Event(op_name, func, rargs, rkwargs, vals, items, stack[-1] if stack else ""))
        return out

    handles = []
    for path, mod in wrapper.named_modules():
        p = module_path(path)

        def pre(m: Any, a: Any, p: str = p) -> None:
            stack.append(p)

        def post(m: Any, a: Any, o: Any) -> None:
            stack.pop()

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    wrapper.train()
    mode = _recorder(on_op)
    try:
        with enable_python_dispatcher(), _as_export():
            _push_mode(mode)
            try:
                result = wrapper(*example)
            finally:
                _pop_mode(torch._C.DispatchKey.PreDispatch)
    finally:
        for h in handles:
            h.remove()
    if not isinstance(result, torch.Tensor):
        raise Unsupported(f"{name}: the forward returns a {type(result).__name__}, not a tensor")
    loss_ref = _resolve(result, where)

    b = _RefBuilder()
    params: list[int] = []
    in_ids: list[int] = []
    for k, (label, x, role) in enumerate(holders):
        if role == "input":
            tid = b.add_tensor(label, x, role)
            in_ids.append(tid)
        else:
            rg = role == "param" and x.requires_grad
            tid = b.add_tensor(module_path(label), x, role, requires_grad=rg)
            params.append(tid)
        b.ids[_Ref(-1, k)] = tid
    for k, ev in enumerate(events):  # training IR keeps every op and every getitem (no dead-code pass)
        args, kwargs = normalize_args(ev.func, ev.args, ev.kwargs)
        if ev.items:
            outs = [(nm, _Ref(k, j), v) for j, (nm, v) in enumerate(zip(ev.items, ev.outs))]
        else:
            outs = [(ev.name, _Ref(k, 0), ev.outs[0])]
        b.add_op(
            ev.name, str(ev.func), args, kwargs, outs, ev.module, tuple(range(len(outs))) if ev.items else ()
        )
        for _, ref, _ in outs:
            b.ids[ref] = b.node_tensor[ref]
    loss_id = _loss_of(b, [b.ids[loss_ref]], name)
    return b.finish(in_ids, params, loss_id, None, name)


@contextlib.contextmanager
def _as_export() -> Iterator[None]:
    """The global state torch.export traces under: backend-specific decompositions off (mkldnn, nnpack,
    cudnn: ``F.layer_norm`` passes ``cudnn_enable=False`` then) and the compiling/exporting flags set
    (code that asks ``torch.compiler.is_exporting()`` takes its export path)."""
    import torch

    backends = (torch.backends.mkldnn, torch.backends.nnpack, torch.backends.cudnn)
    saved = [be.set_flags(False) for be in backends]
    comp = torch.compiler
    flags = ("_is_compiling_flag", "_is_exporting_flag")
    old = {f: getattr(comp, f) for f in flags if hasattr(comp, f)}
    try:
        for f in old:
            setattr(comp, f, True)
        yield
    finally:
        for f, v in old.items():
            setattr(comp, f, v)
        for be, flag in zip(backends, saved):
            be.set_flags(*flag)


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def trace_zoo_meta(zoo_name: str, timings: dict[str, Any] | None = None, **options: Any) -> tuple[Graph, Any]:
    """The Graph of zoo model ``zoo_name`` built under :func:`meta_build` and recorded (:func:`record`),
    and its :class:`~hapnb.zoo.ModelSpec`; ``options`` as for :func:`hapnb.zoo.build`. The Graph has no
    program. ``timings`` (when given) receives ``build_s`` and ``trace_s``. Raises :class:`Unsupported`
    (fall back to :func:`hapnb.trace`) where the recording could differ from torch.export's."""
    import gc
    import time

    from .. import zoo

    was = gc.isenabled()
    gc.disable()  # after importing torch the heap is large: each full collection would rescan it
    try:
        with without_dynamo():
            t0 = time.perf_counter()
            with meta_build():
                model, inputs, spec = zoo.build(zoo_name, **options)
            model, inputs = to_meta(model, inputs)
            t1 = time.perf_counter()
            g = record(model, inputs, name=zoo_name.split(":")[-1])
            if timings is not None:
                timings.update(build_s=t1 - t0, trace_s=time.perf_counter() - t1)
            return g, spec
    finally:
        if was:
            gc.enable()
