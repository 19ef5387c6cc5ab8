"""Asynchronous sharded saves: ``ShardedCheckpointer.save(step, asynchronous=True)``.

Owns the part of a save after the collective begin: every rank stages its state
(``dcp.async_save``: a copy in host memory) and writes its small files, the ranks agree
that all staged (the end of the stall), and a background thread waits for DCP's write,
gathers the digests and has rank 0 commit, over the checkpointer's own gloo group so that
training's collectives never interleave with the save's. :class:`PendingSave` tells when.
It does not begin, commit or discard (the checkpointer does, with flexrun's protocol).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from flexrun import worker_hook
from flexrun.errors import CheckpointError
from flexrun.train.dcp_io import _dcp_error
from flexrun.train.layout import Staged

if TYPE_CHECKING:
    from flexrun.train.sharded import ShardedCheckpointer

log = logging.getLogger(__name__)


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


def _settle(future: Any) -> str | None:
    """Wait for DCP's background write; its error, or None."""
    try:
        future.result()
    except (Exception, CheckpointException) as exc:
        return _dcp_error(exc)
    return None


def _gather_in(ck: ShardedCheckpointer, group: Any, obj: Any) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * ck._ctx.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast_in(group: Any, obj: Any) -> Any:
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def save_async(
    ck: ShardedCheckpointer,
    step: int,
    staged: Staged,
    objects: dict[str, Any],
    extra: dict[str, Any] | None,
    t0: float,
) -> PendingSave:
    """Stage on every rank (collective), then write and commit in the background.

    Raises:
        CheckpointError: a rank failed to stage; nothing is committed.
    """
    group = ck._group() if ck._distributed() else None
    pending = PendingSave(step)
    counted = worker_hook.counted()  # (the state's step count, said once committed)
    local_error, entries, future, hashing = None, {}, None, None
    try:
        writer, hashing = ck._dcp_writer(staged)
        future = dcp.async_save(
            objects, storage_writer=writer, process_group=group, no_dist=group is None
        )
        entries = ck._write_small(staged, extra)
    except (Exception, CheckpointException) as exc:
        local_error = f"rank {ck._ctx.rank}: {_dcp_error(exc)}"
    # Every rank staged (or failed to): the stall ends here, for all of them at once.
    # (Over training's group: DCP's writer thread is using the save's group by now.)
    errors = [e for e in ck._gather(local_error) if e]
    stall = ck._clock.monotonic() - t0
    pending.stall_s = stall
    if errors:
        message = "sharded save failed: " + "; ".join(errors)
        if future is not None:
            _settle(future)
        if ck._ctx.is_main:
            with _suppress_checkpoint_error():
                ck._proto.discard(staged)
            ck._emit("checkpoint_save_failed", step=step, error=message)
        raise CheckpointError(message)

    def finish() -> None:
        err = _settle(future)
        files = dict(entries)
        if hashing is not None:
            files.update(hashing.digests)
        local = None if err is None else f"rank {ck._ctx.rank}: {err}"
        try:
            gathered = _gather_in(ck, group, (local, files))
            result = ck._conclude(staged, gathered, stall_s=stall, counted=counted)
            result = _broadcast_in(group, result)
        except Exception as exc:  # the group itself failed (a rank died): not committed
            result = f"error: the save of step {step} did not complete: {exc}"
        pending._finish(result if isinstance(result, str) else None)

    threading.Thread(target=finish, name=f"flexrun-save-{step}", daemon=True).start()
    return pending
