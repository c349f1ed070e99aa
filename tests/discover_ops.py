"""Custom ops (``torch.library``) without hand rules, for tests/rules/test_discover.py and its verify workers.

``hapnb_test::scaled_tanh(x, w) = tanh(x) * w`` (elementwise, ``w`` broadcast over the last dim) and
``hapnb_test::colnorm(x) = x / sum(|x|, dim 0)`` (normalizes over dim 0: sharding dim 0 is wrong). Both
have a fake impl (for torch.export); scaled_tanh has autograd. ``hapnb_test::globalnorm(x) = x / (sum |x| + 1)``
couples every element (no sharding of it is exact: discovery rejects all) and has autograd. ``CALLS`` records the shape of every ``x`` the CPU
impls see, so tests can count runs and see the splits discovery used.
"""

from __future__ import annotations

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


@torch.library.custom_op("hapnb_test::globalnorm", mutates_args=())
def globalnorm(x: torch.Tensor) -> torch.Tensor:
    CALLS.append(("globalnorm", tuple(x.shape)))
    return x / (x.abs().sum() + 1.0)


@globalnorm.register_fake
def _globalnorm_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _globalnorm_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(inputs[0])


def _globalnorm_bwd(ctx, g):  # noqa: ANN001, ANN202
    (x,) = ctx.saved_tensors
    s = x.abs().sum() + 1.0
    return g / s - (g * x).sum() / (s * s) * torch.sign(x)


globalnorm.register_autograd(_globalnorm_bwd, setup_context=_globalnorm_setup)


class GlobalNormMLP(torch.nn.Module):
    """linear -> the custom global norm (no exact sharding) -> linear -> sum: the op runs replicated."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.ops.hapnb_test.globalnorm(self.a(x))).sum()
