"""Worker processes of one node: spawn, poll, stop, and explain failures.

Owns the process side of the agent: command lines, per-rank log files and their tee to
the console, error files (torch's ``@record`` format), signals and reaping. It knows
nothing of rounds or stores; the agent hands it a fully built environment per rank.

Every worker runs in its own session (so a signal reaches its whole process tree) with
``PR_SET_PDEATHSIG`` = SIGKILL, so a worker dies with its agent even on ``kill -9``.
Every process started here is waited for: no zombies, no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

_PR_SET_PDEATHSIG = 1


def _child_setup(parent_pid: int) -> None:
    # Runs in the child between fork and exec: die with the agent, however it dies.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the agent's own stop path still reaps its workers
    if os.getppid() != parent_pid:
        os._exit(137)  # the agent died before prctl took effect


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """How one worker ended."""

    local_rank: int
    rank: int
    pid: int
    returncode: int
    ended_at: float

    @property
    def exit_code(self) -> int:
        """Shell-style code: 128+N for a signal."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def signal_name(self) -> str | None:
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"


class Process(Protocol):
    """What the agent uses of a worker process: a ``subprocess.Popen``, or a spare it took
    from the node's ``flexrun spares`` (:class:`flexrun.agent.nodepool.AdoptedProcess`)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdin(self) -> IO[bytes] | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Worker:
    local_rank: int
    rank: int
    proc: Process
    log_dir: Path
    error_file: Path
    result: WorkerResult | None = None
    files: list[IO[bytes]] = field(default_factory=list)
    note: str = ""
    """Why the agent ended this worker itself (e.g. a hang), for the root cause."""

    def close_files(self) -> None:
        """Close the agent's handles on the worker's log files."""
        for f in self.files:
            f.close()
        self.files.clear()


def reap(w: Worker) -> None:
    """SIGKILL ``w``'s session if it still runs, wait for it, close its files."""
    if w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.proc.pid, signal.SIGKILL)
    w.proc.wait()
    w.close_files()


def build_command(
    entrypoint: str, args: Sequence[str], *, module: bool, no_python: bool
) -> list[str]:
    if no_python:
        return [entrypoint, *args]
    if module:
        return [sys.executable, "-u", "-m", entrypoint, *args]
    return [sys.executable, "-u", entrypoint, *args]


def spawn_worker(
    command: Sequence[str],
    env: Mapping[str, str],
    wdir: Path,
    *,
    rank: int,
    local_rank: int,
    stdin: int | None = subprocess.DEVNULL,
) -> Worker:
    """Start one worker in its own session, dying with this process, logging to ``wdir``."""
    wdir.mkdir(parents=True, exist_ok=True)
    error_file = wdir / "error.json"
    error_file.unlink(missing_ok=True)
    out = (wdir / "stdout.log").open("ab")
    err = (wdir / "stderr.log").open("ab")
    full = dict(env)
    full["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    parent = os.getpid()
    try:
        proc = subprocess.Popen(
            list(command),
            env=full,
            stdin=stdin,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=lambda: _child_setup(parent),  # noqa: PLW0108
        )
    except OSError:
        out.close()
        err.close()
        raise
    return Worker(local_rank, rank, proc, wdir, error_file, files=[out, err])


def start_tees(
    wdir: Path, prefix: str, console_streams: frozenset[str], done: threading.Event
) -> list[_Tee]:
    """Copy a worker's log files to the console while ``done`` is unset."""
    tees = []
    for stream, console in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        if stream in console_streams:
            tee = _Tee(wdir / f"{stream}.log", prefix, console, done)
            tee.start()
            tees.append(tee)
    return tees


class _Tee(threading.Thread):
    """Copies a growing log file to the console with a ``[rankN]:`` prefix."""

    def __init__(self, path: Path, prefix: str, out: IO[str], done: threading.Event) -> None:
        super().__init__(name=f"flexrun-tee-{path.name}", daemon=True)
        self.path, self.prefix, self.out, self.done = path, prefix, out, done

    def run(self) -> None:
        with self.path.open("rb") as fh:
            partial = b""
            while True:
                chunk = fh.read(65536)
                if chunk:
                    partial += chunk
                    *lines, partial = partial.split(b"\n")
                    for line in lines:
                        self.out.write(f"{self.prefix}{line.decode(errors='replace')}\n")
                    self.out.flush()
                    continue
                if self.done.is_set():
                    if partial:
                        self.out.write(f"{self.prefix}{partial.decode(errors='replace')}\n")
                        self.out.flush()
                    return
                time.sleep(0.05)


class _ExitClock(threading.Thread):
    """Records when each worker exits (via pidfds), so the first failure is known exactly.

    Polling every monitor interval would see two deaths a few milliseconds apart as
    simultaneous; the root cause is the one that happened first.
    """

    def __init__(self, pids: list[int]) -> None:
        super().__init__(name="flexrun-exit-clock", daemon=True)
        self.times: dict[int, float] = {}
        self._fds: dict[int, int] = {}
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except (OSError, AttributeError):
                continue  # no pidfd support: fall back to the time poll() noticed
        self._wake_r, self._wake_w = os.pipe()

    def run(self) -> None:
        import select

        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        pending = set(self._fds)
        while pending:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    return
                self.times.setdefault(self._fds[fd], time.time())
                poller.unregister(fd)
                pending.discard(fd)

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        self.join(timeout=2)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            os.close(fd)
        self._fds = {}


class WorkerGroup:
    """The local workers of one round."""

    def __init__(self, workers: list[Worker], tees: list[_Tee], tee_done: threading.Event) -> None:
        self.workers = workers
        self._tees = tees
        self._tee_done = tee_done
        self._exit_clock = _ExitClock([w.proc.pid for w in workers])
        self._exit_clock.start()

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        log_dir: Path,
        *,
        console_streams: frozenset[str] = frozenset({"stdout", "stderr"}),
        warm: Callable[[Mapping[str, str], Path, int, int], Worker | None] | None = None,
    ) -> WorkerGroup:
        """Start one process per environment in ``envs`` (local rank = index).

        ``warm(env, log_dir, rank, local_rank)`` may supply an already started interpreter
        (a warm spare) instead of a new process.
        """
        workers: list[Worker] = []
        tees: list[_Tee] = []
        done = threading.Event()
        try:
            for local_rank, env in enumerate(envs):
                rank = int(env["RANK"])
                wdir = log_dir / f"rank_{rank}"
                w = warm(env, wdir, rank, local_rank) if warm is not None else None
                if w is None:
                    w = spawn_worker(command, env, wdir, rank=rank, local_rank=local_rank)
                workers.append(w)
                tees.extend(start_tees(w.log_dir, f"[rank{rank}]:", console_streams, done))
        except OSError:
            cls(workers, tees, done).stop(grace_s=0)
            raise
        return cls(workers, tees, done)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def poll(self) -> list[WorkerResult]:
        """Results of workers that have ended so far (in order of noticing)."""
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

    def signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, sig)
                except ProcessLookupError:
                    continue

    def stop(
        self,
        grace_s: float,
        sig: int = signal.SIGTERM,
        *,
        on_first_exit: Callable[[], None] | None = None,
    ) -> None:
        """SIGTERM every worker's process group, wait up to ``grace_s``, then SIGKILL; reap all.

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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)
        self.poll()
        self.close()

    def close(self) -> None:
        self._exit_clock.close()
        self._tee_done.set()
        for t in self._tees:
            t.join(timeout=2)
        for w in self.workers:
            w.close_files()

    def first_failure(self, failed: Sequence[WorkerResult]) -> WorkerResult:
        """The failure that caused the others: earliest, preferring non-consequential ones.

        A peer's death makes its neighbours fail a few milliseconds later with "connection
        closed by peer"; when failures are that close, those are not the root cause.
        """
        first = min(failed, key=lambda r: r.ended_at)
        close = [r for r in failed if r.ended_at - first.ended_at < 1.0]
        primary = [r for r in close if not _is_consequence(self.root_cause(r))]
        return min(primary or close, key=lambda r: r.ended_at)

    def is_consequence(self, result: WorkerResult) -> bool:
        """True if the worker failed because a peer went away (not a failure of its own)."""
        return _is_consequence(self.root_cause(result))

    def root_cause(self, result: WorkerResult) -> dict[str, Any]:
        """What made ``result``'s worker fail: error file, else the tail of its stderr."""
        return describe_failure(next(w for w in self.workers if w.rank == result.rank), result)


def describe_failure(w: Worker, result: WorkerResult) -> dict[str, Any]:
    """Root cause of one worker's failure: its error file, else the tail of its stderr."""
    cause: dict[str, Any] = {
        "rank": result.rank,
        "local_rank": result.local_rank,
        "pid": result.pid,
        "exit_code": result.exit_code,
        "signal": result.signal_name,
        "message": "",
        "traceback": "",
        "log_dir": str(w.log_dir),
    }
    if w.note:
        cause["message"] = w.note
        cause["traceback"] = log_tail(w.log_dir / "stderr.log")
        return cause
    parsed = read_error_file(w.error_file)
    if parsed is not None:
        cause.update(parsed)
        return cause
    tail = log_tail(w.log_dir / "stderr.log")
    cause["traceback"] = tail
    cause["message"] = _last_exception_line(tail) or (
        f"killed by {result.signal_name}"
        if result.signal_name
        else f"exited with code {result.exit_code}"
    )
    return cause


def capture_stacks(w: Worker, timeout_s: float = 10.0) -> str:
    """Python stacks of a live worker: ``py-spy dump`` when installed, else the
    faulthandler dump that ``flexrun.train`` registers on SIGUSR2."""
    import shutil

    pyspy = shutil.which("py-spy")
    if pyspy is not None:
        try:
            res = subprocess.run(
                [pyspy, "dump", "--pid", str(w.proc.pid)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout
        except (OSError, subprocess.TimeoutExpired):
            pass  # fall back to the worker's own faulthandler
    stack_file = w.log_dir / "stacks.txt"
    before = stack_file.stat().st_size if stack_file.exists() else 0
    try:
        os.kill(w.proc.pid, signal.SIGUSR2)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + min(timeout_s, 3.0)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if stack_file.exists() and stack_file.stat().st_size > before:
            time.sleep(0.2)  # let the dump finish
            with stack_file.open() as fh:
                fh.seek(before)
                return fh.read()
    return "(no stacks: py-spy is not installed and the worker did not answer SIGUSR2)"


def read_error_file(path: Path) -> dict[str, str] | None:
    """Parse torch's ``@record`` error file (or flexrun's own, the same shape)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    msg = data.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        return {
            "message": str(msg.get("message", "")),
            "traceback": str(extra.get("py_callstack", "")),
        }
    if isinstance(msg, str):
        return {"message": msg, "traceback": ""}
    return None


def log_tail(path: Path, max_bytes: int = 8192) -> str:
    """The last ``max_bytes`` of a log file as text ("" when unreadable)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\b.*)$")
_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:\s?)+")


_CONSEQUENCES = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "broken pipe",
    "socket closed",
    "connection refused",
)


PREEMPTED_EXIT = 143
"""128 + SIGTERM: what flexrun.train's workers exit with after an agreed preemption stop."""


def _is_consequence(cause: Mapping[str, Any]) -> bool:
    if cause.get("exit_code") == PREEMPTED_EXIT and not cause.get("signal"):
        # The worker stopped by itself with the preemption code while its own agent was
        # not signalled (that agent would not be looking): the ranks agreed to stop
        # because a peer's node is being preempted. That peer leaves the rendezvous next.
        return True
    text = f"{cause.get('message', '')}\n{cause.get('traceback', '')[-2000:]}".lower()
    return any(c in text for c in _CONSEQUENCES)


def _last_exception_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        line = _RANK_PREFIX.sub("", line.strip())
        if _EXC_LINE.match(line):
            return line
    return ""
