"""hapnb.widgets: the interactive notebook UI (ipywidgets), thin views over hapnb's state objects.

>>> from hapnb.widgets import Explorer
>>> ex = Explorer("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)  # doctest: +SKIP
>>> ex  # doctest: +SKIP  (displays the panel in a notebook)

hapnb itself never imports this package; renderers live in :mod:`hapnb.display`.
"""

from __future__ import annotations

from .explorer import Explorer

__all__ = ["Explorer"]
