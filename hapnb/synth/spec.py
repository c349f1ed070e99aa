"""What a search is asked for (ratios per segment and pins, resolved against one theory) and what it
answers with (:class:`SearchNode`, :class:`SearchEvent`, :class:`SearchResult`).

:func:`normalize_ratios` turns ``None`` (throughput-proportional), one flat list or one list per segment
into per-segment ratio rows; :func:`resolve_pins` maps pin names (parameter FQNs, input names, op output
names, ``<module>.out``) to tensor ids and checks each pin: a form (:class:`~hapnb.ir.forms.Form`) the tensor
can take, or a parameter storage (:class:`~hapnb.ir.forms.Storage`, ZeRO-2/3) of a parameter that can be
sharded on that dim. Both raise :class:`PinError` / ``ValueError`` naming the pin and why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..cost.model import Step
from ..hardware.cluster import Cluster
from ..ir.forms import Form, Storage, parse_pin
from ..ir.graph import Graph
from ..triples import Theory

__all__ = [
    "PinError", "normalize_ratios", "resolve_pins", "pin_choices", "explain_no_strategy", "explain_no_program",
    "SearchNode", "SearchEvent", "SearchResult",
]  # fmt: skip


class PinError(ValueError):
    """A pin names an unknown tensor, a form the tensor cannot take, or cannot be satisfied."""


def normalize_ratios(
    ratios: Sequence[float] | Sequence[Sequence[float]] | None, cluster: Cluster, n_segments: int
) -> tuple[tuple[float, ...], ...]:
    """Ratios per segment; default throughput-proportional; a flat list applies to every segment."""
    n = cluster.n
    if ratios is None:
        tot = sum(d.flops for d in cluster.devices)
        row = tuple(d.flops / tot for d in cluster.devices)
        return (row,) * n_segments
    rows = list(ratios)
    if rows and not isinstance(rows[0], (list, tuple)):
        rows = [rows] * n_segments  # type: ignore[list-item]
    if len(rows) != n_segments:
        raise ValueError(f"ratios: expected {n_segments} segment(s), got {len(rows)}")
    out = []
    for k, row in enumerate(rows):
        row = [float(x) for x in row]  # type: ignore[union-attr]
        if len(row) != n:
            raise ValueError(f"ratios for segment {k}: expected {n} values (one per device), got {len(row)}")
        if any(x < 0 for x in row) or sum(row) <= 0:
            raise ValueError(f"ratios for segment {k} must be non-negative and not all zero: {row}")
        s = sum(row)
        out.append(tuple(x / s for x in row))
    return tuple(out)


def resolve_pins(th: Theory, pins: Mapping[str, Form | Storage | str]) -> dict[int, Form | Storage]:
    """Map pin names to tensor ids and check each form is one the tensor can take (a :class:`Storage` pin:
    a parameter that can be sharded on that dim)."""
    g = th.graph
    out: dict[int, Form | Storage] = {}
    for name, form in pins.items():
        if isinstance(form, str):
            form = parse_pin(form)
        try:
            t = g.tensor(name)
        except KeyError:
            t = _module_output(g, name)
            if t is None:
                params = [x.name for x in g.tensors if x.role in ("param", "input")][:12]
                raise PinError(
                    f"pin {name}={form}: no tensor of that name. Pins name parameters (e.g. {params[:6]}), "
                    "inputs, op outputs (fx node names) or '<module>.out' for a module's output."
                ) from None
        if isinstance(form, Storage):
            if t.role != "param" or form.form not in th.forms[t.id]:
                raise PinError(
                    f"pin {name}={form}: only a parameter with a dim of size >= 2 can be stored sharded; "
                    f"{t.name} is a {t.role} of shape {tuple(t.shape)}"
                )
            out[t.id] = form
            continue
        if form not in th.forms[t.id]:
            raise PinError(
                f"pin {name}={form}: tensor {t.name} has shape {tuple(t.shape)} and can take only "
                f"{', '.join(map(str, th.forms[t.id]))} (G(d) needs a dim of size >= 2; R only for computed "
                "floating tensors)"
            )
        out[t.id] = form
    return out


def pin_choices(th: Theory, t: int) -> tuple[Form | Storage, ...]:
    """Every pin :func:`resolve_pins` accepts for tensor ``t``: its forms, then for a parameter each
    sharded storage (ZeRO-3, then ZeRO-2, per dim it can be sharded on).

    >>> import hapnb
    >>> from hapnb.tracing import zoo_graph
    >>> th = hapnb.theory(zoo_graph("mlp", layers=1, hidden=8, input=4, batch=4)[0])
    >>> [str(p) for p in pin_choices(th, th.graph.tensor("layers.0.bias").id)]
    ['I', 'G0', 'zero3(0)', 'zero2(0)']
    """
    forms = th.forms[t]
    if th.graph.tensors[t].role != "param":
        return tuple(forms)
    return (*forms, *(Storage(z, f.dim) for f in forms if f.kind == "G" for z in (3, 2)))


def _module_output(g: Graph, name: str) -> Any:
    if not name.endswith(".out"):
        return None
    mod = name[: -len(".out")]
    ops = [op for op in g.ops if op.module == mod or op.module.startswith(mod + ".")]
    if not ops:
        return None
    return g.tensors[ops[-1].outputs[0]]


def explain_no_strategy(search: Any, op_id: int) -> str:
    """Why the pins of a :class:`~hapnb.synth.search.Search` leave op ``op_id`` no strategy, and how to fix it."""
    g = search.graph
    op = g.ops[op_id]
    pinned = [(g.tensors[t].name, str(search.pins[t])) for t in op.inputs + op.outputs if t in search.pins]
    forms = sorted(
        {
            ", ".join(f"{g.tensors[t].name}:{f}" for t, f in zip(op.outputs, s.outputs))
            for s in search.theory.strategies[op_id]
        }
    )
    return (
        f"pin(s) {', '.join(f'{n}={f}' for n, f in pinned)} cannot be satisfied: op {op.name} ({op.target}) "
        f"has no strategy that takes/produces these forms. Its strategies produce: {'; '.join(forms)}. "
        "Pin one of those forms or remove the pin."
    )


def explain_no_program(search: Any) -> str:
    """Why a :class:`~hapnb.synth.search.Search` found no complete program (memory, or the pins)."""
    pins = ", ".join(f"{search.graph.tensors[t].name}={f}" for t, f in search.pins.items())
    mem = search._mem
    if mem is not None and mem.stats["pruned_memory"]:
        return (
            "no complete distributed program fits in device memory at these ratios "
            f"({mem.stats['pruned_memory']} partial programs were pruned by memory)"
            + (f" under the pins {pins}" if pins else "")
        )
    return (
        "no complete distributed program exists"
        + (f" under the pins {pins}; remove or change a pin" if pins else "")
        + " (every candidate needed a tensor in a form it could not get)"
    )


@dataclass(frozen=True)
class SearchNode:
    """A partial program in the search tree (``step`` is the last step it appended)."""

    id: int
    parent: int
    step: Step | None
    cost: float  # closed stages + open stage (the partial program's stage cost)
    score: float  # cost + heuristic
    position: int  # number of computations done
    props: tuple[tuple[int, Form], ...]
    complete: bool = False

    @property
    def heuristic(self) -> float:
        return self.score - self.cost


@dataclass(frozen=True)
class SearchEvent:
    """What one :meth:`Search.step` did: the popped node, its children, and the pruned children."""

    popped: SearchNode | None
    children: tuple[SearchNode, ...]
    pruned: tuple[tuple[str, str], ...]  # (description of the child, reason)
    done: bool


@dataclass(frozen=True)
class SearchResult:
    """A search's best complete program; ``bound``: a proven lower bound of the optimum at the search's
    ratios (the least score of an open program, or ``cost`` when ``optimal``)."""

    program: tuple[Step, ...]
    cost: float
    optimal: bool
    expansions: int
    seconds: float
    bound: float = 0.0

    @property
    def gap(self) -> float:
        """How far the program may be from the optimum, relative to its cost: ``(cost - bound) / cost``."""
        if self.optimal or self.cost <= 0.0:
            return 0.0
        return max(0.0, (self.cost - self.bound) / self.cost)
