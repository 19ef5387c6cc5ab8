"""An agent's warm interpreters: idle worker processes with Python and torch imported.

Owns starting, handing out and reaping one agent's spares (``python -m
flexrun.spares.spare``) and turning one into a worker (:func:`assign`). A restart in
restart mode, or a replacement in live mode, takes a ready spare instead of paying the
interpreter and ``import torch`` again (seconds on a busy node, most of a restart). A spare
becomes a worker when it is sent its environment, entry point and log paths on stdin; it
then runs the script exactly as a fresh process would.

With a node directory (``--spares-dir``), spares are first taken from the node's
``flexrun spares`` daemon (:mod:`flexrun.spares.client`); only the rest are started here.
A node directory that is not this user's alone is refused once, with a warning, and the
pool starts its own from then on. It does not read the run's configuration (the agent's
:mod:`flexrun.agent.warm` builds it) nor decide when to take.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import SparesError, SparesUntrusted
from flexrun.proc import Worker, reap, spawn_worker
from flexrun.proc.drain import Console, output_paths
from flexrun.proc.spawn import file_size, worker_error_file
from flexrun.spares.adopted import AdoptedProcess
from flexrun.spares.client import Adopted, take_spares
from flexrun.spares.forkserver import BOOTING, GONE, READY, ForkServer, plan_refill
from flexrun.spares.protocol import READY_ENV, SPARE_MODULE, Assignment, command

log = logging.getLogger("flexrun.spares")


class WarmPool:
    """Up to ``size`` spares for one node."""

    def __init__(
        self,
        size: int,
        environ: Mapping[str, str],
        root: Path,
        node: Path | None = None,
        *,
        spare_command: Sequence[str] | None = None,
        max_booting: int | None = None,
        fork_server: bool = False,
        zygote_command: Sequence[str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.size = size
        self.max_booting = max_booting
        """A refill starts at most this many spares importing at once (None: no limit): a
        pool larger than one restart's need gets one restart's worth ready first, instead
        of every spare sharing the CPU and all of them ready late."""
        self.environ = dict(environ)
        self.root = root
        self.node = node
        """The node's ``flexrun spares`` directory, asked first (None: start every spare here)."""
        self.spares: list[tuple[Worker, Path]] = []
        self.command = list(spare_command or command(SPARE_MODULE))
        self._clock = clock
        self._seq = 0
        self.fork_server = fork_server
        """Fork spares from one warm zygote (:mod:`flexrun.spares.forks`) instead of starting
        each fresh: a refill then takes milliseconds and no CPU from the workers."""
        self._zygote_command = zygote_command
        self._zygote: ForkServer | None = None
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
            self.spares.extend((a.worker, a.ready) for a in self._take(target - len(self.spares)))
        if len(self.spares) >= target:
            return  # (before the fork server is started: the node's daemon may serve all)
        booting = sum(1 for _, ready in self.spares if not ready.exists())
        plan = plan_refill(
            target - len(self.spares),
            booting=booting,
            max_booting=self.max_booting if count is None else None,
            zygote=self._zygote_state(),
        )
        for _ in range(plan.forks):
            if not self._fork():
                return self.fill(count)  # (the zygote is gone: start them fresh)
        for _ in range(plan.fresh):
            name, ready = self._next_name()
            env = dict(self.environ)
            env[READY_ENV] = str(ready)
            w = spawn_worker(
                self.command, env, self.root / name, rank=-1, local_rank=-1, stdin=subprocess.PIPE
            )
            self.spares.append((w, ready))

    def _next_name(self) -> tuple[str, Path]:
        self._seq += 1
        name = f"spare-{os.getpid()}-{self._seq}"
        ready = self.root / f"{name}.ready"
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        return name, ready

    def _zygote_state(self) -> str | None:
        """The fork server's state (None: this pool forks nothing), started on first use."""
        if not self.fork_server:
            return None
        if self._zygote is None:
            try:
                self._zygote = ForkServer(
                    self.environ, self.root, zygote_command=self._zygote_command
                )
            except OSError as exc:
                log.warning("could not start the spares' fork server (%s): spares start fresh", exc)
                self.fork_server = False
                return None
        state = self._zygote.state
        if state == GONE:
            self._drop_zygote(self._zygote.why_gone())
            return None
        return state

    def _fork(self) -> bool:
        assert self._zygote is not None
        name, ready = self._next_name()
        try:
            w = self._zygote.fork(name)
        except (OSError, SparesError) as exc:
            self._drop_zygote(str(exc))
            return False
        self.spares.append((w, ready))
        return True

    def _drop_zygote(self, why: str) -> None:
        log.warning("the spares' fork server failed (%s): spares start fresh from now on", why)
        if self._zygote is not None:
            self._zygote.close()
        self._zygote = None
        self.fork_server = False

    def _take(self, count: int) -> list[Adopted]:
        assert self.node is not None
        try:
            return take_spares(self.node, count)
        except SparesUntrusted as exc:
            log.warning("%s: starting spares here from now on", exc)
            self.node = None
        except (OSError, SparesError) as exc:
            log.warning("could not take spares from %s: %s", self.node, exc)
        return []

    def take(self, wait_s: float = 0.0) -> Worker | None:
        """A spare that has finished its imports, or None.

        With ``wait_s``, wait that long for a spare that is still importing: it is ready
        sooner than a process started now would be.
        """
        deadline = self._clock.monotonic() + wait_s
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
            pause = 0.05
            if self._zygote is not None:
                state = self._zygote.state
                if state == READY and len(self.spares) < self.size:
                    self.fill()  # none ready to hand out: fork them now (milliseconds)
                    booting, pause = bool(self.spares), 0.01
                booting = booting or state == BOOTING
            if not booting or self._clock.monotonic() >= deadline:
                return None
            self._clock.sleep(pause)

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
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


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
    console: Console | None = None,
) -> Worker:
    """Turn spare ``w`` into a worker; with ``log_dir`` its output moves to that
    directory's ``stdout.log``/``stderr.log`` (and its error file there). With ``console``
    too, the agent drains its output as a fresh worker's (``spawn_worker(console=)``): the
    spare opens a FIFO or a pseudo-terminal (``proc.drain.output_paths``), never the files.

    Raises:
        OSError: the spare is gone (its assignment channel is closed).
    """
    env = dict(env)
    logs: dict[str, str] = {}
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        w.log_dir = log_dir
        w.error_file = worker_error_file(log_dir, console)
        for stream in ("stdout", "stderr"):
            path = console.log_path(stream, log_dir) if console else log_dir / f"{stream}.log"
            w.log_offsets[stream] = file_size(path)
            if console is None:
                path.touch()  # the agent's tees open it at once; the spare appends
                logs[stream] = str(path)
        if console is not None:
            logs, w.output = output_paths(log_dir, console)
    env["TORCHELASTIC_ERROR_FILE"] = str(w.error_file)
    task = Assignment(
        entry=entry,
        args=tuple(args),
        module=module,
        env=env,
        cwd=os.getcwd(),
        stdout=logs.get("stdout"),
        stderr=logs.get("stderr"),
        # Started by the node's daemon, not by us: it must die with this agent.
        agent_pid=os.getpid() if isinstance(w.proc, AdoptedProcess) else None,
        private_output=w.output is not None,
    )
    assert w.proc.stdin is not None
    try:
        w.proc.stdin.write(task.encode())
        w.proc.stdin.close()
    except OSError:
        if w.output is not None:
            w.output.close(0)
            w.output = None
        raise
    w.rank, w.local_rank = rank, local_rank
    return w
