"""Writing the checkpoint memory tier's copies: the file format, atomic writes, one thread.

Owns the format of a memory copy (the whole payload in one torch file, followed by a
32-byte trailer: a magic, the payload's length and its XXH3-128 checksum, computed while
the bytes are written, so verifying needs no manifest), writing one atomically (a per-writer
temporary name renamed into ``step_<N>.mem``), keeping the newest :data:`KEEP`, removing
what killed writers left, and the background thread that writes at most one copy at a
time: the deferred host copies first (the next ``optimizer.step()`` waits for them, as
for a durable save), then the file. It does not decide when a copy is written
(:mod:`flexrun.train.memtier`) nor which copy is loaded (:mod:`flexrun.train.memload`).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any

import psutil
import torch
import xxhash

from flexrun import worker_hook
from flexrun._clock import Clock
from flexrun.train.serialize import save_without_zip_crc
from flexrun.train.state import HostSnapshot, run_copies

log = logging.getLogger(__name__)

MAGIC = b"FLXMEM02"
TRAILER = struct.Struct("<8sQ16s")
"""magic, payload length, XXH3-128 of the payload: the last bytes of every copy.

The checksum is there to catch corruption (a flipped bit, a torn or stale copy), not
tampering: the memory directory is the job user's alone, and a copy is unpickled with
``weights_only`` only. It is not sha256 because a copy is written every step beside
training: sha256 of a 50M-parameter Adam state (576 MiB) took 0.39 s of CPU here, XXH3
0.06 s (bench/results/checkpoint_memory.txt)."""
CHECKSUM = xxhash.xxh3_128
"""The trailer's checksum: a hasher (``update``, ``digest``); the reader checks with it too."""
KEEP = 2
"""Copies kept per node: the newest and the one before it (used when the newest fails
verification). The older one is removed before a new one is written, so at most
``KEEP`` copies (one of them possibly being written) take memory at any time."""
COPY_RE = re.compile(r"^step_(\d+)\.mem$")
_TMP_RE = re.compile(r"^\.tmp-step_\d+-(\d+)-\d+$")


def copy_name(step: int) -> str:
    return f"step_{step}.mem"


def copy_steps(directory: Path) -> list[int]:
    """Steps of the complete (renamed) copies in ``directory``, ascending (unverified)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := COPY_RE.match(n)))


def payload_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a nested payload (what a copy of it takes, near enough)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    return 0


_PIECE = 1 << 20
"""Bytes hashed and written at a time: one pass over memory instead of two."""


class _HashingFile:
    """Passes writes to ``f``, hashing and counting them."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.checksum = CHECKSUM()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, view.nbytes, _PIECE):  # (hashed while in cache, then written)
            piece = view[i : i + _PIECE]
            self.checksum.update(piece)  # (releases the GIL)
            self._f.write(piece)
        self.nbytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def prune(directory: Path, *, keep: int) -> None:
    """Remove all but the newest ``keep`` copies."""
    steps = copy_steps(directory)
    for s in steps[: max(0, len(steps) - keep)]:
        (directory / copy_name(s)).unlink(missing_ok=True)


def write_copy(directory: Path, step: int, payload: dict[str, Any]) -> int:
    """Write ``payload`` as the copy of ``step`` (atomically); return its size in bytes.

    The oldest copy past :data:`KEEP` is not deleted but renamed to the temporary name
    and overwritten in place: its memory pages are already allocated, so a steady save
    costs no page allocation (on tmpfs, allocating means zeroing every page first).

    Raises:
        OSError: the memory filesystem refused (full, removed); nothing is left behind.
    """
    steps = copy_steps(directory)
    tmp = directory / f".tmp-step_{step}-{os.getpid()}-{threading.get_native_id()}"
    surplus = steps[: max(0, len(steps) - (KEEP - 1))]
    for s in surplus[1:]:
        (directory / copy_name(s)).unlink(missing_ok=True)
    reused = False
    if surplus:
        try:
            os.replace(directory / copy_name(surplus[0]), tmp)
            reused = True
        except FileNotFoundError:
            pass
    try:
        with open(tmp, "r+b" if reused else "wb") as f:
            hashing = _HashingFile(f)
            save_without_zip_crc(payload, hashing)
            f.write(TRAILER.pack(MAGIC, hashing.nbytes, hashing.checksum.digest()))
            f.truncate()
        os.replace(tmp, directory / copy_name(step))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return hashing.nbytes + TRAILER.size


def remove_stale(directory: Path) -> list[str]:
    """Remove temporary files whose writer process is gone (killed mid-write)."""
    removed = []
    for name in os.listdir(directory):
        m = _TMP_RE.match(name)
        if m and not psutil.pid_exists(int(m.group(1))):
            (directory / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


class MemSaver:
    """Writes memory copies on a background thread, one at a time (see the module docstring)."""

    def __init__(self, directory: Path, clock: Clock) -> None:
        self.directory = directory
        self.snapshot = HostSnapshot()
        """Host buffers of memory-only saves (durable saves use the Checkpointer's own)."""
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copied = threading.Event()
        self._copied.set()
        self.copy_wait_s = 0.0
        self.last_bytes = 0

    def start(
        self,
        step: int,
        payload: dict[str, Any],
        pending: list[tuple[torch.Tensor, torch.Tensor]],
        ready: threading.Event | None,
        counted: int = -1,
    ) -> None:
        """Write ``payload`` as ``step`` in the background: first the ``pending`` copies
        (``optimizer.step()`` waits for them), then, once ``ready`` is set (a durable
        persist's own deferred copies into the same payload), the file; then say the
        worker's step count ``counted`` (when the state was taken) can be resumed from."""
        self.copy_wait_s = 0.0
        if pending:
            self._copied.clear()
        self._thread = threading.Thread(
            target=self._run,
            args=(step, payload, pending, ready, counted),
            name=f"flexrun-mem-{step}",
        )
        self._thread.start()

    def _run(
        self,
        step: int,
        payload: dict[str, Any],
        pending: list[tuple[torch.Tensor, torch.Tensor]],
        ready: threading.Event | None,
        counted: int,
    ) -> None:
        try:
            try:
                run_copies(pending)
            finally:
                self._copied.set()
            if ready is not None:
                ready.wait()  # (set in a finally: never left unset)
            self.last_bytes = write_copy(self.directory, step, payload)
            worker_hook.saved(counted)
        except BaseException as exc:  # handed to the training thread at its next save
            self._error = exc

    @property
    def busy(self) -> bool:
        """A copy is being written."""
        return self._thread is not None and self._thread.is_alive()

    def hold_until_copied(self) -> None:
        if not self._copied.is_set():
            t0 = self._clock.monotonic()
            self._copied.wait()
            self.copy_wait_s += self._clock.monotonic() - t0

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take_error(self) -> BaseException | None:
        err, self._error = self._error, None
        return err
