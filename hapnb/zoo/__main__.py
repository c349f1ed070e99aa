"""``python -m hapnb.zoo``: the aten ops of every zoo model and example factory as markdown
(docs/zoo-ops.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import TINY, ZOO_NAMES, build, zoo_options
from .factories import load_factory
from .opslist import OPS_NOTES, exported_ops


def ops_markdown() -> str:
    """The aten ops of every zoo model and example factory, as markdown (for docs/zoo-ops.md)."""
    lines = [
        "# aten ops of the zoo models",
        "",
        f"`torch.export.export(model, inputs)` in train() mode, torch {torch.__version__}, small configs",
        "(`hapnb.zoo.TINY`; the ops do not depend on sizes). Regenerate the file with",
        "`python -m hapnb.zoo > docs/zoo-ops.md`.",
        "",
        OPS_NOTES,
    ]
    cases: list[tuple[str, Callable[[], tuple[nn.Module, tuple]]]] = []
    for name in ZOO_NAMES:
        cases.append((name, lambda name=name: build(name, devices=2, **TINY[name])[:2]))
        if "attention" in zoo_options(name):
            sdpa = lambda name=name: build(name, devices=2, attention="sdpa", **TINY[name])[:2]
            cases.append((f'{name} (attention="sdpa")', sdpa))
    for fac in ("examples.factories:small_convnet", "examples.factories:prenorm_lm"):
        cases.append((fac, lambda fac=fac: load_factory(fac)))
    for title, make in cases:
        model, inputs = make()
        ops = exported_ops(model, inputs, strict=False)
        strict_ops = exported_ops(model, inputs, strict=True)
        same = "same ops" if ops == strict_ops else f"strict differs: {sorted(set(strict_ops) ^ set(ops))}"
        lines.append(f"## {title}\n\nNon-strict and strict export both work ({same}).\n")
        lines.append(", ".join(f"`{op}`" for op in ops))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(ops_markdown())
