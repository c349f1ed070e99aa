"""Verification: run a plan on local ranks and compare it with the single-device program.

:func:`verify` writes a bundle, starts K worker ranks (gloo on CPU) under the process supervisor, trains
a few optimizer steps with dropout off (float64 by default) and compares, against the single-device
program with the same weights, batch and random numbers (the random ops of both draw from a stream seeded
with :data:`VERIFY_SEED`, :mod:`hapnb.runtime.random_stream`: drop path verifies exactly): the loss at every step, every parameter gradient after the
first backward and every weight and buffer (batch norm's running statistics) after the last step.
Workers report progress (a heartbeat per phase and step); a run that stops reporting for
``stall_timeout`` seconds is *stuck*, one that keeps reporting but passes ``timeout`` is *slow*, and the
:class:`VerifyError` says which.

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100", layers=1, hidden=8, input=4, batch=4)  # doctest: +SKIP
>>> print(hapnb.verify(plan, nproc=2).summary())  # doctest: +SKIP
OK: 3 steps on 2 ranks (float64), max relative error 1.2e-16 (worst: grad layers.0.weight), ...
"""

from __future__ import annotations

import dataclasses
import html
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..ir.graph import Graph
from ..pipelines import PipelinePlan
from ..plans.plan import Plan
from ..runtime.codegen import generate
from ..runtime.expand import expand_virtual, has_virtual
from ..runtime.program import program_weights
from ..runtime.reference import reference_module, reference_params
from ..tracing import module_path, trace
from .bundle import load_bundle, write_bundle
from .supervisor import Outcome, run_local
from .worker import WORKER_ARGV, device_kind, duplex_program, make_optimizer, runtime_argv

__all__ = [
    "ProgressLines",
    "TensorCheck",
    "VerifyError",
    "VerifyReport",
    "batch_rows",
    "resize",
    "run_reference",
    "verify",
    "VERIFY_SEED",
]

#: the seed of the random ops' stream in the ranks and the single-device program of :func:`verify`
VERIFY_SEED = 0

#: Progress events passed to ``verify(progress=...)``: worker heartbeats (``{"rank": r, "phase": ...}``
#: or a step's metrics ``{"rank": r, "step": s, ...}``) and the single-device run's
#: ``{"rank": None, "phase": "reference", "step": s}``.
ProgressFn = Callable[[dict[str, Any]], None]


class VerifyError(RuntimeError):
    """A verification run could not finish: a rank crashed (``status == "failed"``), the ranks stopped
    making progress (``"stuck"``) or ran past the time limit while progressing (``"slow"``). The message
    names the rank and quotes its traceback; ``outcome`` is the supervisor's
    :class:`~hapnb.run.supervisor.Outcome`."""

    def __init__(self, message: str, outcome: Outcome | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.status = outcome.status if outcome is not None else "failed"


@dataclass(frozen=True)
class TensorCheck:
    """One compared quantity: ``kind`` is loss/grad/weight/buffer, ``rel`` the max relative error
    ``max|a-b| / max(max|b|, atol)``, ``ok`` whether ``max|a-b| <= atol + rtol * max|b|``."""

    kind: str
    name: str
    rel: float
    abs: float
    ok: bool
    detail: str = ""

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name}".strip()


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify`: ``ok`` only when the loss at every step, every gradient, and every
    weight and buffer after the steps match the single-device program."""

    ok: bool
    plan: str
    nproc: int
    steps: int
    dtype: str
    checks: tuple[TensorCheck, ...]
    seconds: float = 0.0
    rtol: float = 0.0
    atol: float = 0.0

    @property
    def max_rel(self) -> float:
        return max((c.rel for c in self.checks), default=0.0)

    @property
    def failures(self) -> tuple[TensorCheck, ...]:
        return tuple(c for c in self.checks if not c.ok)

    @property
    def worst(self) -> TensorCheck | None:
        """The check with the largest relative error (a failing one first)."""
        return min(self.checks, key=lambda c: (c.ok, -c.rel), default=None)

    def errors(self) -> dict[str, float]:
        """``{"loss": err, "grad layers.0.weight": err, ...}``: max relative error per tensor."""
        return {c.label: c.rel for c in self.checks}

    def summary(self) -> str:
        """One paragraph: OK or MISMATCH, steps, ranks, dtype, the max relative error and its tensor, the
        wall time, and on a mismatch which tensors differ (like :meth:`JobResult.summary`)."""
        worst = self.worst
        where = f" (worst: {worst.label})" if worst is not None else ""
        n = len(self.checks)
        text = (
            f"{'OK' if self.ok else 'MISMATCH'}: {self.steps} step{'s' * (self.steps != 1)} on {self.nproc} "
            f"rank{'s' * (self.nproc != 1)} ({self.dtype}) against one device, max relative error "
            f"{self.max_rel:.3e}{where}, {n} tensor{'s' * (n != 1)} compared, wall {self.seconds:.1f} s"
        )
        if self.ok:
            return text
        bad = self.failures
        names = ", ".join(f"{c.label} ({c.rel:.3e}{', ' + c.detail if c.detail else ''})" for c in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        return (
            f"{text}; FAILED: {len(bad)} of {n} differ beyond rtol {self.rtol:g} + atol {self.atol:g}: "
            f"{names}{more}"
        )

    def text(self) -> str:
        head = (
            f"verify {self.plan}: {'OK' if self.ok else 'MISMATCH'} on {self.nproc} ranks, "
            f"{self.steps} steps, {self.dtype}, max relative error {self.max_rel:.3e} "
            f"(rtol {self.rtol:g}, atol {self.atol:g}), {self.seconds:.1f} s"
        )
        lines = [head]
        if not self.ok:
            lines.append("  max relative error per tensor (worst first):")
            for c in sorted(self.checks, key=lambda c: (c.ok, -c.rel)):
                mark = "ok  " if c.ok else "FAIL"
                extra = f"  ({c.detail})" if c.detail else ""
                lines.append(f"  {mark} {c.kind:6s} {c.name:40s} {c.rel:.3e}{extra}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.ok else "#cf222e"
        rows = "".join(
            f"<tr><td>{'✓' if c.ok else '✗'}</td><td>{html.escape(c.kind)}</td>"
            f"<td><code>{html.escape(c.name)}</code></td><td>{c.rel:.3e}</td>"
            f"<td>{html.escape(c.detail)}</td></tr>"
            for c in sorted(self.checks, key=lambda c: (c.ok, -c.rel))
        )
        return (
            f"<div><b style='color:{color}'>{'OK' if self.ok else 'MISMATCH'}</b> "
            f"{html.escape(self.plan)}: {self.nproc} ranks, {self.steps} steps, {html.escape(self.dtype)}, "
            f"max relative error {self.max_rel:.3e}"
            "<details><summary>per tensor</summary><table><tr><th></th><th>kind</th><th>tensor</th>"
            f"<th>max rel. error</th><th></th></tr>{rows}</table></details></div>"
        )


# ========================================================================================= reference


def run_reference(
    graph: Graph,
    inputs: Sequence[torch.Tensor],
    steps: int,
    *,
    optimizer: str = "sgd",
    lr: float | None = None,
    dtype: str | None = "float64",
    progress: ProgressFn | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Train the single-device program (dropout off) for ``steps``: losses per step, gradients after the
    first backward, weights and buffers after the last step, keyed by model FQN (a tied parameter under
    each of its names). ``progress`` gets ``{"rank": None, "phase": "reference", "step": s}`` per step.
    ``seed``: of the random ops' stream, the ranks' (:data:`VERIFY_SEED` in :func:`verify`)."""
    prev = torch.get_default_dtype()
    tdtype = getattr(torch, dtype) if dtype else None
    try:
        if tdtype is not None:
            torch.set_default_dtype(tdtype)
        gm = reference_module(graph, dropout=False, dtype=tdtype, seed=seed)
        params = reference_params(graph, gm)
        xs = tuple(x.to(tdtype) if tdtype is not None and x.is_floating_point() else x for x in inputs)
        unique = {id(p): p for p in params.values() if p.requires_grad}  # a tied parameter counts once
        opt = make_optimizer(optimizer, list(unique.values()), lr)
        losses: list[float] = []
        grads: dict[str, torch.Tensor] = {}
        for step in range(steps):
            if progress is not None:
                progress({"rank": None, "phase": "reference", "step": step})
            opt.zero_grad(set_to_none=True)
            loss = gm(*xs)
            loss.backward()
            if step == 0:
                grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
            opt.step()
            losses.append(float(loss.detach()))
        weights = {k: p.detach().clone() for k, p in params.items()}
        names = {graph.tensors[t].name for t in graph.params if graph.tensors[t].role == "buffer"}
        named = ((module_path(k), b) for k, b in gm.named_buffers())
        buffers = {k: b.detach().clone() for k, b in named if k in names}
        return {"losses": losses, "grads": grads, "weights": weights, "buffers": buffers}
    finally:
        torch.set_default_dtype(prev)


# ============================================================================================ compare


def _compare(kind: str, name: str, a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> TensorCheck:
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    if a.shape != b.shape:
        return TensorCheck(
            kind, name, float("inf"), float("inf"), False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        )
    if a.numel() == 0:
        return TensorCheck(kind, name, 0.0, 0.0, True)
    # equal values count as no error, infinities included (an attention mask's -inf); the scale is
    # the largest finite value
    diff = float(torch.where(a == b, 0.0, (a - b).abs()).max())
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    if diff != diff:  # NaN
        return TensorCheck(kind, name, float("inf"), float("inf"), False, "NaN")
    return TensorCheck(kind, name, diff / max(scale, atol), diff, diff <= atol + rtol * scale)


def _assemble(
    name: str, recs: Sequence[Mapping[str, Any]], part: str
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Full tensor from every rank's local pieces; for full (unsharded) tensors also each rank's copy."""
    pieces: list[torch.Tensor | None] = []
    dim = -1
    for rec in recs:
        info = next(p for p in rec["params"] if p[1] == name)
        local, dim = info[0], int(info[3])
        pieces.append(rec[part].get(local))
    if any(p is None for p in pieces):
        return None, []
    if dim >= 0:
        return torch.cat([p for p in pieces if p is not None], dim), []
    return pieces[0], [p for p in pieces if p is not None]


def _buffer_check(
    name: str,
    recs: Sequence[Mapping[str, Any]],
    want: torch.Tensor | None,
    initial: torch.Tensor | None,
    rtol: float,
    atol: float,
) -> TensorCheck:
    """Buffer ``name`` after the steps (every rank's copy when replicated) against the single-device
    run's; a buffer the distributed run left at its initial value is said to be not updated."""
    full, copies = _assemble(name, recs, "weights")
    if full is None or want is None:
        which = "the distributed run" if full is None else "the single-device run"
        return TensorCheck("buffer", name, float("inf"), float("inf"), False, f"missing in {which}")
    check = max(
        (_compare("buffer", name, c, want, rtol, atol) for c in copies or [full]), key=lambda c: c.rel
    )
    if check.ok or initial is None:
        return check
    start = initial.detach().to(torch.float64)
    stale = [
        c for c in copies or [full] if c.shape == start.shape and torch.equal(c.to(torch.float64), start)
    ]
    if stale and not torch.equal(want.detach().to(torch.float64), start):
        detail = "never updated by the distributed run (still its initial value)"
        return TensorCheck("buffer", name, check.rel, check.abs, False, detail)
    return check


def _checks(
    graph: Graph,
    recs: Sequence[Mapping[str, Any]],
    ref: Mapping[str, Any],
    steps: int,
    rtol: float,
    atol: float,
    initial: Mapping[str, torch.Tensor],
) -> list[TensorCheck]:
    """The loss at every step, every gradient after the first backward, every weight and buffer after
    the steps; ``initial``: the weights and buffers before the first step (to tell a stale buffer)."""
    checks: list[TensorCheck] = []
    dist_loss = torch.tensor(recs[0]["global_losses"], dtype=torch.float64)
    summed = torch.tensor([sum(rec["losses"][s] for rec in recs) for s in range(steps)], dtype=torch.float64)
    ref_loss = torch.tensor(ref["losses"], dtype=torch.float64)
    checks.append(_compare("loss", "", summed, ref_loss, rtol, atol))
    if not torch.allclose(dist_loss, summed, rtol=1e-12, atol=1e-12):
        checks.append(_compare("loss", "all-reduced", dist_loss, ref_loss, rtol, atol))
    for tid in graph.params:
        t = graph.tensors[tid]
        if t.role == "buffer":
            checks.append(
                _buffer_check(t.name, recs, ref["buffers"].get(t.name), initial.get(t.name), rtol, atol)
            )
        if t.role != "param":
            continue
        for part, kind, refd in (("grads", "grad", ref["grads"]), ("weights", "weight", ref["weights"])):
            if part == "grads" and not t.requires_grad:
                continue
            full, copies = _assemble(t.name, recs, part)
            want = refd.get(t.name)
            if full is None and want is None:
                continue
            if full is None or want is None:
                which = "the distributed run" if full is None else "the single-device run"
                checks.append(
                    TensorCheck(kind, t.name, float("inf"), float("inf"), False, f"missing in {which}")
                )
            elif len(copies) > 1:  # replicated: every rank's copy must match
                checks.append(
                    max((_compare(kind, t.name, c, want, rtol, atol) for c in copies), key=lambda c: c.rel)
                )
            else:
                checks.append(_compare(kind, t.name, full, want, rtol, atol))
    return checks


class ProgressLines:
    """``hapnb verify``'s progress lines on stderr (a :data:`ProgressFn`): each phase (of each step) when
    the first rank enters it, each step when every rank has finished it, and the single-device run's
    steps."""

    def __init__(self, nproc: int, steps: int) -> None:
        self.nproc, self.steps = nproc, steps
        self.t0 = time.monotonic()
        self.seen: set[tuple[Any, ...]] = set()
        self.done: dict[Any, set[Any]] = {}

    def __call__(self, ev: dict[str, Any]) -> None:
        step, phase = ev.get("step"), ev.get("phase")
        if phase == "reference":
            self._say(f"single-device run: step {step + 1}/{self.steps}")
        elif phase is not None:
            key = (phase, step)
            if key not in self.seen:
                self.seen.add(key)
                self._say(f"ranks: {phase}" if step is None else f"step {step + 1}/{self.steps}: {phase}")
        elif step is not None:
            ranks = self.done.setdefault(step, set())
            ranks.add(ev.get("rank"))
            if len(ranks) == self.nproc:
                self._say(f"step {step + 1}/{self.steps} done on all {self.nproc} ranks")

    def _say(self, text: str) -> None:
        print(f"hapnb verify: [{time.monotonic() - self.t0:6.1f} s] {text}", file=sys.stderr, flush=True)


# ============================================================================================ resize


def resize(
    plan: Plan | PipelinePlan, batch: int | None = None, seq: int | None = None
) -> Plan | PipelinePlan:
    """The same program as ``plan`` at another ``batch`` and/or sequence length ``seq``, to verify a
    paper-size plan on a small machine (``hapnb verify --plan P --batch B --seq S``).

    The model is rebuilt from the plan's spec with the new sizes and traced again. An SPMD plan keeps its
    program (every instruction and form) and its ratios; every shard length is cut again from the same
    ratios at the new sizes, exactly as synthesis cuts them (:meth:`hapnb.triples.Theory.lengths`: whole
    rows, whole heads). A pipeline plan keeps its stages, shares, schedule and micro-batch count. A size
    at which a device that holds rows of the plan's batch would get none is not the same program: the
    ValueError says so and names the smallest batch that keeps every such device busy.
    """
    if batch is None and seq is None:
        return plan
    for flag, v in (("--batch", batch), ("--seq", seq)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} {v}: a size is at least 1")
    spec = plan.model_spec
    if not spec:
        raise ValueError(
            f"plan {plan.name} records no model spec (it was made from an nn.Module), so it cannot be "
            "re-derived at another size; plan the small size from your model with the plan's ratios "
            "(hapnb.synthesize(model, cluster, example_inputs=..., ratios=plan.ratios))"
        )
    options = dict(spec.get("options") or {})
    _check_size_options(plan.name, str(spec.get("name")), options, seq)
    if batch is not None:
        options["batch"] = batch
    if seq is not None:
        options["seq"] = seq
    new_spec = {**spec, "options": options}
    if isinstance(plan, PipelinePlan):
        return _resize_pipeline(plan, new_spec, batch)
    return _resize_spmd(plan, new_spec, batch)


def _check_size_options(name: str, model: str, options: Mapping[str, Any], seq: int | None) -> None:
    from .. import zoo

    if seq is not None and model in zoo.ZOO_NAMES and "seq" not in zoo.zoo_options(model):
        raise ValueError(f"plan {name}: its model {model} has no sequence length; drop --seq")


def _resize_spmd(plan: Plan, spec: dict[str, Any], batch: int | None) -> Plan:
    from .. import zoo
    from ..triples import theory

    what = f"plan {plan.name} at {_sizes_text(spec)}"
    if len(plan.ratios) != 1:
        raise ValueError(
            f"{what}: the plan has {len(plan.ratios)} ratio rows (one per segment); re-deriving it at "
            "another size supports one ratio row only: verify it at its own size"
        )
    model, inputs = zoo.rebuild(spec)
    g = trace(model, inputs, name=plan.name)
    th = theory(g)
    row = tuple(plan.ratios[0])
    by_name = {t.name: t for t in g.tensors}

    def cut(t: str, d: int, old: Sequence[int]) -> list[int]:
        ref = by_name.get(t)
        if ref is None or d >= len(ref.shape):
            raise ValueError(
                f"{what}: the model traces to another graph (no tensor {t} with a dim {d}); only the "
                "batch and sequence length may change"
            )
        new = th.lengths(ref.id, d, row)
        idle = [dev for dev, a, b in zip(plan.devices, old, new) if a > 0 and b == 0]
        if idle:
            raise ValueError(
                f"{what}: the plan's ratios cut {t} dim {d} ({ref.shape[d]} long) as {list(new)}, so "
                f"{', '.join(idle)} would hold none of what the plan gives {'them' if len(idle) > 1 else 'it'} "
                f"({list(old)}): not the same program. {_batch_hint(th, ref, d, old, row, inputs[0].shape[0])}"
            )
        return list(new)

    d = plan.to_json()
    d["model"] = spec
    d["graph_fingerprint"] = g.fingerprint
    d["lengths"] = [[t, dim, cut(t, dim, ls)] for t, dim, ls in plan.lengths]
    for ins, out in zip(plan.program, d["program"]):
        if ins.lengths:
            out["lengths"] = cut(ins.tensor, ins.form_value.dim, ins.lengths)
    return dataclasses.replace(Plan.from_json(d, source=what), graph=g)


def _batch_hint(th: Any, ref: Any, dim: int, old: Sequence[int], row: Sequence[float], batch: int) -> str:
    """How large tensor ``ref``'s ``dim`` must be for every device the plan gives a share of it to keep
    one, and the batch that makes it so when the dim grows with the batch."""
    from ..ir.forms import shard_lengths

    size = ref.shape[dim]
    unit, _ = th.units.get((ref.id, dim), (1, size))
    base = next(
        (
            b
            for b in range(1, sum(old) // unit + 1)
            if all(n > 0 for n, o in zip(shard_lengths(b, row), old) if o)
        ),
        None,
    )
    if base is None:
        return "Verify it at its own size."
    need = base * unit
    if size % batch == 0:  # k rows of the dim per sample: the batch sets it
        k = size // batch
        return f"It needs {ref.name} dim {dim} at least {need} long: use --batch {-(-need // k)} or more."
    return f"It needs {ref.name} dim {dim} at least {need} long: raise --seq (or --batch) until it is."


def batch_rows(plan: Plan) -> list[int] | None:
    """Rows of the batch each device holds: its slice of a batch-loaded input, else the cut of the first
    tensor whose dim 0 is the batch (None when neither is known: no graph, or the batch is never cut)."""
    rows = [plan.batch_slice(r) for r in range(len(plan.devices))]
    if all(s.start is not None for s in rows):
        return [s.stop - s.start for s in rows]
    g = plan.graph
    inputs = [t for t in g.tensors if t.role == "input" and t.shape] if g is not None else []
    if not inputs:
        return None
    batch = inputs[0].shape[0]
    names = {t.name: t for t in g.tensors}
    for t, d, ls in plan.lengths:
        if d == 0 and t in names and names[t].shape[0] == batch and sum(ls) == batch:
            return list(ls)
    return None


def _sizes_text(spec: Mapping[str, Any]) -> str:
    opts = spec.get("options") or {}
    return " ".join(f"{k} {opts[k]}" for k in ("batch", "seq") if k in opts)


def _resize_pipeline(plan: PipelinePlan, spec: dict[str, Any], batch: int | None) -> PipelinePlan:
    from ..ir.forms import shard_lengths

    b, m = batch if batch is not None else plan.batch, plan.micro_batches
    what = f"pipeline plan {plan.name} at {_sizes_text(spec)}"

    def keeps_rows(total: int) -> bool:
        return total % m == 0 and all(
            n > 0
            for st in plan.stages
            for n, o in zip(
                shard_lengths(total // m, st.shares), shard_lengths(plan.micro_batch_size, st.shares)
            )
            if o > 0
        )

    if not keeps_rows(b):
        good = next((x for x in range(m, plan.batch + 1, m) if keeps_rows(x)), plan.batch)
        why = (
            f"it runs {m} micro-batches, and {b} does not split into {m} equal ones"
            if b % m
            else "a device of a stage would get no rows of a micro-batch"
        )
        raise ValueError(
            f"{what}: not the same program: {why}. Use --batch {good} (or a larger multiple of {m})"
        )
    d = plan.to_json()
    d["model"], d["batch"] = spec, b
    return PipelinePlan.from_json(d, source=what)


# ============================================================================================ verify


def verify(
    plan: Plan | PipelinePlan,
    nproc: int | None = None,
    steps: int = 3,
    *,
    model: Any = None,
    example_inputs: Sequence[Any] | None = None,
    backend: str = "gloo",
    dtype: str = "float64",
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float | None = None,
    stall_timeout: float = 300.0,
    optimizer: str | None = None,
    lr: float | None = None,
    keep: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
    worker: Sequence[str] = WORKER_ARGV,
    grad_sync: str = "buckets",
    bucket_cap: int | None = None,
    first_bucket_cap: int | None = None,
    interleave: bool = True,
    device: str = "auto",
) -> VerifyReport:
    """Run ``plan`` on ``nproc`` local ranks and compare with the single-device program.

    ``nproc`` defaults to the plan's GPUs: one rank per device, or, for a plan over virtual devices
    (``gpus > 1``), one rank per physical GPU of its expansion (:func:`hapnb.runtime.expand.expand_virtual`).

    Compares the summed loss at every step, every parameter gradient after the first backward (sharded
    gradients concatenated; a replicated gradient on every rank) and every weight and buffer after
    ``steps`` optimizer steps (a buffer the ranks never updated is named as such). Dropout is off in both runs; ``dtype`` (default float64) casts weights and float
    inputs. ``timeout``: limit on the ranks' whole run in seconds (None: none); ``stall_timeout``: the
    ranks are stuck when none reports progress for that long. ``progress`` is called with each progress
    event (see :data:`ProgressFn`). Raises :class:`VerifyError` when a rank crashes (with its traceback),
    the ranks are stuck, or slow past ``timeout``; every rank process is gone by then. ``keep``: a folder
    to keep the bundle and the rank logs in (default: a temporary folder, removed). ``worker``: how to
    start a rank (``python *worker BUNDLE ...``). ``grad_sync``, ``bucket_cap``, ``first_bucket_cap``,
    ``interleave`` and ``device`` (where the ranks' tensors live, :data:`hapnb.run.worker.DEVICES`:
    ``"cuda"`` with gloo runs every rank on this machine's GPUs) go to the workers (:func:`hapnb.run.worker.run_worker`): replicated gradients are
    all-reduced in async buckets by default (``"sync"``: inside autograd), and the gradients are read
    after the buckets are waited for. A duplex plan (``plan.duplex``) runs as two micro-batches per rank.
    ``optimizer``: ``"sgd"`` (default) or ``"adam"``.

    A :class:`~hapnb.pipelines.PipelinePlan` runs one rank per plan device (:mod:`hapnb.run.pipelined`,
    Adam by default, the model rebuilt from the plan's spec) and is compared by model parameter name, a
    stage's weights on each of its devices; ``model``, ``example_inputs``, ``worker`` and the grad-sync
    options are for SPMD plans only.
    """
    rtol = (1e-7 if dtype == "float64" else 1e-3) if rtol is None else rtol
    atol = (1e-9 if dtype == "float64" else 1e-5) if atol is None else atol
    if isinstance(plan, PipelinePlan):
        if (grad_sync, bucket_cap, first_bucket_cap, interleave, device) != (
            "buckets",
            None,
            None,
            True,
            "auto",
        ):
            raise ValueError(
                "grad_sync, bucket caps, interleave and device apply to SPMD plans, not to pipeline plans"
            )
        if model is not None or example_inputs is not None or tuple(worker) != WORKER_ARGV:
            raise ValueError(
                f"pipeline plan {plan.name}: its ranks rebuild the model from the plan's spec "
                f"({plan.model_spec}) and run hapnb.run.pipelined; model, example_inputs and worker are "
                "for SPMD plans"
            )
        return _verify_pipeline(
            plan, nproc, steps, backend=backend, dtype=dtype, rtol=rtol, atol=atol, timeout=timeout,
            stall_timeout=stall_timeout, optimizer=optimizer or "adam", lr=lr, keep=keep, progress=progress,
        )  # fmt: skip
    optimizer = optimizer or "sgd"
    t0 = time.perf_counter()
    n = plan.cluster.gpus
    if nproc is None:
        nproc = n
    if nproc != n:
        what = (
            f"{n} GPUs ({plan.cluster.n} virtual devices of "
            f"{'+'.join(str(d.gpus) for d in plan.cluster.devices)} GPUs, one rank per GPU)"
            if has_virtual(plan)
            else f"{n} devices ({', '.join(plan.devices)})"
        )
        raise ValueError(f"plan {plan.name} is for {what}; verify it with nproc={n}, not {nproc}")
    if backend == "nccl" and torch.cuda.device_count() < n:
        raise ValueError(f"backend nccl needs {n} CUDA devices, this machine has {torch.cuda.device_count()}")
    device_kind(backend, device, "verify")  # before any process starts
    work = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="hapnb-verify-"))
    try:
        bdir = write_bundle(plan, work / "bundle", model=model, example_inputs=example_inputs)
        bundle = load_bundle(bdir)
        # a plan over virtual devices runs as its expansion over the physical GPUs (hapnb.runtime.expand); the
        # bundle keeps the plan as given and every worker expands it the same way
        physical = expand_virtual(bundle.plan, bundle.graph)
        for r in range(n):  # codegen errors surface here, clearly, before any process starts
            if physical.duplex:
                duplex_program(physical, bundle, r, dropout=False)
            else:
                generate(physical, bundle.graph, r, dropout=False)
        out = work / "ranks"
        # the supervisor judges stalls; the collectives' own timeout is only a backstop behind it
        backstop = (timeout if timeout is not None else 10 * stall_timeout) + 60
        args = [
            *worker, str(bdir),
            "--steps", str(steps),
            "--backend", backend,
            "--optimizer", optimizer,
            "--inputs", "full",
            "--no-dropout",
            "--seed", str(VERIFY_SEED),
            "--verify-out", str(out),
            "--timeout", f"{backstop:g}",
        ]  # fmt: skip
        args += runtime_argv(grad_sync, bucket_cap, first_bucket_cap, interleave, device)
        if dtype:
            args += ["--dtype", dtype]
        if lr is not None:
            args += ["--lr", str(lr)]
        outcome = run_local(
            n,
            args,
            stall_s=stall_timeout,
            wall_s=timeout,
            on_heartbeat=(lambda _r, rec: progress(rec)) if progress is not None else None,
            log_dir=work,
            limit_names=("stall_timeout (--stall-timeout)", "timeout (--timeout)"),
        )
        if not outcome.ok:
            raise VerifyError(f"verify {plan.name} on {n} ranks: {outcome.status}: {outcome.error}", outcome)
        lost = [r for r in range(n) if not (out / f"rank{r}.pt").is_file()]
        if lost:
            raise VerifyError(
                f"verify {plan.name}: ranks {lost} exited cleanly but left no results in {out}; is "
                f"{' '.join(worker)} a hapnb worker (python -m hapnb.run.worker)?",
                outcome,
            )
        recs = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(n)]
        ref = run_reference(
            bundle.graph, bundle.inputs, steps, optimizer=optimizer, lr=lr, dtype=dtype, progress=progress,
            seed=VERIFY_SEED,
        )  # fmt: skip
        checks = _checks(bundle.graph, recs, ref, steps, rtol, atol, program_weights(bundle.graph))
        return _report(plan.name, n, steps, dtype, checks, t0, rtol, atol)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _report(
    name: str, n: int, steps: int, dtype: str | None, checks: Sequence[TensorCheck], t0: float, rtol: float,
    atol: float,
) -> VerifyReport:  # fmt: skip
    return VerifyReport(
        all(c.ok for c in checks), name, n, steps, dtype or "native", tuple(checks), time.perf_counter() - t0,
        rtol, atol,
    )  # fmt: skip


def _verify_pipeline(
    plan: PipelinePlan, nproc: int | None, steps: int, *, backend: str, dtype: str, rtol: float,
    atol: float, timeout: float | None, stall_timeout: float, optimizer: str, lr: float | None,
    keep: str | os.PathLike[str] | None, progress: ProgressFn | None,
) -> VerifyReport:  # fmt: skip
    """:func:`verify` for a pipeline plan: its ranks (:func:`hapnb.run.pipelined.run_ranks`) against the
    single-device program of the same model and batch."""
    from .pipelined import prepare, run_ranks

    t0 = time.perf_counter()
    n = len(plan.devices)
    model, inputs = prepare(plan, n if nproc is None else nproc)  # clear errors before any rank starts
    work = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="hapnb-verify-"))
    try:
        out = work / "ranks"
        outcome = run_ranks(
            plan, work, steps, backend=backend, dtype=dtype, optimizer=optimizer, lr=lr, dropout=False,
            verify_out=out, stall_s=stall_timeout, wall_s=timeout,
            on_heartbeat=(lambda _r, rec: progress(rec)) if progress is not None else None,
            limit_names=("stall_timeout (--stall-timeout)", "timeout (--timeout)"),
        )  # fmt: skip
        if not outcome.ok:
            raise VerifyError(f"verify {plan.name} on {n} ranks: {outcome.status}: {outcome.error}", outcome)
        recs = [
            torch.load(out / f"rank{r}.pt", weights_only=True)
            for r in range(n)
            if (out / f"rank{r}.pt").is_file()
        ]
        if not recs:
            raise VerifyError(
                f"verify {plan.name}: the ranks exited cleanly but left no results in {out}", outcome
            )
        ref = run_reference(
            trace(model, inputs, name=plan.name), inputs, steps, optimizer=optimizer, lr=lr, dtype=dtype,
            progress=progress,
        )  # fmt: skip
        losses = torch.tensor(recs[0]["losses"], dtype=torch.float64)
        checks = [_compare("loss", "", losses, torch.tensor(ref["losses"], dtype=torch.float64), rtol, atol)]
        for kind, part in (("grad", "grads"), ("weight", "weights")):
            for name, want in ref[part].items():
                copies = [r[part][name] for r in recs if name in r[part]]
                if copies:  # a stage on several devices: every copy must match
                    checks.append(
                        max((_compare(kind, name, c, want, rtol, atol) for c in copies), key=lambda c: c.rel)
                    )
                elif name in ref["grads"]:  # a trained weight (or its gradient) no rank has
                    inf = float("inf")
                    checks.append(TensorCheck(kind, name, inf, inf, False, "missing in the pipeline run"))
        return _report(plan.name, n, steps, dtype, checks, t0, rtol, atol)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
