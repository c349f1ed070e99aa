"""The Explorer: one notebook panel to step the search, read the theory, pin forms and ratios, edit the
cluster, read the Gantt chart, and verify or launch the plan.

>>> from hapnb.widgets import Explorer
>>> ex = Explorer("mlp", "2xV100+2xP100", layers=2, hidden=64, batch=16)  # doctest: +SKIP
>>> ex                                   # doctest: +SKIP   (the panel)
>>> ex.step(); ex.step_n(10); ex.run()   # doctest: +SKIP   (same as the buttons)
>>> ex.set_pin("layers.0.weight", "G1")  # doctest: +SKIP
>>> ex.set_ratio("p100-0", 0.1)          # doctest: +SKIP   (value + lock)
>>> ex.resynthesize().cost_s             # doctest: +SKIP

``Explorer(model_or_plan, cluster=None, *, pins=None, example_inputs=None, ratios=None, **zoo_options)``
accepts a :class:`~hapnb.plan.Plan` (its graph is needed for the search; a plan loaded from JSON is
rebuilt from its recorded zoo model when possible), a Graph or Theory, an ``nn.Module`` with
``example_inputs``, or a zoo name with zoo options (``layers=2, hidden=64``).

Tabs
----
* **Search**: Step, Step xN, Run to next complete, Run and Reset; the frontier table, the last event
  (popped node, children, pruned children with reasons) and the search-tree drawing update after each.
  "Use best program" turns the best complete program into the current plan.
* **Triples**: the theory filtered by op / tensor / kind; triples enabled at the current search node
  are highlighted ("only enabled" hides the rest).
* **Pins**: a form per parameter/input ("auto" = let the search choose), a ratio slider + lock per
  device, Re-synthesize (new cost and the diff to the previous plan).
* **Plan**: the plan (stages, memory), its Q/B history, and the bokeh Gantt chart (inline BokehJS in an
  iframe, no CDN); after a launch, measured step times are overlaid.
* **Cluster**: presets, per-device TFLOP/s and memory, per-collective latency and bandwidth; Apply
  re-synthesizes on the edited cluster.
* **Launch**: Verify (``hapnb.runtime.verify``) and Launch (``hapnb.launch.launch``) with per-step time
  and loss streamed into a table.

State for scripts and tests: ``ex.search``, ``ex.plan``, ``ex.previous_plan``, ``ex.plans`` (all plans
made), ``ex.event`` (last search event), ``ex.current`` (selected node id), ``ex.pins``,
``ex.ratio_locks``, ``ex.cluster``, ``ex.metrics``, ``ex.last_error``; widgets in ``ex.buttons[name]``,
``ex.controls[name]`` and ``ex.outputs[name]``. Methods: ``step``, ``step_n``, ``run_to_complete``,
``run``, ``reset``, ``select``, ``use_best``, ``set_pin``, ``set_ratio``, ``resynthesize``,
``set_cluster``, ``edit_device``, ``set_collective``, ``apply_cluster``, ``verify``, ``launch``,
``filter_triples``. Methods raise on bad input; the buttons show the error in the panel instead.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as W

from hapnb import display
from hapnb.cluster import PRESETS, Cluster, Collective
from hapnb.forms import Form, parse_form
from hapnb.plan import Plan
from hapnb.search import NoProgramError, Search
from hapnb.triples import Theory, theory

__all__ = ["Explorer"]

GiB = 2**30
AUTO = "auto"


def _html(value: str = "") -> W.HTML:
    return W.HTML(value=value, layout=W.Layout(width="100%", overflow="auto"))


class Explorer:
    """Interactive synthesis panel; see the module docstring for the tabs and the programmatic API."""

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
        self.max_iterations = max_iterations
        self.last_error: BaseException | None = None
        self.metrics: list[dict[str, Any]] = []
        self.measured: list[float] = []
        self.plans: list[Plan] = []
        self.previous_plan: Plan | None = None
        self.event: Any = None
        self.current = 0
        self._syncing = False
        self._launch_thread: threading.Thread | None = None
        self._job: Any = None
        self._model_spec: Any = None
        plan = self._resolve(model_or_plan, cluster, example_inputs, loss, zoo_options)
        self.pins: dict[str, str] = {
            k: str(parse_form(v) if isinstance(v, str) else v) for k, v in (pins or {}).items()
        }
        if plan is not None and not pins:
            self.pins = dict(plan.pins)
        self.ratio_locks: dict[str, float] = dict(ratios or {})
        if plan is None:
            plan = self._synthesize()
        self.plan: Plan = plan
        self.plans.append(plan)
        self.search: Search = self._new_search()
        self.buttons: dict[str, W.Button] = {}
        self.controls: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.widget = self._build()
        self._refresh_all()

    # ============================================================================ model resolution
    def _resolve(
        self, obj: Any, cluster: Any, example_inputs: Any, loss: Any, zoo_options: dict[str, Any]
    ) -> Plan | None:
        from hapnb.tracing import resolve_model

        plan = None
        if isinstance(obj, Plan):
            plan = obj
            self.cluster = plan.cluster if cluster is None else Cluster.resolve(cluster)
            graph = plan.graph
            self._model_spec = plan.model or None
            if graph is None and plan.model_spec:
                graph = self._rebuild_graph(plan)
            if graph is None:
                raise ValueError(
                    f"Explorer: plan {plan.name!r} has no traced graph (it was loaded from JSON) and its "
                    "model "
                    "could not be rebuilt; pass the Graph, the nn.Module with example_inputs, or the zoo name"
                )
            self.theory = theory(graph)
        else:
            if cluster is None:
                raise ValueError(
                    "Explorer needs a cluster for a model or graph: e.g. Explorer(model, '2xV100+2xP100')"
                )
            self.cluster = Cluster.resolve(cluster)
            if isinstance(obj, Theory):
                self.theory = obj
            else:
                graph, spec = resolve_model(obj, self.cluster, example_inputs, loss, **zoo_options)
                self.theory = theory(graph)
                if spec:
                    from hapnb.plan import freeze_mapping

                    self._model_spec = freeze_mapping(spec)
        self.graph = self.theory.graph
        return plan

    @staticmethod
    def _rebuild_graph(plan: Plan) -> Any:
        try:
            from hapnb import zoo
            from hapnb.graph import trace

            spec = zoo.ModelSpec.from_json(plan.model_spec)
            model, inputs, _ = zoo.build_spec(spec)
            g = trace(model, inputs, name=plan.name)
            return g if g.fingerprint == plan.graph_fingerprint else None
        except Exception:  # noqa: BLE001 - the caller explains what to pass instead
            return None

    # ============================================================================ state helpers
    def _form_pins(self) -> dict[str, Form]:
        return {k: parse_form(v) for k, v in self.pins.items() if v and v != AUTO}

    def _synthesize(self) -> Plan:
        from hapnb.synthesis import synthesize

        ratios = dict(self.ratio_locks) or None
        plan = synthesize(
            self.theory,
            self.cluster,
            pins=self._form_pins(),
            ratios=ratios,
            max_iterations=self.max_iterations,
            check_memory=False,  # the plan view marks devices over their memory instead
        )
        if self._model_spec:
            plan = dataclasses.replace(plan, model=self._model_spec)
        return plan

    def _new_search(self) -> Search:
        ratios = self.plan.ratios if self.plan.cluster == self.cluster else None
        return Search(self.theory, self.cluster, ratios=ratios, pins=self._form_pins())

    # ============================================================================ search API
    def step(self) -> Any:
        """Expand one node of the search (the Step button); returns the SearchEvent."""
        ev = self.search.step()
        self._after_step(ev)
        self._refresh_search()
        return ev

    def step_n(self, n: int | None = None) -> Any:
        """Expand ``n`` nodes (default: the "N" field), refreshing the views once at the end."""
        n = int(self.controls["step_n"].value if n is None else n)
        ev = None
        bar = self.controls["progress"]
        bar.max, bar.value = max(n, 1), 0
        for k in range(n):
            if self.search.done:
                break
            ev = self.search.step()
            self._after_step(ev)
            if k % 25 == 0:
                bar.value = k
        bar.value = bar.max
        self._refresh_search()
        return ev

    def run_to_complete(self, max_steps: int = 100_000) -> Any:
        """Step until an expansion produces a complete program (or the search is done)."""
        bar = self.controls["progress"]
        bar.max, bar.value = 100, 0
        ev = None
        for k in range(max_steps):
            if self.search.done:
                break
            ev = self.search.step()
            self._after_step(ev)
            if k % 50 == 0:
                bar.value = k % 100
            if any(c.complete for c in ev.children):
                break
        bar.value = bar.max
        self._refresh_search()
        return ev

    def run(self, chunk: int = 200, max_seconds: float | None = None) -> Any:
        """Run the search to the end (the best program proven optimal), in chunks with progress."""
        t0 = time.perf_counter()
        bar = self.controls["progress"]
        label = self.controls["progress_label"]
        bar.value = 0
        while not self.search.done:
            try:
                self.search.run(max_expansions=chunk, dives=0)
            except NoProgramError:
                if self.search.done:
                    raise
            st = self.search.stats
            bar.max = max(bar.max, st["expansions"] + st["frontier"], 1)
            bar.value = min(st["expansions"], bar.max)
            label.value = f"{st['expansions']} expansions, frontier {st['frontier']}"
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
        bar.value = bar.max
        self.event = None
        best = self.search.best
        self.current = best.id if best is not None else self.current
        self._refresh_search()
        return best

    def reset(self) -> Search:
        """A fresh search at the current plan's ratios and the current pins."""
        self.search = self._new_search()
        self.event = None
        self.current = 0
        self._refresh_search()
        return self.search

    def select(self, node_id: int) -> None:
        """Centre the tree drawing and the triple highlighting on one search node."""
        self.search.node(node_id)  # raises IndexError for an unknown id
        self.current = int(node_id)
        self._syncing = True
        try:
            self.controls["node"].value = self.current
        finally:
            self._syncing = False
        self._refresh_search()

    def use_best(self) -> Plan:
        """Make the search's best complete program (at the search's ratios) the current plan."""
        from hapnb.plan import make_plan

        best = self.search.best
        if best is None:
            raise RuntimeError("the search has no complete program yet: press Run or Run to next complete")
        plan = make_plan(
            self.theory,
            self.cluster,
            self.search.program(best.id),
            self.search.final_conversions(best.id),
            self.search.ratios,
            pins=self._form_pins(),
            stats=self.search.stats,
            model=dict(self._model_spec) if self._model_spec else None,
        )
        self._set_plan(plan)
        return plan

    def _after_step(self, ev: Any) -> None:
        self.event = ev
        if ev.popped is not None:
            self.current = ev.popped.id

    # ============================================================================ pins API
    def set_pin(self, name: str, form: Form | str | None) -> None:
        """Pin tensor ``name`` to ``form`` (``"G1"``, ``hapnb.Shard(1)``, ...); ``None``/"auto" unpins."""
        value = (
            AUTO if form is None or form == AUTO else str(parse_form(form) if isinstance(form, str) else form)
        )
        dd = self.controls.get(f"pin:{name}")
        if dd is None:
            raise KeyError(
                f"no pin control for {name!r}: pins are offered for parameters and inputs "
                f"({', '.join(list(self._pinnable())[:8])}, ...)"
            )
        if value not in dd.options:
            raise ValueError(f"{name} cannot take the form {value}; valid: {', '.join(dd.options)}")
        dd.value = value  # the observer updates self.pins
        self._store_pin(name, value)

    def _store_pin(self, name: str, value: str) -> None:
        if value == AUTO:
            self.pins.pop(name, None)
        else:
            self.pins[name] = value

    def set_ratio(self, device: str, value: float, lock: bool = True) -> None:
        """Set a device's ratio slider and (by default) lock it, so re-synthesis keeps that ratio."""
        if device not in self.cluster.names:
            raise KeyError(f"no device {device!r}; devices: {', '.join(self.cluster.names)}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"ratio of {device} must be in [0, 1], got {value}")
        self._syncing = True
        try:
            self.controls[f"ratio:{device}"].value = float(value)
            self.controls[f"lock:{device}"].value = bool(lock)
        finally:
            self._syncing = False
        if lock:
            self.ratio_locks[device] = float(value)
        else:
            self.ratio_locks.pop(device, None)
        self._show_locks()

    def resynthesize(self) -> Plan:
        """Re-run ``synthesize`` with the pins, locked ratios and cluster; shows the cost and the diff."""
        self._busy("synthesizing...")
        try:
            plan = self._synthesize()
        finally:
            self._busy("")
        self._set_plan(plan)
        return plan

    def _set_plan(self, plan: Plan) -> None:
        self.previous_plan = self.plan
        self.plan = plan
        self.plans.append(plan)
        self.measured = []
        self._sync_ratio_sliders()
        self.search = self._new_search()
        self.event = None
        self.current = 0
        self._refresh_all()

    # ============================================================================ cluster API
    def set_cluster(self, cluster: Cluster | str, apply: bool = True) -> Cluster:
        """Load a cluster (object, preset name, JSON path or inline spec) into the editor; re-synthesize."""
        c = Cluster.resolve(cluster)
        self._fill_cluster_fields(c)
        self._pending_cluster = c
        if apply:
            self.apply_cluster()
        return c

    def edit_device(
        self, name: str, *, flops: float | None = None, memory_bytes: float | None = None
    ) -> None:
        """Edit a device's throughput (flop/s) or memory (bytes) in the cluster editor (not applied yet)."""
        if f"flops:{name}" not in self.controls:
            raise KeyError(
                f"no device {name!r} in the cluster editor; devices: {', '.join(self._editor_devices())}"
            )
        if flops is not None:
            self.controls[f"flops:{name}"].value = flops / 1e12
        if memory_bytes is not None:
            self.controls[f"memory:{name}"].value = memory_bytes / GiB

    def set_collective(
        self, kind: str, *, bandwidth_Bps: float | None = None, latency_s: float | None = None
    ) -> None:
        """Edit a collective's bandwidth (bytes/s) or latency (s) in the cluster editor (not applied yet)."""
        if f"bw:{kind}" not in self.controls:
            raise KeyError(
                f"unknown collective {kind!r}; kinds: {', '.join(k for k, _ in self.cluster.collectives)}"
            )
        if bandwidth_Bps is not None:
            self.controls[f"bw:{kind}"].value = bandwidth_Bps / 1e9
        if latency_s is not None:
            self.controls[f"lat:{kind}"].value = latency_s * 1e6

    def apply_cluster(self) -> Plan:
        """Build the cluster from the editor's fields and re-synthesize on it."""
        c = self._cluster_from_fields()
        n_changed = c.names != self.cluster.names
        self.cluster = c
        if n_changed:
            self.ratio_locks = {k: v for k, v in self.ratio_locks.items() if k in c.names}
            self._build_ratio_rows()
        return self.resynthesize()

    def _editor_devices(self) -> list[str]:
        return [k.split(":", 1)[1] for k in self.controls if k.startswith("flops:")]

    def _cluster_from_fields(self) -> Cluster:
        base: Cluster = getattr(self, "_pending_cluster", None) or self.cluster
        devices = []
        changed = False
        for d in base.devices:
            flops = float(self.controls[f"flops:{d.name}"].value) * 1e12
            mem = int(float(self.controls[f"memory:{d.name}"].value) * GiB)
            if abs(flops - d.flops) > 1e-6 * d.flops or abs(mem - d.memory_bytes) > GiB / 1000:
                changed = True
                devices.append(dataclasses.replace(d, flops=flops, memory_bytes=mem))
            else:
                devices.append(d)
        colls = {}
        for k, col in base.collectives:
            bw = float(self.controls[f"bw:{k}"].value) * 1e9
            lat = float(self.controls[f"lat:{k}"].value) * 1e-6
            if abs(bw - col.bandwidth_Bps) > 1e-6 * col.bandwidth_Bps or abs(lat - col.latency_s) > 1e-12:
                changed = True
                colls[k] = Collective(lat, bw)
            else:
                colls[k] = col
        name = base.name if not changed or base.name.endswith("(edited)") else f"{base.name} (edited)"
        self._pending_cluster = None
        return base.replace(name=name, devices=tuple(devices), collectives=colls)

    # ============================================================================ triples API
    def filter_triples(
        self,
        op: str | None = None,
        tensor: str | None = None,
        kind: str | None = None,
        only_enabled: bool = False,
    ) -> str:
        """Set the triple browser's filters; returns the table's HTML."""
        self.controls["triple_op"].value = op
        self.controls["triple_tensor"].value = tensor
        self.controls["triple_kind"].value = kind
        self.controls["only_enabled"].value = only_enabled
        self._refresh_triples()
        return self.outputs["triples"].value

    # ============================================================================ launch API
    def verify(self, nproc: int | None = None) -> Any:
        """Run ``hapnb.runtime.verify(plan, nproc=...)`` and show its result."""
        fn = _optional("hapnb.run.runtime", "verify")
        if fn is None:
            raise RuntimeError("hapnb.runtime.verify is not available in this installation")
        nproc = int(self.controls["nproc"].value if nproc is None else nproc)
        self._launch_status(f"verifying on {nproc} local ranks...")
        res = fn(self.plan, nproc=nproc)
        ok = getattr(res, "ok", None)
        text = res.summary() if hasattr(res, "summary") else repr(res)
        color = "#060" if ok else "#a00" if ok is False else "#333"
        self._launch_status(f"<span style='color:{color}'>verify: {html.escape(str(text))}</span>", raw=True)
        return res

    def launch(self, nproc: int | None = None, steps: int | None = None, *, wait: bool = True) -> Any:
        """Launch the plan with ``hapnb.launch.launch`` and stream per-step time and loss into the panel.

        ``wait=False`` reads the metrics in a background thread (the Launch button does this).
        """
        fn = _optional("hapnb.run.launch", "launch")
        if fn is None:
            raise RuntimeError("hapnb.launch.launch is not available in this installation")
        nproc = int(self.controls["nproc"].value if nproc is None else nproc)
        steps = int(self.controls["steps"].value if steps is None else steps)
        backend = self.controls["backend"].value
        self.metrics = []
        self.measured = []
        self._launch_status(f"launching {nproc} ranks, {steps} steps ({backend})...")
        job = fn(self.plan, nproc=nproc, backend=backend, steps=steps)
        self._job = job
        if wait:
            self._stream(job)
        else:
            self._launch_thread = threading.Thread(target=self._stream_guarded, args=(job,), daemon=True)
            self._launch_thread.start()
        return job

    def stop(self) -> None:
        """Stop a running launch."""
        if self._job is not None and hasattr(self._job, "stop"):
            self._job.stop()

    def _stream_guarded(self, job: Any) -> None:
        try:
            self._stream(job)
        except Exception as e:  # noqa: BLE001 - shown in the panel (a thread cannot raise to the cell)
            self._error(e)

    def _stream(self, job: Any) -> None:
        it = job.metrics() if hasattr(job, "metrics") else iter(job)
        bar = self.controls["progress"]
        steps = int(self.controls["steps"].value)
        bar.max, bar.value = max(steps, 1), 0
        for m in it:
            self.metrics.append(dict(m))
            if m.get("rank", 0) == 0 and "step_s" in m:
                self.measured.append(float(m["step_s"]))
                bar.value = min(len(self.measured), bar.max)
            self._refresh_metrics()
        result = job.wait() if hasattr(job, "wait") else None
        summary = result.summary() if hasattr(result, "summary") else f"{len(self.measured)} steps"
        self._launch_status(f"launch finished: {summary}")
        self._refresh_plan()

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
            return fn()
        except Exception as e:  # noqa: BLE001 - a button never raises; the error is shown in the panel
            self._error(e)
            return None

    def _error(self, e: BaseException) -> None:
        self.last_error = e
        self.outputs[
            "status"
        ].value = (
            f"<span style='color:#a00'><b>{html.escape(type(e).__name__)}</b>: {html.escape(str(e))}</span>"
        )

    def _busy(self, text: str) -> None:
        self.controls["progress_label"].value = text

    def _build(self) -> W.Widget:
        c = self.controls
        self.outputs["status"] = _html()
        self.outputs["header"] = _html()
        c["progress"] = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="240px"))
        c["progress_label"] = W.Label("")
        tabs = [
            ("Search", self._build_search()),
            ("Triples", self._build_triples()),
            ("Pins", self._build_pins()),
            ("Plan", self._build_plan()),
            ("Cluster", self._build_cluster()),
            ("Launch", self._build_launch()),
        ]
        tab = W.Tab(children=[w for _, w in tabs])
        for i, (t, _) in enumerate(tabs):
            tab.set_title(i, t)
        self.controls["tabs"] = tab
        return W.VBox(
            [
                self.outputs["header"],
                W.HBox([c["progress"], c["progress_label"]]),
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

        def on_node(ch: Any) -> None:
            if not self._syncing:
                self._guarded(lambda: self.select(int(ch["new"])))

        c["node"].observe(on_node, names="value")
        c["depth"].observe(lambda _: self._guarded(self._refresh_tree), names="value")
        row = W.HBox(
            [
                self._button("step", "Step", self.step, icon="step-forward"),
                self._button("step_n", "Step ×N", self.step_n),
                c["step_n"],
                self._button("run_to_complete", "Run to next complete", self.run_to_complete),
                self._button("run", "Run", self.run, icon="play"),
                self._button("reset", "Reset", self.reset, icon="refresh"),
                self._button("use_best", "Use best program", self.use_best),
            ],
            layout=W.Layout(flex_flow="row wrap"),
        )
        self.outputs["search"] = _html()
        self.outputs["tree"] = _html()
        return W.VBox(
            [row, W.HBox([c["node"], c["depth"]]), W.HBox([self.outputs["search"], self.outputs["tree"]])]
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
            c[k].observe(lambda _: self._guarded(self._refresh_triples), names="value")
        self.outputs["triples"] = _html()
        return W.VBox(
            [
                W.HBox([c["triple_op"], c["triple_tensor"], c["triple_kind"]]),
                W.HBox([c["only_enabled"], c["words"]]),
                self.outputs["triples"],
            ]
        )

    def _pinnable(self) -> dict[str, tuple[str, ...]]:
        g, th = self.graph, self.theory
        return {
            t.name: tuple(str(f) for f in th.forms[t.id])
            for t in g.tensors
            if t.role in ("param", "input") and len(th.forms[t.id]) > 1
        }

    def _build_pins(self) -> W.Widget:
        c = self.controls
        rows = []
        for name, forms in self._pinnable().items():
            dd = W.Dropdown(
                options=[AUTO, *forms],
                value=self.pins.get(name, AUTO) if self.pins.get(name, AUTO) in (AUTO, *forms) else AUTO,
                description=name,
                style={"description_width": "initial"},
                layout=W.Layout(width="auto"),
            )

            def on_pin(ch: Any, name: str = name) -> None:
                self._store_pin(name, ch["new"])
                if self.controls["auto_resynth"].value:
                    self._guarded(self.resynthesize)

            dd.observe(on_pin, names="value")
            c[f"pin:{name}"] = dd
            rows.append(dd)
        c["auto_resynth"] = W.Checkbox(value=False, description="re-synthesize on every change", indent=False)
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
                        self._button("resynthesize", "Re-synthesize", self.resynthesize, icon="cogs"),
                        c["auto_resynth"],
                    ]
                ),
                self.outputs["diff"],
            ]
        )

    def _build_ratio_rows(self) -> None:
        c = self.controls
        for k in [k for k in c if k.startswith(("ratio:", "lock:"))]:
            del c[k]
        rows = []
        for j, d in enumerate(self.cluster.names):
            value = (
                self.plan.ratios[0][j]
                if self.plan.cluster.names == self.cluster.names
                else 1.0 / self.cluster.n
            )
            s = W.FloatSlider(
                value=value, min=0.0, max=1.0, step=0.001, readout_format=".3f", description=d,
                continuous_update=False, style={"description_width": "initial"},
                layout=W.Layout(width="420px"),
            )  # fmt: skip
            lock = W.Checkbox(value=d in self.ratio_locks, description="lock", indent=False)

            def on_slide(ch: Any, d: str = d) -> None:
                if self._syncing:
                    return
                self._guarded(lambda: self.set_ratio(d, float(ch["new"]), lock=True))
                if self.controls["auto_resynth"].value:
                    self._guarded(self.resynthesize)

            def on_lock(ch: Any, d: str = d) -> None:
                if self._syncing:
                    return
                self._guarded(
                    lambda: self.set_ratio(d, float(self.controls[f"ratio:{d}"].value), lock=ch["new"])
                )

            s.observe(on_slide, names="value")
            lock.observe(on_lock, names="value")
            c[f"ratio:{d}"] = s
            c[f"lock:{d}"] = lock
            rows.append(W.HBox([s, lock]))
        self.outputs["ratio_rows"].children = rows

    def _sync_ratio_sliders(self) -> None:
        self._syncing = True
        try:
            for j, d in enumerate(self.cluster.names):
                s = self.controls.get(f"ratio:{d}")
                if s is not None and self.plan.cluster.names == self.cluster.names:
                    s.value = self.plan.ratios[0][j]
        finally:
            self._syncing = False

    def _show_locks(self) -> None:
        locks = ", ".join(f"{d}={v:.3f}" for d, v in self.ratio_locks.items()) or "none"
        self.outputs["locks"].value = f"<div>locked ratios: {html.escape(locks)}</div>"

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

        def on_preset(ch: Any) -> None:
            if ch["new"] != "(current)":
                self._guarded(lambda: self.set_cluster(ch["new"], apply=False))

        c["preset"].observe(on_preset, names="value")
        self.outputs["cluster_fields"] = W.VBox()
        self._fill_cluster_fields(self.cluster)
        self.outputs["cluster"] = _html()
        return W.VBox(
            [
                W.HBox([c["preset"], c["spec"], self._button("load_spec", "Load", self._load_spec)]),
                self.outputs["cluster_fields"],
                self._button("apply_cluster", "Apply (re-synthesize)", self.apply_cluster, icon="check"),
                self.outputs["cluster"],
            ]
        )

    def _load_spec(self) -> None:
        spec = self.controls["spec"].value.strip()
        if not spec:
            raise ValueError("type a cluster spec (e.g. 2xV100+6xP100), a preset name or a JSON path first")
        self.set_cluster(spec, apply=False)

    def _fill_cluster_fields(self, cl: Cluster) -> None:
        c = self.controls
        for k in [k for k in c if k.startswith(("flops:", "memory:", "bw:", "lat:"))]:
            del c[k]
        rows = [W.HTML(f"<b>{html.escape(cl.name)}</b>: {cl.n} devices")]
        for d in cl.devices:
            f = W.FloatText(
                value=round(d.flops / 1e12, 6), description="TFLOP/s", layout=W.Layout(width="200px")
            )
            m = W.FloatText(
                value=round(d.memory_bytes / GiB, 4), description="GiB", layout=W.Layout(width="180px")
            )
            c[f"flops:{d.name}"] = f
            c[f"memory:{d.name}"] = m
            rows.append(
                W.HBox([W.Label(f"{d.name} ({d.kind}, {d.machine})", layout=W.Layout(width="220px")), f, m])
            )
        for k, col in cl.collectives:
            bw = W.FloatText(
                value=round(col.bandwidth_Bps / 1e9, 6), description="GB/s", layout=W.Layout(width="200px")
            )
            lat = W.FloatText(
                value=round(col.latency_s * 1e6, 6), description="latency us", layout=W.Layout(width="220px")
            )
            c[f"bw:{k}"] = bw
            c[f"lat:{k}"] = lat
            rows.append(W.HBox([W.Label(k, layout=W.Layout(width="220px")), bw, lat]))
        self.outputs["cluster_fields"].children = rows

    def _build_launch(self) -> W.Widget:
        c = self.controls
        c["nproc"] = W.BoundedIntText(
            value=self.cluster.n, min=1, max=4096, description="nproc", layout=W.Layout(width="150px")
        )
        c["steps"] = W.BoundedIntText(
            value=10, min=1, max=10**6, description="steps", layout=W.Layout(width="150px")
        )
        c["backend"] = W.Dropdown(
            options=["gloo", "nccl"], value="gloo", description="backend", layout=W.Layout(width="200px")
        )
        self.outputs["launch_status"] = _html()
        self.outputs["metrics"] = _html()
        return W.VBox(
            [
                W.HBox(
                    [
                        c["nproc"],
                        c["steps"],
                        c["backend"],
                        self._button("verify", "Verify", self.verify, icon="check-circle"),
                        self._button("launch", "Launch", lambda: self.launch(wait=False), icon="rocket"),
                        self._button("stop", "Stop", self.stop, icon="stop"),
                    ]
                ),  # fmt: skip
                self.outputs["launch_status"],
                self.outputs["metrics"],
            ]
        )

    def _launch_status(self, text: str, raw: bool = False) -> None:
        self.outputs["launch_status"].value = text if raw else html.escape(text)

    # ============================================================================ refreshing
    def _refresh_all(self) -> None:
        self._refresh_header()
        self._refresh_search()
        self._refresh_plan()
        self._show_locks()
        self.outputs["cluster"].value = display.safe_html(display.cluster_html, self.cluster)
        self._refresh_metrics()

    def _refresh_header(self) -> None:
        p = self.plan
        self.outputs["header"].value = (
            f"<b>hapnb Explorer</b>: {html.escape(p.name)} on {html.escape(self.cluster.name)} "
            f"({self.cluster.n} devices): <b>{p.cost_s * 1e3:.4g} ms</b>/iteration, {len(p.stages)} stages"
            + (
                f"; pins {html.escape(', '.join(f'{k}={v}' for k, v in self.pins.items()))}"
                if self.pins
                else ""
            )
        )

    def _refresh_search(self) -> None:
        self.outputs["search"].value = display.safe_html(display.search_html, self.search, self.event)
        self._syncing = True
        try:
            self.controls["node"].value = self.current
        finally:
            self._syncing = False
        st = self.search.stats
        self.controls["progress_label"].value = (
            f"{st['expansions']} expansions, frontier {st['frontier']}"
            + (", done" if self.search.done else "")
        )
        self._refresh_tree()
        self._refresh_triples()

    def _refresh_tree(self) -> None:
        depth = int(self.controls["depth"].value)
        ev = (
            self.event
            if self.event is not None and getattr(self.event.popped, "id", None) == self.current
            else None
        )
        try:
            dot = display.search_tree_dot(self.search, around=self.current, depth=depth, event=ev)
            pic = display.svg(dot)
            self.outputs["tree"].value = pic if pic else f"<pre>{html.escape(dot.source)}</pre>"
        except Exception as e:  # noqa: BLE001 - the drawing is optional
            self.outputs[
                "tree"
            ].value = f"<pre>(no tree drawing: {html.escape(type(e).__name__)}: {html.escape(str(e))})</pre>"

    def enabled(self) -> set[int]:
        """Ids of the triples enabled at the current node."""
        return display.enabled_triples(self.search, self.search.node(self.current))

    def _refresh_triples(self) -> None:
        c = self.controls
        hl = self.enabled()
        self.outputs["triples"].value = display.safe_html(
            display.theory_html,
            self.theory,
            c["triple_op"].value,
            c["triple_tensor"].value,
            hl,
            kind=c["triple_kind"].value,
            words=c["words"].value,
            only=hl if c["only_enabled"].value else None,
        )

    def _refresh_plan(self) -> None:
        p = self.plan
        self._refresh_header()
        self.outputs["plan"].value = display.safe_html(display.plan_html, p)
        self.outputs["history"].value = display.safe_html(display.history_html, p)
        if self.previous_plan is not None:
            self.outputs["diff"].value = display.safe_html(display.plan_diff_html, self.previous_plan, p)
        self.outputs["gantt"].value = self._gantt_html()

    def _gantt_html(self) -> str:
        try:
            page = display.gantt_html(self.plan, self.measured or None, width=860)
        except Exception:  # noqa: BLE001 - no bokeh: the static timeline
            return display.safe_html(display.gantt_svg, self.plan)
        height = 110 + 28 * (self.cluster.n + (2 if self.measured else 0))
        return (
            f'<iframe srcdoc="{html.escape(page, quote=True)}" '
            f"style='width:100%;height:{height}px;border:0' "
            "sandbox='allow-scripts'></iframe>"
        )

    def _refresh_metrics(self) -> None:
        rows = self.metrics[-30:]
        if not rows:
            self.outputs["metrics"].value = "<div>no launch yet</div>"
            return
        body = "".join(
            f"<tr><td>{m.get('rank', '')}</td><td>{m.get('step', '')}</td><td>{_num(m.get('loss'))}</td>"
            f"<td>{_num(m.get('step_s'), 1e3)}</td></tr>"
            for m in rows
        )
        mean = sum(self.measured) / len(self.measured) if self.measured else None
        head = (
            f"<div>{len(self.metrics)} metric lines; predicted {self.plan.cost_s * 1e3:.4g} ms/step"
            + (f", measured mean {mean * 1e3:.4g} ms (rank 0)" if mean is not None else "")
            + "</div>"
        )
        self.outputs["metrics"].value = (
            head + "<table style='font-family:monospace;font-size:12px'><tr><th>rank</th><th>step</th>"
            f"<th>loss</th><th>step ms</th></tr>{body}</table>"
        )

    # ============================================================================ display
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        return (
            f"Explorer({self.plan.name} on {self.cluster.name}: plan {self.plan.cost_s * 1e3:.4g} ms, "
            f"{self.search!r})"
        )


def _num(x: Any, scale: float = 1.0) -> str:
    return f"{float(x) * scale:.5g}" if isinstance(x, (int, float)) else ""


def _optional(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
