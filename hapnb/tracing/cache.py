"""The trace cache: zoo-model Graphs stored as JSON in a user cache folder, keyed by what makes the graph.

A key hashes the model spec (zoo name and options), the torch version and the source of every hapnb
module the graph depends on (the graph IR, the zoo, the tracers and the rule tables, which give flops
and op families), so a change to any of them is a miss, never a stale graph. Entries are plain JSON
(our own format, never pickle): tensors, ops with their arguments (tuples, numbers, strings, tensor
placeholders and the few torch values ops take: dtypes, devices, layouts, memory formats), and the
graph fingerprint, which is recomputed on load — an entry that does not reproduce it is ignored. A
graph read from the cache carries no traced program: the caller attaches a
:class:`~hapnb.ir.graph.DeferredProgram`.

Where: ``$HAPNB_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/hapnb``, else ``~/.cache/hapnb``; entries in
``traces/``. ``HAPNB_TRACE_CACHE=0`` turns the cache off. Writes are atomic (a temporary file renamed);
a cache that cannot be written is skipped silently.

>>> from hapnb.ir.graph import TensorArg
>>> decode_value(encode_value((TensorArg(0), (2, 3), 1.5, None, "x")))
(%0, (2, 3), 1.5, None, 'x')
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from ..ir.graph import Graph, Op, TensorArg, TensorRef, fingerprint
from ..rules.cachedir import cache_root

__all__ = ["cache_dir", "cache_key", "load", "save", "graph_to_json", "graph_from_json", "encode_value",
           "decode_value", "FORMAT"]  # fmt: skip

#: version of the entry format (part of every key)
FORMAT = 2

#: hapnb sources a graph depends on (relative to the package): their contents are part of every key
_SOURCES = ("ir", "zoo", "tracing", "rules")


def enabled() -> bool:
    """Whether the cache is on (``HAPNB_TRACE_CACHE`` is not ``0``/``off``/``false``)."""
    return os.environ.get("HAPNB_TRACE_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    """The folder holding cached traces (not created here): ``traces/`` of :func:`hapnb.rules.cachedir.cache_root`."""
    return cache_root() / "traces"


@functools.cache
def _source_hash() -> str:
    """The hash of the :data:`_SOURCES` files (read once a process)."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in _SOURCES:
        p = pkg / rel
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(pkg)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _torch_version() -> str:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    from importlib.metadata import version

    return version("torch")


def cache_key(spec: dict[str, Any]) -> str:
    """The key of the graph of model ``spec`` (a :class:`~hapnb.zoo.ModelSpec` as JSON)."""
    what = {"format": FORMAT, "spec": spec, "torch": _torch_version(), "hapnb": _source_hash()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------------ values


def encode_value(v: Any) -> Any:
    """An op argument as JSON: tuples as lists, tensor placeholders and torch values as tagged objects.
    Raises TypeError for anything else (such a graph is not cached)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, TensorArg):
        return {"arg": v.index}
    if isinstance(v, tuple):
        return [encode_value(x) for x in v]
    kind = type(v).__module__ + "." + type(v).__qualname__
    if kind == "torch.dtype":
        return {"dtype": str(v).removeprefix("torch.")}
    if kind == "torch.device":
        return {"device": str(v)}
    if kind == "torch.layout":
        return {"layout": str(v).removeprefix("torch.")}
    if kind == "torch.memory_format":
        return {"memory_format": str(v).removeprefix("torch.")}
    raise TypeError(f"cannot store {kind} {v!r} in the trace cache")


def decode_value(v: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if isinstance(v, list):
        return tuple(decode_value(x) for x in v)
    if not isinstance(v, dict):
        return v
    ((tag, x),) = v.items()
    if tag == "arg":
        return TensorArg(int(x))
    if tag == "float":
        return float(x)
    import torch

    if tag == "device":
        return torch.device(x)
    if tag in ("dtype", "layout", "memory_format"):
        val = getattr(torch, x, None)
        if type(val).__module__ + "." + type(val).__qualname__ != f"torch.{tag}":
            raise ValueError(f"torch has no {tag} {x!r}")
        return val
    raise ValueError(f"unknown tagged value {v!r}")


# ------------------------------------------------------------------------------------------ graphs

_TENSOR_FIELDS = ("name", "shape", "dtype", "role", "producer", "consumers", "requires_grad")
_OP_FIELDS = (
    "name",
    "target",
    "inputs",
    "outputs",
    "module",
    "flops",
    "family",
    "segment",
    "output_items",
    "origin",
)


def graph_to_json(g: Graph) -> dict[str, Any]:
    """The graph as JSON (everything but its traced program). Raises TypeError for an op argument that
    has no JSON form."""
    tensors = [[getattr(t, f) for f in _TENSOR_FIELDS] for t in g.tensors]
    ops = [
        [getattr(op, f) for f in _OP_FIELDS] + [encode_value(op.args), encode_value(op.kwargs)]
        for op in g.ops
    ]
    return {
        "format": FORMAT, "name": g.name, "fingerprint": g.fingerprint, "inputs": list(g.inputs),
        "params": list(g.params), "loss": g.loss, "tensors": tensors, "ops": ops,
    }  # fmt: skip


def graph_from_json(d: dict[str, Any]) -> Graph:
    """Inverse of :func:`graph_to_json` (no program). Raises ValueError when the entry is malformed or
    does not reproduce its fingerprint."""
    try:
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}")
        tensors = []
        for k, row in enumerate(d["tensors"]):
            f = dict(zip(_TENSOR_FIELDS, row))
            f["shape"], f["consumers"] = tuple(f["shape"]), tuple(f["consumers"])
            tensors.append(TensorRef(id=k, **f))
        ops = []
        for k, row in enumerate(d["ops"]):
            f = dict(zip(_OP_FIELDS, row[: len(_OP_FIELDS)]))
            for key in ("inputs", "outputs", "output_items"):
                f[key] = tuple(f[key])
            f["flops"] = float(f["flops"])
            args, kwargs = decode_value(row[len(_OP_FIELDS)]), decode_value(row[len(_OP_FIELDS) + 1])
            ops.append(Op(id=k, args=args, kwargs=kwargs, **f))
        g = Graph(
            tensors=tuple(tensors), ops=tuple(ops), inputs=tuple(d["inputs"]), params=tuple(d["params"]),
            loss=int(d["loss"]), fingerprint=str(d["fingerprint"]), name=str(d["name"]),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed trace cache entry: {e}") from None
    if fingerprint(g.tensors, g.ops) != g.fingerprint:
        raise ValueError("the entry does not reproduce its graph fingerprint")
    return g


def load(spec: dict[str, Any]) -> Graph | None:
    """The cached graph of ``spec``, or None (cache off, no entry, or an entry that does not load)."""
    if not enabled():
        return None
    path = cache_dir() / f"{cache_key(spec)}.json"
    try:
        return graph_from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def save(spec: dict[str, Any], g: Graph) -> bool:
    """Store ``g`` as the graph of ``spec``; False when the cache is off or cannot take it."""
    if not enabled():
        return False
    try:
        text = json.dumps(graph_to_json(g), separators=(",", ":"))
    except (TypeError, ValueError):
        return False
    d, key = cache_dir(), cache_key(spec)
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        return False
    return True
