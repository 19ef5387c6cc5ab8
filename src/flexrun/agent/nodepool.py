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

from flexrun.agent.adopt import (
    MAX_TAKE,
    SOCKET_NAME,
    exit_record,
    interpreter,
    pidfd,
    process_gone,
    read_line,
    send_json,
    write_record,
)
from flexrun.errors import ConfigError
from flexrun.proc import Worker, log_tail, reap, spawn_worker

log = logging.getLogger("flexrun.spares")

# A spare that dies while importing is retried after this long, doubling up to the cap.
BOOT_RETRY_S = (1.0, 60.0)
# Exit records older than this are removed (their agent never read them).
RECORD_TTL_S = 3600.0


@dataclass
class _Spare:
    name: str
    worker: Worker
    ready: Path
    started: float
    kind: str = "worker"
    """``worker`` (flexrun.train.spare) or ``agent`` (flexrun.agent.warm_agent)."""
    socket: Path | None = None
    """An agent's own socket, where the ``flexrun run`` client hands itself over."""
    agent_fd: int | None = None
    """pidfd of who took it: the agent (a worker spare), or the ``flexrun run`` client (an
    agent)."""

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
        agents: int = 0,
    ) -> None:
        if not 1 <= count <= MAX_TAKE:
            raise ConfigError(f"--count {count}: must be 1-{MAX_TAKE}")
        if not 0 <= agents <= MAX_TAKE:
            raise ConfigError(f"--agents {agents}: must be 0-{MAX_TAKE}")
        if refill_delay_s < 0:
            raise ConfigError(f"--refill-delay {refill_delay_s:g}: must not be negative")
        self.root = root
        self.count = count
        self.targets = {"worker": count, "agent": agents}
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
                    "%s spare %s exited with %d before it was taken (retry in %.0f s); stderr: %s",
                    s.kind,
                    s.name,
                    rc,
                    delay,
                    log_tail(s.worker.log_dir / "stderr.log", 400).strip() or "(empty)",
                )
                s.worker.close_files()
                if self._last_failed is not None:  # keep the latest failure's logs only
                    shutil.rmtree(self._last_failed, ignore_errors=True)
                self._last_failed = s.worker.log_dir
            elif self._boot_failures and s.ready.exists():
                self._boot_failures = 0
        for s in list(self.given):
            rc = s.proc.poll()
            if rc is not None:
                try:
                    write_record(
                        exit_record(self.root, s.name),
                        {"pid": s.proc.pid, "returncode": rc, "ended_at": time.time()},
                    )
                except OSError as exc:  # e.g. a full disk: the spare's own record may serve
                    log.error("exit status %d of pid %d not recorded: %s", rc, s.proc.pid, exc)
                self._forget(s)
            elif process_gone(s.agent_fd):
                # Its agent died: the spare should have gone with it (it watches the agent
                # once assigned; an unassigned one reads end of file). Make sure.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
        if now >= self._refill_at:
            for kind, target in self.targets.items():
                while sum(1 for s in self.idle if s.kind == kind) < target:
                    self.idle.append(self._start(kind))
        if now - self._pruned_at > 60:
            self._pruned_at = now
            self._prune()

    def _start(self, kind: str) -> _Spare:
        self._seq += 1
        name = f"{kind[0]}{os.getpid()}-{self._seq}"
        ready = self.root / "spares" / f"{name}.ready"
        ready.parent.mkdir(parents=True, exist_ok=True)
        env = dict(self.environ, FLEXRUN_SPARE_READY=str(ready))
        sock = None
        if kind == "agent":
            sock = self.root / "spares" / f"{name}.sock"
            env["FLEXRUN_WARM_AGENT_SOCKET"] = str(sock)
        module = "flexrun.agent.warm_agent" if kind == "agent" else "flexrun.train.spare"
        w = spawn_worker(
            [sys.executable, "-u", "-m", module],
            env,
            self.root / "spares" / name,
            rank=-1,
            local_rank=-1,
            stdin=subprocess.PIPE if kind == "worker" else subprocess.DEVNULL,
        )
        return _Spare(name, w, ready, time.time(), kind=kind, socket=sock)

    def _forget(self, s: _Spare) -> None:
        self.given.remove(s)
        s.ready.unlink(missing_ok=True)
        if s.agent_fd is not None:
            os.close(s.agent_fd)
        s.worker.close_files()
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
            send_json(conn, {"error": f"uid {uid} may not take spares of uid {os.getuid()}"})
            return
        req = json.loads(read_line(conn))
        op = req.get("op")
        if op == "status":
            send_json(conn, self.status())
            return
        if op not in ("take", "take_agent"):
            send_json(conn, {"error": f"unknown op {op!r}"})
            return
        if req.get("interpreter") != interpreter():
            send_json(
                conn,
                {
                    "error": f"these spares run {interpreter()}; "
                    f"the agent runs {req.get('interpreter')}: not taken"
                },
            )
            return
        if op == "take_agent":
            self._take_agent(conn, pid)
            return
        count = req.get("count")
        if not isinstance(count, int) or not 1 <= count <= MAX_TAKE:
            send_json(conn, {"error": f"count {count!r}: must be 1-{MAX_TAKE}"})
            return
        # Ready ones first; a booting one is still sooner than a process started now.
        workers = [s for s in self.idle if s.kind == "worker"]
        chosen = sorted(workers, key=lambda s: not s.ready.exists())[:count]
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
            assert s.proc.stdin is not None
            s.proc.stdin.close()  # the agent holds the only write end now
            self._hand_over(s, pid)
        if chosen:
            log.info("handed %d spare(s) to pid %d", len(chosen), pid)
        if sent < len(data):
            conn.sendall(data[sent:])

    def _take_agent(self, conn: socket.socket, pid: int) -> None:
        ready = [s for s in self.idle if s.kind == "agent" and s.ready.exists()]
        if not ready:
            send_json(conn, {"pid": 0})
            return
        s = ready[0]
        send_json(conn, {"pid": s.proc.pid, "name": s.name, "socket": str(s.socket)})
        s.ready.unlink(missing_ok=True)  # (the flag means "idle and ready")
        self._hand_over(s, pid)
        log.info("handed agent %s to `flexrun run` pid %d", s.name, pid)

    def _hand_over(self, s: _Spare, pid: int) -> None:
        """``s`` now belongs to process ``pid``; new idle ones start after the refill delay."""
        self.idle.remove(s)
        s.agent_fd = pidfd(pid)
        self.given.append(s)
        self._refill_at = max(self._refill_at, time.monotonic() + self.refill_delay_s)

    def status(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "ready": sum(1 for s in self.idle if s.kind == "worker" and s.ready.exists()),
            "booting": sum(1 for s in self.idle if not s.ready.exists()),
            "agents_ready": sum(1 for s in self.idle if s.kind == "agent" and s.ready.exists()),
            "handed_out": len(self.given),
            "interpreter": interpreter(),
        }

    def close(self) -> None:
        """Stop the idle spares; handed-out ones belong to their agents and live on."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            (self.root / SOCKET_NAME).unlink()
        for s in self.idle:
            reap(s.worker)
            s.ready.unlink(missing_ok=True)
            if s.socket is not None:
                s.socket.unlink(missing_ok=True)
            shutil.rmtree(s.worker.log_dir, ignore_errors=True)
        self.idle = []
        for s in self.given:
            if s.agent_fd is not None:
                os.close(s.agent_fd)
        self.given = []
