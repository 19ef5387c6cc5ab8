"""The local workers of one round: start them together, see them end, stop them together.

Owns a set of :class:`~flexrun.proc.spawn.Worker` processes as one unit: starting each
(fresh, or a warm interpreter handed in by the caller), the console tees, exact exit
times (pidfds: two deaths milliseconds apart are told apart), SIGTERM-then-SIGKILL of
every session, reaping (no zombies, no orphans) and reading each failure's root cause
from what that attempt wrote. It does not decide what a failure means.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from flexrun.cause import FailureCause
from flexrun.proc.diagnose import cause_of
from flexrun.proc.drain import Console
from flexrun.proc.logs import Tee, log_tail, start_tees
from flexrun.proc.spawn import Worker, WorkerResult, kill_session, spawn_worker

WarmSource = Callable[[Mapping[str, str], Path, int, int], "Worker | None"]
"""``warm(env, log_dir, rank, local_rank)``: an already started interpreter for that rank
(a warm spare, assigned), or None to start a fresh process."""


def read_cause(w: Worker, result: WorkerResult) -> FailureCause:
    """Root cause of ``w``'s failure from its error file and this attempt's stderr."""
    try:
        error_text: str | None = w.error_file.read_text(errors="replace")
    except OSError:
        error_text = None
    tail = w.stderr_tail()
    if not tail:  # (not drained, or nothing came through the drain: the file says more)
        tail = log_tail(w.log_dir / "stderr.log", since=w.log_offsets.get("stderr", 0))
    return cause_of(
        result, error_file=error_text, stderr_tail=tail, note=w.note, log_dir=str(w.log_dir)
    )


class ExitClock(threading.Thread):
    """Records when each process exits (via pidfds), so the first failure is known exactly;
    polling every monitor interval would see two deaths a few ms apart as simultaneous.
    ``on_exit`` runs (in this thread) after each recorded exit: the agent's loop, waiting a
    monitor interval between passes, is woken by it and sees a death at once, not up to an
    interval later. Processes can be added while it runs (live mode's replacements)."""

    def __init__(self, pids: list[int], on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(name="flexrun-exit-clock", daemon=True)
        self.times: dict[int, float] = {}
        self._on_exit = on_exit
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._added: list[int] = []  # pidfds opened by add(), not yet polled
        self._closed = False
        for pid in pids:
            self._open(pid)
        self._added.clear()
        self._wake_r, self._wake_w = os.pipe()

    def _open(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return  # gone already, or no pidfd support: the time poll() noticed stands
        self._fds[fd] = pid
        self._added.append(fd)

    def add(self, pid: int) -> None:
        """Also watch ``pid`` (started after this clock; the first ``add`` starts it)."""
        with self._lock:
            if self._closed:
                return
            self._open(pid)
            os.write(self._wake_w, b"a")
        if self.ident is None:
            self.start()

    def run(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    if b"x" in os.read(self._wake_r, 64):
                        return
                    with self._lock:
                        added, self._added = self._added, []
                    for new in added:
                        poller.register(new, select.POLLIN)
                    continue
                ended = time.time()
                poller.unregister(fd)
                with self._lock:
                    pid = self._fds.pop(fd)
                    os.close(fd)
                self.times.setdefault(pid, ended)
                if self._on_exit is not None:
                    self._on_exit()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.write(self._wake_w, b"x")
        if self.ident is not None:
            self.join(timeout=2)
        with self._lock:
            for fd in (*self._fds, self._wake_r, self._wake_w):
                os.close(fd)
            self._fds = {}


class WorkerGroup:
    """The local workers of one round."""

    def __init__(
        self,
        workers: list[Worker],
        tees: list[Tee],
        tee_done: threading.Event,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.workers = workers
        self._tees = tees
        self._tee_done = tee_done
        self._exit_clock = ExitClock([w.proc.pid for w in workers], on_exit)
        self._exit_clock.start()

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        log_dir: Path,
        *,
        console_streams: frozenset[str] = frozenset({"stdout", "stderr"}),
        warm: WarmSource | None = None,
        console: Callable[[int, int], Console] | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> WorkerGroup:
        """Start one process per environment in ``envs`` (local rank = index), logging to
        ``log_dir/rank_<RANK>/``; ``console(local_rank, rank)`` says how each worker's
        streams reach the console (default: ``console_streams``, unmodified, a terminal
        staying a terminal); ``on_exit`` runs as soon as any of them exits (see
        :class:`ExitClock`).

        Raises:
            OSError: a process or its log files could not be created (those already
                started are stopped first).
        """
        workers: list[Worker] = []
        tees: list[Tee] = []
        done = threading.Event()
        try:
            for local_rank, env in enumerate(envs):
                rank = int(env["RANK"])
                wdir = log_dir / f"rank_{rank}"
                w = warm(env, wdir, rank, local_rank) if warm is not None else None
                if w is None:
                    w = spawn_worker(
                        command,
                        env,
                        wdir,
                        rank=rank,
                        local_rank=local_rank,
                        stdin=None,  # (inherited, as torchrun's: breakpoint() works)
                        console=(
                            Console(console_streams)
                            if console is None
                            else console(local_rank, rank)
                        ),
                    )
                workers.append(w)
                if w.output is None:  # (a warm spare writes its log files itself)
                    tees.extend(
                        start_tees(
                            w.log_dir, f"[rank{rank}]:", console_streams, done, w.log_offsets
                        )
                    )
        except OSError:
            cls(workers, tees, done).stop(grace_s=0)
            raise
        return cls(workers, tees, done, on_exit)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def poll(self) -> list[WorkerResult]:
        """Results of workers that have ended so far, in the order they ended."""
        now = time.time()
        for w in self.workers:
            if w.result is None:
                rc = w.proc.poll()
                if rc is not None:
                    ended = self._exit_clock.times.get(w.proc.pid, now)
                    w.result = WorkerResult(w.local_rank, w.rank, w.proc.pid, rc, ended)
        return sorted(
            (w.result for w in self.workers if w.result is not None), key=lambda r: r.ended_at
        )

    def all_done(self) -> bool:
        return all(w.result is not None for w in self.workers)

    def worker(self, rank: int) -> Worker:
        return next(w for w in self.workers if w.rank == rank)

    def cause(self, result: WorkerResult) -> FailureCause:
        """Root cause of ``result``'s worker (what this attempt wrote)."""
        return read_cause(self.worker(result.rank), result)

    def signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                kill_session(w.proc.pid, sig)

    def stop(
        self,
        grace_s: float,
        sig: int = signal.SIGTERM,
        *,
        on_first_exit: Callable[[], None] | None = None,
    ) -> None:
        """SIGTERM every worker's session, wait up to ``grace_s``, then SIGKILL; reap all.

        ``on_first_exit`` runs once, as soon as any worker has exited (or when the grace
        ends): a preempted agent deregisters then, because its ranks agreed on the stop
        (and saved) before the first of them exits, while the last may take the whole
        grace to go (interpreter teardown)."""
        self.signal_all(sig)
        deadline = time.monotonic() + grace_s
        pending = list(self.workers)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for w in list(pending):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=min(max(remaining, 0.001), 0.05))
                if w.proc.returncode is not None:
                    pending.remove(w)
            if on_first_exit is not None and len(pending) < len(self.workers):
                on_first_exit()
                on_first_exit = None
        if on_first_exit is not None:
            on_first_exit()
        self.signal_all(signal.SIGKILL)
        for w in self.workers:
            w.proc.wait()
            # Kill anything the worker left in its session (e.g. DataLoader workers).
            kill_session(w.proc.pid)
        self.poll()
        self.close()

    def close(self) -> None:
        self._exit_clock.close()
        self._tee_done.set()
        for t in self._tees:
            t.join(timeout=2)
        for w in self.workers:
            w.close_files()
