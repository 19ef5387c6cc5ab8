"""Sharded checkpoints (FSDP/DTensor) through torch.distributed.checkpoint, with flexrun's commit.

Owns saving and loading state whose tensors are sharded across ranks, so a checkpoint
written at world size N loads at world size M (DCP reshards). Every rank writes its own
shards into the save's staging place (a staging directory on a shared filesystem, or the
attempt prefix on an object store, through DCP's fsspec writer), hashing each file as it
streams out; rank 0 gathers the digests, writes the manifest and commits with the same
protocol as replicated checkpoints (``flexrun.train.commit`` or ``commit_object``: on an
object store the manifest written last is the commit point). Loading verifies on rank 0
and refuses code execution: DCP's own reader unpickles ``.metadata`` with plain
``pickle`` and non-tensor items with ``weights_only=False``; here metadata goes through
an exact allow-list of the (module, name) pairs DCP's metadata consists of
(:data:`~flexrun.train.dcp_io.METADATA_GLOBALS`) and non-tensor items through
``weights_only=True`` (the plumbing is :mod:`flexrun.train.dcp_io`). Every file the
metadata names must be one plain name the manifest lists, so nothing outside the
checkpoint is ever opened. Saves are
collective; ``save(step, asynchronous=True)`` returns once every rank has staged its state
(``dcp.async_save``: a copy in host memory) and writes, gathers the digests and commits in
the background over a process group of its own (gloo), so training's collectives never
interleave with the save's (:mod:`flexrun.train.sharded_async`); the next save, ``wait()``
or ``load()`` waits for it. With ``durable_every``, every save first stages each rank's own
shards in the node's memory and only the first and every ``durable_every``-th go on to DCP;
a load takes the newest step every rank holds a verified copy of, unless storage holds a
newer one (:mod:`flexrun.train.memshard`).

Modules and optimizers registered as they are go through
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict`` and their ``set_`` halves), so an optimizer whose state is not
yet created (a fresh process) is initialised before DCP loads into it and FSDP2 / DTensor
parameters are keyed by their fully qualified names; an optimizer is saved against the
registered module(s) holding its parameters, and refused if none does. A load refuses a
checkpoint holding state under a registered name that the object does not take (DCP itself
would drop it silently).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from flexrun import worker_hook
from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import CheckpointError
from flexrun.events import EventLog
from flexrun.train.checkpoint import (
    Loaded,
    RankZero,
    Stateful,
    StorageOptions,
    resolve_storage_options,
)
from flexrun.train.commit import RenameCommit
from flexrun.train.commit_object import ObjectCommit, open_commit
from flexrun.train.context import TrainContext, current, single_process_context
from flexrun.train.dcp_io import (
    _METADATA,
    METADATA_GLOBALS,
    _dcp_error,
    _fsspec_module,
    _fsspec_reader,
    _HashingFS,
    _ModuleState,
    _OptimizerState,
    _owner,
    _SafePlanner,
    _SafeReader,
    read_safe_metadata,
)
from flexrun.train.layout import Staged, VerifiedCache, prune, step_dir_name, verify
from flexrun.train.memshard import ShardMemoryTier
from flexrun.train.options import CheckpointOptions
from flexrun.train.progress import install_stack_dump
from flexrun.train.serialize import load_weights_only
from flexrun.train.sharded_async import PendingSave, save_async
from flexrun.train.state import capture_rng, restore_rng

__all__ = ["METADATA_GLOBALS", "PendingSave", "ShardedCheckpointer", "read_safe_metadata"]


class ShardedCheckpointer(RankZero):
    """Collective save/load of sharded state with DCP under flexrun's commit protocol."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        options: CheckpointOptions | None = None,
        storage_options: StorageOptions = None,
        ctx: TrainContext | None = None,
        events: EventLog | None = None,
        clock: Clock = SYSTEM_CLOCK,
        save_group: Any = None,
        **option_kwargs: Any,
    ) -> None:
        """As :class:`flexrun.train.Checkpointer`, and ``save_group``: the asynchronous
        saves' gloo group (None: formed at the first, over the default group's store). Of the options
        ``keep_last``, ``keep_every``, ``save_rng`` and the memory tier's
        ``durable_every``, ``memory_dir`` and ``memory_max_bytes`` apply: with
        ``durable_every``, every save stages each rank's own shards into the node's memory
        and every ``durable_every``-th (and the first) is also a DCP save
        (:mod:`flexrun.train.memshard`).

        Raises:
            CheckpointError: unusable directory, bad retention, or this round is fenced.
        """
        self.options = CheckpointOptions.build(options, option_kwargs)
        install_stack_dump()
        self._ctx = ctx or current() or single_process_context()
        self._storage_options = resolve_storage_options(storage_options) or {}
        self._proto = open_commit(directory, storage_options=self._storage_options)
        self._clock = clock
        self._objects: dict[str, Stateful] = {}
        self._pending: PendingSave | None = None
        self._save_group: Any = save_group
        self._verified = VerifiedCache()
        self._setup_events(events)
        self._mem = ShardMemoryTier.open(
            str(directory), self.options, self._ctx, self._events, clock
        )
        error, self._generation = None, self._ctx.round
        if self._ctx.is_main:
            try:
                self._generation = self._proto.claim(run=self._ctx.run_id, round=self._ctx.round)
            except CheckpointError as exc:
                error = str(exc)
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointError(error)

    def register(self, name: str, obj: Stateful) -> None:
        """Save and restore ``obj`` (its state dict may hold DTensors) under ``name``.

        Raises:
            CheckpointError: the name is taken or not a plain identifier.
        """
        if not name.isidentifier() or name in self._objects or name.startswith("_"):
            raise CheckpointError(f"checkpoint name {name!r} is invalid or taken")
        self._objects[name] = obj

    def _state_objects(self) -> dict[str, Any]:
        """What DCP saves and loads: modules and optimizers through
        ``torch.distributed.checkpoint.state_dict``, everything else as registered.

        Raises:
            CheckpointError: an optimizer steps parameters of no registered module.
        """
        modules = {n: o for n, o in self._objects.items() if isinstance(o, torch.nn.Module)}
        out: dict[str, Any] = {}
        for n, o in self._objects.items():
            if isinstance(o, torch.nn.Module):
                out[n] = _ModuleState(o)
            elif isinstance(o, torch.optim.Optimizer):
                out[n] = _OptimizerState(_owner(n, o, modules), o)
            else:
                out[n] = o
        return out

    def steps(self) -> list[int]:
        """Committed (unverified) steps, ascending."""
        return self._proto.steps()

    def _is_object_store(self) -> bool:
        return isinstance(self._proto, ObjectCommit)

    def _dcp_writer(self, staged: Staged) -> tuple[Any, _HashingFS]:
        if isinstance(self._proto, RenameCommit):
            writer: Any = FileSystemWriter(staged.path, sync_files=True)
        else:
            FsspecWriter = _fsspec_module().FsspecWriter  # noqa: N806
            url = self._proto.store.url(staged.path)  # type: ignore[attr-defined]
            # The object is durable once its upload completes; there is no fsync.
            writer = FsspecWriter(url, sync_files=False, **self._storage_options)
        hashing = _HashingFS(writer.fs)
        writer.fs = hashing
        return writer, hashing

    def wait(self) -> None:
        """Until the asynchronous save under way (if any) has committed.

        Raises:
            CheckpointError: it failed; the checkpoint before it is intact.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def _group(self) -> Any:
        """The asynchronous saves' own gloo group (created once, collectively)."""
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        return self._save_group

    def save(
        self, step: int, *, extra: dict[str, Any] | None = None, asynchronous: bool = False
    ) -> PendingSave | None:
        """Write every rank's shards and commit ``step``. Collective.

        With ``asynchronous``, return once every rank's state is staged (copied to host
        memory) and write and commit in the background: the returned :class:`PendingSave`
        (also waited for by the next ``save``, ``wait()`` and ``load()``) says when.

        Raises:
            CheckpointError: any rank failed to write, or the commit failed (asynchronous:
                a failure to begin or stage); the previous checkpoint is intact.
        """
        self.wait()
        if self._mem is not None and not self._mem.save(self, step, extra):
            return None  # memory only
        t0 = self._clock.monotonic()
        objects = self._state_objects()
        staged, error = None, None
        if self._ctx.is_main:
            try:
                staged = self._proto.begin(step, round=self._ctx.round, generation=self._generation)
            except CheckpointError as exc:
                error = str(exc)
        staged, error = self._broadcast((staged, error))
        if error is not None:
            raise CheckpointError(error)
        assert staged is not None
        if asynchronous:
            self._pending = save_async(self, step, staged, objects, extra, t0)
            return self._pending
        local_error, entries, counted = None, {}, worker_hook.counted()
        try:
            writer, hashing = self._dcp_writer(staged)
            dcp.save(objects, storage_writer=writer)
            entries.update(hashing.digests)
            entries.update(self._write_small(staged, extra))
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            local_error = f"rank {self._ctx.rank}: {_dcp_error(exc)}"
        gathered = self._gather((local_error, entries))
        stall_s = self._clock.monotonic() - t0
        result = self._conclude(staged, gathered, stall_s=stall_s, counted=counted)
        result = self._broadcast(result)
        if isinstance(result, str):
            raise CheckpointError(result)
        return None

    def _write_small(self, staged: Staged, extra: dict[str, Any] | None) -> dict[str, Any]:
        """This rank's RNG state (with ``save_rng``) and rank 0's ``extra``: their entries."""
        entries: dict[str, Any] = {}
        if self.options.save_rng:
            rng = capture_rng()
            name = f"rng_{self._ctx.rank}.pt"
            entries[name] = self._proto.write(staged, name, lambda f: torch.save(rng, f))
        if self._ctx.is_main:
            payload = dict(extra or {})
            entries["extra.pt"] = self._proto.write(
                staged, "extra.pt", lambda f: torch.save(payload, f)
            )
        return entries

    def _conclude(
        self, staged: Staged, gathered: list[Any], *, stall_s: float, counted: int = -1
    ) -> str | None:
        """Rank 0: commit, or discard and say why (``"error: ..."``); others: None.
        ``counted``: the worker's step count the state was taken at (said once committed)."""
        result = None
        if self._ctx.is_main:
            try:
                errors = [e for e, _ in gathered if e]
                if errors:
                    raise CheckpointError("sharded save failed: " + "; ".join(errors))
                merged: dict[str, Any] = {}
                for _, files in gathered:
                    merged.update(files)
                self._commit(staged, merged, stall_s=stall_s)
                worker_hook.saved(counted)
            except CheckpointError as exc:
                message = str(exc)
                try:
                    self._proto.discard(staged)
                except CheckpointError as cleanup:
                    message += f" (and its cleanup failed: {cleanup})"
                self._emit("checkpoint_save_failed", step=staged.step, error=message)
                result = f"error: {message}"
        return result

    def _commit(self, staged: Staged, entries: dict[str, Any], *, stall_s: float) -> None:
        t0 = self._clock.monotonic()
        if _METADATA not in entries:
            raise CheckpointError(f"DCP wrote no {_METADATA} for step {staged.step}")
        if isinstance(self._proto, RenameCommit):
            from flexrun.train.storage import fsync_dir

            fsync_dir(staged.path)
        manifest = self._proto.publish(
            staged,
            world_size=self._ctx.world_size,
            entries=entries,
            meta={"kind": "dcp", "objects": sorted(self._objects)},
            clock=self._clock,
            fault_hook=None,
        )
        self._verified.mark(self._proto, staged.step)
        prune(
            self._proto,
            keep_last=self.options.keep_last,
            keep_every=self.options.keep_every,
            protect=staged.step,
            cache=self._verified,
        )
        self._emit(
            "checkpoint_saved",
            step=staged.step,
            bytes=manifest.total_bytes,
            stall_s=round(stall_s + self._clock.monotonic() - t0, 6),
            persist_s=round(self._clock.monotonic() - t0, 6),
            path=self._proto.path(step_dir_name(staged.step)),
            sharded=True,
        )

    def load(self) -> Loaded | None:
        """Restore the newest verified checkpoint into the registered objects. Collective.

        Raises:
            CheckpointError: checkpoints exist but none verifies, or DCP failed to load.
        """
        self.wait()
        t0 = self._clock.monotonic()
        if self._mem is not None and (got := self._mem.load(self, t0)) is not None:
            return got
        objects = self._state_objects()
        chosen, failure, skipped, info = None, None, [], None
        if self._ctx.is_main:
            candidates = sorted(self.steps(), reverse=True)
            reasons = []
            for s in candidates:
                try:
                    manifest, blobs = verify(self._proto, s, keep=lambda n: n == _METADATA)
                    if manifest.meta.get("kind") != "dcp" or _METADATA not in blobs:
                        raise CheckpointError(f"step_{s} is not a sharded (DCP) checkpoint")
                    read_safe_metadata(blobs[_METADATA], files=manifest.files)
                    chosen = s
                    info = (manifest.total_bytes, manifest.world_size, manifest.data_dir)
                    break
                except CheckpointError as exc:
                    skipped.append(s)
                    reasons.append(str(exc))
                    self._emit("checkpoint_fallback", step=s, reason=str(exc))
            if chosen is None and candidates:
                failure = f"no checkpoint in {self._proto.path()} verifies: " + "; ".join(reasons)
        chosen, failure, skipped, info = self._broadcast((chosen, failure, skipped, info))
        if failure is not None:
            raise CheckpointError(failure)
        if chosen is None:
            return None
        nbytes, saved_world, data_dir = info
        parts = [step_dir_name(chosen)] + ([data_dir] if data_dir else [])
        path = self._proto.path(*parts)
        reader = (
            _fsspec_reader(path, self._storage_options)
            if self._is_object_store()
            else _SafeReader(path)
        )
        try:
            dcp.load(objects, storage_reader=reader, planner=_SafePlanner(frozenset(objects)))
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise CheckpointError(f"DCP load of {path} failed: {_dcp_error(exc)}") from exc
        manifest = self._proto.read_manifest(chosen)
        rng_name = f"rng_{self._ctx.rank}.pt"
        if self.options.save_rng and rng_name in manifest.files:
            blob = b"".join(self._proto.read_chunks(chosen, manifest, rng_name))
            restore_rng(load_weights_only(blob, what=rng_name))
        extra_blob = b"".join(self._proto.read_chunks(chosen, manifest, "extra.pt"))
        extra = load_weights_only(extra_blob, what="extra.pt")
        self._emit(
            "checkpoint_loaded",
            step=chosen,
            bytes=nbytes,
            load_s=round(self._clock.monotonic() - t0, 6),
            saved_world_size=saved_world,
            skipped=skipped,
            sharded=True,
        )
        return Loaded(
            step=chosen, extra=dict(extra), world_size=saved_world, skipped=tuple(skipped)
        )
