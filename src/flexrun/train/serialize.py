"""Bytes of one replicated checkpoint file: torch serialization, safely in both directions.

Owns writing state with ``torch.save`` (without the zip container's CRC32, which the
manifest's sha256 makes redundant), through the persist's pacing and rate cap, and
reading it back with ``weights_only=True`` only, so a checkpoint can never run code; and
moving a persist thread to idle priority when asked (``persist_when_idle``). It does not
know where files go.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import torch

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import CheckpointError
from flexrun.train.pacing import CpuPacer, PacedWriter, ThrottledWriter

log = logging.getLogger(__name__)


def load_weights_only(blob: bytes, *, what: str) -> Any:
    """Deserialize with ``weights_only=True``: a checkpoint can never run code.

    Raises:
        CheckpointError: the bytes are not a torch file or contain non-allowlisted objects.
    """
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError ...
        raise CheckpointError(f"{what}: refused to load (weights_only): {exc}") from exc


def torch_writer(
    obj: Any,
    rate: float | None = None,
    clock: Clock = SYSTEM_CLOCK,
    pacer: CpuPacer | None = None,
) -> Any:
    def write(f: Any) -> None:
        target: Any = f  # a file-like is all torch needs
        if pacer is not None:
            target = PacedWriter(target, pacer)
        if rate:
            target = ThrottledWriter(target, rate, clock)
        save_without_zip_crc(obj, target)

    return write


_CRC_CONFIG_LOCK = threading.Lock()


class _RestoreOnFirstWrite:
    """Passes writes through; the first one (or ``restore()``) runs ``undo`` once."""

    def __init__(self, raw: Any, undo: Callable[[], None]) -> None:
        self._raw, self._undo = raw, undo
        self._pending = True

    def restore(self) -> None:
        if self._pending:
            self._pending = False
            self._undo()

    def write(self, data: Any) -> int:
        self.restore()
        return int(self._raw.write(data))

    def flush(self) -> None:
        self._raw.flush()


def save_without_zip_crc(obj: Any, f: Any) -> None:
    """``torch.save(obj, f)`` without the zip container's CRC32 of each tensor.

    The manifest's sha256 of every file already detects corruption; torch's CRC32 would
    be a second pass over every byte (about 0.5 s of CPU per 576 MiB here, taken in one
    burst per tensor before the first byte is written, so it cannot be paced). torch.load
    reads such files as usual. torch reads its ``compute_crc32`` setting, a process-wide
    one, when it opens the zip writer, before pickling; the setting is restored at the
    first byte written, so another thread's ``torch.save`` sees it off for at most that
    moment (its file then merely lacks CRCs too).
    """
    try:
        from torch.utils.serialization import config as ser_config
    except ImportError:  # an older torch: it always computes CRC32
        torch.save(obj, f)
        return
    _CRC_CONFIG_LOCK.acquire()  # released by the guard at the first write, same thread
    before = ser_config.save.compute_crc32

    def undo() -> None:
        ser_config.save.compute_crc32 = before
        _CRC_CONFIG_LOCK.release()

    guard = _RestoreOnFirstWrite(f, undo)
    try:
        ser_config.save.compute_crc32 = False
        torch.save(obj, cast(Any, guard))  # (torch needs only write())
    finally:
        guard.restore()

