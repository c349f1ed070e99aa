"""HTML views of the tuning answers (:mod:`hapnb.plans.explain`): what bounds the step, why not, what if."""

from __future__ import annotations

from typing import Any

from .basics import _bar, _ms, _table, esc


def sensitivity_html(s: Any, *, max_stages: int = 40) -> str:
    """A :class:`~hapnb.plans.explain.Sensitivity`: saving per device and per link (bars), the devices whose memory
    binds, tight devices per stage."""
    pct = f"+{(s.factor - 1) * 100:.3g} %"
    basis = (
        "first order by the ratio LP's dual values (the ratios re-balance)"
        if s.basis == "lp"
        else "the plan's cost at its own (fixed) ratios"
    )
    top = max([d.saving_s for d in s.devices] + [x.saving_s for x in s.links] + [0.0])
    n_st = len(s.stages)
    dev_rows = [
        [esc(d.device), f"{_ms(d.saving_s)} {_bar(d.saving_s, top)}", f"{len(d.tight_stages)}/{n_st or '-'}",
         _ms(d.binding_s)]
        for d in s.devices
    ]  # fmt: skip
    devices = _table(
        ["device", f"saves per {pct} flop/s (ms)", "tight in stages", "binding computation (ms)"],
        dev_rows,
        right=(1, 2, 3),
    )
    links = ""
    if s.links:
        links = _table(
            ["collective / link", f"saves per {pct} bandwidth (ms)", "time in the step (ms)"],
            [[esc(x.name), f"{_ms(x.saving_s)} {_bar(x.saving_s, top)}", _ms(x.time_s)] for x in s.links],
            right=(1, 2),
        )
    stages = ""
    if s.stages:
        rows = [
            [esc(b.stage), _ms(b.comm_s), _ms(b.comp_s), esc(", ".join(b.tight) or "-"),
             esc(", ".join(b.comm_tight) or "-")]
            for b in s.stages[:max_stages]
        ]  # fmt: skip
        more = f" (first {max_stages} of {n_st})" if n_st > max_stages else ""
        stages = (
            f"<details><summary>binding devices per stage{esc(more)}</summary>"
            + _table(
                ["stage", "comm (ms)", "computation max (ms)", "tight devices", "sets a collective's time"],
                rows,
                right=(0, 1, 2),
            )
            + "</details>"
        )
    memory = ""
    if s.memory:
        memory = _table(
            ["memory binds on", "phase", "capacity (GiB)", f"saves per {pct} memory (ms)"],
            [
                [esc(m.device), esc(m.phase), f"{m.capacity_bytes / 2**30:.4g}", _ms(m.saving_s)]
                for m in s.memory
            ],
            right=(2, 3),
        )
    other = ""
    if s.other:
        other = (
            "<div>other tight LP rows (dual): "
            + esc(", ".join(f"{n} {pi:.4g}" for n, pi in s.other))
            + "</div>"
        )
    return (
        f"<div><b>What bounds the step</b> of {esc(s.plan)} on {esc(s.cluster)}: {_ms(s.cost_s)} ms; "
        f"{esc(basis)}.{devices}{links}{memory}{stages}{other}</div>"
    )


def why_not_html(w: Any) -> str:
    """A :class:`~hapnb.plans.whynot.WhyNot`: the best plan with the pins and where it differs, or why none."""
    asked = esc(", ".join(f"{t}={f}" for t, f in w.pins))
    if w.other is None:
        where = f" at <b>{esc(w.where)}</b>" if w.where else ""
        return (
            f"<div><b>Why not {asked}?</b> No program satisfies it{where}:"
            f"<pre style='white-space:pre-wrap'>{esc(w.reason)}</pre></div>"
        )
    delta = w.delta_s
    color = "#a00" if delta > 0 else "#060"
    head = (
        f"<div><b>Why not {asked}?</b> The best plan with it costs <b>{_ms(w.other.cost_s)} ms</b> against "
        f"{_ms(w.cost_s)} ms (<span style='color:{color}'>{delta * 1e3:+.4g} ms</span>)"
        + ("; the chosen plan already gives these forms" if w.already else "")
        + ".</div>"
    )
    rows = [
        [esc(b.ops), f"{_ms(b.chosen_s)} ({b.chosen_stages})", f"{_ms(b.other_s)} ({b.other_stages})",
         f"{b.delta_s * 1e3:+.4g}", esc(", ".join(b.chosen_comm) or "-"), esc(", ".join(b.other_comm) or "-")]
        for b in w.blocks
    ]  # fmt: skip
    table = (
        _table(
            [
                "ops",
                "chosen ms (stages)",
                "with the pins ms (stages)",
                "difference ms",
                "chosen communicates",
                "with the pins communicates",
            ],
            rows,
            right=(1, 2, 3),
        )  # fmt: skip
        if rows
        else "<div>(the two plans have the same stages)</div>"
    )
    return f"<div>{head}{table}</div>"


def what_if_html(w: Any) -> str:
    """A :class:`~hapnb.plans.explain.WhatIf`: the re-planned cost next to the dual's prediction."""
    pred = "-" if w.predicted_s is None else f"{_ms(w.predicted_s)} ms"
    return (
        f"<div><b>What if {esc(w.change)}?</b> re-planned: <b>{_ms(w.replanned.cost_s)} ms</b> "
        f"(saves {_ms(w.replanned_s)} ms of {_ms(w.cost_s)} ms); the LP's duals predicted {pred}.</div>"
    )
