"""The agent's warm pools, built from the run's configuration.

Owns only the choice (from :class:`~flexrun.config.RunConfig`) of whether a mode gets a
pool, how big, with which environment and where its spares log; the pool itself is
:class:`flexrun.spares.pool.WarmPool`.

A spare is an interpreter already running: this one (``sys.executable``). A job whose
workers run another (``PYTHON_EXEC``, :attr:`WorkerSpec.python_exec`, compared as a path,
not by what it resolves to: a venv's ``python`` links to the base interpreter yet is not
the same environment) gets no pool, and its workers start cold under that interpreter.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping

from flexrun.agent.spec import without_secrets
from flexrun.config import RunConfig
from flexrun.spares.pool import WarmPool
from flexrun.spares.protocol import PRELOAD_ENV


def spares_fit(config: RunConfig) -> bool:
    """Whether a spare (this interpreter) can be one of the job's workers."""
    return os.path.abspath(config.worker.python_exec) == os.path.abspath(sys.executable)


def _spare_env(config: RunConfig, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the modules the spares pre-import (``--spare-preload``), if any."""
    out = dict(env)
    if config.spares.spare_preload:
        out[PRELOAD_ENV] = ",".join(config.spares.spare_preload)
    return out


def restart_pool(config: RunConfig) -> WarmPool | None:
    """The warm pool of a restart-mode agent (None when disabled or not applicable)."""
    if (
        config.mode != "restart"
        or config.spares.warm_spares <= 0
        or config.worker.no_python
        or not spares_fit(config)
    ):
        return None
    log_root = config.output.log_dir or (config.output.run_dir / "logs")
    return WarmPool(
        config.spares.warm_spares,
        _spare_env(config, without_secrets(config.worker.environ)),
        log_root / "spares",
        node=config.spares.spares_dir,
        # (A restart needs a spare per local worker: beyond that, refill in batches.)
        max_booting=config.worker.nproc_per_node,
        # A restart takes every local worker's spare at once: refill by fork, in
        # milliseconds, so that a second failure right after the first finds them ready.
        fork_server=True,
    )


def _stdin_carries_nothing() -> bool:
    """This process's stdin is /dev/null or closed: a worker could read nothing from it."""
    try:
        st = os.fstat(0)
    except OSError:
        return True
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev


def first_workers_warm(config: RunConfig) -> bool:
    """Whether restart mode's first workers come from the warm pool (started with the agent).

    A node of a multi-node job, or one with a node's ``flexrun spares``, always: its spares
    import torch while the agent meets the others. A single node when its stdin carries
    nothing, as under a batch system or a pod: one zygote's ``import torch`` then serves
    every worker. Where the agent's stdin is a terminal, a pipe or a file, its first workers
    start cold and inherit it, as torchrun's do (``breakpoint()`` works; a spare's stdin is
    its assignment channel and it gets ``/dev/null``). Cold too when the script imports only
    the standard library as it starts (``SpareSettings.first_from_pool``): the zygote's
    imports would serve none of them, and the pool fills after they started.
    """
    if config.spares.spares_dir is not None:
        return True
    if not config.spares.first_from_pool:
        return False
    if config.store.endpoints:
        return True
    return _stdin_carries_nothing()


def live_pool(config: RunConfig) -> WarmPool | None:
    """The warm pool of a live-mode agent (None for ``--no-python``). The launcher builds
    it and fills it with the node's first workers before it even connects to the store,
    so their Python and torch import overlaps the agent's own start-up."""
    if config.mode != "live" or config.worker.no_python or not spares_fit(config):
        return None
    env = without_secrets(config.worker.environ)
    if config.worker.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as worker_envs will for the workers
    # As LiveSupervisor sets for its workers, but it must be there before the spare imports
    # torch: c10d reads it once. Live workers' bounded store waits expire routinely, and
    # each warning c10d logs for one can stall seconds on a reverse DNS lookup.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    log_root = (config.output.log_dir or config.output.run_dir / "logs") / "live"
    # Refill by fork from one warm zygote, as restart mode: a replacement's fresh `import
    # torch` (seconds of CPU) competed with the survivors' training after every failure.
    return WarmPool(
        config.spares.warm_spares,
        _spare_env(config, env),
        log_root / "spares",
        node=config.spares.spares_dir,
        fork_server=True,
    )
