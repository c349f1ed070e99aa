"""Bundles (hapnb.run.bundle): plan + exported program + inputs in a folder, read back without the
user's code, checked against the plan's graph fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hapnb import zoo
from hapnb.plans.plan import Plan
from hapnb.run.bundle import BundleError, load_bundle, resolve_graph, write_bundle
from hapnb.runtime.codegen import generate
from hapnb.runtime.program import program_weights


def test_bundle_round_trip(dp_plan: Plan, tmp_path: Path) -> None:
    d = write_bundle(dp_plan, tmp_path / "b")
    assert {p.name for p in d.iterdir()} >= {"plan.json", "program.pt2", "cluster.json", "inputs.pt"}
    b = load_bundle(d)
    assert b.plan == dp_plan
    assert b.graph.fingerprint == dp_plan.graph_fingerprint
    _, inputs, _ = zoo.build("mlp", devices=2, **zoo.TINY["mlp"])
    assert all(torch.equal(a, c) for a, c in zip(b.inputs, inputs))
    w0, w1 = program_weights(dp_plan.graph), program_weights(b.graph)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    for rank in range(2):
        assert generate(b.plan, b.graph, rank).code == generate(dp_plan, dp_plan.graph, rank).code
    # a plan read back from JSON has no graph: the bundle is rebuilt from the plan's zoo spec
    loaded = Plan.load(dp_plan.save(tmp_path / "p.json"))
    assert loaded.graph is None
    b2 = load_bundle(write_bundle(loaded, tmp_path / "b2"))
    assert b2.graph.fingerprint == dp_plan.graph_fingerprint
    (tmp_path / "b2" / "inputs.pt").unlink()
    with pytest.raises(BundleError, match="missing inputs.pt"):
        load_bundle(tmp_path / "b2")
    wrong_model, wrong_inputs, _ = zoo.build("mlp", devices=2, **{**zoo.TINY["mlp"], "hidden": 16})
    with pytest.raises(BundleError, match="made for graph"):
        write_bundle(dp_plan, tmp_path / "b3", model=wrong_model, example_inputs=wrong_inputs)


def test_resolve_graph_and_bad_bundles(dp_plan: Plan, tmp_path: Path) -> None:
    g, inputs = resolve_graph(dp_plan)
    assert g is dp_plan.graph and len(inputs) == 2
    loaded = Plan.load(dp_plan.save(tmp_path / "p.json"))
    g2, _ = resolve_graph(loaded)  # rebuilt from the zoo spec the plan records
    assert g2.fingerprint == dp_plan.graph_fingerprint
    with pytest.raises(BundleError, match="is not a hapnb bundle: missing plan.json"):
        load_bundle(tmp_path)
    d = write_bundle(dp_plan, tmp_path / "b")
    (d / "meta.json").write_text('{"format": 99}')
    with pytest.raises(BundleError, match="bundle format 99 is not supported"):
        load_bundle(d)
