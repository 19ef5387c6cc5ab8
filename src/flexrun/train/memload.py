"""Reading the checkpoint memory tier's copies: verify every byte before anything is used.

Owns checking a copy against its trailer (magic, length, checksum of the payload; a copy
rebuilt from memory with no integrity check once produced NaNs and 44 restarts elsewhere,
Megatron-LM#5281), unpickling it with ``weights_only=True`` only, and finding a node's
newest copy that verifies, skipping (and reporting) each one that does not. It does not
decide between memory and durable storage, nor talk to other ranks
(:mod:`flexrun.train.memtier`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexrun.errors import CheckpointError
from flexrun.train.memsave import CHECKSUM, MAGIC, TRAILER, copy_name, copy_steps
from flexrun.train.serialize import load_weights_only

log = logging.getLogger(__name__)


def verify_blob(blob: bytes, *, what: str) -> memoryview:
    """The payload of a copy's bytes once its trailer checks out.

    Raises:
        CheckpointError: truncated, not a memory copy, or its checksum differs.
    """
    if len(blob) < TRAILER.size:
        raise CheckpointError(f"{what}: truncated ({len(blob)} bytes)")
    magic, length, digest = TRAILER.unpack_from(blob, len(blob) - TRAILER.size)
    if magic != MAGIC:
        raise CheckpointError(f"{what}: not a memory copy (bad trailer)")
    if length != len(blob) - TRAILER.size:
        raise CheckpointError(
            f"{what}: {len(blob) - TRAILER.size} payload bytes, {length} expected"
        )
    payload = memoryview(blob)[:length]
    if CHECKSUM(payload).digest() != digest:
        raise CheckpointError(f"{what}: checksum mismatch (corrupted in memory)")
    return payload


def decode(blob: bytes, *, what: str) -> dict[str, Any]:
    """The state a verified copy holds.

    Raises:
        CheckpointError: it does not verify or is refused by ``weights_only``.
    """
    payload = verify_blob(blob, what=what)
    state = load_weights_only(bytes(payload), what=what)
    if not isinstance(state, dict):
        raise CheckpointError(f"{what}: not a checkpoint payload")
    return state


def newest_valid(directory: Path, on_skip: Callable[[int, str], None]) -> tuple[int, bytes] | None:
    """The newest copy in ``directory`` whose trailer verifies, as (step, bytes); each newer
    one that does not is reported to ``on_skip(step, reason)``. ``None``: no usable copy."""
    for step in reversed(copy_steps(directory)):
        what = f"memory copy {directory / copy_name(step)}"
        try:
            blob = (directory / copy_name(step)).read_bytes()
            verify_blob(blob, what=what)
        except (OSError, CheckpointError) as exc:
            log.warning("%s unusable, trying the one before: %s", what, exc)
            on_skip(step, str(exc))
            continue
        return step, blob
    return None
