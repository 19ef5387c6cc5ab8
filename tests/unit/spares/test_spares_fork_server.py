"""A pool's fork server (issue 20, a burst of failures): the refill plan (pure), and a
real zygote loop without torch (``flexrun.spares.forks``): its spares are forked in
milliseconds, lead sessions of their own, run their assignment as a fresh worker would,
report a kill -9 through the zygote's record, die with the zygote and with the agent; a
zygote still importing is waited for (bounded, on the injected clock) instead of starting
spares cold, and a zygote that died leaves the pool starting them fresh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from spares_support import FAKE_SPARE, Served
from support import wait_for

from flexrun.spares.forkserver import BOOTING, GONE, READY, Refill, plan_refill
from flexrun.spares.pool import WarmPool, assign
from flexrun.testing import FakeClock

pytestmark = pytest.mark.timeout(60)

FAKE_ZYGOTE = [
    sys.executable,
    "-c",
    "import sys; from flexrun.spares.forks import serve_forks; sys.exit(serve_forks())",
]
NEVER_READY = [sys.executable, "-c", "import sys; sys.stdin.read()"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def _pool(pools: list[WarmPool], tmp: Path, size: int, **kw: object) -> WarmPool:
    kw.setdefault("zygote_command", FAKE_ZYGOTE)
    pool = WarmPool(
        size,
        os.environ,
        tmp / "pool",
        spare_command=FAKE_SPARE,
        fork_server=True,
        **kw,  # type: ignore[arg-type]
    )
    pools.append(pool)
    return pool


# -- the plan -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("missing", "booting", "max_booting", "zygote", "want"),
    [
        (4, 0, 4, READY, Refill(forks=4)),
        (8, 3, 4, READY, Refill(forks=8)),  # forks import nothing: no batch limit
        (4, 0, 4, BOOTING, Refill()),  # one import under way beats four started now
        (4, 0, 4, GONE, Refill(fresh=4)),
        (4, 3, 4, None, Refill(fresh=1)),  # no zygote: batches of max_booting
        (4, 0, None, None, Refill(fresh=4)),
        (0, 0, 4, READY, Refill()),
        (-2, 0, 4, None, Refill()),
    ],
)
def test_plan_refill(
    missing: int, booting: int, max_booting: int | None, zygote: str | None, want: Refill
) -> None:
    assert plan_refill(missing, booting=booting, max_booting=max_booting, zygote=zygote) == want


# -- a real zygote loop ---------------------------------------------------------------------
def test_spares_are_forked_by_the_zygote_and_run_as_fresh_workers(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    pool = _pool(pools, tmp_path, 2)
    pool.fill()
    assert pool.spares == []  # the zygote is importing: nothing started cold
    w = pool.take(wait_s=30)  # waits for the zygote, then for the fork
    assert w is not None
    zygote = pool._zygote
    assert zygote is not None and zygote.worker is not None
    zpid = zygote.worker.proc.pid
    t0 = time.monotonic()
    pool.fill()
    assert len(pool.spares) == 2 and time.monotonic() - t0 < 5
    for spare, _ in pool.spares:
        assert os.getpgid(spare.proc.pid) == spare.proc.pid == os.getsid(spare.proc.pid)
        with open(f"/proc/{spare.proc.pid}/stat") as fh:
            assert int(fh.read().rsplit(")", 1)[1].split()[1]) == zpid  # forked by it
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1])\nsys.exit(5)\n"
    )
    log_dir = tmp_path / "rank_1"
    assign(
        w,
        env={**os.environ, "RANK": "1"},
        entry=str(script),
        args=["x"],
        module=False,
        rank=1,
        local_rank=1,
        log_dir=log_dir,
    )
    assert w.proc.wait(timeout=30) == 5
    assert (log_dir / "stdout.log").read_text() == "rank 1 x\n"


def test_a_killed_forked_worker_reports_its_signal(tmp_path: Path, pools: list[WarmPool]) -> None:
    pool = _pool(pools, tmp_path, 1)
    pool.fill()
    w = pool.take(wait_s=30)
    assert w is not None
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    log_dir = tmp_path / "r0"
    assign(w, env=dict(os.environ), entry=str(script), args=[], module=False, rank=0,
           local_rank=0, log_dir=log_dir)  # fmt: skip
    wait_for(lambda: "up" in (log_dir / "stdout.log").read_text(), 30, "the worker to start")
    os.kill(w.proc.pid, signal.SIGKILL)
    assert w.proc.wait(timeout=30) == -signal.SIGKILL  # (from the zygote's record)


def test_a_zygote_still_importing_is_waited_for_on_the_injected_clock(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    clock = FakeClock()
    pool = _pool(pools, tmp_path, 2, zygote_command=NEVER_READY, clock=clock)
    pool.fill()
    start = clock.monotonic()
    assert pool.take(wait_s=7.0) is None
    assert 7.0 <= clock.monotonic() - start < 7.2
    assert pool.spares == []  # waited for it; started nothing cold meanwhile


def test_a_dead_zygote_leaves_the_pool_starting_spares_fresh(
    tmp_path: Path, pools: list[WarmPool], caplog: pytest.LogCaptureFixture
) -> None:
    pool = _pool(pools, tmp_path, 1)
    pool.fill()
    zygote = pool._zygote
    assert zygote is not None and zygote.worker is not None
    os.kill(zygote.worker.proc.pid, signal.SIGKILL)
    zygote.worker.proc.wait(timeout=30)
    pool.fill()
    assert "fork server failed" in caplog.text and pool._zygote is None
    assert len(pool.spares) == 1
    w = pool.take(wait_s=30)
    assert w is not None and isinstance(w.proc, subprocess.Popen)  # started fresh


AGENT = """
import os, sys, time
from pathlib import Path
from flexrun.spares.pool import WarmPool
pool = WarmPool(2, os.environ, Path(sys.argv[1]), fork_server=True,
                zygote_command=[sys.executable, "-c", sys.argv[2]])
pool.fill()
w = pool.take(wait_s=30)
pool.fill()
assert w is not None and len(pool.spares) == 2
print(pool._zygote.worker.proc.pid, w.proc.pid, *(s.proc.pid for s, _ in pool.spares), flush=True)
time.sleep(60)
"""


def test_kill_9_of_the_agent_leaves_no_zygote_or_spare_behind(tmp_path: Path) -> None:
    agent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(AGENT), str(tmp_path / "pool"), FAKE_ZYGOTE[2]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        pids = [int(p) for p in agent.stdout.readline().split()]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
    finally:
        agent.kill()
        agent.wait(timeout=30)
    wait_for(lambda: not any(_alive(p) for p in pids), 30, "the zygote and its spares to die")


def test_a_pool_the_node_daemon_fills_starts_no_fork_server(tmp_path: Path) -> None:
    served = Served(tmp_path / "spares")
    try:
        served.wait_ready(2)
        pool = WarmPool(
            2,
            os.environ,
            tmp_path / "own",
            node=served.root,
            fork_server=True,
            zygote_command=FAKE_ZYGOTE,
        )
        try:
            pool.fill()
            assert len(pool.spares) == 2 and pool._zygote is None  # (no import paid for none)
        finally:
            pool.close()
    finally:
        served.close()
