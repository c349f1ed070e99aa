"""The fast zoo path (hapnb.tracing.record, hapnb.tracing.cache): the Graph recorded on meta tensors is the
Graph torch.export gives (every tensor, op, argument, flop count and the fingerprint), for every zoo model;
the trace cache returns the same Graph; a deferred program traces the model with its weights on first use
and checks the fingerprint; ranking candidates by ``iteration_time`` gives the simulator's own number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hapnb
from hapnb import zoo
from hapnb.ir.graph import DeferredProgram, TraceError
from hapnb.plans.simulation import iteration_time, simulate
from hapnb.tracing import cache, deferred_program, trace, zoo_graph
from hapnb.tracing.record import Unsupported, record

#: every zoo model (tiny), the torch attention of the models that have one, and two at their paper
#: sizes (one layer): the meta device must give the same shapes, strides and choices as export's fake CPU
CASES = [(n, dict(zoo.TINY[n])) for n in zoo.ZOO_NAMES]
CASES += [(n, {**zoo.TINY[n], "attention": "torch"}) for n in ("vit", "bert", "bert-moe")]
CASES += [("bert", {"layers": 1, "batch": 16}), ("gpt", {"layers": 1, "batch": 16})]

_RECORD = """
import json, sys
from hapnb.tracing import cache
from hapnb.tracing.record import trace_zoo_meta
out = []
for name, opts in json.loads(sys.argv[1]):
    g, _ = trace_zoo_meta(name, devices=2, **opts)
    out.append(cache.graph_to_json(g))
# the recorder never imports torch._dynamo and leaves no stand-in behind
assert "torch._dynamo" not in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    """The cases recorded in a fresh interpreter (no torch._dynamo loaded: the stand-in path)."""
    out = subprocess.run(
        [sys.executable, "-c", _RECORD, json.dumps(CASES)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    "k", range(len(CASES)), ids=[f"{n}-{o.get('attention', '')}{o.get('layers')}" for n, o in CASES]
)
def test_recorded_graph_is_the_exported_graph(recorded, k):
    name, opts = CASES[k]
    model, inputs, _ = zoo.build(name, devices=2, **opts)
    exported = trace(model, inputs, name=name)
    assert recorded[k] == json.loads(json.dumps(cache.graph_to_json(exported)))
    again = cache.graph_from_json(recorded[k])  # and the JSON form loads back to the same graph
    assert again.tensors == exported.tensors and again.ops == exported.ops


def test_deferred_program_traces_with_weights_once_and_checks_the_graph():
    g, spec = zoo_graph("mlp", devices=2, **zoo.TINY["mlp"])
    assert isinstance(g.program, DeferredProgram)
    ep = g.traced_program()
    assert isinstance(ep, torch.export.ExportedProgram) and g.traced_program() is ep
    model, inputs, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    assert trace(model, inputs).fingerprint == g.fingerprint
    wrong = deferred_program(spec, "mlp", "0" * 16)
    with pytest.raises(TraceError, match="HAPNB_TRACE=export"):
        wrong()


def test_trace_cache_returns_the_same_graph_and_ignores_bad_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("HAPNB_CACHE_DIR", str(tmp_path))
    t1: dict = {}
    g1, spec = zoo_graph("gpt", t1, devices=2, **zoo.TINY["gpt"])
    t2: dict = {}
    g2, _ = zoo_graph("gpt", t2, devices=2, **zoo.TINY["gpt"])
    assert (t1["trace_path"], t2["trace_path"]) == ("recorded", "cache")
    assert json.dumps(cache.graph_to_json(g1)) == json.dumps(cache.graph_to_json(g2))
    assert isinstance(g2.program, DeferredProgram)
    entries = list((tmp_path / "traces").glob("*.json"))
    assert len(entries) == 1 and entries[0].stem == cache.cache_key(spec)
    # another option is another key; a damaged entry is a miss (and is rewritten)
    assert cache.cache_key(
        zoo.model_spec("gpt", devices=2, **{**zoo.TINY["gpt"], "hidden": 64}).to_json()
    ) != (entries[0].stem)
    entries[0].write_text(entries[0].read_text().replace('"linear"', '"linear_9"', 1))
    assert cache.load(spec) is None
    t3: dict = {}
    zoo_graph("gpt", t3, devices=2, **zoo.TINY["gpt"])
    assert t3["trace_path"] == "recorded" and cache.load(spec) is not None
    monkeypatch.setenv("HAPNB_TRACE_CACHE", "0")
    assert cache.load(spec) is None and not cache.save(spec, g1)


def test_export_path_on_request(monkeypatch):
    monkeypatch.setenv("HAPNB_TRACE", "export")
    t: dict = {}
    g, _ = zoo_graph("mlp", t, devices=2, **zoo.TINY["mlp"])
    assert t["trace_path"] == "export" and isinstance(g.program, torch.export.ExportedProgram)


class _InPlace(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.add_(1.0)
        return y.sum()


class _Constant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(4, device="meta")  # a plain attribute: export lifts it as a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sum()


@pytest.mark.parametrize("cls, why", [(_InPlace, "in-place"), (_Constant, "neither a parameter")])
def test_recorder_refuses_what_it_cannot_reproduce(cls, why):
    model = cls().to("meta")
    with pytest.raises(Unsupported, match=why):
        record(model, (torch.empty(2, 4, device="meta"),))


def test_iteration_time_is_the_simulated_time(dp_plan):
    plan = hapnb.synthesize("gpt", "2xV100+2xP100", **zoo.TINY["gpt"])
    for p in (plan, dp_plan):
        assert iteration_time(p) == simulate(p).iteration_s == p.simulated_s


def test_cli_plan_reports_its_phases(tmp_path):
    env = {**os.environ, "HAPNB_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "hapnb", "plan", "--model", "mlp", "--cluster", "1xV100+1xP100", "--json",
           "--no-baselines", "--set", "hidden=32", "--set", "input=16", "--layers", "2"]  # fmt: skip
    out = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
    assert (
        out["phases"]["trace_path"] == "recorded" and len(list(Path(tmp_path, "traces").glob("*.json"))) == 1
    )
    assert {"build_s", "trace_s", "synthesis_s", "search_s", "after_s"} <= set(out["phases"])
