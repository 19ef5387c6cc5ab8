"""Reading a replicated checkpoint back from durable storage: the newest that verifies.

Owns, for :class:`flexrun.train.checkpoint.Checkpointer` (rank 0 chooses, every rank
reads the chosen step): verifying and unpickling one checkpoint (``weights_only``), the
check that it holds every registered object, remembering a checkpoint verified unchanged
while it was read (retention need not verify it again), and walking the candidates
newest first with a ``checkpoint_fallback`` event for each one skipped. It does not
apply the state nor decide between durable storage and the memory tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flexrun.errors import CheckpointError
from flexrun.train.layout import CommitProtocol, Manifest, VerifiedCache, verify
from flexrun.train.serialize import load_weights_only

log = logging.getLogger(__name__)

RNG_FILE = "rng.pt"
EXTRA_FILE = "extra.pt"

Read = Callable[[int], tuple[Manifest, dict[str, Any]]]
Found = tuple[int | None, tuple[Manifest, dict[str, Any]] | None, list[int], str | None]
"""(step chosen, what was read, steps skipped, why none verifies)."""


def read_replicated(
    proto: CommitProtocol,
    step: int,
    objects: list[str],
    verified: VerifiedCache,
    is_main: bool,
) -> tuple[Manifest, dict[str, Any]]:
    """The manifest and state of ``step``, keyed by object name (and the RNG and extra
    files by their file names).

    Raises:
        CheckpointError: it does not verify, is refused by ``weights_only``, or lacks a
            registered object.
    """
    before = proto.fingerprint(step) if is_main else None
    manifest, blobs = verify(proto, step)
    state = {
        name: load_weights_only(blob, what=f"step_{step}/{name}") for name, blob in blobs.items()
    }
    missing = [n for n in objects if f"{n}.pt" not in state]
    if missing:
        raise CheckpointError(f"step_{step} lacks registered state {missing}")
    if before is not None and before == proto.fingerprint(step):
        verified.mark(proto, step)  # unchanged while it was read
    return manifest, {
        (k[: -len(".pt")] if k not in (RNG_FILE, EXTRA_FILE) else k): v for k, v in state.items()
    }


def newest_durable(
    candidates: list[int], read: Read, emit: Callable[..., None], directory: str
) -> Found:
    """The first of ``candidates`` that reads: (step, what was read, steps skipped,
    failure); the failure says why none did (``None`` when one did or there were none)."""
    skipped: list[int] = []
    reasons: list[str] = []
    for s in candidates:
        try:
            return s, read(s), skipped, None
        except CheckpointError as exc:
            skipped.append(s)
            reasons.append(str(exc))
            emit("checkpoint_fallback", step=s, reason=str(exc))
            log.warning("checkpoint step %d unusable, falling back: %s", s, exc)
    if not candidates:
        return None, None, skipped, None
    failure = f"no checkpoint in {directory} verifies (tried {candidates}): " + "; ".join(reasons)
    return None, None, skipped, failure
