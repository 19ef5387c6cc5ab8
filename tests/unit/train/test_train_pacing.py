"""Pacing of the background persist: CpuPacer's rests, PacedWriter's pieces, the
Checkpointer default and opt-out, and torch.save without the zip CRC. No wall-clock asserts:
CPU time is a counter the tests advance and rests land on a FakeClock."""

from __future__ import annotations

import io
import os
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.testing import FakeClock
from flexrun.train import Checkpointer
from flexrun.train.checkpoint import DEFAULT_PERSIST_CPU_SHARE, save_without_zip_crc
from flexrun.train.context import single_process_context
from flexrun.train.options import DEFAULT_PERSIST_FREE_CPU_S
from flexrun.train.pacing import IdlePriority
from flexrun.train.storage import CpuPacer, PacedWriter

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")


class FakeCpu:
    """The paced thread's CPU seconds; tests say how much work each piece took."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _pacer(share: float) -> tuple[CpuPacer, FakeClock, FakeCpu]:
    clock, cpu = FakeClock(), FakeCpu()
    pacer = CpuPacer(share, clock, cpu_time=cpu)
    pacer.start()
    return pacer, clock, cpu


@pytest.mark.parametrize(("share", "work", "rest"), [(0.1, 0.01, 0.09), (0.25, 0.02, 0.06)])
def test_pacer_rests_for_the_cpu_time_a_piece_took_times_one_over_share_minus_one(
    share: float, work: float, rest: float
) -> None:
    pacer, clock, cpu = _pacer(share)
    t0 = clock.monotonic()
    cpu.now += work
    pacer.pace()
    assert clock.monotonic() - t0 == pytest.approx(rest)
    assert pacer.rested_s == pytest.approx(rest)


def test_pacer_keeps_the_cpu_share_over_many_pieces_of_uneven_work() -> None:
    pacer, clock, cpu = _pacer(0.1)
    t0, busy = clock.monotonic(), 0.0
    for i in range(200):
        work = 0.002 + 0.001 * (i % 7)
        cpu.now += work
        clock.advance(work)  # the work itself takes wall time too
        busy += work
        pacer.pace()
    assert busy / (clock.monotonic() - t0) == pytest.approx(0.1, rel=1e-6)


def test_pacer_does_not_count_time_waiting_for_a_core_as_work() -> None:
    pacer, clock, cpu = _pacer(0.1)
    clock.advance(5.0)  # preempted: wall time passes, no CPU used
    t0 = clock.monotonic()
    pacer.pace()
    assert clock.monotonic() == t0 and pacer.rested_s == 0.0


def test_pacer_rest_per_piece_is_capped() -> None:
    pacer, clock, cpu = _pacer(0.01)
    t0 = clock.monotonic()
    cpu.now += 10.0
    pacer.pace()
    assert clock.monotonic() - t0 == pytest.approx(CpuPacer._MAX_REST_S)


def test_pacer_stops_resting_once_hurried() -> None:
    pacer, clock, cpu = _pacer(0.1)
    cpu.now += 0.05
    pacer.hurry()
    t0 = clock.monotonic()
    pacer.pace()
    cpu.now += 0.05
    pacer.pace()
    assert clock.monotonic() == t0


def test_hurry_ends_a_rest_in_progress_within_a_slice() -> None:
    cpu = FakeCpu()

    class HurryingClock(FakeClock):
        def sleep(self, seconds: float) -> None:
            super().sleep(seconds)
            pacer.hurry()  # another thread calls wait() during the first slice

    hc = HurryingClock()
    pacer = CpuPacer(0.1, hc, cpu_time=cpu)
    pacer.start()
    cpu.now += 0.1  # earns a 0.9 s rest
    t0 = hc.monotonic()
    pacer.pace()
    assert 0 < hc.monotonic() - t0 <= CpuPacer._SLICE_S


def test_the_first_free_cpu_seconds_of_a_persist_earn_no_rest() -> None:
    clock, cpu = FakeClock(), FakeCpu()
    pacer = CpuPacer(0.1, clock, cpu_time=cpu, free_s=0.05)
    for _ in range(2):  # each start() opens a new allowance
        pacer.start()
        t0 = clock.monotonic()
        cpu.now += 0.03
        pacer.pace()
        assert clock.monotonic() == t0  # 0.03 of the 0.05 s allowance
        cpu.now += 0.03
        pacer.pace()  # 0.02 free, 0.01 paced
        assert clock.monotonic() - t0 == pytest.approx(0.09)
        cpu.now += 0.01
        pacer.pace()
        assert clock.monotonic() - t0 == pytest.approx(0.18)


def test_pacer_rejects_a_negative_allowance() -> None:
    with pytest.raises(CheckpointError):
        CpuPacer(0.1, FakeClock(), free_s=-1.0)


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_pacer_rejects_a_share_outside_zero_to_one(share: float) -> None:
    with pytest.raises(CheckpointError):
        CpuPacer(share, FakeClock())


def test_paced_writer_passes_bytes_through_in_pieces_and_paces_after_each() -> None:
    pacer, clock, cpu = _pacer(0.5)
    calls: list[int] = []

    class Sink(io.BytesIO):
        def write(self, data: Any) -> int:
            cpu.now += 0.001  # each piece costs 1 ms of CPU
            calls.append(len(data))
            return super().write(data)

    sink = Sink()
    blob = bytes(range(256)) * ((10 << 20) // 256)  # 10 MiB: pieces of 4, 4, 2 MiB
    assert PacedWriter(sink, pacer).write(blob) == len(blob)
    assert sink.getvalue() == blob
    assert calls == [4 << 20, 4 << 20, 2 << 20]
    assert pacer.rested_s == pytest.approx(0.003)


class _Tensor:
    """One float32 tensor of ``n`` elements: 3M (12 MB) outlasts the unpaced allowance."""

    def __init__(self, n: int = 3_000_000) -> None:
        self.t = torch.arange(n, dtype=torch.float32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"]


def _save_once(tmp_path: Path, clock: FakeClock, n: int = 3_000_000, **kw: Any) -> Checkpointer:
    kw.setdefault("save_rng", False)
    c = Checkpointer(str(tmp_path / "ck"), ctx=single_process_context(), clock=clock, **kw)
    c.register("big", _Tensor(n))
    c.save(1)
    thread = c._p._thread
    assert thread is not None
    thread.join(timeout=60)  # let it finish paced (wait() would hurry it)
    assert not thread.is_alive()
    return c


def test_checkpointer_paces_by_default_and_the_checkpoint_loads(tmp_path: Path) -> None:
    assert DEFAULT_PERSIST_CPU_SHARE == 0.1
    clock = FakeClock()
    c = _save_once(tmp_path, clock, persist_free_cpu_s=0.0)  # (12 MB may fit the allowance)
    pacer = c._p._pacer
    assert pacer is not None and pacer.rested_s > 0  # hashing 12 MB took some CPU
    c.wait()
    big = _Tensor()
    big.t = torch.zeros(1)
    c2 = Checkpointer(str(tmp_path / "ck"), ctx=single_process_context(), save_rng=False)
    c2.register("big", big)
    assert c2.load() is not None and torch.equal(big.t, torch.arange(3_000_000.0))


def test_a_small_checkpoint_commits_unpaced_by_default(tmp_path: Path) -> None:
    # A failure before the commit recomputes from the checkpoint before: ten times a
    # small persist's CPU time of rests (~0.25-1 s a save in the goodput bench) was work
    # lost to every failure in that window.
    assert DEFAULT_PERSIST_FREE_CPU_S == 0.05
    clock = FakeClock()
    c = _save_once(tmp_path, clock, n=4096, save_rng=True)  # (the defaults: rng state saved)
    pacer = c._p._pacer
    assert pacer is not None and pacer.rested_s == 0.0
    assert c.steps() == [1]
    c.wait()


@linux_only
@pytest.mark.timeout(30)
def test_a_save_waiting_for_an_idle_priority_persist_puts_it_back_to_normal(
    tmp_path: Path,
) -> None:
    # At SCHED_IDLE a persist gets almost no CPU while anything else on the node is busy;
    # once the training thread waits for it, it must not stay there (a CI run saw a
    # 0.25 s persist take 15 s beside busy processes).
    seen: list[tuple[str, int]] = []
    reached, go = threading.Event(), threading.Event()
    tid: list[int] = []

    def hook(stage: str) -> None:
        if stage == "dir_created":
            tid.append(threading.get_native_id())
            seen.append(("before", os.sched_getscheduler(0)))
            reached.set()
            go.wait(20)
            seen.append(("after", os.sched_getscheduler(0)))

    from flexrun.train.pacing import _can_leave_idle

    if not _can_leave_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20)")
    c = Checkpointer(
        str(tmp_path / "ck"),
        ctx=single_process_context(),
        fault_hook=hook,
        persist_when_idle=True,
    )
    c.register("big", _Tensor())
    c.save(1)
    assert reached.wait(20)
    waiter = threading.Thread(target=c.wait)
    waiter.start()
    for _ in range(200):  # the waiter raises it before waiting
        if os.sched_getscheduler(tid[0]) == os.SCHED_OTHER:
            break
        threading.Event().wait(0.05)
    go.set()
    waiter.join(20)
    assert not waiter.is_alive()
    assert seen == [("before", os.SCHED_IDLE), ("after", os.SCHED_OTHER)]
    assert c.steps() == [1]  # and the persist committed


@linux_only
@pytest.mark.timeout(30)
def test_by_default_the_persist_thread_keeps_normal_priority(tmp_path: Path) -> None:
    # At SCHED_IDLE the persist thread, descheduled while it holds the GIL, froze the
    # training thread for seconds beside busy processes (bench/idle_priority_gil.py).
    seen: list[int] = []
    reached = threading.Event()

    def hook(stage: str) -> None:
        if stage == "dir_created":
            seen.append(os.sched_getscheduler(0))
            reached.set()

    c = Checkpointer(str(tmp_path / "ck"), ctx=single_process_context(), fault_hook=hook)
    c.register("big", _Tensor())
    c.save(1)
    assert reached.wait(20)  # (a wait() before the persist began would raise it anyway)
    c.wait()
    assert seen == [os.SCHED_OTHER]
    assert c.steps() == [1]


@linux_only
def test_idle_priority_never_lowers_a_thread_already_waited_for_nor_touches_a_finished_one() -> (
    None
):
    from flexrun.train.pacing import _can_leave_idle

    if not _can_leave_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20)")
    policies: list[int] = []

    def run(idle: IdlePriority) -> None:
        idle.enter()
        policies.append(os.sched_getscheduler(0))
        idle.done()

    late = IdlePriority()
    late.leave()  # the waiter came before the thread lowered itself
    t = threading.Thread(target=run, args=(late,))
    t.start()
    t.join(10)
    normal = IdlePriority()
    t = threading.Thread(target=run, args=(normal,))
    t.start()
    t.join(10)
    normal.leave()  # after done(): its id may belong to another thread by now
    assert policies == [os.SCHED_OTHER, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


UNPRIVILEGED = """
import os, threading
from flexrun.train import pacing
seen = []
def run():
    idle = pacing.IdlePriority()
    idle.enter()
    seen.append(os.sched_getscheduler(0))
    idle.done()
t = threading.Thread(target=run)
t.start()
t.join(10)
print(pacing._can_leave_idle(), seen == [os.SCHED_OTHER])
"""


@linux_only
@pytest.mark.timeout(60)
def test_where_idle_priority_could_not_be_left_the_persist_thread_is_never_lowered() -> None:
    # Without CAP_SYS_NICE and with RLIMIT_NICE 0 (an unprivileged user's default; root in a
    # container, which drops the capability) a thread may enter SCHED_IDLE but never leave
    # it: a save waiting for such a persist could not end its stall, so the thread stays at
    # normal priority (paced) instead. The probe runs as root without the capability.
    import resource
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_SYS_NICE from a process")
    if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
        pytest.skip("RLIMIT_NICE allows leaving SCHED_IDLE here even without the capability")
    out = subprocess.run(
        ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", sys.executable]
        + ["-c", UNPRIVILEGED],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], out.stdout


def test_checkpointer_rejects_a_negative_free_cpu(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        Checkpointer(str(tmp_path), ctx=single_process_context(), persist_free_cpu_s=-0.1)


def test_checkpointer_unpaced_when_share_is_none(tmp_path: Path) -> None:
    clock = FakeClock()
    t0 = clock.monotonic()
    c = _save_once(tmp_path, clock, persist_cpu_share=None)
    assert c._p._pacer is None and clock.monotonic() == t0
    c.wait()


@pytest.mark.parametrize("share", [0.0, 2.0])
def test_checkpointer_rejects_a_bad_cpu_share(tmp_path: Path, share: float) -> None:
    with pytest.raises(CheckpointError):
        Checkpointer(str(tmp_path), ctx=single_process_context(), persist_cpu_share=share)


def test_save_without_zip_crc_loads_and_restores_the_global_setting() -> None:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    seen: list[bool] = []

    class Spy(io.BytesIO):
        def write(self, data: Any) -> int:
            seen.append(config.save.compute_crc32)
            return super().write(data)

    buf = Spy()
    save_without_zip_crc({"w": torch.arange(10.0)}, buf)
    assert config.save.compute_crc32 == before and seen and all(s == before for s in seen)
    records = zipfile.ZipFile(io.BytesIO(buf.getvalue())).infolist()
    assert [r.CRC for r in records if "/data/" in r.filename] == [0]  # no CRC computed
    out = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert torch.equal(out["w"], torch.arange(10.0))
    # the lock was released: a second call (from another thread) does not block
    done = threading.Event()
    t = threading.Thread(target=lambda: (save_without_zip_crc(1, io.BytesIO()), done.set()))
    t.start()
    t.join(timeout=30)
    assert done.is_set()
