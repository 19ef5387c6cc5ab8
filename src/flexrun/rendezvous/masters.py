"""Each round's master address (``MASTER_ADDR``/``MASTER_PORT`` of its workers).

Owns one node's side of it (:class:`Masters`): group rank 0's node publishes its address
and a port (its agent's store, or a free one) under ``s/round/master/<n>``, first writer
wins; the others wait for the publication, which their change watch of the round
directory wakes them for (and, where the store's watches carry values, hands them: no
read). It remembers the last address it saw, to publish it again with a round a store
restart lost.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from flexrun.rendezvous.decide import Run
from flexrun.rendezvous.state import MasterRecord, RoundRecord

if TYPE_CHECKING:
    from flexrun.rendezvous.handler import RendezvousHandler


def free_port(addr: str) -> int:
    """A port the OS says is free on ``addr`` now (the caller's workers bind it next)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr if addr not in ("localhost",) else "127.0.0.1", 0))
        return int(s.getsockname()[1])


class Masters:
    """The master addresses of one handler's rounds."""

    def __init__(self, h: RendezvousHandler) -> None:
        self.h = h
        self.known: tuple[int, MasterRecord] | None = None

    def master_for(self, rnd: RoundRecord, timeout_s: float, port: int = 0) -> MasterRecord | None:
        """Rank 0's node publishes ``port`` or a free one; others wait for it (None: the
        round moved on, or ``timeout_s`` passed)."""
        h = self.h
        key = h.keys.master(rnd.number)
        if rnd.group_rank(h.me.node_id) == 0:
            rec = MasterRecord(h.me.addr, port or free_port(h.me.addr))
            ok, _ = h.store.compare_and_set(key, rec.encode(), expected_revision=0)
            if not ok:
                entry = h.store.get(key)
                if entry is None:
                    return None
                rec = MasterRecord.decode(entry.value)
            self.known = (rnd.number, rec)
            return rec
        found = self._await(rnd.number, timeout_s)
        if found is not None:
            self.known = (rnd.number, found)
        return found

    def published(self, number: int) -> MasterRecord | None:
        """Round ``number``'s address if published (None: not yet); from the round
        directory's copy where one is kept, at no request."""
        entry = self.h.read_round_key(self.h.keys.master(number))
        return MasterRecord.decode(entry.value) if entry is not None else None

    def restore(self, number: int) -> None:
        """Publish round ``number``'s address again (the store lost it with the round): a
        member still waiting for it would wait for ever."""
        if self.known is not None and self.known[0] == number:
            h = self.h
            h.store.compare_and_set(h.keys.master(number), self.known[1].encode(), expected_revision=0)

    def _await(self, number: int, timeout_s: float) -> MasterRecord | None:
        h = self.h
        deadline = h.clock.monotonic() + timeout_s
        while True:
            found = self.published(number)
            if found is not None:
                return found
            # Not published yet. Decide as the agent's loop would: rank 0's node may have
            # left or died before publishing, and this agent, waiting here, may be the only
            # one left to replace the round (a proposal made here returns Wait).
            action = h.step(None)
            if not isinstance(action, Run) or action.round.number != number:
                return None
            remaining = deadline - h.clock.monotonic()
            if remaining <= 0 or h.stopped:
                return None
            # The address is published under the round directory, which this node's change
            # watch follows from its last read: the publication (or a new header) wakes the
            # wait, at no request; the keep-alive interval bounds it so that the step above
            # still checks on the watcher when nothing changes.
            h.wait(min(remaining, h.settings.heartbeat_interval_s))


__all__ = ["Masters", "free_port"]
