"""The checkpoint commit protocol and the on-disk layout, independent of what is saved.

Owns: the layout (``<root>/step_<N>/`` with data files and ``manifest.json``, the
``latest`` pointer, the ``fence.json`` round record, ``.tmp-*`` staging directories),
writing a checkpoint so that a crash at any instant leaves either the old or the new one,
verifying a checkpoint against its manifest, the round fence, and retention. It does not
serialize tensors (``flexrun.train.checkpoint`` passes writer callables) and never
decides when to save.

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

import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import flexrun
from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import CheckpointError
from flexrun.train.storage import Storage

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
FENCE = "fence.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
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

FaultHook = Callable[[str], None]


class FencedError(CheckpointError):
    """A writer from an older round tried to write after a newer round claimed the directory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """What ``manifest.json`` records about one checkpoint."""

    step: int
    round: int
    world_size: int
    created: float
    files: dict[str, dict[str, Any]]
    """name -> {"size": bytes, "sha256": hex digest}"""
    meta: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    flexrun_version: str = flexrun.__version__

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format_version": self.format_version,
                "step": self.step,
                "round": self.round,
                "world_size": self.world_size,
                "created": self.created,
                "flexrun_version": self.flexrun_version,
                "files": self.files,
                "meta": self.meta,
            },
            indent=1,
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and validate a manifest.

        Raises:
            CheckpointError: not JSON, wrong format version or missing fields.
        """
        try:
            d = json.loads(raw)
            if d.get("format_version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"manifest format version {d.get('format_version')!r} is not {FORMAT_VERSION}"
                )
            files = {
                str(k): {"size": int(v["size"]), "sha256": str(v["sha256"])}
                for k, v in d["files"].items()
            }
            return cls(
                step=int(d["step"]),
                round=int(d["round"]),
                world_size=int(d["world_size"]),
                created=float(d["created"]),
                files=files,
                meta=dict(d.get("meta") or {}),
                flexrun_version=str(d.get("flexrun_version", "")),
            )
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"manifest is malformed: {exc}") from exc


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def list_steps(storage: Storage, root: str) -> list[int]:
    """Steps of committed checkpoint directories, ascending (unverified)."""
    steps = []
    for name in storage.list_dir(root):
        m = _STEP_RE.match(name)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_fence(storage: Storage, root: str) -> int | None:
    """The highest round that claimed ``root``, or ``None``.

    Raises:
        CheckpointError: the fence record exists but cannot be read.
    """
    if FENCE not in storage.list_dir(root):
        return None
    try:
        return int(json.loads(storage.read_bytes(storage.join(root, FENCE)))["round"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"fence record in {root} is malformed: {exc}") from exc


def check_fence(storage: Storage, root: str, round: int) -> None:
    """Raise :class:`FencedError` if a newer round than ``round`` has claimed ``root``."""
    fenced = read_fence(storage, root)
    if fenced is not None and fenced > round:
        raise FencedError(
            f"checkpoint directory {root} belongs to round {fenced}; this writer is from "
            f"round {round} and must not write (a straggler of an old round)"
        )


def claim_fence(storage: Storage, root: str, round: int) -> None:
    """Record ``round`` as the directory's newest writer round (never lowers it).

    Raises:
        FencedError: a newer round already claimed it.
        CheckpointError: the record cannot be written.
    """
    storage.makedirs(root)
    check_fence(storage, root, round)
    if read_fence(storage, root) == round:
        return
    tmp = storage.join(root, f".fence-r{round}-{uuid.uuid4().hex}")
    payload = json.dumps({"round": round}).encode()
    storage.write_file(tmp, lambda f: f.write(payload))
    try:
        storage.rename(tmp, storage.join(root, FENCE), replace=True)
    except CheckpointError:
        _remove_quietly(storage, tmp)
        raise


def remove_stale_staging(storage: Storage, root: str, round: int) -> list[str]:
    """Delete staging/trash directories and temporary pointer/fence files left by crashed
    writers of rounds <= ``round``.

    Only the one writer of ``round`` may call this, before it starts writing.
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
) -> Manifest:
    """Write ``files`` (name -> writer callable) as checkpoint ``step`` and commit it.

    Either the whole checkpoint becomes visible as ``step_<step>`` or nothing does; the
    staging directory is removed on failure.

    Raises:
        FencedError: a newer round owns the directory.
        CheckpointError: any write, sync or rename failed (e.g. disk full).
    """
    hook = fault_hook or (lambda _stage: None)
    check_fence(storage, root, round)
    tmp = staging_dir(storage, root, step, round)
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
) -> Manifest:
    """Commit a staging directory whose data files are durable: manifest, fence, rename, latest.

    The caller removes ``tmp`` if this raises before the rename.

    Raises:
        FencedError: a newer round owns the directory.
        CheckpointError: a write, sync or rename failed.
    """
    hook = fault_hook or (lambda _stage: None)
    final = storage.join(root, step_dir_name(step))
    manifest = Manifest(
        step=step,
        round=round,
        world_size=world_size,
        created=clock.wall(),
        files={k: dict(v) for k, v in entries.items()},
        meta=dict(meta or {}),
    )
    body = manifest.to_json()
    storage.write_file(storage.join(tmp, MANIFEST), lambda f: f.write(body))
    hook("manifest_written")
    # The pointer's bytes are written before anything is published, so a full disk fails
    # the save here and never after the checkpoint became visible.
    pointer = storage.join(root, f".latest-r{round}-{uuid.uuid4().hex[:12]}")
    name_bytes = step_dir_name(step).encode()
    storage.write_file(pointer, lambda f: f.write(name_bytes))
    trash: str | None = None
    published = False
    try:
        check_fence(storage, root, round)
        hook("fence_checked")
        if step in list_steps(storage, root):
            # Re-saving a step (a resumed run redoing work after falling back past a bad
            # checkpoint): move the old one aside first; it comes back if this one fails.
            trash = storage.join(
                root, f".trash-{step_dir_name(step)}-r{round}-{uuid.uuid4().hex[:12]}"
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
            check_fence(storage, root, round)
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
    m = _STEP_RE.match(storage.read_bytes(storage.join(root, LATEST)).decode(errors="replace"))
    return int(m.group(1)) if m else None


def verify_checkpoint(storage: Storage, root: str, step: int) -> tuple[Manifest, dict[str, bytes]]:
    """Read a checkpoint's manifest and files and check every size and sha256.

    Raises:
        CheckpointError: missing manifest or file, or a size/checksum mismatch; the message
            says which.
    """
    d = storage.join(root, step_dir_name(step))
    names = set(storage.list_dir(d))
    if MANIFEST not in names:
        raise CheckpointError(f"{step_dir_name(step)}: manifest.json missing")
    manifest = Manifest.from_json(storage.read_bytes(storage.join(d, MANIFEST)))
    if manifest.step != step:
        raise CheckpointError(f"{step_dir_name(step)}: manifest says step {manifest.step}")
    data: dict[str, bytes] = {}
    for name, entry in manifest.files.items():
        if name not in names:
            raise CheckpointError(f"{step_dir_name(step)}/{name}: file missing")
        blob = storage.read_bytes(storage.join(d, name))
        if len(blob) != entry["size"]:
            raise CheckpointError(
                f"{step_dir_name(step)}/{name}: size {len(blob)} != manifest {entry['size']}"
            )
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{step_dir_name(step)}/{name}: sha256 mismatch (corrupted)")
        data[name] = blob
    return manifest, data


def select_retained(steps: list[int], *, keep_last: int, keep_every: int | None) -> set[int]:
    """Which of ``steps`` retention keeps: the newest ``keep_last`` plus multiples of ``keep_every``."""
    keep = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    if steps and not keep:
        keep.add(max(steps))
    return keep


def prune(
    storage: Storage,
    root: str,
    *,
    keep_last: int,
    keep_every: int | None,
    protect: int,
) -> list[int]:
    """Delete checkpoints that retention does not keep; ``protect`` (just committed) never goes.

    Deletes only when ``protect`` is committed, so the only good checkpoint is never removed.
    """
    steps = list_steps(storage, root)
    if protect not in steps:
        return []
    keep = select_retained(steps, keep_last=keep_last, keep_every=keep_every) | {protect}
    removed = []
    for s in steps:
        if s not in keep and s < protect:
            storage.remove_tree(storage.join(root, step_dir_name(s)))
            removed.append(s)
    return removed
