"""The Checkpointer: what a training script calls to save and resume.

Owns which state is saved (registered stateful objects, per-rank RNG states, user
extras), when the training loop may continue (after the host copy; persisting runs on a
background thread, at most one in flight), how errors reach the caller (a save the storage
refuses, e.g. a full disk or an unreachable object store, is reported and training goes on
until ``max_failed_saves`` in a row have failed over at least ``failed_saves_grace_s``; any
other error, and that limit, raise on every rank at the next ``save()``, never silently),
which checkpoint is loaded (the newest that verifies, with a fallback event for each one
skipped), and the checkpoint events. How a checkpoint becomes visible is the commit
protocol's, chosen once from the directory (``flexrun.train.commit_object.open_commit``:
rename on POSIX filesystems, manifest last on object stores); the names, verification and
retention are ``flexrun.train.layout``'s; the knobs are :class:`CheckpointOptions`.

Replicated (DDP) state: rank 0 is the one writer; RNG states of all ranks are gathered to
it; every rank reads the checkpoint that rank 0 chose. After a resize, ranks that did not
exist in the saved run keep the RNG state the script seeded. Sharded (FSDP/DTensor) state goes
through :class:`flexrun.train.sharded.ShardedCheckpointer` instead.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from flexrun import worker_hook
from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import CheckpointError, StorageFailure
from flexrun.events import EventLog
from flexrun.train.commit_object import open_commit
from flexrun.train.context import TrainContext, current, single_process_context
from flexrun.train.durable_load import (
    EXTRA_FILE,
    RNG_FILE,
    Found,
    newest_durable,
    read_replicated,
)
from flexrun.train.layout import (
    CommitProtocol,
    FaultHook,
    Manifest,
)
from flexrun.train.memtier import MemoryTier
from flexrun.train.objstore import ObjectStore
from flexrun.train.options import DEFAULT_PERSIST_CPU_SHARE, CheckpointOptions
from flexrun.train.persist import Persister
from flexrun.train.progress import install_stack_dump
from flexrun.train.rankzero import (
    Loaded,
    RankZero,
    Stateful,
    StorageOptions,
    deferrable_tensors,
    resolve_storage_options,
)
from flexrun.train.serialize import (
    load_weights_only,
    save_without_zip_crc,
)
from flexrun.train.state import (
    HostSnapshot,
    capture_rng,
    restore_rng,
    synchronize_device,
)
from flexrun.train.storage import Storage

__all__ = [
    "DEFAULT_PERSIST_CPU_SHARE",
    "CheckpointOptions",
    "Checkpointer",
    "Loaded",
    "RankZero",
    "Stateful",
    "StorageOptions",
    "resolve_storage_options",
    "load_weights_only",
    "save_without_zip_crc",
]

log = logging.getLogger(__name__)


class Checkpointer(RankZero):
    """Saves and restores registered state under a directory or fsspec URL.

    Every rank constructs one and calls ``save``/``load`` at the same steps (they are
    collective when a process group exists).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        options: CheckpointOptions | None = None,
        storage_options: StorageOptions = None,
        ctx: TrainContext | None = None,
        events: EventLog | None = None,
        storage: Storage | ObjectStore | None = None,
        clock: Clock = SYSTEM_CLOCK,
        fault_hook: FaultHook | None = None,
        **option_kwargs: Any,
    ) -> None:
        """
        Args:
            directory: local/shared directory or fsspec URL (``s3://bucket/prefix``,
                ``memory://`` ...); URLs commit manifest-last (see the table of tested stores
                and what each guarantees in docs/user/train.md).
            options: the knobs (:class:`CheckpointOptions`); the defaults when omitted.
            storage_options: fsspec options for a URL (endpoint URL, region, profile ...;
                e.g. ``{"endpoint_url": "http://minio:9000"}``), or ``"env"`` to take the
                JSON object in ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (what the Kubernetes
                and pipeline specs' ``storageOptions`` render to). Credentials come from
                the store's own chain, never from here when they travel in a spec.
            ctx: from :func:`flexrun.train.init`; defaults to the current one, else a
                single-process context.
            events: event log; by default one in ``ctx.run_dir`` when that is set.
            storage: file or object operations (default: chosen from ``directory``);
                tests inject faults.
            clock: time source for stall/persist durations.
            fault_hook: called at each commit stage (tests only).
            **option_kwargs: any :class:`CheckpointOptions` field as a keyword argument
                (``keep_last=2``, ``async_save=False`` ...), as before that record
                existed; applied over ``options``.

        Raises:
            TypeError: an unknown keyword argument.
            CheckpointError: bad option values, unusable directory, or this writer's
                round is older than the directory's fence (a straggler). A directory the
                storage refuses to write (full, read-only, unreachable) is not an error
                here: claiming its fence is retried by the first save.
            ConfigError: ``storage_options="env"`` and the variable is malformed.
        """
        self.options = CheckpointOptions.build(options, option_kwargs)
        install_stack_dump()
        self._ctx = ctx or current() or single_process_context()
        self._proto: CommitProtocol = open_commit(
            directory, storage_options=resolve_storage_options(storage_options), storage=storage
        )
        self._clock = clock
        self._objects: dict[str, Stateful] = {}
        self._snapshot = HostSnapshot()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._closed = False
        self._setup_events(events)
        self._p = Persister(
            self._proto,
            ctx=self._ctx,
            options=self.options,
            clock=clock,
            fault_hook=fault_hook,
            emit=self._emit,
            objects=lambda: list(self._objects),
        )
        self._mem = MemoryTier.open(self.directory, self.options, self._ctx, self._events, clock)
        if self._ctx.is_main:
            try:
                self._p.claim_fence()
            except StorageFailure as exc:
                log.warning("checkpoint fence not claimed yet (retried by the first save): %s", exc)
                self._emit("checkpoint_fence_deferred", reason=exc.reason, error=str(exc))

    # -- registration -------------------------------------------------------------------

    def register(self, name: str, obj: Stateful) -> None:
        """Save and restore ``obj`` under ``name`` (a model, optimizer, scheduler, sampler...).

        Raises:
            CheckpointError: the name is taken, reserved, or not a plain file-name stem.
        """
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise CheckpointError(f"checkpoint name {name!r} must be alphanumeric (-, _ allowed)")
        if name in self._objects or f"{name}.pt" in (RNG_FILE, EXTRA_FILE):
            raise CheckpointError(f"checkpoint name {name!r} is already used")
        self._objects[name] = obj
        if isinstance(obj, torch.optim.Optimizer):
            obj.register_step_pre_hook(self._hold_step_until_copied)
            self._optimizers.append(obj)

    def _hold_step_until_copied(self, *_args: Any) -> None:
        self._p.hold_until_copied()
        if self._mem is not None:
            self._mem.hold_until_copied()

    @property
    def last_stall_s(self) -> float:
        """How long the last save blocked training: inside ``save()`` plus any wait of the
        next ``optimizer.step()`` for the deferred copy (so far)."""
        mem = self._mem.saver if self._mem is not None else None
        return self._p._save_stall_s + self._p._copy_wait_s + (mem.copy_wait_s if mem else 0)

    @property
    def directory(self) -> str:
        """The root: a path, or a URL with its protocol."""
        return self._proto.path()

    @property
    def persisting(self) -> bool:
        """True while a background persist is in flight."""
        return self._p.persisting

    @property
    def failed_saves(self) -> int:
        """How many saves in a row the storage refused (0 after a committed save). Only
        the writing rank (rank 0) counts; read it after ``wait()`` for the latest."""
        return self._p._failures.count

    @property
    def memory_copies_skipped(self) -> int:
        """Memory-only saves that skipped their copy (``memory_copy_wait=False``)."""
        return self._mem.skipped if self._mem is not None else 0

    def steps(self) -> list[int]:
        """Committed (not necessarily verified) checkpoint steps, ascending."""
        return self._proto.steps()

    # -- saving -------------------------------------------------------------------------

    def save(
        self, step: int, *, extra: Mapping[str, Any] | None = None, blocking: bool = False
    ) -> None:
        """Checkpoint all registered state as ``step``. Collective: every rank calls it.

        Blocks while the previous persist (if any) finishes and while state is copied to
        host memory; then persisting continues in the background unless ``blocking`` (or
        the checkpointer is synchronous), in which case it returns once the checkpoint is
        committed on every rank's view.

        A save the storage refuses (full disk, read-only, I/O error, unreachable store)
        does not raise until ``max_failed_saves`` in a row have failed (see the options).

        Raises:
            CheckpointError: on every rank: a previous background save failed for another
                reason than the storage, or reached ``max_failed_saves``; or (foreground
                saves) this one did. The previous committed checkpoint is intact.
        """
        if self._closed:
            raise CheckpointError("save() after close()")
        opts = self.options
        t0 = self._clock.monotonic()
        mem = self._mem
        durable = mem is None or mem.durable_now(step, blocking)
        if durable:  # (a memory-only save lets a durable persist go on)
            self._p.join()
        if mem is not None:
            mem.join_before(durable)
        earlier = self._p.take_pending() if self._ctx.is_main else None
        failed = None if earlier is None else str(earlier)
        if failed is None and mem is not None:
            failed = mem.take_error()
        rng = capture_rng() if opts.save_rng else None
        # One collective tells every rank what any knows: they raise together instead
        # of leaving the others blocked in their next collective.
        out = self._gather((rng, failed))
        rngs = None if rng is None else [r for r, _ in out]
        errors = [e for _, e in out if e is not None]
        if errors:
            raise CheckpointError(errors[0]) from earlier
        error: CheckpointError | None = None
        foreground = durable and (blocking or not opts.async_save)
        if not (durable and self._ctx.is_main):
            if mem is not None:
                mem.save_copy(step, self._objects, extra, rngs, self._optimizers, opts.defer_copy)
                self._p._save_stall_s, self._p._copy_wait_s = self._clock.monotonic() - t0, 0.0
        else:
            background = not foreground
            defer = deferrable_tensors(self._optimizers) if background and opts.defer_copy else None
            states = {name: obj.state_dict() for name, obj in self._objects.items()}
            copied, pending = self._snapshot.take(states, defer)
            synchronize_device()
            payload: dict[str, Any] = dict(copied)
            payload[EXTRA_FILE] = copy.deepcopy(dict(extra or {}))  # the caller may mutate it
            if rngs is not None:
                payload[RNG_FILE] = rngs
            self._p._copy_wait_s = 0.0
            self._p._save_stall_s = self._clock.monotonic() - t0
            counted = worker_hook.counted()  # (said once the checkpoint can be resumed from)
            if background:
                self._p.start(step, payload, pending, counted)
            else:
                try:
                    self._p.persist(step, payload, background=False, counted=counted)
                except CheckpointError as exc:
                    error = exc
            if mem is not None:  # the same host copy, once the persist has made it
                mem.start(step, payload, [], self._p._copied if background else None)
            self._p._save_stall_s = self._clock.monotonic() - t0
        if foreground and self._distributed():
            # Also the barrier of a blocking save: no rank goes on before the commit.
            outcome = self._broadcast(None if error is None else str(error))
            if outcome is not None:
                raise CheckpointError(outcome) from error
        elif error is not None:
            raise error

    def wait(self) -> None:
        """Block until the in-flight persist (if any) is committed or has failed.

        A persist the storage refused below ``max_failed_saves`` in a row does not raise
        (it was reported as ``checkpoint_save_failed``); :attr:`failed_saves` says so.

        Raises:
            CheckpointError: the background persist failed otherwise, or reached the limit.
        """
        self._p.join()
        err = self._p.take_pending()
        if err is not None:
            raise err
        if self._mem is not None:
            self._mem.wait()

    def close(self) -> None:
        """Wait for the in-flight persist; later saves are refused. Idempotent.

        Raises:
            CheckpointError: the background persist failed.
        """
        if self._closed:
            return
        self._closed = True
        self.wait()

    def load(self, *, step: int | None = None) -> Loaded | None:
        """Restore the newest checkpoint that verifies (or exactly ``step``). Collective.

        Checkpoints that fail verification (missing files, wrong checksum, refused pickle)
        are skipped with a ``checkpoint_fallback`` event. Returns ``None`` when there is
        no checkpoint at all (a fresh start).

        Raises:
            CheckpointError: checkpoints exist but none verifies, ``step`` does not verify,
                or a registered object is missing from the checkpoint.
        """
        self.wait()
        t0 = self._clock.monotonic()
        if self._mem is not None and step is None:
            got = self._mem.choose(
                max(self.steps(), default=None) if self._ctx.is_main else None, self._gather
            )
            if got is not None:
                self._apply(got.state)
                return got.report(self._emit, self._clock.monotonic() - t0)
        found: Found = (None, None, [], None)
        if self._ctx.is_main:
            candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
            found = newest_durable(candidates, self._read, self._emit, self.directory)
        chosen, loaded, skipped, failure = found
        chosen, failure = self._broadcast((chosen, failure))
        if failure is not None:
            raise CheckpointError(failure)
        if chosen is None:
            return None
        if loaded is None:
            loaded = self._read(chosen)
        manifest, state = loaded
        self._apply(state)
        self._emit(
            "checkpoint_loaded",
            step=chosen,
            bytes=manifest.total_bytes,
            load_s=round(self._clock.monotonic() - t0, 6),
            saved_world_size=manifest.world_size,
            skipped=skipped,
            restored_from="durable",
        )
        return Loaded(
            step=chosen,
            extra=dict(state.get(EXTRA_FILE) or {}),
            world_size=manifest.world_size,
            skipped=tuple(skipped),
        )

    def _read(self, step: int) -> tuple[Manifest, dict[str, Any]]:
        return read_replicated(
            self._proto, step, list(self._objects), self._p._verified, self._ctx.is_main
        )

    def _apply(self, state: dict[str, Any]) -> None:
        for name, obj in self._objects.items():
            obj.load_state_dict(state[name])
        rngs = state.get(RNG_FILE)
        if self.options.save_rng and isinstance(rngs, list) and self._ctx.rank < len(rngs):
            restore_rng(rngs[self._ctx.rank])
