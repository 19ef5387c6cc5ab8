"""The worker environment, read once: the only module in ``flexrun.train`` that reads ``os.environ``.

Owns the mapping from the torchrun contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``TORCHELASTIC_RESTART_COUNT`` ...) and flexrun's additions
(``FLEXRUN_RUN_DIR``, ``FLEXRUN_ROUND``, ``FLEXRUN_RUN_ID``, ``FLEXRUN_NODE``,
``FLEXRUN_MEMORY_DIR``) to one frozen
record. It does not set up process groups (``flexrun.train.context`` does) and it never
writes the environment. Under plain torchrun the ``FLEXRUN_*`` names are absent: the run
directory is then ``None`` and the round falls back to the restart count, which torchrun
increments on every restart just as flexrun increments its round.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from flexrun.errors import ConfigError

MEMORY_DIR_ENV = "FLEXRUN_MEMORY_DIR"
"""The worker variable naming the agent's memory directory (see ``flexrun.agent.memdir``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """What a worker learns from its launcher."""

    rank: int
    """Global rank of this process (``RANK``, 0 when unset)."""
    world_size: int
    """Number of processes (``WORLD_SIZE``, 1 when unset)."""
    local_rank: int
    """Rank on this node (``LOCAL_RANK``); selects the CUDA device."""
    local_world_size: int
    """Processes on this node (``LOCAL_WORLD_SIZE``)."""
    master_addr: str | None
    """Rendezvous address for the default process group, if the launcher set one."""
    master_port: int | None
    """Rendezvous port for the default process group, if the launcher set one."""
    restart_count: int
    """``TORCHELASTIC_RESTART_COUNT``: how many times the launcher restarted the workers."""
    round: int
    """``FLEXRUN_ROUND``, else the restart count: fences checkpoint writes."""
    run_dir: str | None
    """``FLEXRUN_RUN_DIR`` (holds ``events.jsonl``), or ``None`` under plain torchrun."""
    run_id: str
    """``FLEXRUN_RUN_ID``, else ``TORCHELASTIC_RUN_ID``, else ``"local"``."""
    node: str
    """``FLEXRUN_NODE``, else the host name."""
    memory_dir: str | None = None
    """``FLEXRUN_MEMORY_DIR``: host memory the node's agent owns for checkpoint copies
    (the memory tier), or ``None`` (plain torchrun, live mode)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK must be in [0, WORLD_SIZE={self.world_size}), got {self.rank}")
        if self.local_rank < 0 or self.round < 0 or self.restart_count < 0:
            raise ConfigError("LOCAL_RANK, FLEXRUN_ROUND and restart count must be >= 0")

    @property
    def distributed(self) -> bool:
        """True when a default process group can (and should) be formed."""
        return self.master_addr is not None and self.master_port is not None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer, got {raw!r}; fix the launcher") from exc


def read_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """Read the worker environment (``os.environ`` unless ``environ`` is given).

    Raises:
        ConfigError: a variable is present but malformed (e.g. ``RANK=abc``).
    """
    env = os.environ if environ is None else environ

    def _int(name: str, default: int) -> int:
        value = _opt_int(env, name)
        return default if value is None else value

    world_size = _int("WORLD_SIZE", 1)
    restart_count = _int("TORCHELASTIC_RESTART_COUNT", 0)
    rnd = _opt_int(env, "FLEXRUN_ROUND")
    port = _opt_int(env, "MASTER_PORT")
    return WorkerEnv(
        rank=_int("RANK", 0),
        world_size=world_size,
        local_rank=_int("LOCAL_RANK", 0),
        local_world_size=_int("LOCAL_WORLD_SIZE", world_size),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=port,
        restart_count=restart_count,
        round=restart_count if rnd is None else rnd,
        run_dir=env.get("FLEXRUN_RUN_DIR") or None,
        run_id=env.get("FLEXRUN_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or "local",
        node=env.get("FLEXRUN_NODE") or socket.gethostname(),
        memory_dir=env.get(MEMORY_DIR_ENV) or None,
    )
