"""Brute-force oracles the search, memory and pick tests compare against: every program of a theory's
search space, the cheapest one under a cost, a cluster with other memory capacities, and a program's
variants with replicated parameters stored ZeRO-2/3 instead."""

from __future__ import annotations

import dataclasses
import itertools
import math

from hapnb.cost.model import Conversion, CostModel, Load, Step
from hapnb.hardware.cluster import Cluster
from hapnb.ir.forms import I
from hapnb.triples import LOADABLE_ROLES

CONV = {
    ("G", "I"): ["all_gather", "grouped_all_gather"],
    ("R", "I"): ["all_reduce"],
    ("R", "G"): ["reduce_scatter", "grouped_reduce_scatter"],
    ("G", "G"): ["all_to_all"],
    ("I", "G"): ["slice"],
}


def brute_force(th, cluster, ratios, sfb=True, cost=None):
    """Evaluate every program of :func:`all_programs` with the cost model (``cost(cm, program, ratios)``,
    default the plain stage cost) and return the cheapest ``(cost, program)``."""
    cm = CostModel(th, cluster)
    cost = cost or (lambda cm, p, r: cm.evaluate(p, r).cost_s)
    best = [math.inf, None]
    for program in all_programs(th, sfb):
        c = cost(cm, program, ratios)
        if c < best[0]:
            best[0], best[1] = c, list(program)
    return best[0], best[1]


def all_programs(th, sfb=True):
    """Every program in the search space (ops in order; every strategy; every way to get each input form:
    load once, or at most one collective per tensor)."""
    g = th.graph
    n_cons = {t.id: len(set(c for c in t.consumers)) for t in g.tensors}

    def rec(i, forms, converted, program):
        if i == len(g.ops):
            yield list(program)
            return
        op = g.ops[i]
        for s in th.strategies[i]:
            if s.sfb and (
                not sfb
                or any(
                    g.tensors[t].role == "param" and f == I and n_cons[t] > 1
                    for t, f in zip(op.inputs, s.inputs)
                )
            ):
                continue
            needs = list(dict.fromkeys(zip(op.inputs, s.inputs)))
            options = []
            ok = True
            for t, f in needs:
                have = forms.get(t, set())
                if f in have:
                    options.append([None])
                elif g.tensors[t].role in LOADABLE_ROLES:
                    if have:
                        ok = False
                        break
                    options.append([Load(t, f, s.sfb and f == I and g.tensors[t].role == "param")])
                elif t in converted or not have:
                    ok = False
                    break
                else:
                    opts = [
                        Conversion(t, n, src, f)
                        for src in sorted(have)
                        for n in CONV.get((src.kind, f.kind), [])
                    ]
                    if not opts:
                        ok = False
                        break
                    options.append(opts)
            if not ok:
                continue
            for combo in itertools.product(*options):
                loads = tuple(x for x in combo if isinstance(x, Load))
                convs = tuple(x for x in combo if isinstance(x, Conversion))
                if len({c.tensor for c in convs}) != len(convs):
                    continue
                nf = {k: set(v) for k, v in forms.items()}
                for ld in loads:
                    nf.setdefault(ld.tensor, set()).add(ld.form)
                for c in convs:
                    nf[c.tensor].add(c.dst)
                for t, f in zip(op.outputs, s.outputs):
                    nf.setdefault(t, set()).add(f)
                yield from rec(
                    i + 1, nf, converted | {c.tensor for c in convs}, program + [Step(op.id, s, loads, convs)]
                )

    yield from rec(0, {}, frozenset(), [])


def with_memory(c: Cluster, caps: list[float]) -> Cluster:
    return c.replace(
        devices=tuple(dataclasses.replace(d, memory_bytes=int(m)) for d, m in zip(c.devices, caps))
    )


def storage_variants(th, program, dstar):
    """``program`` with every replicated (non-SFB) parameter load also as ZeRO-2 and ZeRO-3 on its shard dim."""
    g = th.graph
    per = []
    for st in program:
        for ld in st.loads:
            d = dstar.get(ld.tensor)
            if g.tensors[ld.tensor].role == "param" and ld.form == I and not ld.sfb and d is not None:
                per.append([ld, Load(ld.tensor, I, False, 2, d), Load(ld.tensor, I, False, 3, d)])
            else:
                per.append([ld])
    for combo in itertools.product(*per):
        it = iter(combo)
        yield [dataclasses.replace(st, loads=tuple(next(it) for _ in st.loads)) for st in program]
