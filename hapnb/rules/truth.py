"""Ground-truth helpers shared by the rule checker and rule discovery: split a full tensor per a form over
simulated ranks, reassemble the ranks' results per a form, and compare tensors in float64.

Layering inside :mod:`hapnb.rules`: :mod:`.registry` (bottom) <- this module <- :mod:`.discover` <-
:mod:`.checker` (top). It imports only the values layer (forms, graph).

* split (:func:`split_input`): ``G(d)`` narrows dim ``d`` by the given per-rank lengths (zero allowed),
  ``R`` draws asymmetric random partials that sum to the full tensor, ``I`` copies it to every rank;
* reassemble (:func:`reassembles`): ``G(d)`` concatenates the ranks' parts in rank order (each part must
  have its rank's length), ``R`` sums them, ``I`` needs every rank's part equal to the full result.

>>> import torch
>>> from hapnb.ir.forms import G
>>> x = torch.arange(6.0).reshape(3, 2)
>>> parts = split_input(x, G(0), 0, lambda t, d: (2, 0, 1), 3, torch.Generator().manual_seed(0))
>>> [tuple(p.shape) for p in parts], reassembles(parts, x, G(0), (2, 0, 1))
([(2, 2), (0, 2), (1, 2)], (True, ''))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..ir.forms import Form, shard_offsets
from ..ir.graph import Op

__all__ = ["close", "split_input", "outputs_of", "reassembles"]


def close(a: Any, b: Any, tol: float = 1e-9) -> tuple[bool, str]:
    """Whether tensor ``a`` equals the expected ``b`` (same shape; integers exactly; floats within ``tol``
    relative to ``b``'s largest magnitude, at least 1e-5 below float64; non-finite entries in the same
    places), with the reason when not."""
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False, f"not tensors: {type(a).__name__} vs {type(b).__name__}"
    if tuple(a.shape) != tuple(b.shape):
        return False, f"shape {tuple(a.shape)} != expected {tuple(b.shape)}"
    if not (a.is_floating_point() or b.is_floating_point() or a.is_complex() or b.is_complex()):
        same = bool(torch.equal(a, b.to(a.dtype)))
        return same, "" if same else "integer values differ"
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    a64, b64 = a.double(), b.double()
    fin = torch.isfinite(b64)
    if not torch.equal(fin, torch.isfinite(a64)):
        return False, "non-finite entries differ"
    if min(a.dtype.itemsize, b.dtype.itemsize) < 8:
        tol = max(tol, 1e-5)
    scale = float(b64[fin].abs().max()) if fin.any() else 0.0
    err = float((a64[fin] - b64[fin]).abs().max()) if fin.any() else 0.0
    ok = err <= tol * max(1.0, scale)
    return ok, "" if ok else f"max abs error {err:.3g} (scale {scale:.3g})"


def split_input(
    x: Any, f: Form, tid: int, lengths: Callable[[int, int], Sequence[int]], n: int, gen: Any
) -> list[Any]:
    """The ``n`` ranks' local copies of the full tensor ``x`` (tensor id ``tid``) in form ``f``:
    ``lengths(tid, dim)`` gives a ``G`` dim's per-rank lengths; ``R`` partials are random (drawn from
    ``gen``), scaled differently per rank, and sum to ``x``."""
    import torch

    if f.is_gather:
        lens = lengths(tid, f.dim)
        offs = shard_offsets(lens)
        return [x.narrow(f.dim, o, k).clone() for o, k in zip(offs, lens)]
    if f.is_reduce:
        parts = []
        for j in range(n - 1):
            parts.append(torch.randn(x.shape, dtype=x.dtype, generator=gen) * (j + 1.5))
        last = x - sum(parts) if parts else x.clone()
        return [*parts, last]
    return [x.clone() for _ in range(n)]


def outputs_of(res: Any, op: Op) -> list[Any]:
    """The op's kept results (``Op.outputs`` order) from what its callable returned."""
    if op.output_items:
        return [res[k] for k in op.output_items]
    return [res]


def reassembles(
    parts: Sequence[Any], want: Any, f: Form, lens: Sequence[int] = (), tol: float = 1e-9
) -> tuple[bool, str]:
    """Whether the ranks' ``parts`` of one output in form ``f`` reassemble to the full result ``want``
    (``lens``: a ``G`` dim's per-rank lengths, each part must have its own), with the reason when not."""
    import torch

    n = len(parts)
    for r in range(n):
        if not isinstance(parts[r], torch.Tensor):
            return False, f"rank {r}: its result is a {type(parts[r]).__name__}, not a tensor"
    if f.is_gather:
        for r in range(n):
            if parts[r].ndim <= f.dim:
                return False, f"rank {r}: no dim {f.dim} in its result"
            if lens and parts[r].shape[f.dim] != lens[r]:
                return False, f"rank {r}: local length {parts[r].shape[f.dim]} != {lens[r]}"
        try:
            return close(torch.cat(list(parts), f.dim), want, tol)
        except RuntimeError as exc:
            return False, f"the parts do not concatenate ({str(exc).splitlines()[0][:120]})"
    if f.is_reduce:
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) > 1:
            return False, f"the ranks' partial sums have different shapes {sorted(shapes)}"
        return close(sum(parts[1:], parts[0]), want, tol)
    for r in range(n):
        ok, why = close(parts[r], want, tol)
        if not ok:
            return False, f"rank {r}: {why}"
    return True, ""


def sample(*shape: int) -> Any:
    """A random float64 tensor of ``shape``: the family modules' ground-truth sample cases use it."""
    import torch

    return torch.randn(*shape, dtype=torch.float64)


def sample_dims(r: Any) -> tuple[int, int, int]:
    """Three random dim sizes in 2..4 from the checker's ``random.Random`` (``(B, S, H)`` of a sample)."""
    return r.randint(2, 5), r.randint(2, 5), r.randint(2, 5)
