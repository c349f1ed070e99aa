"""Memory in the search (:class:`MemoryTracker`): prune partial programs that cannot fit, and decide at the
end how each replicated-use parameter is stored: replicated, ZeRO-2 or ZeRO-3.

With ``Search(..., memory=True)`` every node carries, per device, the parts of :mod:`hapnb.cost.memory` of its
prefix (P, In, A, L, F, X as a ``(6, n)`` array), the live saved-for-backward keys (a bit mask: an activation
saved twice in one form counts once) and its *deferred* parameters (a bit mask).

* **Deferred storage.** A parameter a strategy uses replicated (``I``, not SFB) can be kept replicated (its
  gradient all-reduced), ZeRO-2 or ZeRO-3 (sharded on ``G(d*)``, the dim with the smallest largest shard;
  see :class:`hapnb.cost.model.Load`). The choice changes neither the properties nor the stages (all three
  communicate), only an additive communication term and the memory, so the search appends a deferred load
  (``zero=-1``) charged at the *lean* price: the cheapest option's communication and, in every memory part,
  the least any option takes (the shard in P, nothing in A and F). Both are lower bounds of every option.
* **Realization.** When a program completes, its deferred parameters get the cheapest choice that fits
  every device: first each one's cheapest option; if that does not fit, a small integer program (identical
  parameters grouped into counts per option; HiGHS or CBC through PuLP) minimising the extra communication
  over the lean price subject to each device's two peak constraints (backward and optimizer phase) and the
  largest re-gathered copy. The complete node costs the lean cost plus that extra, exactly.
* **Pruning.** A node is pruned when a lower bound of its final peak exceeds a device's capacity: its parts
  plus the least the rest must add (every later parameter and input in its leanest allowed form, every
  later op's least saved activations that no earlier op can have saved) through the peak formula. The peak
  only grows as a program grows, so this never prunes a program that fits. The peak's two phases are one
  linear map of the parts (:data:`_PHASES`), evaluated once per node for both this test and the storage
  bound (:meth:`MemoryTracker.check`).
* **Dominance.** Of two partial programs with the same key, one dominates the other only if it is no
  costlier (the plain search's test), no larger in every memory part on every device, has saved at least
  the other's live activations and deferred no parameter the other did not. Then for every completion of
  the other there is one of this program that is no costlier and fits wherever the other fits (apply the
  other's realization to the shared deferred parameters), so A* stays exact for fixed ratios among the
  programs that fit.

ZeRO options are searched when ``options["zero"]`` (default True) and the cluster has more than one device
and no virtual devices (whose inner data parallelism the cost model prices for replicated storage only).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cost.memory import _PART_OF, _PARTS, load_pieces, op_pieces, saved_key, storage
from ..cost.model import Load
from ..ir.forms import Form, I
from .balance import _quiet_stdout, _solver

__all__ = ["MemoryTracker", "MemState"]

_P, _IN, _A, _L, _F, _X = range(6)
#: the peak's two phases as rows over the parts (P, In, A, L, F, X): the backward ``3P + In + A + 2L + F +
#: X`` and the optimizer step ``5P + In`` (:meth:`MemoryTracker.peak`'s maximum written out)
_PHASES = np.array([[3.0, 1.0, 1.0, 2.0, 1.0, 1.0], [5.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
_ROW = {kind: _PARTS.index(part) for kind, part in _PART_OF.items()}  # a summed piece kind -> its row
#: one node's memory: (parts per device, live saved keys, deferred parameters)
MemState = tuple[np.ndarray, int, int]
_PIECES: weakref.WeakKeyDictionary[Any, dict[Any, list[Any]]] = weakref.WeakKeyDictionary()


class MemoryTracker:
    """Per-node memory for one :class:`hapnb.synth.search.Search` (see the module docstring)."""

    def __init__(self, search: Any) -> None:
        s = search
        g, th, cm = s.graph, s.theory, s.cost_model
        self.g, self.th, self.cm, self.n = g, th, cm, s.n
        self.ratios = s.ratios
        self.pins = {**s.pins, **s.storage}  # a storage pin: stored as its shard, never deferred
        self.storage = storage(g)
        devs = s.cluster.devices
        self.names = s.cluster.names
        self.cap = np.array([float(d.memory_bytes) for d in devs])
        self.scale = np.array([1.0 + (d.model.memory_overhead if d.model is not None else 0.0) for d in devs])
        self.const = np.array(
            [d.model.memory_const_bytes * d.gpus if d.model is not None else 0.0 for d in devs]
        )
        self.zero_ok = bool(s.options.get("zero", True)) and cm.zero_priced
        self._vec: dict[tuple[int, Form, int], np.ndarray] = {}
        self._time: dict[Load, float] = {}
        self._dstar: dict[int, Form | None] = {}
        self._dbit: dict[int, int] = {}
        self._sbit: dict[tuple[int, str, float], int] = {}
        self._sdie: dict[tuple[int, str, float], int] = {}
        self._op: dict[int, tuple[np.ndarray | None, list[tuple[int, np.ndarray]]]] = {}
        self._realized: dict[Any, tuple[float, tuple[Load, ...]] | None] = {}
        self._dies = [0] * (len(g.ops) + 1)
        for pos, comp in enumerate(s._ops):
            for c in comp:
                self._compile_op(pos, c, s._last_use)  # each tensor's last reader (the search's tables)
        self._future(s)
        self._groups()
        self._phase_tables()
        self.stats = {"realized": 0, "milp": 0, "pruned_memory": 0}

    # ------------------------------------------------------------------ pieces as vectors
    def vec(self, t: int, f: Form, seg: int = -1) -> np.ndarray:
        """Local bytes of tensor ``t`` in form ``f`` per device at the search's ratios."""
        key = (t, f, seg)
        v = self._vec.get(key)
        if v is None:
            v = self._vec[key] = np.array(self.cm._local(t, f, self.ratios, seg), dtype=float)
        return v

    def pieces(self, pos: int, strategy: Any) -> list[Any]:
        """:func:`hapnb.cost.memory.op_pieces` of op ``pos`` under ``strategy`` (they do not depend on the ratios:
        cached per theory, for every search over it)."""
        cache = _PIECES.setdefault(self.th, {})
        key = (pos, strategy)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = op_pieces(self.g, self.g.ops[pos], strategy, self.storage)
        return hit

    def _compile_op(self, pos: int, c: Any, last: Sequence[int]) -> None:
        L: np.ndarray | None = None
        saved = []
        for p in self.pieces(pos, c.strategy):
            v = self.vec(p.tensor, p.form, p.segment) * p.scale
            if p.kind == "output":
                L = v if L is None else np.maximum(L, v)
                continue
            key = saved_key(p, self.n)
            bit = self._sbit.get(key)
            if bit is None:
                bit = self._sbit[key] = 1 << len(self._sbit)
            # the key dies after the last use of any tensor of its storage (views saved by later ops)
            die, old = max(last[p.tensor], pos), self._sdie.get(key, -1)
            if die > old:
                if old >= 0:
                    self._dies[old] &= ~bit
                self._dies[die] |= bit
                self._sdie[key] = die
            saved.append((bit, v))
        self._op[id(c)] = (L, saved)

    # ------------------------------------------------------------------ loads
    def dstar(self, t: int) -> Form | None:
        """The shard form a deferred parameter ``t`` would be stored in (None: not deferrable)."""
        if t in self._dstar:
            return self._dstar[t]
        tr = self.g.tensors[t]
        best = None
        if self.zero_ok and tr.role == "param" and t not in self.pins:
            gs = [f for f in self.th.forms[t] if f.kind == "G"]
            if gs:
                best = min(gs, key=lambda f: (float(self.vec(t, f).max()), f.dim))
                self._dbit[t] = 1 << len(self._dbit)
        self._dstar[t] = best
        return best

    def load(self, t: int, f: Form, sfb: bool) -> Load:
        """The load the search appends to get ``t`` in ``f``: deferred storage for a replicated use."""
        d = self.dstar(t) if f == I and not sfb else None
        return Load(t, f, sfb, -1, d) if d is not None else Load(t, f, sfb)

    def options(self, ld: Load) -> list[tuple[str, Load, float]]:
        """A deferred load's options ``(name, concrete load, seconds)``: replicated, ZeRO-2, ZeRO-3 (a load is
        deferred only where ZeRO is allowed, :meth:`dstar`)."""
        t, d = ld.tensor, ld.stored
        out = [("replicated", Load(t, I), self.time(Load(t, I)))]
        for z in (2, 3):
            concrete = Load(t, I, False, z, d)
            out.append((f"zero{z}", concrete, self.time(concrete)))
        return out

    def time(self, ld: Load) -> float:
        """Seconds of communication of a load (a deferred one: its cheapest option)."""
        v = self._time.get(ld)
        if v is None:
            if ld.zero == -1:
                v = min(x for _, _, x in self.options(ld))
            else:
                v = sum(tm.time(self.ratios) for tm in self.cm.load_terms(ld))
            self._time[ld] = v
        return v

    # ------------------------------------------------------------------ states
    def root(self) -> MemState:
        return np.zeros((6, self.n)), 0, 0

    def _add(self, mem: np.ndarray, pieces: Sequence[Any]) -> None:
        for p in pieces:
            v = self.vec(p.tensor, p.form, p.segment) * p.scale
            if p.kind == "regather":
                np.maximum(mem[_F], v, out=mem[_F])
            else:
                mem[_ROW[p.kind]] += v

    def advance(self, state: MemState, pos: int, c: Any, loads: Sequence[Load]) -> MemState:
        """The state after appending op ``pos`` under compiled strategy ``c`` with ``loads``."""
        mem, sv, dm = state
        mem = mem.copy()
        for ld in loads:
            self._add(mem, load_pieces(self.g, ld))
            if ld.zero == -1:
                dm |= self._dbit[ld.tensor]
        L, saved = self._op[id(c)]
        if L is not None:
            np.maximum(mem[_L], L, out=mem[_L])
        for bit, v in saved:
            if not sv & bit:
                mem[_A] += v
                sv |= bit
        return mem, sv & ~self._dies[pos], dm

    def _raw(self, mem: np.ndarray, pos: int | None = None) -> np.ndarray:
        """Raw bytes of each phase (rows of :data:`_PHASES`) per device of ``mem``, with the least the ops from
        ``pos`` on must add."""
        raw = _PHASES @ mem
        return raw if pos is None else raw + self._rest[pos]

    def peak(self, mem: np.ndarray, pos: int | None = None) -> np.ndarray:
        """Peak bytes per device of ``mem`` (with the least the ops from ``pos`` on must add)."""
        return self._raw(mem, pos).max(axis=0) * self.scale + self.const

    def check(self, state: MemState, pos: int) -> tuple[str, float]:
        """:meth:`exceeds` and :meth:`storage_bound` from one evaluation of the node's phases: ``(why the
        node cannot fit, or "", the extra seconds its storage will cost)``."""
        raw = self._raw(state[0], pos)
        why = self._over(raw)
        return (why, 0.0) if why else ("", self._storage(raw, state[2]))

    def exceeds(self, state: MemState, pos: int) -> str:
        """Why the node cannot fit (empty when it may)."""
        return self._over(self._raw(state[0], pos))

    def _over(self, raw: np.ndarray) -> str:
        peak = raw.max(axis=0) * self.scale + self.const
        over = peak - self._limit
        j = int(np.argmax(over))
        if over[j] <= 0:
            return ""
        self.stats["pruned_memory"] += 1
        return f"memory: {self.names[j]} needs at least {peak[j] / 2**30:.3f} GiB of {self.cap[j] / 2**30:.3f} GiB"

    def dominates(self, a: MemState, b: MemState) -> bool:
        """Whether memory state ``a`` is no worse than ``b`` for every completion (module docstring)."""
        return (a[1] & b[1]) == b[1] and not (a[2] & ~b[2]) and bool((a[0] <= b[0]).all())

    def _groups(self) -> None:
        """Deferrable parameters whose one cheapest option is replicated, grouped by (bytes, extra P per
        device, extra seconds of their cheapest ZeRO option): per group the deferred-bit mask, the extra P
        per device if replicated, and the extra seconds per parameter if switched to ZeRO."""
        groups: dict[Any, list[Any]] = {}
        for t in self.g.tensors:
            d = self.dstar(t.id) if t.role == "param" else None
            if d is None:
                continue
            ld = Load(t.id, I, False, -1, d)
            opts = self.options(ld)
            rep, zero = opts[0][2], min(x for _, _, x in opts[1:])
            dP = self._deltas(ld, "replicated")[0]
            if zero <= rep or not dP.any():
                continue
            g = groups.setdefault((t.nbytes, dP.tobytes(), zero - rep), [0, dP, zero - rep])
            g[0] |= self._dbit[t.id]
        self._gmask = [g[0] for g in groups.values()]
        self._gdP = np.array([g[1] for g in groups.values()]).reshape(len(groups), self.n)
        self._gcost = np.array([g[2] for g in groups.values()])

    def storage_bound(self, state: MemState, pos: int) -> float:
        """A lower bound of the extra seconds the deferred parameters' storage will cost. Keeping every
        deferred parameter of :meth:`_groups` replicated (its cheapest option) overflows a device's
        optimizer phase by ``need`` bytes (its backward phase likewise), even with the least the rest must
        add; switching one parameter to ZeRO saves at most ``5 * scale * extra P`` bytes of the optimizer
        phase (``3 *`` of the backward) and costs at least its group's extra seconds: the cheapest
        fractional cover of ``need`` (a fractional knapsack per device and phase) bounds the cost."""
        return self._storage(self._raw(state[0], pos), state[2])

    def _phase_tables(self) -> None:
        """Per position, the two phases of the least the rest must add (:meth:`_raw`); per device, the peak
        beyond which a node is pruned; the deferred bits of every group of :meth:`_groups`."""
        self._rest = _PHASES[:, :3] @ self._fut  # (positions, phases, devices): the rest adds P, In, A only
        self._limit = self.cap * (1 + 1e-9) + 1.0
        self._gall = 0
        for m in self._gmask:
            self._gall |= m
        self._deferred_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _deferred(self, dm: int) -> tuple[np.ndarray, np.ndarray]:
        """Per group of :meth:`_groups`, how many of deferred mask ``dm``'s parameters it holds, and the P
        per device they would add kept replicated."""
        hit = self._deferred_of.get(dm)
        if hit is None:
            counts = np.array([(dm & m).bit_count() for m in self._gmask], dtype=float)
            hit = self._deferred_of[dm] = (counts, counts @ self._gdP)
        return hit

    def _storage(self, raw: np.ndarray, dm: int) -> float:
        """:meth:`storage_bound` from the node's phases ``raw`` (:meth:`_raw`) and deferred mask ``dm``."""
        if not dm & self._gall:
            return 0.0
        counts, extra = self._deferred(dm)
        mult = _PHASES[:, :1]  # a byte of P counts 3x in the backward, 5x in the optimizer step
        need = (raw + mult * extra) * self.scale + self.const - self.cap  # bytes over, per phase and device
        if not (need > 0).any():
            return 0.0
        best = 0.0
        for k, row in zip(mult[:, 0], need):
            hot = row > 0
            if not hot.any():
                continue
            save = k * self.scale[hot] * self._gdP[:, hot]  # bytes of peak one switch saves (G, hot)
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.where(save > 0, self._gcost[:, None] / save, np.inf)
            order = np.argsort(q, axis=0, kind="stable")
            qs = np.take_along_axis(q, order, 0)
            supply = np.take_along_axis(counts[:, None] * save, order, 0)
            before = np.cumsum(supply, axis=0) - supply
            take = np.clip(row[hot][None, :] - before, 0.0, supply)
            cost = np.where(take > 0, qs * take, 0.0).sum(axis=0)
            best = max(best, float(cost.max()))
        return best

    def _future(self, s: Any) -> None:
        """``_fut[pos]``: the least P, In and A per device the ops ``pos..`` must still add."""
        g, n = self.g, self.n
        n_ops = len(g.ops)
        at = np.zeros((n_ops + 1, 3, n))
        for t in g.tensors:
            if t.role not in ("param", "input", "buffer", "const") or not t.consumers:
                continue
            pin = self.pins.get(t.id)
            forms = [getattr(pin, "form", pin)] if pin is not None else list(self.th.forms[t.id])
            least = np.min([self.vec(t.id, f) for f in forms], axis=0)
            at[min(t.consumers), 0 if t.role == "param" else 1] += least
        first: dict[int, int] = {}  # a storage -> the first op that may save it (or a view of it)
        for pos, comp in enumerate(s._ops):
            for c in comp:
                for p in self.pieces(pos, c.strategy):
                    if p.kind == "saved":
                        first.setdefault(saved_key(p, 1)[0], pos)
        for pos, comp in enumerate(s._ops):
            least = None
            for c in comp:
                v = np.zeros(n)
                for p in self.pieces(pos, c.strategy):
                    if p.kind == "saved" and first[saved_key(p, 1)[0]] == pos:
                        v += self.vec(p.tensor, p.form, p.segment) * p.scale
                least = v if least is None else np.minimum(least, v)
            if least is not None:
                at[pos, 2] += least
        self._fut = np.cumsum(at[::-1], axis=0)[::-1]

    # ------------------------------------------------------------------ realization
    def finish(self, state: MemState, extra: Sequence[Any]) -> MemState:
        """The state with the final conversions (after the last step) added."""
        if not extra:
            return state
        mem = state[0].copy()
        for cv in extra:
            mem[_X] += self.vec(cv.tensor, cv.dst)
        return mem, state[1], state[2]

    def realize(self, state: MemState, loads: Sequence[Load]) -> tuple[float, tuple[Load, ...]] | None:
        """The cheapest storage of the deferred ``loads`` that fits every device: ``(extra seconds over
        the lean price, concrete loads in the order given)``; None when nothing fits."""
        mem = state[0]
        key = (state[2], mem.tobytes())
        if key in self._realized:
            return self._realized[key]
        self.stats["realized"] += 1
        opts = [self.options(ld) for ld in loads]
        lean = [self.time(ld) for ld in loads]
        # each parameter's cheapest option (ties: replicated first) when that fits
        pick = [min(range(len(o)), key=lambda k, o=o: (o[k][2], k)) for o in opts]
        out = self._fits(mem, loads, opts, pick)
        if out is None and self.zero_ok:
            self.stats["milp"] += 1
            pick = self._solve(mem, loads, opts, lean)
            out = None if pick is None else self._fits(mem, loads, opts, pick)
        res = None
        if out is not None:
            res = (sum(opts[i][k][2] - lean[i] for i, k in enumerate(pick)), out)
        if res is None:
            self.stats["pruned_memory"] += 1
        self._realized[key] = res
        return res

    def _deltas(self, ld: Load, name: str) -> tuple[np.ndarray, float, float]:
        """(extra P per device, extra A, F candidate) of an option over the lean deferred load."""
        full = float(self.g.tensors[ld.tensor].nbytes)
        if name == "replicated":
            return full - self.vec(ld.tensor, ld.stored), 0.0, 0.0
        if name == "zero2":
            return np.zeros(self.n), full, full
        return np.zeros(self.n), 0.0, 2.0 * full

    def _fits(
        self, mem: np.ndarray, loads: Sequence[Load], opts: Any, pick: Sequence[int]
    ) -> tuple[Load, ...] | None:
        m = mem.copy()
        for ld, o, k in zip(loads, opts, pick):
            dP, dA, dF = self._deltas(ld, o[k][0])
            m[_P] += dP
            m[_A] += dA
            m[_F] = np.maximum(m[_F], dF)
        if (self.peak(m) > self.cap).any():
            return None
        return tuple(o[k][1] for o, k in zip(opts, pick))

    def _solve(
        self, mem: np.ndarray, loads: Sequence[Load], opts: Any, lean: Sequence[float]
    ) -> list[int] | None:
        """The integer program over option counts per group of identical parameters (module docstring)."""
        import pulp

        groups: dict[Any, list[int]] = {}
        for i, ld in enumerate(loads):
            dP = self._deltas(ld, "replicated")[0]
            key = (self.g.tensors[ld.tensor].nbytes, dP.tobytes(), tuple(x[2] - lean[i] for x in opts[i]))
            groups.setdefault(key, []).append(i)
        gib = 2.0**30
        prob = pulp.LpProblem("hapnb_storage", pulp.LpMinimize)
        y, objective = {}, []
        F = prob.add_variable("F", float(mem[_F].max()) / gib)
        dPs, Ae = [], []
        for gi, (key, members) in enumerate(groups.items()):
            i0, cnt, full = members[0], len(members), key[0] / gib
            for k in range(len(opts[i0])):
                y[gi, k] = prob.add_variable(f"y_{gi}_{k}", 0, cnt, cat="Integer")
                objective.append((opts[i0][k][2] - lean[i0]) * 1e3 * y[gi, k])  # milliseconds
            prob += pulp.lpSum(y[gi, k] for k in range(len(opts[i0]))) == cnt, f"all_{gi}"
            dPs.append(self._deltas(loads[i0], "replicated")[0] / gib)
            Ae.append(full * y[gi, 1])
            for k, mult in ((1, 1.0), (2, 2.0)):  # the largest zero2 / zero3 copy sets F
                u = prob.add_variable(f"u_{gi}_{k}", 0, 1, cat="Integer")
                prob += y[gi, k] <= cnt * u, f"used_{gi}_{k}"
                prob += F >= mult * full * u, f"F_{gi}_{k}"
        prob += pulp.lpSum(objective)
        seen = set()
        for j in range(self.n):  # one pair of constraints per distinct device
            P, In, A0 = mem[_P][j] / gib, mem[_IN][j] / gib, mem[_A][j] / gib
            tr = (2.0 * mem[_L][j] + mem[_X][j]) / gib
            sc, c0, cap = self.scale[j], self.const[j] / gib, self.cap[j] / gib
            sig = (P, In, A0, tr, sc, c0, cap, tuple(d[j] for d in dPs))
            if sig in seen:
                continue
            seen.add(sig)
            Pj = P + pulp.lpSum(d[j] * y[gi, 0] for gi, d in enumerate(dPs) if d[j])
            prob += sc * (5.0 * Pj + In) + c0 <= cap, f"opt_{j}"
            prob += sc * (3.0 * Pj + In + A0 + pulp.lpSum(Ae) + tr + F) + c0 <= cap, f"bwd_{j}"
        with _quiet_stdout():
            status = prob.solve(_solver())
        if pulp.LpStatus[status] != "Optimal":
            return None
        pick = [0] * len(loads)
        for gi, members in enumerate(groups.values()):
            counts = [round(y[gi, k].value() or 0) for k in range(len(opts[members[0]]))]
            it = iter(members)
            for k, cnt in enumerate(counts):
                for _ in range(cnt):
                    pick[next(it)] = k
        return pick
