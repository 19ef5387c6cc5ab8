"""A node's warm interpreters that outlive its agents: the ``flexrun spares`` daemon.

Owns the node side of warm spares that exist before any agent: a daemon started with the
node (a standby node, a pod's sidecar) keeps ``count`` idle ``python -m
flexrun.spares.spare`` processes (and ``agents`` idle ``python -m flexrun.warm_agent``),
with Python and torch already imported, and hands them to processes of its own uid that
ask through ``DIR/pool.sock`` (:mod:`flexrun.spares.listener`; every request is validated
and a bad one is answered with an error, never a crash). An agent started on that node
then skips the interpreter and ``import torch`` (seconds of CPU per process) for
its first workers, and a restarted agent (kill -9, a container restart) finds its
replacements warm. ``DIR`` is created mode 0700, or must already be so and this user's.

A handed-out spare stays this daemon's child (only a parent can reap), so:
- its stdin (the assignment channel) is passed to the agent over the socket
  (``SCM_RIGHTS``) and the daemon closes its own copy;
- the daemon reaps it and writes its exit status to ``exits/<name>.json``, which the
  agent's :class:`~flexrun.spares.adopted.AdoptedProcess` reads; the spare also records its
  own exit code, so a worker still gets a status when the daemon itself is gone;
- it dies with the agent that took it (the spare watches the agent's pid once assigned;
  the daemon also kills it when that agent is gone).

It does not know rounds, ranks or stores; the agent's pool decides when to take.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError, SparesProtocolError
from flexrun.proc import Worker, log_tail, reap, spawn_worker
from flexrun.spares.adopted import pidfd, process_gone
from flexrun.spares.listener import Incoming, Listener
from flexrun.spares.protocol import (
    AGENT_SOCKET_ENV,
    EXIT_RECORD_ENV,
    MAX_TAKE,
    READY_ENV,
    SOCKET_NAME,
    SPARE_MODULE,
    WARM_AGENT_MODULE,
    AgentOffer,
    Request,
    SpareOffer,
    command,
    encode,
    exit_record,
    interpreter,
    parse_request,
    send_json,
    send_with_fds,
    write_record,
)
from flexrun.spares.trust import check_dir

log = logging.getLogger("flexrun.spares")

# A spare that dies while importing is retried after this long, doubling up to the cap.
BOOT_RETRY_S = (1.0, 60.0)
# Exit records older than this are removed (their agent never read them).
RECORD_TTL_S = 3600.0
KINDS = ("worker", "agent")


@dataclass
class _Spare:
    name: str
    worker: Worker
    ready: Path
    kind: str = "worker"
    """``worker`` (a spare) or ``agent`` (a warm agent)."""
    socket: Path | None = None
    """An agent's own socket, where the ``flexrun run`` client hands itself over."""
    owner_fd: int | None = None
    """pidfd of who took it: the agent (a worker spare), or the ``flexrun run`` client (an
    agent)."""

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        p = self.worker.proc
        assert isinstance(p, subprocess.Popen)
        return p

    @property
    def is_ready(self) -> bool:
        return self.ready.exists()


class SparesDaemon:
    """Keeps ``count`` idle spares (and ``agents`` warm agents) in ``root`` and serves them
    on ``root/pool.sock``.

    Raises (from the constructor):
        ConfigError: bad count, or another daemon already serves ``root``.
        SparesUntrusted: ``root`` is not a directory only this user can enter (or a
            process of another uid serves its socket).
    """

    def __init__(
        self,
        root: Path,
        count: int,
        *,
        environ: Mapping[str, str],
        refill_delay_s: float = 5.0,
        agents: int = 0,
        commands: Mapping[str, Sequence[str]] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not 1 <= count <= MAX_TAKE:
            raise ConfigError(f"--count {count}: must be 1-{MAX_TAKE}")
        if not 0 <= agents <= MAX_TAKE:
            raise ConfigError(f"--agents {agents}: must be 0-{MAX_TAKE}")
        if not 0 <= refill_delay_s < float("inf"):  # (NaN too)
            raise ConfigError(f"--refill-delay {refill_delay_s:g}: must be a finite 0 or more")
        self.root = root
        self.count = count
        self.targets = {"worker": count, "agent": agents}
        self.commands = {
            "worker": command(SPARE_MODULE),
            "agent": command(WARM_AGENT_MODULE),
            **{k: list(v) for k, v in (commands or {}).items()},
        }
        self.refill_delay_s = refill_delay_s
        self.environ = dict(environ)
        # Live workers' bounded store waits expire on purpose; c10d reads this at import.
        self.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        self.idle: list[_Spare] = []
        self.given: list[_Spare] = []
        self._clock = clock
        self._seq = 0
        self._refill_at = 0.0
        self._boot_failures = 0
        self._pruned_at = clock.monotonic()
        self._last_failed: Path | None = None
        check_dir(root, create=True)
        for sub in ("exits", "spares"):
            (root / sub).mkdir(mode=0o700, exist_ok=True)
        self.listener = Listener(root / SOCKET_NAME, clock=clock)

    # -- the loop ---------------------------------------------------------------------------
    def serve(self, stopped: Callable[[], bool], tick_s: float = 0.05) -> None:
        """Serve until ``stopped()``; then :meth:`close`."""
        try:
            while not stopped():
                self.tick()
                for incoming in self.listener.poll(tick_s):
                    self.handle(incoming)
        finally:
            self.close()

    def tick(self) -> None:
        """Reap, write exit records, enforce owners' deaths, refill."""
        now = self._clock.monotonic()
        for s in list(self.idle):
            rc = s.proc.poll()
            if rc is not None:
                self._boot_failed(s, rc, now)
            elif self._boot_failures and s.is_ready:
                self._boot_failures = 0
        for s in list(self.given):
            rc = s.proc.poll()
            if rc is not None:
                self._ended(s, rc)
            elif process_gone(s.owner_fd):
                # Its owner died: the spare should have gone with it (it watches the owner
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

    def _boot_failed(self, s: _Spare, rc: int, now: float) -> None:
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

    def _ended(self, s: _Spare, rc: int) -> None:
        record = {"pid": s.proc.pid, "returncode": rc, "ended_at": self._clock.wall()}
        try:
            write_record(exit_record(self.root, s.name), record)
        except OSError as exc:  # e.g. a full disk: the spare's own record may serve
            log.error("exit status %d of pid %d not recorded: %s", rc, s.proc.pid, exc)
        self.given.remove(s)
        s.ready.unlink(missing_ok=True)
        if s.owner_fd is not None:
            os.close(s.owner_fd)
        s.worker.close_files()
        # Its output moved to its rank's log directory when it was assigned.
        shutil.rmtree(s.worker.log_dir, ignore_errors=True)

    def _start(self, kind: str) -> _Spare:
        self._seq += 1
        name = f"{kind[0]}{os.getpid()}-{self._seq}"
        spares = self.root / "spares"
        ready = spares / f"{name}.ready"
        env = dict(self.environ)
        env[READY_ENV] = str(ready)
        env[EXIT_RECORD_ENV] = str(exit_record(self.root, name, own=True))
        sock = None
        if kind == "agent":
            sock = spares / f"{name}.sock"
            env[AGENT_SOCKET_ENV] = str(sock)
        w = spawn_worker(
            self.commands[kind],
            env,
            spares / name,
            rank=-1,
            local_rank=-1,
            stdin=subprocess.PIPE if kind == "worker" else subprocess.DEVNULL,
        )
        return _Spare(name, w, ready, kind=kind, socket=sock)

    def _prune(self) -> None:
        cutoff = self._clock.wall() - RECORD_TTL_S
        for f in (self.root / "exits").iterdir():
            with contextlib.suppress(FileNotFoundError):
                if f.stat().st_mtime < cutoff:
                    f.unlink()

    # -- requests ---------------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        """Answer one request (a malformed one with an error); never raises for what the
        peer sent or did."""
        with incoming.conn as conn:
            try:
                self._answer(conn, incoming.pid, parse_request(incoming.line))
            except SparesProtocolError as exc:
                log.warning("bad request from pid %d: %s", incoming.pid, exc)
                with contextlib.suppress(OSError):
                    send_json(conn, {"error": str(exc)})
            except OSError as exc:
                log.warning("a request of pid %d failed: %s", incoming.pid, exc)

    def _answer(self, conn: socket.socket, pid: int, req: Request) -> None:
        if req.op == "status":
            send_json(conn, self.status())
            return
        if req.interpreter != interpreter():
            raise SparesProtocolError(
                f"these spares run {interpreter()}; the agent runs {req.interpreter:.300}: "
                "not taken"
            )
        if req.op == "take_agent":
            self._take_agent(conn, pid)
        else:
            self._take(conn, pid, req.count)

    def _take(self, conn: socket.socket, pid: int, count: int) -> None:
        # Ready ones first; a booting one is still sooner than a process started now.
        workers = [s for s in self.idle if s.kind == "worker"]
        chosen = sorted(workers, key=lambda s: not s.is_ready)[:count]
        fds = []
        for s in chosen:
            assert s.proc.stdin is not None
            fds.append(s.proc.stdin.fileno())
        offers = [
            SpareOffer(pid=s.proc.pid, name=s.name, ready=s.ready, log_dir=s.worker.log_dir)
            for s in chosen
        ]
        send_with_fds(conn, encode({"spares": [o.as_dict() for o in offers]}), fds)
        # The channels went with the first byte: from here on the agent holds them.
        for s in chosen:
            assert s.proc.stdin is not None
            s.proc.stdin.close()  # the agent holds the only write end now
            self._hand_over(s, pid)
        if chosen:
            log.info("handed %d spare(s) to pid %d", len(chosen), pid)

    def _take_agent(self, conn: socket.socket, pid: int) -> None:
        ready = [s for s in self.idle if s.kind == "agent" and s.is_ready]
        if not ready:
            send_json(conn, {"pid": 0})
            return
        s = ready[0]
        assert s.socket is not None
        send_json(conn, AgentOffer(pid=s.proc.pid, name=s.name, socket=s.socket).as_dict())
        s.ready.unlink(missing_ok=True)  # (the flag means "idle and ready")
        self._hand_over(s, pid)
        log.info("handed agent %s to `flexrun run` pid %d", s.name, pid)

    def _hand_over(self, s: _Spare, pid: int) -> None:
        """``s`` now belongs to process ``pid``; new idle ones start after the refill delay."""
        self.idle.remove(s)
        s.owner_fd = pidfd(pid)
        self.given.append(s)
        self._refill_at = max(self._refill_at, self._clock.monotonic() + self.refill_delay_s)

    def status(self) -> dict[str, object]:
        def idle(kind: str | None, ready: bool) -> int:
            return sum(1 for s in self.idle if kind in (None, s.kind) and s.is_ready == ready)

        return {
            "pid": os.getpid(),
            "ready": idle("worker", True),
            "booting": idle(None, False),
            "agents_ready": idle("agent", True),
            "handed_out": len(self.given),
            "interpreter": interpreter(),
        }

    def close(self) -> None:
        """Stop the idle spares; handed-out ones belong to their agents and live on."""
        self.listener.close()
        for s in self.idle:
            reap(s.worker)
            s.ready.unlink(missing_ok=True)
            if s.socket is not None:
                s.socket.unlink(missing_ok=True)
            shutil.rmtree(s.worker.log_dir, ignore_errors=True)
        self.idle = []
        for s in self.given:
            if s.owner_fd is not None:
                os.close(s.owner_fd)
        self.given = []
