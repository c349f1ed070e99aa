"""User model factories: ``package.module:factory`` (or ``path/to/file.py:factory``) imported and called
with options, giving ``(model, example_inputs)``; clear errors when the path, the call or the result is
wrong."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["FactoryError", "import_factory", "call_factory", "load_factory"]


class FactoryError(ValueError):
    """A ``package.module:factory`` path could not be loaded, or its factory returned the wrong thing."""


# ---------------------------------------------------------------------------------------------------
# factories


def import_factory(path: str) -> Callable[..., Any]:
    mod_name, sep, attr = path.rpartition(":")
    if not sep or not mod_name or not attr:
        raise FactoryError(
            f"factory path {path!r} is malformed: expected 'package.module:factory' (or 'file.py:factory')"
        )
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise FileNotFoundError(f"no such file: {mod_name}")
            mod_id = "_hapnb_factory_" + os.path.splitext(os.path.basename(mod_name))[0]
            ispec = importlib.util.spec_from_file_location(mod_id, mod_name)
            assert ispec is not None and ispec.loader is not None
            module = importlib.util.module_from_spec(ispec)
            ispec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(mod_name)
            except ModuleNotFoundError as e:
                # console scripts do not put the working directory on sys.path; python -m does
                cwd = os.getcwd()
                top = mod_name.split(".")[0]
                if e.name not in (top, mod_name) or cwd in sys.path or "" in sys.path:
                    raise
                sys.path.insert(0, cwd)
                try:
                    module = importlib.import_module(mod_name)
                finally:
                    sys.path.remove(cwd)
    except Exception as e:
        raise FactoryError(
            f"cannot import module {mod_name!r} of factory {path!r}: {type(e).__name__}: {e}. "
            "Check that it is importable (on PYTHONPATH or run from its folder)."
        ) from e
    for part in attr.split("."):
        if not hasattr(module, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise FactoryError(
                f"module {mod_name!r} has no attribute {attr!r} (factory {path!r}); "
                f"callables there: {', '.join(names) or 'none'}"
            )
        module = getattr(module, part)
    if not callable(module):
        raise FactoryError(f"factory {path!r} is not callable (it is a {type(module).__name__})")
    return module


def call_factory(
    path: str, factory: Callable[..., Any], options: dict[str, Any]
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**options)
        except TypeError as e:
            raise FactoryError(f"factory {path!r}{sig} cannot take options {options}: {e}") from e
    result = factory(**options)
    if (
        not isinstance(result, (tuple, list))
        or len(result) != 2
        or not isinstance(result[0], nn.Module)
        or not isinstance(result[1], (tuple, list))
        or not all(isinstance(t, torch.Tensor) for t in result[1])
    ):
        got = type(result).__name__
        if isinstance(result, (tuple, list)):
            got += "(" + ", ".join(type(r).__name__ for r in result) + ")"
        raise FactoryError(
            f"factory {path!r} must return (nn.Module, tuple of tensors) with model(*inputs) the "
            f"scalar loss; it returned {got}"
        )
    return result[0], tuple(result[1])


def load_factory(path: str, **options: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Import ``"package.module:factory"`` (or ``"path/file.py:factory"``) and return ``factory(**options)``.

    The result must be ``(model, example_inputs)``; anything else raises :class:`FactoryError` (a
    ValueError) naming the path.

    >>> model, inputs = load_factory("examples.factories:small_convnet", batch=2)
    >>> model(*inputs).shape
    torch.Size([])
    """
    return call_factory(path, import_factory(path), options)
