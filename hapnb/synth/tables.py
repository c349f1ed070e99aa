"""The ratio-independent tables of a search, built once per theory and shared by every search on it.

:class:`~hapnb.synth.search.Search` compiles its theory into integer tables (a property bit per (tensor, form),
which properties die after each op, every strategy's needed inputs as bits). None of that depends on the
ratios, and only the strategy filter depends on the pins, so :func:`theory_tables` builds it once per
theory and :func:`entries_for` filters it for one search's pins and options, re-checking only the ops that
touch a pinned tensor. A re-planning context (:class:`hapnb.synth.memo.Memo`) keeps the tables, so its
searches (the Q/B loop's, the baseline seeds', a re-plan's) skip this work.

>>> import hapnb
>>> from hapnb.tracing import zoo_graph
>>> th = hapnb.theory(zoo_graph("mlp", layers=1, hidden=8, input=6, batch=4)[0])
>>> tb = theory_tables(th, (0,) * len(th.graph.tensors))
>>> len(tb.entries) == len(th.graph.ops) and all(tb.entries)
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..cost.model import Conversion, CostModel
from ..ir.forms import Form, Storage
from ..rules import Strategy
from ..triples import LOADABLE_ROLES, Theory
from .heuristic import spine_path

__all__ = ["Entry", "TheoryTables", "theory_tables", "entries_for", "ratio_classes"]


class Entry(NamedTuple):
    """One strategy of one op, compiled: ``index`` its place in ``theory.strategies[op]``; ``out_bits`` the
    properties it establishes (outputs that are used later, or the loss); ``needs`` its distinct (tensor,
    form) inputs and ``need_bits`` their property bits; ``reshards`` the re-cuts of G inputs from another
    ratio segment; ``sfb_params`` an SFB strategy's parameters taken replicated (SFB replaces their gradient
    sync, so each must have one consumer and no storage pin); ``sfb_shared`` whether one of them has more
    than one consumer (never allowed); ``in_forms`` / ``out_forms`` and ``spine_terms`` for the spine bound
    (:mod:`hapnb.synth.heuristic`). A named tuple: thousands are made per theory."""

    index: int
    strategy: Strategy
    out_bits: int
    needs: tuple[tuple[int, Form], ...]
    need_bits: tuple[int, ...]
    reshards: tuple[Conversion, ...]
    sfb_params: tuple[int, ...]
    sfb_shared: bool
    in_forms: tuple[int, ...]  # per input position, the index of its form in the tensor's forms
    out_forms: tuple[int, ...]  # likewise per output
    spine_terms: bool  # SFB, or an input that is a parameter with one consumer (the spine bound prices it)


@dataclass(frozen=True)
class TheoryTables:
    """A theory's search tables (see the module docstring); read-only for the searches that share them.

    ``bit``: (tensor, form) -> property bit; ``forms_of_bit`` the inverse; ``tmask``: per tensor, the bits
    of all its forms; ``loadable``: per tensor, whether it is a parameter/input/buffer/constant (loaded, not
    computed); ``last_use``: per tensor, the last op reading it (-1: none); ``dies_at`` / ``dies_comm``: per
    op, the property bits / communication bits dropped after it; ``entries``: per op, every strategy
    compiled (:class:`Entry`), unfiltered; ``price_class``: per tensor, the class of tensors whose collectives
    cost the same (same bytes, ratio segment and need of a gradient); ``bits_of``: per tensor, the bit of
    each of its forms (in ``theory.forms`` order); ``forms_class``: per tensor, which distinct tuple of forms
    it has; ``spine``: op -> (spine input, spine output) along the spine path (:func:`hapnb.synth.heuristic.spine_path`);
    ``single_param``: per tensor, whether it is a parameter with one consumer."""

    bit: Mapping[tuple[int, Form], int]
    forms_of_bit: Mapping[int, tuple[int, Form]]
    tmask: tuple[int, ...]
    loadable: tuple[bool, ...]
    last_use: tuple[int, ...]
    dies_at: tuple[int, ...]
    dies_comm: tuple[int, ...]
    entries: tuple[tuple[Entry, ...], ...]
    price_class: tuple[int, ...]
    bits_of: tuple[tuple[int, ...], ...]
    forms_class: tuple[int, ...]
    spine: Mapping[int, tuple[int, int]]
    single_param: tuple[bool, ...]


def theory_tables(th: Theory, segment_of: Sequence[int]) -> TheoryTables:
    """Build the tables of ``th`` (``segment_of``: each tensor's ratio segment, as the cost model has it)."""
    g = th.graph
    bit: dict[tuple[int, Form], int] = {}
    tmask = [0] * len(g.tensors)
    for t, fs in enumerate(th.forms):
        for f in fs:
            b = 1 << len(bit)
            bit[(t, f)] = b
            tmask[t] |= b
    loadable = tuple(t.role in LOADABLE_ROLES for t in g.tensors)
    last_use = [-1] * len(g.tensors)
    n_consumers = [0] * len(g.tensors)
    for op in g.ops:
        for t in op.inputs:
            last_use[t] = op.id
        for t in set(op.inputs):
            n_consumers[t] += 1
    dies_at = [0] * len(g.ops)
    dies_comm = [0] * len(g.ops)
    for t, i in enumerate(last_use):
        if i >= 0:
            dies_at[i] |= tmask[t]
            dies_comm[i] |= 1 << t
    # a collective's price depends on its tensor only through the bytes, the ratio segment and whether it
    # has a gradient (hapnb.cost.model.CostModel.conversion_terms): tensors of one class share their prices
    classes: dict[tuple[int, int, bool], int] = {}
    price_class = tuple(
        classes.setdefault((t.nbytes, segment_of[t.id], th.requires_grad[t.id]), len(classes))
        for t in g.tensors
    )
    is_param = [t.role == "param" for t in g.tensors]
    single_param = tuple(p and n_consumers[t] == 1 for t, p in enumerate(is_param))
    index_of = [{f: k for k, f in enumerate(fs)} for fs in th.forms]
    bits_of = tuple(tuple(bit[(t, f)] for f in fs) for t, fs in enumerate(th.forms))
    distinct: dict[tuple[Form, ...], int] = {}
    forms_class = tuple(distinct.setdefault(fs, len(distinct)) for fs in th.forms)
    live = [bool(t.consumers) or t.id == g.loss for t in g.tensors]
    # what a strategy's entry needs of its op's tensors only through their forms (form indices, which input
    # positions are distinct (tensor, form) needs): one template per (strategies, forms of the tensors,
    # which inputs are one tensor), shared by a model's repeated layers (whose ops share the rules' Strategy
    # objects, hapnb.triples.theory)
    templates: dict[tuple[object, ...], list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]] = {}
    entries = []
    for op, ss in zip(g.ops, th.strategies):
        ins, outs = op.inputs, op.outputs
        key = (
            tuple(map(id, ss)), tuple(forms_class[t] for t in ins), tuple(forms_class[t] for t in outs),
            tuple(ins.index(t) for t in ins),
        )  # fmt: skip
        tpl = templates.get(key)
        if tpl is None:
            tpl = templates[key] = [_template(index_of, ins, outs, s) for s in ss]
        seg_differs = any(segment_of[t] != op.segment for t in ins)
        op_single = any(single_param[t] for t in ins)
        row = []
        for k, (s, (in_idx, out_idx, need_pos)) in enumerate(zip(ss, tpl)):
            out_bits = 0
            for t, i in zip(outs, out_idx):
                if live[t]:
                    out_bits |= bits_of[t][i]
            needs = tuple((ins[q], s.inputs[q]) for q in need_pos)
            # a G input from another segment is re-cut for this op's ratios: always recorded (free while
            # the two segments' cuts agree), so that the LP may change the segments' ratios independently
            resh = (
                tuple(
                    Conversion(t, "reshard", f, f, op.segment)
                    for t, f in needs
                    if f.kind == "G" and segment_of[t] != op.segment
                )
                if seg_differs
                else ()
            )
            sfb_params = (
                tuple(t for t, f in zip(ins, s.inputs) if is_param[t] and f.kind == "I") if s.sfb else ()
            )
            row.append(
                Entry(
                    k,
                    s,
                    out_bits,
                    needs,
                    tuple(bits_of[ins[q]][in_idx[q]] for q in need_pos),
                    resh,
                    sfb_params,
                    any(n_consumers[t] > 1 for t in sfb_params),
                    in_idx,
                    out_idx,
                    s.sfb or op_single,
                )  # fmt: skip
            )
        entries.append(tuple(row))
    return TheoryTables(
        bit, {b: p for p, b in bit.items()}, tuple(tmask), loadable, tuple(last_use), tuple(dies_at),
        tuple(dies_comm), tuple(entries), price_class, bits_of, forms_class, spine_path(g), single_param,
    )  # fmt: skip


def _template(
    index_of: Sequence[Mapping[Form, int]], ins: Sequence[int], outs: Sequence[int], s: Strategy
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A strategy's form index per input and per output, and the input positions of its distinct (tensor,
    form) needs (first occurrences)."""
    seen: set[tuple[int, Form]] = set()
    need_pos = []
    for q, tf in enumerate(zip(ins, s.inputs)):
        if tf not in seen:
            seen.add(tf)
            need_pos.append(q)
    return (
        tuple(index_of[t][f] for t, f in zip(ins, s.inputs)),
        tuple(index_of[t][f] for t, f in zip(outs, s.outputs)),
        tuple(need_pos),
    )


def entries_for(
    th: Theory,
    tables: TheoryTables,
    pins: Mapping[int, Form],
    storage: Mapping[int, Storage],
    sfb: bool,
) -> list[tuple[Entry, ...]]:
    """Per op, the strategies a search may use under ``pins`` (tensor -> form; an input's pin binds only a
    loadable input, whose form is chosen by its load), ``storage`` (parameters with a ZeRO storage pin)
    and the ``sfb`` option; an op left with none gets an empty tuple (the caller explains why)."""
    g = th.graph
    out = []
    for op, row in zip(g.ops, tables.entries):
        touched = any(t in pins or t in storage for t in op.inputs) or any(t in pins for t in op.outputs)
        if not touched and not any(e.strategy.sfb and (not sfb or e.sfb_shared) for e in row):
            out.append(row)  # nothing to filter: the shared tuple itself
            continue
        keep = []
        for e in row:
            s = e.strategy
            if s.sfb and (not sfb or e.sfb_shared or any(t in storage for t in e.sfb_params)):
                continue
            if touched and not _pins_ok(pins, tables.loadable, op.inputs, s.inputs, op.outputs, s.outputs):
                continue
            keep.append(e)
        out.append(tuple(keep))
    return out


def _pins_ok(
    pins: Mapping[int, Form],
    loadable: Sequence[bool],
    ins: Sequence[int],
    in_forms: Sequence[Form],
    outs: Sequence[int],
    out_forms: Sequence[Form],
) -> bool:
    for t, f in zip(outs, out_forms):
        p = pins.get(t)
        if p is not None and p != f:
            return False
    for t, f in zip(ins, in_forms):
        if loadable[t]:
            p = pins.get(t)
            if p is not None and p != f:
                return False
    return True


def ratio_classes(cm: CostModel, ratios: Sequence[Sequence[float]]) -> tuple[int, ...]:
    """The first device of each class of devices whose computation is equal for every op and strategy
    (the same flop/s, device model, GPUs per device, inner gradient sync and ratio in every segment), in
    device order. Their per-device computation is computed by the same expression from equal inputs, so a
    search that keeps one entry per class gets exactly the same maxima, sums and comparisons.

    >>> import hapnb
    >>> from hapnb.tracing import zoo_graph
    >>> cm = CostModel(hapnb.theory(zoo_graph("mlp", layers=1, hidden=8, input=6, batch=4)[0]),
    ...                hapnb.Cluster.resolve("2xV100+2xP100"))
    >>> ratio_classes(cm, ((0.3, 0.3, 0.2, 0.2),)), ratio_classes(cm, ((0.3, 0.3, 0.25, 0.15),))
    ((0, 2), (0, 2, 3))
    """
    seen: dict[tuple[object, ...], int] = {}
    for j in range(cm.n):
        key = (
            cm.flops[j], cm.models[j], cm.gpus[j], cm.reference_share[j], cm.inner_sync_s_per_byte[j],
            tuple(row[j] for row in ratios),
        )  # fmt: skip
        seen.setdefault(key, j)
    return tuple(seen.values())
