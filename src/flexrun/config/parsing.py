"""Parsers of the values ``flexrun run`` takes: one function per kind of value, pure.

Owns the syntax (and the one clear error) of node ranges, worker counts, endpoints,
``k=v`` lists, durations, torchrun's per-rank stream maps (``-t 0:3,1:1``), rank filters
and signal lists, and torchrun's ``PET_*`` default rules. It reads no environment itself:
callers pass the mapping (``flexrun.config.process_environ()``).
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
from collections.abc import Mapping

from flexrun.errors import ConfigError

log = logging.getLogger("flexrun.config")

DEFAULT_STORE_PORT = 29400
STREAMS = frozenset({"stdout", "stderr"})
_STD = {
    "0": frozenset(),
    "1": frozenset({"stdout"}),
    "2": frozenset({"stderr"}),
    "3": STREAMS,
}


MAX_NODES = 1_000_000
"""The largest ``--nnodes`` MAX (beyond it the keep-alive arithmetic overflows)."""
MAX_NPROC = 1_000_000


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4). Raises ConfigError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if not m:
        raise ConfigError(
            f"--nnodes {text!r}: expected N or MIN:MAX with positive integers, e.g. 1:4"
        )
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise ConfigError(f"--nnodes {text!r}: MIN must be at least 1")
    if hi > MAX_NODES:
        raise ConfigError(f"--nnodes {str(text)[:40]!r}: at most {MAX_NODES} nodes")
    if lo > hi:
        raise ConfigError(
            f"--nnodes {text!r}: MIN ({lo}) is greater than MAX ({hi}); write MIN:MAX, e.g. {hi}:{lo}"
        )
    return lo, hi


def parse_nproc(text: str, *, cuda_count: int | None = None, cpu_count: int | None = None) -> int:
    """``N``, ``auto``, ``cpu``, ``gpu`` (or ``xpu``) -> a positive worker count, as torchrun."""
    value = str(text).strip().lower()
    if value == "cpu":
        return cpu_count or os.cpu_count() or 1
    if value in ("gpu", "auto"):
        if cuda_count is None:
            cuda_count = _cuda_count()
        if cuda_count > 0:
            return cuda_count
        if value == "gpu":
            raise ConfigError("--nproc-per-node gpu: no CUDA device is visible on this node")
        return cpu_count or os.cpu_count() or 1
    if value == "xpu":
        count = _xpu_count()
        if count < 1:
            raise ConfigError("--nproc-per-node xpu: no XPU device is visible on this node")
        return count
    # (ASCII digits only: str.isdigit() is true for "²", which int() refuses)
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_NPROC:
        raise ConfigError(
            f"--nproc-per-node {str(text)[:40]!r}: expected an integer 1-{MAX_NPROC}, auto, "
            "cpu, gpu or xpu"
        )
    return int(value)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _xpu_count() -> int:
    try:
        import torch

        xpu = getattr(torch, "xpu", None)
        return int(xpu.device_count()) if xpu is not None and xpu.is_available() else 0
    except ImportError:
        return 0


def parse_endpoint(
    text: str, default_port: int = DEFAULT_STORE_PORT, *, allow_port_zero: bool = False
) -> list[tuple[str, int]]:
    """``"host:port[,host2:port2]"`` -> [(host, port), ...]; IPv6 in brackets.

    ``allow_port_zero``: port 0 means "a free port on this host" (torchrun's
    ``localhost:0``).
    """
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", part)
        if not m:
            raise ConfigError(f"--rdzv-endpoint {text!r}: expected HOST[:PORT][,HOST[:PORT]...]")
        host = m.group(1) or m.group(3)
        port_s = m.group(2) or m.group(4)
        port = int(port_s) if port_s else default_port
        low = 0 if allow_port_zero else 1
        if not low <= port < 65536:
            raise ConfigError(f"--rdzv-endpoint {text!r}: port {port} is out of range {low}-65535")
        out.append((host, port))
    return out


def parse_kv(text: str, what: str = "--rdzv-conf") -> dict[str, str]:
    """``"a=1,b=x"`` -> {"a": "1", "b": "x"}."""
    out: dict[str, str] = {}
    for part in str(text or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what} {text!r}: expected key=value[,key=value...], got {part!r}")
        out[key.strip()] = value.strip()
    return out


def check_name(value: str, flag: str) -> str:
    """An id or name that becomes part of a path, a store key or a log line: not empty,
    at most 200 characters, no path separator, no control character, not ``.`` or ``..``.

    Raises:
        ConfigError: it is not such a name.
    """
    if not value:
        raise ConfigError(f"{flag}: must not be empty")
    if len(value) > 200:
        raise ConfigError(f"{flag} {value[:40]!r}...: at most 200 characters")
    if value in (".", "..") or "/" in value or "\\" in value:
        raise ConfigError(f"{flag} {value!r}: no path separators, and not '.' or '..'")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"{flag} {value!r}: no control characters (newline, tab ...)")
    return value


MAX_DURATION_S = 365 * 86400.0
"""The longest duration a user may give (one year): beyond it a sleep, a thread's wait or
a deadline overflows (``1e300`` killed the threads that waited on it)."""


def parse_duration(value: object, flag: str, *, positive: bool = False) -> float:
    """A number of seconds: finite, not negative (``positive``: above 0), at most
    :data:`MAX_DURATION_S`.

    Raises:
        ConfigError: not a number, NaN, infinite, negative (or 0 where ``positive``), or
            longer than a year.
    """
    try:
        seconds = float(str(value).strip())
    except (ValueError, OverflowError):
        raise ConfigError(f"{flag} {value!r}: expected a number of seconds") from None
    if not math.isfinite(seconds):
        raise ConfigError(f"{flag} {value!r}: must be a finite number of seconds")
    if seconds < 0 or (positive and seconds == 0):
        raise ConfigError(
            f"{flag} {value!r}: must be {'above 0' if positive else '0 or more'} seconds"
        )
    if seconds > MAX_DURATION_S:
        raise ConfigError(
            f"{flag} {value!r}: must be at most {MAX_DURATION_S:.0f} seconds (one year)"
        )
    return seconds


def parse_std(text: str | None, flag: str) -> frozenset[str] | dict[int, frozenset[str]]:
    """torchrun's ``Std.from_str``: ``"3"`` -> both streams; ``"0:3,1:1"`` -> per local rank
    (ranks not named: none). 0 none, 1 stdout, 2 stderr, 3 both."""
    value = (text or "0").strip()
    if value in _STD:
        return _STD[value]
    out: dict[int, frozenset[str]] = {}
    for part in value.split(","):
        rank, sep, std = part.strip().partition(":")
        if not sep or not rank.isdigit() or std not in _STD:
            raise ConfigError(
                f"{flag} {value!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or "
                "LOCAL_RANK:N,... per local rank (e.g. 0:3,1:1)"
            )
        out[int(rank)] = _STD[std]
    return out


def parse_ranks_filter(text: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,2`` -> {0, 2}; empty -> None (every rank)."""
    if not text or not str(text).strip():
        return None
    try:
        ranks = frozenset(int(p) for p in str(text).split(","))
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter {text!r}: expected a comma-separated list of local ranks, "
            "e.g. 0,1,2"
        ) from None
    if any(r < 0 for r in ranks):
        raise ConfigError(f"--local-ranks-filter {text!r}: local ranks are 0 or more")
    return ranks


_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def parse_signals(text: str | None) -> tuple[str, ...]:
    """``--signals-to-handle``: the names given, stripped (torchrun passes them on verbatim);
    a name that is no signal here, or one that cannot be caught, is warned about and will be
    skipped by :func:`signal_numbers`, as torchrun does."""
    names = tuple(n.strip() for n in str(text or "").split(",") if n.strip())
    for name in names:
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals):
            log.warning("--signals-to-handle %s: no such signal here; it is not handled", name)
        elif sig in _UNCATCHABLE:
            log.warning("--signals-to-handle %s: cannot be caught; it is not handled", name)
    return names


def signal_numbers(names: tuple[str, ...]) -> tuple[int, ...]:
    """The catchable signals among ``names`` (see :func:`parse_signals`)."""
    out = []
    for name in names:
        sig = getattr(signal, name, None)
        if isinstance(sig, signal.Signals) and sig not in _UNCATCHABLE:
            out.append(int(sig))
    return tuple(dict.fromkeys(out))


def pet_name(dest: str) -> str:
    """torchrun's rule: option ``--foo-bar`` (dest ``foo_bar``) defaults from ``PET_FOO_BAR``."""
    return "PET_" + dest.upper().replace("-", "_")


def env_default(environ: Mapping[str, str], option: str, default: str | None) -> str | None:
    """torchrun's ``env`` action: ``PET_<OPTION>`` if set (even empty), else ``default``."""
    return environ.get(pet_name(option), default)


def env_flag(environ: Mapping[str, str], option: str) -> bool:
    """torchrun's ``check_env`` action: ``bool(int(PET_<OPTION>))`` (``PET_STANDALONE=2`` is
    true); ``true``/``false``/``yes``/``no`` are taken too.

    Raises:
        ConfigError: any other value (torchrun fails with a ValueError traceback).
    """
    name = pet_name(option)
    raw = environ.get(name, "0").strip()
    try:
        return bool(int(raw))
    except ValueError:
        pass
    if raw.lower() in ("true", "yes", "on"):
        return True
    if raw.lower() in ("false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={raw!r}: expected an integer (0: off, else on) or true/false")
