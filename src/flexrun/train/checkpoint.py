"""The Checkpointer: what a training script calls to save and resume.

Owns which state is saved (registered stateful objects, per-rank RNG states, user
extras), when the training loop may continue (after the host copy; persisting runs on a
background thread, at most one in flight), how errors reach the caller (a save the storage
refuses, e.g. a full disk, is reported and training goes on until ``max_failed_saves`` in
a row have failed over at least ``failed_saves_grace_s``; any other error, and that limit,
raise on every rank at the next
``save()``, never silently), which checkpoint is loaded (the newest that verifies, with a
fallback event for each one skipped), and the checkpoint events. The layout and commit
protocol live in ``flexrun.train.commit``; file operations in ``flexrun.train.storage``.

Replicated (DDP) state: rank 0 is the one writer; RNG states of all ranks are gathered to
it; every rank reads the checkpoint that rank 0 chose. After a resize, ranks that did not
exist in the saved run keep the RNG state the script seeded. Sharded (FSDP/DTensor) state goes
through :class:`flexrun.train.sharded.ShardedCheckpointer` instead.
"""

from __future__ import annotations

import copy
import io
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import CheckpointError
from flexrun.events import EventLog
from flexrun.train.commit import (
    FaultHook,
    Manifest,
    claim_fence,
    commit_checkpoint,
    list_steps,
    prune,
    remove_stale_staging,
    verify_checkpoint,
)
from flexrun.train.context import TrainContext, current, single_process_context
from flexrun.train.state import (
    HostSnapshot,
    capture_rng,
    restore_rng,
    run_copies,
    synchronize_device,
)
from flexrun.train.storage import (
    CpuPacer,
    PacedWriter,
    Storage,
    StorageFailure,
    ThrottledWriter,
    open_storage,
)

log = logging.getLogger(__name__)

RNG_FILE = "rng.pt"
EXTRA_FILE = "extra.pt"

DEFAULT_PERSIST_CPU_SHARE = 0.1
"""Default share of one core a background persist may use (see ``Checkpointer``)."""


class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()`` (modules, optimizers, samplers...)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Loaded:
    """What :meth:`Checkpointer.load` restored."""

    step: int
    """The step the checkpoint was saved at."""
    extra: dict[str, Any]
    """User extras passed to ``save(extra=...)`` (epoch, counters ...)."""
    world_size: int
    """World size of the run that saved it."""
    skipped: tuple[int, ...]
    """Newer checkpoints that failed verification and were skipped."""


def load_weights_only(blob: bytes, *, what: str) -> Any:
    """Deserialize with ``weights_only=True``: a checkpoint can never run code.

    Raises:
        CheckpointError: the bytes are not a torch file or contain non-allowlisted objects.
    """
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError ...
        raise CheckpointError(f"{what}: refused to load (weights_only): {exc}") from exc


class Checkpointer:
    """Saves and restores registered state under a directory or fsspec URL.

    Every rank constructs one and calls ``save``/``load`` at the same steps (they are
    collective when a process group exists).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ctx: TrainContext | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        defer_copy: bool = True,
        persist_cpu_share: float | None = DEFAULT_PERSIST_CPU_SHARE,
        persist_max_bytes_s: float | None = None,
        persist_when_idle: bool = True,
        save_rng: bool = True,
        max_failed_saves: int = 3,
        failed_saves_grace_s: float = 60.0,
        events: EventLog | None = None,
        storage: Storage | None = None,
        clock: Clock = SYSTEM_CLOCK,
        fault_hook: FaultHook | None = None,
    ) -> None:
        """
        Args:
            directory: local/shared directory or fsspec URL (``memory://``, ``s3://`` ...).
            ctx: from :func:`flexrun.train.init`; defaults to the current one, else a
                single-process context.
            keep_last: how many newest checkpoints retention keeps (>= 1).
            keep_every: also keep every checkpoint whose step is a multiple of this.
            async_save: persist on a background thread (the loop blocks for the host copy).
            defer_copy: with ``async_save``, copy parameters and optimizer state of
                registered optimizers on the background thread too, and hold the next
                ``optimizer.step()`` (a step pre-hook) until that copy is done, so
                ``save()`` itself returns in milliseconds. Requires that those tensors
                change only inside ``optimizer.step()``; pass ``False`` if the script
                mutates parameters elsewhere. Everything else is copied inside ``save()``.
            persist_cpu_share: pace the background persist (serializing, hashing,
                writing) to about this share of one CPU core: after each 4 MiB piece it
                rests for the CPU time the piece took times ``1/share - 1``. The default,
                0.1, is what kept training steps within the 10% target on a 2-core CPU
                machine whose cores training kept busy (bench/results/checkpoint.txt); a
                persist then takes roughly ten times its CPU time (there: 576 MiB of
                model and Adam state, about 1.2 s of CPU, persisted in 13-22 s instead
                of 4-5 s unpaced). ``wait()``, ``close()``, ``load()`` and the next
                ``save()`` end the pacing, so waiting for a paced persist costs no more
                than waiting for an unpaced one; call ``close()`` at the end of training
                (otherwise the interpreter's exit waits for the paced persist). ``None``
                (or 1.0): unpaced, as fast as the machine allows.
            persist_max_bytes_s: also cap the background persist's average write rate
                (None: no cap).
            persist_when_idle: run the background persist under ``SCHED_IDLE`` (Linux), so
                it takes only CPU time that training leaves unused; if training never
                idles, the next ``save()`` waits for it (a visible stall, never a hang).
            save_rng: save and restore per-rank RNG states of torch/CUDA/numpy/Python.
            max_failed_saves: a save the storage refuses (``ENOSPC``, ``EDQUOT``, ``EIO``,
                ``EROFS``) leaves nothing behind, keeps the previous checkpoints, emits
                ``checkpoint_save_failed`` (step, reason, consecutive count) and lets
                training go on; the next scheduled save tries again. When this many saves
                in a row have failed, and the first of them is at least
                ``failed_saves_grace_s`` old, the last failure raises (on every rank, at the
                next ``save()`` for a background save), so a job never trains for hours
                with nothing durable. 1 (with a grace of 0): every failed save raises.
            failed_saves_grace_s: the shortest run of failed saves that raises. A restart
                frees no disk space and throws away the steps since the last checkpoint,
                so a disk that is full for a few seconds must not end the run just because
                checkpoints are frequent (with saves every 0.5 s, three failures took 1.6 s
                in the chaos runs; bench/results/chaos.txt). 0: count only.
            events: event log; by default one in ``ctx.run_dir`` when that is set.
            storage: file operations (default: chosen from ``directory``); tests inject faults.
            clock: time source for stall/persist durations.
            fault_hook: called at each commit stage (tests only).

        Raises:
            CheckpointError: bad retention values, unusable directory, or this writer's
                round is older than the directory's fence (a straggler). A directory the
                storage refuses to write (full, read-only) is not an error here: claiming
                its fence is retried by the first save.
        """
        if max_failed_saves < 1:
            raise CheckpointError(f"max_failed_saves must be >= 1, got {max_failed_saves}")
        if failed_saves_grace_s < 0:
            raise CheckpointError(f"failed_saves_grace_s must be >= 0, got {failed_saves_grace_s}")
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every must be >= 1 or None, got {keep_every}")
        self._ctx = ctx or current() or single_process_context()
        if storage is None:
            self._storage, self._root = open_storage(directory)
        else:
            self._storage, self._root = storage, os.fspath(directory)
        self._keep_last = keep_last
        self._keep_every = keep_every
        self._async = async_save
        self._save_rng = save_rng
        self._clock = clock
        self._fault_hook = fault_hook
        self._objects: dict[str, Stateful] = {}
        self._snapshot = HostSnapshot()
        self._defer = defer_copy
        if persist_max_bytes_s is not None and persist_max_bytes_s <= 0:
            raise CheckpointError("persist_max_bytes_s must be > 0 or None")
        self._persist_rate = persist_max_bytes_s
        if persist_cpu_share is not None and not 0 < persist_cpu_share <= 1:
            raise CheckpointError("persist_cpu_share must be in (0, 1] or None")
        self._cpu_share = persist_cpu_share
        self._pacer: CpuPacer | None = None
        self._idle = persist_when_idle
        self._optimizers: list[torch.optim.Optimizer] = []
        self._copied = threading.Event()
        self._copied.set()
        self._copy_wait_s = 0.0
        self._save_stall_s = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._max_failed = max_failed_saves
        self._failed_grace_s = failed_saves_grace_s
        self._failed = 0
        self._failing_since = 0.0
        self._fence_claimed = False
        if events is None and self._ctx.run_dir is not None:
            events = EventLog(self._ctx.run_dir, run_id=self._ctx.run_id, node=self._ctx.node)
        if events is not None and events.round is None:
            events.round = self._ctx.round
        self._events = events
        if self._ctx.is_main:
            try:
                self._claim_fence()
            except StorageFailure as exc:
                log.warning("checkpoint fence not claimed yet (retried by the first save): %s", exc)
                self._emit("checkpoint_fence_deferred", reason=exc.reason, error=str(exc))

    def _claim_fence(self) -> None:
        """Claim the directory for this round and remove what crashed writers left.

        Raises:
            FencedError: a newer round owns the directory.
            CheckpointError: the fence cannot be read or written.
        """
        self._storage.makedirs(self._root)
        claim_fence(self._storage, self._root, self._ctx.round)
        self._fence_claimed = True
        try:
            remove_stale_staging(self._storage, self._root, self._ctx.round)
        except StorageFailure as exc:  # leftovers only cost space; the next writer retries
            log.warning("could not remove stale checkpoint staging: %s", exc)

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
        if not self._copied.is_set():
            t0 = self._clock.monotonic()
            self._copied.wait()
            self._copy_wait_s += self._clock.monotonic() - t0

    @property
    def last_stall_s(self) -> float:
        """How long the last save blocked training: inside ``save()`` plus any wait of the
        next ``optimizer.step()`` for the deferred copy (so far)."""
        return self._save_stall_s + self._copy_wait_s

    @property
    def directory(self) -> str:
        return self._root

    @property
    def persisting(self) -> bool:
        """True while a background persist is in flight."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed_saves(self) -> int:
        """How many saves in a row the storage refused (0 after a committed save). Only
        the writing rank (rank 0) counts; read it after ``wait()`` for the latest."""
        return self._failed

    def steps(self) -> list[int]:
        """Committed (not necessarily verified) checkpoint steps, ascending."""
        return list_steps(self._storage, self._root)

    # -- saving -------------------------------------------------------------------------

    def save(
        self, step: int, *, extra: Mapping[str, Any] | None = None, blocking: bool = False
    ) -> None:
        """Checkpoint all registered state as ``step``. Collective: every rank calls it.

        Blocks while the previous persist (if any) finishes and while state is copied to
        host memory; then persisting continues in the background unless ``blocking`` (or
        the checkpointer is synchronous), in which case it returns once the checkpoint is
        committed on every rank's view.

        A save the storage refuses (full disk, read-only, I/O error) does not raise until
        ``max_failed_saves`` in a row have failed (see the constructor).

        Raises:
            CheckpointError: on every rank: a previous background save failed for another
                reason than the storage, or reached ``max_failed_saves``; or (foreground
                saves) this one did. The previous committed checkpoint is intact.
        """
        if self._closed:
            raise CheckpointError("save() after close()")
        t0 = self._clock.monotonic()
        self._join()
        earlier = self._take_pending() if self._ctx.is_main else None
        rng = capture_rng() if self._save_rng else None
        # One collective tells every rank what rank 0 knows: they raise together instead
        # of leaving the others blocked in their next collective.
        rngs, fatal = self._gather_with_status(rng, None if earlier is None else str(earlier))
        if fatal is not None:
            raise CheckpointError(fatal) from earlier
        error: CheckpointError | None = None
        foreground = blocking or not self._async
        if self._ctx.is_main:
            background = self._async and not blocking
            defer = self._deferrable() if background and self._defer else None
            states = {name: obj.state_dict() for name, obj in self._objects.items()}
            copied, pending = self._snapshot.take(states, defer)
            synchronize_device()
            payload: dict[str, Any] = dict(copied)
            payload[EXTRA_FILE] = copy.deepcopy(dict(extra or {}))  # the caller may mutate it
            if rngs is not None:
                payload[RNG_FILE] = rngs
            self._copy_wait_s = 0.0
            self._save_stall_s = self._clock.monotonic() - t0
            if background:
                if pending:
                    self._copied.clear()
                self._pacer = (
                    CpuPacer(self._cpu_share, self._clock)
                    if self._cpu_share is not None and self._cpu_share < 1
                    else None
                )
                self._thread = threading.Thread(
                    target=self._persist_bg,
                    args=(step, payload, pending),
                    name=f"flexrun-ckpt-{step}",
                )
                self._thread.start()
                self._save_stall_s = self._clock.monotonic() - t0
            else:
                try:
                    self._persist(step, payload, background=False)
                except CheckpointError as exc:
                    error = exc
                self._save_stall_s = self._clock.monotonic() - t0
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
        self._join()
        self._raise_pending()

    def close(self) -> None:
        """Wait for the in-flight persist; later saves are refused. Idempotent.

        Raises:
            CheckpointError: the background persist failed.
        """
        if self._closed:
            return
        self._closed = True
        self.wait()

    def _join(self) -> None:
        if self._pacer is not None:
            self._pacer.hurry()  # someone waits for it now: finish at full speed
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _raise_pending(self) -> None:
        err = self._take_pending()
        if err is not None:
            raise err

    def _take_pending(self) -> CheckpointError | None:
        err, self._error = self._error, None
        if err is None:
            return None
        what = str(err) if isinstance(err, CheckpointError) else repr(err)
        out = CheckpointError(f"background checkpoint save failed: {what}")
        out.__cause__ = err
        return out

    def _deferrable(self) -> Callable[[torch.Tensor], bool] | None:
        """Tensors only ``optimizer.step()`` changes: parameters and optimizer state."""
        if not self._optimizers:
            return None
        ptrs: set[int] = set()
        for opt in self._optimizers:
            for group in opt.param_groups:
                ptrs.update(p.data_ptr() for p in group["params"])
            for st in opt.state.values():
                ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        ptrs.discard(0)
        return lambda t: t.data_ptr() in ptrs

    def _persist_bg(
        self,
        step: int,
        payload: dict[str, Any],
        pending: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        try:
            try:
                run_copies(pending)  # at normal priority: the next optimizer step waits on it
            finally:
                self._copied.set()
            if self._idle:
                _enter_idle_priority()
            self._persist(step, payload, background=True)
        except BaseException as exc:  # handed to the training thread on its next call
            self._error = exc

    def _persist(self, step: int, payload: dict[str, Any], *, background: bool) -> None:
        t0 = self._clock.monotonic()
        pacer = self._pacer if background else None
        if pacer is not None:
            pacer.start()
        rate = self._persist_rate if background else None
        files = {
            (k if k.endswith(".pt") else f"{k}.pt"): _torch_writer(v, rate, self._clock, pacer)
            for k, v in payload.items()
        }
        try:
            if not self._fence_claimed:
                self._claim_fence()
            manifest = commit_checkpoint(
                self._storage,
                self._root,
                step=step,
                round=self._ctx.round,
                world_size=self._ctx.world_size,
                files=files,
                meta={"kind": "replicated", "objects": sorted(self._objects)},
                clock=self._clock,
                fault_hook=self._fault_hook,
            )
        except StorageFailure as exc:
            self._storage_failed(step, exc)
            return
        except CheckpointError as exc:
            self._emit("checkpoint_save_failed", step=step, error=str(exc), fatal=True)
            raise
        self._failed = 0
        persist_s = self._clock.monotonic() - t0
        removed: list[int] = []
        try:
            removed = prune(
                self._storage,
                self._root,
                keep_last=self._keep_last,
                keep_every=self._keep_every,
                protect=step,
            )
        except StorageFailure as exc:  # the new checkpoint is committed; pruning retries later
            log.warning("checkpoint retention could not delete old checkpoints: %s", exc)
        self._emit(
            "checkpoint_saved",
            step=step,
            bytes=manifest.total_bytes,
            # Background: time in save() plus the optimizer step's wait for the copy;
            # foreground: the whole save, persisting included.
            stall_s=round(self._save_stall_s + (self._copy_wait_s if background else persist_s), 6),
            persist_s=round(persist_s, 6),
            path=self._storage.join(self._root, f"step_{step}"),
            pruned=removed,
        )

    def _storage_failed(self, step: int, exc: StorageFailure) -> None:
        """Report a save the storage refused; raise once ``max_failed_saves`` in a row did,
        over at least ``failed_saves_grace_s``."""
        now = self._clock.monotonic()
        if self._failed == 0:
            self._failing_since = now
        self._failed += 1
        failing_s = now - self._failing_since
        fatal = self._failed >= self._max_failed and failing_s >= self._failed_grace_s
        self._emit(
            "checkpoint_save_failed",
            step=step,
            reason=exc.reason,
            error=str(exc),
            consecutive=self._failed,
            max_failed_saves=self._max_failed,
            failing_s=round(failing_s, 3),
            fatal=fatal,
        )
        if fatal:
            raise CheckpointError(
                f"{self._failed} checkpoint saves in a row failed over {failing_s:.0f} s "
                f"(max_failed_saves={self._max_failed}, failed_saves_grace_s="
                f"{self._failed_grace_s:g}), the last at step {step}: {exc}"
            ) from exc
        log.warning(
            "checkpoint save at step %d failed (%s, %d in a row over %.0f s, limit %d over %g s); "
            "training goes on, the previous checkpoints are intact and the next save tries "
            "again: %s",
            step,
            exc.reason,
            self._failed,
            failing_s,
            self._max_failed,
            self._failed_grace_s,
            exc,
        )

    # -- loading ------------------------------------------------------------------------

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
        chosen: int | None = None
        skipped: list[int] = []
        loaded: tuple[Manifest, dict[str, Any]] | None = None
        failure: str | None = None
        reasons: list[str] = []
        if self._ctx.is_main:
            candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
            for s in candidates:
                try:
                    loaded = self._read(s)
                    chosen = s
                    break
                except CheckpointError as exc:
                    skipped.append(s)
                    reasons.append(str(exc))
                    self._emit("checkpoint_fallback", step=s, reason=str(exc))
                    log.warning("checkpoint step %d unusable, falling back: %s", s, exc)
            if chosen is None and candidates:
                failure = (
                    f"no checkpoint in {self._root} verifies (tried {candidates}): "
                    + "; ".join(reasons)
                )
        decision = self._broadcast((chosen, failure))
        chosen, failure = decision
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
        )
        return Loaded(
            step=chosen,
            extra=dict(state.get(EXTRA_FILE) or {}),
            world_size=manifest.world_size,
            skipped=tuple(skipped),
        )

    def _read(self, step: int) -> tuple[Manifest, dict[str, Any]]:
        manifest, blobs = verify_checkpoint(self._storage, self._root, step)
        state = {
            name: load_weights_only(blob, what=f"step_{step}/{name}")
            for name, blob in blobs.items()
        }
        missing = [n for n in self._objects if f"{n}.pt" not in state]
        if missing:
            raise CheckpointError(f"step_{step} lacks registered state {missing}")
        return manifest, {
            (k[: -len(".pt")] if k not in (RNG_FILE, EXTRA_FILE) else k): v
            for k, v in state.items()
        }

    def _apply(self, state: dict[str, Any]) -> None:
        for name, obj in self._objects.items():
            obj.load_state_dict(state[name])
        rngs = state.get(RNG_FILE)
        if self._save_rng and isinstance(rngs, list) and self._ctx.rank < len(rngs):
            restore_rng(rngs[self._ctx.rank])

    # -- collectives and events ----------------------------------------------------------

    def _distributed(self) -> bool:
        return self._ctx.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _gather_with_status(
        self, rng: Any, status: str | None
    ) -> tuple[list[Any] | None, str | None]:
        """Every rank's ``rng`` (None when RNG states are not saved) and rank 0's ``status``."""
        if not self._distributed():
            return (None if rng is None else [rng]), status
        out: list[Any] = [None] * self._ctx.world_size
        dist.all_gather_object(out, (rng, status))
        rngs = None if rng is None else [r for r, _ in out]
        return rngs, out[0][1]

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _emit(self, event: str, **fields: Any) -> None:
        if self._events is not None and self._ctx.is_main:
            try:
                self._events.emit(event, rank=self._ctx.rank, **fields)
            except OSError as exc:  # the run directory may share the full disk
                log.warning("could not log the %s event: %s", event, exc)


def _torch_writer(
    obj: Any,
    rate: float | None = None,
    clock: Clock = SYSTEM_CLOCK,
    pacer: CpuPacer | None = None,
) -> Any:
    def write(f: Any) -> None:
        target: Any = f  # a file-like is all torch needs
        if pacer is not None:
            target = PacedWriter(target, pacer)
        if rate:
            target = ThrottledWriter(target, rate, clock)
        save_without_zip_crc(obj, target)

    return write


_CRC_CONFIG_LOCK = threading.Lock()


class _RestoreOnFirstWrite:
    """Passes writes through; the first one (or ``restore()``) runs ``undo`` once."""

    def __init__(self, raw: Any, undo: Callable[[], None]) -> None:
        self._raw, self._undo = raw, undo
        self._pending = True

    def restore(self) -> None:
        if self._pending:
            self._pending = False
            self._undo()

    def write(self, data: Any) -> int:
        self.restore()
        return int(self._raw.write(data))

    def flush(self) -> None:
        self._raw.flush()


def save_without_zip_crc(obj: Any, f: Any) -> None:
    """``torch.save(obj, f)`` without the zip container's CRC32 of each tensor.

    The manifest's sha256 of every file already detects corruption; torch's CRC32 would
    be a second pass over every byte (about 0.5 s of CPU per 576 MiB here, taken in one
    burst per tensor before the first byte is written, so it cannot be paced). torch.load
    reads such files as usual. torch reads its ``compute_crc32`` setting, a process-wide
    one, when it opens the zip writer, before pickling; the setting is restored at the
    first byte written, so another thread's ``torch.save`` sees it off for at most that
    moment (its file then merely lacks CRCs too).
    """
    try:
        from torch.utils.serialization import config as ser_config
    except ImportError:  # an older torch: it always computes CRC32
        torch.save(obj, f)
        return
    _CRC_CONFIG_LOCK.acquire()  # released by the guard at the first write, same thread
    before = ser_config.save.compute_crc32

    def undo() -> None:
        ser_config.save.compute_crc32 = before
        _CRC_CONFIG_LOCK.release()

    guard = _RestoreOnFirstWrite(f, undo)
    try:
        ser_config.save.compute_crc32 = False
        torch.save(obj, guard)  # type: ignore[arg-type]  # torch needs only write()
    finally:
        guard.restore()


def _enter_idle_priority() -> None:
    """Move the calling thread to ``SCHED_IDLE`` (Linux only; elsewhere it stays as is)."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux or not permitted: normal priority
        log.debug("could not lower the checkpoint thread's priority: %s", exc)
