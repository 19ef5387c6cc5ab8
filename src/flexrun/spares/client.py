"""The taking side of a node's ``flexrun spares``: agents and ``flexrun run`` ask its daemon.

Owns the client of the daemon's socket: :func:`take_spares` (worker spares for an agent's
pool), :func:`query_status` (``flexrun spares --status``) and :func:`run_in_warm_agent`
(a ``flexrun run`` hands itself over to a warm agent and waits as its relay). Before a
byte is sent, the directory and every socket's server are checked to be this user's own
(:mod:`flexrun.spares.trust`): argv, environment and descriptors never reach a socket
another user planted. What is received is validated (:mod:`flexrun.spares.protocol`).

Refusals are :class:`~flexrun.errors.SparesUntrusted` (one line, exit 2 at the CLI); a
daemon that is absent or does not answer is not an error: the caller starts its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexrun.errors import ConfigError, SparesProtocolError, SparesUntrusted
from flexrun.proc import Worker
from flexrun.spares.adopted import AdoptedProcess
from flexrun.spares.lifeline import relay_signals
from flexrun.spares.protocol import (
    MAX_REPLY,
    MAX_TAKE,
    SOCKET_NAME,
    TAKE_TIMEOUT_S,
    Handover,
    Request,
    close_fds,
    interpreter,
    parse_agent_offer,
    parse_reply,
    parse_spare_offers,
    parse_status,
    read_line,
    recv_line_with_fds,
    send_with_fds,
)
from flexrun.spares.trust import check_dir, connect

log = logging.getLogger("flexrun.spares")


@dataclass(frozen=True)
class Adopted:
    """A spare taken from the daemon: the worker handle and its ready file."""

    worker: Worker
    ready: Path


def _connect(root: Path) -> socket.socket | None:
    """A connection to the daemon serving ``root``, checked; None when none serves it.

    Raises:
        SparesUntrusted: ``root`` or its daemon is not this user's alone.
        OSError: the connection failed.
    """
    if not check_dir(root):
        return None
    path = root / SOCKET_NAME
    return connect(path, str(path), TAKE_TIMEOUT_S)


def take_spares(root: Path, count: int) -> list[Adopted]:
    """Up to ``count`` spares from the daemon serving ``root``; [] when none serves it (or
    it refuses: a warning says why).

    Raises:
        SparesUntrusted: ``root`` or its daemon is not this user's alone (nothing was sent).
        SparesProtocolError: the daemon answered something malformed.
        OSError: the daemon did not answer within ``TAKE_TIMEOUT_S`` (e.g. it is stopped).
    """
    sock = _connect(root)
    if sock is None:
        log.debug("no `flexrun spares` serves %s", root)
        return []
    with sock:
        sock.sendall(Request(op="take", count=count, interpreter=interpreter()).encode())
        data, fds = recv_line_with_fds(sock, MAX_REPLY, MAX_TAKE)
    try:
        reply, error = parse_reply(data)
        if error is not None:
            log.warning("`flexrun spares` in %s: %s", root, error)
            close_fds(fds)
            return []
        offers = parse_spare_offers(reply, root)
        if len(offers) != len(fds):
            raise SparesProtocolError(f"{len(offers)} spares but {len(fds)} channels")
    except SparesProtocolError:
        close_fds(fds)
        raise
    out = []
    for offer, fd in zip(offers, fds, strict=True):
        proc = AdoptedProcess(offer.pid, offer.name, os.fdopen(fd, "wb"), root)
        w = Worker(-1, -1, proc, offer.log_dir, offer.log_dir / "error.json")
        out.append(Adopted(w, offer.ready))
    return out


def _request(root: Path, req: Request) -> tuple[dict[str, Any], str | None] | None:
    """One request to the daemon serving ``root`` and its reply (and refusal message);
    None when none serves it.

    Raises:
        SparesUntrusted, SparesProtocolError, OSError: as :func:`take_spares`.
    """
    sock = _connect(root)
    if sock is None:
        return None
    with sock:
        sock.sendall(req.encode())
        return parse_reply(read_line(sock, MAX_REPLY))


def query_status(root: Path) -> dict[str, Any]:
    """The daemon's counts (pid, ready, booting, agents_ready, handed_out, interpreter).

    Raises:
        ConfigError: no daemon serves ``root`` (or it does not answer).
        SparesUntrusted: ``root`` or its daemon is not this user's alone.
        SparesProtocolError: the daemon answered something malformed.
    """
    try:
        answer = _request(root, Request(op="status"))
    except OSError as exc:
        raise ConfigError(f"`flexrun spares` in {root} did not answer: {exc}") from exc
    if answer is None:
        raise ConfigError(f"no `flexrun spares` serves {root}")
    reply, error = answer
    if error is not None:
        raise ConfigError(f"`flexrun spares` in {root}: {error}")
    return parse_status(reply)


def run_in_warm_agent(root: Path, argv: list[str]) -> int | None:
    """Run ``flexrun <argv>`` in a warm agent of the daemon serving ``root`` and return its
    exit code; None when there is none to take (the caller then runs the agent itself).

    This process becomes a relay: the agent writes to this process's stdout and stderr,
    gets the signals this process gets (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2), and
    dies with it.

    Raises:
        SparesUntrusted: ``root``, its daemon or the offered agent's socket is not this
            user's alone: nothing (argv, environment, descriptors) was sent to it.
    """
    try:
        answer = _request(root, Request(op="take_agent", interpreter=interpreter()))
        if answer is None:
            return None
        reply, error = answer
        if error is not None:
            log.warning("`flexrun spares` in %s: %s", root, error)
            return None
        offer = parse_agent_offer(reply, root)
    except (OSError, SparesProtocolError) as exc:
        log.warning("could not take a warm agent from %s: %s", root, exc)
        return None
    if offer is None:
        return None
    proc = AdoptedProcess(offer.pid, offer.name, None, root)
    handover = Handover(argv=tuple(argv), env=dict(os.environ), cwd=os.getcwd())
    try:
        what = f"warm agent socket {offer.socket}"
        sock = connect(offer.socket, what, TAKE_TIMEOUT_S, pid=offer.pid)
        if sock is None:
            raise OSError("nothing listens on its socket")
        with sock:
            data = handover.encode()
            send_with_fds(sock, data, [0, 1, 2])
            if read_line(sock).strip() != b"ok":
                raise OSError("the warm agent did not accept")
    except SparesUntrusted:
        raise  # (the daemon stops the real one once this process is gone)
    except (OSError, SparesProtocolError) as exc:
        log.warning("warm agent pid %d not usable (%s): starting the agent here", offer.pid, exc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(offer.pid, signal.SIGKILL)
        proc.wait()
        return None
    relay_signals(offer.pid)
    rc = proc.wait()
    return 128 - rc if rc < 0 else rc
