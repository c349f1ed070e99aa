"""Training patterns (examples/patterns.py): padding masks, a sequence classifier, Whisper, a recommender, a
diffusion UNet, a DCGAN generator, at tiny sizes. Each traces with no op without a rule, every op on batch
data can shard the batch, and the plan with the batch sharded verifies exactly against one device on 2
CPU ranks (the realistic sizes: ``python benchmarks/models.py --suite patterns``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hapnb as hap  # noqa: E402
from examples import patterns  # noqa: E402
from hapnb.triples import coverage  # noqa: E402

CLUSTER = "1xV100+1xP100"
#: verified on 2 ranks; the others are covered by the corpus's runs of the same ops
VERIFIED = ["llama_padded", "recommender", "unet", "dcgan"]


def _sharded(name: str) -> hap.Plan:
    """The plan with every input's batch dim pinned ``G0``."""
    model, inputs = patterns.PATTERNS[name](size="tiny")
    g = hap.trace(model, inputs)
    pins = {g.tensors[t].name: "G0" for t in g.inputs}
    return hap.synthesize(g, CLUSTER, pins=pins)


@pytest.mark.parametrize("name", list(patterns.PATTERNS))
def test_a_pattern_traces_with_every_batch_op_shardable(name: str) -> None:
    model, inputs = patterns.PATTERNS[name](size="tiny")
    g = hap.trace(model, inputs)
    cov = coverage(hap.theory(g))
    assert not cov.fallback and not cov.batch_blockers, (name, cov.fallback, cov.batch_blockers)


@pytest.mark.slow
@pytest.mark.parametrize("name", VERIFIED)
def test_a_pattern_with_the_batch_sharded_equals_one_device(name: str) -> None:
    plan = _sharded(name)
    rep = hap.verify(plan, nproc=2, steps=2, timeout=180)
    assert rep.ok, rep.text()
