"""The c10d side of a live epoch: the one ``TCPStore`` connection a worker's members
reports and gloo groups rendezvous on, and the forming of a fresh gloo group that a newer
epoch can interrupt.

Owns that connection (replaced when a forming thread left behind may hold it) and the
forming thread. It does not decide when an epoch is superseded or who its members are
(``flexrun.train.live_group``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from flexrun.errors import LiveAborted, StoreUnavailable
from flexrun.store.tcp_server import probe
from flexrun.train.live_sync import leak

log = logging.getLogger(__name__)


class RawStore:
    """A c10d ``TCPStore`` client on the job's store (unsigned: see SECURITY.md)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.conn: Any = self._connect()
        self.stale = False
        """A forming thread left behind may hold ``conn``: make a new one before using it."""

    def _connect(self) -> Any:
        return dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=self.timeout_s))

    def prefix(self, namespace: str) -> Any:
        return dist.PrefixStore(namespace, self.conn)

    def renew(self) -> None:
        """A new connection, once a refused-connection probe says the store is there.

        Raises:
            StoreUnavailable: the probe was refused.
            RuntimeError: c10d's, the connection failed all the same.
        """
        probe(self.host, self.port, 0.0)
        self.conn = self._connect()
        self.stale = False

    def left_behind(self) -> None:
        """A forming thread left behind may hold ``conn`` (a c10d client serves one request
        at a time, a wait included): take a new one now, or mark it stale when the store
        cannot be reached (the next agreement reconnects)."""
        try:
            self.renew()
        except (StoreUnavailable, RuntimeError) as exc:
            log.warning("no new store connection after leaving a forming group (%s)", exc)
            self.stale = True


def form_gloo(
    prefix: Any,
    rank: int,
    world: int,
    timeout_s: float,
    what: str,
    *,
    superseded: Callable[[], bool],
    left_behind: Callable[[], None],
) -> Any:
    """A gloo process group on ``prefix``, formed on a thread of its own.

    Gloo's rendezvous waits out its whole timeout for a member that never connects: one
    lost between the agreement and the group (killed, or stopped and then killed) held the
    others two minutes while the agent had long published the next epoch, and they missed
    it. Here the wait ends as soon as ``superseded()`` (asked every 0.1 s while it forms)
    says a newer epoch ended this one; the thread is left to its timeout, the group it may still form is
    never used (nor destroyed: ``leak``), and ``left_behind()`` is told, since the thread
    may hold the connection under ``prefix`` (a c10d store client serves one request at a
    time, a wait included).

    Raises:
        LiveAborted: it could not form (a member or the store went away), or it was
            superseded while forming.
    """
    done, box = threading.Event(), dict[str, Any]()

    def form() -> None:
        try:
            pg = dist.ProcessGroupGloo(prefix, rank, world, timedelta(seconds=timeout_s))
            leak(pg)  # (whether used or left: a gloo group is never destroyed)
            box["pg"] = pg
        except Exception as exc:  # handed to the caller below (or dropped once it left)
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=form, name=f"flexrun-form {what}", daemon=True).start()
    while not done.wait(0.1):
        if superseded():
            left_behind()
            raise LiveAborted(f"{what} was superseded while it formed")
    if "error" in box:
        exc = box["error"]
        if not isinstance(exc, RuntimeError):  # (c10d's errors are; anything else is a bug)
            raise exc
        raise LiveAborted(f"{what} did not form: {str(exc).splitlines()[0][:200]}") from exc
    return box["pg"]


__all__ = ["RawStore", "form_gloo"]
