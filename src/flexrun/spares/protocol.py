"""What the warm interpreters' processes say to each other, and where they leave it.

Owns the wire and the files shared by the ``flexrun spares`` daemon, its clients (agents,
``flexrun run``), warm agents and the spares themselves: names (the socket, the environment
variables a spare is started with, the entry modules), the request and reply shapes (one
JSON object a line, validated on receipt: a line that is not an object, a field of the
wrong type, an oversized line or bytes that are not UTF-8 raise
:class:`~flexrun.errors.SparesProtocolError`, never anything else), the identity an
interpreter must share with whoever takes it, and exit records (their paths, written
atomically, read with validation).

JSON only: nothing read here is ever executed or unpickled. Standard library only (no
torch), so that every side can import it first. Who may talk at all is
:mod:`flexrun.spares.trust`'s concern.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexrun import __version__
from flexrun.errors import SparesProtocolError

SOCKET_NAME = "pool.sock"
MAX_TAKE = 256
MAX_LINE = 64 * 1024
"""Longest request to the daemon (bytes, newline included)."""
MAX_REPLY = 1024 * 1024
"""Longest reply from the daemon (``MAX_TAKE`` offers with long paths fit)."""
MAX_HANDOVER = 4 * 1024 * 1024
"""Longest hand-over of a ``flexrun run`` to a warm agent, or assignment of a spare: they
carry a whole environment (Linux caps argv and environment together at 2 MiB)."""
TAKE_TIMEOUT_S = 2.0
"""How long a client waits for the daemon's answer before it starts its workers itself (the
daemon answers in milliseconds; a stopped or starved one must not hold a start back)."""
REQUEST_TIMEOUT_S = 2.0
"""How long the daemon waits for a connection's request line."""
RECORD_WAIT_S = 1.0
"""How long an agent waits for an exit record after the process is gone."""

READY_ENV = "FLEXRUN_SPARE_READY"
"""Set for every spare: the file it writes (its pid) once its imports are done."""
EXIT_RECORD_ENV = "FLEXRUN_SPARE_EXIT_RECORD"
"""Set for a daemon's spares: where the spare records its own exit code once taken."""
AGENT_SOCKET_ENV = "FLEXRUN_WARM_AGENT_SOCKET"
"""Set for a warm agent: the socket it listens on for its ``flexrun run``."""
ZYGOTE_ROOT_ENV = "FLEXRUN_ZYGOTE_ROOT"
"""Set for a pool's fork server: the directory its spares' files go under."""
PRELOAD_ENV = "FLEXRUN_SPARE_PRELOAD"
"""Set for a pool's spares when the run names modules to pre-import (``--spare-preload``):
comma-separated module names, imported before the spare is ready."""
SPARE_MODULE = "flexrun.spares.spare"
FORK_SERVER_FLAG = "--fork-server"
"""``python -m flexrun.spares.spare --fork-server``: a pool's zygote (``spares.forks``)."""
WARM_AGENT_MODULE = "flexrun.warm_agent"

OPS = ("status", "take", "take_agent")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def interpreter() -> str:
    """What a spare and the agent taking it must share: the Python (and its environment,
    e.g. a virtualenv) and the flexrun version."""
    return f"{os.path.realpath(sys.executable)} prefix {sys.prefix} flexrun {__version__}"


def command(module: str) -> list[str]:
    """The command line of a spare of this interpreter running ``module``."""
    return [sys.executable, "-u", "-m", module]


def valid_name(name: object) -> str:
    """``name`` if it can name a spare's files (no separators, no dot files).

    Raises:
        SparesProtocolError: it cannot.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise SparesProtocolError(f"spare name {name!r}: expected 1-64 of [A-Za-z0-9_-]")
    return name


def exit_record(root: Path, name: str, *, own: bool = False) -> Path:
    """Where the daemon (or, with ``own``, the spare itself) writes a spare's exit status."""
    name = valid_name(name)
    return root / "exits" / (f"{name}.self.json" if own else f"{name}.json")


# -- framing --------------------------------------------------------------------------------
def encode(obj: Mapping[str, object]) -> bytes:
    return (json.dumps(dict(obj)) + "\n").encode()


def send_json(conn: socket.socket, obj: Mapping[str, object]) -> None:
    conn.sendall(encode(obj))


def send_with_fds(conn: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """Send ``data`` with ``fds`` attached to its first bytes, then the rest of it.

    The rest is sent only when there is some: a peer that took the whole message at once may
    answer and close before this returns, and a send of nothing to a closed peer fails with
    EPIPE although everything arrived.
    """
    sent = socket.send_fds(conn, [data], list(fds)) if fds else conn.send(data)
    if sent < len(data):
        conn.sendall(data[sent:])


def read_line(conn: socket.socket, limit: int = MAX_LINE, head: bytes = b"") -> bytes:
    """One line from ``conn`` (after ``head``, already received): up to and including the
    newline, or what came before the end of the stream (b"" when nothing did).

    Raises:
        SparesProtocolError: the line is longer than ``limit``.
        OSError: the connection failed or timed out.
    """
    data = head
    while b"\n" not in data:
        if len(data) > limit:
            break
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    line = data.split(b"\n", 1)[0] + (b"\n" if b"\n" in data else b"")
    if len(line) > limit:
        raise SparesProtocolError(f"message over {limit} bytes")
    return line


def recv_line_with_fds(conn: socket.socket, limit: int, max_fds: int) -> tuple[bytes, list[int]]:
    """One line and the descriptors that came with its first bytes (``SCM_RIGHTS``); on any
    error the descriptors are closed before it is raised.

    Raises:
        SparesProtocolError: too long, or more descriptors than ``max_fds`` were sent.
        OSError: the connection failed or timed out.
    """
    data, fds, flags, _ = socket.recv_fds(conn, 65536, max_fds)
    try:
        if flags & socket.MSG_CTRUNC:
            raise SparesProtocolError(f"more than {max_fds} descriptors sent")
        return read_line(conn, limit, head=data), fds
    except BaseException:
        close_fds(fds)
        raise


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def decode_object(line: bytes, what: str) -> dict[str, Any]:
    """The JSON object on ``line``.

    Raises:
        SparesProtocolError: not UTF-8, not JSON, not an object (or nested past Python's
            recursion limit).
    """
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SparesProtocolError(f"{what}: not a JSON line ({type(exc).__name__})") from exc
    if not isinstance(obj, dict):
        raise SparesProtocolError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _field(obj: Mapping[str, Any], key: str, kind: type, what: str, default: Any = ...) -> Any:
    value = obj.get(key, default)
    if value is ...:
        raise SparesProtocolError(f"{what}: {key!r} is missing")
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok and value is not default:
        raise SparesProtocolError(f"{what}: {key!r} must be {kind.__name__}, got {value!r:.60}")
    return value


def _strings(obj: Mapping[str, Any], key: str, what: str) -> tuple[str, ...]:
    value = _field(obj, key, list, what)
    if not all(isinstance(v, str) for v in value):
        raise SparesProtocolError(f"{what}: {key!r} must be a list of strings")
    return tuple(value)


def _environ(obj: Mapping[str, Any], what: str) -> dict[str, str]:
    value = _field(obj, "env", dict, what)
    if not all(isinstance(v, str) for v in value.values()):
        raise SparesProtocolError(f"{what}: 'env' must map names to strings")
    return dict(value)


def _count(obj: Mapping[str, Any], key: str, what: str) -> int:
    value: int = _field(obj, key, int, what)
    if value < 0:
        raise SparesProtocolError(f"{what}: {key!r} must not be negative")
    return value


def _below(root: Path, value: object, key: str, what: str) -> Path:
    if not isinstance(value, str) or not os.path.isabs(value):
        raise SparesProtocolError(f"{what}: {key!r} must be an absolute path")
    path = Path(value)
    if not path.resolve().is_relative_to(root.resolve()):
        raise SparesProtocolError(f"{what}: {key!r} {value!r} is outside {root}")
    return path


# -- client -> daemon -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One request to the daemon."""

    op: str
    """``status`` (counts), ``take`` (worker spares) or ``take_agent`` (one warm agent)."""
    count: int = 0
    """Spares wanted (``take``): 1 to ``MAX_TAKE``."""
    interpreter: str = ""
    """The taker's :func:`interpreter` (``take``, ``take_agent``)."""

    def encode(self) -> bytes:
        return encode({"op": self.op, "count": self.count, "interpreter": self.interpreter})


def parse_request(line: bytes) -> Request:
    """Raises:
    SparesProtocolError: not a valid request (the message says why, for the reply)."""
    what = "request"
    obj = decode_object(line, what)
    op = _field(obj, "op", str, what)
    if op not in OPS:
        raise SparesProtocolError(f"unknown op {op!r:.40}: expected one of {', '.join(OPS)}")
    if op == "status":
        return Request(op=op)
    interp = _field(obj, "interpreter", str, what)
    count = 1
    if op == "take":
        count = _field(obj, "count", int, what)
        if not 1 <= count <= MAX_TAKE:
            raise SparesProtocolError(f"count {count}: must be 1-{MAX_TAKE}")
    return Request(op=op, count=count, interpreter=interp)


# -- daemon -> client -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class SpareOffer:
    """A worker spare handed out (its stdin travels beside the reply)."""

    pid: int
    name: str
    ready: Path
    log_dir: Path

    def as_dict(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "name": self.name,
            "ready": str(self.ready),
            "log_dir": str(self.log_dir),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentOffer:
    """A warm agent handed out: the client connects to ``socket`` and hands itself over."""

    pid: int
    name: str
    socket: Path

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "name": self.name, "socket": str(self.socket)}


def parse_reply(line: bytes) -> tuple[dict[str, Any], str | None]:
    """The daemon's reply and, when it is a refusal, its message.

    Raises:
        SparesProtocolError: not a reply.
    """
    obj = decode_object(line, "reply")
    error = _field(obj, "error", str, "reply", None)
    return obj, error


def _offer_fields(obj: object, root: Path, key: str) -> tuple[int, str, Path]:
    what = "offer"
    if not isinstance(obj, dict):
        raise SparesProtocolError(f"{what}: expected a JSON object")
    pid = _field(obj, "pid", int, what)
    if pid <= 0:
        raise SparesProtocolError(f"{what}: pid {pid} is not a process")
    return pid, valid_name(obj.get("name")), _below(root, obj.get(key), key, what)


def parse_spare_offers(reply: Mapping[str, Any], root: Path) -> list[SpareOffer]:
    """Raises:
    SparesProtocolError: not a list of offers for spares below ``root``."""
    spares = _field(reply, "spares", list, "reply")
    out = []
    for s in spares:
        pid, name, ready = _offer_fields(s, root, "ready")
        log_dir = _below(root, s.get("log_dir"), "log_dir", "offer")
        out.append(SpareOffer(pid=pid, name=name, ready=ready, log_dir=log_dir))
    return out


def parse_agent_offer(reply: Mapping[str, Any], root: Path) -> AgentOffer | None:
    """None when the daemon has no warm agent ready (``{"pid": 0}``).

    Raises:
        SparesProtocolError: not an agent offer below ``root``.
    """
    if _field(reply, "pid", int, "reply") == 0:
        return None
    pid, name, path = _offer_fields(reply, root, "socket")
    return AgentOffer(pid=pid, name=name, socket=path)


STATUS_COUNTS = ("ready", "booting", "agents_ready", "handed_out")


def parse_status(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The daemon's counts, checked.

    Raises:
        SparesProtocolError: a count is missing or not a number of spares.
    """
    out: dict[str, Any] = {k: _count(reply, k, "status") for k in ("pid", *STATUS_COUNTS)}
    out["interpreter"] = _field(reply, "interpreter", str, "status")
    return out


# -- client -> warm agent, agent -> spare ---------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Handover:
    """What a ``flexrun run`` hands a warm agent (with its stdin, stdout, stderr): the agent
    then is that ``flexrun run``. Its pid is read from the socket, never from here."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str

    def encode(self) -> bytes:
        return encode({"argv": list(self.argv), "env": dict(self.env), "cwd": self.cwd})


def parse_handover(line: bytes) -> Handover:
    """Raises:
    SparesProtocolError: not a hand-over."""
    what = "hand-over"
    obj = decode_object(line, what)
    return Handover(
        argv=_strings(obj, "argv", what), env=_environ(obj, what), cwd=_field(obj, "cwd", str, what)
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """What turns a spare into a worker (one line on its stdin)."""

    entry: str
    """Script path, or module name with ``module``."""
    args: tuple[str, ...]
    module: bool
    env: Mapping[str, str]
    """The worker's whole environment (it replaces the spare's)."""
    cwd: str
    stdout: str | None = None
    """Its rank's log file (appended); None: keep the spare's own."""
    stderr: str | None = None
    agent_pid: int | None = None
    """Set for a spare the agent did not start: die with that pid instead of the parent."""
    private_output: bool = False
    """``stdout``/``stderr`` that are FIFOs are the agent's private ones
    (``proc.drain.output_paths``): remove them, and their directory, once open."""

    def encode(self) -> bytes:
        return encode(
            {
                "entry": self.entry,
                "args": list(self.args),
                "module": self.module,
                "env": dict(self.env),
                "cwd": self.cwd,
                "stdout": self.stdout,
                "stderr": self.stderr,
                "agent_pid": self.agent_pid,
                "private_output": self.private_output,
            }
        )


def parse_assignment(line: bytes) -> Assignment:
    """Raises:
    SparesProtocolError: not an assignment."""
    what = "assignment"
    obj = decode_object(line, what)
    agent_pid = _field(obj, "agent_pid", int, what, None)
    return Assignment(
        entry=_field(obj, "entry", str, what),
        args=_strings(obj, "args", what),
        module=_field(obj, "module", bool, what),
        env=_environ(obj, what),
        cwd=_field(obj, "cwd", str, what),
        stdout=_field(obj, "stdout", str, what, None),
        stderr=_field(obj, "stderr", str, what, None),
        agent_pid=agent_pid if agent_pid else None,
        private_output=_field(obj, "private_output", bool, what, False),
    )


# -- exit records ---------------------------------------------------------------------------
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
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(dict(data)))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def record_exit(path: str | Path, returncode: int) -> None:
    """This process's own exit record (best effort: a full disk must not change how the
    script ended, so a failure is one line on stderr)."""
    try:
        write_record(Path(path), {"pid": os.getpid(), "returncode": returncode})
    except OSError as exc:
        print(f"flexrun: exit code {returncode} not recorded: {exc}", file=sys.stderr)


def read_returncode(path: Path) -> int | None:
    """The ``returncode`` of the exit record at ``path``; None when there is none, or it is
    not one (a partial or foreign file is never trusted, and never more than JSON)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        obj = decode_object(raw, "exit record")
        rc: int = _field(obj, "returncode", int, "exit record")
    except SparesProtocolError:
        return None
    return rc
