"""Live mode: a step loop whose surviving workers never restart.

Owns the worker side of live recovery: membership epochs published by the agents, the
gradient all-reduce (which the loop controls, so that a dead peer can be abandoned),
agreement on the last committed step, state transfer to members that lack it, a fresh
process group per epoch, and the per-step data split that keeps the global batch and the
sample order independent of the world size. It does not decide membership (the agents do,
in ``flexrun.agent.live``) and does not read the environment beyond ``LiveEnv``.

How a recovery works (what gloo does when a peer dies, which the design rests on, is in
docs/contributor/architecture.md):

1. The agents publish ``live/epoch`` = (epoch number, member worker ids in rank order,
   abort flag). A dead or frozen worker's agent publishes a new epoch at once.
2. Every worker polls that key while it waits for its asynchronous all-reduce; on an
   aborting change (or a collective error) it abandons the old process group (leaks it:
   aborting a gloo group does not unblock a peer stuck in ``recv``).
3. Members of the new epoch post ``(committed step, has state)`` under the epoch's own
   store prefix, agree on the highest committed step, and the lowest-ranked member at
   that step broadcasts model and optimizer state to everyone (a replacement has none).
4. A new ``ProcessGroupGloo`` on ``PrefixStore("…/pg/<epoch>")`` carries on; the step in
   flight is recomputed, nothing else.

A joining node is admitted at a step boundary: a non-aborting epoch change is signalled
by one extra element appended to the gradient all-reduce, so every member switches after
the same step. Data for step ``s`` is the global positions ``[s*G, (s+1)*G)`` of a seeded
per-epoch permutation, split contiguously among the current ranks, and the loss of each
micro-batch is scaled by its share of ``G``: the summed gradient is the single-process
gradient of the global batch whatever the world size, and at an unchanged world size the
run is bitwise identical to one that never failed.

When live state cannot be trusted (nobody holds it: every member died; or the members'
committed steps or model checksums disagree), the epoch's rank 0 restores the newest
durable checkpoint and broadcasts it, as restart mode would, with a ``live_fallback``
event; the decision is ``flexrun.train.live_plan.plan_recovery``.

Modules: this one runs the step loop and its commits; ``live_group`` owns the epochs and
process groups (steps 1, 2 and 4 and the arrival in 3), ``live_sync`` the checksum and
the state broadcast, ``live_plan`` the pure recovery decision, ``live_shards`` what
differs for a sharded model (replica groups of FSDP2 shards: ``--live-shards``), and
``live_settle`` how a replica group goes on from a step or a join together.

Backends: gloo with CPU tensors is the only implemented and tested path. NCCL is not
implemented (nor run on a GPU). The intended design: a
``ProcessGroupNCCL`` per epoch on the same fresh ``PrefixStore`` namespace, with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (which the agent sets) and the old group's
``abort()`` (``ncclCommAbort``, which, unlike gloo's abort, does release kernels stuck on
a dead peer) instead of leaking it; gradients and the state broadcast on the device.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

# A live script builds an optimizer, and the first optimizer built imports torch._dynamo
# (a large import, even after torch.distributed). Importing it with this module moves
# that into a warm spare's boot (spares import this module), off a replacement's recovery.
import torch._dynamo  # noqa: F401

from flexrun.errors import CheckpointError, ConfigError, LiveAborted, TrainingFinished
from flexrun.events import EventLog
from flexrun.live_protocol import EpochRecord, LiveEnv, MemberReport, mark_state, touch_heartbeat
from flexrun.train.live_durable import LiveDurability
from flexrun.train.live_goodput import LostTime
from flexrun.train.live_group import EpochGroup
from flexrun.train.live_plan import plan_recovery
from flexrun.train.live_portions import split_share
from flexrun.train.live_settle import settle
from flexrun.train.live_shards import Shards, shard_mesh
from flexrun.train.live_sync import broadcast_state, state_checksum, sum_replicas
from flexrun.train.stopsignal import hold as hold_stop_signal

log = logging.getLogger("flexrun.train.live")

PREEMPTED_EXIT = 143


class Step:
    """One global step as seen by one rank: its samples and a scaled ``backward``."""

    def __init__(self, loop: LiveLoop, number: int) -> None:
        self._loop = loop
        self.number = number
        self.rank = loop.rank
        self.world_size = loop.world_size
        if loop.shards is not None:  # (its group's portions: flexrun.train.live_portions)
            parts = [(v, [loop.sample_index(p) for p in ps], held)
                     for v, ps, held in loop.shards.portions.shares(number, loop.global_batch)]  # fmt: skip
            self._shares = [(v, ix) for v, ix, held in parts if not held]
            self.indices: list[int] = [i for _, ix, _ in parts for i in ix]  # (held ones too)
        else:
            start, end = split_share(loop.global_batch, loop.world_size, loop.rank)
            self.indices = [
                loop.sample_index(number * loop.global_batch + p) for p in range(start, end)
            ]

    def batches(self, micro_batch: int | None = None) -> Iterator[Any]:
        """This rank's share of the step's global batch, collated, in micro-batches (of a
        sharded model: each portion's apart, as many on every rank of a group)."""
        loop = self._loop
        if loop.shards is not None:
            chunks: Iterator[list[int]] | list[list[int]] = loop.shards.portions.chunks(
                self._shares, micro_batch, loop.global_batch, loop._params,
                lambda v: torch.manual_seed(loop.seed * 7919 + self.number * 104729 + v),
            )  # fmt: skip
        else:
            size = micro_batch or max(1, len(self.indices))
            chunks = [self.indices[i : i + size] for i in range(0, len(self.indices), size)]
        for chunk in chunks:
            self._loop._current_micro = len(chunk)
            yield self._loop.collate([self._loop.dataset[j] for j in chunk])

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss that is the mean over the last micro-batch, weighted by its
        share of the global batch (uneven splits are exact, not rejected)."""
        (loss * (self._loop._current_micro / self._loop.global_batch)).backward()


def _settled(shards: Shards | None, *, voted: bool) -> bool:
    """Whether the step's vote completed for this worker (``voted``) and, in a sharded
    model, for every member of its replica group (``live_settle.settle``). A sharded
    worker whose vote did not complete holds its portions' gradients (untouched by the
    abandoned sum); one whose did holds none (they are now the sum over groups)."""
    if shards is None:
        return voted
    if voted:
        shards.portions.drop()
    else:
        shards.portions.hold()
    return settle(voted=voted)


def _begin(loop: LiveLoop) -> None:
    """A step's start: no gradient, unless a sharded group holds its portions of it."""
    if loop.shards is not None:
        loop.shards.portions.begin(loop._params)
    else:
        for p in loop._params:
            p.grad = None


def _report(loop: LiveLoop) -> MemberReport:
    """What a worker posts in an epoch's agreement (its loss and group handle aside)."""
    if loop.shards is not None:
        return loop.shards.report(loop.committed, loop.has_state)
    return MemberReport(
        loop.committed, loop.has_state, state_checksum(loop.model) if loop.has_state else None
    )


def _default_collate(items: Sequence[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate(list(items))


class LiveLoop:
    """Iterate training steps that survive worker and node loss in-process.

    Usage::

        loop = LiveLoop(model, optimizer, dataset, global_batch=64, steps=500)
        for step in loop:
            for x, y in step.batches():
                step.backward(F.cross_entropy(model(x), y))

    After each ``for`` body, gradients are summed across the current members and the
    optimizer steps; that is the step's commit. Do not wrap the model in DDP.

    ``on_commit(step)``, if given, is called on every rank right after the optimizer step
    of each committed step (with its ``Step.number``), before any checkpoint save or
    membership change: the place to log what was trained, since a step's body can run
    again after a failure but a survivor commits it once (a fallback to the durable
    checkpoint rolls the count back, and steps after it are committed again).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        global_batch: int,
        steps: int,
        seed: int = 0,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 0,
        timeout_s: float = 120.0,
        environ: Mapping[str, str] | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        if global_batch < 1 or steps < 0:
            raise ConfigError(
                f"global_batch must be >= 1 and steps >= 0 (got {global_batch}, {steps})"
            )
        env_vars = os.environ if environ is None else environ
        self.env = LiveEnv.from_environ(env_vars)
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.global_batch = global_batch
        self.total_steps = steps
        self.seed = seed
        self.collate = collate_fn or _default_collate
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.timeout_s = timeout_s
        self.on_commit = on_commit
        self.committed = 0
        self.has_state = False
        self.rank = 0
        self.world_size = 1
        self._perm_cache: tuple[int, list[int]] | None = None
        self._current_micro = 0
        self._preempted = False
        self._flags = (0.0, 0.0)
        self._params = [p for p in model.parameters()]
        self.lost = LostTime()  # (what disruptions cost: the agent's ETTR subtracts it)
        self.events = EventLog(self.env.run_dir, run_id=self.env.run_id, node=self.env.worker_id)
        self.events.round = self.env.round
        self.group = EpochGroup(self.env, timeout_s=timeout_s, environ=env_vars, events=self.events)
        self.shards = (
            Shards(self.env, model, optimizer, self.group) if self.env.shards > 1 else None
        )
        """The replica-group side of a sharded model (``flexrun.train.live_shards``)."""
        self.durable = LiveDurability(
            checkpoint_dir, model=model, optimizer=optimizer, env=self.env, events=self.events
        )
        self._stop_hb = threading.Event()
        self._hb = threading.Thread(
            target=self._heartbeat, name="flexrun-live-heartbeat", daemon=True
        )
        self._touch()  # the agent admits this worker into an epoch once this file exists
        self._hb.start()
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            # (an uncaught exception ends the loop: the SIGTERM then ends the process)
            hold_stop_signal(signal.SIGTERM, self._on_sigterm, previous, lambda: self._preempted)

    # -- views of the group (also used by flexrun.train.metrics) ----------------------------
    @property
    def epoch(self) -> EpochRecord | None:
        return self.group.epoch

    @property
    def store(self) -> Any:
        return self.group.store

    @property
    def _pg(self) -> Any:
        return self.group.pg

    def _wait(self, work: Any) -> None:
        """Wait for a collective, watching for an aborting epoch change (LiveAborted)."""
        self.group.wait(work)

    # -- plumbing -----------------------------------------------------------------------
    def _touch(self) -> None:
        touch_heartbeat(self.env.heartbeat_file)

    def _heartbeat(self) -> None:
        while not self._stop_hb.wait(self.env.heartbeat_interval_s):
            try:
                self._touch()
            except OSError as exc:
                log.warning("live heartbeat failed: %s", exc)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted = True

    def sample_index(self, position: int) -> int:
        """Dataset index at global sample ``position`` (seeded permutation per data epoch)."""
        n = len(self.dataset)
        data_epoch, offset = divmod(position, n)
        if self._perm_cache is None or self._perm_cache[0] != data_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + data_epoch)
            self._perm_cache = (data_epoch, torch.randperm(n, generator=g).tolist())
        return self._perm_cache[1][offset]

    # -- the loop ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        self.events.emit("live_worker_ready", pid=os.getpid())  # (joiner latency breakdown)
        try:
            self._rejoin(reason="start")
        except TrainingFinished:
            # A replacement that arrived after the last step: nothing to train, and no
            # trained state to hand to the code after the loop. Leave quietly.
            self.events.emit("live_late_joiner_exit", committed=self.committed)
            self._retire()
            sys.exit(0)
        try:
            while self.committed < self.total_steps:
                torch.manual_seed(self.seed * 7919 + self.committed * 104729 + self.rank)
                _begin(self)
                step = Step(self, self.committed)
                yield step
                if not self._commit(step):
                    continue
                if _preempted_all(self):
                    return
            self.group.mark_done(self.total_steps)
            self.durable.wait()
        finally:
            self._retire()

    def _retire(self) -> None:
        """Leave the live protocol: stop heart-beating (the agent then stops watching for
        hangs) and make sure no process group is ever destroyed. A gloo group's destructor
        joins threads that may be stuck in ``recv`` from a peer of an old epoch, which would
        hang the process at exit."""
        self._stop_hb.set()
        if self._hb.is_alive():
            self._hb.join(timeout=2)
        with contextlib.suppress(OSError):
            self.env.heartbeat_file.unlink()
        self.group.leak_all()

    def _commit(self, step: Step) -> bool:
        try:
            # Once per step too: a small world's all-reduce may complete before _wait ever
            # looks, and a joiner would wait many steps to be noticed.
            self.group.check_epoch(time.monotonic())
            flags = torch.tensor(
                [1.0 if self.group.pending_change else 0.0, 1.0 if self._preempted else 0.0]
            )
            if self.shards is not None:
                self.shards.reduce(self.group.wait, flags, self.group.pg)
            else:
                flags = sum_replicas(self.group, self._params, flags)
        except LiveAborted as exc:
            _settled(self.shards, voted=False)
            self._rejoin(reason=str(exc))
            return False
        if not _settled(self.shards, voted=True):
            self._rejoin(reason="a group-mate did not see the step's vote complete")
            return False
        self.optimizer.step()
        self.committed += 1
        self.has_state = True
        if self.on_commit is not None:
            self.on_commit(step.number)
        if self.lost.committed(time.monotonic()):
            self._mark()
        self._flags = (float(flags[-2]), float(flags[-1]))
        every = self.checkpoint_every
        if every and self.committed % every == 0 and self.durable.saver:
            self.durable.save(self.committed)
        if self._flags[0] > 0 and not self._flags[1] > 0:
            self._rejoin(reason="membership change at a step boundary")
        return True

    # -- membership -------------------------------------------------------------------------
    def _rejoin(self, *, reason: str) -> None:
        t0 = time.monotonic()
        self.lost.disrupted()
        self.group.abandon()
        after = self.group.epoch.number if self.group.epoch is not None else -1
        while True:
            rec = self.group.next_epoch(after, has_state=self.has_state)
            try:
                self._join(rec, reason=reason, t0=t0)
                return
            except LiveAborted as exc:
                log.info("epoch %d did not form (%s); waiting for the next", rec.number, exc)
                if self.shards is not None:
                    self.shards.joins.failed(rec.number)
                after = rec.number

    def _join(self, rec: EpochRecord, *, reason: str, t0: float) -> None:
        sh = self.shards
        if sh is not None:
            sh.joins.tried(rec.number)
        report = replace(_report(self), lost_s=self.lost.lost_s, handle=self.group.inplace.handle())
        reports = self.group.agree(rec, report, has_state=self.has_state)
        self.lost.adopt(max(r.lost_s for r in reports))
        if sh is not None:
            layout, plan = sh.plan(reports, formed=self.group.formed_before())
        else:
            plan = plan_recovery(reports, formed=self.group.formed_before())
        self.rank, self.world_size = self.group.form(rec, [r.handle for r in reports])
        if sh is not None:
            sh.portions.adopt(reports, layout.groups, self.rank, keep=not plan.load_durable)
        self.durable.saver = self.rank in layout.groups[0] if sh is not None else self.rank == 0
        if sh is not None:
            # (shard i of every group: this shard's gradient sum and state transfer)
            replicas = layout.replicas(self.env.shard)
            sh.position = replicas.index(self.rank)
            sh.pg = self.group.subgroup(rec, f"r{self.env.shard}", sh.position, len(replicas))
        self._flags = (0.0, 0.0)
        error = None
        me = sh.position if sh is not None else self.rank
        if plan.load_durable and me == plan.source:
            try:
                self.committed = self.durable.restore(
                    rec.number, plan.fallback, has_state=self.has_state
                )
            except CheckpointError as exc:
                error = str(exc)
        if plan.transfer and sh is not None:
            sending = functools.partial(self.events.emit, "live_transfer_sending",
                epoch=rec.number, rank=self.rank, shard=self.env.shard, pid=os.getpid())  # fmt: skip
            self.committed = sh.transfer(self.group.wait, source=plan.source, step=self.committed,
                error=error, on_send=sending, vote_pg=self.group.pg)  # fmt: skip
        elif plan.transfer:
            self.committed = broadcast_state(
                self.group.pg,
                self.group.wait,
                rank=self.rank,
                source=plan.source,
                model=self.model,
                optimizer=self.optimizer,
                step=self.committed,
                error=error,
            )
        elif error is not None:
            raise CheckpointError(error)
        if sh is not None:  # (all of the replica group go on from this epoch, or none does)
            sh.joins.settle(rec.number)
        first = not self.has_state
        self.has_state = True
        self.events.round = self.env.round
        self.events.emit(
            "live_joined",
            epoch=rec.number,
            rank=self.rank,
            world_size=self.world_size,
            step=self.committed,
            source=plan.source if plan.transfer else None,
            fallback=plan.fallback,
            checksum=state_checksum(self.model),
            duration_s=round(time.monotonic() - t0, 4),
            reason=reason,
            group_path=self.group.inplace.formed,
        )
        self._mark()  # (this worker holds live state: see LiveSupervisor)
        if first:
            self.group.mark_formed(rec.number)

    def _mark(self) -> None:
        with contextlib.suppress(OSError):  # (the agent then sees no state, or an old total)
            mark_state(self.env.heartbeat_file, self.lost.lost_s)

    def close(self) -> None:
        """Wait for the last durable checkpoint and leave the live protocol. Idempotent."""
        self._retire()
        self.durable.close()


def _preempted_all(loop: LiveLoop) -> bool:
    """SIGTERM seen by some ranks: everyone agreed through the all-reduce flag."""
    flags = loop._flags
    if not flags[1] > 0:
        return False
    if int(flags[1]) >= loop.world_size:
        if loop.durable.saver and loop.checkpoint_dir:
            loop.durable.save(loop.committed, blocking=True)
        loop.events.emit("preempted", step=loop.committed, rank=loop.rank)
        loop._retire()
        sys.exit(PREEMPTED_EXIT)
    if loop._preempted:
        # Only this node is going away: leave after a committed step; the others
        # re-form without us and lose nothing.
        loop.events.emit("preempted", step=loop.committed, rank=loop.rank, partial=True)
        loop._retire()
        sys.exit(PREEMPTED_EXIT)
    return False


__all__ = [
    "EpochRecord",
    "LiveAborted",
    "LiveEnv",
    "LiveLoop",
    "Step",
    "shard_mesh",
    "split_share",
    "state_checksum",
]
