"""Small synthetic programs (hand-built graphs with simple strategy tables) for search/LP tests.

They do not need tracing: ops are matmuls, pointwise ops and a final sum, with the strategies of the
paper's Fig. 9 (data-parallel, column, row/reduction, replicated), so the search and the LP can be
checked against brute force independently of the rule tables.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from hapnb.cost.model import Load, Step
from hapnb.ir.forms import G, I, R
from hapnb.ir.graph import Graph, Op, TensorArg, TensorRef, fingerprint
from hapnb.rules import Strategy


def strategies(graph: Graph, op: Op) -> list[Strategy]:
    t = graph.tensors
    F = op.flops
    out: list[Strategy] = [
        Strategy("replicated", tuple(I for _ in op.inputs), tuple(I for _ in op.outputs), 0.0, 3 * F)
    ]
    if op.target == "mm":  # x[b,k] @ w[k,n]
        out += [
            Strategy("data", (G(0), I), (G(0),), 3 * F, 0.0),
            Strategy("column", (I, G(1)), (G(1),), 3 * F, 0.0),
            Strategy("row", (G(1), G(0)), (R,), 3 * F, 0.0),
            Strategy("linear-R", (R, I), (R,), 0.0, 3 * F),
            Strategy("sfb", (G(0), I), (G(0),), 2 * F, F, sfb=True),
        ]
    elif op.target == "relu":
        nd = len(t[op.inputs[0]].shape)
        out += [Strategy(f"G{d}", (G(d),), (G(d),), 3 * F, 0.0) for d in range(nd)]
    elif op.target == "add":
        nd = len(t[op.inputs[0]].shape)
        out += [Strategy(f"G{d}", (G(d), G(d)), (G(d),), 3 * F, 0.0) for d in range(nd)]
        out += [Strategy("R", (R, R), (R,), 0.0, 3 * F)]
    elif op.target == "sum":
        nd = len(t[op.inputs[0]].shape)
        out += [Strategy(f"G{d}", (G(d),), (R,), 3 * F, 0.0) for d in range(nd)]
        out += [Strategy("R", (R,), (R,), 0.0, 3 * F)]
    return out


class Builder:
    def __init__(self) -> None:
        self.tensors: list[dict] = []
        self.ops: list[dict] = []

    def tensor(self, name: str, shape: tuple[int, ...], role: str) -> int:
        self.tensors.append(dict(name=name, shape=shape, role=role, producer=None, consumers=[]))
        return len(self.tensors) - 1

    def op(self, target: str, inputs: list[int], shape: tuple[int, ...], flops: float) -> int:
        oid = len(self.ops)
        out = self.tensor(f"{target}_{oid}", shape, "activation")
        self.tensors[out]["producer"] = oid
        for i in inputs:
            self.tensors[i]["consumers"].append(oid)
        self.ops.append(dict(target=target, inputs=inputs, outputs=[out], flops=flops))
        return out

    def build(self, loss: int, name: str = "synthetic") -> Graph:
        ts = tuple(
            TensorRef(
                i,
                d["name"],
                d["shape"],
                "float32",
                d["role"],
                d["producer"],
                tuple(dict.fromkeys(d["consumers"])),
                d["role"] == "param",
            )
            for i, d in enumerate(self.tensors)
        )
        ops = tuple(
            Op(
                i,
                f"{d['target']}_{i}",
                d["target"],
                tuple(d["inputs"]),
                tuple(d["outputs"]),
                tuple(TensorArg(k) for k in range(len(d["inputs"]))),
                (),
                "",
                float(d["flops"]),
                "test",
            )
            for i, d in enumerate(self.ops)
        )
        inputs = tuple(t.id for t in ts if t.role == "input")
        params = tuple(t.id for t in ts if t.role == "param")
        return Graph(ts, ops, inputs, params, loss, None, fingerprint(ts, ops), name)


def mlp_graph(batch: int = 64, dims: tuple[int, ...] = (256, 512, 256), name: str = "mlp") -> Graph:
    b = Builder()
    x = b.tensor("x", (batch, dims[0]), "input")
    h = x
    for k in range(len(dims) - 1):
        w = b.tensor(f"w{k}", (dims[k], dims[k + 1]), "param")
        h = b.op("mm", [h, w], (batch, dims[k + 1]), 2.0 * batch * dims[k] * dims[k + 1])
        if k < len(dims) - 2:
            h = b.op("relu", [h], (batch, dims[k + 1]), float(batch * dims[k + 1]))
    loss = b.op("sum", [h], (), float(batch * dims[-1]))
    return b.build(loss, name)


def random_graph(seed: int) -> Graph:
    """A small random program: matmul chains with relus and a residual add, then a sum loss."""
    rnd = random.Random(seed)
    b = Builder()
    batch = rnd.choice([4, 8, 16, 64])
    d = rnd.choice([4, 8, 32, 128])
    x = b.tensor("x", (batch, d), "input")
    h = x
    skip = None
    for k in range(rnd.randint(1, 3)):
        d2 = rnd.choice([4, 8, 32, 128, 512])
        w = b.tensor(f"w{k}", (d, d2), "param")
        h = b.op("mm", [h, w], (batch, d2), 2.0 * batch * d * d2)
        d = d2
        if rnd.random() < 0.5:
            h = b.op("relu", [h], (batch, d), float(batch * d))
        if skip is not None and b.tensors[skip]["shape"] == (batch, d) and rnd.random() < 0.7:
            h = b.op("add", [h, skip], (batch, d), float(batch * d))
        skip = h
    loss = b.op("sum", [h], (), float(batch * d))
    return b.build(loss, f"random{seed}")


def gather_graph() -> Graph:
    """x -> mm -> sum: data parallel on x with ``w`` replicated, the sum replicated, so the activation is
    all-gathered between them (two stages)."""
    b = Builder()
    x = b.tensor("x", (1024, 256), "input")
    w = b.tensor("w", (256, 256), "param")
    h = b.op("mm", [x, w], (1024, 256), 2.0 * 1024 * 256 * 256)
    loss = b.op("sum", [h], (), 1024 * 256.0)
    return b.build(loss)


def dp_program(th) -> list[Step]:  # noqa: ANN001 - a Theory
    """Every op data-parallel on the batch dim (strategy ``data`` or ``G0``); inputs and weights loaded."""
    g = th.graph
    prog = []
    for op in g.ops:
        s = next(s for s in th.strategies[op.id] if s.name in ("data", "G0"))
        loads = tuple(
            Load(t, f) for t, f in zip(op.inputs, s.inputs) if g.tensors[t].role in ("input", "param")
        )
        prog.append(Step(op.id, s, loads))
    return prog


#: zoo.TINY["mlp"]'s inputs batch-sharded and every weight replicated: plain data parallelism
DP_PINS = {
    "x": "G0",
    "y": "G0",
    **{f"{m}.{k}": "I" for m in ("layers.0", "layers.1", "head") for k in ("weight", "bias")},
}


class BNNet(nn.Module):
    """conv -> training batch norm -> relu -> pool -> linear -> cross-entropy: the smallest CNN whose batch
    norm needs statistics over the whole batch (it replicated the batch before batch norm had a rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)
