"""Live mode's membership and process groups, as one worker sees them.

Owns the worker's side of the epoch protocol: what the agent tells a live worker
(``LiveEnv``), reading ``live/epoch``, noticing an aborting or growing epoch while a
collective runs, waiting for an epoch that includes this worker, the members' arrival and
report exchange under the epoch's own store prefix, and the epoch's process group: a fresh
``ProcessGroupGloo`` per epoch (formed by ``flexrun.train.live_raw``, where an epoch that
aborts it ends the wait; old groups are leaked, never aborted or destroyed), or the
worker's one group re-formed in place where torch can (``flexrun.train.live_reconf``, the
path chosen at start and named in the ``live_group_path`` event). It does not decide whose state
wins (``flexrun.train.live_plan``), move state (``flexrun.train.live_sync``) or run the
step loop (``flexrun.train.live``).

Store outages. A formed process group needs no store (gloo talks peer to peer), so while
the store is away the current epoch trains on: an epoch check that cannot reach the store
is skipped (a refused-connection probe, not a blocking reconnect, so a step is not slowed)
and retried every ``OUTAGE_RETRY_S``. A membership change (waiting for the next epoch, the
members' agreement, marking the job formed or done) waits for the store to come back, and
its timeout counts from the store's return. A restarted store has lost every key: the
agents publish the epoch again, numbered above the last one (``flexrun.agent.live_epochs``),
and a member still waiting in an interrupted agreement posts its report again.

Authentication. With a job secret (the agent passes ``FLEXRUN_JOB_SECRET_FILE``) the
records read here (the epoch, ``formed``, ``done``) are verified
(:func:`flexrun.store.factory.connect_from_env`): a record written without the secret is
ignored (a ``store_record_rejected`` event). The members' arrival reports and the process
group's own keys go through torch's ``TCPStore`` unsigned (see SECURITY.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from flexrun.errors import LiveAborted, StoreUnavailable, TrainingFinished
from flexrun.events import EventLog
from flexrun.live_protocol import EpochRecord, LiveEnv, LiveKeys, MemberReport
from flexrun.store.factory import connect_from_env
from flexrun.store.signed import report_to
from flexrun.store.tcp_server import probe
from flexrun.train.live_raw import RawStore, form_gloo
from flexrun.train.live_reconf import InPlaceGroups
from flexrun.train.live_sync import leak

log = logging.getLogger("flexrun.train.live")

OUTAGE_RETRY_S = 0.25
"""While the store is unreachable: how often a training worker looks again."""

_T = TypeVar("_T")


class EpochGroup:
    """This worker's view of the live epochs: the current one, its process group, and the
    store keys the agents and the members share. Connects to the store on construction."""

    def __init__(
        self,
        env: LiveEnv,
        *,
        timeout_s: float,
        environ: Mapping[str, str] | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.epoch: EpochRecord | None = None
        self.pg: Any = None
        self.pending_change = False
        """A growing epoch was published: switch at the next step boundary."""
        self._abandoned: list[Any] = []  # old groups are leaked on purpose, never aborted
        self._subgroups: list[Any] = []  # the current epoch's other groups (sharded jobs)
        self._next_check = 0.0
        self.keys = LiveKeys(env.run_id)
        self._prefix: Any = None
        self.events = events
        self.down_since: float | None = None
        """When the store became unreachable (None: reachable)."""
        self.store = connect_from_env(
            env.store_host, env.store_port, os.environ if environ is None else environ
        )
        report_to(self.store, self._rejected)
        self._raw = RawStore(env.store_host, env.store_port, timeout_s)
        self.inplace = InPlaceGroups(enabled=env.reconfigure, timeout_s=timeout_s,
            namespace=self.keys.root + "reconf/", raw_store=lambda: self._raw.conn, emit=self._emit)  # fmt: skip

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)

    def _rejected(self, key: str, reason: str) -> None:
        log.warning("ignoring a store record that does not verify: %s (%s)", key, reason)
        self._emit("store_record_rejected", key=key, reason=reason)

    # -- store outages ------------------------------------------------------------------------
    def _outage(self, exc: Exception) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("store unreachable (%s); training on, membership changes wait", exc)
            self._emit("store_unavailable", error=str(exc)[:300], epoch=self._number())

    def _back(self) -> None:
        if self.down_since is not None:
            down = time.monotonic() - self.down_since
            self.down_since = None
            log.warning("store reachable again after %.1fs", down)
            self._emit("store_recovered", down_s=round(down, 3), epoch=self._number())

    def _number(self) -> int | None:
        return self.epoch.number if self.epoch is not None else None

    def _reachable(self) -> None:
        """During an outage, a quick look (one refused connect) before a real request.

        Raises:
            StoreUnavailable: still unreachable.
        """
        if self.down_since is not None:
            probe(self.env.store_host, self.env.store_port, 0.0)

    def patiently(self, fn: Callable[[], _T]) -> _T:
        """``fn()``, waiting out store outages (however long: the agent, which outlives
        this worker, decides when a job without its store is over)."""
        while True:
            try:
                self._reachable()
                out = fn()
            except StoreUnavailable as exc:
                self._outage(exc)
                time.sleep(OUTAGE_RETRY_S)
                continue
            self._back()
            return out

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
        try:
            self._reachable()
            rec = self.read_epoch()
        except StoreUnavailable as exc:
            # The formed group needs no store: train on, look again later.
            self._outage(exc)
            self._next_check = now + OUTAGE_RETRY_S
            return
        self._back()
        current = self.epoch.number if self.epoch else -1
        # (Only a newer number is a change: a restored record is numbered above the last.)
        if rec is not None and _aborts(rec, current, self.env.worker_id):
            raise LiveAborted(f"epoch {rec.number} replaced epoch {current}")
        self.pending_change = self.pending_change or (rec is not None and rec.number > current)

    def wait(self, work: Any) -> None:
        """Wait for a collective, watching for an aborting epoch change.

        Raises:
            LiveAborted: the collective failed, timed out, or the epoch ended under it.
        """
        deadline = time.monotonic() + self.timeout_s
        self.inplace.inflight = work  # (if abandoned, it may hold an in-place group's thread)
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
        """Give up the current process group and its subgroups (leaked: see
        ``live_sync.leak``)."""
        self.inplace.abandoned()
        for pg in [self.pg, *self._subgroups]:
            if pg is not None:
                self._abandoned.append(pg)
                leak(pg)
        self.pg = None
        self._subgroups = []

    def leak_all(self) -> None:
        for pg in [*self._abandoned, self.pg, *self._subgroups]:
            if pg is not None:
                leak(pg)

    def subgroup(self, rec: EpochRecord, name: str, rank: int, size: int) -> Any:
        """A group of ``size`` of ``rec``'s members (this one at ``rank``), named ``name``
        in the epoch's namespace, given up with the epoch's (raises LiveAborted as form)."""
        prefix = self._raw.prefix(f"{self.keys.epoch_namespace(rec.number)}{name}/")
        pg = _fresh(self, prefix, rank, size, rec.number, f"epoch {rec.number}'s group {name}")
        self._subgroups.append(pg)
        return pg

    # -- moving to the next epoch ---------------------------------------------------------------
    def next_epoch(self, after: int, *, has_state: bool) -> EpochRecord:
        """Wait until an epoch newer than ``after`` that includes this worker is published.

        Raises:
            LiveAborted: excluded from it, or none within the timeout.
            TrainingFinished: see ``check_finished``.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self._reachable()
                since = self.store.revision()
                self.check_finished(has_state=has_state)
                rec = self.read_epoch()
            except StoreUnavailable as exc:
                self._outage(exc)
                time.sleep(OUTAGE_RETRY_S)
                deadline = time.monotonic() + self.timeout_s  # (counts from its return)
                continue
            self._back()
            if rec is not None and rec.number > after:
                if self.env.worker_id in rec.members:
                    return rec
                if time.monotonic() > deadline:
                    raise LiveAborted(f"excluded from epoch {rec.number}")
            if time.monotonic() > deadline:
                raise LiveAborted(
                    f"no new membership epoch after {after} within {self.timeout_s:g}s"
                )
            try:
                self.store.wait_for_change(self.keys.epoch, since, 0.5)
            except StoreUnavailable as exc:
                self._outage(exc)

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
        prefix = self._post(rec, rank, report)
        names = [LiveKeys.ready(r) for r in range(world)]
        now = time.monotonic()
        deadline, look, pause = now + self.timeout_s, now + 0.2, 0.001
        # Polled with check(), never a short wait(): each timed-out wait() logs a c10d
        # warning whose formatting does a reverse DNS lookup of the socket's address,
        # which takes seconds where no DNS server answers and would stall a recovery as long.
        while True:
            try:
                if prefix.check(names):
                    break
            except RuntimeError as exc:
                # The store went away (a restarted one lost every report): wait for it,
                # post again, and count the timeout from its return.
                self._outage(StoreUnavailable(f"store failed during agreement: {exc}"))
                prefix = self.patiently(lambda: self._repost(rec, rank, report))
                deadline = time.monotonic() + self.timeout_s
                continue
            now = time.monotonic()
            if now >= look:
                look = now + 0.2
                self.patiently(lambda: self.check_finished(has_state=has_state))
                latest = self.patiently(self.read_epoch)
                if latest is not None and latest.number > rec.number:
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

    def _post(self, rec: EpochRecord, rank: int, report: MemberReport) -> Any:
        if self._raw.stale:
            return self.patiently(lambda: self._repost(rec, rank, report))
        prefix = self._raw.prefix(self.keys.epoch_namespace(rec.number))
        try:
            prefix.set(LiveKeys.ready(rank), report.encode())
        except RuntimeError as exc:
            self._outage(StoreUnavailable(f"store failed during agreement: {exc}"))
            return self.patiently(lambda: self._repost(rec, rank, report))
        return prefix

    def _repost(self, rec: EpochRecord, rank: int, report: MemberReport) -> Any:
        """A new connection to the store, and this member's report posted again.

        Raises:
            StoreUnavailable: the store is still unreachable.
        """
        try:
            self._raw.renew()
            prefix = self._raw.prefix(self.keys.epoch_namespace(rec.number))
            prefix.set(LiveKeys.ready(rank), report.encode())
        except RuntimeError as exc:
            raise StoreUnavailable(f"store failed during agreement: {exc}") from exc
        return prefix

    def form(self, rec: EpochRecord, handles: list[str | None] | None = None) -> tuple[int, int]:
        """Epoch ``rec``'s group (after ``agree``), re-formed in place when every member
        posted a handle (``handles``, rank order), else fresh; returns (rank, world).

        Raises:
            LiveAborted: the group could not form (a member or the store went away).
        """
        rank, world = rec.members.index(self.env.worker_id), len(rec.members)
        prefix = self._prefix or self._raw.prefix(self.keys.epoch_namespace(rec.number))
        self._prefix = None
        pg = self.inplace.form(rec.number, handles or [], lambda: _replaced(self, rec.number))
        self.pg = pg or _fresh(self, prefix, rank, world, rec.number, f"epoch {rec.number}'s group")
        self.epoch = rec
        self.pending_change = False
        return rank, world

    # -- job-wide markers ---------------------------------------------------------------------
    def formed_before(self) -> bool:
        """Some epoch of this job has formed before (so someone once held state)."""
        return self.patiently(lambda: self.store.get(self.keys.formed)) is not None

    def mark_formed(self, epoch: int) -> None:
        self.patiently(lambda: self.store.put(self.keys.formed, str(epoch).encode()))

    def mark_done(self, steps: int) -> None:
        self.patiently(lambda: self.store.put(self.keys.done, str(steps).encode()))


def _fresh(group: EpochGroup, prefix: Any, rank: int, world: int, number: int, what: str) -> Any:
    """A fresh gloo group for epoch ``number`` (raises LiveAborted: see ``form_gloo``)."""
    return form_gloo(prefix, rank, world, group.timeout_s, what,
                     superseded=lambda: _replaced(group, number), left_behind=group._raw.left_behind)  # fmt: skip


def _replaced(group: EpochGroup, number: int) -> bool:
    """The published epoch ends epoch ``number`` for this worker (False while the store is
    away). Forming a group stops on the rule its collectives follow: a growing epoch keeps
    every member, so the group forms (a member that stopped alone would leave the others
    waiting in their first collective on it, taking the change only at a step boundary)."""
    try:
        latest = group.read_epoch()
    except StoreUnavailable:
        return False
    return latest is not None and _aborts(latest, number, group.env.worker_id)


def _aborts(rec: EpochRecord, current: int, worker_id: str) -> bool:
    """``rec`` ends epoch ``current`` at once: newer, and aborting or leaving ``worker_id``
    out (a growing epoch is taken at the next step boundary)."""
    return rec.number > current and (rec.abort or worker_id not in rec.members)


__all__ = ["EpochGroup", "LiveAborted", "LiveEnv", "TrainingFinished"]
