"""Tests of hapnb.tracing: parameters/inputs/loss, shapes, module paths, flops, tuple outputs,
the fx fallback, and TraceError for untraceable modules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hapnb import rules
from hapnb.ir.graph import Graph, TensorArg, TraceError
from hapnb.tracing import trace


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, d: int = 16, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return (x + self.mlp(x)).pow(2).mean()


def test_mlp_with_loss_identifies_params_inputs_and_loss():
    g = trace(MLP(), (torch.randn(5, 8),), loss=nn.CrossEntropyLoss(), targets=(torch.randint(0, 4, (5,)),))
    assert isinstance(g, Graph)
    assert [g.tensors[t].name for t in g.inputs] == ["x", "target"]
    assert [g.tensors[t].name for t in g.params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert all(g.tensors[t].role == "param" and g.tensors[t].requires_grad for t in g.params)
    assert [op.target for op in g.ops] == [
        "aten.linear.default",
        "aten.relu.default",
        "aten.linear.default",
        "aten.cross_entropy_loss.default",
    ]
    loss = g.tensors[g.loss]
    assert loss.shape == () and loss.dtype == "float32" and loss.producer == g.ops[-1].id
    lin = g.ops[0]
    assert lin.module == "fc1" and lin.family == "matmul"
    assert lin.args[:3] == (TensorArg(0), TensorArg(1), TensorArg(2))
    assert [g.tensors[t].name for t in lin.inputs] == ["x", "fc1.weight", "fc1.bias"]
    assert g.tensors[lin.outputs[0]].shape == (5, 16)
    assert lin.flops == 2 * 5 * 16 * 8 + 5 * 16
    ce = g.ops[-1]
    assert ce.args[3:] == (1, -100, 0.0)  # normalized to the aten schema (defaults filled in)
    assert g.tensors[lin.outputs[0]].consumers == (1,)
    assert (
        g.fingerprint
        and g.fingerprint
        == trace(
            MLP(), (torch.randn(5, 8),), loss=nn.CrossEntropyLoss(), targets=(torch.randint(0, 4, (5,)),)
        ).fingerprint
    )


def test_transformer_encoder_layer_traces_with_sdpa_flops():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    layer.eval()  # trace must still use train mode (dropout present), then restore eval
    g = trace(layer, (torch.randn(2, 5, 16),), loss=lambda out: out.square().mean())
    assert not layer.training
    targets = {op.target for op in g.ops}
    assert {
        "aten.scaled_dot_product_attention.default",
        "aten.layer_norm.default",
        "aten.dropout.default",
    } <= targets
    sdpa = next(op for op in g.ops if op.target == "aten.scaled_dot_product_attention.default")
    assert sdpa.flops > 0 and sdpa.module == "self_attn" and sdpa.family == "attention"
    assert "self_attn.in_proj_weight" in {g.tensors[t].name for t in g.params}
    assert g.tensor("norm1.weight").shape == (16,)
    for op in g.ops:  # every op has at least the replicated strategy, most have more
        assert rules.strategies(g, op)[0].name == "replicate"
    assert sum(len(rules.strategies(g, op)) > 1 for op in g.ops) >= len(g.ops) - 2


def test_hand_written_attention_block_module_paths_and_tuple_outputs():
    g = trace(Attention(), (torch.randn(2, 6, 16),))
    assert g.tensors[g.inputs[0]].name == "x"
    split = next(op for op in g.ops if op.target == "aten.split.Tensor")
    assert split.output_items == (0, 1, 2) and len(split.outputs) == 3
    assert all(g.tensors[t].shape == (2, 6, 16) for t in split.outputs)
    mods = {op.module for op in g.ops}
    assert {"norm", "qkv", "proj", "mlp.0", "mlp.2"} <= mods
    views = [op for op in g.ops if op.target == "aten.view.default"]
    assert views and views[0].args[1] == (2, 6, 4, 4)
    sdpa = next(op for op in g.ops if op.family == "attention")
    assert sdpa.flops == rules.flops(sdpa.target, [(2, 4, 6, 4)] * 3, [(2, 4, 6, 4)])


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow
            return x * 2
        return x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x)).sum()


def test_untraceable_model_names_the_module_and_hints():
    with pytest.raises(TraceError) as info:
        trace(Gated(), (torch.randn(3, 4),))
    msg = str(info.value)
    assert "'gate'" in msg
    assert "torch.cond" in msg
    assert "at: test_tracing.py:" in msg and "`if x.sum() > 0:" in msg  # the line of the model that branched


class LayerDropStack(nn.Module):
    """Layers skipped at random while training, as Hugging Face's LayerDrop does (``config.layerdrop``)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(layerdrop=0.25)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        drop = self.training and self.config.layerdrop > 0
        for layer in self.layers:
            if not (drop and torch.rand([]) < self.config.layerdrop):
                x = layer(x)
        return x.sum()


def test_layerdrop_is_named_with_the_setting_that_turns_it_off():
    model = LayerDropStack()
    with pytest.raises(TraceError) as info:
        trace(model, (torch.randn(3, 4),))
    msg = str(info.value)
    assert "config.layerdrop=0.25" in msg and "`config.layerdrop = 0.0`" in msg
    model.config.layerdrop = 0.0
    assert len(trace(model, (torch.randn(3, 4),)).params) == 4


class MaskedRows(nn.Module):
    """Pools the rows a mask picks (``h[mask]``, as HF BART's classifier picks its end-of-sentence rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask):
        return self.fc(x)[mask].sum()


def test_a_data_dependent_shape_names_the_op_and_the_line() -> None:
    x, mask = torch.randn(3, 5, 4), torch.rand(3, 5) > 0.5
    with pytest.raises(TraceError) as info:
        trace(MaskedRows(), (x, mask))
    msg = str(info.value)
    assert "depends on the values of the data" in msg and "at: test_tracing.py:" in msg
    assert "`return self.fc(x)[mask].sum()`" in msg and "argmax" in msg


class LabelledRows(nn.Module):
    """Keeps the rows whose label is not negative and branches on how many there are, as HF DeBERTa-v2's
    classification loss does (``(labels >= 0).nonzero()`` then ``if label_index.size(0) > 0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels):
        index = (labels >= 0).nonzero()
        if index.size(0) > 0:
            return self.fc(x)[index.view(-1)].sum()
        return self.fc(x).sum() * 0


def test_a_branch_on_a_data_dependent_size_names_the_line() -> None:
    """torch reports such a guard as "Caused by: (file:line in forward)" with a shortened path: the error
    names the file, the line and its code."""
    with pytest.raises(TraceError) as info:
        trace(LabelledRows(), (torch.randn(5, 4), torch.arange(5)))
    msg = str(info.value)
    assert "at: test_tracing.py:" in msg and "`if index.size(0) > 0:`" in msg, msg
    assert "branches on tensor values" in msg


def test_fx_fallback_refuses_to_freeze_a_random_draw(monkeypatch):
    """Symbolic tracing runs ``torch.rand([])`` once, at trace time: the branch on it would be taken the same
    way in every step (a layer always kept, or always dropped). The fallback refuses instead."""

    def fail(*a, **k):
        raise RuntimeError("export disabled for this test")

    monkeypatch.setattr(torch.export, "export", fail)
    with pytest.raises(TraceError, match=r"draws a random number \(rand\) on no traced value"):
        trace(LayerDropStack(), (torch.randn(3, 4),))
    stack = LayerDropStack()
    stack.config.layerdrop = 0.0
    assert [op.target for op in trace(stack, (torch.randn(3, 4),)).ops].count("aten.linear.default") == 2


def test_non_scalar_output_needs_a_loss():
    with pytest.raises(TraceError, match="scalar"):
        trace(MLP(), (torch.randn(5, 8),))


def test_fx_fallback_maps_to_the_same_aten_names(monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("export disabled for this test")

    monkeypatch.setattr(torch.export, "export", fail)
    g = trace(MLP(), (torch.randn(5, 8),), loss=lambda o: o.sum())
    assert isinstance(g.program, torch.fx.GraphModule)
    assert [op.target for op in g.ops] == [
        "aten.linear.default",
        "aten.relu.default",
        "aten.linear.default",
        "aten.sum.default",
    ]
    assert g.ops[0].module == "fc1" and g.ops[0].flops == 2 * 5 * 16 * 8 + 5 * 16
    assert [g.tensors[t].name for t in g.params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert g.tensors[g.loss].shape == ()


def test_exported_program_is_accepted():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = MLP()

        def forward(self, x):
            return self.m(x).sum()

    ep = torch.export.export(WithLoss(), (torch.randn(3, 8),))
    g = trace(ep, ())
    assert [op.target for op in g.ops][-1] == "aten.sum.default"
    assert g.tensors[g.params[0]].name == "m.fc1.weight"


def test_a_compiled_model_traces_as_its_own_module() -> None:
    """``torch.compile(model)`` wraps the model (``OptimizedModule``), whose parameters are named
    ``_orig_mod.<name>`` and whose input was not named by the model's signature: pins by the model's own
    names failed. The wrapped module is traced instead (nothing is compiled)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(6, 4)
    plain = trace(model, (x,), loss=lambda y: y.square().mean())
    compiled = trace(torch.compile(model), (x,), loss=lambda y: y.square().mean())
    assert [t.name for t in compiled.tensors] == [t.name for t in plain.tensors]
    assert compiled.fingerprint == plain.fingerprint
