"""A worker's output, drained by the agent: pipes or pseudo-terminals to logs and console.

Owns the agent's side of a worker's stdout and stderr. The worker writes into a pipe, or a
pseudo-terminal when the agent's own stream is a terminal (so ``isatty()`` is true in the
worker and a ``\\r`` progress bar updates in place), never into a file: a full or failing
disk under the log directory cannot make a worker's write fail or block. One thread per
worker copies what arrives to its log file and, when that stream is shown, to the console
(unmodified and at once from a terminal; line by line with a ``[rankN]:`` prefix from a
pipe) and, for a tee'd stream, each line holding one of torchrun's
``--duplicate-std{out,err}-filters`` strings to the round's shared :class:`FilteredLog`.
A log write that fails is counted and dropped; the console says so once per agent,
and again when writing works again. The newest stderr bytes are kept in memory for the root
cause, so a failure is diagnosed even when nothing could be logged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import selectors
import shutil
import tempfile
import termios
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

TAIL_BYTES = 16384
"""How much of a worker's newest stderr stays in memory (the root cause's tail)."""
_CONSOLE_FDS = {"stdout": 1, "stderr": 2}


@dataclass(frozen=True, slots=True)
class Console:
    """How one worker's streams reach the agent's console (and, where a torchrun LogsSpecs
    chose them, which files they go to)."""

    streams: frozenset[str] = frozenset()
    """The streams shown (the others only go to the log files)."""
    prefixes: Mapping[str, str] = field(default_factory=dict)
    """Shown streams copied line by line after this prefix (torchrun's tee); the other
    shown streams are copied unmodified, and through a pseudo-terminal where the agent's
    own stream is a terminal."""
    duplicates: Mapping[str, FilteredLog] = field(default_factory=dict)
    """Where the matching lines of a prefixed stream are also appended (torchrun's
    ``--duplicate-stdout-filters``: only its tee'd streams are filtered)."""
    files: Mapping[str, Path] = field(default_factory=dict)
    """A stream's log file instead of ``<worker dir>/<stream>.log``."""
    error_file: Path | None = None
    """The worker's ``TORCHELASTIC_ERROR_FILE`` instead of ``<worker dir>/error.json``."""

    def log_path(self, name: str, wdir: Path) -> Path:
        return self.files.get(name, wdir / f"{name}.log")

    def tty(self) -> frozenset[str]:
        return frozenset(s for s in self.streams - set(self.prefixes) if console_is_tty(s))

    def _copy(self, name: str, wdir: Path) -> StreamCopy:
        prefix = self.prefixes.get(name)
        return StreamCopy(
            name,
            self.log_path(name, wdir),
            _CONSOLE_FDS[name] if name in self.streams else None,
            None if prefix is None else prefix.encode(),
            keep_tail=name == "stderr",
            duplicate=self.duplicates.get(name) if prefix is not None else None,
        )


class _DiskNotice:
    """Says once (per agent process) that log lines are being dropped, and once that
    logging resumed; counts what was dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.dropped_lines = 0
        self.failing = False
        self.say: Callable[[str], None] = lambda text: _write_all(2, text.encode())

    def dropped(self, lines: int, path: Path, exc: OSError) -> None:
        with self._lock:
            self.dropped_lines += lines
            if self.failing:
                return
            self.failing = True
        self.say(
            f"[flexrun] cannot write worker logs ({path.parent}: {exc.strerror or exc}): "
            "dropping log lines until writing works again; workers and the console are "
            "unaffected\n"
        )

    def wrote(self) -> None:
        with self._lock:
            if not self.failing:
                return
            self.failing = False
            lines = self.dropped_lines
        self.say(f"[flexrun] worker logs are written again ({lines} line(s) dropped so far)\n")


DISK_NOTICE = _DiskNotice()


def line_matches(line: bytes, needles: tuple[bytes, ...]) -> bool:
    """torchrun's duplicate filter: ``line`` holds any of ``needles`` (an empty needle
    matches every line, as ``"" in line`` does in torch)."""
    return any(n in line for n in needles)


def filter_needles(filters: tuple[str, ...]) -> tuple[bytes, ...]:
    """The byte strings a worker's (UTF-8) output lines are searched for."""
    return tuple(f.encode() for f in filters)


class FilteredLog:
    """One file that the lines of several workers' streams holding any of ``needles`` are
    appended to, each after its console prefix (torchrun's ``filtered_stdout.log`` /
    ``filtered_stderr.log``: one per attempt, all local ranks together). Safe to feed from
    every worker's drain thread. A write that fails is counted and dropped, as a log
    line's (:data:`DISK_NOTICE`): a full disk never reaches a worker."""

    def __init__(self, path: Path, needles: tuple[bytes, ...]) -> None:
        self.path = path
        self.needles = needles
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._closed = False

    def open(self) -> None:
        """Create the file now (torchrun creates it when the attempt starts, even if no
        line ever matches); a disk that refuses is said once and retried at the first line."""
        with self._lock:
            self._write(b"", 0)

    def offer(self, prefix: bytes, lines: list[bytes]) -> None:
        """Append those of ``lines`` (without their newline) that match, each after ``prefix``."""
        kept = [prefix + ln + b"\n" for ln in lines if line_matches(ln, self.needles)]
        if kept:
            with self._lock:
                self._write(b"".join(kept), len(kept))

    def _write(self, data: bytes, lines: int) -> None:
        if self._closed:
            return  # (a drain that outlived its round)
        try:
            if self._fd is None:
                self._fd = _open_append(self.path)
            _write_all(self._fd, data)
        except OSError as exc:
            DISK_NOTICE.dropped(lines, self.path, exc)

    def close(self) -> None:
        """Close the file; later lines (a drain that outlived its round) are not written."""
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _open_append(path: str | os.PathLike[str]) -> int:
    """A log file opened for appending (created 0644 if missing)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


@dataclass
class StreamCopy:
    """One stream of one worker: where its bytes go."""

    name: str
    """``stdout`` or ``stderr``."""
    log_path: Path
    console_fd: int | None
    """The agent's descriptor to copy to (None: kept off the console)."""
    prefix: bytes | None
    """Console line prefix; None: bytes are copied unmodified as they come (a terminal)."""
    keep_tail: bool = False
    duplicate: FilteredLog | None = None
    """Where this (prefixed) stream's matching lines are also appended."""
    tail: bytearray = field(default_factory=bytearray)
    _log_fd: int | None = None
    _partial: bytes = b""

    def feed(self, chunk: bytes) -> None:
        self._log(chunk)
        if self.keep_tail:
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - TAIL_BYTES)]
        if self.prefix is None:
            if self.console_fd is not None:
                self._console(chunk)
            return
        if self.console_fd is None and self.duplicate is None:
            return
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self._lines(lines)

    def _lines(self, lines: list[bytes]) -> None:
        assert self.prefix is not None
        if not lines:
            return
        if self.console_fd is not None:
            self._console(b"".join(self.prefix + line + b"\n" for line in lines))
        if self.duplicate is not None:
            self.duplicate.offer(self.prefix, lines)

    def end(self) -> None:
        if self._partial and self.prefix is not None:
            self._lines([self._partial])
        self._partial = b""
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def open_log(self) -> None:
        """Create the log file now (the run directory's contract: every rank has its
        ``stdout.log`` and ``stderr.log``, empty when it wrote nothing); a disk that
        refuses is said once and retried at the first bytes."""
        try:
            self._log_fd = _open_append(self.log_path)
        except OSError as exc:
            DISK_NOTICE.dropped(0, self.log_path, exc)

    def _log(self, chunk: bytes) -> None:
        try:
            if self._log_fd is None:
                self._log_fd = _open_append(self.log_path)
            _write_all(self._log_fd, chunk)
        except OSError as exc:
            DISK_NOTICE.dropped(max(1, chunk.count(b"\n")), self.log_path, exc)
            return
        DISK_NOTICE.wrote()

    def _console(self, data: bytes) -> None:
        assert self.console_fd is not None
        try:
            _write_all(self.console_fd, data)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.EBADF, errno.EIO):
                raise
            self.console_fd = None  # the console went away: keep logging


class Drain(threading.Thread):
    """Copies a worker's output descriptors (the read ends) until each reaches its end."""

    def __init__(
        self,
        name: str,
        streams: dict[int, StreamCopy],
        *,
        held: list[int] | None = None,
        private: Path | None = None,
    ) -> None:
        super().__init__(name=f"flexrun-drain-{name}", daemon=True)
        self.streams = streams
        self._held = list(held or [])
        """Write ends the agent keeps open for a process that opens its output by path
        (a warm spare): without them, the reader would see an end before it opened."""
        self._private = private
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._closing = False
        self._eof = threading.Event()
        for fd in streams:
            self._sel.register(fd, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)

    def run(self) -> None:
        for stream in self.streams.values():
            stream.open_log()
        open_fds = set(self.streams)
        try:
            while open_fds:
                for key, _ in self._sel.select():
                    fd = int(key.fd)
                    if fd == self._wake_r:
                        if self._closing:
                            return
                        continue
                    try:
                        chunk = os.read(fd, 65536)
                    except OSError as exc:
                        if exc.errno != errno.EIO:  # (a terminal whose writers all closed)
                            raise
                        chunk = b""
                    if chunk:
                        self.streams[fd].feed(chunk)
                        continue
                    self._sel.unregister(fd)
                    open_fds.discard(fd)
        finally:
            for s in self.streams.values():
                s.end()
            self._eof.set()

    def tail(self, name: str) -> str | None:
        """The newest bytes of stream ``name`` kept in memory, as text (None: not kept)."""
        for s in self.streams.values():
            if s.name == name and s.keep_tail:
                return bytes(s.tail).decode(errors="replace")
        return None

    def wait_eof(self, timeout_s: float) -> bool:
        """Wait until every stream ended (the worker, and anything that inherited its
        output, exited) or ``timeout_s`` passed; True when all ended. Call it once the
        worker has exited: the agent's own write ends are closed first."""
        self.release()
        return self._eof.wait(timeout_s)

    def release(self) -> None:
        """Close the write ends the agent held for a worker that opened its output by path
        (its own copies keep the streams open while it runs)."""
        held, self._held = self._held, []
        for fd in held:
            os.close(fd)

    def close(self, timeout_s: float = 2.0) -> None:
        """Drain what is left (up to ``timeout_s``), then stop and close the descriptors."""
        self.release()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None
        if self.is_alive() and not self.wait_eof(timeout_s):
            self._closing = True
            os.write(self._wake_w, b"x")
            self.join(timeout=2)
        if not self.is_alive():
            self._sel.close()
            for fd in (*self.streams, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.streams = {}


def console_is_tty(stream: str) -> bool:
    """Whether the agent's own ``stream`` (stdout/stderr) is a terminal."""
    try:
        return os.isatty(_CONSOLE_FDS[stream])
    except OSError:
        return False


def open_pty(like_fd: int) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) for a worker's stream: the window size of the
    agent's terminal ``like_fd`` (progress bars size themselves from it), and no output
    processing (the bytes written reach the agent, and then its terminal, unmodified)."""
    master, slave = os.openpty()
    with contextlib.suppress(OSError):
        fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(like_fd, termios.TIOCGWINSZ, b"\0" * 8))
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    os.set_inheritable(master, False)
    return master, slave


def output_pipes(wdir: Path, console: Console) -> tuple[dict[str, int], Drain]:
    """The write ends to give a worker as ``stdout``/``stderr`` (close them once it has
    started) and the :class:`Drain` (not started) that copies the read ends to
    ``wdir/{stdout,stderr}.log`` and to the agent's console as ``console`` says (a
    pseudo-terminal for its :meth:`Console.tty` streams, else a pipe).

    Raises:
        OSError: no pipe or terminal could be made.
    """
    ends: dict[str, int] = {}
    streams: dict[int, StreamCopy] = {}
    tty = console.tty()
    try:
        for name, fd in _CONSOLE_FDS.items():
            read, write = open_pty(fd) if name in tty else os.pipe()
            ends[name] = write
            streams[read] = console._copy(name, wdir)
    except OSError:
        for fd in (*ends.values(), *streams):
            os.close(fd)
        raise
    return ends, Drain(wdir.name, streams)


def output_paths(wdir: Path, console: Console) -> tuple[dict[str, str], Drain]:
    """The same plumbing as :func:`output_pipes` for a process that is already running
    and opens its output by path (a warm spare taking an assignment): the paths to open
    for writing (a pseudo-terminal's device, or a FIFO in a private directory), and the
    :class:`Drain` (started) reading them. The agent holds a write end of each until
    :meth:`Drain.release` (call it once the worker exited).

    Raises:
        OSError: no terminal, directory or FIFO could be made.
    """
    private = Path(tempfile.mkdtemp(prefix="flexrun-out-"))
    paths: dict[str, str] = {}
    streams: dict[int, StreamCopy] = {}
    held: list[int] = []
    tty = console.tty()
    try:
        for name, fd in _CONSOLE_FDS.items():
            if name in tty:
                read, write = open_pty(fd)
                paths[name] = os.ttyname(write)
            else:
                fifo = private / name
                os.mkfifo(fifo, 0o600)
                read = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                write = os.open(fifo, os.O_WRONLY | os.O_CLOEXEC)
                os.set_blocking(read, True)
                paths[name] = str(fifo)
            held.append(write)
            streams[read] = console._copy(name, wdir)
    except OSError:
        for x in (*held, *streams):
            os.close(x)
        shutil.rmtree(private, ignore_errors=True)
        raise
    drain = Drain(wdir.name, streams, held=held, private=private)
    drain.start()
    return paths, drain
