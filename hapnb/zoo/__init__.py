"""Benchmark models of the HAP paper as plain PyTorch, and loading of user model factories.

Every model here *includes its loss*: ``model(*example_inputs)`` returns the scalar training loss, and
the targets are among the example inputs. Weights are created under ``torch.manual_seed(seed)`` and
inputs from a generator seeded with ``seed``, so a build is reproducible; a :class:`ModelSpec` (stored in
plans) records exactly how to rebuild it.

>>> import torch
>>> from hapnb import zoo
>>> model, inputs, spec = zoo.build("mlp", devices=2, layers=2, hidden=16, input=8, batch=4)
>>> loss = model(*inputs)
>>> loss.shape, spec.to_json()["name"]
(torch.Size([]), 'mlp')
>>> model2, inputs2, _ = zoo.build_spec(zoo.ModelSpec.from_json(spec.to_json()))
>>> bool(torch.equal(model2(*inputs2), loss))
True

Models (paper sizes by default: hidden 768, 12 heads, ff 3072, seq 128, dropout 0.1, batch 32/device):

* ``mlp`` — ``layers`` x (Linear + ReLU) and a Linear head on a random input; the smoke model.
* ``vgg19`` — CIFAR-10 VGG19 (3x3 convs, 5 max-pools, adaptive avg-pool 7x7, 25088-4096-4096-10).
* ``vit`` — CIFAR ViT: 4x4 patches by a strided conv, cls token, learned positions, post-LN encoder.
* ``bert`` — the paper's "BERT-base", a causal LM on a 33,280-word vocabulary (WikiText-2 padded).
* ``bert-moe`` — ``bert`` with a top-2 GShard MoE FFN on every odd layer (E = 2 x devices experts).
* ``gpt`` — a pre-norm GPT with fused qkv and ``scaled_dot_product_attention(is_causal=True)``.
* ``lm`` — the LM measured on an H100 (hapnb/data/h100-lm-steps.json, docs/benchmarks/fidelity.md): embedding
  (vocab 8192) + learned positions, post-LN ReLU encoder layers (heads = hidden // 64, no mask, dropout 0),
  linear head, summed cross-entropy over the next token.

Options (``build`` keywords): ``devices`` (default 8), ``seed`` (0), ``dtype`` ("float32"), ``batch``
(global, default 32 x devices), ``reduction`` ("mean" or "sum" for the loss) and per model:

=========  ====================================================================================
mlp        layers 4, hidden 1024, input 1024, classes 10
vgg19      image 32 (>= 32), classes 10, width 1.0 (channel multiplier), hidden 4096, dropout 0.1
vit        layers 12, hidden 768, heads 12, ff 4*hidden, dropout 0.1, image 32, patch 4, classes 10,
           attention "sdpa"
bert       layers 12, seq 128, hidden 768, heads 12, ff 4*hidden, dropout 0.1, vocab 33280,
           attention "sdpa"
bert-moe   as bert, plus experts 2*devices, capacity_factor 2.5 (capacity = ceil(seq/experts*factor))
gpt        layers 12, seq 128, hidden 768, heads 12, ff 4*hidden, dropout 0.1, vocab 32000
lm         layers 2, seq 64, hidden 256, heads hidden//64, ff 4*hidden, dropout 0.0, vocab 8192,
           reduction "sum", attention "sdpa"
=========  ====================================================================================

The default ``attention="sdpa"`` builds the encoder layers from :class:`PostLNEncoderLayer`; the
alternative ``attention="torch"`` uses ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` as the
paper does: their export transposes to sequence-first and folds batch into other dims (``view [S, B*H, hd]``,
``permute`` + ``reshape [S*B, D]``); tracing unfolds the second fold around the output projection
(:mod:`hapnb.tracing.folds`), so the batch stays sharded there too. ``attention="sdpa"``
swaps in :class:`PostLNEncoderLayer` / :class:`SelfAttention`: same parameters, same math, and a
batch-major graph (linear, split, view, transpose, SDPA, transpose, reshape, linear).

The default ``bert`` vocabulary follows the original: WikiText-2's 33,278 words padded to
``devices * (33278 // devices + 1)`` (33,280 for 1, 2, 4, 8 or 16 devices).

The aten ops each model exports to are listed in :mod:`hapnb.zoo.opslist` (and docs/zoo-ops.md).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .factories import FactoryError, call_factory, import_factory, load_factory
from .models import GPT, LM, MLP, VGG19, CausalLM, MoEFFN, ViT
from .opslist import exported_ops

__all__ = [
    "ModelSpec", "ZOO_NAMES", "FactoryError", "TINY", "build", "build_spec", "rebuild", "model_spec",
    "load_factory", "exported_ops", "zoo_options", "MoEFFN",
]  # fmt: skip

ZOO_NAMES: tuple[str, ...] = ("mlp", "vgg19", "vit", "bert", "bert-moe", "gpt", "lm")

# Options accepted by every zoo model besides its own (build's explicit keywords included).
_COMMON = ("devices", "seed", "dtype", "batch", "reduction")
_LM = ("layers", "seq", "hidden", "heads", "ff", "dropout", "vocab")
_OPTIONS: dict[str, tuple[str, ...]] = {
    "mlp": ("layers", "hidden", "input", "classes"),
    "vgg19": ("image", "classes", "width", "hidden", "dropout"),
    "vit": ("layers", "hidden", "heads", "ff", "dropout", "image", "patch", "classes", "attention"),
    "bert": (*_LM, "attention"),
    "bert-moe": (*_LM, "attention", "experts", "capacity_factor"),
    "gpt": _LM,
    "lm": (*_LM, "attention"),
}
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_WIKITEXT2_WORDS = 33278  # WikiText-2 word vocabulary incl. <eos>, as in the original benchmark


def zoo_options(name: str) -> tuple[str, ...]:
    """The option names :func:`build` accepts for zoo model ``name`` (sorted).

    >>> zoo_options("mlp")
    ('batch', 'classes', 'devices', 'dtype', 'hidden', 'input', 'layers', 'reduction', 'seed')
    """
    if name not in _OPTIONS:
        raise ValueError(f"unknown zoo model {name!r}; valid names: {', '.join(ZOO_NAMES)}")
    return tuple(sorted({*_COMMON, *_OPTIONS[name]}))


# ---------------------------------------------------------------------------------------------------
# ModelSpec


def _is_json_value(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_is_json_value(x) for x in v)
    return False


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


def _thaw(v: Any) -> Any:
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class ModelSpec:
    """A JSON-able description of how to rebuild a model (stored inside plans).

    ``name`` is a zoo name or ``"package.module:factory"``; ``options`` are the sorted ``(key, value)``
    pairs given to :func:`build` (``devices`` and ``seed`` are always recorded, other options only when
    given, so defaults are re-derived on rebuild).

    >>> s = ModelSpec("bert", (("layers", 2), ("seed", 0)))
    >>> ModelSpec.from_json(s.to_json()) == s
    True
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        opts = tuple(sorted((str(k), _freeze(v)) for k, v in self.options))
        object.__setattr__(self, "options", opts)

    def to_json(self) -> dict:
        """``{"name": ..., "options": {key: value}}`` (plain JSON types only)."""
        return {"name": self.name, "options": {k: _thaw(v) for k, v in self.options}}

    @staticmethod
    def from_json(d: dict) -> ModelSpec:
        """Inverse of :meth:`to_json`; raises ValueError on a malformed object."""
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            raise ValueError(f"a model spec must be an object with a string 'name', got {d!r}")
        opts = d.get("options", {})
        if not isinstance(opts, dict):
            raise ValueError(f"model spec 'options' must be an object, got {opts!r}")
        return ModelSpec(d["name"], tuple(opts.items()))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments for :func:`build`."""
        return dict(self.options)

    def __str__(self) -> str:
        opts = " ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}({opts})"


# ---------------------------------------------------------------------------------------------------
# build


def _need(cfg: dict[str, Any], key: str, kind: type, *, low: float = 1) -> Any:
    v = cfg[key]
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok or v < low:
        raise ValueError(
            f"option {key}={v!r} is invalid: expected {'an integer' if kind is int else 'a number'} >= {low}"
        )
    return v


def _resolve(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """Defaults for ``name`` updated with the given options, validated."""
    devices = _need(given, "devices", int)
    _need(given, "seed", int, low=0)
    cfg: dict[str, Any] = {"devices": devices, "seed": given["seed"], "dtype": "float32"}
    cfg.update(batch=32 * devices, reduction="mean")
    if name == "mlp":
        cfg.update(layers=4, hidden=1024, input=1024, classes=10)
    elif name == "vgg19":
        cfg.update(image=32, classes=10, width=1.0, hidden=4096, dropout=0.1)
    elif name == "vit":
        cfg.update(layers=12, hidden=768, heads=12, ff=None, dropout=0.1, image=32, patch=4, classes=10)
        cfg.update(attention="sdpa")
    elif name == "lm":
        cfg.update(layers=2, seq=64, hidden=256, heads=None, ff=None, dropout=0.0, vocab=8192)
        cfg.update(attention="sdpa", reduction="sum")
    else:
        vocab = devices * (_WIKITEXT2_WORDS // devices + 1) if name != "gpt" else 32000
        cfg.update(layers=12, seq=128, hidden=768, heads=12, ff=None, dropout=0.1, vocab=vocab)
        if name != "gpt":
            cfg.update(attention="sdpa")
        if name == "bert-moe":
            cfg.update(experts=2 * devices, capacity_factor=2.5)
    cfg.update({k: v for k, v in given.items() if v is not None})
    if cfg.get("ff", 0) is None:
        cfg["ff"] = 4 * cfg["hidden"]
    if name == "lm" and cfg.get("heads") is None:
        cfg["heads"] = max(1, cfg["hidden"] // 64)

    _need(cfg, "batch", int)
    if cfg["dtype"] not in _DTYPES:
        raise ValueError(f"option dtype={cfg['dtype']!r} is invalid: expected one of {', '.join(_DTYPES)}")
    if cfg.get("attention", "torch") not in ("torch", "sdpa"):
        raise ValueError(f"option attention={cfg['attention']!r} is invalid: expected 'torch' or 'sdpa'")
    if cfg["reduction"] not in ("mean", "sum"):
        raise ValueError(f"option reduction={cfg['reduction']!r} is invalid: expected 'mean' or 'sum'")
    for key in ("layers", "hidden", "heads", "ff", "input", "classes", "seq", "vocab", "experts", "patch"):
        if key in cfg:
            _need(cfg, key, int)
    for key in ("dropout", "width", "capacity_factor"):
        if key in cfg:
            _need(cfg, key, float, low=0)
    if "dropout" in cfg and cfg["dropout"] >= 1:
        raise ValueError(f"option dropout={cfg['dropout']!r} is invalid: expected 0 <= dropout < 1")
    if "heads" in cfg and cfg["hidden"] % cfg["heads"]:
        raise ValueError(
            f"option heads={cfg['heads']} must divide hidden={cfg['hidden']} (attention splits hidden)"
        )
    if name == "vgg19":
        _need(cfg, "image", int, low=32)  # five 2x2 max-pools
    if name == "vit":
        _need(cfg, "image", int)
        if cfg["image"] % cfg["patch"]:
            raise ValueError(f"option patch={cfg['patch']} must divide image={cfg['image']}")
    if name == "bert-moe":
        cfg["capacity"] = math.ceil(cfg["seq"] / cfg["experts"] * cfg["capacity_factor"])
        if cfg["capacity"] < 1:
            raise ValueError(f"capacity_factor={cfg['capacity_factor']} gives an expert capacity of 0")
    return cfg


def _make(name: str, cfg: dict[str, Any], gen: torch.Generator) -> tuple[nn.Module, tuple]:
    b, red = cfg["batch"], cfg["reduction"]
    if name == "mlp":
        model: nn.Module = MLP(cfg["layers"], cfg["input"], cfg["hidden"], cfg["classes"], red)
        x = torch.randn(b, cfg["input"], generator=gen)
        return model, (x, torch.randint(0, cfg["classes"], (b,), generator=gen))
    if name in ("vgg19", "vit"):
        if name == "vgg19":
            model = VGG19(cfg["width"], cfg["hidden"], cfg["classes"], cfg["dropout"], red)
        else:
            keys = ("layers", "hidden", "heads", "ff", "dropout", "image", "patch", "classes")
            model = ViT(*(cfg[k] for k in keys), red, cfg["attention"])
        img = torch.randn(b, 3, cfg["image"], cfg["image"], generator=gen)
        return model, (img, torch.randint(0, cfg["classes"], (b,), generator=gen))
    keys = ("layers", "seq", "hidden", "heads", "ff", "dropout", "vocab")
    if name == "gpt":
        model = GPT(*(cfg[k] for k in keys), red)
    elif name == "lm":
        model = LM(*(cfg[k] for k in keys), red, attention=cfg["attention"])
        tokens = torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=gen)
        return model, (tokens, tokens.roll(-1, 1))
    elif name == "bert":
        model = CausalLM(*(cfg[k] for k in keys), red, attention=cfg["attention"])
    else:
        moe = dict(experts=cfg["experts"], capacity=cfg["capacity"], attention=cfg["attention"])
        model = CausalLM(*(cfg[k] for k in keys), red, **moe)
    tokens = torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=gen)
    return model, (tokens, torch.randint(0, cfg["vocab"], (b, cfg["seq"]), generator=gen))


def build(
    name: str,
    *,
    devices: int = 8,
    layers: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> tuple[nn.Module, tuple[torch.Tensor, ...], ModelSpec]:
    """Build zoo model ``name`` (or load factory ``"package.module:factory"``).

    Returns ``(model, example_inputs, spec)`` with ``model(*example_inputs)`` the scalar loss, the model
    in train() mode. ``batch`` is global (default 32 x devices); ``overrides`` set other options (see
    :func:`zoo_options`), e.g. ``hidden=32, heads=4, vocab=64`` for a tiny config. Unknown names or
    options raise ValueError listing the valid ones.

    For a factory path, ``layers``/``batch``/``seq`` (when given) and ``overrides`` are passed to the
    factory as keywords, ``devices`` and ``seed`` only if its signature names them; the factory runs
    under ``torch.manual_seed(seed)``.

    >>> model, (x, y), spec = build("mlp", devices=1, hidden=8, input=4, layers=1)
    >>> tuple(x.shape), str(spec)
    ((32, 4), 'mlp(devices=1 hidden=8 input=4 layers=1 seed=0)')
    """
    spec = model_spec(name, devices=devices, layers=layers, batch=batch, seq=seq, seed=seed, **overrides)
    given = {k: _thaw(v) for k, v in spec.options}

    if ":" in name:
        fkw = {k: v for k, v in given.items() if k not in ("devices", "seed")}
        factory = import_factory(name)
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):  # builtins without a signature
            params = {}
        for k in ("devices", "seed"):
            if k in params:
                fkw[k] = given[k]
        torch.manual_seed(seed)
        model, inputs = call_factory(name, factory, fkw)
        return model, inputs, spec

    if name not in _OPTIONS:
        raise ValueError(
            f"unknown model {name!r}: valid zoo names are {', '.join(ZOO_NAMES)}, "
            "or give a factory as 'package.module:factory'"
        )
    valid = zoo_options(name)
    bad = sorted(set(given) - set(valid))
    if bad:
        raise ValueError(
            f"model {name!r} does not take option(s) {', '.join(bad)}; valid: {', '.join(valid)}"
        )
    cfg = _resolve(name, given)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, inputs = _make(name, cfg, gen)
    dtype = _DTYPES[cfg["dtype"]]
    if dtype != torch.float32:
        model = model.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    model.train()
    model.zoo_config = dict(cfg)  # resolved options (defaults filled in), for display
    return model, inputs, spec


def model_spec(name: str, **options: Any) -> ModelSpec:
    """The :class:`ModelSpec` :func:`build` records for ``build(name, **options)``, made without building
    (options are checked to be JSON values only): ``model_spec("bert", devices=2)`` is
    ``bert(devices=2 seed=0)``."""
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    given: dict[str, Any] = {"devices": options.pop("devices", 8), "seed": options.pop("seed", 0)}
    given.update({k: v for k, v in options.items() if v is not None or k not in ("layers", "batch", "seq")})
    for k, v in given.items():
        if not _is_json_value(v):
            raise ValueError(
                f"option {k}={v!r} of model {name!r} is not a JSON value (number, string, bool or list); "
                "plans must be able to record it"
            )
    return ModelSpec(name, tuple(given.items()))


def build_spec(spec: ModelSpec) -> tuple[nn.Module, tuple[torch.Tensor, ...], ModelSpec]:
    """Rebuild the model a :class:`ModelSpec` describes (same seed -> same weights and inputs)."""
    kwargs = spec.kwargs
    kwargs = {k: (_thaw(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
    return build(spec.name, **kwargs)


def rebuild(
    spec: dict | None, missing: Exception | None = None
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Model and inputs of a plan's recorded spec (JSON); raises ``missing`` (else ValueError) if there is none."""
    if not spec:
        raise missing or ValueError('no model spec ({"name": ..., "options": ...}) to rebuild the model from')
    return build_spec(ModelSpec.from_json(spec))[:2]


TINY: dict[str, dict[str, Any]] = {
    "mlp": dict(layers=2, hidden=32, input=16, batch=8),
    "vgg19": dict(width=1 / 16, hidden=32, batch=4),
    "vit": dict(layers=2, hidden=32, heads=4, image=8, batch=8),
    "bert": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8),
    "bert-moe": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8, experts=4),
    "gpt": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8),
    "lm": dict(layers=2, hidden=32, heads=4, vocab=64, seq=8, batch=8),
}
"""Small configurations of every zoo model (fast to build, trace and run; used by tests)."""
