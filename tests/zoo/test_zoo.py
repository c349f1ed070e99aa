"""Tests for hapnb.zoo: the paper's benchmark models and user factories."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from hapnb import zoo
from hapnb.zoo import TINY, ZOO_NAMES, FactoryError, ModelSpec, build, build_spec, load_factory, opslist


def _tiny(name: str, **kw):
    return build(name, devices=2, **{**TINY[name], **kw})


def _loss(model, inputs, seed: int = 123) -> torch.Tensor:
    torch.manual_seed(seed)  # dropout draws from the global RNG
    return model(*inputs)


# --------------------------------------------------------------------------- every zoo model


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_builds_loss_backward_export(name):
    model, inputs, spec = _tiny(name)
    assert model.training
    loss = _loss(model, inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())
    # export in train mode, both flavours, same ops; the module docstring lists exactly these ops
    ops = zoo.exported_ops(model, inputs)
    assert ops == zoo.exported_ops(model, inputs, strict=True)
    assert "aten.dropout.default" in ops or name == "mlp"
    assert {o.replace("<built-in function getitem>", "operator.getitem") for o in ops} == _doc_ops(name)
    assert spec.name == name and dict(spec.options)["devices"] == 2


def _doc_ops(name: str) -> set[str]:
    m = re.search(rf"^\* ``{re.escape(name)}``: (.*?)(?=^\* ``|^\s*$)", opslist.__doc__, re.M | re.S)
    assert m, f"module docstring lists no ops for {name}"
    return {o.strip() for o in m.group(1).replace("\n", " ").split(",")}


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_deterministic_and_spec_roundtrip(name):
    m1, in1, spec = _tiny(name, seed=3)
    m2, in2, spec2 = _tiny(name, seed=3)
    assert spec == spec2
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert all(torch.equal(a, b) for a, b in zip(in1, in2))
    loss = _loss(m1, in1)
    assert torch.equal(loss, _loss(m2, in2))
    # JSON round trip rebuilds the same model
    back = ModelSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert back == spec
    m3, in3, spec3 = build_spec(back)
    assert spec3 == spec and torch.equal(_loss(m3, in3), loss)
    # another seed gives other weights
    m4, _, _ = _tiny(name, seed=4)
    assert not all(torch.equal(a, b) for a, b in zip(m1.parameters(), m4.parameters()))


def test_float64_and_sum_reduction():
    m, inputs, _ = _tiny("gpt", dtype="float64", dropout=0.0)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    mean = m(*inputs)
    assert mean.dtype == torch.float64
    m2, inputs2, _ = _tiny("gpt", dtype="float64", dropout=0.0, reduction="sum")
    n_tokens = inputs[1].numel()
    torch.testing.assert_close(m2(*inputs2), mean * n_tokens)


# --------------------------------------------------------------------------- model semantics


def test_mlp_matches_manual_forward():
    m, (x, y), _ = build("mlp", devices=1, layers=2, hidden=8, input=5, classes=3, batch=6)
    h = x
    for lin in m.layers:
        h = torch.relu(h @ lin.weight.T + lin.bias)
    expect = F.cross_entropy(h @ m.head.weight.T + m.head.bias, y)
    torch.testing.assert_close(m(x, y), expect)
    assert x.shape == (6, 5) and y.max() < 3


def test_defaults_batch_and_shapes():
    m, (x, y), spec = build("mlp")
    assert x.shape == (32 * 8, 1024) and len(m.layers) == 4 and m.head.out_features == 10
    assert spec.options == (("devices", 8), ("seed", 0))
    _, (img, _), _ = build("vgg19", devices=1, width=1 / 16, hidden=16)
    assert img.shape == (32, 3, 32, 32)
    m, (tok, tgt), _ = build("bert-moe", layers=2, hidden=8, heads=2, vocab=16, batch=1)
    moe = m.layers[1].moe
    assert tok.shape == (1, 128) and moe.experts == 16 and moe.capacity == 20  # E = 2 x 8, ceil(128/16*2.5)
    assert tuple(moe.w1.shape) == (16, 8, 32) and tuple(moe.w2.shape) == (16, 32, 8)
    assert tuple(moe.gate.weight.shape) == (16, 8) and moe.gate.bias is None
    assert not hasattr(m.layers[0], "moe")


def _layer_params(d: int, f: int) -> int:
    return (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d  # attention, FFN, two LayerNorms


def test_default_parameter_counts():
    vit, _, _ = build("vit")
    n_vit = sum(p.numel() for p in vit.parameters())
    expect = 12 * _layer_params(768, 3072) + (3 * 16 * 768 + 768) + 768 + 65 * 768 + (768 * 10 + 10)
    assert n_vit == expect and 84e6 < n_vit < 87e6
    del vit
    bert, _, _ = build("bert")
    n_bert = sum(p.numel() for p in bert.parameters())
    v = 33280
    assert n_bert == 12 * _layer_params(768, 3072) + v * 768 + (768 * v + v)
    assert 135e6 < n_bert < 137e6
    assert tuple(bert.mask.shape) == (128, 128) and bert.mask[0, 1] == float("-inf") and bert.mask[1, 0] == 0


def test_vocab_padding_follows_devices():
    for devices, vocab in ((8, 33280), (4, 33280), (3, 33279)):
        m, (tok, _), _ = build("bert", devices=devices, layers=1, hidden=8, heads=2, seq=4, batch=1)
        assert m.decoder.out_features == vocab and m.zoo_config["vocab"] == vocab


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_causal(name):
    m, (tok, tgt), _ = _tiny(name, dropout=0.0)
    head = m.decoder if name == "bert" else m.head
    seen = []
    head.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    tok2 = tok.clone()
    tok2[:, -1] = (tok2[:, -1] + 1) % 64
    m(tok, tgt), m(tok2, tgt)
    torch.testing.assert_close(seen[0][:, :-1], seen[1][:, :-1])
    assert not torch.allclose(seen[0][:, -1], seen[1][:, -1])


@pytest.mark.parametrize("name", ["vit", "bert", "bert-moe"])
def test_sdpa_attention_equals_torch_layers(name):
    mt, inputs, _ = _tiny(name, dropout=0.0, dtype="float64")
    ms, _, _ = _tiny(name, dropout=0.0, dtype="float64", attention="sdpa")
    ms.load_state_dict(mt.state_dict())  # same parameter names and shapes
    torch.testing.assert_close(ms(*inputs), mt(*inputs))


def _moe_reference(moe, x):
    """Token-by-token GShard top-2 routing with per-sequence capacity (ground truth)."""
    e_n, cap = moe.experts, moe.capacity
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        top = torch.topk(probs[b], 2, dim=-1).indices
        slots1 = [0] * e_n
        kept1 = []
        for s in range(x.shape[1]):
            e = int(top[s, 0])
            kept1.append(slots1[e] < cap)
            slots1[e] += 1
        used = [min(c, cap) for c in slots1]
        slots2 = [0] * e_n
        for s in range(x.shape[1]):
            e1, e2 = int(top[s, 0]), int(top[s, 1])
            k2 = used[e2] + slots2[e2] < cap
            slots2[e2] += 1
            g1 = probs[b, s, e1] if kept1[s] else 0.0
            g2 = probs[b, s, e2] if k2 else 0.0
            denom = max(float(g1 + g2), torch.finfo(x.dtype).eps)
            for g, e in ((g1, e1), (g2, e2)):
                if float(g) > 0:
                    y = torch.relu(x[b, s] @ moe.w1[e]) @ moe.w2[e]
                    out[b, s] += g / denom * y
    return out


@torch.no_grad()
def test_moe_routing_matches_token_loop():
    torch.manual_seed(0)
    moe = zoo.MoEFFN(hidden=6, ff=10, experts=4, capacity=3).double()
    x = torch.randn(3, 8, 6, dtype=torch.float64)  # 8 tokens x 2 choices over 4 experts x 3 slots: drops
    dispatch, combine = moe.routing(x)
    assert dispatch.shape == (3, 8, 4, 3)
    assert dispatch.sum(dim=1).max() <= 1  # one token per (sequence, expert, slot)
    assert dispatch.sum(dim=(2, 3)).max() <= 2  # at most two experts per token
    assert dispatch.sum() < 3 * 8 * 2  # capacity dropped some tokens
    torch.testing.assert_close(moe(x), _moe_reference(moe, x))


def test_moe_sequences_are_independent():
    m, (tok, tgt), _ = _tiny("bert-moe", dropout=0.0)
    seen = []
    m.decoder.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    tok2 = tok.clone()
    tok2[1:] = torch.randint(0, 64, tok2[1:].shape)
    m(tok, tgt), m(tok2, tgt)
    torch.testing.assert_close(seen[0][0], seen[1][0])


# --------------------------------------------------------------------------- errors


def test_bad_names_and_options():
    with pytest.raises(ValueError, match=r"valid zoo names are mlp, vgg19, vit, bert, bert-moe, gpt"):
        build("resnet")
    with pytest.raises(ValueError, match=r"does not take option\(s\) colour, seq; valid: .*hidden"):
        build("mlp", seq=4, colour=1)
    with pytest.raises(ValueError, match="does not take option"):
        build("vgg19", layers=3)
    with pytest.raises(ValueError, match="heads=5 must divide hidden=32"):
        build("gpt", hidden=32, heads=5)
    with pytest.raises(ValueError, match="devices=0 is invalid"):
        build("bert", devices=0)
    with pytest.raises(ValueError, match="image=16 is invalid"):
        build("vgg19", image=16)
    with pytest.raises(ValueError, match="attention='flash' is invalid"):
        build("bert", attention="flash")
    with pytest.raises(ValueError, match="not a JSON value"):
        build("mlp", hidden=torch.tensor(3))
    with pytest.raises(ValueError, match="unknown zoo model"):
        zoo.zoo_options("nope")
    with pytest.raises(ValueError, match="string 'name'"):
        ModelSpec.from_json({"options": {}})


# --------------------------------------------------------------------------- factories


@pytest.mark.parametrize(
    "path",
    ["examples.factories:small_convnet", "examples.factories:prenorm_lm", "examples/factories.py:prenorm_lm"],
)
def test_example_factories(path):
    model, inputs = load_factory(path, batch=2)
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    torch.export.export(model, inputs)
    # through build: recorded in the spec, seeded, rebuildable
    m1, in1, spec = build(path, batch=2, seed=5)
    assert spec.name == path and dict(spec.options)["batch"] == 2
    m2, in2, _ = build_spec(ModelSpec.from_json(json.loads(json.dumps(spec.to_json()))))
    assert torch.equal(m1(*in1), m2(*in2))


def test_prenorm_lm_uses_rule_less_ops():
    model, inputs = load_factory("examples.factories:prenorm_lm")
    ops = zoo.exported_ops(model, inputs)
    assert "aten.cumsum.default" in ops and "aten.erf.default" in ops
    assert torch.isclose(model(*inputs), torch.tensor(math.log(64.0)), rtol=0.3)  # near-uniform at init


BAD_MODULE = """
import torch
def not_a_pair():
    return torch.nn.Linear(2, 2)
def bad_inputs():
    return torch.nn.Linear(2, 2), [torch.zeros(2), "x"]
def good(batch=2, devices=1, seed=None):
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1), (torch.ones(batch, devices),)
def broken(
"""


def test_factory_errors(tmp_path, monkeypatch):
    (tmp_path / "zoo_facts_ok.py").write_text(BAD_MODULE.rsplit("def broken", 1)[0])
    (tmp_path / "zoo_facts_broken.py").write_text(BAD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        FactoryError, match=r"cannot import module 'no_such_pkg_zz' of factory 'no_such_pkg_zz:f'"
    ):
        load_factory("no_such_pkg_zz:f")
    with pytest.raises(FactoryError, match="zoo_facts_broken:good.*SyntaxError"):
        load_factory("zoo_facts_broken:good")
    with pytest.raises(FactoryError, match="has no attribute 'nope'.*callables there: .*bad_inputs, good"):
        load_factory("zoo_facts_ok:nope")
    with pytest.raises(FactoryError, match=r"'zoo_facts_ok:not_a_pair' must return \(nn.Module, tuple"):
        load_factory("zoo_facts_ok:not_a_pair")
    with pytest.raises(FactoryError, match=r"returned list\(Linear, list\)|returned tuple\(Linear, list\)"):
        load_factory("zoo_facts_ok:bad_inputs")
    with pytest.raises(FactoryError, match="cannot take options"):
        load_factory("zoo_facts_ok:good", colour=3)
    with pytest.raises(FactoryError, match="malformed"):
        load_factory(":good")
    with pytest.raises(FactoryError, match="no such file"):
        load_factory("missing/file.py:good")
    assert issubclass(FactoryError, ValueError)
    # devices and seed reach a factory that names them; the tuple result is normalized
    model, (x,), spec = build("zoo_facts_ok:good", devices=3, batch=4)
    assert x.shape == (4, 3) and isinstance(model, torch.nn.Linear)
