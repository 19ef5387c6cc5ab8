"""Starting and ending one process: command lines, die-with-parent, stopping and reaping.

Owns the mechanics every process flexrun starts shares (workers, warm spares, the spares
daemon's children): each runs in its own session (so a signal reaches its whole tree) and
is killed by the kernel when the process that started it dies, even on ``kill -9``
(``PR_SET_PDEATHSIG``, armed by an exec shim rather than ``preexec_fn``, which is unsafe
in a threaded parent). It knows nothing of ranks' meaning, rounds or stores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from flexrun.proc.drain import Console, Drain, output_pipes

_SHIM = str(Path(__file__).with_name("_pdeathsig.py"))


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """How one worker ended."""

    local_rank: int
    rank: int
    pid: int
    returncode: int
    """``Popen.returncode``: negative -N for signal N."""
    ended_at: float
    """Epoch seconds (when the exit was seen, as exactly as the platform allows)."""

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
    """What flexrun uses of a started process: a ``subprocess.Popen``, or a spare taken
    from the node's ``flexrun spares`` (:class:`flexrun.spares.client.AdoptedProcess`)."""

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
    """One started process and the files the agent keeps for it."""

    local_rank: int
    rank: int
    proc: Process
    log_dir: Path
    error_file: Path
    result: WorkerResult | None = None
    files: list[IO[bytes]] = field(default_factory=list)
    note: str = ""
    """Why the agent ended this worker itself (e.g. a hang), for the root cause."""
    log_offsets: dict[str, int] = field(default_factory=dict)
    """Size of each log file (``stdout``/``stderr``) when this attempt started: a reused
    run directory appends, and only what this attempt wrote is its own."""
    output: Drain | None = None
    """The agent's copier of the worker's output pipes (None: the worker writes its log
    files itself, as a warm spare assigned a log directory does)."""

    def close_files(self) -> None:
        """Drain and close the worker's output and the agent's handles on its files."""
        for f in self.files:
            f.close()
        self.files.clear()
        if self.output is not None:
            self.output.close()

    def stderr_tail(self, max_bytes: int = 8192) -> str | None:
        """What this attempt wrote last on stderr, from the agent's copier (None: the
        worker writes its files itself; read the file from ``log_offsets``)."""
        if self.output is None:
            return None
        self.output.wait_eof(0.5)  # (its last words may still be in the pipe)
        tail = self.output.tail("stderr")
        return None if tail is None else tail[-max_bytes:]


def build_command(
    entrypoint: str,
    args: Sequence[str],
    *,
    module: bool,
    no_python: bool,
    python: str | None = None,
) -> list[str]:
    """The worker command line: ``python -u script args`` (``-m`` for a module), or the
    executable itself with ``no_python``; ``python`` overrides the interpreter."""
    if no_python:
        return [entrypoint, *args]
    exe = python or sys.executable
    if module:
        return [exe, "-u", "-m", entrypoint, *args]
    return [exe, "-u", entrypoint, *args]


def spawn(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    stdin: int | IO[bytes] | None = subprocess.DEVNULL,
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
    cwd: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``command`` in a session of its own that dies with this process.

    Raises:
        OSError: the process could not be started.
    """
    return subprocess.Popen(
        [sys.executable, "-I", "-S", _SHIM, str(os.getpid()), *command],
        env=dict(env),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        start_new_session=True,
    )


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def spawn_worker(
    command: Sequence[str],
    env: Mapping[str, str],
    wdir: Path,
    *,
    rank: int,
    local_rank: int,
    stdin: int | None = subprocess.DEVNULL,
    console: Console | None = None,
) -> Worker:
    """Start one worker logging to ``wdir/{stdout,stderr}.log`` (appended) with its
    ``TORCHELASTIC_ERROR_FILE`` at ``wdir/error.json``.

    With ``console`` (which streams the agent's console shows, and how) the agent drains
    the worker's stdout and stderr (:mod:`.drain`) into the log files and to the console:
    unmodified (through a pseudo-terminal where the agent's stream is a terminal), or line
    by line after a prefix. The worker then never writes a file itself: a full log disk drops log lines, never the worker's writes. Without
    ``console`` (a warm spare, whose output moves when it is assigned) the worker's
    descriptors are the log files themselves.

    Raises:
        OSError: no pipe, terminal or process could be made.
    """
    # A failing log disk must not stop the worker: the copier counts (and says) what it
    # cannot write.
    with contextlib.suppress(OSError):
        wdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    error_file = worker_error_file(wdir, console)
    offsets = {
        s: file_size(console.log_path(s, wdir) if console else wdir / f"{s}.log")
        for s in ("stdout", "stderr")
    }
    if console is None:
        return _spawn_to_files(command, env, wdir, error_file, offsets, rank, local_rank, stdin)
    ends, drain = output_pipes(wdir, console)
    full = dict(env)
    full["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    try:
        proc = spawn(command, full, stdin=stdin, stdout=ends["stdout"], stderr=ends["stderr"])
    except OSError:
        drain.close(0)
        raise
    finally:
        for fd in ends.values():
            os.close(fd)
    drain.start()
    return Worker(local_rank, rank, proc, wdir, error_file, log_offsets=offsets, output=drain)


def worker_error_file(wdir: Path, console: Console | None) -> Path:
    """The worker's ``TORCHELASTIC_ERROR_FILE`` (``wdir/error.json`` unless ``console``
    names one), with what an earlier attempt left there removed (only a regular file: a
    LogsSpecs may name ``/dev/null``)."""
    error_file = console.error_file if console is not None and console.error_file else None
    error_file = error_file or wdir / "error.json"
    with contextlib.suppress(OSError):
        if error_file.is_file():
            error_file.unlink()
    return error_file


def _spawn_to_files(
    command: Sequence[str],
    env: Mapping[str, str],
    wdir: Path,
    error_file: Path,
    offsets: dict[str, int],
    rank: int,
    local_rank: int,
    stdin: int | None,
) -> Worker:
    out = _private_log(wdir / "stdout.log")
    err = _private_log(wdir / "stderr.log")
    full = dict(env)
    full["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    try:
        proc = spawn(command, full, stdin=stdin, stdout=out, stderr=err)
    except OSError:
        out.close()
        err.close()
        raise
    return Worker(local_rank, rank, proc, wdir, error_file, files=[out, err], log_offsets=offsets)


def _private_log(path: Path) -> IO[bytes]:
    """``path`` opened to append, created readable by its owner only (a log may hold
    what a worker prints about its data)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


def kill_session(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the session (process group) led by ``pid``; gone already is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stopped(pid: int) -> int | None:
    """If ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP: state ``T`` in ``/proc/<pid>/stat``;
    not ``t``, a debugger's tracing stop), how many times its main thread has been scheduled
    (``/proc/<pid>/schedstat``): a caller that sees the same count again knows the process did
    not run in between (a stop and continue cycle wakes it); else None (running, gone, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        with open(f"/proc/{pid}/schedstat", "rb") as fh:
            sched = fh.read().split()
    except OSError:
        return None
    # (the state follows the command name, which is in parentheses and may hold any byte)
    if stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"T" or len(sched) < 3:
        return None
    return int(sched[2])


def reap(w: Worker) -> None:
    """SIGKILL ``w``'s session if it still runs, wait for it, close its files."""
    if w.proc.poll() is None:
        kill_session(w.proc.pid)
    w.proc.wait()
    w.close_files()
