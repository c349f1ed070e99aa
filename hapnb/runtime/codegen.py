"""Code generation: one plan + the single-device program -> a torch.fx GraphModule per rank.

:func:`generate` walks the plan's instructions in order and keeps ``env[(tensor, form)] -> fx node``:

* ``load``: a user input becomes a placeholder (sliced with :func:`hapnb.runtime.collectives.shard` for ``G(d)``,
  or already the rank's slice with ``inputs="local"``); a parameter loaded ``I`` is
  ``collectives.replicate(get_attr)`` (identity forward, gradient all-reduce backward), ``load_sfb`` a
  plain ``get_attr`` (the SFB op makes the full gradient itself), ``G(d)`` the ``get_attr`` of the rank's
  pre-sliced parameter. Buffers and constants are never replicated (they have no gradient).
* ``collective``: the matching :mod:`hapnb.runtime.collectives` call with static Python-int shard lengths from
  ``plan.lengths_of``.
* ``compute``: :func:`hapnb.rules.localize` gives the call the rank runs on its local tensors.
* after the walk, the buffers the traced program updates (batch norm's running statistics) are computed
  from the plan's globally reduced statistics and written back in place (:mod:`hapnb.runtime.bufferupdates`).

The output is the rank's partial loss (``R`` form): summing it over ranks gives the single-device loss,
and back-propagating every rank's own partial loss gives correct gradients.

>>> import hapnb, torch
>>> from hapnb.runtime.codegen import generate
>>> plan = hapnb.synthesize("mlp", "2xV100", layers=1, hidden=8, input=4, batch=4)  # doctest: +SKIP
>>> prog = generate(plan, plan.graph, rank=0)  # doctest: +SKIP
>>> print(prog.module.code)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..ir.collective_table import COLLECTIVES as COLLECTIVE_TABLE
from ..ir.collective_table import CollectiveDef
from ..ir.forms import Form, G, I, R, shard_offsets
from ..ir.graph import Graph, Op
from . import collectives as C
from .bufferupdates import BufferUpdateError, emit_buffer_updates
from .collective_errors import instruction_label
from .program import (
    COLLECTIVE_FUNCTIONS,
    DROPOUT_TARGETS,
    NATIVE_DROPOUT,
    TRAINING_FLAG,
    CodegenError,
    LocalParam,
    RankProgram,
    as_run,
    device_anchor,
    has_dropout,
    ident,
    program_weights,
    run_constants,
    tied_groups,
    when_training,
)
from .random_stream import STREAM_ATTR, RandomStream

__all__ = ["generate"]


def _find_strategy(
    strategies: Sequence[Any], name: str, ins: tuple[Form, ...], outs: tuple[Form, ...]
) -> Any | None:
    same = [s for s in strategies if tuple(s.inputs) == ins and tuple(s.outputs) == outs]
    for s in same:
        if s.name == name:
            return s
    return same[0] if same else None


def _collective_call(
    spec: CollectiveDef,
    x: fx.Node,
    src: Form,
    dst: Form,
    src_lengths: Callable[[], tuple[int, ...]],
    dst_lengths: Callable[[], tuple[int, ...]],
    new_lengths: tuple[int, ...] | None,
) -> tuple[Callable[..., Any], tuple, dict]:
    """The :mod:`hapnb.runtime.collectives` call that runs collective ``spec`` on ``x`` (``src`` -> ``dst``):
    the function its table entry names and the arguments that function takes."""
    fn = getattr(C, spec.runtime)
    if spec.runtime == "all_gather":
        return fn, (x, src.dim, src_lengths()), {"padded": spec.padded}
    if spec.runtime == "reduce_scatter":
        return fn, (x, dst.dim, dst_lengths()), {"padded": spec.padded}
    if spec.runtime == "all_to_all":
        return fn, (x, src.dim, dst.dim, src_lengths(), dst_lengths()), {}
    if spec.runtime == "reshard":
        return fn, (x, src.dim, src_lengths(), new_lengths), {}
    if spec.runtime == "shard":
        return fn, (x, dst.dim, dst_lengths()), {}
    return fn, (x,), {}  # all_reduce, to_partial


# ------------------------------------------------------------------------------------------ generate


def generate(
    plan: Any,
    graph: Graph | None = None,
    rank: int = 0,
    *,
    inputs: str = "full",
    dropout: bool = True,
    dtype: torch.dtype | str | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    strategies: Callable[[Graph, Op], Sequence[Any]] | None = None,
    localize: Callable[..., Any] | None = None,
    grad_sync: str = "sync",
    seed: int | None = None,
) -> RankProgram:
    """Build rank ``rank``'s program for ``plan`` on ``graph`` (default ``plan.graph``).

    ``inputs="full"``: the module takes the full global batch and slices it itself; ``"local"``: it takes
    the rank's slice of every ``G``-loaded input (see :meth:`RankProgram.local_inputs`). ``dropout=False``
    replaces dropout by identity (exact verification); with ``True`` dropout runs while the module trains
    and is off after ``module.eval()`` (it reads ``module.training``). ``dtype`` (e.g. ``torch.float64``)
    casts floating weights and float32 and half dtype constants in op arguments. ``weights`` overrides the weights
    taken from ``graph.program``; ``strategies``/``localize`` override :mod:`hapnb.rules` (hand-built graphs).
    A plan over virtual devices (``gpus > 1``) is expanded first (:func:`hapnb.runtime.expand.expand_virtual`):
    ``rank`` then counts physical GPUs. ``grad_sync="sync"``: a replicated parameter is wrapped in
    :func:`hapnb.runtime.collectives.replicate` (its gradient is all-reduced inside autograd); ``"buckets"``: it is
    used as it is and listed in :attr:`RankProgram.grad_sync` for the runtime to all-reduce (DDP-like
    async buckets, :mod:`hapnb.run.buckets`). A parameter also loaded ``load_sfb`` always syncs in-graph.
    Random ops draw from the module's :class:`~hapnb.runtime.random_stream.RandomStream` seeded with
    ``seed`` (default ``torch.initial_seed()``): every rank must be given the same one.
    """
    from .. import rules

    g = graph if graph is not None else getattr(plan, "graph", None)
    if g is None:
        raise CodegenError(
            f"plan {plan.name} carries no graph; pass graph=hapnb.trace(model, example_inputs) or use "
            "hapnb.run.bundle.load_bundle"
        )
    if plan.graph_fingerprint and g.fingerprint and plan.graph_fingerprint != g.fingerprint:
        raise CodegenError(
            f"plan {plan.name} was made for graph {plan.graph_fingerprint} but this graph is {g.fingerprint} "
            "(a different model, shapes or batch size); synthesize a plan for this model"
        )
    if inputs not in ("full", "local"):
        raise ValueError(f"inputs must be 'full' or 'local', got {inputs!r}")
    if grad_sync not in ("sync", "buckets"):
        raise ValueError(f"grad_sync must be 'sync' or 'buckets', got {grad_sync!r}")
    from .expand import expand_virtual, has_virtual

    if has_virtual(plan):  # virtual devices: rank = one physical GPU of the expanded plan
        plan = expand_virtual(plan, g, strategies=strategies)
    if not 0 <= rank < plan.cluster.n:
        raise ValueError(f"rank {rank} is out of range for a plan on {plan.cluster.n} devices")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if weights is None:
        weights = program_weights(g) if g.params else {}
    b = _RankBuilder(
        plan,
        g,
        rank,
        inputs,
        dropout,
        dtype,
        grad_sync,
        strategies or rules.strategies,
        localize or rules.localize,
        torch.initial_seed() if seed is None else seed,
    )
    b.place_inputs()
    b.make_weights(weights)
    for k, ins in enumerate(plan.program):
        b.index = k
        where = b.label()  # how errors name it, codegen's and a collective's at run time alike
        if ins.kind == "load":
            b.load(ins, where)
        elif ins.kind == "collective":
            b.collective(ins, where)
        elif ins.kind == "compute":
            b.compute(ins, where)
        else:
            raise CodegenError(f"{where}: unknown instruction kind {ins.kind!r}")
    return b.finish()


class _RankBuilder:
    """The state of one rank program while :func:`generate` walks the plan: the fx graph, the node of every
    ``(tensor, form)`` made so far (``env``; ``tagged`` for forms re-cut at a segment edge), the local
    weights (``records``) and what the runtime must do besides (``bucketed`` gradients, ``notes``)."""

    def __init__(
        self, plan: Any, g: Graph, rank: int, inputs: str, dropout: bool, dtype: torch.dtype | None,
        grad_sync: str, strat_fn: Callable[..., Any], local_fn: Callable[..., Any], seed: int,
    ) -> None:  # fmt: skip
        self.plan, self.g, self.rank, self.n = plan, g, rank, plan.cluster.n
        self.inputs, self.dropout, self.dtype, self.grad_sync = inputs, dropout, dtype, grad_sync
        self.seed = seed  # of the random ops' stream
        self.strat_fn, self.local_fn = strat_fn, local_fn
        self.ops_by_name = {op.name: op for op in g.ops}
        self.fxg = fx.Graph()
        self.root = torch.nn.Module()
        self.used: set[str] = set()
        self.env: dict[tuple[int, Form], fx.Node] = {}
        self.tagged: dict[tuple[int, Form, int], tuple[fx.Node, tuple[int, ...]]] = {}
        self.notes: list[str] = []
        self.in_nodes: dict[int, fx.Node] = {}
        self.input_slices: list[tuple[int, int, int]] = []
        self.records: dict[str, LocalParam] = {}
        self.attr_nodes: dict[str, fx.Node] = {}
        self.repl_nodes: dict[str, fx.Node] = {}
        self.bucketed: list[str] = []
        self.index = 0  # the instruction being generated (its collectives are labelled with it)
        self.device_node: fx.Node | None = None
        self.training_node: fx.Node | None = None
        self.stream_node: fx.Node | None = None
        # what is loaded in which forms (ZeRO: the stored shard), and whether any load is ZeRO-3
        self.load_forms: dict[str, list[tuple[Form, bool]]] = {}
        self.zero3 = any(ins.kind == "load" and ins.name == "load_zero3" for ins in plan.program)
        for ins in plan.program:
            if ins.kind == "load":
                f = ins.src_value if ins.name.startswith("load_zero") else ins.form_value
                forms = self.load_forms.setdefault(ins.tensor, [])
                if (f, ins.name == "load_sfb") not in forms:
                    forms.append((f, ins.name == "load_sfb"))
        # tied names share one local parameter: it syncs in-graph if any of its names is loaded load_sfb
        self.sfb_loaded: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def lengths(self, name: str, dim: int, where: str) -> tuple[int, ...]:
        try:
            ls = tuple(int(x) for x in self.plan.lengths_of(name, dim))
        except KeyError:
            raise CodegenError(
                f"{where}: the plan has no shard lengths for {name} dim {dim}; the plan is incomplete"
            ) from None
        if len(ls) != self.n:
            raise CodegenError(
                f"{where}: shard lengths of {name} dim {dim} have {len(ls)} entries, not {self.n}"
            )
        return ls

    def emit(self, target: Any, args: tuple, kwargs: dict | None = None, name: str | None = None) -> fx.Node:
        return self.fxg.create_node("call_function", target, args, kwargs or {}, name=name)

    def attr(self, name: str) -> fx.Node:
        nd = self.attr_nodes.get(name)
        if nd is None:
            nd = self.attr_nodes[name] = self.fxg.get_attr(self.records[name].local_name)
        return nd

    def label(self, role: str = "") -> str:
        """What errors call the current instruction's collective (:func:`.collective_errors.instruction_label`)."""
        return instruction_label(self.index, self.plan.program[self.index], role)

    def replicated(self, name: str) -> fx.Node:
        nd = self.repl_nodes.get(name)
        if nd is None:
            local = self.records[name].local_name
            if self.grad_sync == "buckets" and local not in self.sfb_loaded:
                nd = self.repl_nodes[name] = self.attr(name)
                if local not in self.bucketed:
                    self.bucketed.append(local)
            else:
                where = {"where": self.label("the all-reduce of its gradient")}
                nd = self.repl_nodes[name] = self.emit(
                    C.replicate, (self.attr(name),), where, name=f"{local}_I"
                )
        return nd

    def runtime_device(self) -> fx.Node:
        if self.device_node is None:
            self.device_node = device_anchor(self.root, self.fxg)
        return self.device_node

    def training(self) -> fx.Node:
        """The node of the module's ``training`` flag (what dropout reads at run time)."""
        if self.training_node is None:
            self.training_node = self.fxg.get_attr(TRAINING_FLAG)
        return self.training_node

    def random_stream(self) -> fx.Node:
        """The node of the module's :class:`~hapnb.runtime.random_stream.RandomStream` (what random ops draw
        from)."""
        if self.stream_node is None:
            self.root.add_module(STREAM_ATTR, RandomStream(self.seed))
            self.stream_node = self.fxg.get_attr(STREAM_ATTR)
        return self.stream_node

    def constants(self, value: Any) -> Any:
        """An argument tree's traced constants as this program runs them (dtype, device)."""
        return run_constants(value, self.dtype, self.runtime_device)

    def emit_traced(self, fn: Any, args: tuple, kwargs: dict, name: str | None = None) -> fx.Node:
        """Emit a traced op's call as this program runs it (:func:`hapnb.runtime.program.as_run`)."""
        fn, args, kwargs = as_run(
            fn, args, kwargs, dtype=self.dtype, dropout=self.dropout, device=self.runtime_device,
            stream=self.random_stream,
        )  # fmt: skip
        if self.dropout and has_dropout(fn):  # dropout as traced while training, none after module.eval()
            fn, args = when_training(fn), (self.training(), *args)
        return self.emit(C.regathered(fn) if self.zero3 else fn, args, kwargs, name)

    def need(self, tid: int, f: Form, where: str) -> fx.Node:
        nd = self.env.get((tid, f))
        if nd is None:
            have = sorted(str(ff) for (tt, ff) in self.env if tt == tid)
            raise CodegenError(
                f"{where}: needs {self.g.tensors[tid].name}:{f}, which no earlier instruction produced "
                f"(available forms: {', '.join(have) or 'none'}); "
                "the plan's program is out of order or corrupt"
            )
        return nd

    def fetch(
        self, tid: int, f: Form, segment: int | None, where: str
    ) -> tuple[fx.Node, tuple[int, ...] | None]:
        """The node of ``tensor:f`` and, for a form re-cut for a ratio segment (``G1@2``), its lengths."""
        if segment is None:
            return self.need(tid, f, where), None
        ent = self.tagged.get((tid, f, segment))
        if ent is None:
            raise CodegenError(
                f"{where}: needs {self.g.tensors[tid].name}:{f}@{segment}, which no earlier reshard produced; "
                "the plan's program is out of order or corrupt"
            )
        return ent

    def tensor(self, name: str, where: str) -> Any:
        try:
            return self.g.tensor(name)
        except KeyError as e:
            raise CodegenError(f"{where}: {e}") from None

    # ------------------------------------------------------------------ placeholders and weights
    def place_inputs(self) -> None:
        """One placeholder per user input, and how the rank cuts it (``inputs="local"``: its own slice)."""
        for tid in self.g.inputs:
            t = self.g.tensors[tid]
            self.in_nodes[tid] = self.fxg.placeholder(ident(t.name, self.used))
            forms = self.load_forms.get(t.name, [])
            gforms = [f for f, _ in forms if f.kind == "G"]
            if self.inputs == "local" and gforms:
                if len(forms) != 1:
                    raise CodegenError(
                        f"input {t.name} is loaded as {', '.join(str(f) for f, _ in forms)}; "
                        "inputs='local' needs one form per input (use inputs='full')"
                    )
                d = gforms[0].dim
                ls = self.lengths(t.name, d, f"load {t.name}")
                self.input_slices.append((d, shard_offsets(ls)[self.rank], ls[self.rank]))
            else:
                self.input_slices.append((-1, 0, t.shape[0] if t.shape else 0))

    def make_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """The rank's parameters, buffers and constants: its shard where every use loads one ``G`` form,
        else the whole tensor. Tied parameters (one tensor under several names) become one local
        parameter: autograd sums the gradients of all its uses and the optimizer updates one copy."""
        g = self.g
        missing = [g.tensors[t].name for t in g.params if g.tensors[t].name not in weights]
        if missing:
            raise CodegenError(f"no weight given for {', '.join(missing)}")
        tied = tied_groups(weights, [g.tensors[t].name for t in g.params if g.tensors[t].role == "param"])
        for tid in g.params:
            t = g.tensors[tid]
            members = tied.get(t.name, [t.name])
            aliases = tuple(m for m in members if m != t.name)
            if members[0] != t.name:  # a later name of a tied parameter: the first name's local parameter
                self.records[t.name] = dataclasses.replace(
                    self.records[members[0]], name=t.name, aliases=aliases
                )
                continue
            full = weights[t.name].detach()
            if self.dtype is not None and full.is_floating_point():
                full = full.to(self.dtype)
            loaded = [m for m in members if m in self.load_forms]
            if aliases:
                self.check_tied_pins(members, loaded)
            forms = [f for m in loaded for f in self.load_forms[m]]
            forms = [f for k, f in enumerate(forms) if f not in forms[:k]]
            trainable = t.role == "param" and t.requires_grad
            only_g = len(forms) == 1 and forms[0][0].kind == "G" and not forms[0][1]
            if only_g:  # tied names cut differently (other segments' ratios) share the full tensor instead
                d = forms[0][0].dim
                only_g = len({self.lengths(m, d, f"load {m}") for m in loaded}) == 1
            lname = ident(loaded[0] if loaded else t.name, self.used)
            if only_g:
                ls = self.lengths(loaded[0], d, f"load {loaded[0]}")
                start = shard_offsets(ls)[self.rank]
                local = full.narrow(d, start, ls[self.rank]).clone().contiguous()
                rec = LocalParam(
                    lname, t.name, t.role, str(G(d)), t.shape, d, start, ls[self.rank], ls, trainable, aliases
                )
            else:
                local = full.clone()
                rec = LocalParam(
                    lname, t.name, t.role, "I", t.shape, requires_grad=trainable, aliases=aliases
                )
            if t.role == "param":
                self.root.register_parameter(lname, torch.nn.Parameter(local, requires_grad=trainable))
            else:
                self.root.register_buffer(lname, local)
            self.records[t.name] = rec
        self.sfb_loaded = {
            self.records[m].local_name
            for m, fs in self.load_forms.items()
            if m in self.records and any(b for _, b in fs)
        }

    def check_tied_pins(self, members: Sequence[str], loaded: Sequence[str]) -> None:
        """A pin on a name of a tied parameter that the program never loads (it uses the tensor under
        another name) would be silently ignored: refuse it, naming both names."""
        pins = dict(getattr(self.plan, "pins", ()) or ())
        for m in members:
            if m in pins and m not in loaded and loaded and any(pins.get(u) != pins[m] for u in loaded):
                used = " and ".join(loaded)
                raise CodegenError(
                    f"plan {self.plan.name} pins {m}={pins[m]}, but {m} is tied to {used} (one tensor) and "
                    f"the program uses it only as {used}, so the pin has no effect; pin {loaded[0]}={pins[m]} "
                    f"instead (or pin both names alike)"
                )

    # ------------------------------------------------------------------ instructions
    def load(self, ins: Any, where: str) -> None:
        """A load: an input (whole, or cut to the rank's slice), or a weight in the form the program uses
        (its local shard, replicated with its gradient synced, or gathered from a ZeRO shard)."""
        t = self.tensor(ins.tensor, where)
        f = ins.form_value
        key = (t.id, f)
        if key in self.env:
            return
        if t.role == "input":
            ph = self.in_nodes[t.id]
            if f.kind == "I" or self.inputs == "local":
                if self.inputs == "local" and f.kind == "I" and self.load_forms[t.name] != [(I, False)]:
                    raise CodegenError(f"{where}: inputs='local' cannot also load {t.name} replicated")
                self.env[key] = ph
            elif f.kind == "G":
                ls = self.lengths(t.name, f.dim, where)
                self.env[key] = self.emit(C.shard, (ph, f.dim, ls), name=_tname(t.name, f))
            else:
                raise CodegenError(f"{where}: an input cannot be loaded in form {f}")
            return
        if t.name not in self.records:
            raise CodegenError(f"{where}: {t.name} is not an input, parameter, buffer or constant")
        rec = self.records[t.name]
        sfb = ins.name == "load_sfb"
        if ins.name in ("load_zero2", "load_zero3"):  # stored sharded, all-gathered before use
            stored = ins.src_value
            if f != I or stored.kind != "G" or not rec.sharded or rec.dim != stored.dim:
                raise CodegenError(
                    f"{where}: {ins.name} needs {t.name} stored as one shard {stored} and used as I; "
                    f"the program also loads it as {rec.form}"
                )
            ls = self.lengths(t.name, stored.dim, where)
            fn = C.gather_param if ins.name == "load_zero3" else C.all_gather
            kw = {"where": where}
            self.env[key] = self.emit(fn, (self.attr(t.name), stored.dim, ls), kw, name=_tname(t.name, f))
            return
        if f.kind == "G" and rec.sharded:
            self.env[key] = self.attr(t.name)
        elif f.kind == "G":
            src = self.replicated(t.name) if rec.requires_grad else self.attr(t.name)
            ls = self.lengths(t.name, f.dim, where)
            self.env[key] = self.emit(C.shard, (src, f.dim, ls), name=_tname(t.name, f))
        elif f.kind == "I":
            self.env[key] = self.attr(t.name) if sfb or not rec.requires_grad else self.replicated(t.name)
        else:
            raise CodegenError(f"{where}: a weight cannot be loaded in form {f}")
        if sfb and (t.id, I) not in self.env:
            self.env[(t.id, I)] = self.env[key]

    def collective(self, ins: Any, where: str) -> None:
        """A collective: the :mod:`hapnb.runtime.collectives` call its table entry names."""
        t = self.tensor(ins.tensor, where)
        src, dst = ins.src_value, ins.form_value
        x, src_lens = self.fetch(t.id, src, ins.src_segment, where)
        spec = COLLECTIVE_TABLE.get(ins.name)
        if spec is None:
            raise CodegenError(f"{where}: unknown collective {ins.name!r}")
        same_dim = src.kind == dst.kind == "G" and src.dim == dst.dim
        _expect(where, (src.kind, dst.kind) == (spec.src, spec.dst) and same_dim == spec.resegments, ins.name)
        new_lens: tuple[int, ...] | None = None
        if spec.resegments:
            new_lens = tuple(int(v) for v in getattr(ins, "lengths", ()) or ())
            if len(new_lens) != self.n:
                raise CodegenError(f"{where}: a reshard needs the {self.n} new shard lengths, got {new_lens}")
        fn, args, kwargs = _collective_call(
            spec,
            x,
            src,
            dst,
            lambda: src_lens if src_lens is not None else self.lengths(t.name, src.dim, where),
            lambda: self.lengths(t.name, dst.dim, where),
            new_lens,
        )
        if fn in COLLECTIVE_FUNCTIONS:  # it communicates: its errors name this instruction
            kwargs = {**kwargs, "where": where}
        nd = self.emit(fn, args, kwargs, _tname(t.name, dst))
        if ins.segment is not None:
            self.tagged[(t.id, dst, ins.segment)] = (nd, new_lens if new_lens is not None else ())
        else:
            self.env[(t.id, dst)] = nd

    def compute(self, ins: Any, where: str) -> None:
        """A computation: the op localized for its strategy on this rank (:func:`hapnb.rules.localize`)."""
        from ..rules import LocalContext

        g = self.g
        op = self.ops_by_name.get(ins.op)
        if op is None:
            raise CodegenError(f"{where}: the graph has no op named {ins.op!r}")
        in_forms = tuple(f for _, f, _ in ins.input_forms)
        out_forms = tuple(f for _, f in ins.output_forms)
        if len(in_forms) != len(op.inputs) or len(out_forms) != len(op.outputs):
            raise CodegenError(
                f"{where}: op {op.name} has {len(op.inputs)} inputs and {len(op.outputs)} outputs but the "
                f"instruction gives {len(in_forms)} and {len(out_forms)} forms"
            )
        args_nodes = []
        recut: dict[tuple[int, int], tuple[int, ...]] = {}  # inputs re-cut for this op's segment
        for tid, (_, f0, segment) in zip(op.inputs, ins.input_forms):
            node, lens = self.fetch(tid, f0, segment, where)
            args_nodes.append(node)
            if lens is not None and f0.kind == "G":
                recut[(tid, f0.dim)] = lens
        if not self.dropout and op.target in DROPOUT_TARGETS + (NATIVE_DROPOUT,):
            if out_forms[0] != in_forms[0]:
                raise CodegenError(f"{where}: dropout changes the form {in_forms[0]} -> {out_forms[0]}")
            self.env[(op.outputs[0], out_forms[0])] = args_nodes[0]
            if len(op.outputs) > 1:  # native_dropout's mask: all kept
                mask = self.emit(torch.ops.aten.ones_like.default, (args_nodes[0],), {"dtype": torch.bool})
                self.env[(op.outputs[1], out_forms[1])] = mask
            return
        strat = _find_strategy(self.strat_fn(g, op), ins.name, in_forms, out_forms)
        if strat is None:
            raise CodegenError(
                f"{where}: op {op.name} ({op.target}) has no strategy {ins.name!r} with inputs "
                f"({', '.join(map(str, in_forms))}) and outputs ({', '.join(map(str, out_forms))})"
            )

        def ctx_lengths(tid: int, dim: int) -> tuple[int, ...]:
            return recut.get((tid, dim)) or self.lengths(g.tensors[tid].name, dim, where)

        _check_cuts(g, op, strat, ctx_lengths, where)
        try:
            call = self.local_fn(g, op, strat, LocalContext(self.rank, self.n, ctx_lengths))
        except CodegenError:
            raise
        except Exception as e:
            raise CodegenError(
                f"{where}: localizing op {op.name} ({op.target}) with strategy {strat.name} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        cargs, ckw = call.bind(args_nodes)
        out_name = _tname(g.tensors[op.outputs[0]].name, out_forms[0]) if len(op.outputs) == 1 else op.name
        # hapnb's own ops (a bias on rank 0 only, an SFB backward) run as autocast runs the whole op
        fn = autocast_whole(call.fn) if call.fn in _AUTOCAST_WHOLE else call.fn
        # with ZeRO-3, autograd keeps no gathered weight: the op's backward gathers it again
        nd = self.emit_traced(fn, cargs, ckw, out_name)
        if op.output_items:
            for tid, item, f in zip(op.outputs, op.output_items, out_forms):
                self.env[(tid, f)] = self.emit(
                    operator.getitem, (nd, item), name=_tname(g.tensors[tid].name, f)
                )
        else:
            self.env[(op.outputs[0], out_forms[0])] = nd

    # ------------------------------------------------------------------ the end
    def finish(self) -> RankProgram:
        """Batch norm's running-statistics updates, the partial loss as the output, the GraphModule."""
        g = self.g
        try:
            self.notes += emit_buffer_updates(
                g, lambda fn, a, kw: self.emit(fn, self.constants(a), self.constants(kw)), self.env,
                lambda name, dim: self.lengths(name, dim, "buffer update"), self.records, self.attr,
            )  # fmt: skip
        except BufferUpdateError as e:
            raise CodegenError(str(e)) from None
        loss = g.tensors[g.loss]
        out = self.env.get((loss.id, R))
        if out is None and (loss.id, I) in self.env:
            out = self.emit(C.to_partial, (self.env[(loss.id, I)],), name=_tname(loss.name, R))
            self.notes.append("the loss was replicated; rank 0 keeps it (to_partial)")
        if out is None:
            raise CodegenError(
                f"the plan never produces the loss {loss.name} (as R or I); the program is incomplete"
            )
        self.fxg.output(out)
        self.fxg.lint()
        gm = fx.GraphModule(self.root, self.fxg, class_name=f"Rank{self.rank}Program")
        gm.graph.lint()
        # GraphModule copies only the attributes its graph reads: keep weights the program never uses (a
        # tied name, a parameter the loss does not depend on), so every record names a real attribute
        present = {k for k, _ in gm.named_parameters()} | {k for k, _ in gm.named_buffers()}
        for rec in self.records.values():
            if rec.local_name not in present:
                present.add(rec.local_name)
                if rec.local_name in self.root._parameters:
                    gm.register_parameter(rec.local_name, self.root._parameters[rec.local_name])
                else:
                    gm.register_buffer(rec.local_name, self.root._buffers[rec.local_name])
        return RankProgram(
            module=gm,
            rank=self.rank,
            n=self.n,
            params=tuple(self.records[g.tensors[t].name] for t in g.params),
            input_names=tuple(g.tensors[t].name for t in g.inputs),
            input_slices=tuple(self.input_slices),
            inputs=self.inputs,
            loss=loss.name,
            fingerprint=g.fingerprint,
            notes=tuple(self.notes),
            grad_sync=tuple(self.bucketed),
            input_shapes=tuple(tuple(g.tensors[t].shape) for t in g.inputs),
        )


_AUTOCAST_WRAPPED: dict[Any, Callable[..., Any]] = {}


def autocast_whole(fn: Any) -> Callable[..., Any]:
    """``fn`` (one of :mod:`hapnb.ops`' local forms of a matmul or convolution) run as ``torch.autocast``
    runs the whole op it stands for: under autocast on the device of its tensors, its float32 tensor
    arguments are cast to the autocast dtype and ``fn`` runs with autocast off; without autocast it is
    ``fn``. So every rank's part comes out in the dtype the whole op gives: rank 0's ``prod + bias`` (the
    bias added on rank 0 only) would otherwise promote to the bias's float32 while the other ranks keep
    the product's bfloat16, and the partial sums' collective would mix dtypes (gloo aborts on the size
    mismatch); and a custom backward (SFB's weight gradient), which autocast does not reach, sees one
    dtype. One named function per ``fn``, callable as an fx op.

    >>> f = autocast_whole(torch.matmul)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     f(torch.ones(2, 2), torch.ones(2, 2)).dtype
    torch.bfloat16
    """
    w = _AUTOCAST_WRAPPED.get(fn)
    if w is None:

        def w(*args: Any, **kwargs: Any) -> Any:
            dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
            if not torch.is_autocast_enabled(dev):
                return fn(*args, **kwargs)
            low = torch.get_autocast_dtype(dev)
            args = tuple(
                a.to(low) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args
            )
            with torch.autocast(dev, enabled=False):
                return fn(*args, **kwargs)

        name = "autocast_whole_" + "".join(
            ch if ch.isalnum() else "_" for ch in getattr(fn, "__name__", "op")
        )
        w.__name__ = w.__qualname__ = name
        _AUTOCAST_WRAPPED[fn] = w
    return w


def _autocast_whole_ops() -> tuple[Any, ...]:
    from .. import ops

    return (ops.addmm_partial, ops.conv_partial, ops.linear_partial, ops.sfb_linear, ops.sfb_matmul)


#: the localized calls :func:`autocast_whole` wraps: a bias term only rank 0 adds (their result dtype
#: under autocast would differ by rank), SFB's custom backward (autocast does not reach it)
_AUTOCAST_WHOLE = _autocast_whole_ops()


def _tname(t: str, f: Form) -> str:
    """The fx node name of tensor ``t`` in form ``f``."""
    return re.sub(r"\W", "_", f"{t}_{f}")


def _check_cuts(
    g: Graph, op: Op, strat: Any, lengths: Callable[[int, int], tuple[int, ...]], where: str
) -> None:
    """All G-form dims of one strategy are one partition: their per-rank lengths must be proportional to
    the dims' sizes. A mismatch means tensors cut for different ratio segments meet without a reshard."""
    pairs = [(t, f.dim) for t, f in zip(op.inputs, strat.inputs) if f.kind == "G"]
    pairs += [(t, f.dim) for t, f in zip(op.outputs, strat.outputs) if f.kind == "G"]
    if len(pairs) < 2:
        return
    t0, d0 = pairs[0]
    s0, l0 = g.tensors[t0].shape[d0], lengths(t0, d0)
    for t, d in pairs[1:]:
        s, ls = g.tensors[t].shape[d], lengths(t, d)
        if any(a * s != b * s0 for a, b in zip(l0, ls)):
            raise CodegenError(
                f"{where}: {g.tensors[t0].name} dim {d0} is cut {l0} but {g.tensors[t].name} dim {d} is cut "
                f"{ls}; op {op.name} needs both cut alike (tensors from different ratio segments meet "
                "without a reshard). The plan is inconsistent: re-synthesize it, or without segments"
            )


def _expect(where: str, ok: bool, name: str) -> None:
    if not ok:
        raise CodegenError(f"{where}: the forms do not fit the collective {name}")
