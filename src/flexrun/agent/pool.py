"""Warm interpreters: idle worker processes with Python and torch already imported.

Owns starting, handing out and reaping spares (``python -m flexrun.train.spare``). A
restart in restart mode, or a replacement in live mode, takes a ready spare instead of
paying the interpreter and ``import torch`` again (seconds on a busy node, most of a
restart). A spare becomes a worker when it is sent its environment, entry point and log
paths on stdin; it then runs the script exactly as a fresh process would.

With a node directory (``--spares-dir``), spares are first taken from the node's
``flexrun spares`` daemon (already warm before this agent started, see
:mod:`flexrun.agent.nodepool`); only the rest are started here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from flexrun.agent.adopt import AdoptedProcess, exit_record, take_spares
from flexrun.config import RunConfig
from flexrun.proc import Worker, reap, spawn_worker
from flexrun.proc.spawn import file_size

log = logging.getLogger("flexrun.agent")


class WarmPool:
    """Up to ``size`` spares for one node."""

    def __init__(
        self, size: int, environ: Mapping[str, str], root: Path, node: Path | None = None
    ) -> None:
        self.size = size
        self.environ = dict(environ)
        self.root = root
        self.node = node
        """The node's ``flexrun spares`` directory, asked first (None: start every spare here)."""
        self.spares: list[tuple[Worker, Path]] = []
        self._seq = 0
        self.last_ready_ts: float | None = None
        """When the spare last handed out finished its imports (epoch seconds)."""

    def fill(self, count: int | None = None) -> None:
        """Reap dead spares and start new ones up to the pool size (or up to ``count``: a
        node's first workers, started as spares before its agent has met the others)."""
        alive = []
        for w, ready in self.spares:
            if w.proc.poll() is None:
                alive.append((w, ready))
            else:
                reap(w)
        self.spares = alive
        target = self.size if count is None else count
        if self.node is not None and len(self.spares) < target:
            try:
                taken = take_spares(self.node, target - len(self.spares))
            except OSError as exc:
                log.warning("could not take spares from %s: %s", self.node, exc)
                taken = []
            self.spares.extend((a.worker, a.ready) for a in taken)
        while len(self.spares) < target:
            self._seq += 1
            name = f"spare-{os.getpid()}-{self._seq}"
            ready = self.root / f"{name}.ready"
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.unlink(missing_ok=True)
            env = dict(self.environ, FLEXRUN_SPARE_READY=str(ready))
            cmd = [sys.executable, "-u", "-m", "flexrun.train.spare"]
            w = spawn_worker(
                cmd, env, self.root / name, rank=-1, local_rank=-1, stdin=subprocess.PIPE
            )
            self.spares.append((w, ready))

    def take(self, wait_s: float = 0.0) -> Worker | None:
        """A spare that has finished its imports, or None.

        With ``wait_s``, wait that long for a spare that is still importing: it is ready
        sooner than a process started now would be.
        """
        deadline = time.monotonic() + wait_s
        while True:
            booting = False
            for i, (w, ready) in enumerate(self.spares):
                if w.proc.poll() is not None:
                    continue
                if ready.exists():
                    del self.spares[i]
                    with contextlib.suppress(OSError):
                        self.last_ready_ts = ready.stat().st_mtime
                    ready.unlink(missing_ok=True)  # the flag means "an idle spare is ready"
                    return w
                booting = True
            if not booting or time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def trim(self) -> None:
        """Stop spares beyond the pool size (a node's first workers that were not needed)."""
        while len(self.spares) > self.size:
            w, ready = self.spares.pop()
            reap(w)
            ready.unlink(missing_ok=True)

    def close(self) -> None:
        for w, _ in self.spares:
            reap(w)
        self.spares = []


def assign(
    w: Worker,
    *,
    env: Mapping[str, str],
    entry: str,
    args: Sequence[str],
    module: bool,
    rank: int,
    local_rank: int,
    log_dir: Path | None = None,
) -> Worker:
    """Turn spare ``w`` into a worker; with ``log_dir`` its output moves to that
    directory's ``stdout.log``/``stderr.log`` (and its error file there)."""
    env = dict(env)
    task: dict[str, object] = {"entry": entry, "args": list(args), "module": module}
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        w.log_dir = log_dir
        w.error_file = log_dir / "error.json"
        w.error_file.unlink(missing_ok=True)
        for stream in ("stdout", "stderr"):
            path = log_dir / f"{stream}.log"
            w.log_offsets[stream] = file_size(path)
            path.touch()  # the agent's tees open it at once; the spare appends
            task[stream] = str(path)
    env["TORCHELASTIC_ERROR_FILE"] = str(w.error_file)
    task["env"] = env
    task["cwd"] = os.getcwd()
    if isinstance(w.proc, AdoptedProcess):
        # Started by the node's daemon, not by us: it must die with this agent, and keep
        # its exit code where we can read it even if the daemon goes away.
        task["agent_pid"] = os.getpid()
        task["exit_record"] = str(exit_record(w.proc.root, w.proc.name, own=True))
    assert w.proc.stdin is not None
    w.proc.stdin.write((json.dumps(task) + "\n").encode())
    w.proc.stdin.close()
    w.rank, w.local_rank = rank, local_rank
    return w


def restart_pool(config: RunConfig) -> WarmPool | None:
    """The warm pool of a restart-mode agent (None when disabled or not applicable)."""
    if config.mode != "restart" or config.warm_spares <= 0 or config.no_python:
        return None
    log_root = config.log_dir or (config.run_dir / "logs")
    return WarmPool(config.warm_spares, config.environ, log_root / "spares", node=config.spares_dir)


def live_pool(config: RunConfig) -> WarmPool | None:
    """The warm pool of a live-mode agent (None for ``--no-python``). The launcher builds
    it and fills it with the node's first workers before it even connects to the store,
    so their Python and torch import overlaps the agent's own start-up."""
    if config.mode != "live" or config.no_python:
        return None
    env = dict(config.environ)
    if config.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as worker_envs will for the workers
    # As LiveSupervisor sets for its workers, but it must be there before the spare imports
    # torch: c10d reads it once. Live workers' bounded store waits expire routinely, and
    # each warning c10d logs for one can stall seconds on a reverse DNS lookup.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    log_root = (config.log_dir or config.run_dir / "logs") / "live"
    return WarmPool(config.warm_spares, env, log_root / "spares", node=config.spares_dir)
