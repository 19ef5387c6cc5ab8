"""Live mode's durable checkpoints: the step loop's Checkpointer, and restoring from it.

Owns the one place a live job touches durable storage: periodic saves by the epoch's
rank 0 (built lazily, so a job without ``checkpoint_dir`` never imports the checkpoint
machinery), and the restore at a job's start or when live state cannot be trusted, with
the ``live_fallback`` event that says so. The step loop is :mod:`flexrun.train.live`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from flexrun.errors import CheckpointError
from flexrun.events import EventLog
from flexrun.live_protocol import LiveEnv

log = logging.getLogger("flexrun.train.live")


class LiveDurability:
    """The durable side of one live worker's model and optimizer."""

    def __init__(
        self,
        checkpoint_dir: str | None,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        env: LiveEnv,
        events: EventLog,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.model = model
        self.optimizer = optimizer
        self.env = env
        self.events = events
        self._ckpt: Any = None
        self._save_group: Any = None
        if env.shards > 1 and checkpoint_dir:
            # A replica group's asynchronous saves run on a gloo group of their own, formed
            # over the group's store. Formed now, with the group: formed lazily at the
            # group's first save, after the store had restarted (the group's store client
            # does not reconnect), it hung for minutes and then killed the group
            # (DistNetworkError: Broken pipe; a group becomes the saver when the first
            # group is lost, so its first save can come long after it formed).
            import torch.distributed as dist

            self._save_group = dist.new_group(backend="gloo")
        self.saver = True
        """This worker takes part in the saves: the epoch's rank 0 (whole-model replicas)
        or a member of its first replica group (a sharded model: a collective save of the
        group's shards)."""

    def checkpointer(self) -> Any:
        """The Checkpointer (built on first use).

        Raises:
            CheckpointError: no checkpoint_dir was given.
        """
        if self._ckpt is None:
            if not self.checkpoint_dir:
                raise CheckpointError("checkpoint_dir is not set")
            from flexrun.train.context import single_process_context

            ctx = single_process_context(run_dir=self.env.run_dir, round=self.env.round)
            if self.env.shards > 1:
                # A replica group's shards, saved and loaded collectively over its own
                # (the process's default) group, through DCP with flexrun's commit.
                from dataclasses import replace

                from flexrun.train.sharded import ShardedCheckpointer

                ctx = replace(ctx, rank=self.env.shard, world_size=self.env.shards,
                              run_id=self.env.run_id, backend="gloo")  # fmt: skip
                self._ckpt = ShardedCheckpointer(
                    self.checkpoint_dir, ctx=ctx, save_rng=False, save_group=self._save_group
                )
            else:
                from flexrun.train.checkpoint import Checkpointer

                self._ckpt = Checkpointer(self.checkpoint_dir, ctx=ctx, save_rng=False)
            self._ckpt.register("model", self.model)
            self._ckpt.register("optim", self.optimizer)
        return self._ckpt

    def save(self, step: int, *, blocking: bool = False) -> None:
        if self.env.shards > 1:
            self.checkpointer().save(step, extra={"step": step}, asynchronous=not blocking)
        else:
            self.checkpointer().save(step, extra={"step": step}, blocking=blocking)

    def restore(self, epoch: int, fallback: str | None, *, has_state: bool) -> int:
        """Restore the newest durable checkpoint into this (source) member, as restart mode
        would: at the job's start (a resume), or because live state is lost or inconsistent
        (``fallback`` says why; then the event log says so). Returns the committed step.

        Raises:
            CheckpointError: live state is inconsistent and there is no durable checkpoint
                to fall back to, or checkpoints exist and none verifies.
        """
        loaded = self.checkpointer().load() if self.checkpoint_dir else None
        if loaded is not None:
            step = int(loaded.extra.get("step", loaded.step))
            source = "durable checkpoint"
        elif fallback is not None and has_state:
            # The weights in memory were trained past step 0 and some member's differ:
            # there is nothing trustworthy to continue from.
            raise CheckpointError(
                f"{fallback}, and there is no durable checkpoint to fall back to"
                f" (checkpoint_dir={self.checkpoint_dir!r})"
            )
        else:
            # Fresh processes: their state is the script's initial state, as in a restart
            # without a checkpoint.
            step = 0
            source = "initial state (no durable checkpoint)"
        if fallback is not None:
            log.warning(
                "live fallback in epoch %d: %s; resuming from %s at step %d",
                epoch,
                fallback,
                source,
                step,
            )
            self.events.emit(
                "live_fallback", epoch=epoch, reason=fallback, step=step, source=source
            )
        return step

    def wait(self) -> None:
        """Wait for a background save in flight."""
        if self._ckpt is not None:
            self._ckpt.wait()

    def close(self) -> None:
        """Wait for the last save; a whole-model Checkpointer also closes (the sharded one
        has nothing to close: calling its absent ``close()`` made every sharded saver exit
        1 in ``LiveLoop.close()`` after its last step)."""
        if self._ckpt is None:
            return
        if self.env.shards > 1:
            self._ckpt.wait()
        else:
            self._ckpt.close()
