""":func:`trace`: turn ``loss(model(*inputs), *targets)`` into a Graph. The primary path is torch.export
(non-strict first, then strict) in train mode, which yields aten-level ops with shapes in
``node.meta["val"]`` (:mod:`.exported`); the fallback is torch.fx.symbolic_trace + ShapeProp
(:mod:`.fx_fallback`). When every path fails, the error names the innermost module that was running and
a hint for the reason. The model and its loss are traced as one module (:func:`_make_wrapper`) whose
inputs are named after the model's forward (:func:`_input_names`); the meta recorder (:mod:`.record`)
traces the same wrapper.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Callable, Sequence
from typing import Any

from ..ir.graph import Graph, TraceError
from .builder import module_path
from .exported import _from_lowered
from .fx_fallback import _from_fx

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


def _user_line(exc: BaseException) -> str:
    """Where in the model's code torch.export stopped: ``file.py:LINE: `code` `` from the error's "The following
    call raised this error" block or its "Caused by:" line (a guard on a size that depends on the data, e.g.
    ``if idx.size(0) > 0`` after ``nonzero``); empty when the error has neither."""
    lines = str(exc).splitlines()
    for k, ln in enumerate(lines):
        if "following call raised this error" not in ln:
            continue
        for at, nxt in enumerate(lines[k + 1 : k + 4], start=k + 1):
            m = re.match(r'\s*File "([^"]+)", line (\d+)', nxt)
            if m is not None:
                code = lines[at + 1].strip() if at + 1 < len(lines) else ""
                where = f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
                return f"{where}: `{code}`" if code else where
    for ln in lines:  # torch's other form: "Caused by: (models/bert/modeling_bert.py:1062 in forward)"
        m = re.search(r"Caused by: \((\S+?):(\d+) in \w+\)", ln)
        if m is not None:
            where = f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
            code = _frame_line(exc, m.group(1), int(m.group(2)))
            return f"{where}: `{code}`" if code else where
    return ""


def _frame_line(exc: BaseException, path: str, line: int) -> str:
    """The source of ``path:line`` when a frame of ``exc``'s traceback ran it (torch shortens the path it
    reports, so a frame's file is matched by its ending); empty when none did."""
    tb = exc.__traceback__
    while tb is not None:
        fname = tb.tb_frame.f_code.co_filename
        if tb.tb_lineno == line and fname.endswith(path):
            return linecache.getline(fname, line).strip()
        tb = tb.tb_next
    return ""


def _layerdrop(model: Any) -> str:
    """The first module of ``model`` in training mode whose config (or itself) asks for LayerDrop, as
    ``name (layerdrop=p)``; empty when none does. LayerDrop skips whole layers at random in every step: a
    branch on a random number, which no static program can take."""
    if not hasattr(model, "named_modules"):
        return ""
    for name, mod in model.named_modules():
        cfg = getattr(mod, "config", None)
        p = getattr(cfg, "layerdrop", None) if cfg is not None else getattr(mod, "layerdrop", None)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0 and mod.training:
            return f"module {name or '<top-level model>'!r} (config.layerdrop={p})"
    return ""


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


def unwrap_compiled(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, else ``model``: it computes the
    same, and its parameter names are the model's own (the wrapper prefixes them with ``_orig_mod.``)."""
    import torch

    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    kind = getattr(compiled, "OptimizedModule", None)
    return model._orig_mod if kind is not None and isinstance(model, kind) else model


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
    ``model`` may also be a ``torch.export.ExportedProgram`` that returns the scalar loss, or a
    ``torch.compile``'d module (its original module is traced: :func:`unwrap_compiled`).
    """
    import torch

    from .lower import cumulative_batch_norm
    from .patches import static_mask_hints

    if isinstance(model, torch.export.ExportedProgram):  # already exported: use it as is
        specs = model.graph_signature.user_inputs
        return _from_lowered(model, list(specs), name or "model")
    model = unwrap_compiled(model)
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
    where, at, layerdrop = "<top-level model>", "", _layerdrop(model)
    try:
        tracker = _ModuleTracker(wrapper)
        try:
            with cumulative_batch_norm(wrapper), static_mask_hints():
                ep = torch.export.export(wrapper, example, strict=False)
            return _from_lowered(ep, names, gname)
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported below
            where, at = tracker.innermost(), _user_line(exc)
            errors.append(f"torch.export (non-strict): {_first_line(exc)}")
        finally:
            tracker.remove()
        try:
            with cumulative_batch_norm(wrapper), static_mask_hints():
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
    hint = _hint(reason)
    if layerdrop and hint is _HINTS[0][1]:
        hint = (
            f"{layerdrop} skips layers at random while training (LayerDrop), a branch on a random number that "
            "no static program can take: set its `config.layerdrop = 0.0` before tracing"
        )
    raise TraceError(
        f"cannot trace {gname}: module {where!r} failed — {reason}\n"
        + (f"  at: {at}\n" if at else "")
        + f"  hint: {hint}\n  all attempts:\n    "
        + "\n    ".join(errors)
    )
