"""Rule discovery: strategies for ops without a hand rule, found by ground truth.

An op that still has no hand rule after tracing lowered it (:mod:`hapnb.tracing.lower`) — a rare aten op
or a custom op registered with ``torch.library`` — would run replicated and force every tensor it
touches to ``I``. Discovery instead *tries* candidate strategies on the op itself and keeps those the
op's own results confirm.

Candidates (:func:`candidates`), from the shapes and dtypes of the op's tensors, in this order:

* partial sums: one float input ``R``, the other inputs ``I``, every output ``R`` (all outputs float);
* for every index length ``L`` (each distinct dim size >= 2 among the op's tensors, ascending): each
  input ``G(e)`` for a dim ``e`` of size ``L`` or ``I``, each output ``G(e)`` with size ``L`` or ``R``
  (floats only); all-``I`` inputs are skipped. Inputs try their ``G`` dims before ``I``, so the
  most-sharded candidates come first.

At most :data:`MAX_CANDIDATES` (256) are tried per op; the rest are dropped (recorded as
``Discovery.truncated``) — the order above is deterministic, so the same candidates are always kept.

Acceptance (:func:`accepts`): random full inputs (floats in float64; integer inputs uniform in ``[0, m)``
with ``m`` the smallest dim size among the op's other tensors (5 when they have none), so index-like
inputs index validly; bool inputs random) are split per the candidate's input forms over
:data:`N_RANKS` (3) simulated ranks, ``G`` dims UNEVENLY with an empty shard, in two different splits
(:func:`splits`: ``(a, 0, L-a)`` with ``a = min(2, L-1)`` and ``(0, L-1, 1)``). Each rank runs the op on
its local tensors; the results must reassemble (``G``: concatenated in rank order, ``R``: summed over
ranks) to the op run on the whole input, within 1e-9 relative (float64). The op must be deterministic
(two runs on the same inputs equal; random ops are rejected) and must not write its inputs; an
exception on any rank rejects a candidate. An op that does not take float64 is checked in its own
dtypes (tolerance 1e-5).

Big ops: when the op's tensors hold more than :data:`BIG_NUMEL` elements, the check runs on a shrunk
instance: every dim size above 8 that does not appear among the op's non-tensor int arguments (which may
be shapes) maps to a small size (>= 3, so an uneven split with an empty shard exists), equal sizes to
equal sizes, distinct to distinct. The op's outputs must come out with the correspondingly shrunk
shapes. When it cannot shrink (sizes pinned by arguments, or still too big), nothing is discovered and
``Discovery.reason`` says why.

Results are cached per op signature (target, tensor shapes and dtypes, non-tensor arguments, the torch
version and :data:`FORMAT`) in memory and on disk as JSON in ``discover/`` of the hapnb cache folder
(:func:`hapnb.rules.cachedir.cache_root`). A file that does not parse as a matching entry is ignored and
rewritten; entries are data (form names), never code. A custom op whose implementation changes under
the same name and shapes keeps its cached answer: :func:`clear_cache` (or removing the folder) forgets.

``HAPNB_DISCOVER=0`` turns discovery off (ops without a hand rule run replicated, as before);
``HAPNB_DISCOVER_CACHE=0`` keeps the answers in memory only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..ir.forms import Form, G, I, R, parse_form
from ..ir.graph import Graph, Op, TensorArg, map_args
from .cachedir import cache_root
from .registry import _RULES, LocalCall, _aten, _Cand, _set_fallback, _short
from .truth import close, outputs_of, reassembles, split_input

__all__ = [
    "Discovery",
    "discover",
    "candidates",
    "accepts",
    "splits",
    "enabled",
    "clear_cache",
    "cached",
    "MAX_CANDIDATES",
    "N_RANKS",
    "BIG_NUMEL",
    "FORMAT",
]

#: version of the cache entries and of the acceptance procedure (part of every key)
FORMAT = 1
#: the most candidates tried per op (the first ones in :func:`candidates`' deterministic order)
MAX_CANDIDATES = 256
#: simulated ranks of the acceptance check
N_RANKS = 3
#: an op whose tensors hold more elements than this is checked on a shrunk instance
BIG_NUMEL = 1_000_000
#: dim sizes up to this are never shrunk
_KEEP_UP_TO = 8
#: exclusive upper bound of random integer inputs when the op has no other tensor with a dim
_INT_BOUND_DEFAULT = 5

Forms = tuple[tuple[Form, ...], tuple[Form, ...]]


@dataclass(frozen=True)
class Discovery:
    """What discovery found for one op signature.

    ``accepted``: the (input forms, output forms) the ground truth confirmed; ``tried``: candidates
    checked; ``truncated``: candidates dropped by the cap; ``reason``: why nothing could be checked
    (empty when the check ran); ``splits``: the per-rank ``G`` lengths used, per index length (instance
    sizes); ``shrunk``: original size -> instance size for a big op; ``spec``: the op re-buildable as
    JSON (target, input shapes/dtypes, arguments) or None; ``rejected``: a few rejected candidates with
    why.
    """

    target: str
    accepted: tuple[Forms, ...] = ()
    tried: int = 0
    truncated: int = 0
    reason: str = ""
    splits: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    shrunk: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    spec: dict[str, Any] | None = None
    rejected: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        if self.reason:
            return f"{self.target}: not discovered ({self.reason})"
        acc = "; ".join(_forms_text(f) for f in self.accepted) or "none"
        return f"{self.target}: {len(self.accepted)}/{self.tried} candidates accepted ({acc})"


def _forms_text(f: Forms) -> str:
    return f"({','.join(map(str, f[0]))}) -> ({','.join(map(str, f[1]))})"


def enabled() -> bool:
    """Whether discovery is on (``HAPNB_DISCOVER`` is not ``0``/``off``/``false``/``no``)."""
    return os.environ.get("HAPNB_DISCOVER", "1").strip().lower() not in ("0", "off", "false", "no")


def _disk_enabled() -> bool:
    return os.environ.get("HAPNB_DISCOVER_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


# ==================================================================================== candidates


def candidates(
    ins: Sequence[tuple[tuple[int, ...], bool]],
    outs: Sequence[tuple[tuple[int, ...], bool]],
    cap: int = MAX_CANDIDATES,
) -> tuple[list[Forms], int]:
    """The candidate strategies of an op with input and output tensors ``(shape, is_float)``, in the
    module's deterministic order, at most ``cap`` of them; returns them and how many were dropped.

    >>> cs, dropped = candidates([((4, 3), True)], [((4, 3), True)])
    >>> [_forms_text(c) for c in cs], dropped
    (['(R) -> (R)', '(G1) -> (G1)', '(G1) -> (R)', '(G0) -> (G0)', '(G0) -> (R)'], 0)
    """
    out: list[Forms] = []
    dropped = 0

    def add(c: Forms) -> None:
        nonlocal dropped
        if len(out) < cap:
            out.append(c)
        else:
            dropped += 1

    if outs and all(fl for _, fl in outs):
        for k, (_, fl) in enumerate(ins):
            if fl:
                add((tuple(R if j == k else I for j in range(len(ins))), (R,) * len(outs)))
    sizes = sorted({d for shape, _ in (*ins, *outs) for d in shape if d >= 2})
    for L in sizes:
        in_opts = [[G(e) for e, d in enumerate(shape) if d == L] + [I] for shape, _ in ins]
        out_opts = [[G(e) for e, d in enumerate(shape) if d == L] + ([R] if fl else []) for shape, fl in outs]
        if any(not o for o in out_opts):
            continue  # an output with no dim of length L that cannot be a partial sum
        for fi in itertools.product(*in_opts):
            if all(f.is_identity for f in fi):
                continue
            for fo in itertools.product(*out_opts):
                add((tuple(fi), tuple(fo)))
            if dropped > 100_000:  # the count of dropped ones is only informative past the cap
                return out, dropped
    return out, dropped


def splits(length: int) -> tuple[tuple[int, ...], ...]:
    """The two uneven per-rank splits of an index of ``length`` (>= 2) over :data:`N_RANKS` ranks, each
    with an empty shard.

    >>> splits(2), splits(5)
    (((1, 0, 1), (0, 1, 1)), ((2, 0, 3), (0, 4, 1)))
    """
    a = min(2, length - 1)
    return ((a, 0, length - a), (0, length - 1, 1))


# ===================================================================================== acceptance


def accepts(
    fn: Callable[..., Any],
    op: Op,
    full: Sequence[Any],
    cand: Forms,
    split_list: Sequence[tuple[int, ...]],
    tol: float = 1e-9,
    seed: int = 0,
) -> tuple[bool, str]:
    """Whether the op (``fn`` with ``op``'s non-tensor arguments) run on ``full`` (one tensor per entry of
    ``op.inputs``) split per ``cand``'s input forms reassembles to the full result per its output forms,
    for every per-rank split in ``split_list`` (the ``G`` lengths); the reason when not."""
    import torch

    ins, outs = cand
    call = LocalCall(fn, op.args, op.kwargs)
    try:
        want = outputs_of(call.run(list(full)), op)
    except Exception as exc:  # noqa: BLE001
        return False, f"the full op raised {_short(exc)}"
    for k, split in enumerate(split_list):  # without a G form: two draws of the R partials
        gen = torch.Generator().manual_seed(seed * 7919 + k)
        n = len(split)
        local = [split_input(x, f, t, _const(split), n, gen) for x, f, t in zip(full, ins, op.inputs)]
        got = []
        for r in range(n):
            try:
                got.append(outputs_of(call.run([v[r] for v in local]), op))
            except Exception as exc:  # noqa: BLE001 - a rank that raises rejects the candidate
                return False, f"split {list(split)} rank {r} raised {_short(exc)}"
        for j, (w, f) in enumerate(zip(want, outs)):
            ok, why = reassembles([got[r][j] for r in range(n)], w, f, split if f.is_gather else (), tol)
            if not ok:
                return False, f"split {list(split)} output {j} ({f}): {why}"
    return True, ""


def _const(split: tuple[int, ...]) -> Callable[[int, int], tuple[int, ...]]:
    return lambda _t, _d: split


# =================================================================================== the instance


def _int_args(op: Op) -> set[int]:
    found: set[int] = set()

    def leaf(v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            found.add(abs(v))
        return v

    map_args((op.args, op.kw), leaf)
    return found


def _shrink(graph: Graph, op: Op) -> tuple[dict[int, int], str]:
    """The size map of the instance discovery checks (identity: empty) and why it cannot (or "")."""
    tids = list(dict.fromkeys(op.inputs + op.outputs))
    total = sum(graph.tensors[t].numel for t in tids)
    if total <= BIG_NUMEL:
        return {}, ""
    pinned = _int_args(op)
    sizes = {d for t in tids for d in graph.tensors[t].shape}
    big = sorted(d for d in sizes if d > _KEEP_UP_TO and d not in pinned)
    taken = (sizes - set(big)) | pinned
    mapping: dict[int, int] = {}
    nxt = 3
    for d in big:
        while nxt in taken:
            nxt += 1
        mapping[d] = nxt
        taken.add(nxt)
    small = sum(math.prod(mapping.get(d, d) for d in graph.tensors[t].shape) for t in tids)
    if small > BIG_NUMEL:
        held = sorted(d for d in sizes if d > _KEEP_UP_TO and d in pinned)
        return mapping, (
            f"{total} elements, still {small} after shrinking"
            + (f" (sizes {held} appear among its arguments, so they cannot shrink)" if held else "")
        )
    return mapping, ""


def _torch_dtype(name: str, high: bool) -> Any:
    import torch

    dt = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    if high and dt.is_floating_point:
        return torch.float64
    if high and dt.is_complex:
        return torch.complex128
    return dt


def _random_inputs(
    shapes: dict[int, tuple[int, ...]], dtypes: dict[int, str], inputs: Sequence[int], high: bool, seed: int
) -> list[Any]:
    """One random tensor per entry of ``inputs`` (tensor ids; a repeated id gets the same tensor)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    made: dict[int, Any] = {}
    for t in inputs:
        if t in made:
            continue
        shape, dt = shapes[t], _torch_dtype(dtypes[t], high)
        if dt.is_floating_point or dt.is_complex:
            made[t] = torch.randn(shape, dtype=dt, generator=gen)
        elif dt == torch.bool:
            made[t] = torch.rand(shape, generator=gen) > 0.5
        else:
            others = [d for u, s in shapes.items() if u != t for d in s]
            bound = max(1, min(others)) if others else _INT_BOUND_DEFAULT
            made[t] = torch.randint(0, bound, shape, generator=gen, dtype=dt)
    return [made[t] for t in inputs]


def _mutates(fn: Any) -> bool:
    schema = getattr(fn, "_schema", None)
    for a in getattr(schema, "arguments", ()) or ():
        info = getattr(a, "alias_info", None)
        if info is not None and getattr(info, "is_write", False):
            return True
    return False


# ======================================================================================= discover


def discover(graph: Graph, op: Op) -> Discovery:
    """The strategies ground truth accepts for ``op`` (cached per signature in memory and on disk)."""
    key = _key(graph, op)
    found = _MEMORY.get(key)
    if found is not None:
        return found
    found = _load(key, op)
    if found is None:
        found = _discover(graph, op)
        _save(key, found)
    _MEMORY[key] = found
    if found.accepted:
        _KNOWN.add(op.target)
    return found


def _discover(graph: Graph, op: Op) -> Discovery:
    t0 = time.perf_counter()
    spec = _spec(graph, op)
    try:
        fn = _aten(op.target)
    except KeyError as exc:
        return Discovery(op.target, reason=f"no op overload to run ({exc.args[0]})", spec=spec)
    if _mutates(fn):
        return Discovery(op.target, reason="it writes its inputs", spec=spec)
    mapping, why = _shrink(graph, op)
    if why:
        return Discovery(op.target, reason=f"too big to check: {why}", shrunk=mapping, spec=spec)
    ts = graph.tensors
    shapes = {t: tuple(mapping.get(d, d) for d in ts[t].shape) for t in dict.fromkeys(op.inputs + op.outputs)}
    dtypes = {t: ts[t].dtype for t in shapes}
    checked = _full_run(fn, op, shapes, dtypes)
    if isinstance(checked, str):
        return Discovery(op.target, reason=checked, shrunk=mapping, spec=spec)
    full, tol = checked
    cands, dropped = candidates(
        [(shapes[t], ts[t].is_float) for t in op.inputs], [(shapes[t], ts[t].is_float) for t in op.outputs]
    )
    accepted, rejected = [], []
    used: dict[int, tuple[tuple[int, ...], ...]] = {}
    for k, c in enumerate(cands):
        lens = {shapes[t][f.dim] for t, f in zip(op.inputs + op.outputs, c[0] + c[1]) if f.is_gather}
        split_list = splits(next(iter(lens))) if lens else splits(2)
        if lens:
            used[next(iter(lens))] = split_list
        ok, why = accepts(fn, op, full, c, split_list, tol, seed=k)
        if ok:
            accepted.append(c)
        elif len(rejected) < 8:
            rejected.append((_forms_text(c), why))
    return Discovery(
        op.target,
        tuple(accepted),
        len(cands),
        dropped,
        "",
        used,
        mapping,
        time.perf_counter() - t0,
        spec,
        tuple(rejected),
    )


def _full_run(
    fn: Any, op: Op, shapes: dict[int, tuple[int, ...]], dtypes: dict[int, str]
) -> tuple[list[Any], float] | str:
    """Random full inputs the op runs on deterministically, with the tolerance to check at (float64
    first, else the op's own dtypes), the reason as a string when there are none."""
    expect = {t: shapes[t] for t in op.outputs}
    why = ""
    for high in (True, False):
        try:
            full = _random_inputs(shapes, dtypes, op.inputs, high, seed=1234)
        except ValueError as exc:
            return f"cannot make its inputs: {exc}"
        call = LocalCall(fn, op.args, op.kwargs)
        try:
            a = outputs_of(call.run(full), op)
            b = outputs_of(call.run(full), op)
        except Exception as exc:  # noqa: BLE001
            why = f"the op raised {_short(exc)} on random inputs"
            continue
        for t, x, y in zip(op.outputs, a, b):
            if tuple(getattr(x, "shape", ())) != expect[t]:
                got = tuple(getattr(x, "shape", ()))
                return (
                    f"an output has shape {got}, expected {expect[t]} (its shapes do not follow its inputs')"
                )
            if not close(x, y, 0.0)[0]:
                return "it is not deterministic (two runs on the same inputs differ)"
        return full, (1e-9 if high else 1e-5)
    return why


# ========================================================================================= caches

_MEMORY: dict[str, Discovery] = {}
_KNOWN: set[str] = set()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _key(graph: Graph, op: Op) -> str:
    ts = graph.tensors
    parts = (
        FORMAT,
        op.target,
        [(ts[t].shape, ts[t].dtype) for t in op.inputs],
        [(ts[t].shape, ts[t].dtype) for t in op.outputs],
        [op.inputs.index(t) for t in op.inputs],
        op.output_items,
        repr(op.args),
        repr(op.kwargs),
        _torch_version(),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def cache_folder() -> Any:
    """The folder of the on-disk discovery cache (``discover/`` of the hapnb cache folder)."""
    return cache_root() / "discover"


def clear_cache(disk: bool = False) -> None:
    """Forget the discoveries of this process (and, with ``disk``, the on-disk cache entries)."""
    _MEMORY.clear()
    _KNOWN.clear()
    if disk:
        d = cache_folder()
        for p in d.glob("*.json") if d.is_dir() else ():
            p.unlink(missing_ok=True)


def cached() -> Iterator[Discovery]:
    """Every discovery known: this process's, then the readable on-disk entries (for the checker)."""
    seen = set()
    for key, d in list(_MEMORY.items()):
        seen.add(key)
        yield d
    folder = cache_folder()
    if not folder.is_dir():
        return
    for p in sorted(folder.glob("*.json")):
        if p.stem in seen:
            continue
        d = _read(p, p.stem)
        if d is not None:
            yield d


def _load(key: str, op: Op) -> Discovery | None:
    if not _disk_enabled():
        return None
    d = _read(cache_folder() / f"{key}.json", key)
    if d is None or d.target != op.target:
        return None
    if any(len(i) != len(op.inputs) or len(o) != len(op.outputs) for i, o in d.accepted):
        return None
    return d


def _read(path: Any, key: str) -> Discovery | None:
    """One cache entry, or None when it is missing or does not parse as one (never executed)."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT or raw.get("key") != key:
            return None
        accepted = tuple(
            (tuple(parse_form(x) for x in i), tuple(parse_form(x) for x in o)) for i, o in raw["accepted"]
        )
        return Discovery(
            str(raw["target"]),
            accepted,
            int(raw["tried"]),
            int(raw["truncated"]),
            str(raw["reason"]),
            {int(k): tuple(tuple(int(x) for x in s) for s in v) for k, v in raw["splits"].items()},
            {int(k): int(v) for k, v in raw["shrunk"].items()},
            float(raw["seconds"]),
            raw["spec"] if isinstance(raw.get("spec"), dict) else None,
            tuple((str(a), str(b)) for a, b in raw.get("rejected", ())),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _save(key: str, d: Discovery) -> None:
    if not _disk_enabled():
        return
    entry = {
        "format": FORMAT,
        "key": key,
        "target": d.target,
        "accepted": [[[str(f) for f in i], [str(f) for f in o]] for i, o in d.accepted],
        "tried": d.tried,
        "truncated": d.truncated,
        "reason": d.reason,
        "splits": {str(k): [list(s) for s in v] for k, v in d.splits.items()},
        "shrunk": {str(k): v for k, v in d.shrunk.items()},
        "seconds": d.seconds,
        "spec": d.spec,
        "rejected": [list(r) for r in d.rejected],
    }
    try:
        folder = cache_folder()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entry, indent=1))
        os.replace(tmp, folder / f"{key}.json")
    except (OSError, TypeError, ValueError):
        pass  # a cache that cannot be written is skipped


# ============================================================================ specs (for the checker)


def _encode(v: Any) -> Any:
    """A JSON value for one argument leaf tree; raises TypeError for what it cannot encode."""
    import torch

    if isinstance(v, TensorArg):
        return {"tensor": v.index}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    raise TypeError(f"cannot encode {type(v).__name__}")


def decode_arg(v: Any, tensors: Sequence[Any]) -> Any:
    """The inverse of the spec encoding, with ``{"tensor": i}`` replaced by ``tensors[i]``."""
    import torch

    if isinstance(v, list):
        return [decode_arg(x, tensors) for x in v]
    if isinstance(v, dict):
        if "tensor" in v:
            return tensors[int(v["tensor"])]
        if "tuple" in v:
            return tuple(decode_arg(x, tensors) for x in v["tuple"])
        if "float" in v:
            return float(v["float"])
        if "dtype" in v:
            dt = getattr(torch, str(v["dtype"]), None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown dtype {v['dtype']!r}")
            return dt
        raise ValueError(f"cannot decode {v!r}")
    return v


def _spec(graph: Graph, op: Op) -> dict[str, Any] | None:
    ts = graph.tensors
    try:
        return {
            "target": op.target,
            "inputs": [[list(ts[t].shape), ts[t].dtype] for t in op.inputs],
            "args": _encode(tuple(op.args)),
            "kwargs": {k: _encode(v) for k, v in op.kwargs},
        }
    except TypeError:
        return None


def rebuild(spec: dict[str, Any], seed: int = 0) -> tuple[str, tuple, dict]:
    """``(target, args, kwargs)`` with random tensors (as discovery makes them) from a cache spec."""
    ins = [(tuple(int(x) for x in s), str(dt)) for s, dt in spec["inputs"]]
    shapes = {k: s for k, (s, _) in enumerate(ins)}
    dtypes = {k: dt for k, (_, dt) in enumerate(ins)}
    tensors = _random_inputs(shapes, dtypes, list(range(len(ins))), True, seed)
    args = decode_arg(spec["args"], tensors)
    kwargs = {str(k): decode_arg(v, tensors) for k, v in spec["kwargs"].items()}
    return str(spec["target"]), tuple(args), kwargs


# ================================================================================= registry hook


class _Provider:
    """The registry's fallback for ops without a hand rule: the discovered strategies as candidates."""

    def __call__(self, graph: Graph, op: Op) -> list[_Cand]:
        if op.target in _RULES or not enabled():
            return []
        d = discover(graph, op)
        out = []
        for ins, outs in d.accepted:
            sharded = any(f.is_gather for f in ins + outs)
            out.append(_Cand("discovered:shard" if sharded else "discovered:partial", ins, outs))
        return out

    @staticmethod
    def known(target: str) -> bool:
        """Whether some discovery of ``target`` in this process accepted a strategy."""
        return target in _KNOWN


_set_fallback(_Provider())
