"""A node's warm interpreters that outlive its agents: the ``flexrun spares`` daemon.

Owns the node side of warm spares that exist before any agent: a daemon started with the
node (a standby node, a pod's sidecar) keeps ``count`` idle ``python -m
flexrun.train.spare`` processes, with Python and torch already imported, and hands them
to agents that ask through a unix socket in its directory. An agent started on that
node then skips the interpreter and ``import torch`` (about 2 s of CPU per process here)
for its first workers, and a restarted agent (kill -9, a container restart) finds its
replacements warm.

A handed-out spare stays this daemon's child (only a parent can reap), so:
- its stdin (the assignment channel) is passed to the agent over the socket
  (``SCM_RIGHTS``) and the daemon closes its own copy;
- the daemon reaps it and writes its exit status to ``exits/<name>.json``, which the
  agent's :class:`AdoptedProcess` reads; the spare also records its own exit code, so a
  worker still gets a status when the daemon itself is gone;
- it dies with the agent that took it (the spare watches the agent's pid once assigned;
  the daemon also kills it when that agent is gone).

It does not know rounds, ranks or stores; :mod:`flexrun.agent.pool` decides when to take.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from flexrun import __version__
from flexrun.agent.workers import Worker, spawn_worker
from flexrun.errors import ConfigError

log = logging.getLogger("flexrun.spares")

SOCKET_NAME = "pool.sock"
MAX_TAKE = 256
# A spare that dies while importing is retried after this long, doubling up to the cap.
BOOT_RETRY_S = (1.0, 60.0)
# Exit records older than this are removed (their agent never read them).
RECORD_TTL_S = 3600.0
# How long an agent waits for the daemon's answer before it starts its workers itself (the
# daemon answers in milliseconds; a stopped or starved one must not hold a start back).
TAKE_TIMEOUT_S = 2.0
# How long an agent waits for an exit record after the process is gone.
RECORD_WAIT_S = 1.0


def interpreter() -> str:
    """What a spare and the agent taking it must share: the Python (and its environment,
    e.g. a virtualenv) and the flexrun version."""
    return f"{os.path.realpath(sys.executable)} prefix {sys.prefix} flexrun {__version__}"


def exit_record(root: Path, name: str, *, own: bool = False) -> Path:
    """Where the daemon (or, with ``own``, the spare itself) writes a spare's exit status."""
    return root / "exits" / (f"{name}.self.json" if own else f"{name}.json")


def _write_json(path: Path, data: Mapping[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(data)))
    os.replace(tmp, path)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _gone(fd: int | None) -> bool:
    """True once the process behind pidfd ``fd`` (None: already gone) has exited."""
    if fd is None:
        return True
    return bool(select.select([fd], [], [], 0)[0])


@dataclass
class _Spare:
    name: str
    worker: Worker
    ready: Path
    started: float
    agent_pid: int = 0
    agent_fd: int | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        p = self.worker.proc
        assert isinstance(p, subprocess.Popen)
        return p


class SparesDaemon:
    """Keeps ``count`` idle spares in ``root`` and serves them on ``root/pool.sock``.

    Raises (from the constructor):
        ConfigError: bad count, or another daemon already serves ``root``.
    """

    def __init__(
        self,
        root: Path,
        count: int,
        *,
        environ: Mapping[str, str],
        refill_delay_s: float = 5.0,
    ) -> None:
        if not 1 <= count <= MAX_TAKE:
            raise ConfigError(f"--count {count}: must be 1-{MAX_TAKE}")
        if refill_delay_s < 0:
            raise ConfigError(f"--refill-delay {refill_delay_s:g}: must not be negative")
        self.root = root
        self.count = count
        self.refill_delay_s = refill_delay_s
        self.environ = dict(environ)
        # Live workers' bounded store waits expire on purpose; c10d reads this at import.
        self.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        self.idle: list[_Spare] = []
        self.given: list[_Spare] = []
        self._seq = 0
        self._refill_at = 0.0
        self._boot_failures = 0
        self._pruned_at = 0.0
        self._last_failed: Path | None = None
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)  # the socket hands out processes: this user only
        (root / "exits").mkdir(exist_ok=True)
        path = root / SOCKET_NAME
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # left by a daemon that died
            else:
                raise ConfigError(f"another `flexrun spares` already serves {root}")
            finally:
                probe.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.sock.setblocking(False)

    # -- the loop ---------------------------------------------------------------------------
    def serve(self, stopped: Callable[[], bool], tick_s: float = 0.05) -> None:
        """Serve until ``stopped()``; then :meth:`close`."""
        try:
            while not stopped():
                self.tick()
                if select.select([self.sock], [], [], tick_s)[0]:
                    self._accept()
        finally:
            self.close()

    def tick(self) -> None:
        """Reap, write exit records, enforce agent deaths, refill."""
        now = time.monotonic()
        for s in list(self.idle):
            rc = s.proc.poll()
            if rc is not None:
                self.idle.remove(s)
                self._boot_failures += 1
                delay = min(BOOT_RETRY_S[1], BOOT_RETRY_S[0] * 2 ** (self._boot_failures - 1))
                self._refill_at = max(self._refill_at, now + delay)
                log.error(
                    "spare %s exited with %d before it was taken (retry in %.0f s); stderr: %s",
                    s.name,
                    rc,
                    delay,
                    _tail(s.worker.log_dir / "stderr.log"),
                )
                _close_files(s.worker)
                if self._last_failed is not None:  # keep the latest failure's logs only
                    shutil.rmtree(self._last_failed, ignore_errors=True)
                self._last_failed = s.worker.log_dir
            elif self._boot_failures and s.ready.exists():
                self._boot_failures = 0
        for s in list(self.given):
            rc = s.proc.poll()
            if rc is not None:
                try:
                    _write_json(
                        exit_record(self.root, s.name),
                        {"pid": s.proc.pid, "returncode": rc, "ended_at": time.time()},
                    )
                except OSError as exc:  # e.g. a full disk: the spare's own record may serve
                    log.error("exit status %d of pid %d not recorded: %s", rc, s.proc.pid, exc)
                self._forget(s)
            elif _gone(s.agent_fd):
                # Its agent died: the spare should have gone with it (it watches the agent
                # once assigned; an unassigned one reads end of file). Make sure.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
        if len(self.idle) < self.count and now >= self._refill_at:
            while len(self.idle) < self.count:
                self.idle.append(self._start())
        if now - self._pruned_at > 60:
            self._pruned_at = now
            self._prune()

    def _start(self) -> _Spare:
        self._seq += 1
        name = f"s{os.getpid()}-{self._seq}"
        ready = self.root / "spares" / f"{name}.ready"
        ready.parent.mkdir(parents=True, exist_ok=True)
        env = dict(self.environ, FLEXRUN_SPARE_READY=str(ready))
        cmd = [sys.executable, "-u", "-m", "flexrun.train.spare"]
        w = spawn_worker(
            cmd, env, self.root / "spares" / name, rank=-1, local_rank=-1, stdin=subprocess.PIPE
        )
        return _Spare(name, w, ready, time.time())

    def _forget(self, s: _Spare) -> None:
        self.given.remove(s)
        if s.agent_fd is not None:
            os.close(s.agent_fd)
        _close_files(s.worker)
        # Its output moved to its rank's log directory when it was assigned.
        shutil.rmtree(s.worker.log_dir, ignore_errors=True)

    def _prune(self) -> None:
        cutoff = time.time() - RECORD_TTL_S
        for f in (self.root / "exits").iterdir():
            with contextlib.suppress(FileNotFoundError):
                if f.stat().st_mtime < cutoff:
                    f.unlink()

    # -- requests ---------------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                self._handle(conn)
            except (OSError, ValueError) as exc:
                log.warning("a request failed: %s", exc)

    def _handle(self, conn: socket.socket) -> None:
        pid, uid, _ = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
        if uid != os.getuid():
            _send(conn, {"error": f"uid {uid} may not take spares of uid {os.getuid()}"})
            return
        req = json.loads(_read_line(conn))
        op = req.get("op")
        if op == "status":
            _send(conn, self.status())
            return
        if op != "take":
            _send(conn, {"error": f"unknown op {op!r}"})
            return
        count = req.get("count")
        if not isinstance(count, int) or not 1 <= count <= MAX_TAKE:
            _send(conn, {"error": f"count {count!r}: must be 1-{MAX_TAKE}"})
            return
        if req.get("interpreter") != interpreter():
            _send(
                conn,
                {
                    "error": f"these spares run {interpreter()}; "
                    f"the agent runs {req.get('interpreter')}: not taken"
                },
            )
            return
        # Ready ones first; a booting one is still sooner than a process started now.
        chosen = sorted(self.idle, key=lambda s: not s.ready.exists())[:count]
        fds = []
        for s in chosen:
            assert s.proc.stdin is not None
            fds.append(s.proc.stdin.fileno())
        reply = {
            "spares": [
                {
                    "pid": s.proc.pid,
                    "name": s.name,
                    "ready": str(s.ready),
                    "log_dir": str(s.worker.log_dir),
                }
                for s in chosen
            ]
        }
        data = (json.dumps(reply) + "\n").encode()
        sent = socket.send_fds(conn, [data], fds) if fds else conn.send(data)
        # The channels went with the first byte: from here on the agent holds them.
        for s in chosen:
            self.idle.remove(s)
            assert s.proc.stdin is not None
            s.proc.stdin.close()  # the agent holds the only write end now
            s.agent_pid, s.agent_fd = pid, _pidfd(pid)
            self.given.append(s)
        if chosen:
            log.info("handed %d spare(s) to pid %d", len(chosen), pid)
            self._refill_at = max(self._refill_at, time.monotonic() + self.refill_delay_s)
        if sent < len(data):
            conn.sendall(data[sent:])

    def status(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "ready": sum(1 for s in self.idle if s.ready.exists()),
            "booting": sum(1 for s in self.idle if not s.ready.exists()),
            "handed_out": len(self.given),
            "interpreter": interpreter(),
        }

    def close(self) -> None:
        """Stop the idle spares; handed-out ones belong to their agents and live on."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            (self.root / SOCKET_NAME).unlink()
        for s in self.idle:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
            _close_files(s.worker)
            s.ready.unlink(missing_ok=True)
            shutil.rmtree(s.worker.log_dir, ignore_errors=True)
        self.idle = []
        for s in self.given:
            if s.agent_fd is not None:
                os.close(s.agent_fd)
        self.given = []


# -- the agent's side ---------------------------------------------------------------------------
class AdoptedProcess:
    """A handed-out spare as the agent sees it: what the agent uses of ``subprocess.Popen``
    (``pid``, ``stdin``, ``returncode``, ``poll``, ``wait``) for a process it did not start.
    Exit is seen through a pidfd; the status comes from the daemon's (or the spare's own)
    exit record."""

    def __init__(self, pid: int, name: str, stdin: IO[bytes], root: Path) -> None:
        self.pid = pid
        self.name = name
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None
        self.root = root
        self._fd = _pidfd(pid)
        self._gone_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not _gone(self._fd):
            return None
        rc = self._read_record()
        if rc is None:
            now = time.monotonic()
            self._gone_at = self._gone_at or now
            if now - self._gone_at < RECORD_WAIT_S:
                return None
            log.warning(
                "worker pid %d ended and no exit status was recorded (is `flexrun spares` "
                "gone?): reported as killed",
                self.pid,
            )
            rc = -signal.SIGKILL
        self.returncode = rc
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return rc

    def _read_record(self) -> int | None:
        for own in (False, True):
            path = exit_record(self.root, self.name, own=own)
            try:
                rc = int(json.loads(path.read_text())["returncode"])
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                continue
            for p in (
                exit_record(self.root, self.name),
                exit_record(self.root, self.name, own=True),
            ):
                p.unlink(missing_ok=True)
            return rc
        return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            if self._fd is not None:
                left = (
                    0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
                )
                select.select([self._fd], [], [], left)
            else:
                time.sleep(0.01)


@dataclass(frozen=True)
class Adopted:
    worker: Worker
    ready: Path


def take_spares(root: Path, count: int) -> list[Adopted]:
    """Up to ``count`` spares from the daemon serving ``root``; [] when none serves it.

    Raises:
        OSError: the daemon did not answer within ``TAKE_TIMEOUT_S`` (e.g. it is stopped)
            or answered something unreadable.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TAKE_TIMEOUT_S)
    try:
        try:
            sock.connect(str(root / SOCKET_NAME))
        except (FileNotFoundError, ConnectionRefusedError):
            log.debug("no `flexrun spares` serves %s", root)
            return []
        req = {"op": "take", "count": count, "interpreter": interpreter()}
        sock.sendall((json.dumps(req) + "\n").encode())
        data, fds, _, _ = socket.recv_fds(sock, 65536, MAX_TAKE)
        while not data.endswith(b"\n"):
            more = sock.recv(65536)
            if not more:
                break
            data += more
    finally:
        sock.close()
    try:
        reply = json.loads(data)
        if "error" in reply:
            for fd in fds:
                os.close(fd)
            log.warning("`flexrun spares` in %s: %s", root, reply["error"])
            return []
        spares = reply["spares"]
        if len(spares) != len(fds):
            raise ValueError(f"{len(spares)} spares but {len(fds)} channels")
    except (ValueError, KeyError, TypeError) as exc:
        for fd in fds:
            os.close(fd)
        raise OSError(f"unreadable reply from `flexrun spares` in {root}: {exc}") from exc
    out = []
    for s, fd in zip(spares, fds, strict=True):
        proc = AdoptedProcess(int(s["pid"]), str(s["name"]), os.fdopen(fd, "wb"), root)
        wdir = Path(s["log_dir"])
        out.append(Adopted(Worker(-1, -1, proc, wdir, wdir / "error.json"), Path(s["ready"])))
    return out


def query_status(root: Path) -> dict[str, object]:
    """The daemon's counts (ready, booting, handed_out).

    Raises:
        ConfigError: no daemon serves ``root``.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        try:
            sock.connect(str(root / SOCKET_NAME))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ConfigError(f"no `flexrun spares` serves {root}") from exc
        sock.sendall(b'{"op": "status"}\n')
        reply: dict[str, object] = json.loads(_read_line(sock))
        return reply
    finally:
        sock.close()


# -- small helpers ------------------------------------------------------------------------------
def _read_line(conn: socket.socket, limit: int = 65536) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError("request too long")
    return data


def _send(conn: socket.socket, obj: Mapping[str, object]) -> None:
    conn.sendall((json.dumps(dict(obj)) + "\n").encode())


def _close_files(w: Worker) -> None:
    for f in w.files:
        f.close()
    w.files.clear()


def _tail(path: Path, limit: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip() or "(empty)"
    except OSError:
        return "(none)"
