"""The background persist of a replicated checkpoint: one thread, paced, errors handed over.

Owns, for :class:`flexrun.train.checkpoint.Checkpointer`: claiming the directory's fence,
running a persist (deferred host copies, then every file through the commit protocol) on a
background thread at most one at a time, paced to a share of a core and at idle
priority, counting the saves the storage refused (``max_failed_saves`` over
``failed_saves_grace_s``), retention after each commit, the ``checkpoint_saved`` and
``checkpoint_save_failed`` events, and handing any other error to the training thread
at its next call. It does not decide what is saved or when.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from flexrun import worker_hook
from flexrun._clock import Clock
from flexrun.errors import CheckpointError, StorageFailure
from flexrun.train.context import TrainContext
from flexrun.train.layout import (
    CommitProtocol,
    FaultHook,
    Manifest,
    VerifiedCache,
    prune,
    step_dir_name,
)
from flexrun.train.options import CheckpointOptions
from flexrun.train.pacing import CpuPacer, IdlePriority
from flexrun.train.serialize import torch_writer
from flexrun.train.state import run_copies

log = logging.getLogger(__name__)


class _FailedSaves:
    """Counts saves the storage refused in a row; says when they must end the run."""

    def __init__(self, limit: int, grace_s: float) -> None:
        self.limit, self.grace_s = limit, grace_s
        self.count = 0
        self._since = 0.0

    def record(self, now: float) -> tuple[int, float, bool]:
        """One more failure at ``now``: (count, seconds failing, fatal)."""
        if self.count == 0:
            self._since = now
        self.count += 1
        failing_s = now - self._since
        return self.count, failing_s, self.count >= self.limit and failing_s >= self.grace_s


class Persister:
    """Commits one checkpoint at a time for rank 0 (see the module docstring)."""

    def __init__(
        self,
        proto: CommitProtocol,
        *,
        ctx: TrainContext,
        options: CheckpointOptions,
        clock: Clock,
        fault_hook: FaultHook | None,
        emit: Callable[..., None],
        objects: Callable[[], list[str]],
    ) -> None:
        self._proto, self._ctx, self.options, self._clock = proto, ctx, options, clock
        self._fault_hook = fault_hook
        self._emit = emit
        self._object_names = objects
        self._verified = VerifiedCache()
        self._pacer: CpuPacer | None = None
        self._idle: IdlePriority | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._copy_wait_s = 0.0
        self._save_stall_s = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failures = _FailedSaves(options.max_failed_saves, options.failed_saves_grace_s)
        self._fence_claimed = False
        self._generation = ctx.round

    def claim_fence(self) -> None:
        """Claim the directory for this round and remove what crashed writers left.

        Raises:
            FencedError: a newer round owns the directory.
            CheckpointError: the fence cannot be read or written.
        """
        self._generation = self._proto.claim(run=self._ctx.run_id, round=self._ctx.round)
        self._fence_claimed = True

    def start(
        self,
        step: int,
        payload: dict[str, Any],
        pending: list[tuple[torch.Tensor, torch.Tensor]],
        counted: int = -1,
    ) -> None:
        """Persist ``payload`` as ``step`` on a background thread (after ``pending`` copies);
        ``counted``: the worker's step count when the state was taken (said once committed:
        :func:`flexrun.worker_hook.saved`)."""
        if pending:
            self._copied.clear()
        share = self.options.persist_cpu_share
        self._pacer = (
            CpuPacer(share, self._clock, free_s=self.options.persist_free_cpu_s)
            if share is not None and share < 1
            else None
        )
        self._idle = IdlePriority() if self.options.persist_when_idle else None
        self._thread = threading.Thread(
            target=self._persist_bg,
            args=(step, payload, pending, counted),
            name=f"flexrun-ckpt-{step}",
        )
        self._thread.start()

    def hold_until_copied(self) -> None:
        """Block the caller (an optimizer step) until the deferred host copy is done."""
        if not self._copied.is_set():
            t0 = self._clock.monotonic()
            self._copied.wait()
            self._copy_wait_s += self._clock.monotonic() - t0

    @property
    def persisting(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        # Someone waits for it now: finish at full speed and at normal priority.
        if self._pacer is not None:
            self._pacer.hurry()
        if self._idle is not None:
            self._idle.leave()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take_pending(self) -> CheckpointError | None:
        err, self._error = self._error, None
        if err is None:
            return None
        what = str(err) if isinstance(err, CheckpointError) else repr(err)
        out = CheckpointError(f"background checkpoint save failed: {what}")
        out.__cause__ = err
        return out

    def _persist_bg(
        self,
        step: int,
        payload: dict[str, Any],
        pending: list[tuple[torch.Tensor, torch.Tensor]],
        counted: int,
    ) -> None:
        try:
            try:
                run_copies(pending)  # at normal priority: the next optimizer step waits on it
            finally:
                self._copied.set()
            if self._idle is not None:
                self._idle.enter()
            self.persist(step, payload, background=True, counted=counted)
        except BaseException as exc:  # handed to the training thread on its next call
            self._error = exc
        finally:
            if self._idle is not None:
                self._idle.done()

    def persist(
        self, step: int, payload: dict[str, Any], *, background: bool, counted: int = -1
    ) -> None:
        t0 = self._clock.monotonic()
        pacer = self._pacer if background else None
        if pacer is not None:
            pacer.start()
        rate = self.options.persist_max_bytes_s if background else None
        try:
            if not self._fence_claimed:
                self.claim_fence()
            manifest = self._commit(step, payload, rate, pacer)
        except StorageFailure as exc:
            self._storage_failed(step, exc)
            return
        except CheckpointError as exc:
            self._emit("checkpoint_save_failed", step=step, error=str(exc), fatal=True)
            raise
        self._failures.count = 0
        self._verified.mark(self._proto, step)
        worker_hook.saved(counted)
        persist_s = self._clock.monotonic() - t0
        removed: list[int] = []
        try:
            removed = prune(
                self._proto,
                keep_last=self.options.keep_last,
                keep_every=self.options.keep_every,
                protect=step,
                cache=self._verified,
            )
        except CheckpointError as exc:  # the new checkpoint is committed; pruning retries later
            log.warning("checkpoint retention could not delete old checkpoints: %s", exc)
        self._emit(
            "checkpoint_saved",
            step=step,
            bytes=manifest.total_bytes,
            # Background: time in save() plus the optimizer step's wait for the copy;
            # foreground: the whole save, persisting included.
            stall_s=round(self._save_stall_s + (self._copy_wait_s if background else persist_s), 6),
            persist_s=round(persist_s, 6),
            path=self._proto.path(step_dir_name(step)),
            pruned=removed,
        )

    def _commit(
        self, step: int, payload: dict[str, Any], rate: float | None, pacer: CpuPacer | None
    ) -> Manifest:
        """Write every file of ``step`` and publish it; on failure leave nothing behind."""
        hook = self._fault_hook or (lambda _stage: None)
        staged = self._proto.begin(step, round=self._ctx.round, generation=self._generation)
        published = False
        try:
            hook("dir_created")
            entries: dict[str, dict[str, Any]] = {}
            for key, value in payload.items():
                name = key if key.endswith(".pt") else f"{key}.pt"
                writer = torch_writer(value, rate, self._clock, pacer)
                entries[name] = self._proto.write(staged, name, writer)
                hook("file_written")
            hook("files_written")
            manifest = self._proto.publish(
                staged,
                world_size=self._ctx.world_size,
                entries=entries,
                meta={"kind": "replicated", "objects": sorted(self._object_names())},
                clock=self._clock,
                fault_hook=self._fault_hook,
            )
            published = True
            return manifest
        finally:
            if not published:
                try:
                    self._proto.discard(staged)
                except CheckpointError as cleanup:  # the original error matters more
                    log.warning("checkpoint cleanup failed: %s", cleanup)

    def _storage_failed(self, step: int, exc: StorageFailure) -> None:
        """Report a save the storage refused; raise once ``max_failed_saves`` in a row did,
        over at least ``failed_saves_grace_s``."""
        count, failing_s, fatal = self._failures.record(self._clock.monotonic())
        limit, grace = self._failures.limit, self._failures.grace_s
        self._emit(
            "checkpoint_save_failed",
            step=step,
            reason=exc.reason,
            error=str(exc),
            consecutive=count,
            max_failed_saves=limit,
            failing_s=round(failing_s, 3),
            fatal=fatal,
        )
        if fatal:
            raise CheckpointError(
                f"{count} checkpoint saves in a row failed over {failing_s:.0f} s "
                f"(max_failed_saves={limit}, failed_saves_grace_s={grace:g}), the last at "
                f"step {step}: {exc}"
            ) from exc
        log.warning(
            "checkpoint save at step %d failed (%s, %d in a row over %.0f s, limit %d over %g s); "
            "training goes on, the previous checkpoints are intact and the next save tries "
            "again: %s",
            step,
            exc.reason,
            count,
            failing_s,
            limit,
            grace,
            exc,
        )

    # -- loading ------------------------------------------------------------------------
