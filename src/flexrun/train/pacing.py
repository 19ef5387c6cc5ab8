"""Byte pipes of a checkpoint persist: hashing, rate caps and CPU pacing.

Owns the file-object wrappers a persist writes through: :class:`HashingWriter` (sha256
and size of what passes), :class:`ThrottledWriter` (an average byte-rate cap),
:class:`CpuPacer` and :class:`PacedWriter` (a background persist kept near a share of one
core) and :class:`PieceWriter` (large writes cut into bounded pieces, so that a buffered
upload never holds a second copy of a whole tensor), and :class:`IdlePriority` (a
background persist at ``SCHED_IDLE`` until someone waits for it). It does not know where bytes go
(``flexrun.train.storage``, ``flexrun.train.objstore``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from flexrun._clock import Clock
from flexrun.errors import CheckpointError

log = logging.getLogger(__name__)


class HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None
        """The first I/O error, kept because serializers (torch's zip writer) may rewrap it."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        try:
            written = self._raw.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        n = len(view) if written is None else written
        self.size += n
        return n

    def flush(self) -> None:
        self._raw.flush()


class ThrottledWriter:
    """Caps the average write rate (bytes/s) in 4 MiB pieces, so a background persist
    takes a bounded share of CPU and memory bandwidth from training."""

    _PIECE = 4 << 20

    def __init__(self, raw: Any, rate: float, clock: Clock) -> None:
        self._raw, self._rate, self._clock = raw, rate, clock
        self._start = clock.monotonic()
        self._sent = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self._PIECE):
            piece = view[i : i + self._PIECE]
            self._raw.write(piece)
            self._sent += len(piece)
            ahead = self._sent / self._rate - (self._clock.monotonic() - self._start)
            if ahead > 0:
                self._clock.sleep(ahead)
        return len(view)

    def flush(self) -> None:
        self._raw.flush()


class CpuPacer:
    """Keeps a background thread's CPU use near a share of one core: after each piece of
    work it rests for the CPU time the piece took times ``1/share - 1``.

    The measure is the calling thread's own CPU time, so time the thread spends waiting
    for a core (training has it) does not lengthen the rests, and nothing accumulates as
    credit for a later burst. :meth:`hurry` ends the pacing (a caller waits for the
    result); a rest in progress ends within ``_SLICE_S``.

    Call :meth:`start` and :meth:`pace` from the paced thread.
    """

    _SLICE_S = 0.05
    _MAX_REST_S = 1.0
    """One piece never earns a longer rest (a piece that took that long was preempted)."""

    def __init__(
        self,
        share: float,
        clock: Clock,
        *,
        cpu_time: Callable[[], float] = time.thread_time,
        free_s: float = 0.0,
    ) -> None:
        """
        Args:
            share: CPU share of one core, ``0 < share <= 1`` (1: never rests).
            clock: what the rests sleep on.
            cpu_time: the calling thread's CPU seconds (injected by tests).
            free_s: CPU seconds after :meth:`start` that earn no rest (a persist that
                costs less is not paced at all).

        Raises:
            CheckpointError: ``share`` or ``free_s`` out of range.
        """
        if not 0 < share <= 1:
            raise CheckpointError(f"persist CPU share must be in (0, 1], got {share}")
        if not (math.isfinite(free_s) and free_s >= 0):
            raise CheckpointError(f"unpaced persist CPU must be >= 0 s, got {free_s}")
        self._factor = 1.0 / share - 1.0
        self._free_left = free_s
        self._free_s = free_s
        self._clock = clock
        self._cpu_time = cpu_time
        self._hurry = threading.Event()
        self._mark: float | None = None
        self.rested_s = 0.0
        """Total rest so far (seconds on ``clock``)."""

    def start(self) -> None:
        self._mark = self._cpu_time()
        self._free_left = self._free_s

    def pace(self) -> None:
        """Rest in proportion to the CPU time used since :meth:`start` or the last call
        (beyond the first ``free_s`` after :meth:`start`)."""
        now = self._cpu_time()
        spent = now - (now if self._mark is None else self._mark)
        free = min(spent, self._free_left)
        self._free_left -= free
        rest = min((spent - free) * self._factor, self._MAX_REST_S)
        end = self._clock.monotonic() + rest
        for _ in range(int(rest / self._SLICE_S) + 2):  # bounded; a slice each
            left = end - self._clock.monotonic()
            if left <= 0 or self._hurry.is_set():
                break
            self._clock.sleep(min(left, self._SLICE_S))
            self.rested_s += min(left, self._SLICE_S)
        self._mark = self._cpu_time()  # the rest's own CPU is not work

    def hurry(self) -> None:
        """Stop resting from now on (thread-safe)."""
        self._hurry.set()


class PacedWriter:
    """Writes in pieces through a :class:`CpuPacer`, so hashing and writing each piece
    (the CPU cost of a persist) is spread out instead of taken in one burst."""

    _PIECE = 4 << 20

    def __init__(self, raw: Any, pacer: CpuPacer) -> None:
        self._raw, self._pacer = raw, pacer

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self._PIECE):
            self._raw.write(view[i : i + self._PIECE])
            self._pacer.pace()
        return len(view)

    def flush(self) -> None:
        self._raw.flush()


class PieceWriter:
    """Passes writes on in pieces of at most ``piece`` bytes (a view, never a copy)."""

    def __init__(self, raw: Any, piece: int = 4 << 20) -> None:
        self._raw, self._piece = raw, piece

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self._piece):
            self._raw.write(view[i : i + self._piece])
        return len(view)

    def flush(self) -> None:
        self._raw.flush()


def _can_leave_idle() -> bool:
    """Whether a thread of this process can go back from ``SCHED_IDLE`` to normal
    scheduling: Linux allows it only with ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` of 20
    (an unprivileged user's default is 0, and containers drop the capability). Tried once
    on a short-lived thread of its own; the answer is kept for the process."""
    global _LEAVE_OK
    if _LEAVE_OK is None:
        result: list[bool] = []

        def probe() -> None:
            tid = threading.get_native_id()
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):
                result.append(False)  # not Linux, or not even that
                return
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                result.append(True)
            except OSError:
                result.append(False)

        t = threading.Thread(target=probe, name="flexrun-sched-probe", daemon=True)
        t.start()
        t.join(5.0)
        _LEAVE_OK = bool(result and result[0])
        if not _LEAVE_OK:
            log.info(
                "background checkpoint persists run at normal priority (paced to their CPU "
                "share): SCHED_IDLE could not be left again when a save waits for one "
                "(needs CAP_SYS_NICE or `ulimit -e 20`)"
            )
    return _LEAVE_OK


_LEAVE_OK: bool | None = None


class IdlePriority:
    """Runs a background thread under ``SCHED_IDLE`` (Linux) until someone waits for it.

    At idle priority the thread takes only CPU time nothing else wants; on a node whose
    cores are all busy (other ranks, data-loader workers) it gets almost none. That is the
    point while training runs, but not once the training thread waits for it (the next
    ``save()``, ``wait()``, ``load()``): :meth:`leave`, called by the waiter, puts the
    thread back to normal scheduling, so the wait lasts about the persist's own work
    instead of until the node idles (a 0.25 s persist took 15 s beside three busy
    processes on 2 cores before). Where the process may not go back from ``SCHED_IDLE``
    (:func:`_can_leave_idle`), the thread is never lowered: a stall the waiter cannot end
    is worse than the CPU share the pacer already bounds.

    :meth:`enter` and :meth:`done` are called by the background thread, :meth:`leave` by
    any other; a thread that has been left is never lowered again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tid: int | None = None
        self._left = False

    def enter(self) -> None:
        """Lower the calling thread to ``SCHED_IDLE`` (unless :meth:`leave` came first,
        or it could not be raised again)."""
        if not _can_leave_idle():
            return
        with self._lock:
            if self._left:
                return
            tid = threading.get_native_id()
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError) as exc:  # not Linux or not permitted
                log.debug("could not lower the checkpoint thread's priority: %s", exc)
                return
            self._tid = tid

    def leave(self) -> None:
        """Put the thread back to normal scheduling now and for the rest of its work."""
        with self._lock:
            self._left = True
            tid, self._tid = self._tid, None
            if tid is None:
                return
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError as exc:  # (the probe said it could: limits changed since)
                log.warning(
                    "could not raise the checkpoint thread's priority while waiting for it "
                    "(%s): the wait lasts until the node's cores are free",
                    exc,
                )

    def done(self) -> None:
        """The thread is about to end: forget its id (a later :meth:`leave` must not
        touch a thread that reused it)."""
        with self._lock:
            self._tid = None
