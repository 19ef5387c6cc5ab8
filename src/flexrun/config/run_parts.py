"""The parts of a validated ``flexrun run``, one per consumer.

Owns the frozen, validated settings each part of the agent receives, so that a module is
handed only what it uses: :class:`WorkerSpec` (what a worker process is and how it is
supervised: the launch, the start and stop), :class:`OutputSettings` (where streams, logs and
error files go), :class:`ObserveSettings` (metrics and resource sampling) and
:class:`SpareSettings` (warm spare processes). :class:`~flexrun.config.RunConfig` holds them
with the store, rendezvous and recovery parts. It does not build them (that is
:mod:`flexrun.config.build`) and does not act on them.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flexrun.config.parsing import STREAMS, signal_numbers
from flexrun.errors import ConfigError

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
START_METHODS = ("spawn", "fork", "forkserver")


@dataclass(frozen=True, kw_only=True, slots=True)
class StdStreams:
    """torchrun's per-local-rank stream setting (``-r``/``-t``: ``3`` or ``0:3,1:1``)."""

    default: frozenset[str] = frozenset()
    """The streams of every local rank not in ``by_rank`` (none when a map was given)."""
    by_rank: Mapping[int, frozenset[str]] = field(default_factory=dict)

    def of(self, local_rank: int) -> frozenset[str]:
        return self.by_rank.get(local_rank, self.default)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec:
    """What each worker process is, and how the agent starts, watches and stops it."""

    entrypoint: str
    """Script path, module name (with ``module``) or executable (with ``no_python``)."""
    args: tuple[str, ...] = ()
    """Arguments after the entrypoint."""
    module: bool = False
    no_python: bool = False
    nproc_per_node: int = 1
    role: str = "default"
    environ: Mapping[str, str] = field(default_factory=dict)
    """The environment workers inherit (captured by ``from_args``)."""
    python_exec: str = sys.executable
    """The interpreter of the workers (``PYTHON_EXEC``, else this one), as torchrun."""
    start_method: str = "spawn"
    """``--start-method``: torchrun's multiprocessing start method. flexrun starts every
    worker as a fresh process (``exec``), which is what torchrun does for any script,
    module or executable (the method matters to torchrun only for ``--run-path``)."""
    run_path: bool = False
    """``--run-path``: torchrun runs the script with ``runpy.run_path`` in a spawned
    interpreter; flexrun runs ``python -u SCRIPT`` (the same ``__main__``, ``__file__`` and
    ``sys.argv``); ``module`` and ``no_python`` are then off, as torchrun."""
    virtual_local_rank: bool = False
    """``--virtual-local-rank``: every worker sees ``LOCAL_RANK=0`` and
    ``CUDA_VISIBLE_DEVICES`` = its own device (``worker_envs`` does it)."""
    slurm_task: tuple[int, int] | None = None
    """A Slurm step of several tasks on this node (one per GPU) whose agent runs one worker:
    (``SLURM_LOCALID``, tasks on this node), the worker's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (``worker_envs`` does it; :mod:`flexrun.config.slurm`)."""
    numa_binding: str | None = None
    """``--numa-binding`` mode (node, socket, exclusive, core-complex) or None."""
    numa_cpus: tuple[frozenset[int], ...] = ()
    """With ``numa_binding``: the CPU set of each local rank (torch's own choice, the CPUs
    near ``cuda:<local_rank>``); the agent binds worker i to ``numa_cpus[i]``."""
    monitor_interval_s: float = 0.1
    stop_grace_s: float = 30.0
    """Seconds between SIGTERM and SIGKILL when stopping workers (``--stop-grace``, or
    torchrun's ``--shutdown-timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``)."""
    signals_to_handle: tuple[str, ...] = DEFAULT_SIGNALS
    """``--signals-to-handle``: signal names the agent catches and forwards to its workers
    (as given: workers see them joined in ``TORCHELASTIC_SIGNALS_TO_HANDLE``; the catchable
    ones are :attr:`signal_numbers`)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if not self.monitor_interval_s > 0:
            raise ConfigError("--monitor-interval must be positive")
        if self.stop_grace_s < 0:
            raise ConfigError("--stop-grace must not be negative")
        if self.start_method not in START_METHODS:
            raise ConfigError(
                f"--start-method {self.start_method!r}: choose one of {', '.join(START_METHODS)}"
            )
        if self.module and self.no_python:
            raise ConfigError(
                "--no-python and --module cannot be used together (as in torchrun): "
                "give one of them"
            )
        if self.numa_binding is not None and len(self.numa_cpus) != self.nproc_per_node:
            raise ConfigError("--numa-binding: one CPU set per local worker is needed")
        if not self.module and not self.no_python and not Path(self.entrypoint).is_file():
            raise ConfigError(
                f"training script {self.entrypoint!r} does not exist (or is not a file)"
            )
        if (
            self.no_python
            and shutil.which(self.entrypoint) is None
            and not Path(self.entrypoint).is_file()
        ):
            raise ConfigError(f"--no-python: executable {self.entrypoint!r} not found")

    @property
    def signal_numbers(self) -> tuple[int, ...]:
        """The catchable signals of :attr:`signals_to_handle`, as numbers."""
        return signal_numbers(self.signals_to_handle)


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputSettings:
    """Where a run's files and its workers' streams go."""

    run_dir: Path = Path("flexrun-runs/default")
    log_dir: Path | None = None
    console_streams: frozenset[str] = frozenset({"stdout", "stderr"})
    """Which worker streams also go to the agent's console (all go to log files): the value
    for every local rank without its own setting (see :meth:`console_for`)."""
    redirects: StdStreams = field(default_factory=StdStreams)
    """``-r/--redirects``: streams kept off the console, per local rank."""
    tee: StdStreams = field(default_factory=StdStreams)
    """``-t/--tee``: streams shown on the console and written to a file, per local rank
    (torchrun prefixes tee'd console lines with ``[<role><local_rank>]:``)."""
    local_ranks_filter: frozenset[int] | None = None
    """``--local-ranks-filter``: only these local ranks reach the console (None: all)."""
    duplicate_stdout_filters: tuple[str, ...] = ()
    """``--duplicate-stdout-filters``: stdout lines containing any of these are also
    appended to a filtered copy (torchrun: ``<log_dir>/filtered_stdout.log``)."""
    duplicate_stderr_filters: tuple[str, ...] = ()
    """The same for stderr (``filtered_stderr.log``)."""
    log_line_prefix_template: str | None = None
    """``--log-line-prefix-template`` (torch 2.15), else ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``
    (``${role_name}``, ``${rank}``, ``${local_rank}``, ``${hostname}``: the node's FQDN): the
    prefix of tee'd console lines instead of ``[<role><local_rank>]:``."""
    logs_specs: str | None = None
    """``--logs-specs NAME``: a ``torchrun.logs_specs`` entry point (checked to load and to be
    a LogsSpecs); the agent builds it (``flexrun.config.plugins.logs_specs_class``) with log_dir,
    redirects, tee and local_ranks_filter and takes each worker's file paths from its
    ``reify(envs)``."""
    event_log_handler: str = "null"
    """``--event-log-handler`` (torch's names: null, console, dynamic_rendezvous): with
    ``console`` the agent also writes each event it logs to stderr."""
    launcher_error_file: Path | None = None
    """``TORCHELASTIC_ERROR_FILE`` of the launcher itself (a scheduler such as TorchX set
    it): the agent writes the root cause there in torch's error-file format."""

    def console_for(self, local_rank: int) -> frozenset[str]:
        """The streams of ``local_rank`` that reach the agent's console (torchrun's rules:
        not redirected or tee'd, and the rank passes ``--local-ranks-filter``)."""
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return frozenset()
        return (STREAMS - self.redirects.of(local_rank)) | self.tee.of(local_rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class ObserveSettings:
    """What the agent serves and samples for observers."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (off when None)."""
    metrics_host: str = "127.0.0.1"
    """The address the metrics server binds (``--metrics-host``; 0.0.0.0 to be scraped)."""
    resource_interval_s: float = 10.0
    """How often node resources (CPU, memory, disk, network, GPU) go to the event log; 0: never."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpareSettings:
    """Warm spare worker processes (torch imported, waiting to replace a dead worker)."""

    warm_spares: int = 0
    """Idle worker processes kept ready to replace a dead one."""
    spares_dir: Path | None = None
    """The node's ``flexrun spares`` directory: spares are taken from it first (None: off)."""
    spare_preload: tuple[str, ...] = ()
    """Modules this run's spares import before they are ready (``--spare-preload``), so a
    replacement worker finds the script's libraries imported; none by default."""
    first_from_pool: bool = True
    """Whether the first workers may be forked from the pool's zygote: False when the script
    imports only the standard library as it starts (:mod:`flexrun.config.script_imports`),
    so a zygote's ``import torch`` would serve none of them."""

    def __post_init__(self) -> None:
        if self.warm_spares < 0:
            raise ConfigError(f"--warm-spares {self.warm_spares}: must be 0 or more")
