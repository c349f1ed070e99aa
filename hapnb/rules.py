"""Per-op sharding rules: which forms an op accepts and produces, its flops, and how it runs locally.

(Interface skeleton; the rule tables are filled in by the rules work.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .forms import Form

__all__ = ["Strategy"]


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on every device: the input forms it needs and the output forms it makes.

    ``inputs`` has one form per entry of ``Op.inputs``; ``outputs`` one per entry of ``Op.outputs``.
    ``scaled_flops`` are the training (forward + backward) flops that scale with the device's sharding
    ratio (work on a sharded dim); ``fixed_flops`` those every device does in full. ``sfb`` marks a
    sufficient-factor-broadcasting strategy: its replicated weight inputs skip the gradient all-reduce,
    because the strategy all-gathers the sufficient factors (its G input and the output gradient) in the
    backward and computes the full weight gradient on every device.
    """

    name: str
    inputs: tuple[Form, ...]
    outputs: tuple[Form, ...]
    scaled_flops: float = 0.0
    fixed_flops: float = 0.0
    sfb: bool = False

    def __str__(self) -> str:
        ins = ",".join(map(str, self.inputs))
        outs = ",".join(map(str, self.outputs))
        return f"{self.name}: ({ins}) -> ({outs})"
