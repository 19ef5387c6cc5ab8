"""The agent's side of a node's ``flexrun spares``: taking warm interpreters from it.

Owns the client of the daemon's socket (``take_spares``, ``query_status``), the handle of
a process the agent did not start (:class:`AdoptedProcess`: a pidfd for its exit, exit
records for its status) and the names both sides share. The daemon itself is
:mod:`flexrun.agent.nodepool`; this module stays light (no torch) so that an agent or a
``flexrun run`` client can import it before anything heavy.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from flexrun import __version__
from flexrun.errors import ConfigError
from flexrun.proc import Worker

log = logging.getLogger("flexrun.spares")

SOCKET_NAME = "pool.sock"
MAX_TAKE = 256
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


def pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def process_gone(fd: int | None) -> bool:
    """True once the process behind pidfd ``fd`` (None: already gone) has exited."""
    if fd is None:
        return True
    return bool(select.select([fd], [], [], 0)[0])


class AdoptedProcess:
    """A handed-out spare as the agent sees it: what the agent uses of ``subprocess.Popen``
    (``pid``, ``stdin``, ``returncode``, ``poll``, ``wait``) for a process it did not start.
    Exit is seen through a pidfd; the status comes from the daemon's (or the spare's own)
    exit record."""

    def __init__(self, pid: int, name: str, stdin: IO[bytes] | None, root: Path) -> None:
        self.pid = pid
        self.name = name
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None
        self.root = root
        self._fd = pidfd(pid)
        self._gone_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not process_gone(self._fd):
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


def query_status(root: Path) -> dict[str, Any]:
    """The daemon's counts (ready, booting, handed_out, agents_ready).

    Raises:
        ConfigError: no daemon serves ``root`` (or it does not answer).
    """
    try:
        reply = _request(root, {"op": "status"})
    except OSError as exc:
        raise ConfigError(f"`flexrun spares` in {root} did not answer: {exc}") from exc
    if reply is None:
        raise ConfigError(f"no `flexrun spares` serves {root}")
    return reply


def read_line(conn: socket.socket, limit: int = 65536) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError("request too long")
    return data


def send_json(conn: socket.socket, obj: Mapping[str, object]) -> None:
    conn.sendall((json.dumps(dict(obj)) + "\n").encode())


def exit_code_of(code: object) -> int:
    """The status ``sys.exit(code)`` ends the process with."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def write_record(path: Path, data: Mapping[str, object]) -> None:
    """Write an exit record atomically (a reader sees all of it or nothing).

    Raises:
        OSError: the write failed (e.g. a full disk).
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(data)))
    os.replace(tmp, path)


def record_exit(path: str, returncode: int) -> None:
    """This process's own exit record (best effort)."""
    try:
        write_record(Path(path), {"pid": os.getpid(), "returncode": returncode})
    except OSError as exc:  # (a full disk must not change how the script ended)
        print(f"flexrun: exit code {returncode} not recorded: {exc}", file=sys.stderr)


def die_with(agent_pid: int) -> None:
    """Die (with everything in this session) when ``agent_pid`` exits, not when the daemon
    that started this process does: the agent (or client) that took it owns it now."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none (it named the daemon)
    try:
        fd = os.pidfd_open(agent_pid)
    except ProcessLookupError:
        os.killpg(0, signal.SIGKILL)  # the agent is already gone
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="flexrun-agent-watch", daemon=True).start()


def run_in_warm_agent(root: Path, argv: list[str]) -> int | None:
    """Run ``flexrun <argv>`` in a warm agent of the daemon serving ``root`` and return its
    exit code; None when there is none to take (the caller then runs the agent itself).

    This process becomes a relay: the agent writes to this process's stdout and stderr,
    gets the signals this process gets (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2), and
    dies with it."""
    try:
        offer = _request(root, {"op": "take_agent", "interpreter": interpreter()})
    except OSError as exc:
        log.warning("could not take a warm agent from %s: %s", root, exc)
        return None
    if offer is None or "error" in offer or not offer.get("pid"):
        if offer is not None and "error" in offer:
            log.warning("`flexrun spares` in %s: %s", root, offer["error"])
        return None
    pid, name = int(offer["pid"]), str(offer["name"])
    proc = AdoptedProcess(pid, name, None, root)
    req = {
        "argv": argv,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "client_pid": os.getpid(),
        "exit_record": str(exit_record(root, name, own=True)),
    }
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TAKE_TIMEOUT_S)
            sock.connect(str(offer["socket"]))
            socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], [0, 1, 2])
            if read_line(sock).strip() != b"ok":
                raise OSError("the warm agent did not accept")
    except OSError as exc:
        log.warning("warm agent pid %d not usable (%s): starting the agent here", pid, exc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        proc.wait()
        return None

    def relay(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, relay)
    rc = proc.wait()
    return 128 - rc if rc < 0 else rc


def _request(root: Path, req: Mapping[str, object]) -> dict[str, Any] | None:
    """One request to the daemon serving ``root`` and its answer; None when none serves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TAKE_TIMEOUT_S)
        try:
            sock.connect(str(root / SOCKET_NAME))
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        send_json(sock, req)
        try:
            reply: dict[str, Any] = json.loads(read_line(sock))
        except ValueError as exc:
            raise OSError(f"unreadable reply: {exc}") from exc
        return reply
