"""Run plans: bundles, local verification against one device, and ``distribute`` under torchrun.

* :func:`write_bundle` / :func:`load_bundle`: a folder with ``plan.json``, ``program.pt2`` (torch.export's
  own format, weights included), ``cluster.json``, ``inputs.pt`` (plain tensors, loaded with
  ``weights_only=True``) and ``meta.json``; a worker rebuilds the graph from it without the user's code.
* :func:`verify`: runs the plan on K local ranks (gloo) and the single-device program with the same
  weights and batch (dropout off, float64 by default) for a few optimizer steps, and compares the loss at
  every step, every parameter gradient after the first backward and every weight after the last step.
* :func:`distribute` / :func:`full_state_dict`: the DDP-like API inside a torchrun job.

>>> import hapnb
>>> plan = hapnb.synthesize("mlp", "2xV100", layers=1, hidden=8, input=4, batch=4)  # doctest: +SKIP
>>> hapnb.verify(plan, nproc=2).ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..codegen import CodegenError, RankProgram, generate, reference_module, reference_params
from ..expand import expand_virtual, has_virtual
from ..graph import Graph
from ..plan import Plan

__all__ = [
    "Bundle",
    "BundleError",
    "VerifyError",
    "TensorCheck",
    "VerifyReport",
    "write_bundle",
    "load_bundle",
    "resolve_graph",
    "verify",
    "verify_main",
    "spawn_ranks",
    "run_reference",
    "distribute",
    "DistributedModule",
    "full_state_dict",
]

BUNDLE_FORMAT = 1


class BundleError(ValueError):
    """A bundle is missing, malformed, or does not match its plan."""


class VerifyError(RuntimeError):
    """A verification run could not finish: a rank crashed or hung (the message has its traceback)."""


# ============================================================================================ bundles


@dataclass(frozen=True, eq=False)
class Bundle:
    """A loaded bundle: the plan (with ``plan.graph`` attached), the exported program, the example
    inputs and the rebuilt graph."""

    path: Path
    plan: Plan
    program: Any
    inputs: tuple[torch.Tensor, ...]
    graph: Graph


def _spec_json(plan: Plan) -> dict[str, Any] | None:
    """The plan's model spec as ModelSpec JSON (options as an object, however the plan stored them)."""
    from ..plan import _jsonable

    spec = plan.model_spec
    if not spec:
        return None
    out = dict(_jsonable(spec))
    opts = spec.get("options", {})
    if isinstance(opts, (list, tuple)):
        out["options"] = {str(k): _jsonable(v) for k, v in opts}
    return out


def resolve_graph(
    plan: Plan, model: Any = None, example_inputs: Sequence[Any] | None = None
) -> tuple[Graph, tuple[torch.Tensor, ...]]:
    """The plan's graph and example inputs: ``plan.graph`` when it is there, else traced from ``model``
    (with ``example_inputs``), else rebuilt from the plan's zoo/factory spec. Checks the fingerprint."""
    from ..tracing import trace

    g = plan.graph
    if g is not None and model is None:
        inputs = tuple(example_inputs) if example_inputs is not None else _program_inputs(g)
        if inputs is None:
            raise BundleError(
                f"plan {plan.name}: its traced program keeps no example inputs; pass example_inputs=(...)"
            )
        return g, inputs
    if model is None:
        spec = _spec_json(plan)
        if not spec:
            raise BundleError(
                f"plan {plan.name} has no graph in memory and no model spec to rebuild it; "
                "pass model=... and example_inputs=(...)"
            )
        from .. import zoo

        model, built_inputs, _ = zoo.build_spec(zoo.ModelSpec.from_json(spec))
        if example_inputs is None:
            example_inputs = built_inputs
    if example_inputs is None:
        raise BundleError("example_inputs=(...) are needed to trace the model")
    inputs = tuple(example_inputs)
    g = trace(model, inputs, name=plan.name)
    _check_fingerprint(plan, g)
    return g, inputs


def _program_inputs(g: Graph) -> tuple[torch.Tensor, ...] | None:
    ex = getattr(g.program, "example_inputs", None)
    if ex is None:
        return None
    args, kwargs = ex
    if kwargs:
        return None
    return tuple(args)


def _check_fingerprint(plan: Plan, g: Graph) -> None:
    if plan.graph_fingerprint != g.fingerprint:
        raise BundleError(
            f"plan {plan.name} was made for graph {plan.graph_fingerprint}, but the model traces to "
            f"{g.fingerprint}: the model, its options or the batch shape differ. Synthesize a new plan."
        )


def write_bundle(
    plan: Plan,
    directory: str | os.PathLike[str],
    *,
    model: Any = None,
    example_inputs: Sequence[Any] | None = None,
) -> Path:
    """Write a self-contained bundle for ``plan`` into ``directory`` (created) and return its path."""
    g, inputs = resolve_graph(plan, model, example_inputs)
    if not isinstance(g.program, torch.export.ExportedProgram):
        raise BundleError(
            f"{plan.name} was traced with the torch.fx fallback, which cannot be saved; bundles need a "
            "model that torch.export can capture"
        )
    for k, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise BundleError(f"example input {k} is a {type(x).__name__}; bundles hold tensors only")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    plan.save(d / "plan.json")
    plan.cluster.save(d / "cluster.json")
    torch.export.save(g.program, d / "program.pt2")
    torch.save([x.detach().cpu().contiguous() for x in inputs], d / "inputs.pt")
    meta = {
        "format": BUNDLE_FORMAT,
        "name": g.name,
        "graph_fingerprint": g.fingerprint,
        "inputs": [g.tensors[t].name for t in g.inputs],
        "torch": torch.__version__,
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return d


def _graph_from_program(ep: Any, names: list[str], name: str, inputs: tuple) -> Graph:
    from ..tracing import from_export

    return from_export(ep, names, name)


def load_bundle(directory: str | os.PathLike[str]) -> Bundle:
    """Load a bundle written by :func:`write_bundle`; rebuilds the graph and checks its fingerprint."""
    d = Path(directory)
    missing = [f for f in ("plan.json", "program.pt2", "inputs.pt", "meta.json") if not (d / f).is_file()]
    if missing:
        raise BundleError(f"{d} is not a hapnb bundle: missing {', '.join(missing)}")
    plan = Plan.load(d / "plan.json")
    try:
        meta = json.loads((d / "meta.json").read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{d / 'meta.json'}: not valid JSON ({e})") from None
    if meta.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{d}: bundle format {meta.get('format')!r} is not supported")
    ep = torch.export.load(d / "program.pt2")
    inputs = tuple(torch.load(d / "inputs.pt", weights_only=True))
    g = _graph_from_program(ep, list(meta["inputs"]), str(meta.get("name", plan.name)), inputs)
    _check_fingerprint(plan, g)
    plan = dataclasses.replace(plan, graph=g)
    return Bundle(d, plan, ep, inputs, g)


# ========================================================================================= reference


def run_reference(
    graph: Graph,
    inputs: Sequence[torch.Tensor],
    steps: int,
    *,
    optimizer: str = "sgd",
    lr: float | None = None,
    dtype: str | None = "float64",
) -> dict[str, Any]:
    """Train the single-device program (dropout off) for ``steps``: losses per step, gradients after the
    first backward and weights after the last step, keyed by model FQN."""
    from .worker import make_optimizer

    prev = torch.get_default_dtype()
    tdtype = getattr(torch, dtype) if dtype else None
    try:
        if tdtype is not None:
            torch.set_default_dtype(tdtype)
        gm = reference_module(graph, dropout=False, dtype=tdtype)
        params = reference_params(graph, gm)
        xs = tuple(x.to(tdtype) if tdtype is not None and x.is_floating_point() else x for x in inputs)
        unique = {id(p): p for p in params.values() if p.requires_grad}  # a tied parameter counts once
        opt = make_optimizer(optimizer, list(unique.values()), lr)
        losses: list[float] = []
        grads: dict[str, torch.Tensor] = {}
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = gm(*xs)
            loss.backward()
            if step == 0:
                grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
            opt.step()
            losses.append(float(loss.detach()))
        weights = {k: p.detach().clone() for k, p in params.items()}
        return {"losses": losses, "grads": grads, "weights": weights}
    finally:
        torch.set_default_dtype(prev)


# ============================================================================================ verify


@dataclass(frozen=True)
class TensorCheck:
    """One compared quantity: ``kind`` is loss/grad/weight, ``rel`` the max relative error
    ``max|a-b| / max(max|b|, atol)``, ``ok`` whether ``max|a-b| <= atol + rtol * max|b|``."""

    kind: str
    name: str
    rel: float
    abs: float
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify`: ``ok`` only when the loss at every step, every gradient and every
    weight after the steps match the single-device program."""

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

    def errors(self) -> dict[str, float]:
        """``{"loss": err, "grad layers.0.weight": err, ...}``: max relative error per tensor."""
        return {f"{c.kind} {c.name}".strip(): c.rel for c in self.checks}

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def _peer_loss(text: str) -> bool:
    """Whether a rank's output says it failed only because a peer went away."""
    keys = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer", "Broken pipe")
    return any(k in text for k in keys)


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def spawn_ranks(
    nproc: int, argv: Sequence[str], workdir: Path, timeout: float, env: Mapping[str, str] | None = None
) -> list[str]:
    """Start ``python *argv`` (e.g. ``["-m", "hapnb.run.worker", BUNDLE, ...]``) as ranks 0..nproc-1 on this
    machine, torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), wait,
    and return every rank's output (stdout and stderr, also in ``workdir/rank<r>.log``).

    Raises :class:`VerifyError` with the failing rank's traceback when a rank exits with an error, or
    naming the ranks still running after ``timeout`` seconds; every process is killed in both cases.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    root = str(Path(__file__).resolve().parent.parent)
    base = dict(os.environ)
    base.update(env or {})
    base["PYTHONPATH"] = root + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)})
    base.setdefault("OMP_NUM_THREADS", "1")
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    try:
        for r in range(nproc):
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc))
            log = workdir / f"rank{r}.log"
            logs.append(log)
            with open(log, "wb") as fh:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        env=e,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                # a crashed rank may still be tearing down while its peers already report the lost
                # connection: wait a little, then blame a rank whose traceback is not a peer loss
                grace = time.monotonic() + 3.0
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                codes = [p.poll() for p in procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                texts = [_tail(log) for log in logs]
                root = [r for r in range(nproc) if "Traceback" in texts[r] and not _peer_loss(texts[r])]
                r = (root or bad)[0]
                others = ", ".join(str(x) for x in bad if x != r)
                raise VerifyError(
                    f"rank {r} of {nproc} failed"
                    + (f" (exit status {codes[r]})" if codes[r] is not None else "")
                    + (f"; ranks {others} failed too" if others else "")
                    + f". Its output:\n{texts[r]}"
                )
            if all(c == 0 for c in codes):
                return [_tail(log, 1 << 20) for log in logs]
            if time.monotonic() > deadline:
                hung = [r for r, c in enumerate(codes) if c is None]
                raise VerifyError(
                    f"ranks {hung} of {nproc} were still running after {timeout:.0f} s (a hang: a collective "
                    f"that not every rank reached?). Output of rank {hung[0]}:\n{_tail(logs[hung[0]])}"
                )
            time.sleep(0.05)
    finally:
        _kill(procs)


def _compare(kind: str, name: str, a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> TensorCheck:
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    if a.shape != b.shape:
        return TensorCheck(
            kind, name, float("inf"), float("inf"), False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        )
    if a.numel() == 0:
        return TensorCheck(kind, name, 0.0, 0.0, True)
    diff = float((a - b).abs().max())
    scale = float(b.abs().max())
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


def verify(
    plan: Plan,
    nproc: int | None = None,
    steps: int = 3,
    *,
    model: Any = None,
    example_inputs: Sequence[Any] | None = None,
    backend: str = "gloo",
    dtype: str = "float64",
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float = 120.0,
    optimizer: str = "sgd",
    lr: float | None = None,
    keep: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Run ``plan`` on ``nproc`` local ranks and compare with the single-device program.

    ``nproc`` defaults to the plan's GPUs: one rank per device, or, for a plan over virtual devices
    (``gpus > 1``), one rank per physical GPU of its expansion (:func:`hapnb.expand.expand_virtual`).

    Compares the summed loss at every step, every parameter gradient after the first backward (sharded
    gradients concatenated; a replicated gradient on every rank) and every weight after ``steps``
    optimizer steps. Dropout is off in both runs; ``dtype`` (default float64) casts weights and float
    inputs. Raises :class:`VerifyError` when a rank crashes or hangs (with its traceback). ``keep``: a
    folder to keep the bundle and rank outputs in (default: a temporary folder, removed).
    """
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
    if rtol is None:
        rtol = 1e-7 if dtype == "float64" else 1e-3
    if atol is None:
        atol = 1e-9 if dtype == "float64" else 1e-5
    work = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="hapnb-verify-"))
    try:
        bdir = write_bundle(plan, work / "bundle", model=model, example_inputs=example_inputs)
        bundle = load_bundle(bdir)
        # a plan over virtual devices runs as its expansion over the physical GPUs (hapnb.expand); the
        # bundle keeps the plan as given and every worker expands it the same way
        physical = expand_virtual(bundle.plan, bundle.graph)
        for r in range(n):  # codegen errors surface here, clearly, before any process starts
            generate(physical, bundle.graph, r, dropout=False)
        out = work / "ranks"
        args = [
            "-m",
            "hapnb.run.worker",
            str(bdir),
            "--steps", str(steps),
            "--backend", backend,
            "--optimizer", optimizer,
            "--inputs", "full",
            "--no-dropout",
            "--verify-out", str(out),
            "--timeout", str(max(10.0, timeout)),
            "--metrics", str(work / "metrics{rank}.jsonl"),
        ]  # fmt: skip
        if dtype:
            args += ["--dtype", dtype]
        if lr is not None:
            args += ["--lr", str(lr)]
        spawn_ranks(n, args, work, timeout)
        recs = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(n)]
        ref = run_reference(bundle.graph, bundle.inputs, steps, optimizer=optimizer, lr=lr, dtype=dtype)
        checks: list[TensorCheck] = []
        dist_loss = torch.tensor(recs[0]["global_losses"], dtype=torch.float64)
        summed = torch.tensor(
            [sum(rec["losses"][s] for rec in recs) for s in range(steps)], dtype=torch.float64
        )
        ref_loss = torch.tensor(ref["losses"], dtype=torch.float64)
        checks.append(_compare("loss", "", summed, ref_loss, rtol, atol))
        if not torch.allclose(dist_loss, summed, rtol=1e-12, atol=1e-12):
            checks.append(_compare("loss", "all-reduced", dist_loss, ref_loss, rtol, atol))
        g = bundle.graph
        for tid in g.params:
            t = g.tensors[tid]
            for part, kind, refd in (("grads", "grad", ref["grads"]), ("weights", "weight", ref["weights"])):
                if t.role != "param":
                    continue
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
                    continue
                if len(copies) > 1:  # replicated: every rank's copy must match
                    worst = max(
                        (_compare(kind, t.name, c, want, rtol, atol) for c in copies), key=lambda c: c.rel
                    )
                    checks.append(worst)
                else:
                    checks.append(_compare(kind, t.name, full, want, rtol, atol))
        ok = all(c.ok for c in checks)
        return VerifyReport(
            ok, plan.name, n, steps, dtype or "native", tuple(checks), time.perf_counter() - t0, rtol, atol
        )
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


_ZOO_FLAGS = ("layers", "batch", "seq", "hidden", "heads", "vocab", "input")


def verify_main(args: Any) -> int:
    """``hapnb verify`` (argparse namespace): exit status 0 only when the plan matches one device.

    Reads ``plan`` (a plan JSON path) or ``model`` + ``cluster`` (+ ``pin`` NAME=FORM list, ``ratios``
    "r1,r2,...", zoo options ``layers``, ``batch``, ``seq``, ``hidden``, ``heads``, ``vocab``, ``input``),
    and ``nproc``, ``backend``, ``steps``, ``dtype``, ``timeout``, ``json`` when present. Prints the
    report (on a mismatch: the max relative error of every tensor, worst first).
    """
    get = lambda k, d=None: getattr(args, k, d)  # noqa: E731
    try:
        if get("plan"):
            plan = Plan.load(get("plan"))
        elif get("model") and get("cluster"):
            from ..synthesis import synthesize

            pins = {}
            for p in get("pin") or get("pins") or ():
                k, sep, v = str(p).partition("=")
                if not sep:
                    raise ValueError(f"--pin {p!r}: use NAME=FORM, e.g. x=Shard(0)")
                pins[k] = v
            zoo_opts = {k: get(k) for k in _ZOO_FLAGS if get(k) is not None}
            ratios = get("ratios")
            if isinstance(ratios, str):
                ratios = [float(x) for x in ratios.split(",")]
            plan = synthesize(get("model"), get("cluster"), pins=pins or None, ratios=ratios, **zoo_opts)
        else:
            print("hapnb verify: give --plan PLAN or --model NAME --cluster SPEC", file=sys.stderr)
            return 2
        nproc = get("nproc") or plan.cluster.gpus
        report = verify(
            plan,
            nproc=nproc,
            steps=get("steps") or 3,
            backend=get("backend") or "gloo",
            dtype=get("dtype") or "float64",
            timeout=get("timeout") or 120.0,
        )
    except (VerifyError, BundleError, CodegenError, ValueError, FileNotFoundError) as e:
        print(f"hapnb verify: {e}", file=sys.stderr)
        return 1
    if get("json"):
        print(json.dumps({"ok": report.ok, "max_rel": report.max_rel, "errors": report.errors()}))
    else:
        print(report.text())
    return 0 if report.ok else 1


# ======================================================================================== distribute


class DistributedModule(torch.nn.Module):
    """This rank's part of a distributed model (see :func:`distribute`): ``forward(*inputs)`` returns the
    rank's partial loss (R form); ``loss.backward()`` synchronises every gradient itself."""

    def __init__(self, program: RankProgram, plan: Plan) -> None:
        super().__init__()
        self.module = program.module
        self.program = program
        self.plan = plan
        self.rank = program.rank

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.module(*inputs)

    def local_inputs(self, *full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's slices of the global batch (what ``forward`` takes with ``inputs='local'``)."""
        return self.program.local_inputs(*full)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, n={self.program.n}, inputs={self.program.inputs!r}"


def distribute(
    model: Any, plan: Plan, *, example_inputs: Sequence[Any] | None = None, inputs: str = "local"
) -> DistributedModule:
    """Inside an initialised process group (torchrun): this rank's module for ``plan``.

    ``model`` is the single-device model (its current weights are sliced for this rank); with
    ``inputs='local'`` feed ``dm.local_inputs(*global_batch)`` (this rank's slice), with ``'full'`` the
    whole batch. Like DDP, but gradients are synchronised by the program's own collectives.

    >>> dm = hapnb.distribute(model, plan, example_inputs=(x, y))  # doctest: +SKIP
    >>> loss = dm(*dm.local_inputs(x, y)); loss.backward(); opt.step()  # doctest: +SKIP
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "distribute() needs torch.distributed: run under torchrun and call "
            "torch.distributed.init_process_group() first (or use hapnb.verify for a local check)"
        )
    n, rank = dist.get_world_size(), dist.get_rank()
    if n != plan.cluster.gpus:
        raise ValueError(f"plan {plan.name} is for {plan.cluster.gpus} GPUs but the job has {n} ranks")
    if model is None:
        g, _ = resolve_graph(plan, None, example_inputs)
    else:
        if example_inputs is None:
            ex = _program_inputs(plan.graph) if plan.graph is not None else None
            if ex is None:
                raise ValueError("distribute(model, plan) needs example_inputs=(...) to trace the model")
            example_inputs = ex
        g, _ = resolve_graph(plan, model, example_inputs)
    plan = expand_virtual(plan, g)  # a virtual plan runs one rank per physical GPU
    prog = generate(plan, g, rank, inputs=inputs)
    dev = next((p.device for p in model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    dm = DistributedModule(prog, plan)
    if dev is not None:
        dm.to(dev)
    return dm


def full_state_dict(dm: DistributedModule) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model at full shape, on every rank (all-gathers the shards).

    Keys are the model's own names (``model.state_dict()`` keys), so ``model.load_state_dict(
    full_state_dict(dm))`` restores the single-device model exactly.
    """
    from .. import collectives as C

    state = dict(dm.module.named_parameters())
    state.update(dict(dm.module.named_buffers()))
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for p in dm.program.params:
            local = state[p.local_name].detach()
            if p.sharded:
                out[p.name] = C.all_gather(local.contiguous(), p.dim, p.lengths).clone()
            else:
                out[p.name] = local.clone()
    return out
