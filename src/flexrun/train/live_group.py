"""Live mode's membership and process groups, as one worker sees them.

Owns the worker's side of the epoch protocol: what the agent tells a live worker
(``LiveEnv``), reading ``live/epoch``, noticing an aborting or growing epoch while a
collective runs, waiting for an epoch that includes this worker, the members' arrival and
report exchange under the epoch's own store prefix, and a fresh ``ProcessGroupGloo`` per
epoch (old groups are leaked, never aborted or destroyed). It does not decide whose state
wins (``flexrun.train.live_plan``), move state (``flexrun.train.live_sync``) or run the
step loop (``flexrun.train.live``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from flexrun.errors import LiveAborted, TrainingFinished
from flexrun.live_protocol import EpochRecord, LiveEnv, LiveKeys, MemberReport
from flexrun.train.live_sync import leak


class EpochGroup:
    """This worker's view of the live epochs: the current one, its process group, and the
    store keys the agents and the members share. Connects to the store on construction."""

    def __init__(self, env: LiveEnv, *, timeout_s: float) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.epoch: EpochRecord | None = None
        self.pg: Any = None
        self.pending_change = False
        """A growing epoch was published: switch at the next step boundary."""
        self._abandoned: list[Any] = []  # old groups are leaked on purpose, never aborted
        self._next_check = 0.0
        self.keys = LiveKeys(env.run_id)
        self._prefix: Any = None

        from flexrun.store.tcp import TcpStore

        self.store = TcpStore(env.store_host, env.store_port, connect_timeout_s=30)
        self._raw = dist.TCPStore(
            env.store_host, env.store_port, None, False, timedelta(seconds=timeout_s)
        )

    # -- the current epoch -------------------------------------------------------------------
    def read_epoch(self) -> EpochRecord | None:
        entry = self.store.get(self.keys.epoch)
        return EpochRecord.decode(entry.value) if entry is not None else None

    def check_epoch(self, now: float) -> None:
        """At most every 5 ms: an aborting epoch change raises LiveAborted; a growing one
        sets ``pending_change``, to be agreed at the next step boundary."""
        if now < self._next_check:
            return
        self._next_check = now + 0.005
        rec = self.read_epoch()
        current = self.epoch.number if self.epoch else -1
        if rec is not None and rec.number != current:
            if rec.abort or self.env.worker_id not in rec.members:
                raise LiveAborted(f"epoch {rec.number} replaced epoch {current}")
            self.pending_change = True

    def wait(self, work: Any) -> None:
        """Wait for a collective, watching for an aborting epoch change.

        Raises:
            LiveAborted: the collective failed, timed out, or the epoch ended under it.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            if work.is_completed():
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise LiveAborted(
                        f"collective failed: {str(exc).splitlines()[0][:200]}"
                    ) from exc
                return
            now = time.monotonic()
            self.check_epoch(now)
            if now > deadline:
                raise LiveAborted(f"collective did not complete in {self.timeout_s:g}s")
            time.sleep(0.0005)

    def abandon(self) -> None:
        """Give up the current process group (leaked: see ``live_sync.leak``)."""
        if self.pg is not None:
            self._abandoned.append(self.pg)
            leak(self.pg)
            self.pg = None

    def leak_all(self) -> None:
        for pg in [*self._abandoned, self.pg]:
            if pg is not None:
                leak(pg)

    # -- moving to the next epoch ---------------------------------------------------------------
    def next_epoch(self, after: int, *, has_state: bool) -> EpochRecord:
        """Wait until an epoch newer than ``after`` that includes this worker is published.

        Raises:
            LiveAborted: excluded from it, or none within the timeout.
            TrainingFinished: see ``check_finished``.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            since = self.store.revision()
            self.check_finished(has_state=has_state)
            rec = self.read_epoch()
            if rec is not None and rec.number > after:
                if self.env.worker_id in rec.members:
                    return rec
                if time.monotonic() > deadline:
                    raise LiveAborted(f"excluded from epoch {rec.number}")
            if time.monotonic() > deadline:
                raise LiveAborted(
                    f"no new membership epoch after {after} within {self.timeout_s:g}s"
                )
            self.store.wait_for_change(self.keys.epoch, since, 0.5)

    def check_finished(self, *, has_state: bool) -> None:
        """Raises TrainingFinished when this worker holds no state and the job is done."""
        if not has_state and self.store.get(self.keys.done) is not None:
            raise TrainingFinished()

    def agree(
        self, rec: EpochRecord, report: MemberReport, *, has_state: bool
    ) -> list[MemberReport]:
        """Post this worker's ``report`` in epoch ``rec`` and return every member's, in rank
        order, once all have arrived.

        Raises:
            LiveAborted: a newer epoch superseded ``rec``, the store failed, or some member
                did not arrive within the timeout.
            TrainingFinished: see ``check_finished``.
        """
        rank, world = rec.members.index(self.env.worker_id), len(rec.members)
        prefix = dist.PrefixStore(self.keys.epoch_namespace(rec.number), self._raw)
        prefix.set(LiveKeys.ready(rank), report.encode())
        names = [LiveKeys.ready(r) for r in range(world)]
        now = time.monotonic()
        deadline, look, pause = now + self.timeout_s, now + 0.2, 0.001
        # Polled with check(), never a short wait(): each timed-out wait() logs a c10d
        # warning whose formatting does a reverse DNS lookup of the socket's address,
        # which took 5-10 s here (no DNS server reachable) and stalled a recovery 10 s.
        while True:
            try:
                if prefix.check(names):
                    break
            except RuntimeError as exc:
                raise LiveAborted(f"store failed during agreement: {exc}") from exc
            now = time.monotonic()
            if now >= look:
                look = now + 0.2
                self.check_finished(has_state=has_state)
                latest = self.read_epoch()
                if latest is not None and latest.number != rec.number:
                    raise LiveAborted(
                        f"epoch {latest.number} superseded {rec.number} during agreement"
                    )
                if now > deadline:
                    raise LiveAborted(f"members of epoch {rec.number} did not all arrive")
            time.sleep(pause)
            pause = min(pause * 1.5, 0.01)
        self._prefix = prefix
        try:
            return [MemberReport.decode(bytes(v)) for v in prefix.multi_get(names)]
        except ValueError as exc:
            raise LiveAborted(f"epoch {rec.number}: {exc}") from exc

    def form(self, rec: EpochRecord) -> tuple[int, int]:
        """A fresh process group for epoch ``rec`` (after ``agree``); returns (rank, world)."""
        rank, world = rec.members.index(self.env.worker_id), len(rec.members)
        prefix = self._prefix or dist.PrefixStore(self.keys.epoch_namespace(rec.number), self._raw)
        self.pg = dist.ProcessGroupGloo(prefix, rank, world, timedelta(seconds=self.timeout_s))
        self.epoch = rec
        self.pending_change = False
        self._prefix = None
        return rank, world

    # -- job-wide markers ---------------------------------------------------------------------
    def formed_before(self) -> bool:
        """Some epoch of this job has formed before (so someone once held state)."""
        return self.store.get(self.keys.formed) is not None

    def mark_formed(self, epoch: int) -> None:
        self.store.put(self.keys.formed, str(epoch).encode())

    def mark_done(self, steps: int) -> None:
        self.store.put(self.keys.done, str(steps).encode())


__all__ = ["EpochGroup", "LiveAborted", "LiveEnv", "TrainingFinished"]
