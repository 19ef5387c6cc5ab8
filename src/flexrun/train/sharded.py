"""Sharded checkpoints (FSDP/DTensor) through torch.distributed.checkpoint, with flexrun's commit.

Owns saving and loading state whose tensors are sharded across ranks, so a checkpoint
written at world size N loads at world size M (DCP reshards). Every rank writes its own
shards into one staging directory on a shared filesystem; rank 0 then hashes every file,
writes the manifest and commits with the same protocol as replicated checkpoints
(``flexrun.train.commit``). Loading verifies on rank 0 and refuses code execution: DCP's
own reader unpickles ``.metadata`` with plain ``pickle`` and non-tensor items with
``weights_only=False``; here metadata goes through an allowlist unpickler and non-tensor
items through ``weights_only=True``. Saves are synchronous (collective). Local/shared
filesystem paths only (no fsspec URLs here).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import CheckpointError
from flexrun.events import EventLog
from flexrun.train.checkpoint import Loaded, Stateful, load_weights_only
from flexrun.train.commit import (
    check_fence,
    claim_fence,
    finalize_staged,
    list_steps,
    prune,
    remove_stale_staging,
    staging_dir,
    step_dir_name,
    verify_checkpoint,
)
from flexrun.train.context import TrainContext, current, single_process_context
from flexrun.train.state import capture_rng, restore_rng
from flexrun.train.storage import LocalStorage, fsync_dir

_METADATA = ".metadata"
_TORCH_NAMES = {"Size", "device", "layout", "memory_format", "dtype", "strided"}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global outside DCP's own data classes."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (
                module == "torch"
                and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype))
            )
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in {"set", "frozenset", "slice"})
            or (module == "pathlib" and name in {"PosixPath", "PurePosixPath"})
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refused global {module}.{name} in checkpoint metadata")
        return super().find_class(module, name)


def read_safe_metadata(blob: bytes) -> Metadata:
    """Parse DCP metadata without running code.

    Raises:
        CheckpointError: it names a global outside the allowlist or is not metadata.
    """
    try:
        meta = _MetadataUnpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # UnpicklingError, AttributeError, EOFError ...
        raise CheckpointError(f"DCP metadata refused: {exc}") from exc
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"DCP metadata is a {type(meta).__name__}, not Metadata")
    return meta


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(os.fspath(self.path), _METADATA)
        with open(path, "rb") as fh:
            meta = read_safe_metadata(fh.read())
        storage_meta = meta.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        meta.storage_meta = storage_meta
        return meta


class _SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class ShardedCheckpointer:
    """Collective save/load of sharded state with DCP under flexrun's commit protocol."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ctx: TrainContext | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        save_rng: bool = True,
        events: EventLog | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """Same arguments as :class:`flexrun.train.Checkpointer` (saves are synchronous).

        Raises:
            CheckpointError: ``directory`` is a URL, bad retention, or this round is fenced.
        """
        text = os.fspath(directory)
        if "://" in text:
            raise CheckpointError(f"{text}: sharded checkpoints need a local/shared directory")
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        self._ctx = ctx or current() or single_process_context()
        self._root = os.path.abspath(text)
        self._storage = LocalStorage()
        self._keep_last, self._keep_every = keep_last, keep_every
        self._save_rng = save_rng
        self._clock = clock
        self._objects: dict[str, Stateful] = {}
        if events is None and self._ctx.run_dir is not None:
            events = EventLog(self._ctx.run_dir, run_id=self._ctx.run_id, node=self._ctx.node)
        if events is not None and events.round is None:
            events.round = self._ctx.round
        self._events = events
        error = None
        if self._ctx.is_main:
            try:
                claim_fence(self._storage, self._root, self._ctx.round)
                remove_stale_staging(self._storage, self._root, self._ctx.round)
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

    def steps(self) -> list[int]:
        """Committed (unverified) steps, ascending."""
        return list_steps(self._storage, self._root)

    def save(self, step: int, *, extra: dict[str, Any] | None = None) -> None:
        """Write every rank's shards and commit ``step``. Collective and synchronous.

        Raises:
            CheckpointError: any rank failed to write, or the commit failed; the previous
                checkpoint is intact.
        """
        t0 = self._clock.monotonic()
        tmp, error = None, None
        if self._ctx.is_main:
            try:
                check_fence(self._storage, self._root, self._ctx.round)
                tmp = staging_dir(self._storage, self._root, step, self._ctx.round)
                self._storage.makedirs(tmp)
            except CheckpointError as exc:
                error = str(exc)
        tmp, error = self._broadcast((tmp, error))
        if error is not None:
            raise CheckpointError(error)
        assert tmp is not None
        local_error = None
        try:
            dcp.save(dict(self._objects), storage_writer=FileSystemWriter(tmp, sync_files=True))
            if self._save_rng:
                rng = capture_rng()
                self._storage.write_file(
                    os.path.join(tmp, f"rng_{self._ctx.rank}.pt"), lambda f: torch.save(rng, f)
                )
            if self._ctx.is_main:
                payload = dict(extra or {})
                self._storage.write_file(
                    os.path.join(tmp, "extra.pt"), lambda f: torch.save(payload, f)
                )
        except Exception as exc:  # DCP raises CheckpointException, OSError ...
            local_error = f"rank {self._ctx.rank}: {exc}"
        errors = [e for e in self._gather(local_error) if e]
        result = None
        if self._ctx.is_main:
            try:
                if errors:
                    raise CheckpointError("sharded save failed: " + "; ".join(errors))
                self._commit(step, tmp, stall_s=self._clock.monotonic() - t0)
            except CheckpointError as exc:
                self._storage.remove_tree(tmp)
                self._emit("checkpoint_save_failed", step=step, error=str(exc))
                result = f"error: {exc}"
        result = self._broadcast(result)
        if isinstance(result, str):
            raise CheckpointError(result)

    def _commit(self, step: int, tmp: str, *, stall_s: float) -> None:
        t0 = self._clock.monotonic()
        entries = {}
        for dirpath, _dirs, files in os.walk(tmp):
            for f in files:
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, tmp)
                if os.sep in rel:
                    raise CheckpointError(f"unexpected nested file {rel} in DCP output")
                entries[rel] = _hash_file(full)
        fsync_dir(tmp)
        manifest = finalize_staged(
            self._storage,
            self._root,
            tmp,
            step=step,
            round=self._ctx.round,
            world_size=self._ctx.world_size,
            entries=entries,
            meta={"kind": "dcp", "objects": sorted(self._objects)},
            clock=self._clock,
        )
        prune(
            self._storage,
            self._root,
            keep_last=self._keep_last,
            keep_every=self._keep_every,
            protect=step,
        )
        self._emit(
            "checkpoint_saved",
            step=step,
            bytes=manifest.total_bytes,
            stall_s=round(stall_s + self._clock.monotonic() - t0, 6),
            persist_s=round(self._clock.monotonic() - t0, 6),
            path=os.path.join(self._root, step_dir_name(step)),
            sharded=True,
        )

    def load(self) -> Loaded | None:
        """Restore the newest verified checkpoint into the registered objects. Collective.

        Raises:
            CheckpointError: checkpoints exist but none verifies, or DCP failed to load.
        """
        t0 = self._clock.monotonic()
        chosen, failure, skipped, nbytes = None, None, [], 0
        if self._ctx.is_main:
            candidates = sorted(self.steps(), reverse=True)
            reasons = []
            for s in candidates:
                try:
                    manifest, blobs = verify_checkpoint(self._storage, self._root, s)
                    if manifest.meta.get("kind") != "dcp" or _METADATA not in blobs:
                        raise CheckpointError(f"step_{s} is not a sharded (DCP) checkpoint")
                    read_safe_metadata(blobs[_METADATA])
                    chosen, nbytes = s, manifest.total_bytes
                    break
                except CheckpointError as exc:
                    skipped.append(s)
                    reasons.append(str(exc))
                    self._emit("checkpoint_fallback", step=s, reason=str(exc))
            if chosen is None and candidates:
                failure = f"no checkpoint in {self._root} verifies: " + "; ".join(reasons)
        chosen, failure, skipped, nbytes = self._broadcast((chosen, failure, skipped, nbytes))
        if failure is not None:
            raise CheckpointError(failure)
        if chosen is None:
            return None
        path = os.path.join(self._root, step_dir_name(chosen))
        try:
            dcp.load(dict(self._objects), storage_reader=_SafeReader(path), planner=_SafePlanner())
        except Exception as exc:  # DCP wraps rank failures in CheckpointException
            raise CheckpointError(f"DCP load of {path} failed: {exc}") from exc
        rng_path = os.path.join(path, f"rng_{self._ctx.rank}.pt")
        if self._save_rng and os.path.exists(rng_path):
            restore_rng(load_weights_only(self._storage.read_bytes(rng_path), what=rng_path))
        extra = load_weights_only(
            self._storage.read_bytes(os.path.join(path, "extra.pt")), what="extra.pt"
        )
        with open(os.path.join(path, "manifest.json"), "rb") as fh:
            saved_world = int(json.load(fh)["world_size"])
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

    def _distributed(self) -> bool:
        return self._ctx.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed():
            return [obj]
        out: list[Any] = [None] * self._ctx.world_size
        dist.all_gather_object(out, obj)
        return out

    def _emit(self, event: str, **fields: Any) -> None:
        if self._events is not None and self._ctx.is_main:
            self._events.emit(event, rank=self._ctx.rank, **fields)


def _hash_file(path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}
