"""Checking event-log records before the readers (report, analysis) use them.

An event log is outside input: anyone who can write the run directory can put any line
in it, and a log copied from another machine may be damaged. This module owns the rule
for what a usable event is: a JSON object with a finite number ``ts``, a non-empty
string ``event``, an integer (or absent) ``round``; the typed fields the readers compute
with (``world_size``, ``steps_per_s``, ``members``, a ``resources`` sample's counters...)
are of their type, or dropped. A line that is not such an event is skipped and counted,
never an exception. It does not read files (:mod:`flexrun.events` and the readers do).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MAX_ABS_TS = 1e11
"""Timestamps are seconds since the epoch: below 0 or beyond about the year 5138 a line
is not an event."""

_INT_FIELDS = ("world_size", "rank", "step", "nodes", "exit_code", "local_rank")
_FLOAT_FIELDS = ("steps_per_s", "samples_per_s", "duration_s", "ettr", "failure_ettr")
_LIST_FIELDS = ("members", "joined")
_RESOURCE_INTS = ("mem_used_bytes", "net_rx_bytes", "net_tx_bytes", "mem_total_bytes")
_GPU_INTS = ("index", "mem_used_bytes")
_GPU_FLOATS = ("util_ratio", "temp_c")


MAX_ABS_INT = 2**63
"""An integer field beyond a signed 64-bit counter is not a count (and a float of it may
overflow): the field is dropped."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < MAX_ABS_INT


def _is_finite(v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    # An int compares with a float exactly; math.isfinite(int) would convert it and
    # raise OverflowError on one beyond a float's range.
    return abs(v) <= 1e300 and (isinstance(v, int) or math.isfinite(v))


def _typed(d: dict[str, Any], ints: tuple[str, ...], floats: tuple[str, ...]) -> bool:
    """Drop null counters (read as absent); False when one is of the wrong type."""
    for k in (*ints, *floats):
        if k in d and d[k] is None:
            del d[k]
    return all(_is_int(d[k]) for k in ints if k in d) and all(
        _is_finite(d[k]) for k in floats if k in d
    )


def _clean_gpu(g: object) -> dict[str, Any] | None:
    if not isinstance(g, Mapping):
        return None
    out = {str(k): v for k, v in g.items()}
    return out if _typed(out, _GPU_INTS, _GPU_FLOATS) else None


def _clean_resources(out: dict[str, Any]) -> bool:
    """Whether a ``resources`` sample is usable (its counters numbers, its GPUs objects)."""
    if not _typed(out, _RESOURCE_INTS, ("cpu_ratio",)):
        return False
    gpus = out.get("gpus")
    if gpus is None:
        return True
    if not isinstance(gpus, list):
        return False
    cleaned = [_clean_gpu(g) for g in gpus]
    if any(g is None for g in cleaned):
        return False
    out["gpus"] = cleaned
    return True


def clean_event(record: object) -> dict[str, Any] | None:
    """A copy of ``record`` fit for the readers, or None when it is not a usable event.

    Typed fields of the wrong type are removed (an event with ``world_size: "x"`` still
    counts as the event it is, without a world size); a wrong ``ts``, ``event`` or
    ``round`` makes the whole record unusable.
    """
    if not isinstance(record, Mapping):
        return None
    ts = record.get("ts")
    kind = record.get("event")
    rnd = record.get("round")
    if not _is_finite(ts) or not 0 <= ts <= MAX_ABS_TS:  # type: ignore[operator]
        return None
    if not isinstance(kind, str) or not kind:
        return None
    if rnd is not None and not _is_int(rnd):
        return None
    out = {str(k): v for k, v in record.items()}
    out["ts"] = float(ts)  # type: ignore[arg-type]
    for name in _INT_FIELDS:
        if name in out and out[name] is not None and not _is_int(out[name]):
            del out[name]
    for name in _FLOAT_FIELDS:
        if name in out and out[name] is not None and not _is_finite(out[name]):
            del out[name]
    for name in _LIST_FIELDS:
        if name in out and not (
            isinstance(out[name], list) and all(isinstance(x, str) for x in out[name])
        ):
            del out[name]
    if kind == "resources" and not _clean_resources(out):
        return None
    return out


__all__ = ["MAX_ABS_INT", "MAX_ABS_TS", "clean_event"]
