"""The checkpoint layout and the interface every commit protocol implements.

Owns what is the same whatever the storage: the names (``step_<N>/``, ``manifest.json``,
``latest``, ``fence.json``), the :class:`Manifest` record and its strict parser, the
parsers of the pointer and fence records (plain JSON or text: nothing read from a
checkpoint directory is ever unpickled here), the pure retention choice, the
:class:`CommitProtocol` a Checkpointer talks to, and the two operations written once on
top of any protocol: verifying a checkpoint against its manifest and pruning by retention
(counting only checkpoints that verified). The protocols themselves live in
``flexrun.train.commit`` (POSIX: stage, fsync, rename) and ``flexrun.train.commit_object``
(object stores: data under the final prefix, manifest last by conditional write).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import flexrun
from flexrun._clock import Clock
from flexrun.errors import CheckpointError, FencedError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
FENCE = "fence.json"
STEP_RE = re.compile(r"^step_(\d+)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

FaultHook = Callable[[str], None]
"""Called with a stage name between commit steps (tests kill or fail the writer there)."""

Writer = Callable[[Any], object]
"""Writes one file's bytes into the binary file object it is given."""


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def safe_name(name: str, what: str) -> str:
    """``name`` if it is one plain path component, else a CheckpointError (a manifest
    from elsewhere must never name a path outside its checkpoint)."""
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise CheckpointError(f"{what} {name!r} is not a plain file name")
    return name


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
    data_dir: str = ""
    """Sub-prefix of ``step_<N>/`` holding the data files (object stores: one per writer
    attempt, so no writer ever overwrites another's objects); empty: the step directory."""
    generation: int | None = None
    """The writer's fencing generation (see :func:`claim_decision`); None: its round."""
    format_version: int = FORMAT_VERSION
    flexrun_version: str = flexrun.__version__

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    @property
    def fence_generation(self) -> int:
        return self.round if self.generation is None else self.generation

    def to_json(self) -> bytes:
        d: dict[str, Any] = {
            "format_version": self.format_version,
            "step": self.step,
            "round": self.round,
            "world_size": self.world_size,
            "created": self.created,
            "flexrun_version": self.flexrun_version,
            "files": self.files,
            "meta": self.meta,
        }
        if self.data_dir:
            d["data_dir"] = self.data_dir
        if self.generation is not None:
            d["generation"] = self.generation
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and validate a manifest (JSON only; every name a plain file name).

        Raises:
            CheckpointError: not JSON, wrong format version, missing fields or unsafe names.
        """
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise CheckpointError("manifest is not a JSON object")
            if d.get("format_version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"manifest format version {d.get('format_version')!r} is not {FORMAT_VERSION}"
                )
            files = {
                safe_name(str(k), "manifest file"): {
                    "size": int(v["size"]),
                    "sha256": str(v["sha256"]),
                }
                for k, v in d["files"].items()
            }
            data_dir = str(d.get("data_dir") or "")
            if data_dir:
                safe_name(data_dir, "manifest data_dir")
            generation = d.get("generation")
            return cls(
                step=int(d["step"]),
                round=int(d["round"]),
                world_size=int(d["world_size"]),
                created=float(d["created"]),
                files=files,
                meta=dict(d.get("meta") or {}),
                data_dir=data_dir,
                generation=None if generation is None else int(generation),
                flexrun_version=str(d.get("flexrun_version", "")),
            )
        except CheckpointError:
            raise
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            OverflowError,
            RecursionError,
        ) as exc:  # (UnicodeDecodeError is a ValueError)
            raise CheckpointError(f"manifest is malformed: {exc}") from exc


EPOCH_SHIFT = 32
"""A fencing generation is ``epoch << EPOCH_SHIFT | round``: rounds order writers within
one run; each new run (job incarnation) that claims a directory starts a new epoch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FenceRecord:
    """``fence.json``: the newest writer generation that claimed a directory, and its run."""

    generation: int
    run: str | None

    @property
    def epoch(self) -> int:
        return self.generation >> EPOCH_SHIFT

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "generation": self.generation,
                "epoch": self.epoch,
                "round": self.generation & ((1 << EPOCH_SHIFT) - 1),
                "run": self.run,
            },
            sort_keys=True,
        ).encode()


def parse_fence(raw: bytes, where: str) -> FenceRecord:
    """The record in ``fence.json`` (older records hold only ``round``).

    Raises:
        CheckpointError: not a JSON object with an integer ``generation`` or ``round``.
    """
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise TypeError("not a JSON object")
        generation = int(d["generation"] if "generation" in d else d["round"])
        run = d.get("run")
        return FenceRecord(generation=generation, run=None if run is None else str(run))
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise CheckpointError(f"fence record in {where} is malformed: {exc}") from exc


def claim_decision(
    current: FenceRecord | None, *, run: str, round: int, where: str
) -> tuple[FenceRecord | None, int]:
    """What a writer of ``round`` in run ``run`` claims: the record to write (None: the
    fence stays) and its generation. The same run keeps its epoch and orders by round
    (an older round is a straggler); another run (a new incarnation of the job, whose
    rounds start again) takes the next epoch, so every writer of the previous run is
    fenced from then on.

    Raises:
        FencedError: a newer round of the same run already claimed the directory.
    """
    if round < 0 or round >= 1 << EPOCH_SHIFT:
        raise CheckpointError(f"round {round} out of range")
    if current is None:
        return FenceRecord(generation=round, run=run), round
    if current.run != run:
        generation = ((current.epoch + 1) << EPOCH_SHIFT) | round
        return FenceRecord(generation=generation, run=run), generation
    generation = (current.epoch << EPOCH_SHIFT) | round
    if current.generation > generation:
        raise FencedError(fenced_message(where, current.generation, generation))
    if current.generation == generation:
        return None, generation
    return FenceRecord(generation=generation, run=run), generation


def parse_latest(raw: bytes) -> int | None:
    """The step a ``latest`` pointer names, or ``None`` when it names none (a hint only)."""
    m = STEP_RE.match(raw.decode(errors="replace").strip())
    return int(m.group(1)) if m else None


def _describe(generation: int) -> str:
    epoch, round = generation >> EPOCH_SHIFT, generation & ((1 << EPOCH_SHIFT) - 1)
    return f"round {round}" if epoch == 0 else f"round {round} of run epoch {epoch}"


def fenced_message(root: str, fenced: int, generation: int) -> str:
    return (
        f"checkpoint directory {root} belongs to {_describe(fenced)}; this writer is from "
        f"{_describe(generation)} and must not write (a straggler of an old round)"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Staged:
    """One save in progress: where its data files go until it is published."""

    step: int
    round: int
    generation: int
    """The writer's fencing generation (what ``claim`` returned)."""
    path: str
    """Directory (POSIX staging dir) or prefix (object store attempt) of the data files."""
    data_dir: str = ""
    """What the manifest records as ``data_dir`` (object stores)."""


class CommitProtocol(Protocol):
    """How checkpoints become visible on one kind of storage. Chosen once, from the storage.

    Every method raises :class:`~flexrun.errors.CheckpointError` (``StorageFailure`` when
    the storage refused: full, read-only, failing; ``FencedError`` when a newer round owns
    the directory).
    """

    root: str
    fencing: str
    """``"conditional"`` (the store compares and sets), ``"checked"`` (checked before and
    after publishing; a window of one operation remains) or ``"best-effort"``."""

    def path(self, *parts: str) -> str:
        """A path (or URL) below the root, for events and for DCP."""
        ...

    def claim(self, *, run: str, round: int) -> int:
        """Claim the directory for this writer (:func:`claim_decision`; the fence is never
        lowered), remove what crashed writers of older generations left (staging,
        unnamed objects, incomplete uploads) and return this writer's generation. Raises
        FencedError when a newer round of the same run owns the directory."""
        ...

    def check_fence(self, generation: int) -> None:
        """Raise FencedError if a newer generation than ``generation`` claimed the directory."""
        ...

    def steps(self) -> list[int]:
        """Steps that have a committed (not necessarily verified) manifest, ascending."""
        ...

    def begin(self, step: int, *, round: int, generation: int) -> Staged:
        """Make a place for a new save's data files."""
        ...

    def write(self, staged: Staged, name: str, writer: Writer) -> dict[str, Any]:
        """Write one data file (streamed; verified as written); its manifest entry."""
        ...

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
        """Write the manifest and make the checkpoint visible, or nothing (see the module)."""
        ...

    def discard(self, staged: Staged) -> None:
        """Remove an unpublished save's data (best effort is not enough: raise on failure)."""
        ...

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step`` (CheckpointError when absent or malformed)."""
        ...

    def read_chunks(self, step: int, manifest: Manifest, name: str) -> Iterator[bytes]:
        """The bytes of one data file of ``step``, in pieces."""
        ...

    def fingerprint(self, step: int) -> tuple[Any, ...]:
        """Cheap identity of a checkpoint's current objects (sizes, etags or mtimes): a
        verification stays valid while this is unchanged."""
        ...

    def remove(self, step: int) -> None:
        """Delete a whole checkpoint, its manifest first."""
        ...

    def read_latest(self) -> int | None:
        """The step ``latest`` names (a hint: loading lists and verifies)."""
        ...


def verify(
    proto: CommitProtocol, step: int, *, keep: Callable[[str], bool] = lambda _n: True
) -> tuple[Manifest, dict[str, bytes]]:
    """Check every file of ``step`` against its manifest (size and sha256), streaming;
    return the manifest and the bytes of the files ``keep`` selects.

    Raises:
        CheckpointError: missing manifest or file, or a size/checksum mismatch; the message
            says which.
    """
    name = step_dir_name(step)
    manifest = proto.read_manifest(step)
    if manifest.step != step:
        raise CheckpointError(f"{name}: manifest says step {manifest.step}")
    data: dict[str, bytes] = {}
    for fname, entry in manifest.files.items():
        h = hashlib.sha256()
        size = 0
        kept: list[bytes] | None = [] if keep(fname) else None
        for chunk in proto.read_chunks(step, manifest, fname):
            h.update(chunk)
            size += len(chunk)
            if kept is not None:
                kept.append(chunk)
        if size != entry["size"]:
            raise CheckpointError(f"{name}/{fname}: size {size} != manifest {entry['size']}")
        if h.hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{name}/{fname}: sha256 mismatch (corrupted)")
        if kept is not None:
            data[fname] = b"".join(kept)
    return manifest, data


def select_retained(
    steps: list[int],
    *,
    keep_last: int,
    keep_every: int | None,
    good: Collection[int] | None = None,
) -> set[int]:
    """Which of ``steps`` retention keeps: the newest ``keep_last`` of those in ``good``
    (all, when ``good`` is None) plus every multiple of ``keep_every``. Never empty when
    ``steps`` is not: with no good checkpoint at all, nothing is given up."""
    counted = sorted(s for s in steps if good is None or s in good)
    keep = set(counted[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    if steps and not counted:
        return set(steps)
    if steps and not keep:
        keep.add(max(counted))
    return keep


class VerifiedCache:
    """Which checkpoints verified, valid while their fingerprint is unchanged, so that
    retention counts only good checkpoints without re-reading them at every save."""

    def __init__(self) -> None:
        self._good: dict[int, tuple[Any, ...]] = {}

    def mark(self, proto: CommitProtocol, step: int) -> None:
        """Record that ``step`` verified (just written, or just read and checked)."""
        try:
            self._good[step] = proto.fingerprint(step)
        except CheckpointError:
            self._good.pop(step, None)

    def is_good(self, proto: CommitProtocol, step: int) -> bool:
        """Whether ``step`` verifies: the cached answer while nothing changed, else a full
        (streamed) verification."""
        try:
            before = proto.fingerprint(step)
        except CheckpointError:
            return False
        if self._good.get(step) == before:
            return True
        try:
            verify(proto, step, keep=lambda _n: False)
        except CheckpointError:
            self._good.pop(step, None)
            return False
        self._good[step] = before
        return True


def prune(
    proto: CommitProtocol,
    *,
    keep_last: int,
    keep_every: int | None,
    protect: int,
    cache: VerifiedCache | None = None,
) -> list[int]:
    """Delete whole checkpoints that retention does not keep. ``protect`` (just committed)
    never goes; ``keep_last`` counts only checkpoints that verify, newest first, so a
    corrupt checkpoint never displaces a good one and the only good one is never removed.

    Raises:
        CheckpointError: listing or deleting failed (what was deleted stays deleted).
    """
    steps = proto.steps()
    if protect not in steps:
        return []
    cache = cache or VerifiedCache()
    good = {protect}
    for s in sorted((s for s in steps if s < protect), reverse=True):
        if len(good) >= keep_last:
            break
        if cache.is_good(proto, s):
            good.add(s)
    keep = select_retained(steps, keep_last=keep_last, keep_every=keep_every, good=good)
    removed = []
    for s in steps:
        if s not in keep and s < protect:
            proto.remove(s)
            removed.append(s)
    return removed
