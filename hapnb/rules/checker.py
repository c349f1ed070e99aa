"""The ground-truth checker of every rule table (strategy validation, HAP style), its sample cases,
and the ``python -m hapnb.triples --check`` / ``hapnb theory --check`` command-line body.

For every registered op family, build sample inputs, and for every strategy split random full inputs
per its input forms with UNEVEN ratios (zero-length shards included): ``G`` narrows by the class
lengths, ``R`` gets asymmetric random partials that sum to the full tensor, ``I`` is a full copy. Run
:func:`~hapnb.rules.localize` per simulated rank, reassemble (``G``: concat in rank order, ``R``: sum,
``I``: every rank must equal the full result) and compare with the full op in float64. Backward: grads
of ``G`` inputs must concat to the full grad, of ``R`` inputs be complete on every rank, of ``I`` inputs
sum to the full grad (SFB weights: complete on every rank).

Discovered rules (:mod:`.discover`, ops without a hand rule) are checked the same way, for every
discovery known to this process or in the on-disk cache whose op can be rebuilt here (a custom op's
library must be imported); their rows have ``source == "discovered"`` and say so in the report.

This module is the top of :mod:`hapnb.rules`: it imports the registry (the family tables register
themselves when the package is imported). The module is ``checker`` and the function ``check``, so
``hapnb.rules.check`` is always the function and ``hapnb.rules.checker`` always the module.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..ir.forms import shard_lengths, shard_offsets
from ..ir.graph import Graph, Op, TensorArg, TensorRef
from .cases import sample_cases
from .discover import cached as _discovered
from .discover import rebuild as _rebuild
from .registry import (
    _RULES,
    LocalCall,
    LocalContext,
    Strategy,
    _aten,
    _short,
    _strict,
    family,
    flops,
    localize,
    registered,
    strategies,
)
from .truth import close, outputs_of, reassembles, split_input

__all__ = ["CheckRow", "CheckReport", "check", "main"]


@dataclass(frozen=True)
class CheckRow:
    """One checked (op case, strategy): status is 'ok', 'wrong' or 'crash'."""

    target: str
    case: str
    strategy: str
    status: str
    detail: str = ""
    source: str = "hand"  # "discovered": a strategy rule discovery found (hapnb.rules.discover)


@dataclass(frozen=True)
class CheckReport:
    """All rows of a :func:`check` run; ``ok`` when no rule is wrong or crashes."""

    rows: tuple[CheckRow, ...]
    seconds: float = 0.0
    unchecked: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.rows) and bool(self.rows)

    @property
    def wrong(self) -> tuple[CheckRow, ...]:
        return tuple(r for r in self.rows if r.status == "wrong")

    @property
    def crashed(self) -> tuple[CheckRow, ...]:
        return tuple(r for r in self.rows if r.status == "crash")

    def by_target(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for r in self.rows:
            d = out.setdefault(r.target, {"ok": 0, "wrong": 0, "crash": 0})
            d[r.status] += 1
        return out

    def __str__(self) -> str:
        lines = [f"{'op':44s} {'ok':>5s} {'wrong':>6s} {'crash':>6s}"]
        found = {r.target for r in self.rows if r.source == "discovered"}
        for t, d in sorted(self.by_target().items()):
            name = f"{t} (discovered)" if t in found else t
            lines.append(f"{name:44s} {d['ok']:5d} {d['wrong']:6d} {d['crash']:6d}")
        if self.wrong:
            lines.append("\nWRONG rules (output differs from the single-device op):")
            lines.extend(f"  {r.target} [{r.case}] {r.strategy}: {r.detail}" for r in self.wrong[:40])
        if self.crashed:
            lines.append("\nCRASHING rules (localized op raised):")
            lines.extend(f"  {r.target} [{r.case}] {r.strategy}: {r.detail}" for r in self.crashed[:40])
        gone = [u for u in self.unchecked if "(discovered" in u]
        unchecked = [u for u in self.unchecked if "(discovered" not in u]
        if unchecked:
            more = f", ... ({len(unchecked)} in all)" if len(unchecked) > 12 else ""
            lines.append(
                "\nregistered without a sample case (same table generator as checked ops): "
                + ", ".join(unchecked[:12])
                + more
            )
        if gone:
            lines.append("\ndiscovered rules not checked here: " + ", ".join(gone[:12]))
        n_ok = sum(r.status == "ok" for r in self.rows)
        lines.append(
            f"\n{len(self.rows)} checks, {n_ok} ok, {len(self.wrong)} wrong, {len(self.crashed)} crashed "
            f"({self.seconds:.1f} s): {'PASS' if self.ok else 'FAIL'}"
        )
        return "\n".join(lines)


def _single_op(target: str, args: tuple, kwargs: dict) -> tuple[Graph, Op, list[Any]]:
    """A one-op Graph for ``target(*args, **kwargs)`` with real tensors as its inputs."""
    import torch

    from ..ir.graph import normalize_args as _normalize

    fn = _aten(target)
    args, kwargs = _normalize(fn, tuple(args), dict(kwargs))
    tensors: list[TensorRef] = []
    full: list[Any] = []

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            k = len(full)
            full.append(v)
            tensors.append(TensorRef(k, f"in{k}", tuple(v.shape), str(v.dtype)[6:], "input"))
            return TensorArg(k)
        if isinstance(v, (list, tuple)):
            return tuple(conv(x) for x in v)
        return v

    cargs = tuple(conv(a) for a in args)
    ckw = tuple(sorted((k, conv(v)) for k, v in kwargs.items()))
    res = fn(*args, **kwargs)
    outs = list(res) if isinstance(res, (tuple, list)) else [res]
    items = tuple(range(len(outs))) if isinstance(res, (tuple, list)) else ()
    out_ids = []
    for k, o in enumerate(outs):
        tid = len(tensors)
        tensors.append(TensorRef(tid, f"out{k}", tuple(o.shape), str(o.dtype)[6:], "activation", producer=0))
        out_ids.append(tid)
    in_ids = tuple(range(len(full)))
    fl = flops(
        target, [t.shape for t in tensors[: len(full)]], [tensors[t].shape for t in out_ids], cargs, ckw
    )
    op = Op(
        0,
        "op",
        target,
        in_ids,
        tuple(out_ids),
        cargs,
        ckw,
        flops=fl,
        family=family(target),
        output_items=items,
    )
    g = Graph(tuple(tensors), (op,), in_ids, (), out_ids[0], name=target)
    return g, op, full


def _class_lengths(g: Graph, op: Op, s: Strategy, ratios: Sequence[float]) -> Callable[[int, int], tuple]:
    pairs = [(t, f.dim) for t, f in zip(op.inputs + op.outputs, s.inputs + s.outputs) if f.is_gather]
    if not pairs:
        return lambda t, d: ()
    base = 0
    for t, d in pairs:
        base = math.gcd(base, g.tensors[t].shape[d])
    lens = shard_lengths(base, ratios)

    def lengths(t: int, d: int) -> tuple[int, ...]:
        unit = g.tensors[t].shape[d] // base
        return tuple(unit * x for x in lens)

    return lengths


# inputs that never take a gradient (class weights of losses)
_NON_DIFF_INPUTS: dict[str, tuple[int, ...]] = {
    "aten.cross_entropy_loss.default": (2,),
    "aten.nll_loss_nd.default": (2,),
    "aten.nll_loss.default": (2,),
}


def _check_strategy(
    g: Graph, op: Op, full: list[Any], s: Strategy, n: int, ratios: Sequence[float], seed: int, backward: bool
) -> tuple[str, str]:
    import torch

    from .. import ops as hops

    gen = torch.Generator().manual_seed(seed)
    lengths = _class_lengths(g, op, s, ratios)
    full_call = LocalCall(_aten(op.target), op.args, op.kwargs)
    no_grad = _NON_DIFF_INPUTS.get(op.target, ())
    diff = [backward and x.is_floating_point() and k not in no_grad for k, x in enumerate(full)]
    want_in = [x.detach().clone().requires_grad_(d) for x, d in zip(full, diff)]
    low = any(g.tensors[t].itemsize < 8 and g.tensors[t].is_float for t in op.inputs + op.outputs)
    tol = 1e-5 if low else 1e-9
    want = outputs_of(full_call.run(want_in), op)
    local_ins = [split_input(x, f, t, lengths, n, gen) for x, f, t in zip(full, s.inputs, op.inputs)]
    cots = [
        torch.randn(w.shape, dtype=w.dtype, generator=gen) if w.is_floating_point() else None for w in want
    ]
    do_bwd = backward and any(w.requires_grad for w in want)
    if do_bwd:
        loss = sum((w * c).sum() for w, c in zip(want, cots) if c is not None and w.requires_grad)
        loss.backward()  # type: ignore[union-attr]
    sim = hops.RankSimulator(n)
    calls = [localize(g, op, s, LocalContext(r, n, lengths)) for r in range(n)]
    for _pass in range(2):
        got: list[list[Any]] = []
        grads: list[list[Any]] = []
        for r in range(n):
            xs = [v[r].detach().clone().requires_grad_(do_bwd and d) for v, d in zip(local_ins, diff)]
            with sim.rank(r):
                outs = outputs_of(calls[r].run(xs), op)
                if do_bwd:
                    lsum: Any = 0
                    for tid, o, f, c in zip(op.outputs, outs, s.outputs, cots):
                        if c is None or not o.requires_grad:
                            continue
                        if f.is_gather:
                            lens = lengths(tid, f.dim)
                            lc = c.narrow(f.dim, shard_offsets(lens)[r], lens[r])
                        elif f.is_reduce:
                            lc = c
                        else:
                            lc = c / n
                        lsum = lsum + (o * lc).sum()
                    if isinstance(lsum, torch.Tensor) and lsum.requires_grad:
                        lsum.backward()
            got.append([o.detach() for o in outs])
            grads.append([x.grad if x.requires_grad else None for x in xs])
        if not sim.records:
            break
        sim.next_pass()
    # forward
    for k, (w, f) in enumerate(zip(want, s.outputs)):
        tid = op.outputs[k]
        parts = [got[r][k] for r in range(n)]
        lens = lengths(tid, f.dim) if f.is_gather else ()
        ok, why = reassembles(parts, w.detach(), f, lens, tol)
        if not ok:
            return "wrong", f"output {k} ({f}): {why}"
    if not do_bwd:
        return "ok", ""
    for k, (x, f) in enumerate(zip(want_in, s.inputs)):
        if not x.requires_grad:
            continue
        ref = x.grad if x.grad is not None else torch.zeros_like(x)
        gs = [grads[r][k] if grads[r][k] is not None else torch.zeros_like(local_ins[k][r]) for r in range(n)]
        if f.is_gather:
            ok, why = close(torch.cat(gs, f.dim), ref, tol)
        elif f.is_reduce or (s.sfb and k > 0):
            ok, why = True, ""
            for r in range(n):
                ok, why = close(gs[r], ref, tol)
                if not ok:
                    why = f"rank {r}: {why}"
                    break
        else:
            ok, why = close(sum(gs[1:], gs[0]), ref, tol)
        if not ok:
            return "wrong", f"grad of input {k} ({f}): {why}"
    return "ok", ""


# -------------------------------------------------------------------------------- the check

_FIXED_RATIOS: tuple[tuple[float, ...], ...] = ((0.7, 0.3), (0.5, 0.0, 0.5), (0.4, 0.3, 0.2, 0.1))


def check(
    targets: Sequence[str] | None = None,
    *,
    trials: int = 20,
    seed: int = 0,
    shapes_per_case: int = 2,
    backward: bool = True,
    discovered: bool = True,
) -> CheckReport:
    """Check every rule against the single-device op (see the module docstring).

    ``targets`` restricts the check to those ops (``"linear"`` matches ``aten.linear.*``); ``trials``
    random (n, ratios) draws per strategy (n = 2..4, zero ratios included) on top of three fixed
    uneven ones; backward is checked on the fixed draws. ``discovered`` also checks the discovered rules
    (:mod:`.discover`) known to this process or its on-disk cache (rows with ``source="discovered"``).
    """
    t0 = time.perf_counter()
    with _strict():
        return _check(targets, trials, seed, shapes_per_case, backward, t0, discovered)


def _check(
    targets: Sequence[str] | None,
    trials: int,
    seed: int,
    shapes_per_case: int,
    backward: bool,
    t0: float,
    discovered: bool = True,
) -> CheckReport:
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows: list[CheckRow] = []
    cases = sample_cases()
    want = None
    if targets:
        want = [t if t.startswith("aten.") else f"aten.{t}." for t in targets]
    checked: set[str] = set()
    for target, build in cases:
        if want and not any(target == w or target.startswith(w) for w in want):
            continue
        checked.add(target)
        for _shape in range(shapes_per_case):
            try:
                args, kwargs = build(rng)
                g, op, full = _single_op(target, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - a broken sample is reported, not fatal
                rows.append(CheckRow(target, "?", "-", "crash", f"building the sample: {_short(exc)}"))
                continue
            case = " ".join(f"{list(t.shape)}" for t in (g.tensors[i] for i in op.inputs))
            try:
                strats = strategies(g, op)
            except Exception as exc:  # noqa: BLE001
                rows.append(CheckRow(target, case, "-", "crash", f"generating strategies: {_short(exc)}"))
                continue
            for s in strats:
                status, detail = _draws(g, op, full, s, rng, trials, shapes_per_case, backward)
                rows.append(CheckRow(target, case, str(s), status, detail))
    missing: list[str] = []
    if discovered:
        rows += _check_discovered(targets, rng, trials, shapes_per_case, backward, missing)
    unchecked = () if want else tuple(sorted(set(registered()) - checked))
    return CheckReport(tuple(rows), time.perf_counter() - t0, unchecked + tuple(sorted(set(missing))))


def _matches(target: str, targets: Sequence[str] | None) -> bool:
    if not targets:
        return True
    return any(target == t or target.startswith((t, f"aten.{t}.")) for t in targets)


def _check_discovered(
    targets: Sequence[str] | None,
    rng: random.Random,
    trials: int,
    shapes_per_case: int,
    backward: bool,
    missing: list[str],
) -> list[CheckRow]:
    """Rows for every discovered rule with an accepted strategy (this process's discoveries and the
    on-disk cache's) of an op that has no hand rule now (a cached discovery of an op that has since got
    one is never used); ops that cannot be rebuilt here (a custom op whose library is not imported) go to
    ``missing``. An op without autograd is checked forward only (the detail says so)."""
    rows: list[CheckRow] = []
    seen: set[str] = set()
    for d in _discovered():
        if not d.accepted or d.spec is None or not _matches(d.target, targets) or d.target in _RULES:
            continue
        try:
            target, args, kwargs = _rebuild(d.spec, seed=rng.randrange(1 << 30))
            g, op, full = _single_op(target, args, kwargs)
        except Exception:  # noqa: BLE001 - not rebuildable in this process
            missing.append(f"{d.target} (discovered; its op is not available here)")
            continue
        case = "discovered " + " ".join(f"{list(g.tensors[i].shape)}" for i in op.inputs)
        if (target, case) in seen:
            continue
        seen.add((target, case))
        try:
            strats = strategies(g, op)
        except Exception as exc:  # noqa: BLE001
            rows.append(CheckRow(target, case, "-", "crash", f"discovering: {_short(exc)}", "discovered"))
            continue
        for s in strats:
            status, detail = _draws(g, op, full, s, rng, trials, shapes_per_case, backward)
            if status == "crash" and backward:
                fwd, fdetail = _draws(g, op, full, s, rng, trials, shapes_per_case, False)
                if fwd != "crash":
                    status, detail = fwd, f"forward only (backward raised: {detail[:120]}) {fdetail}".strip()
            rows.append(CheckRow(target, case, str(s), status, detail, "discovered"))
    return rows


def _draws(
    g: Graph,
    op: Op,
    full: list[Any],
    s: Strategy,
    rng: random.Random,
    trials: int,
    shapes_per_case: int,
    backward: bool,
) -> tuple[str, str]:
    """Check one strategy on the fixed uneven ratio draws and random ones (zero ratios included)."""
    draws = [(r_, True) for r_ in _FIXED_RATIOS]
    for _ in range(max(0, trials // shapes_per_case - len(draws))):
        nn = rng.randint(2, 4)
        rs = [rng.choice((0.0, rng.random() + 0.05, rng.random() + 0.05)) for _ in range(nn)]
        if sum(rs) == 0:
            rs[0] = 1.0
        draws.append((tuple(rs), False))
    status, detail = "ok", ""
    for ratios, fixed in draws:
        try:
            status, detail = _check_strategy(
                g, op, full, s, len(ratios), ratios, rng.randrange(1 << 30), backward and fixed
            )
        except Exception as exc:  # noqa: BLE001
            status, detail = "crash", _short(exc)
        if status != "ok":
            return status, f"ratios {list(ratios)}: {detail}"
    return status, detail


def main(argv: Sequence[str] | None = None) -> int:
    """CLI body: ``python -m hapnb.triples --check [OP ...] [--trials N] [--seed S] [--list]``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m hapnb.triples", description="check hapnb's per-op sharding rules"
    )
    p.add_argument(
        "--check", nargs="*", metavar="OP", help="check all rules, or only these ops (e.g. linear)"
    )
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the rule tables")
    a = p.parse_args(argv)
    if a.list:
        for t, (fam, why) in registered().items():
            print(f"{fam:14s} {t:44s} {why}")
        return 0
    if a.check is None:
        p.print_help()
        return 2
    report = check(a.check or None, trials=a.trials, seed=a.seed)
    print(report)
    return 0 if report.ok else 1
