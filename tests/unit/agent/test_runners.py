"""Restart and live runners against fake processes (and the in-memory store).

A fake process never runs: the test decides when it ends and with what code; its pid is
above this machine's pid_max, so every signal sent to it reaches nothing. The runners'
own logic is what is tested: worker environments, root causes from error files and
stderr, echoes, hang verdicts, replacement from warm spares, epochs and fallbacks.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from flexrun.agent import policy as p
from flexrun.agent.live import LiveRunner
from flexrun.agent.restart import RestartRunner
from flexrun.agent.runner import RoundStart
from flexrun.config import RendezvousSettings, RunConfig
from flexrun.events import EventLog
from flexrun.live_protocol import EpochRecord, LiveKeys, NodeWorkers, mark_state, touch_heartbeat
from flexrun.proc import Worker
from flexrun.rendezvous.state import RUNNING, MasterRecord, Member, RoundRecord
from flexrun.testing import FakeClock, MemoryStore
from flexrun.testing.config import run_config

_NO_PID = 4_000_000  # above any pid_max: signals to it fail with ESRCH


class FakeProc:
    _next = _NO_PID

    def __init__(self) -> None:
        FakeProc._next += 1
        self.pid = FakeProc._next
        self.returncode: int | None = None
        self.stdin: io.BytesIO | None = _Channel()

    def end(self, rc: int) -> None:
        self.returncode = rc

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            # Only ever waited on after a signal: it "exits" on SIGTERM / SIGKILL.
            self.returncode = -15
        return self.returncode


class _Channel(io.BytesIO):
    """A spare's stdin: keeps what the agent assigned after it is closed."""

    def close(self) -> None:
        self.sent = self.getvalue()
        super().close()


class FakePool:
    """Warm spares that are fake processes; counts what the runner asks of it."""

    def __init__(self, tmp: Path, count: int = 8) -> None:
        self.tmp = tmp
        self.available = count
        self.taken: list[Worker] = []
        self.fills = 0
        self.closed = False
        self.last_ready_ts = 123.0

    def take(self, wait_s: float = 0.0) -> Worker | None:
        if self.available <= 0:
            return None
        self.available -= 1
        d = self.tmp / f"spare{len(self.taken)}"
        d.mkdir(parents=True, exist_ok=True)
        w = Worker(-1, -1, FakeProc(), d, d / "error.json")
        self.taken.append(w)
        return w

    def fill(self, count: int | None = None) -> None:
        self.fills += 1

    def trim(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def config(tmp_path: Path, **kw: object) -> RunConfig:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    flat: dict[str, object] = {
        "entrypoint": str(script),
        "run_dir": tmp_path / "run",
        "run_id": "job",
        "nproc_per_node": 2,
        "rendezvous": RendezvousSettings(max_restarts=3, heartbeat_timeout_s=5.0),
    }
    return run_config(**{**flat, **kw})


def rnd(number: int, *nodes: tuple[str, int]) -> RoundRecord:
    return RoundRecord(number, RUNNING, tuple(Member(n, "10.0.0.1", k) for n, k in nodes))


def events_of(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# -- restart mode ---------------------------------------------------------------------------
MASTER = MasterRecord("10.0.0.1", 29555)


def restart_runner(tmp_path: Path, pool: FakePool, **kw: object) -> tuple[RestartRunner, Path]:
    c = config(tmp_path, **kw)
    ev = EventLog(c.output.run_dir, run_id="job", node="n1")
    runner = RestartRunner(
        c,
        node_id="n1",
        events=ev,
        pool=pool,
        clock=FakeClock(),
    )
    return runner, c.output.run_dir


@pytest.mark.timeout(20)
def test_restart_runner_starts_each_rank_with_torchruns_environment(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, run_dir = restart_runner(tmp_path, pool)
    assert runner.run_round(rnd(4, ("n0", 2), ("n1", 2)), MASTER) is RoundStart.FRESH
    tasks = [json.loads(w.proc.stdin.sent) for w in pool.taken]  # type: ignore[union-attr]
    assert [t["env"]["RANK"] for t in tasks] == ["2", "3"]
    env = tasks[0]["env"]
    assert env["WORLD_SIZE"] == "4" and env["GROUP_RANK"] == "1" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29555"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["FLEXRUN_ROUND"] == "4"
    assert env["TORCHELASTIC_ERROR_FILE"].endswith("round_4/rank_2/error.json")
    kinds = [e["event"] for e in events_of(run_dir)]
    assert kinds == [
        "rendezvous_started",
        "rendezvous_completed",
        "worker_started",
        "worker_started",
    ]
    assert runner.poll() is None
    runner.close()
    assert pool.closed and not runner.active


@pytest.mark.timeout(20)
def test_restart_runner_reports_a_failure_with_its_error_file_and_an_echo_as_such(
    tmp_path: Path,
) -> None:
    pool = FakePool(tmp_path)
    runner, _ = restart_runner(tmp_path, pool)
    runner.run_round(rnd(1, ("n1", 2), ("n2", 2)), MASTER)
    w0, w1 = runner.group.workers  # type: ignore[union-attr]
    w0.error_file.write_text(json.dumps({"message": "ValueError: bad shard"}))
    w0.proc.end(1)  # type: ignore[attr-defined]
    (w1.log_dir / "stderr.log").write_text("RuntimeError: Connection reset by peer\n")
    w1.proc.end(1)  # type: ignore[attr-defined]
    ev = runner.poll()
    assert isinstance(ev, p.Exited) and ev.all_done and ev.peers == 2
    by_rank = {e.rank: e for e in ev.exits}
    assert by_rank[0].cause is not None and by_rank[0].cause.message == "ValueError: bad shard"
    assert by_rank[0].cause.node == "n1" and not by_rank[0].consequence
    assert by_rank[1].consequence
    runner.stop(0)


@pytest.mark.timeout(20)
def test_restart_runner_blames_and_ends_a_silent_rank(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, run_dir = restart_runner(tmp_path, pool, hang_timeout_s=30.0)
    runner.run_round(rnd(1, ("n1", 2)), MASTER)
    w0, w1 = runner.group.workers  # type: ignore[union-attr]
    now = runner.clock.wall()
    for w, age in ((w0, 100.0), (w1, 1.0)):
        (w.log_dir / "progress").write_text("5 0\n")  # (past its first step)
        os.utime(w.log_dir / "progress", (now - age, now - age))
    ev = runner.poll()
    assert isinstance(ev, p.Exited)
    (exit0,) = [e for e in ev.exits if e.rank == 0]
    assert exit0.cause is not None and exit0.cause.kind == "hang"
    assert "no progress for 100.0s" in exit0.cause.message
    hang = [e for e in events_of(run_dir) if e["event"] == "hang_detected"]
    assert hang and hang[0]["rank"] == 0 and Path(hang[0]["stacks_file"]).exists()
    runner.stop(0)


@pytest.mark.timeout(20)
def test_restart_runner_does_not_start_a_round_whose_master_never_came(tmp_path: Path) -> None:
    c = config(tmp_path)
    runner = RestartRunner(c, node_id="n1", events=EventLog(c.output.run_dir, run_id="j"))
    assert runner.run_round(rnd(2, ("n0", 1), ("n1", 2)), None) is None
    assert not runner.active and runner.runs == 0


@pytest.mark.timeout(20)
def test_restart_runner_refills_its_pool_after_warm_starts_at_once(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, _ = restart_runner(tmp_path, pool)
    runner.tend()
    assert pool.fills == 0  # nothing ran yet: the launcher fills it
    runner.run_round(rnd(1, ("n1", 2)), MASTER)
    runner.tend()
    assert pool.fills == 1  # every worker was warm: no cold start to protect
    runner.stop(0)


# -- live mode ------------------------------------------------------------------------------
def live_runner(
    tmp_path: Path, pool: FakePool, **kw: object
) -> tuple[LiveRunner, MemoryStore, Path]:
    c = config(tmp_path, **kw)
    store = MemoryStore()
    runner = LiveRunner(
        c,
        node_id="n1",
        store=store,
        store_addr=("127.0.0.1", 1),
        events=EventLog(c.output.run_dir, run_id="job", node="n1"),
        pool=pool,
    )
    return runner, store, c.output.run_dir


def epoch(store: MemoryStore) -> EpochRecord:
    entry = store.get(LiveKeys("job").epoch)
    assert entry is not None
    return EpochRecord.decode(entry.value)


@pytest.mark.timeout(20)
def test_live_runner_starts_once_and_publishes_the_first_epoch(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, store, _ = live_runner(tmp_path, pool)
    assert runner.run_round(rnd(1, ("n1", 2)), None) is RoundStart.FRESH
    assert epoch(store) == EpochRecord(1, ("n1.w1", "n1.w2"), False)
    node = store.get(LiveKeys("job").node("n1"))
    assert node is not None and NodeWorkers.decode(node.value).workers == ("n1.w1", "n1.w2")
    env = json.loads(pool.taken[0].proc.stdin.sent)["env"]  # type: ignore[union-attr]
    assert env["FLEXRUN_LIVE"] == "1" and env["FLEXRUN_WORKER_ID"] == "n1.w1"
    assert "MASTER_ADDR" not in env
    # A later round keeps the workers.
    assert runner.run_round(rnd(2, ("n1", 2)), None) is RoundStart.CONTINUED
    assert len(pool.taken) == 2
    runner.close()


@pytest.mark.timeout(20)
def test_live_runner_replaces_a_dead_worker_from_a_spare_and_aborts_the_epoch(
    tmp_path: Path,
) -> None:
    pool = FakePool(tmp_path)
    runner, store, run_dir = live_runner(tmp_path, pool)
    runner.run_round(rnd(1, ("n1", 2)), None)
    for lw in runner.slots.values():
        touch_heartbeat(lw.heartbeat)
        mark_state(lw.heartbeat)
    store.put(LiveKeys("job").formed, b"1")
    runner.slots[0].worker.proc.end(-9)  # type: ignore[attr-defined]
    ev = runner.poll()
    assert isinstance(ev, p.LiveFailed) and ev.epoch == 1
    assert ev.causes[0].worker_id == "n1.w1" and ev.causes[0].signal == "SIGKILL"
    assert runner.slots[0].worker_id == "n1.w3" and len(pool.taken) == 3
    rec = epoch(store)
    assert rec.number == 2 and rec.abort and "n1.w1" not in rec.members
    started = [e for e in events_of(run_dir) if e["event"] == "worker_started"]
    assert started[-1]["spare"] is True
    assert not [e for e in events_of(run_dir) if e.get("reason") == "live_fallback"]
    runner.close()


@pytest.mark.timeout(20)
def test_live_runner_falls_back_when_every_holder_of_the_state_died(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, store, run_dir = live_runner(tmp_path, pool)
    runner.run_round(rnd(1, ("n1", 2)), None)
    store.put(LiveKeys("job").formed, b"1")
    for lw in runner.slots.values():
        lw.worker.proc.end(1)  # type: ignore[attr-defined]
    ev = runner.poll()
    assert isinstance(ev, p.LiveFailed) and len(ev.causes) == 2
    assert [e for e in events_of(run_dir) if e.get("reason") == "live_fallback"]
    assert all(lw.included for lw in runner.slots.values())
    runner.close()


@pytest.mark.timeout(20)
def test_live_runner_kills_a_worker_whose_heartbeat_is_too_old(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, _, run_dir = live_runner(tmp_path, pool)
    runner.run_round(rnd(1, ("n1", 2)), None)
    hb = runner.slots[1].heartbeat
    touch_heartbeat(hb)
    old = time.time() - 60
    os.utime(hb, (old, old))
    assert runner.poll() is None
    hang = [e for e in events_of(run_dir) if e["event"] == "hang_detected"]
    assert hang and hang[0]["worker_id"] == "n1.w2" and hang[0]["silent_s"] >= 59
    runner.close()


@pytest.mark.timeout(20)
def test_live_runner_reports_the_finish_when_every_worker_completed(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, _, _ = live_runner(tmp_path, pool)
    runner.run_round(rnd(1, ("n1", 2)), None)
    assert runner.poll() is None
    for lw in runner.slots.values():
        lw.worker.proc.end(0)  # type: ignore[attr-defined]
    assert isinstance(runner.poll(), p.LiveFinished)
    runner.close()
    assert pool.closed


def test_fake_processes_are_out_of_reach() -> None:
    with open("/proc/sys/kernel/pid_max") as fh:
        assert int(fh.read()) < _NO_PID
    with pytest.raises(ProcessLookupError):
        os.kill(_NO_PID + 1, 0)
    assert subprocess.DEVNULL  # (the module's processes are fakes; nothing is started)
