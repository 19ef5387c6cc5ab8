"""Which of a worker's streams reach the agent's console, and how: torchrun's rules.

Owns one pure decision per local rank, from the run's configuration: a stream that is
neither redirected nor tee'd is the agent's own in torchrun (shown unmodified, and a
terminal stays a terminal); a tee'd one is shown line by line after torchrun's prefix
``[<role><local_rank>]:`` (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` /
``--log-line-prefix-template``); a redirected one, or any stream of a rank that
``--local-ranks-filter`` leaves out, only goes to its log file. The matching lines of a
tee'd stream are also appended to the attempt's ``filtered_std{out,err}.log``
(``--duplicate-std{out,err}-filters``), as torchrun's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from string import Template

from flexrun.agent.logs_specs import AttemptFiles, load_logs_specs, reify
from flexrun.config import RunConfig
from flexrun.proc.drain import Console, FilteredLog, filter_needles


def filtered_logs(
    config: RunConfig, directory: Path, paths: Mapping[str, Path] | None = None
) -> dict[str, FilteredLog]:
    """The attempt's ``directory/filtered_{stream}.log`` (or ``paths[stream]``, a LogsSpecs'
    choice) of each stream that has ``--duplicate-*-filters`` (created now, as torchrun
    does; close them when the attempt ends)."""
    wanted = {
        "stdout": config.output.duplicate_stdout_filters,
        "stderr": config.output.duplicate_stderr_filters,
    }
    out = {}
    for stream, filters in wanted.items():
        if filters:
            path = (paths or {}).get(stream, directory / f"filtered_{stream}.log")
            with contextlib.suppress(OSError):  # (a full disk: said at the first write)
                path.parent.mkdir(parents=True, exist_ok=True)
            out[stream] = FilteredLog(path, filter_needles(filters))
            out[stream].open()
    return out


def with_duplicates(console: Console, filtered: Mapping[str, FilteredLog]) -> Console:
    """``console`` with its tee'd (prefixed) streams' matching lines also sent to ``filtered``."""
    dups = {s: f for s, f in filtered.items() if s in console.prefixes}
    return dataclasses.replace(console, duplicates=dups)


def line_prefix(config: RunConfig, local_rank: int, rank: int) -> str:
    """torchrun's console prefix of a tee'd line: ``[<role><local_rank>]:`` or the template."""
    if config.output.log_line_prefix_template is not None:
        return Template(config.output.log_line_prefix_template).safe_substitute(
            role_name=config.worker.role,
            rank=rank,
            local_rank=local_rank,
            hostname=socket.getfqdn(),
        )
    return f"[{config.worker.role}{local_rank}]:"


def close_filtered(logs: Mapping[str, FilteredLog]) -> None:
    for f in logs.values():
        f.close()


def console_plan(
    config: RunConfig,
    local_rank: int,
    rank: int,
    filtered: Mapping[str, FilteredLog] | None = None,
) -> Console:
    """How local rank ``local_rank`` (global ``rank``) is shown on the console; its tee'd
    streams' matching lines also go to ``filtered`` (stream -> the attempt's file)."""
    shown = config.output.console_for(local_rank)
    teed = config.output.tee.of(local_rank) & shown
    prefix = line_prefix(config, local_rank, rank)
    return with_duplicates(Console(shown, {stream: prefix for stream in teed}), filtered or {})


class AttemptOutputs:
    """Where the workers of one attempt (a round; in live mode, a start) write and what the
    console shows of them: torchrun's rules from the configuration, or what the
    ``--logs-specs`` plugin's ``reify`` decided, plus the attempt's filtered copies."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.specs = load_logs_specs(config.output)
        """``--logs-specs``: the torchrun LogsSpecs instance (None: off)."""
        self.attempt: AttemptFiles | None = None
        self.filtered: dict[str, FilteredLog] = {}
        """The attempt's ``filtered_std{out,err}.log`` (``--duplicate-*-filters``)."""

    def begin(
        self, directory: Path, envs: Callable[[], Sequence[dict[str, str]]], ranks: Iterable[int]
    ) -> None:
        """A new attempt in ``directory`` of the workers of ``ranks`` (per local rank);
        ``envs()`` gives their environments, only called for a plugin (which may set each
        one's ``TORCHELASTIC_ERROR_FILE``, as torch's does).

        Raises:
            ConfigError: the plugin's ``reify`` failed or answered something unusable.
        """
        self.end()
        c = self.config
        if self.specs is not None:
            prefixes = [line_prefix(c, lr, rank) for lr, rank in enumerate(ranks)]
            self.attempt = reify(self.specs, envs(), prefixes)
        paths = self.attempt.filtered if self.attempt is not None else None
        self.filtered = filtered_logs(c, directory, paths)

    def console(self, local_rank: int, rank: int) -> Console:
        """How worker ``local_rank`` of this attempt is shown and logged."""
        if self.attempt is not None:
            return with_duplicates(self.attempt.consoles[local_rank], self.filtered)
        return console_plan(self.config, local_rank, rank, self.filtered)

    def end(self) -> None:
        """Close the attempt's filtered copies (after its workers' drains: fed until then)."""
        filtered, self.filtered, self.attempt = self.filtered, {}, None
        close_filtered(filtered)
