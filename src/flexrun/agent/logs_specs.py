"""``--logs-specs NAME``: a torchrun ``LogsSpecs`` plugin deciding each worker's files.

Owns loading the plugin class (the ``torchrun.logs_specs`` entry point that
:mod:`flexrun.config.plugins` found: importing it imports torch and the user's code, so it
happens here, in the agent, not while the configuration is read), building it as
torchrun does (``log_dir``, ``redirects``, ``tee``, ``local_ranks_filter``), and turning
what its ``reify(envs)`` answers for an attempt (torch's ``LogsDest``) into each worker's
:class:`~flexrun.proc.drain.Console`: which file each stream goes to, which streams the
console shows (a stream the plugin leaves to the console, or one it tees, after
torchrun's prefix), the worker's ``TORCHELASTIC_ERROR_FILE`` and the attempt's filtered
copies. A stream the plugin leaves to the console is still kept in flexrun's own
``stdout.log``/``stderr.log`` (the run directory's contract).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrun.config import OutputSettings, StdStreams
from flexrun.config.plugins import LOGS_SPECS_GROUP, logs_specs_entry
from flexrun.errors import ConfigError
from flexrun.proc.drain import Console

_BITS = {"stdout": 1, "stderr": 2}  # (torch's Std.OUT, Std.ERR)


def std_value(streams: StdStreams) -> Any:
    """A ``-r``/``-t`` setting as torch's ``Std`` (or its per-local-rank map)."""
    from torch.distributed.elastic.multiprocessing import Std

    def one(s: frozenset[str]) -> Any:
        return Std(sum(_BITS[x] for x in s))

    if streams.by_rank:
        return {lr: one(s) for lr, s in streams.by_rank.items()}
    return one(streams.default)


def load_logs_specs(output: OutputSettings) -> Any | None:
    """The run's LogsSpecs instance (None without ``--logs-specs``), built as torchrun
    builds it.

    Raises:
        ConfigError: the entry point is gone, cannot be imported, is not a LogsSpecs
            subclass, or cannot be built from these options.
    """
    name = output.logs_specs
    if name is None:
        return None
    ep = logs_specs_entry(name)
    try:
        cls = ep.load()
    except Exception as exc:  # (third-party code may fail in any way: report it as input)
        raise ConfigError(
            f"--logs-specs {name}: cannot load {ep.value} ({type(exc).__name__}: {exc})"
        ) from exc
    from torch.distributed.elastic.multiprocessing import LogsSpecs

    if not (isinstance(cls, type) and issubclass(cls, LogsSpecs)):
        raise ConfigError(
            f"--logs-specs {name}: {LOGS_SPECS_GROUP}:{name} = {ep.value} is not a LogsSpecs "
            "subclass (torchrun requires one)"
        )
    try:
        return cls(
            log_dir=None if output.log_dir is None else str(output.log_dir),
            redirects=std_value(output.redirects),
            tee=std_value(output.tee),
            local_ranks_filter=(
                None
                if output.local_ranks_filter is None
                else set(output.local_ranks_filter)
            ),
        )
    except Exception as exc:  # (the plugin's own constructor)
        raise ConfigError(
            f"--logs-specs {name}: {ep.value}(log_dir, redirects, tee, local_ranks_filter) "
            f"failed ({type(exc).__name__}: {exc})"
        ) from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class AttemptFiles:
    """What a LogsSpecs decided for one attempt of this node's workers."""

    consoles: tuple[Console, ...]
    """Per local rank: console, files and error file (see :func:`consoles_from_dest`)."""
    filtered: Mapping[str, Path] = field(default_factory=dict)
    """Where ``filtered_{stream}.log`` goes (torch's ``LogsDest.filtered_*``)."""


def _path(value: object) -> Path | None:
    """A LogsDest path: None for torch's console marker (the empty string)."""
    text = str(value) if value is not None else ""
    return Path(text) if text else None


def consoles_from_dest(dest: Any, nproc: int, prefixes: Sequence[str]) -> AttemptFiles:
    """Each local rank's :class:`Console` from torch's ``LogsDest`` ``dest``: a stream with
    a file goes there and is shown only when tee'd (after ``prefixes[local_rank]``); a
    stream left to the console (``""``) is shown unmodified (and kept in flexrun's log).

    Raises:
        ConfigError: the plugin left a local rank without a stdout or stderr entry.
    """
    consoles = []
    for lr in range(nproc):
        files: dict[str, Path] = {}
        shown: set[str] = set()
        prefixed: dict[str, str] = {}
        for stream, paths, tees in (
            ("stdout", dest.stdouts, dest.tee_stdouts),
            ("stderr", dest.stderrs, dest.tee_stderrs),
        ):
            if lr not in paths:
                raise ConfigError(
                    f"--logs-specs: reify() gave no {stream} for local rank {lr} "
                    f"(it must map every local rank 0..{nproc - 1}, as torchrun requires)"
                )
            path = _path(paths[lr])
            if path is None:
                shown.add(stream)
                continue
            files[stream] = path
            if lr in tees and str(tees[lr]) != os.devnull:
                shown.add(stream)
                prefixed[stream] = prefixes[lr]
        consoles.append(
            Console(
                frozenset(shown),
                prefixed,
                files=files,
                error_file=_path(dest.error_files.get(lr)),
            )
        )
    filtered = {
        s: p
        for s, p in (
            ("stdout", _path(getattr(dest, "filtered_stdout", ""))),
            ("stderr", _path(getattr(dest, "filtered_stderr", ""))),
        )
        if p is not None
    }
    return AttemptFiles(consoles=tuple(consoles), filtered=filtered)


def reify(specs: Any, envs: Sequence[dict[str, str]], prefixes: Sequence[str]) -> AttemptFiles:
    """Ask ``specs`` for this attempt's files (``envs``: each local rank's environment; the
    plugin may set ``TORCHELASTIC_ERROR_FILE`` in them, as torch's does).

    Raises:
        ConfigError: the plugin's ``reify`` failed or answered something unusable.
    """
    try:
        dest = specs.reify(dict(enumerate(envs)))
    except Exception as exc:  # (the plugin's code)
        raise ConfigError(
            f"--logs-specs: {type(specs).__name__}.reify failed ({type(exc).__name__}: {exc})"
        ) from exc
    return consoles_from_dest(dest, len(envs), prefixes)
