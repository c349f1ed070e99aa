"""The Explorer: one notebook panel to step the search, read the theory, pin forms and ratios, edit the
cluster, read the Gantt chart, and verify or launch the plan.

>>> from hapnb.widgets import Explorer
>>> ex = Explorer("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)  # doctest: +SKIP
>>> ex  # the panel  # doctest: +SKIP
>>> ex.step(); ex.step_n(10); ex.run()  # same as the buttons  # doctest: +SKIP
>>> ex.set_pin("layers.0.weight", "G1")  # doctest: +SKIP
>>> ex.set_ratio("p100-0", 0.1)  # value + lock  # doctest: +SKIP
>>> ex.resynthesize().cost_s  # doctest: +SKIP

``Explorer(model_or_plan, cluster=None, *, pins=None, example_inputs=None, ratios=None, **zoo_options)``
takes what :class:`hapnb.session.Session` takes (a Plan, a Graph or Theory, an ``nn.Module`` with
``example_inputs``, or a zoo name with zoo options), or a Session itself. The panel is a view: every
button, slider and selector calls a method of ``ex.session`` and re-renders from its state, so whatever
a script does to the session, the panel shows after the next refresh (``ex.refresh()``).

Tabs
----
* **Search**: Step, Step xN, Run to next complete, Run and Reset; the frontier table, the last event
  (popped node, children, pruned children with reasons) and the search-tree drawing (root at the left)
  update after each. "Use best program" turns the best complete program into the current plan.
* **Triples**: the theory filtered by op / tensor / kind; triples enabled at the current search node
  are highlighted ("only enabled" hides the rest).
* **Pins**: a form per parameter/input ("auto" = let the search choose), a ratio slider + lock per
  device; every change re-plans (``Plan.replan(exact=False)``: the Q/B loop from the current plan's
  ratios, reusing what did not change) and shows the new cost
  and the diff to the previous plan ("re-plan on every change" off: the Re-synthesize button does it).
  "Why not?": the best plan with a chosen form for one tensor, its cost and where it differs, or why no
  program has that form (``Plan.why_not``); the current plan does not change.
* **Plan**: the plan (stages, memory), its Q/B history, and the bokeh Gantt chart (inline BokehJS in an
  iframe, no CDN); after a launch, measured step times are overlaid.
* **Cluster**: presets, per-device TFLOP/s and memory, per-collective latency and bandwidth (edits go
  to the session's draft cluster); Apply re-plans on it. "What bounds the step": the plan's sensitivity
  (``Plan.sensitivity``: what +10 % flop/s of each device or bandwidth of each collective would save, by
  the ratio LP's duals; computed when the tab is shown), and "What if?": one such change re-planned,
  its cost next to the duals' prediction.
* **Launch**: Verify (``hapnb.run.verify.verify``) and Launch (``hapnb.run.launch.launch``) with
  per-step time and loss streamed into a table; "re-balance live" lets the job move work off a straggler
  (``rebalance=True``) and "straggler" slows one rank down for a demo (``slowdown={rank: factor}``); a live
  chart shows each rank's step time, compute and time blocked in collectives per step, with the re-balances
  marked (:mod:`hapnb.widgets.launch_panel`).

State for scripts and tests lives in ``ex.session``; the panel subscribes to its change events
(:meth:`hapnb.session.Session.subscribe`) and re-renders the part that changed, whoever changed it: a button,
a script calling ``ex.session.set_pin(...)``, or another view. The session's state and verbs are readable
on the Explorer by name, without a copy (:data:`SESSION_STATE`: ``ex.plan``, ``ex.search``, ``ex.pins``,
...; :data:`SESSION_VERBS`: ``ex.step()``, ``ex.set_pin(...)``, ``ex.resynthesize()``, ``ex.verify()``,
...). The Explorer's own methods ask and show: ``why_not``, ``show_sensitivity``, ``what_if`` (their
answers render in the panel), ``filter_triples``, ``launch`` (follows the job) and ``refresh``.
``ex.last_error`` is the error the panel shows. Widgets are in ``ex.buttons[name]``, ``ex.controls[name]``
and ``ex.outputs[name]``. Methods raise on bad input; the buttons show the error in the panel instead.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as W

from hapnb import display
from hapnb.hardware.cluster import PRESETS, Cluster
from hapnb.ir.forms import Form
from hapnb.plans.explain import INTRA_MACHINE
from hapnb.plans.plan import Plan
from hapnb.session import AUTO, Change, Progress, Session

from .launch_panel import LaunchPanel

__all__ = ["Explorer", "SESSION_STATE", "SESSION_VERBS"]

#: the session's state the panel shows, readable on the Explorer by name (``ex.plan`` is ``ex.session.plan``)
SESSION_STATE = ("search", "plan", "previous_plan", "plans", "event", "current", "pins", "ratio_locks",
                 "cluster", "metrics", "measured", "rebalances", "theory", "graph")  # fmt: skip
#: the session's verbs, callable on the Explorer by name (``ex.step()`` is ``ex.session.step()``); the
#: panel follows every change through the session's change events, whoever made it
SESSION_VERBS = ("step", "step_n", "run_to_complete", "run", "reset", "select", "use_best", "enabled", "set_pin",
                 "set_ratio", "resynthesize", "set_cluster", "edit_device", "set_collective", "apply_cluster",
                 "verify", "stop")  # fmt: skip

GiB = 2**30
_CLUSTER_TAB = 4  # index of the Cluster tab (its sensitivity is computed when it is shown)


def _html(**layout: Any) -> W.HTML:
    return W.HTML(value="", layout=W.Layout(width="100%", **layout))


def _scroll(inner: str) -> str:
    """A box that scrolls sideways on its own. ``contain:inline-size`` keeps a wide table or drawing from
    widening the widget (so text wraps at the widget's width instead of running out of view), and the
    box opens at its left edge."""
    return f"<div style='contain:inline-size;overflow-x:auto;white-space:normal'>{inner}</div>"


class Explorer:
    """Interactive synthesis panel over a :class:`~hapnb.session.Session`; see the module docstring."""

    def __init__(
        self,
        model_or_plan: Any,
        cluster: Cluster | str | None = None,
        *,
        pins: Mapping[str, Form | str] | None = None,
        example_inputs: Sequence[Any] | None = None,
        ratios: Mapping[str, float] | None = None,
        loss: Any = None,
        max_iterations: int = 10,
        **zoo_options: Any,
    ) -> None:
        if isinstance(model_or_plan, Session):
            extra = [
                k
                for k, v in dict(
                    cluster=cluster, pins=pins, example_inputs=example_inputs, ratios=ratios, loss=loss
                ).items()
                if v is not None
            ] + list(zoo_options)
            if extra:
                raise ValueError(f"Explorer(session) takes no other arguments; got {', '.join(extra)}")
            self.session = model_or_plan
        else:
            self.session = Session(
                model_or_plan,
                cluster,
                pins=pins,
                example_inputs=example_inputs,
                ratios=ratios,
                loss=loss,
                max_iterations=max_iterations,
                **zoo_options,
            )
        self.last_error: BaseException | None = None
        self._syncing = False
        self._launch_thread: threading.Thread | None = None
        self.launch_panel = LaunchPanel(self)
        self.buttons: dict[str, W.Button] = {}
        self.controls: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.widget = self._build()
        self.refresh()
        self.session.subscribe(self._on_change)

    # ============================================================================ the session, by name
    def __getattr__(self, name: str) -> Any:
        """The session's state and verbs by name (:data:`SESSION_STATE`, :data:`SESSION_VERBS`):
        ``ex.plan`` is ``ex.session.plan``, ``ex.step()`` is ``ex.session.step()``."""
        if name in SESSION_STATE or name in SESSION_VERBS:
            return getattr(self.session, name)
        raise AttributeError(f"'Explorer' object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *SESSION_STATE, *SESSION_VERBS})

    def _on_change(self, change: Change) -> None:
        """The session changed (whoever changed it): re-render what shows that part of its state."""
        try:
            kind = change.kind
            if kind == "search":
                self._refresh_search()
            elif kind == "plan":
                self.refresh()
            elif kind == "pins":
                self._sync_pins()
                self._refresh_header()
            elif kind == "ratios":
                self._sync_ratios()
            elif kind in ("draft", "cluster"):
                self._sync_cluster_fields()
            elif kind == "busy":
                if change.text:
                    self.controls["progress_label"].value = html.escape(change.text)
                else:
                    self._refresh_status()
            elif kind == "progress" and change.progress is not None:
                self._progress(change.progress)
            elif kind in ("verify", "job", "rebalance"):
                self.launch_panel.on_change(change)
                if kind == "job" and self.session.poll().result is not None:
                    self._refresh_plan()  # the measured overlay
        except Exception as e:  # noqa: BLE001 - a view never breaks the session's verb; shown in the panel
            self._error(e)

    # ============================================================================ questions
    def why_not(self, pins: Mapping[str, Form | str] | None = None) -> Any:
        """Why the plan does not use these forms (default: the "Why not?" tensor and form fields): shows
        and returns the session's :class:`hapnb.plans.whynot.WhyNot`; the plan does not change."""
        if pins is None:
            pins = {self.controls["why_tensor"].value: self.controls["why_form"].value}
        self.controls["progress_label"].value = "re-planning with the pins..."
        try:
            answer = self.session.why_not(pins)
        finally:
            self._refresh_status()
        self.outputs["why_not"].value = _scroll(display.safe_html(display.why_not_html, answer))
        return answer

    def show_sensitivity(self) -> Any:
        """Compute and show what bounds the plan's step (the Cluster tab does when it is shown)."""
        sens = self.session.sensitivity()
        self.outputs["sensitivity"].value = _scroll(display.safe_html(display.sensitivity_html, sens))
        self._sensitivity_of = self.plan
        return sens

    def what_if(
        self,
        change: str | None = None,
        percent: float | None = None,
    ) -> Any:
        """Re-plan with one device, collective kind or the intra-machine link faster by ``percent`` %
        (defaults: the "What if?" fields; ``change`` is a device name, a collective kind or
        ``"intra-machine"``) and show the re-planned cost next to the duals' prediction."""
        change = self.controls["what_if"].value if change is None else change
        percent = float(self.controls["what_if_pct"].value if percent is None else percent)
        kw: dict[str, Any] = {"factor": 1.0 + percent / 100.0}
        if change in self.cluster.names:
            kw["device"] = change
        elif change == INTRA_MACHINE:
            kw["link"] = True
        else:
            kw["collective"] = change
        self.controls["progress_label"].value = "re-planning..."
        try:
            answer = self.session.what_if(**kw)
        finally:
            self._refresh_status()
        self.outputs["what_if"].value = display.safe_html(display.what_if_html, answer)
        return answer

    # ============================================================================ triples
    def filter_triples(
        self,
        op: str | None = None,
        tensor: str | None = None,
        kind: str | None = None,
        only_enabled: bool = False,
    ) -> str:
        """Set the triple browser's filters; returns the table's HTML."""
        self._syncing = True
        try:
            self.controls["triple_op"].value = op
            self.controls["triple_tensor"].value = tensor
            self.controls["triple_kind"].value = kind
            self.controls["only_enabled"].value = only_enabled
        finally:
            self._syncing = False
        self._refresh_triples()
        return self.outputs["triples"].value

    # ============================================================================ launch
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
        """Launch the plan and stream per-step time and loss, and the live chart, into the panel; returns
        the job. Every ``None`` argument comes from the Launch tab's controls: ``rebalance`` (re-balance
        the ratios live when a rank straggles, ``True`` or :class:`hapnb.run.rebalance.RebalanceOptions`
        fields), ``slowdown`` (``{rank: factor}``: a straggler for a demo). Other ``options`` go to
        :meth:`hapnb.session.Session.launch` (``dtype``, ``timeout_s``, ...). ``wait=False`` follows the job
        in a background thread (the Launch button does this)."""
        return self.launch_panel.launch(
            nproc, steps, wait=wait, rebalance=rebalance, slowdown=slowdown, **options
        )

    # ============================================================================ building
    def _button(self, key: str, description: str, handler: Callable[[], Any], **kw: Any) -> W.Button:
        b = W.Button(description=description, layout=W.Layout(width="auto"), **kw)

        def click(_: Any) -> None:
            self._guarded(handler)

        b.on_click(click)
        self.buttons[key] = b
        return b

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        try:
            self.last_error = None
            self.outputs["status"].value = ""
            return fn()
        except Exception as e:  # noqa: BLE001 - a control never raises; the error is shown in the panel
            self._error(e)
            return None

    def _error(self, e: BaseException) -> None:
        self.last_error = e
        self.outputs[
            "status"
        ].value = (
            f"<span style='color:#a00'><b>{html.escape(type(e).__name__)}</b>: {html.escape(str(e))}</span>"
        )

    def _observe(self, widget: Any, fn: Callable[[Any], Any]) -> None:
        """Call ``fn(new value)`` (guarded) when the user changes ``widget``, not when the view syncs it."""

        def handler(ch: Any) -> None:
            if not self._syncing:
                self._guarded(lambda: fn(ch["new"]))

        widget.observe(handler, names="value")

    def _build(self) -> W.Widget:
        c = self.controls
        self.outputs["status"] = _html()
        self.outputs["header"] = _html()
        c["progress"] = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="240px", flex="0 0 auto"))
        # an HTML line, not a Label: a Label never wraps and clips its text with an ellipsis
        c["progress_label"] = W.HTML(value="", layout=W.Layout(flex="1 1 0%", min_width="12em"))
        tabs = [
            ("Search", self._build_search()),
            ("Triples", self._build_triples()),
            ("Pins", self._build_pins()),
            ("Plan", self._build_plan()),
            ("Cluster", self._build_cluster()),
            ("Launch", self.launch_panel.build()),
        ]
        tab = W.Tab(children=[w for _, w in tabs])
        for i, (t, _) in enumerate(tabs):
            tab.set_title(i, t)
        c["tabs"] = tab
        tab.observe(lambda ch: self._guarded(self._refresh_sensitivity), names="selected_index")
        return W.VBox(
            [
                self.outputs["header"],
                W.HBox(
                    [c["progress"], c["progress_label"]],
                    layout=W.Layout(flex_flow="row wrap", align_items="center", width="100%"),
                ),
                self.outputs["status"],
                tab,
            ]
        )

    def _build_search(self) -> W.Widget:
        c = self.controls
        c["step_n"] = W.BoundedIntText(
            value=10, min=1, max=1_000_000, description="N", layout=W.Layout(width="140px")
        )
        c["node"] = W.BoundedIntText(
            value=0, min=0, max=10**9, description="node", layout=W.Layout(width="160px")
        )
        c["depth"] = W.BoundedIntText(
            value=2, min=0, max=6, description="depth", layout=W.Layout(width="140px")
        )
        self._observe(c["node"], lambda v: self.session.select(int(v)))
        self._observe(c["depth"], lambda _: self._refresh_tree())
        row = W.HBox(
            [
                self._button("step", "Step", lambda: self.session.step(), icon="step-forward"),
                self._button("step_n", "Step ×N", lambda: self.session.step_n(int(c["step_n"].value))),
                c["step_n"],
                self._button(
                    "run_to_complete", "Run to next complete", lambda: self.session.run_to_complete()
                ),
                self._button("run", "Run", lambda: self.session.run(), icon="play"),
                self._button("reset", "Reset", lambda: self.session.reset(), icon="refresh"),
                self._button("use_best", "Use best program", lambda: self.session.use_best()),
            ],
            layout=W.Layout(flex_flow="row wrap"),
        )
        # one below the other, each the tab's full width (side by side, each got half and clipped)
        self.outputs["search"] = _html()
        self.outputs["tree"] = _html()
        return W.VBox(
            [row, W.HBox([c["node"], c["depth"]]), self.outputs["search"], self.outputs["tree"]],
            layout=W.Layout(width="100%"),
        )

    def _build_triples(self) -> W.Widget:
        c = self.controls
        g = self.graph
        c["triple_op"] = W.Dropdown(
            options=[("all ops", None)] + [(o.name, o.name) for o in g.ops], description="op"
        )
        c["triple_tensor"] = W.Dropdown(
            options=[("all tensors", None)] + [(t.name, t.name) for t in g.tensors], description="tensor"
        )
        c["triple_kind"] = W.Dropdown(
            options=[
                ("all kinds", None),
                ("compute", "compute"),
                ("load", "load"),
                ("collective", "collective"),
            ],
            description="kind",
        )
        c["only_enabled"] = W.Checkbox(value=False, description="only enabled at the node", indent=False)
        c["words"] = W.Checkbox(value=False, description="paper's words", indent=False)
        for k in ("triple_op", "triple_tensor", "triple_kind", "only_enabled", "words"):
            self._observe(c[k], lambda _: self._refresh_triples())
        self.outputs["triples"] = _html()
        return W.VBox(
            [
                W.HBox(
                    [c["triple_op"], c["triple_tensor"], c["triple_kind"]],
                    layout=W.Layout(flex_flow="row wrap"),
                ),
                W.HBox([c["only_enabled"], c["words"]]),
                self.outputs["triples"],
            ]
        )

    def _build_pins(self) -> W.Widget:
        c = self.controls
        rows = []
        for name in self.session.pinnable():
            dd = W.Dropdown(
                options=self.session.pin_options(name),
                value=self.session.pins.get(name, AUTO),
                description=name,
                style={"description_width": "initial"},
                layout=W.Layout(width="auto"),
            )
            self._observe(dd, lambda v, name=name: self._on_pin(name, v))
            c[f"pin:{name}"] = dd
            rows.append(dd)
        c["auto_resynth"] = W.Checkbox(value=True, description="re-plan on every change", indent=False)
        names = list(self.session.pinnable())
        c["why_tensor"] = W.Dropdown(options=names, description="why not", layout=W.Layout(width="auto"))
        c["why_form"] = W.Dropdown(
            options=self.session.pin_options(names[0])[1:] if names else [], layout=W.Layout(width="90px")
        )
        self._observe(c["why_tensor"], self._on_why_tensor)
        self.outputs["why_not"] = _html()
        self.outputs["ratio_rows"] = W.VBox()
        self._build_ratio_rows()
        self.outputs["locks"] = _html()
        self.outputs["diff"] = _html()
        return W.VBox(
            [
                W.HTML("<b>Form pins</b> (auto = the search chooses)"),
                W.Box(
                    rows,
                    layout=W.Layout(
                        display="flex", flex_flow="row wrap", max_height="260px", overflow="auto"
                    ),
                ),
                W.HTML(
                    "<b>Sharding ratios</b> (moving a slider locks it; locked ratios are pinned in the LP)"
                ),
                self.outputs["ratio_rows"],
                self.outputs["locks"],
                W.HBox(
                    [
                        self._button(
                            "resynthesize", "Re-synthesize", lambda: self.session.resynthesize(), icon="cogs"
                        ),
                        c["auto_resynth"],
                    ]
                ),
                self.outputs["diff"],
                W.HTML("<b>Why not?</b> the best plan with one more pin (the plan does not change)"),
                W.HBox([c["why_tensor"], c["why_form"], self._button("why_not", "Why not?", self.why_not)]),
                self.outputs["why_not"],
            ]
        )

    def _on_why_tensor(self, name: str) -> None:
        self.controls["why_form"].options = self.session.pin_options(name)[1:]

    def _on_pin(self, name: str, value: str) -> None:
        self.session.set_pin(name, value)
        if self.controls["auto_resynth"].value:
            self.session.resynthesize()

    def _on_ratio(self, device: str, value: float | None = None, lock: bool = True) -> None:
        if value is None:
            value = float(self.controls[f"ratio:{device}"].value)
        self.session.set_ratio(device, value, lock=lock)
        if lock and self.controls["auto_resynth"].value:
            self.session.resynthesize()

    def _build_ratio_rows(self) -> None:
        c = self.controls
        for k in [k for k in c if k.startswith(("ratio:", "lock:"))]:
            del c[k]
        rows = []
        values, locks = self.session.ratio_values, self.session.ratio_locks
        for d in self.cluster.names:
            s = W.FloatSlider(
                value=values[d], min=0.0, max=1.0, step=0.001, readout_format=".3f", description=d,
                continuous_update=False, style={"description_width": "initial"}, layout=W.Layout(width="420px"),
            )  # fmt: skip
            lock = W.Checkbox(value=d in locks, description="lock", indent=False)
            self._observe(s, lambda v, d=d: self._on_ratio(d, float(v), lock=True))
            self._observe(lock, lambda v, d=d: self._on_ratio(d, lock=bool(v)))
            c[f"ratio:{d}"] = s
            c[f"lock:{d}"] = lock
            rows.append(W.HBox([s, lock]))
        self.outputs["ratio_rows"].children = rows
        self._ratio_names = self.cluster.names

    def _build_plan(self) -> W.Widget:
        self.outputs["plan"] = _html()
        self.outputs["gantt"] = _html()
        self.outputs["history"] = _html()
        acc = W.Accordion(children=[self.outputs["plan"], self.outputs["history"]])
        acc.set_title(0, "plan")
        acc.set_title(1, "Q/B history")
        acc.selected_index = 0
        return W.VBox([self.outputs["gantt"], acc])

    def _build_cluster(self) -> W.Widget:
        c = self.controls
        c["preset"] = W.Dropdown(options=["(current)", *PRESETS], value="(current)", description="preset")
        c["spec"] = W.Text(
            value="", placeholder="2xV100+6xP100 or a JSON path", description="spec", continuous_update=False
        )
        self._observe(
            c["preset"], lambda v: self.session.set_cluster(v, apply=False) if v != "(current)" else None
        )
        self.outputs["cluster_fields"] = W.VBox()
        self._build_cluster_fields()
        self.outputs["draft"] = _html()
        self.outputs["cluster"] = _html()
        self.outputs["sensitivity"] = _html()
        self.outputs["what_if"] = _html()
        c["what_if"] = W.Dropdown(
            options=self._what_if_options(), description="what if", layout=W.Layout(width="auto")
        )
        c["what_if_pct"] = W.FloatText(value=10.0, description="faster %", layout=W.Layout(width="160px"))
        self._sensitivity_of: Plan | None = None
        return W.VBox(
            [
                W.HBox([c["preset"], c["spec"], self._button("load_spec", "Load", self._load_spec)]),
                self.outputs["cluster_fields"],
                self.outputs["draft"],
                self._button(
                    "apply_cluster", "Apply (re-plan)", lambda: self.session.apply_cluster(), icon="check"
                ),
                self.outputs["cluster"],
                self.outputs["sensitivity"],
                W.HBox([c["what_if"], c["what_if_pct"], self._button("what_if", "What if?", self.what_if)]),
                self.outputs["what_if"],
            ]
        )

    def _what_if_options(self) -> list[str]:
        cl = self.cluster
        return [*cl.names, *(k for k, _ in cl.collectives)] + (
            [INTRA_MACHINE] if any(d.gpus > 1 for d in cl.devices) else []
        )

    def _load_spec(self) -> None:
        spec = self.controls["spec"].value.strip()
        if not spec:
            raise ValueError("type a cluster spec (e.g. 2xV100+6xP100), a preset name or a JSON path first")
        self.session.set_cluster(spec, apply=False)

    def _build_cluster_fields(self) -> None:
        """One row per device (TFLOP/s, GiB) and per collective (GB/s, latency) of the draft cluster."""
        c = self.controls
        s = self.session
        cl = s.draft
        for k in [k for k in c if k.startswith(("flops:", "memory:", "bw:", "lat:"))]:
            del c[k]
        rows: list[W.Widget] = []
        for d in cl.devices:
            f = W.FloatText(description="TFLOP/s", layout=W.Layout(width="200px"))
            m = W.FloatText(description="GiB", layout=W.Layout(width="180px"))
            self._observe(f, lambda v, n=d.name: s.edit_device(n, flops=float(v) * 1e12))
            self._observe(m, lambda v, n=d.name: s.edit_device(n, memory_bytes=float(v) * GiB))
            c[f"flops:{d.name}"], c[f"memory:{d.name}"] = f, m
            rows.append(
                W.HBox([W.Label(f"{d.name} ({d.kind}, {d.machine})", layout=W.Layout(width="220px")), f, m])
            )
        for k, _ in cl.collectives:
            bw = W.FloatText(description="GB/s", layout=W.Layout(width="200px"))
            lat = W.FloatText(description="latency us", layout=W.Layout(width="220px"))
            self._observe(bw, lambda v, k=k: s.set_collective(k, bandwidth_Bps=float(v) * 1e9))
            self._observe(lat, lambda v, k=k: s.set_collective(k, latency_s=float(v) * 1e-6))
            c[f"bw:{k}"], c[f"lat:{k}"] = bw, lat
            rows.append(W.HBox([W.Label(k, layout=W.Layout(width="220px")), bw, lat]))
        self.outputs["cluster_fields"].children = rows
        self._field_names = (cl.names, tuple(k for k, _ in cl.collectives))

    # ============================================================================ syncing controls
    def _sync(self, widget: Any, value: Any) -> None:
        """Set a control to the session's value without firing its observer."""
        self._syncing = True
        try:
            widget.value = value
        finally:
            self._syncing = False

    def _sync_pins(self) -> None:
        pins = self.session.pins
        for name in self.session.pinnable():
            dd = self.controls[f"pin:{name}"]
            value = pins.get(name, AUTO)
            if dd.value != value and value in dd.options:
                self._sync(dd, value)

    def _sync_ratios(self) -> None:
        if self._ratio_names != self.cluster.names:
            self._build_ratio_rows()
        values, locks = self.session.ratio_values, self.session.ratio_locks
        for d in self.cluster.names:
            self._sync(self.controls[f"ratio:{d}"], values[d])
            self._sync(self.controls[f"lock:{d}"], d in locks)
        text = ", ".join(f"{d}={v:.3f}" for d, v in locks.items()) or "none"
        self.outputs["locks"].value = f"<div>locked ratios: {html.escape(text)}</div>"

    def _sync_cluster_fields(self) -> None:
        cl = self.session.draft
        if self._field_names != (cl.names, tuple(k for k, _ in cl.collectives)):
            self._build_cluster_fields()
        c = self.controls
        for d in cl.devices:
            self._sync(c[f"flops:{d.name}"], round(d.flops / 1e12, 6))
            self._sync(c[f"memory:{d.name}"], round(d.memory_bytes / GiB, 4))
        for k, col in cl.collectives:
            self._sync(c[f"bw:{k}"], round(col.bandwidth_Bps / 1e9, 6))
            self._sync(c[f"lat:{k}"], round(col.latency_s * 1e6, 6))
        self._show_draft()

    def _show_draft(self) -> None:
        s = self.session
        if not s.draft_pending:
            self.outputs["draft"].value = ""
            return
        items = "".join(f"<li>{html.escape(line)}</li>" for line in s.draft_changes)
        self.outputs[
            "draft"
        ].value = f"<div>draft <b>{html.escape(s.draft.name)}</b>, not applied yet:<ul>{items}</ul></div>"

    def _progress(self, p: Progress) -> None:
        bar = self.controls["progress"]
        if p.total:
            bar.max = max(p.total, 1)
            bar.value = min(p.done, bar.max)
        else:  # unknown total: cycle
            bar.max = 100
            bar.value = p.done % 100
        self.controls["progress_label"].value = html.escape(p.text)

    # ============================================================================ rendering
    def refresh(self) -> None:
        """Re-render every view from the session's state."""
        self._sync_pins()
        self._sync_ratios()
        self._sync_cluster_fields()
        self._refresh_search()
        self._refresh_plan()
        self.outputs["cluster"].value = _scroll(display.safe_html(display.cluster_html, self.cluster))
        if list(self.controls["what_if"].options) != self._what_if_options():
            self.controls["what_if"].options = self._what_if_options()
        self._refresh_sensitivity()
        if self._nproc_cluster != self.cluster:  # one rank per GPU of the applied cluster
            self._nproc_cluster = self.cluster
            self._sync(self.controls["nproc"], self.cluster.gpus)
        self.launch_panel.show_job(self.session.poll())

    def _refresh_sensitivity(self) -> None:
        """The sensitivity of the current plan, computed when the Cluster tab is shown (it solves LPs)."""
        if self._sensitivity_of is self.plan:
            return
        if self.controls["tabs"].selected_index == _CLUSTER_TAB:
            self.show_sensitivity()
        else:
            self.outputs["sensitivity"].value = "<div>(what bounds the step: shown with this tab)</div>"

    def _refresh_header(self) -> None:
        p, cl, pins = self.plan, self.cluster, self.session.pins
        self.outputs["header"].value = (
            f"<b>hapnb Explorer</b>: {html.escape(p.name)} on {html.escape(cl.name)} "
            f"({cl.n} devices): <b>{p.cost_s * 1e3:.4g} ms</b>/iteration, {len(p.stages)} stages"
            + (f"; pins {html.escape(', '.join(f'{k}={v}' for k, v in pins.items()))}" if pins else "")
        )

    def _refresh_status(self) -> None:
        self.controls["progress_label"].value = html.escape(self.session.status)

    def _refresh_search(self) -> None:
        s = self.session
        self.outputs["search"].value = _scroll(display.safe_html(display.search_html, s.search, s.event))
        self._sync(self.controls["node"], s.current)
        self._refresh_status()
        self._refresh_tree()
        self._refresh_triples()

    def _refresh_tree(self) -> None:
        s = self.session
        depth = int(self.controls["depth"].value)
        ev = s.event if s.event is not None and getattr(s.event.popped, "id", None) == s.current else None
        try:
            # left to right: the root sits at the drawing's left edge, where the scroll box opens
            dot = display.search_tree_dot(s.search, around=s.current, depth=depth, event=ev, rankdir="LR")
            pic = display.svg(dot)
            body = pic if pic else f"<pre>{html.escape(dot.source)}</pre>"
        except Exception as e:  # noqa: BLE001 - the drawing is optional
            body = f"<pre>(no tree drawing: {html.escape(type(e).__name__)}: {html.escape(str(e))})</pre>"
        self.outputs["tree"].value = _scroll(body)

    def _refresh_triples(self) -> None:
        c = self.controls
        hl = self.session.enabled()
        self.outputs["triples"].value = _scroll(
            display.safe_html(
                display.theory_html,
                self.theory,
                c["triple_op"].value,
                c["triple_tensor"].value,
                hl,
                kind=c["triple_kind"].value,
                words=c["words"].value,
                only=hl if c["only_enabled"].value else None,
            )
        )

    def _refresh_plan(self) -> None:
        p, prev = self.plan, self.previous_plan
        self._refresh_header()
        note = self.session.memory_note
        warn = f"<div style='color:#b00'>{html.escape(note)}</div>" if note else ""
        self.outputs["plan"].value = warn + _scroll(display.safe_html(display.plan_html, p))
        self.outputs["history"].value = _scroll(display.safe_html(display.history_html, p))
        if prev is not None:
            self.outputs["diff"].value = _scroll(display.safe_html(display.plan_diff_html, prev, p))
        self.outputs["gantt"].value = display.gantt_frame(self.plan, self.measured)

    # ============================================================================ display
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        return f"Explorer({self.plan.name} on {self.cluster.name}: plan {self.plan.cost_s * 1e3:.4g} ms, {self.search!r})"
