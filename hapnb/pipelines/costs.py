"""Layer costs for pipeline planning (issue 11, Ditto §5.1): the model cut into *units* at module
boundaries of its repeated blocks, and each unit's forward and backward time per device kind, its
parameters, the activations it keeps for the backward and the bytes that cross each cut, all read off
hapnb's one cost model (:class:`hapnb.cost.model.CostModel`), never a second one.

* **Units** (:func:`find_units`): the traced ops carry their module path. The container whose indexed
  children (``blocks.0``, ``blocks.1``, ...) cover the most indices is the model's stack of repeated
  blocks; unit 0 is everything before the first block (labelled ``"(input)"``), one unit per block, and a
  last unit from the first submodule called after the last block (e.g. ``ln_f``: final norm, head and
  loss). A model without such a container is cut at its top-level submodules. Every unit after the first
  begins where a submodule called once per forward begins: what ``torch.distributed.pipelining`` splits at.
* **Time**: the graph's data-parallel program (the ``dp_ev`` baseline's pins: parameters replicated,
  inputs sharded on the batch dim, found by hapnb's search) fixes, per op, which flops scale with a
  device's share of the micro-batch. A device of kind K running a unit on share ``r`` of a micro-batch
  takes ``const + coef * r`` seconds forward (and another such pair backward): the cost model's
  computation term of the op under that strategy on one device of K. Forward vs backward: each op's
  forward flops over its training flops (the rules' split; 1/3 for ops without flops).
* **Memory** (per unit, one whole micro-batch): parameter bytes (and per tensor, for the gradient
  all-reduce), the activations autograd saves and the backward's transient, from
  :meth:`CostModel.memory_breakdown` of the unit's steps.
* **Boundaries**: bytes of the activations produced before a cut and used after it, per micro-batch.

Big zoo models (:func:`model_costs`): when every device is flops-only, a zoo model whose blocks are
identical is traced with two blocks and the block unit repeated to the requested depth; this is exact
(the two traced blocks must price identically, or the full model is traced), and saves materializing e.g.
GPT-2 XL's 1.6 B weights. :data:`MODEL_PRESETS` names such configurations (``gpt2-xl``).

>>> from hapnb.hardware.cluster import Cluster
>>> lc = model_costs("gpt", Cluster.parse("2xV100"), micro_batch=2, layers=3, hidden=32, heads=4, seq=8,
...                  vocab=64)
>>> lc.names[:2], lc.names[-1], len(lc)
(('(input)', 'blocks.0'), 'ln_f', 5)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ..cost.model import CostModel, Step
from ..hardware.cluster import Cluster
from ..hardware.parts import Device
from ..ir.graph import Graph
from ..triples import Theory, theory

__all__ = [
    "UnitCost",
    "LayerCosts",
    "MODEL_PRESETS",
    "find_units",
    "layer_costs",
    "model_costs",
    "resolve_preset",
    "kind_keys",
]

#: Named model configurations: ``name -> (zoo model, options)``. GPT-2 XL as Ditto evaluates it (§7):
#: 48 layers, hidden 1600, 25 heads, sequence 1024, the GPT-2 vocabulary.
MODEL_PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = MappingProxyType(
    {
        "gpt2-xl": ("gpt", MappingProxyType(dict(layers=48, hidden=1600, heads=25, seq=1024, vocab=50257))),
    }
)

#: Forward share of an op's training time when it has no flops (backward = 2x forward, as the rules charge).
FORWARD_SHARE_DEFAULT = 1.0 / 3.0
#: Blocks traced when a big zoo model is priced from a shallow copy (see :func:`model_costs`).
TRACED_BLOCKS = 2


def kind_keys(cluster: Cluster) -> tuple[str, ...]:
    """Each device's class for planning (Ditto's device type): its kind, or, when devices of one kind
    differ in throughput, memory or device model (custom clusters), the kind with its TFLOP/s and a
    number.

    >>> kind_keys(Cluster.parse("2x5e12+1x3e12"))
    ('custom@5T', 'custom@5T', 'custom@3T')
    """
    variants: dict[str, list[tuple[Any, ...]]] = {}
    sig = []
    for d in cluster.devices:
        key = (d.flops, d.memory_bytes, d.model)
        sig.append(key)
        if key not in variants.setdefault(d.kind, []):
            variants[d.kind].append(key)
    out = []
    for d, key in zip(cluster.devices, sig):
        vs = variants[d.kind]
        if len(vs) == 1:
            out.append(d.kind)
            continue
        name = f"{d.kind}@{d.flops / 1e12:.4g}T"
        same = [v for v in vs if f"{d.kind}@{v[0] / 1e12:.4g}T" == name]
        out.append(name if len(same) == 1 else f"{name}#{same.index(key)}")
    return tuple(out)


@dataclass(frozen=True)
class UnitCost:
    """One unit's costs. ``forward``/``backward``: kind -> ``(const_s, coef_s)``, seconds
    ``const + coef * r`` on share ``r`` of one micro-batch; ``optimizer``: kind -> seconds of the
    optimizer step over the unit's parameters (device-model devices; 0 when flops-only)."""

    name: str
    forward: Mapping[str, tuple[float, float]]
    backward: Mapping[str, tuple[float, float]]
    param_bytes: int
    param_tensors: tuple[int, ...]  # bytes of each parameter tensor the unit owns
    activation_bytes: float  # saved for the backward, one whole micro-batch
    transient_bytes: float  # the backward's largest transient, one whole micro-batch
    boundary_bytes: int  # activation bytes entering this unit from earlier units, per micro-batch
    optimizer: Mapping[str, float] = field(default_factory=dict)

    def time(self, kind: str, share: float = 1.0) -> tuple[float, float]:
        """(forward, backward) seconds on one device of ``kind`` running ``share`` of a micro-batch."""
        f, b = self.forward[kind], self.backward[kind]
        return f[0] + f[1] * share, b[0] + b[1] * share


@dataclass(frozen=True)
class LayerCosts:
    """The units of a model with their costs per device kind, for one micro-batch size."""

    units: tuple[UnitCost, ...]
    kinds: tuple[str, ...]
    micro_batch: int
    source: str = "traced"  # how the costs were obtained (traced, or traced shallow and repeated)
    model: Mapping[str, Any] | None = None  # zoo.ModelSpec JSON of the full model, when known

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError("a model needs at least one unit")
        # prefix sums per kind: forward/backward const and coef, and memory per unit
        pre: dict[str, list[tuple[float, float, float, float]]] = {}
        for k in self.kinds:
            acc = [(0.0, 0.0, 0.0, 0.0)]
            for u in self.units:
                a = acc[-1]
                f, b = u.forward[k], u.backward[k]
                acc.append((a[0] + f[0], a[1] + f[1], a[2] + b[0], a[3] + b[1]))
            pre[k] = acc
        object.__setattr__(self, "_time_prefix", pre)
        mem = [(0, 0.0, 0)]  # parameter bytes, saved activation bytes, parameter tensors
        for u in self.units:
            a = mem[-1]
            mem.append((a[0] + u.param_bytes, a[1] + u.activation_bytes, a[2] + len(u.param_tensors)))
        object.__setattr__(self, "_mem_prefix", mem)

    def __len__(self) -> int:
        return len(self.units)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    def span_time(self, kind: str, a: int, b: int) -> tuple[float, float, float, float]:
        """Units ``[a, b)`` on ``kind``: ``(fwd_const, fwd_coef, bwd_const, bwd_coef)`` (seconds)."""
        p = self._time_prefix[kind]  # type: ignore[attr-defined]
        x, y = p[b], p[a]
        return x[0] - y[0], x[1] - y[1], x[2] - y[2], x[3] - y[3]

    def span_params(self, a: int, b: int) -> tuple[int, int]:
        """Units ``[a, b)``: (parameter bytes, parameter tensors)."""
        p = self._mem_prefix  # type: ignore[attr-defined]
        return p[b][0] - p[a][0], p[b][2] - p[a][2]

    def span_activations(self, a: int, b: int) -> float:
        p = self._mem_prefix  # type: ignore[attr-defined]
        return p[b][1] - p[a][1]

    def span_transient(self, a: int, b: int) -> float:
        return max(u.transient_bytes for u in self.units[a:b])

    def span_optimizer(self, kind: str, a: int, b: int) -> float:
        return math.fsum(u.optimizer.get(kind, 0.0) for u in self.units[a:b])

    def total_time(self, kind: str) -> float:
        """Forward + backward of the whole model on one device of ``kind`` (one micro-batch)."""
        fc, fk, bc, bk = self.span_time(kind, 0, len(self.units))
        return fc + fk + bc + bk

    def to_json(self) -> dict[str, Any]:
        return {
            "micro_batch": self.micro_batch,
            "source": self.source,
            "kinds": list(self.kinds),
            "units": [
                {
                    "name": u.name,
                    "forward_s": {k: u.time(k)[0] for k in self.kinds},
                    "backward_s": {k: u.time(k)[1] for k in self.kinds},
                    "param_bytes": u.param_bytes,
                    "activation_bytes": u.activation_bytes,
                    "boundary_bytes": u.boundary_bytes,
                }
                for u in self.units
            ],
        }

    def __str__(self) -> str:
        k = self.kinds[0]
        rows = [
            f"  {u.name:>16s}: fwd {u.time(k)[0] * 1e3:9.3f} ms, bwd {u.time(k)[1] * 1e3:9.3f} ms on {k}, "
            f"params {u.param_bytes / 2**20:8.1f} MiB, saved {u.activation_bytes / 2**20:8.1f} MiB"
            for u in self.units
        ]
        return "\n".join(
            [
                f"{len(self.units)} units, micro-batch {self.micro_batch} ({self.source}); kinds {', '.join(self.kinds)}"
            ]
            + rows
        )


# ----------------------------------------------------------------------------------------------------
# units


def _block_container(g: Graph) -> tuple[str, list[int]] | None:
    """The module container with the most indexed children (``blocks`` -> [0, 1, ...]), if any has 2+."""
    found: dict[str, set[int]] = {}
    for op in g.ops:
        parts = op.module.split(".") if op.module else []
        for k, p in enumerate(parts):
            if p.isdigit():
                found.setdefault(".".join(parts[:k]), set()).add(int(p))
    best = None
    for name, idx in found.items():
        if len(idx) < 2 or not name:
            continue
        key = (len(idx), -name.count("."), name)
        if best is None or key > best[0]:
            best = (key, name, sorted(idx))
    return None if best is None else (best[1], best[2])


def _owner(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _top(module: str) -> str:
    return module.split(".")[0] if module else ""


def find_units(g: Graph) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The model's units: ``(names, first op index of each unit)``.

    ``names[0]`` labels what runs before the first cut; ``names[i > 0]`` is the FQN of the submodule whose
    call begins unit ``i``. Raises ValueError when the model has no place to cut."""
    ops = g.ops
    found = _block_container(g)
    names: list[str] = []
    starts: list[int] = []
    if found is not None:
        container, idx = found
        spans = []
        for i in idx:
            fqn = f"{container}.{i}"
            mine = [k for k, op in enumerate(ops) if _owner(op.module, fqn)]
            spans.append((fqn, mine[0], mine[-1]))
        spans.sort(key=lambda s: s[1])
        for (a, _, last), (b, first, _) in zip(spans, spans[1:]):
            if first <= last:
                raise ValueError(
                    f"cannot cut the model between {a} and {b}: their ops interleave (a block called twice, "
                    "or weights shared between blocks); pipelines need each block called once, in order"
                )
        if spans[0][1] > 0:
            names.append("(input)")
            starts.append(0)
        for fqn, first, _ in spans:
            names.append(fqn)
            starts.append(first)
        end = spans[-1][2]
        k = next((k for k in range(end + 1, len(ops)) if ops[k].module), None)
        if k is not None:
            # the last unit begins with the outermost module whose first call is here (never called before)
            called = {op.module for op in ops[:k]}
            parts = ops[k].module.split(".")
            head = next(
                (".".join(parts[:j]) for j in range(1, len(parts) + 1)
                 if not any(_owner(c, ".".join(parts[:j])) for c in called)),
                None,
            )  # fmt: skip
            if head is not None:
                names.append(head)
                starts.append(k)
    else:
        order: list[tuple[str, int]] = []
        for k, op in enumerate(ops):
            t = _top(op.module)
            if t and all(t != o for o, _ in order):
                order.append((t, k))
        for (a, _), (b, first) in zip(order, order[1:]):
            last_a = max(k for k, op in enumerate(ops) if _top(op.module) == a)
            if last_a > first:
                raise ValueError(
                    f"cannot cut the model at {b}: module {a} runs again after it begins; pipelines need "
                    "submodules called once, in order"
                )
        for t, first in order:
            if not starts:
                names.append("(input)" if first > 0 else t)
                starts.append(0)
                if first > 0:
                    names.append(t)
                    starts.append(first)
            else:
                names.append(t)
                starts.append(first)
    if len(starts) < 2:
        raise ValueError(
            f"cannot cut {g.name} into pipeline stages: no repeated blocks (an nn.ModuleList such as "
            "blocks.0, blocks.1, ...) and fewer than two top-level submodules"
        )
    return tuple(names), tuple(starts)


# ----------------------------------------------------------------------------------------------------
# costs


def _dp_program(th: Theory, cluster: Cluster) -> tuple[Step, ...]:
    """The data-parallel program (``dp_ev``'s pins) of the graph on two devices of the first kind."""
    from ..synth.search import Search
    from ..synth.seeds import baseline_specs

    d0 = cluster.devices[0]
    pair = cluster.replace(
        name="dp-pair",
        devices=(replace(d0, name="dp0", model=None), replace(d0, name="dp1", model=None)),
    )
    name, pins, ratios, opts = baseline_specs(th, pair, {})[0]
    s = Search(th, pair, ratios=ratios, pins=pins, options=opts)
    res = s.run(max_expansions=200_000)
    prog = tuple(res.program)
    if sorted(st.op for st in prog) != list(range(len(th.graph.ops))):
        raise ValueError(f"the data-parallel program of {th.graph.name} does not run every op once")
    return prog


def _one_device(cluster: Cluster, d: Device) -> Cluster:
    return cluster.replace(name=f"one-{d.kind}", devices=(replace(d, name="d0", gpus=1),))


def layer_costs(
    g: Graph,
    cluster: Cluster,
    *,
    th: Theory | None = None,
    source: str = "traced",
    model: Mapping[str, Any] | None = None,
) -> LayerCosts:
    """Units of a traced graph (traced at one micro-batch) and their costs on each device kind of
    ``cluster``, from the cost model. See the module docstring."""
    th = th or theory(g)
    names, starts = find_units(g)
    prog = _dp_program(th, cluster)
    by_op = {st.op: st for st in prog}
    bounds = list(starts) + [len(g.ops)]
    unit_of = [0] * len(g.ops)
    for u in range(len(names)):
        for k in range(bounds[u], bounds[u + 1]):
            unit_of[k] = u
    nseg = 1 + max((op.segment for op in g.ops), default=0)
    zero, one = ((0.0,),) * nseg, ((1.0,),) * nseg
    kinds: dict[str, Device] = {}
    for d, k in zip(cluster.devices, kind_keys(cluster)):
        kinds.setdefault(k, d)
    per_kind: dict[str, tuple[CostModel, list[list[float]]]] = {}
    for k, d in kinds.items():
        cm = CostModel(th, _one_device(cluster, d))
        acc = [[0.0, 0.0, 0.0, 0.0] for _ in names]
        for op in g.ops:
            st = by_op[op.id]
            c0 = cm.comp(op.id, st.strategy, zero)[0]
            c1 = cm.comp(op.id, st.strategy, one)[0]
            total = st.strategy.scaled_flops + st.strategy.fixed_flops
            fshare = min(1.0, op.flops / total) if total > 0 else FORWARD_SHARE_DEFAULT
            a = acc[unit_of[op.id]]
            a[0] += fshare * c0
            a[1] += fshare * (c1 - c0)
            a[2] += (1 - fshare) * c0
            a[3] += (1 - fshare) * (c1 - c0)
        per_kind[k] = (cm, acc)
    # memory and parameters per unit (kind-independent; a flops-only device gives the raw bytes)
    flat = CostModel(th, _one_device(cluster, replace(next(iter(kinds.values())), model=None)))
    steps_of: list[list[Step]] = [[] for _ in names]  # the unit's steps, loads left out (memory)
    full_of: list[list[Step]] = [[] for _ in names]  # the unit's steps as the program runs them (optimizer)
    params_of: list[list[int]] = [[] for _ in names]
    seen: set[int] = set()
    for st in prog:
        u = unit_of[st.op]
        steps_of[u].append(replace(st, loads=()))
        full_of[u].append(st)
        for ld in st.loads:
            t = g.tensors[ld.tensor]
            if t.role == "param" and ld.tensor not in seen:
                seen.add(ld.tensor)
                params_of[u].append(t.nbytes)
    units = []
    for u, name in enumerate(names):
        mem = flat.memory_breakdown(steps_of[u], (), one)[0] if steps_of[u] else {}
        opt = {}
        for k, (cm, _) in per_kind.items():
            if cm.models[0] is not None:
                opt[k] = cm.optimizer_linear(full_of[u])[1][0]
        cut = bounds[u]
        crossing = sum(
            t.nbytes
            for t in g.tensors
            if t.role == "activation"
            and t.producer is not None
            and t.producer < cut
            and any(c >= cut for c in t.consumers)
        )
        units.append(
            UnitCost(
                name=name,
                forward={k: (a[u][0], a[u][1]) for k, (_, a) in per_kind.items()},
                backward={k: (a[u][2], a[u][3]) for k, (_, a) in per_kind.items()},
                param_bytes=sum(params_of[u]),
                param_tensors=tuple(params_of[u]),
                activation_bytes=float(mem.get("activations", 0)),
                transient_bytes=float(mem.get("transient", 0)),
                boundary_bytes=int(crossing) if u > 0 else 0,
                optimizer=opt,
            )
        )
    mb = _batch_of(g)
    return LayerCosts(tuple(units), tuple(kinds), mb, source=source, model=model)


def _batch_of(g: Graph) -> int:
    for t in g.inputs:
        shape = g.tensors[t].shape
        if shape:
            return int(shape[0])
    return 1


# ----------------------------------------------------------------------------------------------------
# big zoo models


def resolve_preset(model: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A :data:`MODEL_PRESETS` name expands to its zoo model and options (given options win)."""
    if model in MODEL_PRESETS:
        base, opts = MODEL_PRESETS[model]
        return base, {**opts, **{k: v for k, v in options.items() if v is not None}}
    return model, {k: v for k, v in options.items() if v is not None}


def _signature(u: UnitCost) -> tuple[Any, ...]:
    return (
        tuple(sorted(u.forward.items())),
        tuple(sorted(u.backward.items())),
        u.param_tensors,
        u.activation_bytes,
        u.transient_bytes,
        u.boundary_bytes,
        tuple(sorted(u.optimizer.items())),
    )


def model_costs(
    model: str,
    cluster: Cluster,
    *,
    micro_batch: int,
    batch: int | None = None,
    seed: int = 0,
    **options: Any,
) -> LayerCosts:
    """Layer costs of a zoo model (or ``package.module:factory``, or a :data:`MODEL_PRESETS` name)
    built at one micro-batch of ``micro_batch`` samples; the recorded model spec keeps the global
    ``batch``. Deep zoo models on flops-only clusters are traced with :data:`TRACED_BLOCKS` blocks and the
    block repeated (exact: see the module docstring)."""
    from .. import zoo
    from ..tracing import zoo_graph

    name, opts = resolve_preset(model, options)
    if ":" not in name and name not in zoo.ZOO_NAMES:
        raise ValueError(
            f"unknown model {model!r}: use a zoo name ({', '.join(zoo.ZOO_NAMES)}), a preset "
            f"({', '.join(MODEL_PRESETS)}) or package.module:factory"
        )
    n = cluster.n
    given = {"devices": n, "seed": seed, **opts, "batch": batch if batch is not None else micro_batch}
    spec = zoo.ModelSpec(name, tuple(given.items())).to_json()
    layers = opts.get("layers")
    shallow = (
        ":" not in name
        and "layers" in zoo.zoo_options(name)
        and all(d.model is None for d in cluster.devices)
        and isinstance(layers, int)
        and layers > TRACED_BLOCKS
    )
    if shallow:
        small = {**opts, "layers": TRACED_BLOCKS}
        g, _ = zoo_graph(name, devices=n, seed=seed, batch=micro_batch, **small)
        out = _repeat_blocks(layer_costs(g, cluster, model=spec), layers)
        if out is not None:
            return out
    # zoo models recorded on meta tensors (or read from the trace cache): no weights are materialized
    g, _ = zoo_graph(name, devices=n, seed=seed, batch=micro_batch, **opts)
    return layer_costs(g, cluster, model=spec)


def _repeat_blocks(lc: LayerCosts, depth: int) -> LayerCosts | None:
    """The costs of the same model with ``depth`` blocks, from a trace with :data:`TRACED_BLOCKS` blocks;
    None when the traced blocks do not price identically (then the full model must be traced)."""
    names = lc.names
    blocks = [i for i, nm in enumerate(names) if nm.rsplit(".", 1)[-1].isdigit()]
    if len(blocks) != TRACED_BLOCKS or blocks != list(range(blocks[0], blocks[0] + len(blocks))):
        return None
    first, second = lc.units[blocks[0]], lc.units[blocks[1]]
    if _signature(first) != _signature(replace(second, boundary_bytes=first.boundary_bytes)):
        return None
    container = names[blocks[0]].rsplit(".", 1)[0]
    units = list(lc.units[: blocks[0]])
    for i in range(depth):
        proto = first if i == 0 else second
        units.append(replace(proto, name=f"{container}.{i}"))
    units += lc.units[blocks[-1] + 1 :]
    src = f"traced with {TRACED_BLOCKS} blocks, block repeated to {depth} (identical blocks)"
    return LayerCosts(tuple(units), lc.kinds, lc.micro_batch, source=src, model=lc.model)
