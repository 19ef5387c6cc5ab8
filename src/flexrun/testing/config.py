"""A :class:`~flexrun.config.RunConfig` from flat keyword arguments, for tests.

Owns only the sorting of a field name into the part that holds it (worker, output, observe,
spares, or the config itself), so a test can say ``run_config(entrypoint=..., run_dir=...,
mode="live")`` without spelling the parts. It does not validate beyond what the parts do.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from flexrun.config import (
    ObserveSettings,
    OutputSettings,
    RunConfig,
    SpareSettings,
    WorkerSpec,
)

_PARTS: dict[str, type[Any]] = {
    "worker": WorkerSpec,
    "output": OutputSettings,
    "observe": ObserveSettings,
    "spares": SpareSettings,
}


def run_config(**flat: Any) -> RunConfig:
    """Sort ``flat`` into the parts by field name; a name no part has is an error."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
    top: dict[str, Any] = {}
    own = {f.name for f in fields(RunConfig)}
    for key, value in flat.items():
        part = next((n for n, cls in _PARTS.items() if key in {f.name for f in fields(cls)}), None)
        if part is not None:
            parts[part][key] = value
        elif key in own:
            top[key] = value
        else:
            raise TypeError(f"run_config: no part of RunConfig has a field {key!r}")
    built = {name: cls(**parts[name]) for name, cls in _PARTS.items()}
    return RunConfig(**built, **top)
