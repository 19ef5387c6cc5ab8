"""The object-store checkpoint commit protocol (S3, GCS, Azure, memory:// ...): manifest last.

Owns, for storage without rename: how a checkpoint becomes visible and how a straggler is
kept from overwriting a newer round's. Layout under the root (``flexrun.train.layout``):
``fence.json``, ``latest``, and per checkpoint ``step_<N>/manifest.json`` plus the data
objects of one writer attempt under ``step_<N>/r<generation>-<id>/`` (the manifest's
``data_dir``; the generation is the round, with the run's epoch in its high bits, see
``flexrun.train.layout.claim_decision``). :func:`open_commit` chooses this protocol or the POSIX one
(``flexrun.train.commit``) from the directory, once.

Commit steps (each a fault-injection point in ``OBJECT_COMMIT_STAGES``): check the fence;
upload every data object under its final attempt prefix, streamed, each verified (its
size on the store; multipart parts carry the client's checksums); list the prefix and
check every object the manifest will name; check the fence; write ``manifest.json``: the
commit point, one atomic PUT, conditional: ``If-None-Match: *`` for a new step,
``If-Match: <etag>`` to replace an older-or-same-round manifest of the same step (a re-save
after a fallback); write ``latest``; re-check the fence; delete the replaced attempt's
objects. Readers list ``step_*/manifest.json``, take the newest that verifies, and ignore
objects no manifest names.

Failures: nothing before the manifest is visible to a reader, so a failed or killed save
leaves only unnamed objects (and, for a killed multipart upload, an incomplete upload);
the next writer's :meth:`ObjectCommit.claim` deletes those of generations <= its own and
aborts their incomplete uploads. An error after the manifest PUT withdraws it (a conditional
delete of exactly that version) and puts back the manifest it replaced.

Fencing: ``fence.json`` is raised by compare-and-set and never lowered; a manifest of
generation G is never replaced by a writer of a lower generation (the conditional PUT
fails if it changed since the writer read it). A new run of the job (its rounds start at
0 again) takes the next epoch, so a resumed job is never locked out by its own past. Where the store has no conditional writes
(``ObjectStore.conditional`` false), the same checks run just before each write:
best-effort, a window of one request remains.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, cast

from flexrun._clock import Clock
from flexrun.errors import CheckpointError, FencedError, PreconditionFailed
from flexrun.train.commit import RenameCommit
from flexrun.train.layout import (
    FENCE,
    LATEST,
    MANIFEST,
    STEP_RE,
    CommitProtocol,
    FaultHook,
    FenceRecord,
    Manifest,
    Staged,
    Writer,
    claim_decision,
    fenced_message,
    parse_fence,
    parse_latest,
    safe_name,
    step_dir_name,
)
from flexrun.train.objstore import ObjectStore, open_object_store
from flexrun.train.storage import Storage, open_storage

log = logging.getLogger(__name__)

OBJECT_COMMIT_STAGES = (
    "dir_created",
    "file_written",
    "files_written",
    "fence_checked",
    "manifest_written",
    "latest_updated",
    "committed",
)
"""Points between commit steps where a fault hook is called (``dir_created``: the attempt
prefix is chosen, nothing is written yet); from ``manifest_written`` on, the new
checkpoint is the one a reader loads."""

_ATTEMPT_RE = re.compile(r"^r(\d+)-[0-9a-f]{12}$")
_MANIFEST_KEY = re.compile(r"^step_(\d+)/manifest\.json$")
_CLAIM_TRIES = 20


class ObjectCommit:
    """The manifest-last protocol (see the module docstring) behind ``CommitProtocol``."""

    def __init__(self, store: ObjectStore, root: str) -> None:
        self.store = store
        self.root = root
        self.fencing = "conditional" if store.conditional else "best-effort"

    def path(self, *parts: str) -> str:
        return self.store.url(self._key(*parts))

    def _key(self, *parts: str) -> str:
        return self.store.join(self.root, *parts)

    # -- the fence -------------------------------------------------------------------------

    def _read_fence(self) -> tuple[FenceRecord, str] | None:
        got = self.store.get(self._key(FENCE))
        if got is None:
            return None
        return parse_fence(got[0], self.path()), got[1]

    def check_fence(self, generation: int) -> None:
        fence = self._read_fence()
        if fence is not None and fence[0].generation > generation:
            raise FencedError(fenced_message(self.path(), fence[0].generation, generation))

    def claim(self, *, run: str, round: int) -> int:
        for _ in range(_CLAIM_TRIES):
            fence = self._read_fence()
            record, generation = claim_decision(
                None if fence is None else fence[0], run=run, round=round, where=self.path()
            )
            if record is None:
                break
            try:
                if fence is None:
                    self.store.put(self._key(FENCE), record.to_json(), if_absent=True)
                else:
                    self.store.put(self._key(FENCE), record.to_json(), if_match=fence[1])
                break
            except PreconditionFailed:
                continue  # another writer moved the fence meanwhile: read it again
        else:
            raise CheckpointError(
                f"could not claim the checkpoint fence of {self.path()}: contended"
            )
        try:
            self._remove_stale(generation)
        except CheckpointError as exc:  # leftovers only cost space; the next writer retries
            log.warning("could not remove what crashed checkpoint writers left: %s", exc)
        return generation

    def _remove_stale(self, generation: int) -> None:
        """Delete attempt objects no manifest names and abort incomplete uploads, of
        generations <= ``generation`` (only its one writer calls this, before it writes)."""
        for path, upload_id in self.store.incomplete_uploads(self._key()):
            rel = path[len(self._key()) :].strip("/").split("/")
            if len(rel) >= 2 and STEP_RE.match(rel[0]) and _stale(rel[1], generation, keep=None):
                self.store.abort_upload(path, upload_id)
        for name in self.store.children(self._key()):
            m = STEP_RE.match(name)
            if m is None:
                continue
            referenced = self._referenced(int(m.group(1)))
            objects = self.store.listing(self._key(name))
            stale = [
                self._key(name, rel)
                for rel in objects
                if rel != MANIFEST and _stale(rel.split("/", 1)[0], generation, keep=referenced)
            ]
            self.store.delete(stale)

    def _referenced(self, step: int) -> str | None:
        try:
            return self.read_manifest(step).data_dir
        except CheckpointError:
            return None

    # -- listing and reading ---------------------------------------------------------------

    def steps(self) -> list[int]:
        steps = set()
        for rel in self.store.listing(self._key()):
            m = _MANIFEST_KEY.match(rel)
            if m:
                steps.add(int(m.group(1)))
        return sorted(steps)

    def read_manifest(self, step: int) -> Manifest:
        got = self.store.get(self._key(step_dir_name(step), MANIFEST))
        if got is None:
            raise CheckpointError(f"{step_dir_name(step)}: manifest.json missing")
        return Manifest.from_json(got[0])

    def read_chunks(self, step: int, manifest: Manifest, name: str) -> Iterator[bytes]:
        parts = [step_dir_name(step)] + ([manifest.data_dir] if manifest.data_dir else [])
        return self.store.read_chunks(self._key(*parts, safe_name(name, "checkpoint file")))

    def fingerprint(self, step: int) -> tuple[Any, ...]:
        listing = self.store.listing(self._key(step_dir_name(step)))
        return tuple(sorted((rel, i.size, i.token) for rel, i in listing.items()))

    def read_latest(self) -> int | None:
        got = self.store.get(self._key(LATEST))
        return None if got is None else parse_latest(got[0])

    # -- writing ---------------------------------------------------------------------------

    def begin(self, step: int, *, round: int, generation: int) -> Staged:
        self.check_fence(generation)
        attempt = f"r{generation}-{uuid.uuid4().hex[:12]}"
        return Staged(
            step=step,
            round=round,
            generation=generation,
            path=self._key(step_dir_name(step), attempt),
            data_dir=attempt,
        )

    def write(self, staged: Staged, name: str, writer: Writer) -> dict[str, Any]:
        if name == MANIFEST:
            raise CheckpointError(f"invalid checkpoint file name {name!r}")
        path = self.store.join(staged.path, safe_name(name, "checkpoint file name"))
        size, digest = self.store.upload(path, writer)
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
        hook = fault_hook or (lambda _stage: None)
        manifest = Manifest(
            step=staged.step,
            round=staged.round,
            world_size=world_size,
            created=clock.wall(),
            files={safe_name(k, "checkpoint file name"): dict(v) for k, v in entries.items()},
            meta=dict(meta or {}),
            data_dir=staged.data_dir,
            generation=staged.generation,
        )
        self._check_objects(staged, manifest)
        self.check_fence(staged.generation)
        hook("fence_checked")
        mkey = self._key(step_dir_name(staged.step), MANIFEST)
        token, previous = self._put_manifest(mkey, manifest)
        hook("manifest_written")
        try:
            self.store.put(self._key(LATEST), step_dir_name(staged.step).encode())
            hook("latest_updated")
            self.check_fence(staged.generation)
        except CheckpointError:
            # A newer round claimed the directory while we committed, or the store failed:
            # withdraw ours, so that a save reported failed left nothing new.
            self._withdraw(mkey, token, previous)
            raise
        hook("committed")
        try:
            self._remove_replaced(staged)
        except CheckpointError as exc:  # the new checkpoint is committed either way
            log.warning("could not delete the replaced checkpoint's objects: %s", exc)
        return manifest

    def _check_objects(self, staged: Staged, manifest: Manifest) -> None:
        """Every object the manifest names is on the store with its size."""
        listing = self.store.listing(staged.path)
        for name, entry in manifest.files.items():
            info = listing.get(name)
            if info is None:
                raise CheckpointError(f"{self.store.url(staged.path)}/{name}: not on the store")
            if info.size != int(entry["size"]):
                raise CheckpointError(
                    f"{self.store.url(staged.path)}/{name}: {info.size} bytes on the store, "
                    f"{entry['size']} written"
                )

    def _put_manifest(self, mkey: str, manifest: Manifest) -> tuple[str, bytes | None]:
        """Write the manifest by compare-and-set; the new token and the bytes it replaced."""
        body = manifest.to_json()
        current = self.store.get(mkey)
        try:
            if current is None:
                return self.store.put(mkey, body, if_absent=True), None
            old = _generation_of(current[0])
            if old is not None and old > manifest.fence_generation:
                raise FencedError(fenced_message(self.path(), old, manifest.fence_generation))
            return self.store.put(mkey, body, if_match=current[1]), current[0]
        except PreconditionFailed as exc:
            now = self.store.get(mkey)
            newer = None if now is None else _generation_of(now[0])
            mine = manifest.fence_generation
            if newer is not None and newer > mine:
                raise FencedError(fenced_message(self.path(), newer, mine)) from exc
            raise CheckpointError(
                f"{self.store.url(mkey)} was written by another writer (generation {newer}) "
                f"while this one (generation {mine}) committed"
            ) from exc

    def _withdraw(self, mkey: str, token: str, previous: bytes | None) -> None:
        try:
            if self.store.delete_if_match(mkey, token) and previous is not None:
                self.store.put(mkey, previous, if_absent=True)
        except CheckpointError as exc:  # the original error is the one raised
            log.error("could not withdraw checkpoint manifest %s: %s", self.store.url(mkey), exc)

    def _remove_replaced(self, staged: Staged) -> None:
        prefix = self._key(step_dir_name(staged.step))
        stale = [
            self.store.join(prefix, rel)
            for rel in self.store.listing(prefix)
            if rel != MANIFEST
            and _stale(rel.split("/", 1)[0], staged.generation, keep=staged.data_dir)
        ]
        self.store.delete(stale)

    def discard(self, staged: Staged) -> None:
        objects = [self.store.join(staged.path, rel) for rel in self.store.listing(staged.path)]
        self.store.delete(objects)
        for path, upload_id in self.store.incomplete_uploads(staged.path):
            self.store.abort_upload(path, upload_id)

    def remove(self, step: int) -> None:
        prefix = self._key(step_dir_name(step))
        # Manifest first: a deletion cut short leaves unnamed objects (removed by the next
        # claim), never a manifest naming missing objects.
        self.store.delete([self.store.join(prefix, MANIFEST)])
        self.store.delete([self.store.join(prefix, rel) for rel in self.store.listing(prefix)])


def _stale(attempt: str, generation: int, *, keep: str | None) -> bool:
    m = _ATTEMPT_RE.match(attempt)
    return m is not None and attempt != keep and int(m.group(1)) <= generation


def _generation_of(raw: bytes) -> int | None:
    try:
        return Manifest.from_json(raw).fence_generation
    except CheckpointError:
        return None  # a malformed manifest: anyone may replace it


def open_commit(
    directory: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    storage: Storage | ObjectStore | None = None,
) -> CommitProtocol:
    """The commit protocol for ``directory``: POSIX for local paths (and an injected
    :class:`~flexrun.train.storage.Storage`), manifest-last for fsspec URLs (and an
    injected :class:`~flexrun.train.objstore.ObjectStore`).

    Raises:
        CheckpointError: an unknown URL scheme or a missing fsspec backend, or
            ``storage_options`` given for a local path.
    """
    text = os.fspath(directory)
    if storage is not None:
        if hasattr(storage, "upload"):
            return ObjectCommit(cast(ObjectStore, storage), text)
        return RenameCommit(cast(Storage, storage), text)
    if "://" not in text or text.startswith("file://"):
        if storage_options:
            raise CheckpointError(f"{text}: storage_options apply to fsspec URLs, not local paths")
        local, root = open_storage(text)
        return RenameCommit(local, root)
    store, root = open_object_store(text, storage_options)
    return ObjectCommit(store, root)
