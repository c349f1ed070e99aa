"""Fail fast: what a collective that timed out or lost a peer raises (issue 20).

Every communicating call of :mod:`hapnb.runtime.collectives` takes ``where=``, a label of what it runs
for. A generated rank program passes ``instruction k (...)`` (:func:`instruction_label`: the index in
the plan's program, the collective's name, its tensor and forms); the gradient buckets, the live
reshard and the worker label their own. The label rides along with the call and, in the backward, in
the autograd context of the collective whose dual runs: nothing is recorded or synchronised while the
collective runs. Only when the backend raises (gloo raises ``RuntimeError`` when a collective waits past
the process group's timeout, and at once when a peer's connection closes) is the error turned into a
:class:`CollectiveError` that names this rank, the instruction, forward or backward, the timeout that
was exceeded, and what to do.

>>> cause = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete")
>>> e = collective_error(cause, rank=0, op="all_gather", where="instruction 7 (grouped_all_gather of relu)",
...                      direction="forward")
>>> (e.reason, e.timeout_s)
('timeout', 3.0)
>>> print(str(e)[:73])
rank 0 waited more than 3 s (the collective timeout) for its peers in the
>>> print(str(e)[74:156])
forward of instruction 7 (grouped_all_gather of relu), running all_gather: another
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

__all__ = [
    "CollectiveError",
    "collective_error",
    "guarded",
    "instruction_label",
    "group_timeout",
    "set_group_timeout",
]

T = TypeVar("T")

#: backend messages of a peer that went away (its process exited or was killed)
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crashing",
)
_TIMEOUT_MS = re.compile(r"[Tt]imed out waiting (\d+)\s*ms")


class CollectiveError(RuntimeError):
    """A collective of this rank waited past its timeout (``reason == "timeout"``), lost a peer
    (``"peer"``) or failed in the backend (``"error"``). The message is one line naming ``rank``, the
    collective ``op``, ``where`` (the instruction, or what else ran it), ``direction`` (``forward`` or
    ``backward``, empty when neither applies) and ``timeout_s``, and what to do; the backend's error is
    its ``__cause__``."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        op: str,
        where: str | None,
        direction: str,
        timeout_s: float | None,
        reason: str,
    ) -> None:
        super().__init__(message)
        self.rank, self.op, self.where, self.direction = rank, op, where, direction
        self.timeout_s, self.reason = timeout_s, reason


def instruction_label(index: int, ins: Any, role: str = "") -> str:
    """How errors name instruction ``index`` of a plan's program: its index, its name, its tensor and
    the instruction as the plan prints it; ``role`` says what part of it communicates (a load's gradient
    all-reduce).

    >>> from hapnb.plans.plan import Instruction
    >>> instruction_label(7, Instruction("collective", "grouped_all_gather", 0, "relu", "G1", "I"))
    'instruction 7 (grouped_all_gather of relu: relu:I = grouped_all_gather(relu:G1))'
    """
    text = f"instruction {index} ({ins.name} of {ins.tensor}: {ins}"
    return f"{text}; {role})" if role else f"{text})"


def _seconds(td: Any) -> float | None:
    return td.total_seconds() if isinstance(td, timedelta) else None


def group_timeout(group: Any = None) -> float | None:
    """Seconds a collective of ``group`` (None: the default group) may wait for its peers, as its backend
    holds it; None when torch.distributed is not initialised or the backend does not say."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = group if group is not None else dist.group.WORLD
        for dev in getattr(pg, "_device_types", ()):
            t = _seconds(pg._get_backend(torch.device(dev)).options._timeout)
            if t is not None:
                return t
    except Exception:  # a backend without options (MPI) or another torch version: not known
        return None
    return None


def set_group_timeout(seconds: float, group: Any = None) -> None:
    """Make every collective of ``group`` (None: the default group) wait at most ``seconds`` for its peers
    (what ``init_process_group(timeout=...)`` sets), for a group the caller did not create."""
    import torch.distributed as dist

    if not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds!r}")
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        raise RuntimeError(
            f"this torch ({torch.__version__}) cannot change a process group's timeout; pass "
            "timeout=timedelta(seconds=...) to torch.distributed.init_process_group instead"
        )
    setter(timedelta(seconds=float(seconds)), group)


#: what only a communication backend's own errors say (gloo's carry their source path)
_BACKEND_WORDS = ("gloo", "nccl", "NCCL", "c10d", "ProcessGroup")


def _from_backend(e: RuntimeError) -> bool:
    """Whether ``e`` comes from the communication (a timeout, a lost peer, a backend error), not from the
    tensors around it (an out-of-memory error, a shape error stay as they are)."""
    import torch.distributed as dist

    text = str(e)
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return _reason(text) != "error" or any(w in text for w in _BACKEND_WORDS)


def _reason(text: str) -> str:
    if any(m in text for m in _PEER_GONE):
        return "peer"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "timeout"
    return "error"


def _direction(where: str | None) -> str:
    """``backward`` while autograd runs a node (a dual collective, a gradient hook), else ``forward`` for
    an instruction of a rank program and nothing for other collectives (a global loss, a reshard)."""
    if torch._C._current_autograd_node() is not None:
        return "backward"
    return "forward" if where is not None and where.startswith("instruction") else ""


def collective_error(
    cause: BaseException,
    *,
    rank: int,
    op: str,
    where: str | None = None,
    direction: str | None = None,
    timeout_s: float | None = None,
) -> CollectiveError:
    """The :class:`CollectiveError` for ``cause``, the backend's error of collective ``op`` run for
    ``where`` on ``rank``. ``direction`` None: ``backward`` inside a backward pass, else ``forward`` for an
    instruction (``where`` starts with ``instruction``); ``""``: name none. ``timeout_s`` None: read from the backend's message."""
    text = str(cause).strip()
    reason = _reason(text)
    if timeout_s is None and (m := _TIMEOUT_MS.search(text)):
        timeout_s = int(m.group(1)) / 1000.0
    direction = _direction(where) if direction is None else direction
    place = where or "a call outside a rank program"
    what = f"the {direction} of {place}" if direction else place
    running = "" if where is None or where.startswith(op) else f", running {op}"
    limit = f"{timeout_s:g} s" if timeout_s is not None else "the process group's timeout"
    raise_it = (
        "raise the timeout (hapnb launch --timeout S, hapnb.distribute(..., timeout=S) or "
        "torch.distributed.init_process_group(timeout=...))"
    )
    if reason == "timeout":
        msg = (
            f"rank {rank} waited more than {limit} (the collective timeout) for its peers in {what}{running}: "
            "another rank did not reach this collective in time. It stopped, crashed or hangs before it "
            "(see its log: hapnb launch names a rank that exited and where each rank was), or it is only "
            f"slower than the timeout allows: then {raise_it}"
        )
    elif reason == "peer":
        msg = (
            f"rank {rank} lost a peer in {what}{running}: another rank stopped before this collective (it exited or "
            "was killed); see that rank's log for the cause"
        )
    else:
        msg = f"rank {rank}: {op} failed in {what}"
    first = text.splitlines()[0] if text else type(cause).__name__
    return CollectiveError(
        f"{msg}. Backend: {first}",
        rank=rank, op=op, where=where, direction=direction, timeout_s=timeout_s, reason=reason,
    )  # fmt: skip


def guarded(
    rank: int,
    group: Any,
    op: str,
    where: str | None,
    fn: Callable[..., T],
    *args: Any,
    direction: str | None = None,
) -> T:
    """``fn(*args)``, the communication of collective ``op`` run for ``where``; a backend error (a
    ``RuntimeError`` from the communication) comes out as the :class:`CollectiveError` that names them,
    other errors as they are. Costs a ``try`` on the way through."""
    try:
        return fn(*args)
    except CollectiveError:
        raise
    except RuntimeError as e:
        if not _from_backend(e):
            raise
        err = collective_error(
            e, rank=rank, op=op, where=where, direction=direction, timeout_s=group_timeout(group)
        )
        raise err from e
