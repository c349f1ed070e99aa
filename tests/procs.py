"""Process checks shared by the run-layer tests: is a pid alive (zombies count as gone), and did a run
leave nothing behind."""

from __future__ import annotations

import time
from collections.abc import Iterable


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, already exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_gone(pids: Iterable[int], within_s: float = 5.0) -> None:
    """Every pid has exited within ``within_s`` seconds."""
    pids = set(pids)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes left behind"


def run_ranks(argv: list[str], n: int, env: dict[str, str], on_heartbeat=None) -> None:  # type: ignore[no-untyped-def]
    """Run ``argv`` as ``n`` rank processes under the supervisor (2 min stall, 4 min wall limit), then
    check that none is left behind and that the run succeeded (its error and stderr tails when not)."""
    from hapnb.run.supervisor import Supervisor, rank_envs

    kw = {} if on_heartbeat is None else {"on_heartbeat": on_heartbeat}
    with Supervisor([argv] * n, rank_envs(n, env=env), stall_s=120, wall_s=240, **kw) as sup:
        pids = sup.pids
        res = sup.wait()
    assert_gone(pids)
    assert res.ok, f"{res.error}\n" + "\n".join(res.stderr_tails)  # each rank's last lines, one string
