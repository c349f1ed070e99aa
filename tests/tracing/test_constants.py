"""Constant folding (issue 18, :mod:`hapnb.tracing.constants`): what depends on no input and no weight (T5's
relative position buckets, a causal mask) becomes a lifted constant at trace time, exactly; random ops,
buffers, weights, inputs, lone factories and large constants are left to the program."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hapnb as hap
from hapnb.tracing import constants
from hapnb.tracing.constants import fold_constants


class RelBias(nn.Module):
    """Attention scores plus a bucketed relative position bias (as T5 computes it) under a causal mask."""

    def __init__(self, heads: int = 2, buckets: int = 8) -> None:
        super().__init__()
        self.buckets = buckets
        self.bias = nn.Embedding(buckets, heads)
        self.proj = nn.Linear(6, 6)

    def bucket(self, s: int) -> torch.Tensor:
        pos = torch.arange(s)
        rel = (pos[None, :] - pos[:, None]).abs()
        exact = self.buckets // 2
        far = exact + (torch.log(rel.float() / exact + 1e-6) / 2.0 * exact).to(torch.long)
        return torch.where(rel < exact, rel, torch.clamp(far, max=self.buckets - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, S, 6)
        s = x.shape[2]
        bias = self.bias(self.bucket(s)).permute(2, 0, 1).unsqueeze(0)  # (1, H, S, S)
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2) + bias
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, -1e4)
        return scores.softmax(-1).sum()


def _export(model: nn.Module, *inputs: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model, inputs, strict=False)


def _targets(ep: torch.export.ExportedProgram) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


@pytest.fixture(scope="module")
def relbias() -> tuple[RelBias, torch.Tensor]:
    torch.manual_seed(0)
    return RelBias(), torch.randn(4, 2, 12, 6)


def test_shape_only_tables_become_exact_constants(relbias) -> None:
    model, x = relbias
    ep = _export(model, x)
    out = fold_constants(ep)
    assert out.folded, "the buckets and the mask depend on the shape alone"
    assert not {"aten.log.default", "aten.abs.default", "aten.tril.default"} & _targets(out.program)
    assert "aten.log.default" in _targets(ep), "the input program is not changed"
    torch.testing.assert_close(out.program.module()(x), model(x), rtol=0, atol=0)
    want = model.bucket(12)
    assert any(torch.equal(out.program.constants[c], want) for c in out.folded)


def test_the_graph_loads_folded_constants_like_weights(relbias) -> None:
    model, x = relbias
    g = hap.trace(model, (x,))
    consts = {t.id for t in g.tensors if t.role == "const"}
    assert consts and set(consts) <= set(g.params)
    for op in g.ops:  # every op left reads an input, a weight or an activation (or is a lone factory)
        assert not op.inputs or not set(op.inputs) <= consts, op.target
    plan = hap.synthesize(g, "1xV100+1xP100")
    assert not plan.fallback_ops


def test_folding_twice_or_nothing_to_fold_changes_nothing(relbias) -> None:
    model, x = relbias
    once = fold_constants(_export(model, x)).program
    assert fold_constants(once).folded == () and fold_constants(once).program is once

    class LoneFactory(nn.Module):  # GPT's position arange: a lone factory op stays an op
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + torch.arange(x.shape[1])).sum()

    ep = _export(LoneFactory(), torch.randn(3, 5))
    assert fold_constants(ep).program is ep


class NotConstant(nn.Module):
    """Shape-only-looking work that must run in every step: random numbers, a buffer, a weight, the input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(5))
        self.w = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(5).abs()
        scaled = self.scale.exp()
        weighted = (self.w * 2).abs()
        shaped = torch.zeros_like(x).abs()
        return (x * noise + scaled + weighted + shaped).sum()


def test_random_ops_buffers_weights_and_inputs_are_not_folded() -> None:
    ep = _export(NotConstant(), torch.randn(3, 5))
    assert fold_constants(ep).program is ep


def test_large_and_growing_constants_stay_computed(relbias, monkeypatch) -> None:
    model, x = relbias
    ep = _export(model, x)
    full = fold_constants(ep)
    monkeypatch.setattr(constants, "SMALL_BYTES", 64)
    monkeypatch.setattr(constants, "MAX_BYTES", 12 * 12 * 4)  # (12, 12) float32 fits, (12, 12) int64 not
    small = fold_constants(ep)
    sizes = [
        small.program.constants[c].numel() * small.program.constants[c].element_size() for c in small.folded
    ]
    assert small.folded and max(sizes) <= 12 * 12 * 4
    assert any(torch.equal(full.program.constants[c], model.bucket(12)) for c in full.folded)
    assert not any(torch.equal(small.program.constants[c], model.bucket(12)) for c in small.folded)
    assert "aten.log.default" not in _targets(small.program)  # the float table is still folded
    torch.testing.assert_close(small.program.module()(x), model(x), rtol=0, atol=0)


@pytest.mark.slow
def test_a_plan_with_folded_constants_equals_one_device(relbias) -> None:
    model, x = relbias
    g = hap.trace(model, (x,))
    plan = hap.synthesize(g, "1xV100+1xP100")
    rep = hap.verify(plan, nproc=2, steps=2, timeout=120)
    assert rep.ok, rep.text()


class InPlace(nn.Module):
    """A shape-only table changed in place before use (a program not functionalized yet)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).float()
        doubled = pos * 2
        pos.add_(1)
        return (x * doubled + x * pos).sum()


def test_a_table_changed_in_place_is_not_folded_from_its_old_value() -> None:
    model, x = InPlace(), torch.randn(3, 5)
    out = fold_constants(_export(model, x))
    torch.testing.assert_close(out.program.module()(x), model(x), rtol=0, atol=0)


class Rotary(nn.Module):
    """Rotary cos/sin tables from a non-persistent ``inv_freq`` buffer (as Hugging Face models compute them),
    applied to a projection of the input."""

    def __init__(self, dim: int = 4, persistent: bool = False) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=persistent)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, dim)
        pos = torch.arange(x.shape[1]).float()
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        h = self.proj(x)
        return (h * emb.cos() + h.flip(-1) * emb.sin()).sum()


def test_tables_of_non_persistent_buffers_are_folded_exactly() -> None:
    torch.manual_seed(0)
    model, x = Rotary(), torch.randn(2, 6, 4)
    out = fold_constants(_export(model, x))
    assert {"aten.cos.default", "aten.sin.default", "aten.outer.default"}.isdisjoint(_targets(out.program))
    assert len(out.folded) == 2  # cos and sin, (6, 4) each
    torch.testing.assert_close(out.program.module()(x), model(x), rtol=0, atol=0)
    # a persistent buffer is state (a checkpoint may restore it): its tables stay computed
    kept = fold_constants(_export(Rotary(persistent=True), x)).program
    assert {"aten.cos.default", "aten.sin.default", "aten.outer.default"} <= _targets(kept)


class Counter(nn.Module):
    """A non-persistent buffer the forward updates: not a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return (x * self.steps.exp()).sum()


def test_a_non_persistent_buffer_the_program_updates_is_not_folded() -> None:
    from hapnb.tracing.lower import lower

    ep = lower(_export(Counter(), torch.randn(3, 5))).program
    assert fold_constants(ep).program is ep


def test_the_meta_recorder_refuses_non_persistent_buffers() -> None:
    """The recorder cannot compute on meta tensors, so it leaves such models to torch.export, which folds."""
    from hapnb.tracing.record import Unsupported, record

    model = Rotary().to("meta")
    with pytest.raises(Unsupported, match="inv_freq is a non-persistent buffer"):
        record(model, (torch.empty(2, 6, 4, device="meta"),), loss=None)


def test_coverage_lists_the_folded_constants() -> None:
    """The folded ops are gone from the program; the coverage report names the constants that replaced them."""
    from hapnb.triples import coverage

    torch.manual_seed(0)
    cov = coverage(hap.theory(hap.trace(Rotary(), (torch.randn(2, 6, 4),))))
    assert len(cov.folded) == 2 and all(n.rsplit(".", 1)[-1].startswith("folded_") for n in cov.folded)
    assert cov.to_json()["folded_constants"] == list(cov.folded)
    assert "loaded as constants: " + cov.folded[0] in cov.summary()
    plain = hap.trace(nn.Linear(4, 2), (torch.randn(6, 4),), loss=lambda y: y.sum())
    assert coverage(hap.theory(plain)).folded == ()


class PaddingMask(nn.Module):
    """Reads a padding mask ``(B, S)`` at broadcast aranges into ``(B, 1, 1, S)``, as Hugging Face's mask
    functions do, and a second table at aranges that are not a reshape (the rows reversed)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, flip: bool = False) -> torch.Tensor:
        b, s = mask.shape
        rows = torch.arange(b)
        rows = rows.flip(0) if flip else rows
        seen = mask.bool()[rows[:, None, None, None], torch.arange(s)[None, None, None, :]]  # (B, 1, 1, S)
        return self.proj(x).masked_fill(~seen, 0.0).sum()


def _padding_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return torch.randn(4, 2, 6, 6), mask


def test_an_index_by_aranges_is_a_reshape_that_shards_the_batch() -> None:
    x, mask = _padding_inputs()
    model = PaddingMask()
    ep = _export(model, x, mask)
    out = fold_constants(ep).program
    assert "aten.index.Tensor" in _targets(ep) and "aten.index.Tensor" not in _targets(out)
    assert "aten.reshape.default" in _targets(out) and "aten.arange.default" not in _targets(out)
    torch.testing.assert_close(out.module()(x, mask), model(x, mask))
    g = hap.trace(model, (x, mask))
    plan = hap.synthesize(g, "1xV100+1xP100", pins={"x": "G0", "mask": "G0"})
    assert not any("index" in op.target for op in plan.graph.ops)
    rep = hap.verify(plan, nproc=2, steps=1, timeout=120)
    assert rep.ok, rep.text()


def test_an_index_by_other_constants_stays_an_index() -> None:
    class Flipped(PaddingMask):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x, mask, flip=True)

    x, mask = _padding_inputs()
    model = Flipped()
    out = fold_constants(_export(model, x, mask)).program
    assert "aten.index.Tensor" in _targets(out)
    torch.testing.assert_close(out.module()(x, mask), model(x, mask))
