"""The checkpoint memory tier's policy: which saves are durable, where copies live, which loads.

Owns, for :class:`flexrun.train.checkpoint.Checkpointer` with ``durable_every``: the
decision per save (durable when ``blocking``, when no durable save happened yet in this
process, or when ``durable_every`` steps have passed since the last one; the decision
depends only on the step and what every rank knows, so all ranks agree), the node's copy
directory (a per-checkpoint-directory folder inside the memory directory the agent owns,
``FLEXRUN_MEMORY_DIR``), turning the tier off when it cannot work (no memory directory,
a state whose two copies pass ``memory_max_bytes``, a full memory filesystem: durable
saves only, said once per node with ``checkpoint_memory_off``), and the collective choice
at load time: the newest step any rank's node holds a verified copy of, unless durable
storage holds a newer one; a rank whose node lacks that copy receives it from the lowest
rank that has it (a replacement node restores from a peer), and verifies it again.

Replicated (DDP) state: every node's local rank 0 writes the whole state, so each
node holds its own copy and a lost node costs no other node anything (sharded state has its
own per-rank tier, :mod:`flexrun.train.memshard`). It does not write or verify copies (:mod:`flexrun.train.memsave`, :mod:`flexrun.train.memload`).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flexrun import worker_hook
from flexrun._clock import Clock
from flexrun.errors import CheckpointError
from flexrun.events import EventLog
from flexrun.train.context import TrainContext
from flexrun.train.durable_load import EXTRA_FILE, RNG_FILE
from flexrun.train.memload import decode, newest_valid
from flexrun.train.memsave import KEEP, MemSaver, payload_nbytes, prune, remove_stale
from flexrun.train.options import CheckpointOptions
from flexrun.train.rankzero import Loaded, deferrable_tensors

log = logging.getLogger(__name__)

META = "__memtier__"
"""Payload key of a copy's own record (step, world size): not a registered object."""


@dataclass(frozen=True, slots=True)
class MemoryLoad:
    """A state chosen from the memory tier (every rank holds it, verified)."""

    step: int
    state: dict[str, Any]
    peers: list[int]
    """Ranks that received the copy from another node's rank."""
    world_size: int
    """World size of the run that saved it."""

    def report(self, emit: Callable[..., None], load_s: float) -> Loaded:
        emit(
            "checkpoint_loaded",
            step=self.step,
            load_s=round(load_s, 6),
            saved_world_size=self.world_size,
            skipped=[],
            restored_from="memory",
            from_peer=self.peers,
        )
        extra = dict(self.state.get(EXTRA_FILE) or {})
        return Loaded(step=self.step, extra=extra, world_size=self.world_size, skipped=())


class TierBase:
    """What both memory tiers share: their folder in the node's memory directory, their
    events, and turning themselves off (durable saves only, said once, their copies
    removed). ``writer``: this rank writes the folder's copies and speaks for them."""

    label = "checkpoint memory tier"

    def __init__(
        self, options: CheckpointOptions, ctx: TrainContext, events: EventLog | None, writer: bool
    ) -> None:
        assert options.durable_every is not None
        self.every = options.durable_every
        self.cap = options.memory_max_bytes
        self._ctx = ctx
        self._events = events
        self.writer = writer
        self.last_durable: int | None = None
        self.off: str | None = None
        self.dir: Path | None = None

    def _base_dir(self, options: CheckpointOptions, directory: str, suffix: str) -> Path | None:
        """This checkpoint directory's folder in the memory directory (``suffix`` appended
        to its name), or None with the tier turned off when there is no memory directory."""
        base = options.memory_dir or self._ctx.memory_dir
        if base is None:
            self._turn_off("no memory directory (FLEXRUN_MEMORY_DIR is set by flexrun run)")
            return None
        return Path(base) / f"ckpt-{hashlib.sha256(directory.encode()).hexdigest()[:16]}{suffix}"

    def _open_dir(self, path: Path) -> None:
        """Use ``path``; the writer makes it (private) and clears a dead writer's leftovers."""
        self.dir = path
        if self.writer:
            try:
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                remove_stale(path)
            except OSError as exc:
                self._turn_off(f"memory directory {path} unusable: {exc}")

    def emit(self, event: str, **fields: Any) -> None:
        """An event of the copies this rank writes (a node's local rank 0 speaks for the
        node's replicated copy; each rank for its own shards)."""
        if self._events is not None and self.writer:
            try:
                self._events.emit(event, rank=self._ctx.rank, node=self._ctx.node, **fields)
            except OSError as exc:
                log.warning("could not log the %s event: %s", event, exc)

    def _turn_off(self, reason: str) -> None:
        if self.off is None:
            self.off = reason
            log.warning("%s off, durable saves only: %s", self.label, reason)
            self.emit("checkpoint_memory_off", reason=reason, durable_every=self.every)
            if self.dir is not None and self.writer:
                prune(self.dir, keep=0)


class MemoryTier(TierBase):
    """One Checkpointer's memory tier on this rank (see the module docstring)."""

    @classmethod
    def open(
        cls,
        directory: str,
        options: CheckpointOptions,
        ctx: TrainContext,
        events: EventLog | None,
        clock: Clock,
    ) -> MemoryTier | None:
        """The tier of a checkpointer of ``directory``; ``None`` without ``durable_every``."""
        if options.durable_every is None:
            return None
        return cls(directory=directory, options=options, ctx=ctx, events=events, clock=clock)

    def __init__(
        self,
        *,
        directory: str,
        options: CheckpointOptions,
        ctx: TrainContext,
        events: EventLog | None,
        clock: Clock,
    ) -> None:
        super().__init__(options, ctx, events, writer=ctx.local_rank == 0)
        self.wait_copies = options.memory_copy_wait
        self.skipped = 0
        """Memory-only saves whose copy was skipped: the previous one was still being
        written (``memory_copy_wait=False`` only)."""
        self.saver: MemSaver | None = None
        path = self._base_dir(options, directory, "")
        if path is not None:
            self.saver = MemSaver(path, clock)
            self._open_dir(path)

    # -- saving -----------------------------------------------------------------------------
    def durable_now(self, step: int, blocking: bool) -> bool:
        """Whether the save of ``step`` also goes to durable storage (same on every rank)."""
        last = self.last_durable
        durable = blocking or last is None or step < last or step - last >= self.every
        if durable:
            self.last_durable = step
        return durable

    def join(self) -> None:
        if self.saver is not None:
            self.saver.join()

    def join_before(self, durable: bool) -> None:
        """Before a save: wait for the copy under way, unless this save is memory-only and
        ``memory_copy_wait`` is off (then :meth:`save_copy` skips this save's copy)."""
        if durable or self.wait_copies or self.saver is None or not self.saver.busy:
            self.join()

    def wait(self) -> None:
        """Until the copy under way (if any) is written.

        Raises:
            CheckpointError: it failed for another reason than a full memory filesystem.
        """
        self.join()
        failed = self.take_error()
        if failed is not None:
            raise CheckpointError(failed)

    def take_error(self) -> str | None:
        """A failed background copy: a full or vanished memory filesystem turns the tier
        off (``None``: training goes on); anything else is returned to raise."""
        err = self.saver.take_error() if self.saver is not None else None
        if err is None:
            return None
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.ENOENT, errno.EROFS):
            self._turn_off(f"memory copy failed: {err}")
            return None
        return f"memory checkpoint copy failed on rank {self._ctx.rank}: {err!r}"

    def hold_until_copied(self) -> None:
        if self.saver is not None:
            self.saver.hold_until_copied()

    def start(
        self,
        step: int,
        payload: dict[str, Any],
        pending: list[tuple[torch.Tensor, torch.Tensor]],
        ready: Any = None,
    ) -> None:
        """Write this node's copy of ``payload`` (writer rank; a no-op when off)."""
        if not self.writer or self.off is not None or self.saver is None:
            return
        nbytes = payload_nbytes(payload)
        if self.cap is not None and KEEP * nbytes > self.cap:
            self._turn_off(
                f"the state takes {nbytes} bytes; {KEEP} copies pass memory_max_bytes={self.cap}"
            )
            return
        record = {"step": step, "world_size": self._ctx.world_size, "round": self._ctx.round}
        self.saver.start(step, {**payload, META: record}, pending, ready, worker_hook.counted())

    def save_copy(
        self,
        step: int,
        objects: dict[str, Any],
        extra: Mapping[str, Any] | None,
        rngs: list[Any] | None,
        optimizers: list[torch.optim.Optimizer],
        defer_copy: bool,
    ) -> None:
        """A memory-only save: snapshot the ``objects``' state into this tier's own host
        buffers (with ``defer_copy``, the optimizers' tensors are copied by the thread,
        before the next optimizer step) and write the copy in the background."""
        if not self.writer or self.off is not None or self.saver is None:
            return
        if self.saver.busy:
            self.skipped += 1
            return
        states = {name: obj.state_dict() for name, obj in objects.items()}
        defer = deferrable_tensors(optimizers) if defer_copy else None
        copied, pending = self.saver.snapshot.take(states, defer)
        payload = dict(copied)
        payload[EXTRA_FILE] = copy.deepcopy(dict(extra or {}))  # the caller may mutate it
        if rngs is not None:
            payload[RNG_FILE] = rngs
        self.start(step, payload, pending)

    # -- loading ----------------------------------------------------------------------------
    def choose(
        self,
        durable_newest: int | None,
        gather: Callable[[Any], list[Any]],
    ) -> MemoryLoad | None:
        """Collective: the newest verified copy on any node, unless durable storage (``durable_newest``, known on
        rank 0) holds a newer step or no node has a copy (``None``: load from durable)."""
        found: tuple[int, bytes] | None = None
        if self.dir is not None and self.off is None:
            found = newest_valid(
                self.dir,
                lambda s, why: self.emit("checkpoint_memory_skipped", step=s, reason=why),
            )
        gathered = gather((None if found is None else found[0], durable_newest))
        durable = gathered[0][1]
        steps = [s for s, _ in gathered if s is not None]
        best = max(steps) if steps else None
        self.last_durable = durable
        if best is None or (durable is not None and durable > best):
            return None
        blob = found[1] if found is not None and found[0] == best else None
        holders = [r for r, (s, _) in enumerate(gathered) if s == best]
        receivers = [r for r in range(len(gathered)) if r not in holders]
        if receivers:
            box = [blob if self._ctx.rank == holders[0] else None]
            dist.broadcast_object_list(box, src=holders[0])
            blob = box[0]
        assert blob is not None
        where = "peer" if self._ctx.rank in receivers else "memory"
        state = decode(blob, what=f"memory copy of step {best} ({where})")
        meta = state.pop(META, None)
        if not isinstance(meta, dict) or meta.get("step") != best:
            raise CheckpointError(f"memory copy of step {best} has no matching record")
        return MemoryLoad(best, state, receivers, int(meta.get("world_size", 0)))
