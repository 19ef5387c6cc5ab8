"""Settling a sharded live job's replica group: all of its members go on, or none does.

Owns the two points where the members of a replica group must agree before they run the
group's own FSDP collectives (which cannot be abandoned): the end of a step (:func:`settle`:
every member saw the step's vote complete, so all of them step the optimizer or none does)
and the end of a join (:class:`GroupJoins`: every member completed its join of the epoch).
Both exist for one reason: gloo completes a collective at different moments on different
ranks, so a member can see it complete while its group-mate, still waiting, sees an
aborting epoch and leaves. It does not run the loop (``flexrun.train.live``) or form the
groups (``flexrun.train.live_group``, ``flexrun.train.live_shards``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from flexrun.errors import FlexrunError, LiveAborted
from flexrun.live_protocol import LiveEnv
from flexrun.train.live_group import EpochGroup

log = logging.getLogger(__name__)


def settle(*, voted: bool, group: Any = None) -> bool:
    """Whether every member of this replica group (``group``; None: the default group, a
    sharded live worker's replica group) saw the step's vote complete (this one:
    ``voted``), so that all of them step the optimizer or none does.

    gloo completes an all-reduce at different moments on different ranks: a member could
    finish the vote and go on into the next step's FSDP all-gather (a blocking wait) while
    its group-mate, still waiting, saw an aborting epoch and left to rejoin; the first then
    waited out gloo's timeout and died, and the group's state with it. Every member posts
    this exactly once per step, whatever the outcome, and waits for it without looking at
    epochs: it completes while the group lives (a member lost takes its whole group: the
    agent drops it; a closed connection reads as not settled).
    """
    t = torch.tensor([1 if voted else 0], dtype=torch.int32)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as exc:  # a group-mate is gone: its group is being dropped
        log.warning("the step's settle failed (%s): rejoining", str(exc).splitlines()[0])
        return False
    return bool(t.item())


def _went_on(record: bytes | None, number: int) -> bool | None:
    """What a group-mate's join record (``<epoch tried> <try|ok|fail> <last epoch it went
    on from>``) says of epoch ``number``: its part completed (True), it did not or it did
    not go on from it (False), not known yet (None: it has not reached ``number``, or it is
    still trying it).

    Raises:
        ValueError: not such a record.
    """
    if record is None:
        return None
    tried, state, went_on = record.decode().split()
    if state not in ("try", "ok", "fail"):
        raise ValueError(f"unknown join state {state!r}")
    if int(tried) > number:
        return int(went_on) == number
    if int(tried) < number or state == "try":
        return None
    return state == "ok"


class GroupJoins:
    """Whether every member of this worker's replica group completed its join of an epoch,
    so that all of them go on into the group's FSDP collectives or none does (the join's
    twin of :func:`settle`).

    A join ends in collectives over the whole epoch (its group, the shard subgroups, the
    transfer's closing vote), which gloo completes at different moments on different
    ranks: a member could leave its join and enter the next step's FSDP all-gather while
    its group-mate, still waiting, saw an aborting epoch and went on to the next one; the
    first then waited out gloo's timeout in the all-gather, and its group died with it. A
    collective on the group's own process group cannot settle this (group-mates need not
    try the same epochs: one may skip an epoch the other tries, and the collectives would
    pair across epochs), so each member keeps one store record (``_went_on``) and goes on
    from epoch E only once every mate's says its part of E completed. A mate that tried a
    later epoch without going on from E did not; a mate lost takes the group (the agent
    kills its mates), so the wait needs no epoch watching, only a bound. A restarted store
    has lost the records: members still waiting post theirs again (as an interrupted
    agreement does); a mate that had already gone on cannot, so a restart in the
    milliseconds between two mates' reads costs the group (the bound, then a replacement).
    """

    def __init__(self, group: EpochGroup, env: LiveEnv) -> None:
        self.group = group
        self.env = env
        self.went_on = -1
        """The last epoch this worker went on from."""
        root = f"{group.keys.root}joins/{env.group}/"
        self._mine = root + str(env.shard)
        self._mates = [root + str(i) for i in range(env.shards) if i != env.shard]

    def _put(self, number: int, state: str) -> None:
        record = f"{number} {state} {self.went_on}".encode()
        self.group.patiently(lambda: self.group.store.put(self._mine, record))

    def tried(self, number: int) -> None:
        """This worker starts its join of epoch ``number``."""
        self._put(number, "try")

    def failed(self, number: int) -> None:
        """Its join of epoch ``number`` did not complete: no mate goes on from it."""
        self._put(number, "fail")

    def settle(self, number: int) -> None:
        """This worker's part of epoch ``number`` completed: return once every mate's did.

        Raises:
            LiveAborted: some mate's did not (this one then fails the epoch too).
            FlexrunError: no verdict from a mate within twice the timeout (every step of a
                join is bounded by it): this worker ends, so that the agent replaces its
                group rather than leave it split.
        """
        self._put(number, "ok")
        limit = 2 * self.group.timeout_s
        deadline, pause, warned = time.monotonic() + limit, 0.001, False
        while True:
            t0 = time.monotonic()
            own, *entries = self.group.patiently(
                lambda: [self.group.store.get(k) for k in (self._mine, *self._mates)]
            )
            if time.monotonic() - t0 > 1.0:  # (a store outage: the bound counts from its return)
                deadline = time.monotonic() + limit
            if own is None:  # (a restarted store lost every record: post this one again)
                self._put(number, "ok")
            verdicts: list[bool | None] = []
            for key, entry in zip(self._mates, entries, strict=True):
                try:
                    verdicts.append(_went_on(entry.value if entry else None, number))
                except ValueError as exc:  # (UnicodeDecodeError is a ValueError)
                    if not warned:
                        log.warning("ignoring an unreadable join record at %s (%s)", key, exc)
                    warned = True
                    verdicts.append(None)
            if False in verdicts:
                raise LiveAborted(f"a group-mate did not complete its join of epoch {number}")
            if None not in verdicts:
                self.went_on = number
                return
            if time.monotonic() > deadline:
                raise FlexrunError(
                    f"no group-mate verdict on epoch {number} within {limit:g}s: leaving, so "
                    f"that the agent replaces replica group {self.env.group}"
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 0.01)


__all__ = ["GroupJoins", "settle"]
