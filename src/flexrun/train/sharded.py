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
(:data:`METADATA_GLOBALS`) and non-tensor items through ``weights_only=True``. Saves are
collective; ``save(step, asynchronous=True)`` returns once every rank has staged its state
(``dcp.async_save``: a copy in host memory) and writes, gathers the digests and commits in
the background over a process group of its own (gloo), so training's collectives never
interleave with the save's; the next save, ``wait()`` or ``load()`` waits for it.

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

import hashlib
import io
import logging
import os
import pickle
import threading
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

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
from flexrun.train.layout import Staged, VerifiedCache, prune, step_dir_name, verify
from flexrun.train.options import CheckpointOptions
from flexrun.train.progress import install_stack_dump
from flexrun.train.serialize import load_weights_only
from flexrun.train.state import capture_rng, restore_rng

log = logging.getLogger(__name__)

_METADATA = ".metadata"

METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
    | {(("torch", n)) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
)
"""Every global DCP's ``.metadata`` may name, exactly: what torch 2.13 writes for models
with optimizer state (Adam, SGD, AdamW), DTensor shards and non-tensor items (the classes
of ``torch.distributed.checkpoint.metadata``, the file reader's ``_StorageInfo``, tensor
sizes, dtypes and layouts, a checkpoint id path). No dotted names, no other module."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global outside :data:`METADATA_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"refused global {module}.{name} in checkpoint metadata")
        return super().find_class(module, name)


def read_safe_metadata(blob: bytes) -> Metadata:
    """Parse DCP metadata without running code.

    Raises:
        CheckpointError: it names a global outside the allow-list or is not metadata.
    """
    try:
        meta = _MetadataUnpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # UnpicklingError, AttributeError, EOFError ...
        raise CheckpointError(f"DCP metadata refused: {exc}") from exc
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"DCP metadata is a {type(meta).__name__}, not Metadata")
    return meta


class _SafeMetadata:
    """A DCP reader mixin: ``.metadata`` through the allow-list, never plain pickle."""

    fs: Any
    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self.fs.concat_path(self.path, _METADATA), "rb") as fh:
            meta = read_safe_metadata(fh.read())
        storage_meta = meta.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        meta.storage_meta = storage_meta
        return meta


class _SafeReader(_SafeMetadata, FileSystemReader):
    pass


def _fsspec_module() -> Any:
    """torch's fsspec storage for DCP: public from torch 2.15, private before (2.15
    deprecates the private name)."""
    try:
        import torch.distributed.checkpoint.fsspec_filesystem as public  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        import torch.distributed.checkpoint._fsspec_filesystem as private

        return private
    return public


def _fsspec_reader(url: str, options: Mapping[str, Any]) -> Any:
    reader: Any = _fsspec_module().FsspecReader

    class _SafeFsspecReader(_SafeMetadata, reader):
        pass

    return _SafeFsspecReader(url, **dict(options))


class _SafePlanner(DefaultLoadPlanner):
    """Loads non-tensor items with ``weights_only=True``, and refuses a checkpoint holding
    keys under the registered names that the objects' state dicts do not ask for."""

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self._names = names

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        wanted = set(self.state_dict)
        dropped = sorted(
            k
            for k in metadata.state_dict_metadata
            if k not in wanted and k.split(".", 1)[0] in self._names
        )
        if dropped:
            shown = ", ".join(dropped[:5]) + (
                f" (+{len(dropped) - 5} more)" if len(dropped) > 5 else ""
            )
            raise CheckpointError(
                f"the checkpoint holds state the registered objects do not take, which would "
                f"be dropped: {shown}"
            )

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _HashingStream:
    """A write stream that hashes and counts what DCP writes through it."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self._raw.write(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def close(self) -> None:
        self._raw.close()


class _HashingFS:
    """Wraps a DCP ``FileSystem``: records (size, sha256) of every file written, by name."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.digests: dict[str, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        with self._inner.create_stream(path, mode) as raw:
            if "r" in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        with self._lock:
            self.digests[_base(path)] = {"size": stream.size, "sha256": stream.sha256.hexdigest()}

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)
        with self._lock:
            if _base(path) in self.digests:
                self.digests[_base(new_path)] = self.digests.pop(_base(path))


class _ModuleState:
    """A registered ``nn.Module`` through ``get_model_state_dict``/``set_model_state_dict``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state)


class _OptimizerState:
    """A registered optimizer through ``get_optimizer_state_dict``/``set_optimizer_state_dict``
    against the module holding its parameters: its state is created before DCP loads into
    it, so nothing of the checkpoint is skipped."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, state)


def _owner(
    name: str, optimizer: torch.optim.Optimizer, modules: dict[str, torch.nn.Module]
) -> torch.nn.Module:
    """The registered module (or, across several, a ``ModuleDict`` of them by name) whose
    parameters include every parameter ``optimizer`` steps.

    Raises:
        CheckpointError: some parameter belongs to no registered module.
    """
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    holders = {n: m for n, m in modules.items() if params & {id(p) for p in m.parameters()}}
    covered: set[int] = set()
    for m in holders.values():
        covered |= {id(p) for p in m.parameters()}
    if not holders or not params <= covered:
        raise CheckpointError(
            f"optimizer {name!r} steps parameters of no registered module: register the "
            f"module(s) it trains too (their state is saved by name, and the optimizer's "
            f"state is keyed by their parameter names)"
        )
    if len(holders) == 1:
        return next(iter(holders.values()))
    return torch.nn.ModuleDict(holders)


def _dcp_error(exc: BaseException) -> str:
    """One line per failed rank for DCP's ``CheckpointException`` (a ``BaseException``
    whose text is every rank's traceback), the exception's text otherwise."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(inner).__name__}: {inner}"
            for rank, (inner, _) in sorted(exc.failures.items())
        )
    return str(exc)


class PendingSave:
    """An asynchronous sharded save: staged, being written and committed in the background."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.stall_s = 0.0
        """How long ``save`` held training: the state's staging, collectively."""
        self._done = threading.Event()
        self._error: str | None = None

    def _finish(self, error: str | None) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        """Whether it has committed or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Until committed (collective ranks each wait for their own part).

        Raises:
            CheckpointError: it failed (the previous checkpoint is intact), or ``timeout``
                passed first.
        """
        if not self._done.wait(timeout):
            raise CheckpointError(f"the save of step {self.step} is still under way")
        if self._error is not None:
            raise CheckpointError(self._error)


@contextmanager
def _suppress_checkpoint_error() -> Generator[None, None, None]:
    try:
        yield
    except CheckpointError as exc:
        log.warning("could not discard a failed save: %s", exc)


def _base(path: Any) -> str:
    return os.path.basename(str(os.fspath(path)).rstrip("/"))


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
        **option_kwargs: Any,
    ) -> None:
        """Same arguments as :class:`flexrun.train.Checkpointer`; of the options only
        ``keep_last``, ``keep_every`` and ``save_rng`` apply (saves are synchronous).

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
        self._save_group: Any = None
        self._verified = VerifiedCache()
        self._setup_events(events)
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

    def _gather_in(self, group: Any, obj: Any) -> list[Any]:
        if not self._distributed():
            return [obj]
        out: list[Any] = [None] * self._ctx.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _broadcast_in(self, group: Any, obj: Any) -> Any:
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

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
            return self._save_async(step, staged, objects, extra, t0)
        local_error, entries = None, {}
        try:
            writer, hashing = self._dcp_writer(staged)
            dcp.save(objects, storage_writer=writer)
            entries.update(hashing.digests)
            if self.options.save_rng:
                rng = capture_rng()
                name = f"rng_{self._ctx.rank}.pt"
                entries[name] = self._proto.write(staged, name, lambda f: torch.save(rng, f))
            if self._ctx.is_main:
                payload = dict(extra or {})
                entries["extra.pt"] = self._proto.write(
                    staged, "extra.pt", lambda f: torch.save(payload, f)
                )
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            local_error = f"rank {self._ctx.rank}: {_dcp_error(exc)}"
        gathered = self._gather((local_error, entries))
        result = self._conclude(staged, gathered, stall_s=self._clock.monotonic() - t0)
        result = self._broadcast(result)
        if isinstance(result, str):
            raise CheckpointError(result)
        return None

    def _save_async(
        self,
        step: int,
        staged: Staged,
        objects: dict[str, Any],
        extra: dict[str, Any] | None,
        t0: float,
    ) -> PendingSave:
        group = self._group() if self._distributed() else None
        pending = PendingSave(step)
        local_error, entries, future, hashing = None, {}, None, None
        try:
            writer, hashing = self._dcp_writer(staged)
            future = dcp.async_save(
                objects, storage_writer=writer, process_group=group, no_dist=group is None
            )
            if self.options.save_rng:
                rng = capture_rng()
                name = f"rng_{self._ctx.rank}.pt"
                entries[name] = self._proto.write(staged, name, lambda f: torch.save(rng, f))
            if self._ctx.is_main:
                payload = dict(extra or {})
                entries["extra.pt"] = self._proto.write(
                    staged, "extra.pt", lambda f: torch.save(payload, f)
                )
        except (Exception, CheckpointException) as exc:
            local_error = f"rank {self._ctx.rank}: {_dcp_error(exc)}"
        # Every rank staged (or failed to): the stall ends here, for all of them at once.
        # (Over training's group: DCP's writer thread is using the save's group by now.)
        errors = [e for e in self._gather(local_error) if e]
        stall = self._clock.monotonic() - t0
        pending.stall_s = stall
        if errors:
            message = "sharded save failed: " + "; ".join(errors)
            if future is not None:
                self._settle(future)
            if self._ctx.is_main:
                with _suppress_checkpoint_error():
                    self._proto.discard(staged)
                self._emit("checkpoint_save_failed", step=step, error=message)
            raise CheckpointError(message)

        def finish() -> None:
            err = self._settle(future)
            files = dict(entries)
            if hashing is not None:
                files.update(hashing.digests)
            local = None if err is None else f"rank {self._ctx.rank}: {err}"
            try:
                gathered = self._gather_in(group, (local, files))
                result = self._conclude(staged, gathered, stall_s=stall)
                result = self._broadcast_in(group, result)
            except Exception as exc:  # the group itself failed (a rank died): not committed
                result = f"error: the save of step {step} did not complete: {exc}"
            pending._finish(result if isinstance(result, str) else None)

        self._pending = pending
        threading.Thread(target=finish, name=f"flexrun-save-{step}", daemon=True).start()
        return pending

    @staticmethod
    def _settle(future: Any) -> str | None:
        """Wait for DCP's background write; its error, or None."""
        try:
            future.result()
        except (Exception, CheckpointException) as exc:
            return _dcp_error(exc)
        return None

    def _conclude(self, staged: Staged, gathered: list[Any], *, stall_s: float) -> str | None:
        """Rank 0: commit, or discard and say why (``"error: ..."``); others: None."""
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
                    read_safe_metadata(blobs[_METADATA])
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
