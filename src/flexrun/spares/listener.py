"""The daemon's socket: who may connect, and one request line from each, never blocking.

Owns ``DIR/pool.sock`` from the server's side: binding it (refusing when a live daemon
already serves the directory, removing one left by a dead daemon), accepting connections
without ever blocking the daemon's loop, refusing a peer of another uid at once
(``SO_PEERCRED``), and collecting each connection's request line up to ``MAX_LINE`` bytes
and ``REQUEST_TIMEOUT_S`` seconds. A connection that sends too much, or nothing in time, is
answered with an error and closed; one that closes without a word is dropped. What the
line means is the daemon's (:mod:`flexrun.spares.daemon`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError, SparesUntrusted
from flexrun.spares.protocol import MAX_LINE, REQUEST_TIMEOUT_S, send_json
from flexrun.spares.trust import check_peer, connect

log = logging.getLogger("flexrun.spares")

MAX_PENDING = 64
"""Connections at once whose request is still incomplete; more are refused."""


@dataclass
class Incoming:
    """A connection from a peer of this uid, with its request line."""

    conn: socket.socket
    pid: int
    line: bytes


@dataclass
class _Pending:
    conn: socket.socket
    pid: int
    deadline: float
    data: bytes = field(default=b"")


class Listener:
    """Requests on the unix socket at ``path``.

    Raises (from the constructor):
        ConfigError: another daemon already serves ``path``.
        SparesUntrusted: a process of another uid serves ``path``.
        OSError: the socket could not be bound.
    """

    def __init__(
        self,
        path: Path,
        *,
        clock: Clock = SYSTEM_CLOCK,
        limit: int = MAX_LINE,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.path = path
        self.limit = limit
        self.timeout_s = timeout_s
        self._clock = clock
        self._pending: dict[int, _Pending] = {}
        self._claim(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(str(path))
            os.chmod(path, 0o600)
            self.sock.listen(16)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    @staticmethod
    def _claim(path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(st.st_mode):
            probe = connect(path, str(path), 2.0)
            if probe is not None:
                probe.close()
                raise ConfigError(f"another `flexrun spares` already serves {path.parent}")
        path.unlink()  # left by a daemon that died (or not a socket: in our own directory)

    def poll(self, timeout_s: float) -> list[Incoming]:
        """Wait up to ``timeout_s`` for connections and data; the complete requests."""
        waiting = [self.sock, *(p.conn for p in self._pending.values())]
        readable = select.select(waiting, [], [], timeout_s)[0]
        done: list[Incoming] = []
        for conn in readable:
            if conn is self.sock:
                self._accept()
            else:
                self._read(self._pending[conn.fileno()], done)
        now = self._clock.monotonic()
        for p in list(self._pending.values()):
            if now >= p.deadline:
                self._refuse(p.conn, f"no request within {self.timeout_s:g} s")
        return done

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: the loop goes on
                log.warning("could not accept a connection: %s", exc)
                return
            try:
                pid = check_peer(conn, "a client")
            except SparesUntrusted:
                self._refuse(conn, f"only uid {os.geteuid()} may use these spares")
                continue
            if len(self._pending) >= MAX_PENDING:
                self._refuse(conn, "too many connections at once")
                continue
            conn.setblocking(False)
            deadline = self._clock.monotonic() + self.timeout_s
            self._pending[conn.fileno()] = _Pending(conn, pid, deadline)

    def _read(self, p: _Pending, done: list[Incoming]) -> None:
        try:
            chunk = p.conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
            p.data = b""  # (reset by the peer: nobody to answer)
        if chunk:
            p.data += chunk
            if b"\n" not in p.data:
                if len(p.data) > self.limit:
                    self._refuse(p.conn, f"request over {self.limit} bytes")
                return
        del self._pending[p.conn.fileno()]
        if not p.data:
            p.conn.close()  # connected and left without a word (e.g. a probe)
            return
        line = p.data.split(b"\n", 1)[0]
        if len(line) >= self.limit:
            self._refuse(p.conn, f"request over {self.limit} bytes")
            return
        p.conn.setblocking(True)
        p.conn.settimeout(self.timeout_s)
        done.append(Incoming(p.conn, p.pid, line + b"\n"))

    def _refuse(self, conn: socket.socket, message: str) -> None:
        """Answer ``message`` as an error (if the peer still listens) and close."""
        self._pending.pop(conn.fileno(), None)
        log.warning("refused a request: %s", message)
        with contextlib.suppress(OSError):
            conn.setblocking(True)
            conn.settimeout(0.5)
            send_json(conn, {"error": message})
        conn.close()

    def close(self) -> None:
        for p in list(self._pending.values()):
            p.conn.close()
        self._pending = {}
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
