"""The node's memory directory for the checkpoint memory tier: created, handed over, removed.

Owns one directory per agent and run in host memory (``/dev/shm``: a tmpfs, so copies
written there cost no disk and survive the workers, kill -9 included), readable by its
owner only, named after the run, the node and the agent's pid; passing it to workers
(``FLEXRUN_MEMORY_DIR``, set by :func:`flexrun.agent.spec.worker_envs`), removing it
when the agent exits, and removing what agents that were killed left (their pid is gone).
It does not write or read checkpoint copies (``flexrun.train.memtier`` does).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import psutil

log = logging.getLogger("flexrun.agent")

SHM = Path("/dev/shm")
PREFIX = "flexrun-mem-"
_NAME_RE = re.compile(r"^flexrun-mem-.*-(\d+)$")


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", part)[:64] or "_"


def create_memory_dir(run_id: str, node_id: str, *, root: Path = SHM) -> Path | None:
    """A fresh memory directory of this agent, after removing dead agents' ones; ``None``
    when ``root`` is not usable (then workers get no memory tier, and say so)."""
    if not root.is_dir():
        log.info("no %s: checkpoints have no memory tier on this node", root)
        return None
    sweep(root)
    path = root / f"{PREFIX}{_safe(run_id)}-{_safe(node_id)}-{os.getpid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:  # (the same pid's earlier agent in this process)
        pass
    except OSError as exc:
        log.warning("cannot create the memory directory %s: %s", path, exc)
        return None
    return path


def remove_memory_dir(path: Path | None) -> None:
    """Remove this agent's memory directory and the copies in it."""
    if path is None:
        return
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("could not remove the memory directory %s: %s", path, exc)


def sweep(root: Path = SHM) -> list[Path]:
    """Remove memory directories (of this user) whose agent process is gone."""
    removed = []
    uid = os.getuid()
    for entry in root.iterdir():
        m = _NAME_RE.match(entry.name)
        if m is None or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            if entry.stat().st_uid != uid or psutil.pid_exists(int(m.group(1))):
                continue
        except OSError:
            continue
        remove_memory_dir(entry)
        removed.append(entry)
    return removed
