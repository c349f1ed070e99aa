"""The A* spine bound (:class:`hapnb.search.Search`'s admissible heuristic, with the remaining computation).

:func:`spine_bound` is a backward DP over a relaxed problem along one path (the *spine*) from an input to
the loss; :func:`spine_value` reads it for a node's properties. The search keeps the result per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .cost import Conversion
from .forms import Form
from .triples import LOADABLE_ROLES

__all__ = ["CONVERSIONS", "spine_bound", "spine_value"]

#: Which collectives turn a form kind into another: (src kind, dst kind) -> names.
CONVERSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("G", "I"): ("all_gather", "grouped_all_gather"),
    ("R", "I"): ("all_reduce",),
    ("R", "G"): ("reduce_scatter", "grouped_reduce_scatter"),
    ("G", "G"): ("all_to_all",),
    ("I", "G"): ("slice",),
}


def spine_bound(s: Any, comm_only: bool = False) -> tuple[int, list[list[tuple[int, float]]]]:
    """Backward DP over a relaxed problem along one path (the spine) from an input to the loss.

    Relaxations (each can only lower the cost, so the bound is admissible): every tensor off the
    spine is free to take any form; computation is counted on one device, the one with the most
    computation left (a stage's max over devices is at least any one device's time); stages merge freely; tokens
    (one conversion per tensor) are ignored; parameter gradient syncs are counted only for
    parameters with one consumer. Along the spine the forms must match: converting the spine
    tensor costs the cheapest collective between the two forms.

    ``s`` is the :class:`~hapnb.search.Search` being compiled (its compiled strategies, property bits,
    ratios, remaining computation, shared price caches and load pricing). Returns the device the bound
    weighs (``jstar``, an index into the search's per-device vectors: one entry per device class) and, per position, ``(property bit, bound)`` for each form of the live spine tensor
    (``comm_only``: the communication alone, no computation).
    """
    g, th, cm = s.graph, s.theory, s.cost_model
    n_ops = len(g.ops)
    # weights on the device that has the most computation left even in the best case: any weights on
    # the simplex give a valid bound, and this one is tight when that device is the bottleneck
    jstar = max(range(len(s._rem[0])), key=lambda j: (s._rem[0][j], -j))
    inf = float("inf")
    # the spine: from the loss backwards, through the largest activation input (then the deepest): the
    # big activations are where unavoidable communication is (a MoE layer's expert path, [B, E, C, D],
    # with its all-to-alls and expert weights, rather than its longer gating path on [B, S, E])
    depth = [0] * len(g.tensors)
    for op in g.ops:
        d = 1 + max((depth[t] for t in op.inputs), default=0)
        for t in op.outputs:
            depth[t] = d
    spine_ops: dict[int, tuple[int, int]] = {}  # op -> (spine input, spine output)
    t = g.loss
    while g.tensors[t].producer is not None:
        op = g.ops[g.tensors[t].producer]
        acts = [x for x in op.inputs if g.tensors[x].role not in LOADABLE_ROLES]
        if not acts:
            break
        src = max(acts, key=lambda x: (g.tensors[x].numel, depth[x], -x))
        spine_ops[op.id] = (src, t)
        t = src
    n_cons = [len(set(x.consumers)) for x in g.tensors]

    # the weights are one-hot on jstar (zero for comm_only): a strategy's computation is c.comp[jstar]
    single = [x.role == "param" and n_cons[x.id] == 1 for x in g.tensors]

    # a strategy's communication terms (its single-consumer parameters' loads, an SFB sync), in order; the
    # searches at these ratios share them unless loads depend on the search (memory, storage pins)
    terms_of: dict[tuple[int, int], tuple[float, ...]] = (
        s._shared.setdefault("spine_terms", {}) if s._mem is None and not s.storage else {}
    )

    def local(op_id: int, c: Any) -> float:
        key = (op_id, c.index)
        terms = terms_of.get(key)
        if terms is None:
            op = g.ops[op_id]
            terms = tuple(
                s._load_entry(ti, f, c.strategy.sfb and f.kind == "I")[1]
                for ti, f in zip(op.inputs, c.strategy.inputs)
                if single[ti]
            )
            if c.strategy.sfb:
                terms += (s._sfb_time(op_id, c),)
            terms_of[key] = terms
        v = 0.0 if comm_only else c.comp[jstar]
        for x in terms:
            v += x
        return v

    # a conversion's price depends on the tensor only through its price class (bytes, ratio segment, need
    # of a gradient: hapnb.searchtables): the cheapest collective between two forms, per class; and per
    # (class, the tensor's forms, the forms an op takes) which prices a row adds (the searches of one
    # re-planning context at the same ratios share both: s._shared)
    conv_cache: dict[tuple[Any, ...], float] = s._shared.setdefault("conv", {})
    row_plans: dict[tuple[Any, ...], list[tuple[Form, tuple[float, ...]]]] = s._shared.setdefault(
        "conv_rows", {}
    )
    price_class = s._price_class

    def price(ti: int, a: Form, b: Form) -> float:
        key = (price_class[ti], a, b)
        x = conv_cache.get(key)
        if x is None:
            x = inf
            for name in CONVERSIONS.get((a.kind, b.kind), ()):
                cv = Conversion(ti, name, a, b)
                x = min(x, sum(tm.time(s.ratios) for tm in cm.conversion_terms(cv)))
            conv_cache[key] = x
        return x

    def conv_row(ti: int, by_in: dict[Form, float]) -> dict[Form, float]:
        """For each form of spine tensor ti: the cheapest conversion to a form in by_in plus its value."""
        keys = tuple(by_in)
        pk = (price_class[ti], th.forms[ti], keys)
        plan = row_plans.get(pk)
        if plan is None:
            plan = row_plans[pk] = [
                (a, tuple(0.0 if a == b else price(ti, a, b) for b in keys)) for a in th.forms[ti]
            ]
        vals = tuple(by_in.values())
        row = {}
        for a, xs in plan:
            best = inf
            for v, x in zip(vals, xs):
                v += x
                if v < best:
                    best = v
            row[a] = best
        return row

    # V[i]: form of the live spine tensor before op i -> lower bound of ops i.. end
    spine_at: list[int | None] = [None] * (n_ops + 1)
    V: list[dict[Form, float]] = [{} for _ in range(n_ops + 1)]
    V[n_ops] = {f: 0.0 for f in th.forms[g.loss]}
    spine_at[n_ops] = g.loss
    cur = g.loss
    for i in range(n_ops - 1, -1, -1):
        comp = s._ops[i]
        if i in spine_ops and spine_ops[i][1] == cur:
            src, out = spine_ops[i]
            op = g.ops[i]
            k_in = op.inputs.index(src)
            k_out = op.outputs.index(out)
            nxt = V[i + 1]
            # the best rest per form the op takes its spine input in, then the cheapest way there
            by_in: dict[Form, float] = {}
            for c in comp:
                f_in = c.strategy.inputs[k_in]
                v = local(i, c) + nxt.get(c.strategy.outputs[k_out], inf)
                if v < by_in.get(f_in, inf):
                    by_in[f_in] = v
            V[i] = conv_row(src, by_in)
            cur = src
        else:
            m = min(local(i, c) for c in comp)
            V[i] = {f: v + m for f, v in V[i + 1].items()}
        spine_at[i] = cur
    spine_opts: list[list[tuple[int, float]]] = []
    for i in range(n_ops + 1):
        ti = spine_at[i]
        opts = [(s._bit[(ti, f)], v) for f, v in V[i].items() if v < inf and (ti, f) in s._bit]
        # a not-yet-loaded spine input may take any form: handled by "no present form" in _h
        spine_opts.append(opts)
    return jstar, spine_opts


def spine_value(opts: Sequence[tuple[int, float]], props: int) -> float | None:
    """The spine bound for the spine tensor's present form (any form if none is present yet)."""
    if not opts:
        return None
    present = [v for bit, v in opts if props & bit]
    return min(present) if present else min(v for _, v in opts)
