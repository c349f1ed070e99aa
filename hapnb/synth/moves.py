"""The search's moves: what one step can do at a node, and what it costs.

A step runs one strategy of the next op. :class:`Moves` (the base of :class:`hapnb.synth.search.Search`)
compiles each op's strategies that the pins allow into :class:`_Compiled` moves with their per-device
computation, and answers, in the hot loop, how a strategy gets each input form it needs from the node's
state: present already, a load (plain, SFB, or a ZeRO storage's gather), or a collective from a form the
tensor has (:data:`~hapnb.synth.heuristic.CONVERSIONS`; outside the duplex search only the cheapest of
them, as every one leaves the same state), each priced at the search's ratios. Prices are
shared through the search's ``shared`` dict by the searches of one re-planning context at the same
ratios (a collective's price per price class of tensors; a plain load's per cluster).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cost.model import Conversion, Load, Step
from ..ir.forms import Form, R
from ..rules import Strategy
from .heuristic import CONVERSIONS
from .spec import PinError, explain_no_strategy
from .tables import entries_for, theory_tables

__all__ = ["Moves"]

_PRESENT = [(None, 0, 0, 0, 0.0)]  # the option of a needed form that is present (nothing to add)

#: why a strategy cannot run at a node (:meth:`Search._need_options`' ``fail``), shown when recording
_UNMET = {
    1: "{t} is already loaded in another form",
    2: "{t} was already communicated once",
    3: "no collective gives {t}:{f}",
}


@dataclass(slots=True)
class _Compiled:
    strategy: Strategy
    comp: tuple[float, ...]
    out_bits: int
    needs: tuple[tuple[int, Form], ...]  # distinct (tensor, form) inputs
    reshards: tuple[Conversion, ...]  # G inputs from another segment (re-cut for this op's ratios)
    need_bits: tuple[int, ...]  # the property bit of each of ``needs``
    index: int  # its place in the theory's strategies of the op
    fixed: tuple[float, ...] | None = None  # its own communication seconds: re-cuts, then SFB (first use)


class Moves:
    """What a step can do at a search node, and its price: the compiled strategies of every op, the load
    and collective options of each needed form, a strategy's own communication (re-cuts, SFB) and the
    intra-machine gradient syncs of virtual devices. Needs the search's ``graph``, ``theory``,
    ``cost_model``, ``ratios``, ``pins``, ``storage``, ``options``, ``_reps``, ``_shared`` and ``_mem``."""

    def _compile_moves(self) -> list[tuple[float, ...]]:
        """Each op's strategies allowed by the pins as :class:`_Compiled` moves with their per-device
        computation, and the hot loop's lookup tables; returns each op's per-device computation lower
        bound (the cheapest strategy's)."""
        g, th, cm = self.graph, self.theory, self.cost_model
        # the ratio-independent tables: built once per theory (hapnb.synth.optimize passes one "static" dict for
        # every search of a context; a table is reused only for the very theory it was built from)
        static = self._shared.get("static")
        hit = static.get("tables") if static is not None else None
        if hit is not None and hit[0] is th:
            tables, self._cv_lists = hit[1], hit[2]
        else:
            tables = theory_tables(th, cm.segment_of)
            # (source bit, target bit) -> the collectives between the two forms, each with whether it is a
            # grouped one (ratio-independent)
            self._cv_lists: dict[tuple[int, int], tuple[tuple[Conversion, bool], ...]] = {}
            if static is not None:
                static["tables"] = (th, tables, self._cv_lists)
        self._tables = tables
        self._price_class = tables.price_class
        self._bit = tables.bit
        self._tmask = tables.tmask
        self._forms_of_bit = tables.forms_of_bit
        self._loadable = tables.loadable
        self._last_use = tables.last_use
        self._dies_at = tables.dies_at
        self._dies_comm = tables.dies_comm
        self._ops: list[list[_Compiled]] = []
        comp_of = self._shared.setdefault("comp", {})  # (op, strategy index) -> per-device seconds
        lb = []
        allowed = entries_for(th, tables, self.pins, self.storage, bool(self.options["sfb"]))
        for op, row in zip(g.ops, allowed):
            if not row:
                raise PinError(explain_no_strategy(self, op.id))
            comp_list = []
            for e in row:
                key = (op.id, e.index)
                comp = comp_of.get(key)
                if comp is None:
                    comp = comp_of[key] = cm.comp(op.id, e.strategy, self.ratios, self._reps)
                comp_list.append(
                    _Compiled(e.strategy, comp, e.out_bits, e.needs, e.reshards, e.need_bits, e.index)
                )
            self._ops.append(comp_list)
            lb.append(tuple(map(min, zip(*(c.comp for c in comp_list)))))
        # what does not depend on the ratios is kept per cluster: ``shared["per_cluster"]`` (hapnb.synth.optimize
        # passes one dict for every search of a context on this cluster)
        self._per_cluster: dict[Any, Any] = self._shared.setdefault("per_cluster", {})
        # the hot loop's lookups by property bits (ints hash fast): a load's option [(Load, bit, 0, 1, seconds)]
        # by (bit, sfb) (a plain load's price does not depend on the ratios: shared per cluster, unless a
        # storage pin makes the search's loads its own); the options to get a tensor's needed form from its
        # present ones by (present bits, target bit), with and without the grouped collectives, all of them
        # (the duplex search) or the cheapest alone (shared by the searches at these ratios); an SFB sync's
        # time; a collective's time per price class
        self._load_opts: dict[tuple[int, bool], list[Any]] = (
            {} if self.storage else self._per_cluster.setdefault("plain loads", {})
        )
        self._conv_opts: dict[tuple[int, int], tuple[list[Any], ...]] = self._shared.setdefault(
            "conv_opts", {}
        )
        # which of the four lists (:meth:`_conversion_options`)
        self._conv_pick = (0 if self.options["grouped"] else 1) + (0 if self.duplex else 2)
        self._sfb_of: dict[tuple[int, int], float] = self._shared.setdefault("sfb", {})
        self._conv_t: dict[tuple[int, str, int], float] = self._shared.setdefault("conv_t", {})
        self._loss_bits_R = self._bit.get((g.loss, R), 0)
        self._has_inner = any(cm.inner_sync_s_per_byte)
        return lb

    def _load(self, t: int, f: Form, sfb: bool) -> Load:
        """The load appended to get ``t`` in ``f``: a storage pin's ZeRO load, a deferred storage
        (memory=True, :mod:`hapnb.synth.memory_prune`) or the plain load."""
        st = self.storage.get(t)
        if st is not None:
            return Load(t, f, False, st.zero, st.form)
        return self._mem.load(t, f, sfb) if self._mem is not None else Load(t, f, sfb)

    def _load_option(self, t: int, f: Form, sfb: bool, bit: int) -> list[Any]:
        """The hot loop's one option to load ``t`` in ``f`` (``bit``): ``[(Load, bit, 0, 1, seconds)]``, kept
        per (bit, sfb) unless loads are priced by the memory tracker."""
        opts = self._load_opts.get((bit, sfb)) if self._mem is None else None
        if opts is None:
            ld = self._load(t, f, sfb)
            opts = [(ld, bit, 0, 1, self._load_time(ld))]
            if self._mem is None:
                self._load_opts[(bit, sfb)] = opts
        return opts

    def _load_s(self, t: int, f: Form, sfb: bool) -> float:
        """Seconds of loading ``t`` in ``f`` (the spine bound's price of a load)."""
        return self._load_option(t, f, sfb, self._bit[(t, f)])[0][4]

    def _collective_s(self, cv: Conversion) -> float:
        """Seconds of a collective at the search's ratios, shared by the tensors of one price class (same
        bytes, ratio segment and need of a gradient) and by the searches at these ratios."""
        key = (self._price_class[cv.tensor], cv.name, cv.segment)
        v = self._conv_t.get(key)
        if v is None:
            v = self._conv_t[key] = sum(tm.time(self.ratios) for tm in self.cost_model.conversion_terms(cv))
        return v

    def _load_time(self, ld: Load) -> float:
        """Communication seconds of a load (a deferred one: its cheapest storage)."""
        if self._mem is not None:
            return self._mem.time(ld)
        return sum(tm.time(self.ratios) for tm in self.cost_model.load_terms(ld))

    def _conversion_options(self, t: int, have: int, f: Form, bit: int) -> tuple[list[Any], ...]:
        """The hot loop's options to get tensor ``t`` in ``f`` (``bit``) from its present forms (``have``):
        one per collective from each present form, with its time, with and without the grouped collectives
        (lists 0 and 1), and of each of those the cheapest alone (lists 2 and 3; the first of equal ones).
        A collective's time is shared by the tensors of one price class; the collectives between two forms
        of a tensor are kept per theory (``_cv_lists``).

        Every collective that gives the form leaves the same state (the form added, the tensor's token
        spent) and differs only in seconds, so outside the duplex search a costlier one's child is dominated
        by the cheapest's: with other communication in the step both close the stage and the cheapest is no
        costlier; where only the cheapest is free, its step joins the open stage, which no completion makes
        costlier than closing it and paying more (a stage's maximum over devices is at most the sum of its
        parts' maxima). One option per need stops the product over an op's needs from exploding: a Mamba
        block's ``stack`` of 16 scan steps, each given in another form, made 65,536 children per expansion.
        The duplex search takes every option (its labels are compared on a Pareto front)."""
        opts: tuple[list[Any], list[Any]] = ([], [])
        tbit = 1 << t
        while have:
            low = have & -have
            have ^= low
            cvs = self._cv_lists.get((low, bit))
            if cvs is None:
                _, src = self._forms_of_bit[low]
                cvs = self._cv_lists[(low, bit)] = tuple(
                    (Conversion(t, name, src, f), name.startswith("grouped"))
                    for name in CONVERSIONS.get((src.kind, f.kind), ())
                )
            for cv, grouped in cvs:
                x = (cv, bit, tbit, 2, self._collective_s(cv))
                opts[0].append(x)
                if not grouped:
                    opts[1].append(x)
        return (*opts, *([min(o, key=lambda x: x[4])] if o else [] for o in opts))

    def _fixed(self, op: int, c: _Compiled) -> tuple[float, ...]:
        """A compiled strategy's own communication seconds, in the order the cost adds them: its re-cuts of
        inputs from another ratio segment, then its SFB sync."""
        if c.fixed is None:
            c.fixed = tuple(self._collective_s(cv) for cv in c.reshards) + (
                (self._sfb_time(op, c),) if c.strategy.sfb else ()
            )
        return c.fixed

    def _sfb_time(self, op: int, c: _Compiled) -> float:
        """An SFB strategy's sync seconds (shared by the searches at these ratios)."""
        key = (op, c.index)
        v = self._sfb_of.get(key)
        if v is None:
            st = Step(op, c.strategy)
            v = self._sfb_of[key] = sum(tm.time(self.ratios) for tm in self.cost_model.sfb_terms(st))
        return v

    def _need_options(self, c: _Compiled, props: int, comm: int) -> tuple[list[Any], int, int, Any]:
        """How strategy ``c`` gets each input it needs in the node's state: per (tensor, form) the options
        (load | conversion | None, new property bits, comm bit, kind (0 present, 1 load, 2 conversion),
        seconds), or why it cannot run here (``fail``: a key of :data:`_UNMET`, with the tensor and form)."""
        g, loadable, tmask = self.graph, self._loadable, self._tmask
        per_need: list[list[tuple[Any, int, int, int, float]]] = []
        for (t, f), bit in zip(c.needs, c.need_bits):
            if props & bit:
                per_need.append(_PRESENT)
                continue
            if loadable[t]:
                if props & tmask[t]:
                    return per_need, 1, t, f
                sfb = c.strategy.sfb and f.kind == "I" and g.tensors[t].role == "param"
                opts = self._load_opts.get((bit, sfb)) if self._mem is None else None
                per_need.append(opts or self._load_option(t, f, sfb, bit))
                continue
            if comm >> t & 1:
                self._stats.pruned_repeated_comm += 1
                return per_need, 2, t, f
            have = props & tmask[t]
            pair = self._conv_opts.get((have, bit))
            if pair is None:
                pair = self._conv_opts[(have, bit)] = self._conversion_options(t, have, f, bit)
            opts = pair[self._conv_pick]
            if not opts:
                return per_need, 3, t, f
            per_need.append(opts)
        return per_need, 0, -1, None

    def _with_loads(
        self, loads: tuple[Load, ...], comp: tuple[float, ...], tail: tuple[float, ...]
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """A step's computation and the label's tail with what its loads add besides communication: the
        intra-machine gradient syncs of virtual devices of several GPUs (in the step's computation, or,
        duplex, in the tail, once per iteration after both micro-batches) and, on device-model devices, the
        loaded weights' optimizer step (in the tail, :mod:`hapnb.synth.optimizer_step`)."""
        if self._has_inner:
            for ld in loads:
                inner_all = self.cost_model.load_comp(ld, self.ratios)
                inner = tuple(inner_all[j] for j in self._reps)
                if self.duplex:
                    tail = tuple(a + b for a, b in zip(tail, inner))
                else:
                    comp = tuple(a + b for a, b in zip(comp, inner))
        if self._opt is not None:
            tail = self._opt.add(tail, loads)
        return comp, tail


def stage_step(
    base: float, acc: tuple[float, ...], acc_max: float, opens: bool, comm_s: float, comp: tuple[float, ...]
) -> tuple[float, tuple[float, ...]]:
    """A step's plain label ``(base, acc)`` from its parent's (``acc_max = max(acc)``): a step that
    communicates (or the first) closes the open stage at its slowest device and opens one with its
    communication and computation; another joins the open stage (the duplex label:
    :func:`hapnb.synth.duplex.label_step`)."""
    if comm_s > 0.0 or opens:
        return base + acc_max + comm_s, comp
    return base, tuple(a + b for a, b in zip(acc, comp))
