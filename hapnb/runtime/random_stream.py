"""The random numbers of a program's random ops (``rand``, ``randn``, ``bernoulli``, ...): one stream per
program, the same on every rank and in the single-device program.

A random op runs replicated (its rule, :mod:`hapnb.rules.creation`: every rank draws the whole tensor and
uses its slice), which is right only if every rank draws the *same* numbers. The global generator does
not promise that: ranks are often seeded apart (``manual_seed(seed + rank)`` for data augmentation), and a
batch-sharded dropout draws a mask of each rank's own size, so the streams drift apart after the first
uneven one. Then a drop-path mask, say, differs from rank to rank, and a sample is dropped in one rank's
features and kept in another's: a program no single device runs.

So each program has a :class:`RandomStream` (the module attribute :data:`STREAM_ATTR`) and its random ops
draw from it (:func:`from_stream`): the ``k``-th draw uses a generator seeded from ``(seed, k)``, on the
device of the tensor drawn. Every rank runs the same random ops in the same order with the same shapes,
so with one ``seed`` they draw the same numbers; :func:`hapnb.run.distribute.distribute` takes rank 0's
seed (``torch.initial_seed()``) for every rank. The single-device program made for verification draws
from a stream with the same seed, so a program with drop path verifies exactly (dropout itself is
switched off there; it shards with the batch and draws from the global generator).

>>> s = RandomStream(7)
>>> a = from_stream(torch.ops.aten.rand.default)(s, [3])
>>> b = from_stream(torch.ops.aten.rand.default)(RandomStream(7), [3])
>>> torch.equal(a, b), s.draws
(True, 1)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RandomStream", "RANDOM_OPS", "STREAM_ATTR", "from_stream", "is_random", "continue_stream"]

#: the attribute of a program's module that holds its :class:`RandomStream`
STREAM_ATTR = "hapnb_random"

_aten = torch.ops.aten
#: each random op and its overload that takes a ``generator`` (the same op for those with a ``generator``
#: keyword)
RANDOM_OPS: dict[Any, Any] = {
    _aten.rand.default: _aten.rand.generator,
    _aten.randn.default: _aten.randn.generator,
    _aten.randint.default: _aten.randint.generator,
    _aten.randint.low: _aten.randint.low_generator,
    _aten.rand_like.default: _aten.rand_like.generator,
    _aten.randn_like.default: _aten.randn_like.generator,
    _aten.randperm.default: _aten.randperm.generator,
    _aten.bernoulli.default: _aten.bernoulli.default,
    _aten.bernoulli.p: _aten.bernoulli.p,
}


def is_random(fn: Any) -> bool:
    """Whether op ``fn`` draws random numbers (a key of :data:`RANDOM_OPS`)."""
    return fn in RANDOM_OPS


class RandomStream(torch.nn.Module):
    """A program's random numbers: draw ``k`` (counted in :attr:`draws`) uses a generator seeded from
    ``(seed, k)``. Set :attr:`seed` (and reset :attr:`draws`) with :meth:`reseed`. A module without
    weights, so that a program's fx graph can hold it (``get_attr``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = int(seed)
        self.draws = 0

    def reseed(self, seed: int) -> None:
        """Start the stream again from ``seed``."""
        self.seed, self.draws = int(seed), 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of the next draw on ``device`` (None on the meta device: nothing is drawn)."""
        k = self.draws
        self.draws += 1
        if device.type == "meta":
            return None
        digest = hashlib.sha256(f"{self.seed}:{k}".encode()).digest()
        gen = torch.Generator(device=device)
        gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        return gen

    def extra_repr(self) -> str:
        return f"seed={self.seed}, draws={self.draws}"


def _device(args: tuple, kwargs: dict) -> torch.device:
    """The device a random op draws on: its tensor input's, else its ``device`` argument, else the CPU."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else torch.device("cpu")


_FROM_STREAM: dict[Any, Callable[..., Any]] = {}


def from_stream(fn: Any) -> Callable[..., Any]:
    """Random op ``fn`` with a leading :class:`RandomStream` it draws from (one named function per ``fn``,
    callable as an fx op)."""
    w = _FROM_STREAM.get(fn)
    if w is None:
        overload = RANDOM_OPS[fn]

        def w(stream: RandomStream, *args: Any, **kwargs: Any) -> Any:
            gen = stream.generator(_device(args, kwargs))
            if gen is None:
                return fn(*args, **kwargs)
            return overload(*args, **kwargs, generator=gen)

        name = "from_stream_" + "".join(ch if ch.isalnum() else "_" for ch in getattr(fn, "__name__", "op"))
        w.__name__ = w.__qualname__ = name
        _FROM_STREAM[fn] = w
    return w


def continue_stream(module: torch.nn.Module, owner: torch.nn.Module) -> None:
    """Make program ``module`` (the same program for another batch size, or after a reshard) draw from
    ``owner``'s stream, where both have one, so it continues ``owner``'s draws instead of repeating them."""
    stream = getattr(owner, STREAM_ATTR, None)
    if isinstance(stream, RandomStream) and isinstance(getattr(module, STREAM_ATTR, None), RandomStream):
        setattr(module, STREAM_ATTR, stream)
