"""A fork server's loop: the process side of a pool's refill in milliseconds.

Owns what ``python -m flexrun.spares.spare --fork-server`` (which imports torch first) does
once warm: one interpreter has paid Python, torch and ``flexrun.train`` (what
:mod:`flexrun.spares.spare` pays per spare), then forks each new spare on request, so a
refill after a restart costs no ``import torch`` and no CPU beside the restarted workers
(a burst of failures finds its spares ready), and the spares share the zygote's pages
until they write them. Standard library only here (the unit tests run it without torch).

Its stdin is a Unix socket to the pool that started it (:mod:`flexrun.spares.forkserver`):
one request line per spare (``{"name": NAME}``), answered with one line (``{"pid": N}``)
and the write end of the new spare's stdin (``SCM_RIGHTS``), its assignment channel. Every
child is, as a spare started fresh: the leader of a session of its own, killed when its
parent (this zygote, which dies with the agent) dies, logging to ``ROOT/NAME/``, ready
once ``ROOT/NAME.ready`` exists; then it serves its assignment
(:func:`flexrun.spares.become.serve_assignment`) with the zygote's frames unwound. The
zygote reaps its children and writes each one's status where
:class:`flexrun.spares.adopted.AdoptedProcess` reads it (``ROOT/exits/NAME.json``).

Fork safety: the zygote never runs a torch operation, so torch's intra-op thread pool is
not started; OpenBLAS (numpy) stops its threads in its own pre-fork handler; Python's
``random`` reseeds in each child, and numpy's global generator is reseeded here. End of
input: the zygote exits (its idle children with it).
"""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import socket
import sys
from pathlib import Path

from flexrun.errors import SparesProtocolError
from flexrun.spares.become import Prepare, announce_ready, serve_assignment
from flexrun.spares.protocol import (
    EXIT_RECORD_ENV,
    MAX_LINE,
    READY_ENV,
    ZYGOTE_ROOT_ENV,
    decode_object,
    encode,
    exit_record,
    valid_name,
    write_record,
)

_PR_SET_PDEATHSIG = 1


class _Child(Exception):
    """Raised in a forked child to unwind the zygote's loop (never escapes :func:`serve_forks`)."""


class Zygote:
    def __init__(self, conn: socket.socket, root: Path) -> None:
        self.conn = conn
        self.root = root
        self.children: dict[int, str] = {}
        self._buf = b""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self._wake_w)
        (root / "exits").mkdir(parents=True, exist_ok=True)

    def serve(self) -> None:
        """Fork spares until end of input; in a child, raise :class:`_Child`."""
        while True:
            ready, _, _ = select.select([self.conn.fileno(), self._wake_r], [], [], 5.0)
            self._reap()
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)  # (SIGCHLD's wake-ups: reaped above)
            if self.conn.fileno() in ready:
                chunk = self.conn.recv(65536)
                if not chunk:
                    return
                self._buf += chunk
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    self._answer(line)
                if len(self._buf) > MAX_LINE:
                    raise SparesProtocolError(f"request over {MAX_LINE} bytes")

    def _answer(self, line: bytes) -> None:
        try:
            name = valid_name(decode_object(line, "fork request").get("name"))
            _check_fork_safe()
        except SparesProtocolError as exc:
            self.conn.sendall(encode({"error": str(exc)}))
            return
        r, w = os.pipe()
        sync_r, sync_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.close(sync_r)
            self._become_spare(name, r, sync_w)
            raise _Child
        os.close(r)
        os.close(sync_w)
        self.children[pid] = name
        try:
            # Answer once it leads its session: a kill of its session must reach it.
            while os.read(sync_r, 64):
                pass
            socket.send_fds(self.conn, [encode({"pid": pid})], [w])
        finally:
            os.close(w)
            os.close(sync_r)

    def _become_spare(self, name: str, stdin_fd: int, sync_fd: int) -> None:
        """In the child: a session of its own, death with the zygote, its own files (then
        ``sync_fd`` is closed: the zygote hands it out)."""
        parent = os.getppid()
        self.conn.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self._wake_r)
        os.close(self._wake_w)
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(137)  # the zygote died before the death signal was armed
        os.close(sync_fd)
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        log_dir = self.root / name
        log_dir.mkdir(parents=True, exist_ok=True)
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            target = os.open(log_dir / f"{stream}.log", flags, 0o600)
            os.dup2(target, fd)
            os.close(target)
        os.environ[READY_ENV] = str(self.root / f"{name}.ready")
        os.environ[EXIT_RECORD_ENV] = str(exit_record(self.root, name, own=True))
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(log_dir / "error.json")
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()  # (as a fresh interpreter's, from entropy)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            name = self.children.pop(pid, None)
            if name is None:
                continue
            rc = os.waitstatus_to_exitcode(status)
            try:
                write_record(exit_record(self.root, name), {"pid": pid, "returncode": rc})
            except OSError as exc:  # (a full disk: the child's own record may serve)
                print(
                    f"flexrun zygote: status {rc} of pid {pid} not recorded: {exc}", file=sys.stderr
                )


def _check_fork_safe() -> None:
    """Raises:
    SparesProtocolError: CUDA is initialised here (a forked child could not use it)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        raise SparesProtocolError("CUDA is initialised in the fork server: not forking")


def serve_forks(prepare: Prepare | None = None) -> int:
    """The zygote's main: fork spares until end of input (0); in a forked spare, its
    assignment's exit code (``serve_assignment``)."""
    root = Path(os.environ[ZYGOTE_ROOT_ENV])
    conn = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    zygote = Zygote(conn, root)
    # Everything imported so far (torch and the rest) lives as long as any spare: move it out
    # of the collector's reach. A child's collections and its exit then no longer walk (and
    # so copy) the pages it shares with this zygote: 0.75 -> 0.3 s of CPU per forked worker's
    # normal exit with torch imported.
    gc.freeze()
    announce_ready(os.environ.pop(READY_ENV, None))
    try:
        zygote.serve()
    except _Child:
        # A forked spare, with the zygote's frames gone: from here on, as a fresh one.
        with os.fdopen(0, "rb", closefd=False) as stdin:
            return serve_assignment(prepare=prepare, stdin=stdin)
    return 0
