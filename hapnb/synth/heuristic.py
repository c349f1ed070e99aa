"""The A* spine bound (:class:`hapnb.synth.search.Search`'s admissible heuristic, with the remaining computation).

:func:`spine_bound` is a backward DP over a relaxed problem along one path (the *spine*) from an input to
the loss; :func:`spine_value` reads it for a node's properties. The search keeps the result per position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..cost.model import Conversion
from ..ir.collective_table import conversions
from ..ir.forms import Form
from ..triples import LOADABLE_ROLES

__all__ = ["CONVERSIONS", "spine_bound", "spine_path", "spine_value"]

#: Which collectives turn a form kind into another: (src kind, dst kind) -> names.
#: (source kind, destination kind) -> the collectives the search may insert between them
#: (:func:`hapnb.ir.collective_table.conversions`)
CONVERSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    (a, b): conversions(a, b) for a in "GIR" for b in "GIR" if conversions(a, b)
}


def spine_path(g: Any) -> dict[int, tuple[int, int]]:
    """The spine: from the loss backwards, through each op's largest activation input (then the deepest),
    as op -> (spine input, spine output). The big activations are where unavoidable communication is (a
    MoE layer's expert path, [B, E, C, D], with its all-to-alls and expert weights, rather than its longer
    gating path on [B, S, E]). The op that starts the path from loaded tensors only (a language model's
    embedding) is its *source*, with spine input -1: its strategies fix the first spine tensor's form."""
    depth = [0] * len(g.tensors)
    for op in g.ops:
        d = 1 + max((depth[t] for t in op.inputs), default=0)
        for t in op.outputs:
            depth[t] = d
    out: dict[int, tuple[int, int]] = {}
    t = g.loss
    while g.tensors[t].producer is not None:
        op = g.ops[g.tensors[t].producer]
        acts = [x for x in op.inputs if g.tensors[x].role not in LOADABLE_ROLES]
        if not acts:
            out[op.id] = (-1, t)  # the source: its weights' loads decide the first spine tensor's form
            break
        src = max(acts, key=lambda x: (g.tensors[x].numel, depth[x], -x))
        out[op.id] = (src, t)
        t = src
    return out


def local_pricer(s: Any, jstar: int, comm_only: bool = False) -> Any:
    """``local(op, compiled)``: a strategy's computation on device ``jstar`` (none with ``comm_only``)
    plus the communication of its own that the bounds count, in order: its single-consumer parameters'
    loads (with, on device-model devices, their part of the optimizer step on ``jstar``: a weight stored
    replicated updates all its bytes there, :mod:`hapnb.synth.optimizer_step`) and an SFB sync. Plain
    loads' prices do not depend on the ratios (shared per cluster), an SFB sync's do (shared per ratios);
    they are not shared where loads depend on the search (memory, storage pins). Used by the spine bound,
    its side consumers (:mod:`hapnb.synth.heuristic_side`) and the chain bound."""
    g, tb = s.graph, s._tables
    single = tb.single_param
    plain = s._mem is None and not s.storage
    terms_of: dict[tuple[int, int], tuple[float, ...]] = (
        s._per_cluster.setdefault("spine loads", {}) if plain else {}
    )
    entries = tb.entries
    opt, opt_of = s._opt, {}  # device models: a single-consumer weight's optimizer step, by its storage

    def local(op_id: int, c: Any) -> float:
        v = 0.0 if comm_only else c.comp[jstar]
        if not entries[op_id][c.index].spine_terms:
            return v
        if opt is not None:
            x = opt_of.get((op_id, c.index))
            if x is None:
                op = g.ops[op_id]
                x = opt_of[(op_id, c.index)] = sum(
                    opt.least(ti, f, lean=storage_open(s, ti))[jstar]
                    for ti, f in zip(op.inputs, c.strategy.inputs)
                    if single[ti]
                )
            v += x
        key = (op_id, c.index)
        terms = terms_of.get(key)
        if terms is None:
            op = g.ops[op_id]
            terms = terms_of[key] = tuple(
                s._load_s(ti, f, c.strategy.sfb and f.kind == "I")
                for ti, f in zip(op.inputs, c.strategy.inputs)
                if single[ti]
            )
        if c.strategy.sfb:
            terms += (s._sfb_time(op_id, c),)
        for x in terms:
            v += x
        return v

    return local


def storage_open(s: Any, t: int) -> bool:
    """Whether weight ``t``'s storage is still open in search ``s`` where a strategy uses it replicated (deferred
    under memory pruning, or a storage pin): the bounds then price its optimizer step at the least over its
    sharded forms too (``lean`` of :meth:`hapnb.synth.optimizer_step.OptimizerStep.least`)."""
    return s._mem is not None or t in s.storage


def bound_device(s: Any) -> int:
    """The device class the bounds of Search ``s`` weigh: the one with the most computation left even in
    the best case. Any weights on the simplex give a valid bound; this one is tight when that device is
    the bottleneck."""
    return max(range(len(s._rem[0])), key=lambda j: (s._rem[0][j], -j))


def price_matrices(s: Any) -> Callable[[int], list[list[float]]]:
    """``price_matrix(tensor)``: the cheapest collective from each of the tensor's forms to each (0 to
    itself), in ``theory.forms`` order. A conversion's price depends on the tensor only through its price
    class (bytes, ratio segment, need of a gradient: :mod:`hapnb.synth.tables`), so the matrices are kept
    per (price class, the tensor's forms) and shared by the searches at the same ratios (``s._shared``)."""
    th, tb = s.theory, s._tables
    prices: dict[tuple[int, int], list[list[float]]] = s._shared.setdefault("spine_prices", {})

    def price_matrix(ti: int) -> list[list[float]]:
        key = (tb.price_class[ti], tb.forms_class[ti])
        m = prices.get(key)
        if m is None:
            fs = th.forms[ti]
            m = prices[key] = [[0.0 if a == b else _cheapest(s, ti, a, b) for b in fs] for a in fs]
        return m

    return price_matrix


def spine_bound(s: Any, comm_only: bool = False) -> tuple[int, list[list[tuple[int, float]]]]:
    """Backward DP over a relaxed problem along one path (the spine, :func:`spine_path`) from an input to the
    loss.

    Relaxations (each can only lower the cost, so the bound is admissible): every tensor off the
    spine is free to take any form; computation is counted on one device, the one with the most
    computation left (a stage's max over devices is at least any one device's time); stages merge freely;
    tokens (one conversion per tensor) are ignored; parameter gradient syncs are counted only for
    parameters with one consumer. Along the spine the forms must match: converting the spine
    tensor costs the cheapest collective between the two forms.

    ``s`` is the :class:`~hapnb.synth.search.Search` being compiled (its compiled strategies, theory tables,
    ratios, remaining computation, shared price caches and load pricing). Returns the device the bound
    weighs (``jstar``, an index into the search's per-device vectors: one entry per device class) and, per
    position, ``(property bit, bound)`` for each form of the live spine tensor (``comm_only``: the
    communication alone, no computation). Values are kept per form index (``theory.forms`` order).
    """
    g, th, tb = s.graph, s.theory, s._tables
    n_ops = len(g.ops)
    jstar = bound_device(s)
    inf = float("inf")
    spine_ops, entries = tb.spine, tb.entries
    local = local_pricer(s, jstar, comm_only)  # weights one-hot on jstar (zero for comm_only)

    price_matrix = price_matrices(s)

    # V[i]: per form (index) of the live spine tensor before op i, a lower bound of ops i.. end
    spine_at: list[int] = [g.loss] * (n_ops + 1)
    V: list[list[float]] = [[]] * (n_ops + 1)
    V[n_ops] = [0.0] * len(th.forms[g.loss])
    cur = g.loss
    for i in range(n_ops - 1, -1, -1):
        comp = s._ops[i]
        if i in spine_ops and spine_ops[i][1] == cur:
            src, out = spine_ops[i]
            op = g.ops[i]
            k_out = op.outputs.index(out)
            nxt = V[i + 1]
            row_of = entries[i]
            if src < 0:  # the source op: the best of its strategies, whatever form the spine tensor is in
                m = min(local(i, c) + nxt[row_of[c.index].out_forms[k_out]] for c in comp)
                V[i] = [m] * len(nxt)
                spine_at[i] = cur
                continue
            k_in = op.inputs.index(src)
            # the best rest per form the op takes its spine input in, then the cheapest way there
            by_in = [inf] * len(th.forms[src])
            for c in comp:
                e = row_of[c.index]
                v = local(i, c) + nxt[e.out_forms[k_out]]
                a = e.in_forms[k_in]
                if v < by_in[a]:
                    by_in[a] = v
            row = []
            for xs in price_matrix(src):
                best = inf
                for v, x in zip(by_in, xs):
                    v += x
                    if v < best:
                        best = v
                row.append(best)
            V[i] = row
            cur = src
        else:
            m = min(local(i, c) for c in comp)
            V[i] = [v + m for v in V[i + 1]]
        spine_at[i] = cur
    spine_opts = [
        [(b, v) for b, v in zip(tb.bits_of[spine_at[i]], V[i]) if v < inf] for i in range(n_ops + 1)
    ]  # a not-yet-loaded spine input may take any form: handled by "no present form" in _h
    return jstar, spine_opts


def _cheapest(s: Any, ti: int, a: Form, b: Form) -> float:
    """Seconds of the cheapest collective turning tensor ``ti`` from form ``a`` into ``b`` (inf: none)."""
    return min((s._collective_s(Conversion(ti, name, a, b)) for name in CONVERSIONS.get((a.kind, b.kind), ())),
               default=float("inf"))  # fmt: skip


def spine_value(opts: Sequence[tuple[int, float]], props: int) -> float | None:
    """The spine bound for the spine tensor's present form (any form if none is present yet)."""
    if not opts:
        return None
    present = [v for bit, v in opts if props & bit]
    return min(present) if present else min(v for _, v in opts)
