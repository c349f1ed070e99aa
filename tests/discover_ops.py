"""Custom ops (``torch.library``) without hand rules, for tests/test_discover.py and its verify workers.

``hapnb_test::scaled_tanh(x, w) = tanh(x) * w`` (elementwise, ``w`` broadcast over the last dim) and
``hapnb_test::colnorm(x) = x / sum(|x|, dim 0)`` (normalizes over dim 0: sharding dim 0 is wrong). Both
have a fake impl (for torch.export) and autograd. ``CALLS`` records the shape of every ``x`` the CPU
impls see, so tests can count runs and see the splits discovery used.
"""

from __future__ import annotations

from pathlib import Path

import torch

CALLS: list[tuple[str, tuple[int, ...]]] = []


@torch.library.custom_op("hapnb_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    CALLS.append(("scaled_tanh", tuple(x.shape)))
    return torch.tanh(x) * w


@scaled_tanh.register_fake
def _scaled_tanh_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def _scaled_tanh_bwd(ctx, g):  # noqa: ANN001, ANN202
    x, w = ctx.saved_tensors
    t = torch.tanh(x)
    return g * (1 - t * t) * w, (g * t).sum_to_size(w.shape)


scaled_tanh.register_autograd(_scaled_tanh_bwd, setup_context=_scaled_tanh_setup)


@torch.library.custom_op("hapnb_test::colnorm", mutates_args=())
def colnorm(x: torch.Tensor) -> torch.Tensor:
    CALLS.append(("colnorm", tuple(x.shape)))
    return x / (x.abs().sum(0, keepdim=True) + 1.0)


@colnorm.register_fake
def _colnorm_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class TanhMLP(torch.nn.Module):
    """linear -> the custom scaled tanh -> linear -> mean-square loss: batch-parallel when discovered."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, d)
        self.w = torch.nn.Parameter(torch.randn(d))
        self.fc2 = torch.nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.hapnb_test.scaled_tanh(self.fc1(x), self.w)
        return self.fc2(h).pow(2).mean()


def worker_argv() -> tuple[str, ...]:
    """How a verify worker starts (``python *worker_argv() BUNDLE ...``): import this module, which
    registers the ops, then run the hapnb worker."""
    here = str(Path(__file__).resolve().parent)
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import discover_ops; "
        "from hapnb.run.worker import main; sys.exit(main(sys.argv[1:]))"
    )
    return ("-c", code)
