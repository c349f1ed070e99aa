"""The Explorer's Launch tab: verify and launch the plan, with live re-balancing, an injected straggler for
demos, and a live telemetry chart.

Controls (in ``ex.controls``): ``nproc``, ``steps``, ``backend``; ``rebalance`` (a checkbox: re-balance the
ratios live when a rank straggles, :func:`hapnb.run.launch.launch`'s ``rebalance=True``), ``slow_rank`` (a
rank to slow down, or none) and ``slow_factor`` (how many times slower: ``slowdown={rank: factor}``).
Outputs (in ``ex.outputs``): ``launch_status`` (one line), ``live_chart`` (each rank's step time, compute and
time blocked in collectives per step, with the re-balances marked: :func:`hapnb.display.live_frame`),
``rebalances`` (the decisions, a table) and ``metrics`` (the last metrics lines).

The panel follows the session's change events: a ``"job"`` change redraws the table and, at most every
:attr:`LaunchPanel.chart_interval_s` seconds while the job runs, the chart; a ``"rebalance"`` change
redraws the chart and the decisions at once; the job's end draws the chart a last time, complete (a static
page, inline BokehJS).
"""

from __future__ import annotations

import html
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import ipywidgets as W

from hapnb import display
from hapnb.run.launch import JobState
from hapnb.session import Change

__all__ = ["LaunchPanel"]

#: the straggler drop-down's value for "no straggler"
NO_STRAGGLER = -1


class LaunchPanel:
    """The Launch tab of ``ex`` (an :class:`~hapnb.widgets.Explorer`); see the module docstring."""

    #: while a job runs, the live chart is redrawn at most this often (seconds); each redraw sends the chart's
    #: page with BokehJS inlined (about 1.4 MB) to the notebook
    chart_interval_s: float = 1.0

    def __init__(self, ex: Any) -> None:  # the Explorer (not imported: it imports this module)
        self.ex = ex
        self._chart_at = -math.inf
        self._chart_shown: tuple[int, bool] | None = None

    # ============================================================================ building
    def build(self) -> W.Widget:
        ex, c = self.ex, self.ex.controls
        ex._nproc_cluster = ex.cluster  # the nproc field follows the applied cluster (Explorer.refresh)
        c["nproc"] = W.BoundedIntText(
            value=ex.cluster.gpus, min=1, max=4096, description="nproc", layout=W.Layout(width="150px")
        )
        c["steps"] = W.BoundedIntText(
            value=10, min=1, max=10**6, description="steps", layout=W.Layout(width="150px")
        )
        c["backend"] = W.Dropdown(
            options=["gloo", "nccl"], value="gloo", description="backend", layout=W.Layout(width="200px")
        )
        c["rebalance"] = W.Checkbox(
            value=False, description="re-balance live", indent=False, layout=W.Layout(width="130px")
        )
        c["slow_rank"] = W.Dropdown(description="straggler", layout=W.Layout(width="220px"))
        c["slow_factor"] = W.BoundedFloatText(
            value=3.0, min=1.0, max=100.0, step=0.5, description="x slower", layout=W.Layout(width="150px")
        )
        self._straggler_options()
        c["nproc"].observe(lambda _: self._straggler_options(), names="value")
        for key in ("launch_status", "live_chart", "rebalances", "metrics"):
            ex.outputs[key] = W.HTML(value="", layout=W.Layout(width="100%"))
        verify = ex._button(
            "verify", "Verify", lambda: ex.session.verify(nproc=int(c["nproc"].value)), icon="check-circle"
        )
        launch = ex._button("launch", "Launch", lambda: self.launch(wait=False), icon="rocket")
        stop = ex._button("stop", "Stop", lambda: ex.session.stop(), icon="stop")
        row = W.Layout(flex_flow="row wrap", align_items="center")
        return W.VBox(
            [
                W.HBox([c["nproc"], c["steps"], c["backend"], verify, launch, stop], layout=row),
                W.HBox([c["rebalance"], c["slow_rank"], c["slow_factor"]], layout=row),
                ex.outputs["launch_status"],
                ex.outputs["live_chart"],
                ex.outputs["rebalances"],
                ex.outputs["metrics"],
            ]
        )

    def _straggler_options(self) -> None:
        """One straggler choice per rank of the nproc field (and none); keeps the choice while it exists."""
        dd, n = self.ex.controls["slow_rank"], int(self.ex.controls["nproc"].value)
        options = [("none", NO_STRAGGLER)] + [(f"rank {r}", r) for r in range(n)]
        if list(dd.options) != options:
            keep = dd.value if dd.value is not None and dd.value < n else NO_STRAGGLER
            dd.options = options
            dd.value = keep

    # ============================================================================ launching
    def slowdown(self) -> dict[int, float]:
        """The straggler the controls ask for, ``{rank: factor}`` (empty: none, or a factor of 1)."""
        rank, factor = self.ex.controls["slow_rank"].value, float(self.ex.controls["slow_factor"].value)
        return {int(rank): factor} if rank is not None and rank != NO_STRAGGLER and factor > 1.0 else {}

    def launch(
        self,
        nproc: int | None = None,
        steps: int | None = None,
        *,
        wait: bool = True,
        rebalance: bool | Mapping[str, Any] | None = None,
        slowdown: Mapping[int, float] | None = None,
        **options: Any,
    ) -> Any:
        """Launch the session's plan (every ``None`` argument from the controls) and follow it; returns the
        job. ``wait=False`` follows it in a background thread (the Launch button does this)."""
        ex, c = self.ex, self.ex.controls
        nproc = int(c["nproc"].value if nproc is None else nproc)
        steps = int(c["steps"].value if steps is None else steps)
        rebalance = bool(c["rebalance"].value) if rebalance is None else rebalance
        slowdown = self.slowdown() if slowdown is None else dict(slowdown)
        backend = c["backend"].value
        extra = "".join(
            [", re-balancing live" if rebalance else ""]
            + [f", rank {r} {f:g}x slower" for r, f in sorted(slowdown.items())]
        )
        self.status(html.escape(f"launching {nproc} ranks, {steps} steps ({backend}){extra}..."))
        self._chart_at, self._chart_shown = -math.inf, None  # a new job: its first lines are drawn at once
        options.update(rebalance=rebalance, slowdown=slowdown or None)
        job = ex.session.launch(nproc=nproc, steps=steps, backend=backend, **options)
        if wait:
            ex.session.follow()
        else:
            ex._launch_thread = threading.Thread(target=self._follow_guarded, daemon=True)
            ex._launch_thread.start()
        return job

    def _follow_guarded(self) -> None:
        try:
            self.ex.session.follow()
        except Exception as e:  # noqa: BLE001 - shown in the panel (a thread cannot raise to the cell)
            self.ex._error(e)

    # ============================================================================ showing
    def status(self, markup: str) -> None:
        self.ex.outputs["launch_status"].value = markup

    def on_change(self, change: Change) -> None:
        """The session's ``"verify"``, ``"job"`` or ``"rebalance"`` change."""
        if change.kind == "verify":
            self.status(display.verify_status_html(self.ex.session.verify_report))
        elif change.kind == "rebalance":
            color = "#060" if (change.rebalance or {}).get("accepted") else "#666"
            self.status(f"<span style='color:{color}'>{html.escape(change.text)}</span>")
            self.show_job(self.ex.session.poll(), force=True)
        elif change.kind == "job":
            self.show_job(self.ex.session.poll())

    def show_job(self, state: JobState, force: bool = False) -> None:
        """Render a launch snapshot: progress, the live chart (throttled while running), the re-balance
        decisions, the last metrics lines, predicted vs measured."""
        ex = self.ex
        ex.outputs["metrics"].value = display.launch_html(state)
        if not state.started:
            ex.outputs["live_chart"].value = ex.outputs["rebalances"].value = ""
            return
        self._chart(state, force)
        bar = ex.controls["progress"]
        bar.max = max(state.steps, 1)
        bar.value = min(len(state.step_times), bar.max)
        if state.result is not None:
            color = "#060" if state.result.ok else "#a00"
            self.status(f"<span style='color:{color}'>{html.escape(state.summary())}</span>")

    def _chart(self, state: JobState, force: bool) -> None:
        """Redraw the live chart and the decisions: when forced, when the job ended, or when
        :attr:`chart_interval_s` has passed; never twice for the same lines."""
        key = (len(state.metrics), state.result is not None)
        now = time.monotonic()
        due = force or state.result is not None or now - self._chart_at >= self.chart_interval_s
        if not due or key == self._chart_shown:
            return
        self._chart_at, self._chart_shown = now, key
        out = self.ex.outputs
        out["live_chart"].value = display.safe_html(
            lambda m: display.live_frame(m, steps=state.steps), state.metrics
        )
        decided = any(m.get("event") == "rebalance" for m in state.metrics)
        out["rebalances"].value = display.safe_html(display.rebalance_html, state.metrics) if decided else ""
