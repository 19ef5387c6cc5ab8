"""WarmPool and assign against fake spares (the real hand-over code without torch): fill,
take with and without waiting, trim, close, and a spare becoming a worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spares_support import FAKE_SPARE
from support import wait_for

from flexrun.proc import Worker
from flexrun.proc.drain import Console
from flexrun.spares.pool import WarmPool, assign
from flexrun.testing import FakeClock

pytestmark = pytest.mark.timeout(60)

NEVER_READY = [sys.executable, "-c", "import sys; sys.stdin.read()"]

SCRIPT = """
import json, os, sys
with open(sys.argv[1], "w") as fh:
    json.dump({"pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv[1:],
               "rank": os.environ.get("RANK"), "err": os.environ["TORCHELASTIC_ERROR_FILE"],
               "spare_env": os.environ.get("FLEXRUN_SPARE_READY"),
               "cmdline": open("/proc/self/cmdline").read()}, fh)
print("hello from the worker")
sys.exit(int(sys.argv[2]))
"""


def _pool(pools: list[WarmPool], tmp: Path, size: int, **kw: object) -> WarmPool:
    pool = WarmPool(size, os.environ, tmp / "pool", spare_command=FAKE_SPARE, **kw)  # type: ignore[arg-type]
    pools.append(pool)
    return pool


def _taken_with_script(pools: list[WarmPool], tmp: Path) -> tuple[Worker, Path]:
    """A ready spare taken from a pool of one, and SCRIPT written for it to run."""
    pool = _pool(pools, tmp, 1)
    pool.fill()
    w = pool.take(wait_s=30)
    assert w is not None
    script = tmp / "w.py"
    script.write_text(SCRIPT)
    return w, script


def test_take_waits_for_a_booting_spare_and_hands_each_out_once(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    pool = _pool(pools, tmp_path, 2)
    pool.fill()
    assert len(pool.spares) == 2
    first = pool.take(wait_s=30)
    assert first is not None and pool.last_ready_ts is not None
    second = pool.take(wait_s=30)
    assert second is not None and second.proc.pid != first.proc.pid
    assert pool.take(wait_s=30) is None  # nothing left, nothing booting: no wait
    pool.fill()
    assert len(pool.spares) == 2


def test_take_gives_up_after_wait_s_on_the_injected_clock(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    clock = FakeClock()
    pool = WarmPool(1, os.environ, tmp_path / "p", spare_command=NEVER_READY, clock=clock)
    pools.append(pool)
    pool.fill()
    assert pool.take() is None  # booting, no wait
    start = clock.monotonic()
    assert pool.take(wait_s=5.0) is None
    assert 5.0 <= clock.monotonic() - start < 5.2  # waited on the fake clock, not the real one
    assert len(pool.spares) == 1  # still there, still booting


def test_dead_spares_are_skipped_then_replaced_and_trim_stops_the_extra(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    pool = _pool(pools, tmp_path, 1)
    pool.fill(count=3)  # a node's first workers, started as spares
    assert len(pool.spares) == 3
    dead = pool.spares[0][0]
    dead.proc.stdin.close()  # type: ignore[union-attr]  (end of input: the spare exits 0)
    assert dead.proc.wait(timeout=30) == 0
    taken = pool.take(wait_s=30)
    assert taken is not None and taken is not dead
    pool.trim()
    assert len(pool.spares) == 1
    pool.fill()
    assert len(pool.spares) == 1 and pool.spares[0][0] is not dead
    kept = pool.spares[0][0]
    pool.close()
    assert kept.proc.poll() is not None and pool.spares == []
    taken.proc.stdin.close()  # type: ignore[union-attr]
    taken.proc.wait(timeout=30)


def test_an_assigned_spare_runs_the_script_as_a_fresh_worker_would(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    w, script = _taken_with_script(pools, tmp_path)
    out = tmp_path / "out.json"
    work = tmp_path / "work"
    work.mkdir()
    log_dir = tmp_path / "rank_3"
    cwd = os.getcwd()
    os.chdir(work)
    try:
        env = {**os.environ, "RANK": "3"}
        assign(
            w,
            env=env,
            entry=str(script),
            args=[str(out), "3"],
            module=False,
            rank=3,
            local_rank=0,
            log_dir=log_dir,
        )
    finally:
        os.chdir(cwd)
    assert w.proc.wait(timeout=30) == 3
    got = json.loads(out.read_text())
    assert got["pid"] == w.proc.pid and got["cwd"] == str(work) and got["rank"] == "3"
    assert got["argv"] == [str(out), "3"] and got["err"] == str(log_dir / "error.json")
    assert got["spare_env"] is None  # the worker's environment replaced the spare's
    # ps and pgrep -f see what a fresh worker's command line would be, not the spare's
    title = got["cmdline"].rstrip("\0")
    assert title == f"{sys.executable} -u {script} {out} 3", got["cmdline"]
    assert (log_dir / "stdout.log").read_text() == "hello from the worker\n"
    assert (w.rank, w.local_rank, w.log_dir) == (3, 0, log_dir)


def test_a_spare_removes_the_agents_private_fifos_once_it_opened_them(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    """An agent killed with kill -9 never removes the FIFO directory it made for a spare's
    output: the spare removes it as soon as it has both ends open, and the drain still
    gets every line."""
    w, script = _taken_with_script(pools, tmp_path)
    log_dir = tmp_path / "rank_0"
    assign(
        w,
        env=dict(os.environ),
        entry=str(script),
        args=[str(tmp_path / "out.json"), "0"],
        module=False,
        rank=0,
        local_rank=0,
        log_dir=log_dir,
        console=Console(),
    )
    assert w.output is not None and w.output._private is not None
    private = w.output._private
    assert w.proc.wait(timeout=30) == 0
    assert not private.exists()  # gone before the agent's own cleanup ran
    assert w.output.wait_eof(5)
    w.output.close()
    assert (log_dir / "stdout.log").read_text() == "hello from the worker\n"


def test_a_module_entry_point_is_found_on_the_workers_pythonpath(
    tmp_path: Path, pools: list[WarmPool]
) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "entry_mod.py").write_text("import sys\nsys.exit(7)\n")
    pool = _pool(pools, tmp_path, 1)
    pool.fill()
    w = pool.take(wait_s=30)
    assert w is not None
    pythonpath = os.pathsep.join([str(lib), os.environ.get("PYTHONPATH", "")])
    assign(
        w,
        env={**os.environ, "PYTHONPATH": pythonpath},
        entry="entry_mod",
        args=[],
        module=True,
        rank=0,
        local_rank=0,
    )
    assert w.proc.wait(timeout=30) == 7


ORDER_HELPER = """
import sys
def note(what, log=sys.argv[1], open=open):  # (bound now: finalization clears names)
    with open(log, "a") as fh:
        fh.write(what + "\\n")
class Model:  # stands for a DDP model, whose destructor may join a thread
    def __del__(self, note=note):
        note("freed")
"""
# The script defines no function or class of its own: nothing of it refers back to its
# globals (no reference cycle), so they are freed the moment the last reference goes.
ORDER_SCRIPT = """
import atexit, sys
from order_helper import Model, note
model = Model()
atexit.register(note, "atexit")
note("end")
if sys.argv[2] == "exit":
    sys.exit(5)
if sys.argv[2] == "raise":
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("ending", ["return", "exit", "raise"])
def test_a_spare_keeps_the_scripts_objects_until_the_end_as_a_fresh_interpreter_does(
    tmp_path: Path, pools: list[WarmPool], ending: str
) -> None:
    """A script's globals outlive its last line until the interpreter's finalization, in a
    spare as in a fresh ``python script.py``: freed as soon as runpy returned, a DDP model's
    gloo process group was destroyed while its run loop still needed the GIL, and the worker
    hung for good after its training ended (pytorch/pytorch#56297)."""
    script = tmp_path / "order.py"
    script.write_text(ORDER_SCRIPT)
    (tmp_path / "order_helper.py").write_text(ORDER_HELPER)
    fresh_log, spare_log = tmp_path / "fresh.log", tmp_path / "spare.log"
    fresh = subprocess.run(
        [sys.executable, str(script), str(fresh_log), ending], capture_output=True, timeout=60
    )
    pool = _pool(pools, tmp_path, 1)
    pool.fill()
    w = pool.take(wait_s=30)
    assert w is not None
    assign(
        w,
        env=dict(os.environ),
        entry=str(script),
        args=[str(spare_log), ending],
        module=False,
        rank=0,
        local_rank=0,
    )
    assert (
        w.proc.wait(timeout=30) == fresh.returncode == {"return": 0, "exit": 5, "raise": 1}[ending]
    )
    assert fresh_log.read_text() == "end\natexit\nfreed\n"
    assert spare_log.read_text() == fresh_log.read_text()


def test_a_malformed_assignment_is_one_line_and_exit_2(tmp_path: Path) -> None:
    ready = tmp_path / "s.ready"
    p = subprocess.Popen(
        FAKE_SPARE,
        env={**os.environ, "FLEXRUN_SPARE_READY": str(ready)},
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(ready.exists, 30, "the spare to be ready", interval=0.01)
    _, err = p.communicate(b'{"entry": 5}\n', timeout=30)
    assert p.returncode == 2
    assert err.decode().count("\n") == 1 and "'entry' must be str" in err.decode()
