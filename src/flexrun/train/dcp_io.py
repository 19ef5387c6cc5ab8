"""What :class:`~flexrun.train.sharded.ShardedCheckpointer` puts between its state and DCP.

Owns DCP's plumbing for sharded checkpoints: metadata read through an exact allow-list
(:data:`METADATA_GLOBALS`, never plain ``pickle``), the safe file and fsspec readers, the
load planner (non-tensor items ``weights_only=True``; a checkpoint holding state under a
registered name that the object does not ask for is refused, as DCP would drop it
silently), the writer's hashing filesystem (size and sha256 of every file as it streams
out), the adapters through which registered modules and optimizers are saved and restored
(``torch.distributed.checkpoint.state_dict``), and DCP's error text. It does not save, load
or commit (``flexrun.train.sharded``).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
from collections.abc import Collection, Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from flexrun.errors import CheckpointError
from flexrun.train.layout import safe_name

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


def read_safe_metadata(blob: bytes, *, files: Collection[str] | None = None) -> Metadata:
    """Parse DCP metadata without running code, and check every file it names.

    Each storage entry's ``relative_path`` must be one plain file name (so the reader
    opens it below the checkpoint's data directory, never an absolute or ``../`` path)
    and, when ``files`` (the names the manifest verified) is given, one of them.

    Raises:
        CheckpointError: it names a global outside the allow-list, is not metadata, or
            a storage entry names a path outside the checkpoint or the manifest.
    """
    try:
        meta = _MetadataUnpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # UnpicklingError, AttributeError, EOFError ...
        raise CheckpointError(f"DCP metadata refused: {exc}") from exc
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"DCP metadata is a {type(meta).__name__}, not Metadata")
    _check_storage_paths(meta, files)
    return meta


def _check_storage_paths(meta: Metadata, files: Collection[str] | None) -> None:
    storage = meta.storage_data
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise CheckpointError(f"DCP metadata storage_data is a {type(storage).__name__}")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str):
            raise CheckpointError(f"DCP metadata names a file {rel!r} that is not a string")
        try:
            safe_name(rel, "DCP metadata file")
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (a path outside the checkpoint)") from None
        if files is not None and rel not in files:
            raise CheckpointError(f"DCP metadata names {rel!r}, a file the manifest does not list")


class _SafeMetadata:
    """A DCP reader mixin: ``.metadata`` through the allow-list, never plain pickle."""

    fs: Any
    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self.fs.concat_path(self.path, _METADATA), "rb") as fh:
            meta = read_safe_metadata(fh.read())  # every rank checks the paths it will open
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


def _base(path: Any) -> str:
    return os.path.basename(str(os.fspath(path)).rstrip("/"))
