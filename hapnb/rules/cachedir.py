"""Where hapnb keeps its caches on disk (a leaf: imports nothing of hapnb).

It lives at the bottom of :mod:`hapnb.rules` because the lowest cache user is rule discovery
(:mod:`hapnb.rules.discover`); the trace cache (:mod:`hapnb.tracing.cache`, a layer above) uses it too.

``$HAPNB_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/hapnb``, else ``~/.cache/hapnb``. Each cache has its
own folder below it: traced graphs in ``traces/`` (:mod:`hapnb.tracing.cache`), discovered op rules in
``discover/`` (:mod:`hapnb.rules.discover`). Nothing here creates a folder.

>>> isinstance(cache_root(), Path)
True
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The hapnb cache folder (not created here); every cache uses a subfolder of it."""
    base = os.environ.get("HAPNB_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "hapnb"
