"""Each round's master address (``MASTER_ADDR``/``MASTER_PORT`` of its workers).

Owns one node's side of it (:class:`Masters`): group rank 0's node publishes its address
and a port (its agent's store, or a free one) under ``s/round/master/<n>``, first writer
wins; the others wait for the publication, which their change watch of the round
directory wakes them for (and, where the store's watches carry values, hands them: no
read). It remembers the last address it saw (in the session), to publish it again with
a round a store restart lost.

A static job's workers' store is the job's own store (one port, as torchrun's): before
group rank 0 empties it of an earlier round's worker keys, every other member marks that
its workers of earlier rounds are stopped (:meth:`Masters.mark_stopped`, awaited by
:meth:`Masters.all_stopped`), and the round's master is published only after the
emptying (:class:`flexrun.agent.worker_store.WorkerStores`).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from flexrun.rendezvous.state import MasterRecord, RoundRecord

if TYPE_CHECKING:
    from flexrun.rendezvous.session import Session


def free_port(addr: str) -> int:
    """A port the OS says is free on ``addr`` now (the caller's workers bind it next)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr if addr not in ("localhost",) else "127.0.0.1", 0))
        return int(s.getsockname()[1])


class Masters:
    """The master addresses of one session's rounds (what to wait for, and how long, is
    the handler's: :meth:`flexrun.rendezvous.handler.RendezvousHandler.master_for`)."""

    def __init__(self, s: Session) -> None:
        self.s = s

    def publish(self, rnd: RoundRecord, port: int = 0) -> MasterRecord | None:
        """Group rank 0's node: publish this node's address with ``port`` or a free one;
        the first writer wins (its record is returned; None: it vanished meanwhile)."""
        s = self.s
        key = s.keys.master(rnd.number)
        rec = MasterRecord(s.me.addr, port or free_port(s.me.addr))
        ok, _ = s.store.compare_and_set(key, rec.encode(), expected_revision=0)
        if not ok:
            entry = s.store.get(key)
            if entry is None:
                return None
            rec = MasterRecord.decode(entry.value)
        self.seen(rnd.number, rec)
        return rec

    def published(self, number: int) -> MasterRecord | None:
        """Round ``number``'s address if published (None: not yet); from the round
        directory's copy where one is kept, at no request."""
        entry = self.s.read_round_key(self.s.keys.master(number))
        return MasterRecord.decode(entry.value) if entry is not None else None

    def mark_stopped(self, rnd: RoundRecord) -> None:
        """This member's workers of the rounds before ``rnd`` are stopped."""
        s = self.s
        s.store.put(s.keys.stopped(rnd.number, s.me.node_id), b"1")

    def all_stopped(self, rnd: RoundRecord) -> bool:
        """Whether every other member of ``rnd`` marked its earlier workers stopped."""
        s = self.s
        return all(
            s.read_round_key(s.keys.stopped(rnd.number, node)) is not None
            for node in rnd.member_ids
            if node != s.me.node_id
        )

    def seen(self, number: int, rec: MasterRecord) -> None:
        """Remember round ``number``'s address, to publish it again should the store lose
        it with the round (:meth:`flexrun.rendezvous.session.Session.round_restored`)."""
        self.s.master = (number, rec)


__all__ = ["Masters", "free_port"]
