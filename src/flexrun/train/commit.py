"""The POSIX checkpoint commit protocol (local and shared filesystems), independent of what is saved.

Owns, for storage with an atomic rename: writing a checkpoint so that a crash at any
instant leaves either the old or the new one (``.tmp-*`` staging directories renamed into
``<root>/step_<N>/``, ``latest`` moved by rename), the round fence on such storage, and
the removal of what crashed writers left. :class:`RenameCommit` is this protocol behind
:class:`flexrun.train.layout.CommitProtocol`; object stores (no rename) use
``flexrun.train.commit_object`` instead. The names, the manifest, verification and
retention are shared (``flexrun.train.layout``). It does not serialize tensors
(``flexrun.train.checkpoint`` passes writer callables) and never decides when to save.

Commit steps, in order (each is a fault-injection point named in ``COMMIT_STAGES``):
stage files in ``.tmp-step_<N>-r<round>-<id>/`` (each file fsynced, then the directory),
write ``manifest.json`` last, write the new ``latest`` pointer to a temporary file, check
the fence, rename the directory to ``step_<N>`` (never over a live one), fsync the root,
point ``latest`` at it by atomic rename, re-check the fence, prune old checkpoints.

Failures: every byte is written before anything is published, so a full disk (or any
write error) fails a save before the rename and leaves no file behind. An error after
the rename (the pointer's rename, a raised fence) withdraws the new checkpoint, so a save
reported failed never leaves a new checkpoint visible; a checkpoint moved aside to be
re-saved is put back.

Fencing: the one writer of round R claims ``fence.json`` (R) when its Checkpointer is
built; a writer of an older round is refused at construction, before staging and before
the rename, and withdraws its checkpoint if it finds the fence raised after renaming.
Without a compare-and-set on the filesystem a window of one rename remains between the
last check and the rename; the withdrawal closes most of it. Staging directories are per
writer, so writes never interleave.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import CheckpointError, FencedError
from flexrun.train.layout import (
    FENCE,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    STEP_RE,
    FaultHook,
    FenceRecord,
    Manifest,
    Staged,
    Writer,
    claim_decision,
    fenced_message,
    parse_fence,
    parse_latest,
    select_retained,
    step_dir_name,
    verify,
)
from flexrun.train.storage import Storage

__all__ = [
    "COMMIT_STAGES",
    "FENCE",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "FaultHook",
    "FencedError",
    "Manifest",
    "RenameCommit",
    "check_fence",
    "claim_fence",
    "commit_checkpoint",
    "finalize_staged",
    "list_steps",
    "read_fence",
    "read_latest",
    "remove_stale_staging",
    "select_retained",
    "staging_dir",
    "step_dir_name",
    "verify_checkpoint",
]

_STEP_RE = STEP_RE
_TMP_RE = re.compile(r"^\.(?:tmp|trash|latest|fence)-(?:.*-)?r(\d+)-[0-9a-f]+$")

COMMIT_STAGES = (
    "dir_created",
    "file_written",
    "files_written",
    "manifest_written",
    "fence_checked",
    "renamed",
    "latest_updated",
    "committed",
)
"""Points between commit steps where a fault hook is called (tests kill the process there)."""


def list_steps(storage: Storage, root: str) -> list[int]:
    """Steps of committed checkpoint directories, ascending (unverified)."""
    steps = []
    for name in storage.list_dir(root):
        m = _STEP_RE.match(name)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_fence_record(storage: Storage, root: str) -> FenceRecord | None:
    """The ``fence.json`` record of ``root``, or ``None``.

    Raises:
        CheckpointError: the fence record exists but cannot be read.
    """
    if FENCE not in storage.list_dir(root):
        return None
    return parse_fence(storage.read_bytes(storage.join(root, FENCE)), root)


def read_fence(storage: Storage, root: str) -> int | None:
    """The highest writer generation (the round, within a run's first epoch) that claimed
    ``root``, or ``None``.

    Raises:
        CheckpointError: the fence record exists but cannot be read.
    """
    record = read_fence_record(storage, root)
    return None if record is None else record.generation


def check_fence(storage: Storage, root: str, round: int) -> None:
    """Raise :class:`FencedError` if a newer generation than ``round`` (a writer's
    generation) has claimed ``root``."""
    fenced = read_fence(storage, root)
    if fenced is not None and fenced > round:
        raise FencedError(fenced_message(root, fenced, round))


def claim_fence(storage: Storage, root: str, round: int, *, run: str = "local") -> int:
    """Record this writer (``round`` of run ``run``) as the directory's newest (never lowers
    it; see :func:`flexrun.train.layout.claim_decision`); return its generation.

    Raises:
        FencedError: a newer round of the same run already claimed it.
        CheckpointError: the record cannot be written.
    """
    storage.makedirs(root)
    record, generation = claim_decision(
        read_fence_record(storage, root), run=run, round=round, where=root
    )
    if record is None:
        return generation
    tmp = storage.join(root, f".fence-r{generation}-{uuid.uuid4().hex}")
    payload = record.to_json()
    storage.write_file(tmp, lambda f: f.write(payload))
    try:
        storage.rename(tmp, storage.join(root, FENCE), replace=True)
    except CheckpointError:
        _remove_quietly(storage, tmp)
        raise
    return generation


def remove_stale_staging(storage: Storage, root: str, round: int) -> list[str]:
    """Delete staging/trash directories and temporary pointer/fence files left by crashed
    writers of generations <= ``round`` (a writer's generation).

    Only the one writer of that generation may call this, before it starts writing.
    """
    removed = []
    for name in storage.list_dir(root):
        m = _TMP_RE.match(name)
        if m and int(m.group(1)) <= round:
            storage.remove_tree(storage.join(root, name))
            removed.append(name)
    return removed


def staging_dir(storage: Storage, root: str, step: int, round: int) -> str:
    """A fresh staging directory path for ``step`` (not yet created)."""
    return storage.join(root, f".tmp-{step_dir_name(step)}-r{round}-{uuid.uuid4().hex[:12]}")


def commit_checkpoint(
    storage: Storage,
    root: str,
    *,
    step: int,
    round: int,
    world_size: int,
    files: Mapping[str, Callable[[Any], object]],
    meta: Mapping[str, Any] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    fault_hook: FaultHook | None = None,
    generation: int | None = None,
) -> Manifest:
    """Write ``files`` (name -> writer callable) as checkpoint ``step`` and commit it
    (``generation``: the writer's fencing generation; default its round).

    Either the whole checkpoint becomes visible as ``step_<step>`` or nothing does; the
    staging directory is removed on failure.

    Raises:
        FencedError: a newer round owns the directory.
        CheckpointError: any write, sync or rename failed (e.g. disk full).
    """
    hook = fault_hook or (lambda _stage: None)
    gen = round if generation is None else generation
    check_fence(storage, root, gen)
    tmp = staging_dir(storage, root, step, gen)
    committed = False
    try:
        storage.makedirs(tmp)
        hook("dir_created")
        entries: dict[str, dict[str, Any]] = {}
        for name, writer in files.items():
            if name == MANIFEST or "/" in name:
                raise CheckpointError(f"invalid checkpoint file name {name!r}")
            size, digest = storage.write_file(storage.join(tmp, name), writer)
            entries[name] = {"size": size, "sha256": digest}
            hook("file_written")
        hook("files_written")
        manifest = finalize_staged(
            storage,
            root,
            tmp,
            step=step,
            round=round,
            world_size=world_size,
            entries=entries,
            meta=meta,
            clock=clock,
            fault_hook=fault_hook,
            generation=generation,
        )
        committed = True
        return manifest
    finally:
        if not committed:
            try:
                storage.remove_tree(tmp)
            except CheckpointError as cleanup_exc:  # the original error matters more
                _note(cleanup_exc)


def finalize_staged(
    storage: Storage,
    root: str,
    tmp: str,
    *,
    step: int,
    round: int,
    world_size: int,
    entries: Mapping[str, Mapping[str, Any]],
    meta: Mapping[str, Any] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    fault_hook: FaultHook | None = None,
    generation: int | None = None,
) -> Manifest:
    """Commit a staging directory whose data files are durable: manifest, fence, rename, latest.

    The caller removes ``tmp`` if this raises before the rename.

    Raises:
        FencedError: a newer round owns the directory.
        CheckpointError: a write, sync or rename failed.
    """
    hook = fault_hook or (lambda _stage: None)
    gen = round if generation is None else generation
    final = storage.join(root, step_dir_name(step))
    manifest = Manifest(
        step=step,
        round=round,
        world_size=world_size,
        created=clock.wall(),
        files={k: dict(v) for k, v in entries.items()},
        meta=dict(meta or {}),
        generation=generation,
    )
    body = manifest.to_json()
    storage.write_file(storage.join(tmp, MANIFEST), lambda f: f.write(body))
    hook("manifest_written")
    # The pointer's bytes are written before anything is published, so a full disk fails
    # the save here and never after the checkpoint became visible.
    pointer = storage.join(root, f".latest-r{gen}-{uuid.uuid4().hex[:12]}")
    name_bytes = step_dir_name(step).encode()
    storage.write_file(pointer, lambda f: f.write(name_bytes))
    trash: str | None = None
    published = False
    try:
        check_fence(storage, root, gen)
        hook("fence_checked")
        if step in list_steps(storage, root):
            # Re-saving a step (a resumed run redoing work after falling back past a bad
            # checkpoint): move the old one aside first; it comes back if this one fails.
            trash = storage.join(
                root, f".trash-{step_dir_name(step)}-r{gen}-{uuid.uuid4().hex[:12]}"
            )
            storage.rename(final, trash, replace=False)
        try:
            storage.rename(tmp, final, replace=False)
        except CheckpointError:
            _restore(storage, trash, final)
            raise
        published = True
        hook("renamed")
        try:
            storage.rename(pointer, storage.join(root, LATEST), replace=True)
            hook("latest_updated")
            check_fence(storage, root, gen)
        except CheckpointError:
            # A newer round claimed the directory while we committed, or the storage
            # failed: withdraw ours, so that a save reported failed left nothing new.
            _withdraw(storage, final)
            _restore(storage, trash, final)
            _remove_quietly(storage, pointer)
            raise
        hook("committed")
    finally:
        if not published:
            _remove_quietly(storage, pointer)
    if trash is not None:
        _remove_quietly(storage, trash)  # the new checkpoint is committed either way
    return manifest


def _restore(storage: Storage, trash: str | None, final: str) -> None:
    """Put a checkpoint moved aside for a re-save back in place (best effort, logged)."""
    if trash is None:
        return
    try:
        storage.rename(trash, final, replace=False)
    except CheckpointError as exc:
        logging.getLogger(__name__).error(
            "could not move the previous checkpoint %s back to %s: %s", trash, final, exc
        )


def _withdraw(storage: Storage, final: str) -> None:
    try:
        storage.remove_tree(final)
    except CheckpointError as exc:  # the original error is the one raised
        logging.getLogger(__name__).error("could not withdraw checkpoint %s: %s", final, exc)


def _remove_quietly(storage: Storage, path: str) -> None:
    try:
        storage.remove_tree(path)
    except CheckpointError as exc:  # left for remove_stale_staging; the caller's error matters more
        _note(exc)


def _note(exc: BaseException) -> None:
    logging.getLogger(__name__).warning("checkpoint cleanup failed: %s", exc)


def read_latest(storage: Storage, root: str) -> int | None:
    """Step the ``latest`` pointer names, or ``None`` (a hint only; loading verifies)."""
    if LATEST not in storage.list_dir(root):
        return None
    return parse_latest(storage.read_bytes(storage.join(root, LATEST)))


def verify_checkpoint(storage: Storage, root: str, step: int) -> tuple[Manifest, dict[str, bytes]]:
    """Read a checkpoint's manifest and files and check every size and sha256.

    Raises:
        CheckpointError: missing manifest or file, or a size/checksum mismatch; the message
            says which.
    """
    return verify(RenameCommit(storage, root), step)


class RenameCommit:
    """The POSIX protocol (see the module docstring) behind ``CommitProtocol``."""

    fencing = "checked"

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.root = root

    def path(self, *parts: str) -> str:
        return self.storage.join(self.root, *parts)

    def claim(self, *, run: str, round: int) -> int:
        self.storage.makedirs(self.root)
        generation = claim_fence(self.storage, self.root, round, run=run)
        try:
            remove_stale_staging(self.storage, self.root, generation)
        except CheckpointError as exc:  # leftovers only cost space; the next writer retries
            logging.getLogger(__name__).warning(
                "could not remove stale checkpoint staging: %s", exc
            )
        return generation

    def check_fence(self, generation: int) -> None:
        check_fence(self.storage, self.root, generation)

    def steps(self) -> list[int]:
        return list_steps(self.storage, self.root)

    def begin(self, step: int, *, round: int, generation: int) -> Staged:
        self.check_fence(generation)
        tmp = staging_dir(self.storage, self.root, step, generation)
        self.storage.makedirs(tmp)
        return Staged(step=step, round=round, generation=generation, path=tmp)

    def write(self, staged: Staged, name: str, writer: Writer) -> dict[str, Any]:
        if name == MANIFEST or "/" in name or os.sep in name:
            raise CheckpointError(f"invalid checkpoint file name {name!r}")
        size, digest = self.storage.write_file(self.storage.join(staged.path, name), writer)
        return {"size": size, "sha256": digest}

    def publish(
        self,
        staged: Staged,
        *,
        world_size: int,
        entries: Mapping[str, Mapping[str, Any]],
        meta: Mapping[str, Any] | None,
        clock: Clock,
        fault_hook: FaultHook | None,
    ) -> Manifest:
        return finalize_staged(
            self.storage,
            self.root,
            staged.path,
            step=staged.step,
            round=staged.round,
            world_size=world_size,
            entries=entries,
            meta=meta,
            clock=clock,
            fault_hook=fault_hook,
            generation=staged.generation,
        )

    def discard(self, staged: Staged) -> None:
        self.storage.remove_tree(staged.path)

    def read_manifest(self, step: int) -> Manifest:
        d = self.path(step_dir_name(step))
        if MANIFEST not in self.storage.list_dir(d):
            raise CheckpointError(f"{step_dir_name(step)}: manifest.json missing")
        return Manifest.from_json(self.storage.read_bytes(self.storage.join(d, MANIFEST)))

    def read_chunks(self, step: int, manifest: Manifest, name: str) -> Iterator[bytes]:
        d = (
            self.path(step_dir_name(step), manifest.data_dir)
            if manifest.data_dir
            else (self.path(step_dir_name(step)))
        )
        if name not in self.storage.list_dir(d):
            raise CheckpointError(f"{step_dir_name(step)}/{name}: file missing")
        return self.storage.read_chunks(self.storage.join(d, name))

    def fingerprint(self, step: int) -> tuple[Any, ...]:
        return self.storage.fingerprint(self.path(step_dir_name(step)))

    def remove(self, step: int) -> None:
        d = self.path(step_dir_name(step))
        # Manifest first: a deletion cut short leaves files without a manifest (ignored,
        # removed by the next claim), never a manifest naming missing files.
        self.storage.remove_tree(self.storage.join(d, MANIFEST))
        self.storage.remove_tree(d)

    def read_latest(self) -> int | None:
        return read_latest(self.storage, self.root)
