"""Verification against one device (hapnb.run.verify): reports, shared parameters, progress, stalls."""

from __future__ import annotations

import pytest

import hapnb as hap

TIED = "examples.factories:tied_lm"


@pytest.mark.slow
def test_tied_embedding_verifies() -> None:
    """A weight shared by two modules: gradients summed over both uses, one copy updated."""
    plan = hap.synthesize(TIED, "2xV100")
    names = {plan.graph.tensors[t].name for t in plan.graph.params}
    assert {"embed.weight", "head.weight"} <= names
    report = hap.verify(plan, nproc=2, steps=3)
    assert report.ok, report.text()
    checked = {(c.kind, c.name) for c in report.checks}
    for name in ("embed.weight", "head.weight"):
        assert ("grad", name) in checked and ("weight", name) in checked
    assert report.max_rel < 1e-10
