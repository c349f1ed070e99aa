"""The Graph under construction while a traced program is walked: :class:`_Builder` gives every tensor a
unique name, records each op with its canonical target, family and analytic flops (from :mod:`hapnb.rules`),
and finishes with the consumers and the fingerprint, after unfolding the folds of leading dims around
row-wise ops (:mod:`.folds`: seq-first attention keeps the batch sharded). Every tracing path fills one:
torch.export (:mod:`.exported`), the fx fallback (:mod:`.fx_fallback`) and the meta recorder (:mod:`.record`).

>>> module_path("model.encoder.layer.0")
'encoder.layer.0'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir.graph import Graph, Op, TensorArg, TensorRef, TraceError, fingerprint
from .folds import unfold_rows


def module_path(path: str) -> str:
    """Module path inside the user's model: drop the wrapper prefix ``model.``."""
    for junk in ("L['self'].", "L__self___"):
        if path.startswith(junk):
            path = path[len(junk) :]
    if path == "model":
        return ""
    if path.startswith("model."):
        return path[len("model.") :]
    return path


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _canonical(target: Any) -> str:
    import torch

    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.linear.default"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target}.default"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or str(target)
    return f"{mod}.{name}" if mod else name


@dataclass(frozen=True)
class _FxState:
    """A parameter of a leaf module in the fx fallback (resolved to its tensor id)."""

    tid: int


class _Builder:
    """Accumulates TensorRefs and Ops while walking an fx graph."""

    def __init__(self) -> None:
        self.tensors: list[dict[str, Any]] = []
        self.ops: list[Op] = []
        self.node_tensor: dict[Any, int] = {}  # fx node (or (node, item)) -> tensor id
        self.folded: dict[Any, Any] = {}  # fx node -> python value (sym ints etc.)
        self.names: set[str] = set()

    def add_tensor(self, name: str, val: Any, role: str, requires_grad: bool = False) -> int:
        base, k = name, 1
        while name in self.names:
            name = f"{base}_{k}"
            k += 1
        self.names.add(name)
        tid = len(self.tensors)
        shape = tuple(int(s) for s in val.shape)
        self.tensors.append(
            dict(
                id=tid,
                name=name,
                shape=shape,
                dtype=_dtype_name(val.dtype),
                role=role,
                producer=None,
                requires_grad=requires_grad,
            )
        )
        return tid

    def convert(self, value: Any, inputs: list[int]) -> Any:
        """Replace fx nodes in an argument by TensorArg placeholders / folded values."""
        import torch.fx as fx

        if isinstance(value, _FxState):
            inputs.append(value.tid)
            return TensorArg(len(inputs) - 1)
        if isinstance(value, fx.Node):
            if value in self.node_tensor:
                tid = self.node_tensor[value]
                inputs.append(tid)
                return TensorArg(len(inputs) - 1)
            if value in self.folded:
                return self.folded[value]
            raise TraceError(f"argument {value.name} has no traced value (op {value.op} {value.target})")
        if isinstance(value, (list, tuple)):
            return tuple(self.convert(v, inputs) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, self.convert(v, inputs)) for k, v in value.items()))
        return value

    def add_op(
        self,
        name: str,
        target: str,
        args: tuple,
        kwargs: dict,
        outs: list[tuple[str, Any, Any]],
        module: str,
        items: tuple[int, ...] = (),
        origin: str = "",
    ) -> None:
        from .. import rules

        inputs: list[int] = []
        cargs = tuple(self.convert(a, inputs) for a in args)
        ckw = tuple(sorted((k, self.convert(v, inputs)) for k, v in kwargs.items()))
        out_ids = []
        for out_name, key, val in outs:
            tid = self.add_tensor(out_name, val, "activation")
            self.tensors[tid]["producer"] = len(self.ops)
            self.node_tensor[key] = tid
            out_ids.append(tid)
        in_shapes = [self.tensors[t]["shape"] for t in inputs]
        out_shapes = [self.tensors[t]["shape"] for t in out_ids]
        try:
            fl = float(rules.flops(target, in_shapes, out_shapes, cargs, ckw))
        except Exception:  # a flop formula must never break tracing
            fl = 0.0
        self.ops.append(
            Op(
                id=len(self.ops),
                name=name,
                target=target,
                inputs=tuple(inputs),
                outputs=tuple(out_ids),
                args=cargs,
                kwargs=ckw,
                module=module,
                flops=fl,
                family=rules.family(target),
                output_items=items,
                origin=origin,
            )
        )

    def finish(self, inputs: list[int], params: list[int], loss: int, program: Any, name: str) -> Graph:
        consumers: dict[int, list[int]] = {}
        for op in self.ops:
            for t in op.inputs:
                lst = consumers.setdefault(t, [])
                if op.id not in lst:
                    lst.append(op.id)
        tensors = tuple(TensorRef(consumers=tuple(consumers.get(d["id"], ())), **d) for d in self.tensors)
        ops = tuple(self.ops)
        graph = Graph(
            tensors=tensors,
            ops=ops,
            inputs=tuple(inputs),
            params=tuple(params),
            loss=loss,
            program=program,
            fingerprint=fingerprint(tensors, ops),
            name=name,
        )
        return unfold_rows(graph)  # every tracing path: a fold of the batch around row-wise ops (.folds)


def _loss_of(b: _Builder, out_ids: list[int], where: str) -> int:
    cands = [
        t
        for t in out_ids
        if b.tensors[t]["shape"] == () and b.tensors[t]["dtype"].startswith(("float", "bfloat"))
    ]
    if len(cands) != 1:
        desc = ", ".join(f"{b.tensors[t]['name']}{list(b.tensors[t]['shape'])}" for t in out_ids) or "nothing"
        raise TraceError(
            f"{where}: the traced program must return exactly one scalar floating-point loss, but it returns "
            f"{desc}. Fix: pass loss=fn(output, *targets) to hapnb.trace, or make forward return a scalar."
        )
    return cands[0]
