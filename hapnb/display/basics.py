"""Shared pieces of the renderers: escaping, tables, units, form notation, colours, ``safe_html``."""

from __future__ import annotations

import html as _html
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: Fill colours of the three forms (I replicated, G sharded, R partial sums) in every drawing.
FORM_COLORS: Mapping[str, str] = {"I": "#9ecae1", "G": "#a1d99b", "R": "#fdae6b", "?": "#eeeeee"}
_COMM_COLOR = "#e6550d"
_COMP_COLOR = "#3182bd"
_IDLE_COLOR = "#dddddd"
_DEVICE_COLORS = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
)  # fmt: skip

_TABLE = "border-collapse:collapse;font-family:monospace;font-size:12px;margin:4px 0"
_TD = "border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top"
_TDR = "border:1px solid #ccc;padding:2px 6px;text-align:right;vertical-align:top"
_TH = "border:1px solid #ccc;padding:2px 6px;background:#f4f4f4;text-align:left"
_HIGHLIGHT = "background:#fff3b0"


def esc(x: Any) -> str:
    """HTML-escape ``str(x)``."""
    return _html.escape(str(x), quote=True)


# ============================================================================================ basics


def safe_html(fn: Any, obj: Any, *args: Any, **kwargs: Any) -> str:
    """``fn(obj, *args, **kwargs)`` as HTML; on any error, the escaped ``repr(obj)`` plus a short note.

    Never raises (``KeyboardInterrupt`` aside), so a display bug never breaks a notebook cell.

    >>> safe_html(lambda o: 1 / 0, "x").startswith("<div")
    True
    """
    try:
        out = fn(obj, *args, **kwargs)
        return out if isinstance(out, str) else str(out)
    except Exception as e:  # noqa: BLE001 - a display must never raise
        try:
            text = repr(obj)
        except Exception as e2:  # noqa: BLE001
            text = f"<{type(obj).__name__} object (repr failed: {type(e2).__name__}: {e2})>"
        name = getattr(fn, "__name__", "renderer")
        return (
            f"<div><pre style='white-space:pre-wrap'>{esc(text)}</pre>"
            f"<div style='color:#a00;font-size:11px'>(hapnb: {esc(name)} could not render this: "
            f"{esc(type(e).__name__)}: {esc(str(e)[:300])})</div></div>"
        )


def _table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    highlight: Iterable[int] = (),
    right: Iterable[int] = (),
    caption: str = "",
) -> str:
    """An HTML table; ``rows`` hold already-escaped cell HTML; ``highlight`` row indices; ``right`` cols."""
    hl = set(highlight)
    rc = set(right)
    head = "".join(f"<th style='{_TH}'>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        style = f" style='{_HIGHLIGHT}'" if i in hl else ""
        cells = "".join(f"<td style='{_TDR if k in rc else _TD}'>{c}</td>" for k, c in enumerate(row))
        body.append(f"<tr{style}>{cells}</tr>")
    cap = f"<caption style='text-align:left;font-weight:bold'>{caption}</caption>" if caption else ""
    return f"<table style='{_TABLE}'>{cap}<tr>{head}</tr>{''.join(body)}</table>"


def _bar(x: float, top: float, color: str = _COMP_COLOR, width: int = 120, min_width: int = 0) -> str:
    """An inline horizontal bar ``width * x / top`` pixels long (at least ``min_width``, at most ``width``)."""
    w = 0 if top <= 0 else max(min_width, min(width, round(width * x / top)))
    return f"<span style='display:inline-block;width:{w}px;height:9px;background:{color}'></span>"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{int(n)} B"


def short_target(target: str) -> str:
    """``aten.linear.default`` -> ``linear``."""
    parts = target.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims", "torch"):
        return parts[1]
    return target


def form_text(form: Any, words: bool = False) -> str:
    """A form in math notation: ``G(0)``, ``I``, ``R``; with ``words`` the paper's All-Gather(0)/...

    Accepts a :class:`~hapnb.ir.forms.Form` (anything with ``kind`` and ``dim``) or its string (``"G0"``,
    ``"G(0)"``, ``"I"``, ``"R"``; a ``@segment`` suffix is ignored).

    >>> form_text("G1"), form_text("R", words=True), form_text("G(0)@2", words=True)
    ('G(1)', 'All-Reduce', 'All-Gather(0)')
    """
    if hasattr(form, "kind"):
        kind, dim = form.kind, getattr(form, "dim", None)
    else:
        m = re.fullmatch(r"([IRG])\(?(\d*)\)?(@\d+)?", str(form).strip().upper())
        if m is None or (m[1] == "G") != bool(m[2]):
            raise ValueError(f"not a form: {form!r} (expected I, R or G<d>)")
        kind, dim = m[1], int(m[2]) if m[2] else None
    if words:
        return {"I": "Identity", "R": "All-Reduce"}.get(kind, f"All-Gather({dim})")
    return f"G({dim})" if kind == "G" else kind


def _kind(form: Any) -> str:
    s = str(form)
    return s[:1] if s[:1] in ("I", "G", "R") else "?"


def _props_text(props: Iterable[tuple[str, Any]], words: bool = False) -> str:
    return "{" + ", ".join(f"{name} | {form_text(f, words)}" for name, f in props) + "}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _stage_starts(plan: Any) -> list[float]:
    out, t = [], 0.0
    for s in plan.stages:
        out.append(t)
        t += s.time_s
    return out


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit a chart spanning ``seconds`` reads best in, and its scale from seconds.

    >>> time_unit(3.5e-3), time_unit(2e-5), time_unit(12.0)
    (('ms', 1000.0), ('µs', 1000000.0), ('s', 1.0))
    """
    s = abs(seconds)
    if s >= 1.0:
        return "s", 1.0
    if s >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6
