"""The pool's side of its fork server (:mod:`flexrun.spares.forks`), and when to use it.

Owns starting the zygote (``python -m flexrun.spares.spare --fork-server``: a session of
its own that dies with the agent), asking it for spares (each answered in milliseconds
with the new spare's pid and assignment channel) and the pure choice of how a refill gets its spares
(:func:`plan_refill`): forked while the zygote is ready, none while it is still importing
(it will be ready before a spare started now, and one import is all a pool pays), started
fresh when it is gone. A forked spare is not the agent's child: it is seen through
:class:`~flexrun.spares.adopted.AdoptedProcess`, its status through the zygote's records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flexrun.errors import SparesError
from flexrun.proc import Worker, log_tail, reap, spawn_worker
from flexrun.spares.adopted import AdoptedProcess
from flexrun.spares.protocol import (
    FORK_SERVER_FLAG,
    MAX_LINE,
    READY_ENV,
    SPARE_MODULE,
    ZYGOTE_ROOT_ENV,
    command,
    decode_object,
    encode,
    recv_line_with_fds,
)

log = logging.getLogger("flexrun.spares")

FORK_TIMEOUT_S = 5.0
"""How long one fork request may take (a fork of a torch interpreter takes tens of milliseconds;
this bounds a stuck zygote, not a slow one)."""

BOOTING, READY, GONE = "booting", "ready", "gone"


@dataclass(frozen=True, kw_only=True, slots=True)
class Refill:
    """How many spares a refill forks and how many it starts fresh."""

    forks: int = 0
    fresh: int = 0


def plan_refill(
    missing: int, *, booting: int, max_booting: int | None, zygote: str | None
) -> Refill:
    """The refill of a pool ``missing`` spares short, ``booting`` of its spares still
    importing, with at most ``max_booting`` importing at once (None: no limit) and its
    zygote ``BOOTING``, ``READY``, ``GONE`` (or None: the pool has none)."""
    missing = max(0, missing)
    if zygote == READY:
        return Refill(forks=missing)  # (a fork imports nothing: no batch limit)
    if zygote == BOOTING:
        return Refill()
    if max_booting is not None:
        missing = min(missing, max(0, max_booting - booting))
    return Refill(fresh=missing)


class ForkServer:
    """One pool's zygote: started at once, asked with :meth:`fork`."""

    def __init__(
        self,
        environ: Mapping[str, str],
        root: Path,
        *,
        zygote_command: Sequence[str] | None = None,
    ) -> None:
        self.root = root
        # (Not ``*.ready``: those are idle spares' flags, counted by whoever watches a pool.)
        self.ready_file = root / "fork-server.pid"
        self.ready_file.unlink(missing_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        env = dict(environ)
        env[READY_ENV] = str(self.ready_file)
        env[ZYGOTE_ROOT_ENV] = str(root)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.worker: Worker | None = spawn_worker(
                list(zygote_command or [*command(SPARE_MODULE), FORK_SERVER_FLAG]),
                env,
                root / "zygote",
                rank=-1,
                local_rank=-1,
                stdin=theirs.fileno(),
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(FORK_TIMEOUT_S)
        self.conn = ours

    @property
    def state(self) -> str:
        if self.worker is None or self.worker.proc.poll() is not None:
            return GONE
        return READY if self.ready_file.exists() else BOOTING

    def fork(self, name: str) -> Worker:
        """A new spare named ``name`` (its files ``ROOT/NAME/``, ``ROOT/NAME.ready``).

        Raises:
            SparesError: the zygote answered with an error or something malformed.
            OSError: it did not answer (gone, or not within ``FORK_TIMEOUT_S``).
        """
        self.conn.sendall(encode({"name": name}))
        data, fds = recv_line_with_fds(self.conn, MAX_LINE, 1)
        try:
            if not data:
                raise OSError("the zygote closed its socket")
            reply = decode_object(data, "fork reply")
            if "error" in reply or len(fds) != 1 or not isinstance(reply.get("pid"), int):
                raise SparesError(f"zygote: {reply.get('error', 'malformed reply')}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        proc = AdoptedProcess(reply["pid"], name, os.fdopen(fds[0], "wb"), self.root)
        return Worker(-1, -1, proc, self.root / name, self.root / name / "error.json")

    def why_gone(self) -> str:
        """The zygote's last words (its stderr's tail)."""
        if self.worker is None:
            return "stopped"
        rc = self.worker.proc.poll()
        tail = log_tail(self.worker.log_dir / "stderr.log", 400).strip() or "(empty)"
        return f"exit code {rc}; stderr: {tail}"

    def close(self) -> None:
        """Stop the zygote (its idle children die with it: their death signal)."""
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.worker is not None:
            reap(self.worker)
            self.worker = None
        self.ready_file.unlink(missing_ok=True)
