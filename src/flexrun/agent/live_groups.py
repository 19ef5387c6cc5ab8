"""Replica groups of a sharded live job on this node: the unit of failure.

Owns which local slots form a replica group (``--live-shards S``: slots ``b*S .. b*S+S-1``
form block ``b``), each group's id (a new one whenever the group is replaced, so that its
workers build a fresh group-local process group under a fresh store prefix), and what a
failure takes out: a dead or frozen worker's group-mates are killed with it, because
their FSDP collectives ran with the dead worker (a gloo collective behind a frozen peer
cannot be aborted) and a group's process group is never reconfigured. The other groups
keep their processes. It does not start workers or publish epochs (``flexrun.agent.live``
does), and with ``S = 1`` it changes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from flexrun.cause import FailureCause
from flexrun.events import EventLog
from flexrun.proc import kill_session, reap

MATE_EXIT_WAIT_S = 5.0
"""How long a killed group-mate may take to exit when the runner stops (SIGKILL: ms)."""


class ReplicaGroups:
    """This node's replica groups (blocks of ``shards`` consecutive slots)."""

    def __init__(self, node: str, nproc: int, shards: int) -> None:
        self.node = node
        self.nproc = nproc
        self.shards = shards
        self._ids: dict[int, str] = {}
        self._seq = 0
        self._dying: list[Any] = []  # (killed group-mates, not yet reaped)

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def block(self, slot: int) -> int:
        return slot // self.shards

    def slots(self, block: int) -> range:
        return range(block * self.shards, (block + 1) * self.shards)

    def renew(self, blocks: Iterable[int]) -> None:
        """New ids for ``blocks``: their next workers form new groups."""
        for b in blocks:
            self._seq += 1
            self._ids[b] = f"{self.node}.g{b}.{self._seq}"

    def worker_group(self, slot: int) -> tuple[int, str, int] | None:
        """(shards, group id, shard index) of the worker put in ``slot`` now (None: not a
        sharded job)."""
        if not self.sharded:
            return None
        b = self.block(slot)
        if b not in self._ids:
            self.renew([b])
        return self.shards, self._ids[b], slot % self.shards

    def admitted(self, included: dict[int, bool]) -> set[int]:
        """The slots to publish, from ``included`` (slot -> the worker is ready): a sharded
        group enters an epoch whole or not at all (its FSDP group needs every shard)."""
        ready = {s for s, ok in included.items() if ok}
        if not self.sharded:
            return ready
        return {s for s in ready if all(m in ready for m in self.slots(self.block(s)))}

    def members(self, workers: Mapping[int, Any]) -> list[str]:
        """The worker ids to publish, in slot order (``workers``: slot -> LiveWorker)."""
        ok = self.admitted({s: lw.included for s, lw in workers.items()})
        return [lw.worker_id for s, lw in sorted(workers.items()) if s in ok]

    def take_out(
        self,
        dead: list[int],
        failures: list[FailureCause],
        workers: MutableMapping[int, Any],
        events: EventLog,
    ) -> None:
        """The groups of the ``dead`` slots leave: their living mates are killed and their
        slots added to ``dead`` (to be refilled with the group's new id); of several
        failures of one group in ``failures``, the first one ended by a signal (else the
        first) is its cause, the others its consequence (a mate that saw its peer's
        connection reset and raised). ``workers``: slot -> LiveWorker (its ``worker``
        is a :class:`flexrun.proc.Worker`)."""
        if not self.sharded or not dead:
            return
        blocks = sorted({self.block(s) for s in dead})
        by_block: dict[int, list[FailureCause]] = {}
        for cause in failures:
            if cause.local_rank is not None:
                by_block.setdefault(self.block(cause.local_rank), []).append(cause)
        kept = [c for c in failures if c.local_rank is None]
        for b in blocks:
            group = by_block.get(b, [])
            if group:
                kept.append(next((c for c in group if c.signal), group[0]))
            mates = [s for s in self.slots(b) if s not in dead and s in workers]
            for s in mates:
                # (killed, not waited for: their group's next workers start at once)
                lw = workers.pop(s)
                kill_session(lw.worker.proc.pid, signal.SIGKILL)
                self._dying.append(lw.worker)
                dead.append(s)
            events.emit(
                "live_group_dropped",
                group=self._ids.get(b),
                slots=list(self.slots(b)),
                killed=[s for s in mates],
                cause=[c.worker_id for c in group],
            )
        failures[:] = kept
        self.renew(blocks)

    def reap_dying(self, wait_s: float = 0.0) -> None:
        """Reap the killed group-mates that have exited (waiting up to ``wait_s`` each)."""
        left = []
        for w in self._dying:
            if wait_s:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=wait_s)
            if w.proc.poll() is None:
                left.append(w)
            else:
                reap(w)
        self._dying = left


__all__ = ["MATE_EXIT_WAIT_S", "ReplicaGroups"]
