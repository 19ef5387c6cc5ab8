"""Restart mode's runner (torchrun semantics): every round starts this node's workers afresh.

Owns the worker group of the current round: building each rank's environment, taking
warm spares for it, hang detection without the script's help (each worker's progress
hook, :mod:`flexrun.worker_hook`, read through :mod:`flexrun.agent.progress`), and turning worker exits into the policy's ``Exited`` event
(each failure with its root cause). It does not decide what a failure means
(:mod:`flexrun.agent.policy`), nor talk to the store: the agent's loop hands it each round
with its master address.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping
from pathlib import Path

from flexrun import worker_hook
from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.agent.console import AttemptOutputs
from flexrun.agent.memdir import create_memory_dir, remove_memory_dir
from flexrun.agent.policy import Exited, WorkerExit, blame_hang
from flexrun.agent.progress import ProgressBook
from flexrun.agent.runner import RoundStart
from flexrun.agent.spec import worker_envs
from flexrun.config import RunConfig
from flexrun.events import EventLog
from flexrun.proc import Worker, WorkerGroup, build_command, kill_session
from flexrun.proc.diagnose import in_collective, is_consequence
from flexrun.proc.stacks import capture_stacks
from flexrun.recovery import HangLimits, RecoverySettings, hang_limits
from flexrun.rendezvous.state import MasterRecord, RoundRecord
from flexrun.spares.pool import WarmPool, assign

log = logging.getLogger("flexrun.agent")

RESTART_GRACE_S = 2.0
"""A restart stops workers that may be blocked in a collective with a dead peer: they will
not reach a clean exit, so do not wait long before SIGKILL."""
SPARE_DELAY_S = 3.0
"""Warm spares are started this long after a round's cold workers, so that they do not
compete with the workers' own start-up (interpreter and torch import) for CPU. Workers that
came from spares have no such start-up: the pool is refilled at once after them (otherwise
a round that fails within the delay, as under a stream of faults, waits a whole spare boot
(interpreter and ``import torch``) for its replacement)."""
SPARE_BOOT_WAIT_S = 60.0
"""A spare still importing torch will be ready before a process started now: wait this long
(in all, for the round's ranks together; at once when none is booting) before starting
workers cold. As long as live mode's: on an overloaded node the zygote's imports may take
more than 10 s, and cold workers started beside it only add their own imports to the load;
the bound is for an import that hangs."""


class RestartRunner:
    """This node's workers, restarted every round."""

    def __init__(
        self,
        config: RunConfig,
        *,
        node_id: str,
        events: EventLog,
        pool: WarmPool | None = None,
        clock: Clock = SYSTEM_CLOCK,
        on_close: Callable[[], None] | None = None,
        agent_store: bool | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self._wake = wake  # (ends the agent loop's wait when a worker exits)
        self._on_close = on_close  # (drops the workers' store this agent hosts)
        self.agent_store = config.static is not None if agent_store is None else agent_store
        """The workers are clients of a store an agent hosts (None: a static job's are)."""
        self.node_id = node_id
        self.events = events
        self.pool = pool
        self.clock = clock
        self.group: WorkerGroup | None = None
        self.round: RoundRecord | None = None
        self.runs = 0
        """Rounds started so far (TORCHELASTIC_RESTART_COUNT of the next one)."""
        self._started_at = 0.0
        self._t0: float | None = None  # when the round being started was prepared
        self._cold_workers = 0  # workers of the current round not taken from the warm pool
        self.progress = ProgressBook()
        self.hang_limits = hang_limits(
            RecoverySettings.of(config.rendezvous, hang_timeout_s=config.hang_timeout_s)
        )
        self._warm_until = 0.0
        self.memory_dir = create_memory_dir(config.run_id, node_id)
        """Host memory for the workers' checkpoint copies (removed by :meth:`close`)."""
        self.outputs = AttemptOutputs(config)
        """The round's files and console (and ``--logs-specs``, ``--duplicate-*-filters``)."""
        self._command = build_command(
            config.worker.entrypoint,
            config.worker.args,
            module=config.worker.module,
            no_python=config.worker.no_python,
            python=config.worker.python_exec,
        )

    @property
    def active(self) -> bool:
        return self.group is not None

    # -- rounds ------------------------------------------------------------------------------
    def prepare_round(self, rnd: RoundRecord) -> None:
        if self.group is not None:
            log.info("round %d (%s): restarting workers", rnd.number, rnd.reason)
            self.events.emit("restart", round=rnd.number, reason=rnd.reason)
            self.stop(RESTART_GRACE_S)
        self._t0 = self.clock.monotonic()
        self.events.emit("rendezvous_started", round=rnd.number)

    def run_round(self, rnd: RoundRecord, master: MasterRecord | None) -> RoundStart | None:
        if self._t0 is None or self.group is not None:
            self.prepare_round(rnd)
        t0, self._t0 = self._t0, None
        assert t0 is not None
        if master is None:
            return None  # the round moved on while its master was awaited
        self.events.round = rnd.number
        c = self.config
        envs = worker_envs(
            base=c.worker.environ,
            rnd=rnd,
            node_id=self.node_id,
            nproc=c.worker.nproc_per_node,
            master=master,
            role=c.worker.role,
            run_id=c.run_id,
            run_dir=c.output.run_dir,
            # A static world shares one agent store: every node must use the same
            # /worker/attempt_<restart count> prefix there, so the round's count (a node
            # that rejoined has started fewer rounds itself).
            restart_count=rnd.restarts if c.static is not None else self.runs,
            max_restarts=c.rendezvous.max_restarts,
            settings=c,
            agent_store=self.agent_store,
            memory_dir=self.memory_dir,
        )
        log_dir = (c.output.log_dir or (c.output.run_dir / "logs")) / f"round_{rnd.number}"
        self._cold_workers = 0
        # One wait for booting spares per round, shared by its ranks (not one per rank: a
        # burst of failures on a loaded node found every spare booting and waited 4 x).
        self._warm_until = self.clock.monotonic() + SPARE_BOOT_WAIT_S
        paths = {}
        for env in envs:
            wdir = log_dir / f"rank_{env['RANK']}"
            # A relaunch into a used run directory (a requeued Slurm job keeps its id, so its
            # rdzv id and round numbers) must not read an interrupted run's progress as its
            # own: a stale file's old mtime and steps would be judged a hang at once.
            for stale in (wdir / "progress", wdir / "stacks.txt"):
                stale.unlink(missing_ok=True)
            worker_hook.worker_env(env, str(wdir / "progress"), str(wdir / "stacks.txt"))
            paths[int(env["RANK"])] = wdir / "progress"
        self.progress.reset(paths)
        self.outputs.begin(log_dir, lambda: envs, [int(env["RANK"]) for env in envs])
        # Said before the workers start: a line of the agent's must not land in the middle
        # of what a worker is drawing on the terminal (a progress bar), as torchrun's don't.
        base = rnd.rank_base(self.node_id)
        log.info(
            "round %d: %d node(s), world size %d, ranks %d-%d here",
            rnd.number,
            len(rnd.members),
            rnd.world_size(),
            base,
            base + c.worker.nproc_per_node - 1,
        )
        try:
            self.group = WorkerGroup.start(
                self._command,
                envs,
                log_dir,
                console_streams=c.output.console_streams,
                warm=self._warm if self.pool is not None else None,
                console=self.outputs.console,
                on_exit=self._wake,
            )
        except OSError:
            self.outputs.end()
            raise
        self.round = rnd
        self.runs += 1
        self._started_at = self.clock.monotonic()
        self.events.emit(
            "rendezvous_completed",
            round=rnd.number,
            members=rnd.member_ids,
            world_size=rnd.world_size(),
            group_rank=rnd.group_rank(self.node_id),
            duration_s=round(self.clock.monotonic() - t0, 4),
            reason=rnd.reason,
        )
        for w in self.group.workers:
            self.events.emit("worker_started", rank=w.rank, local_rank=w.local_rank, pid=w.proc.pid)
        return RoundStart.FRESH

    def _warm(
        self, env: Mapping[str, str], wdir: Path, rank: int, local_rank: int
    ) -> Worker | None:
        """A warm spare for ``rank``, or None (then the worker is started fresh)."""
        assert self.pool is not None
        w = self.pool.take(wait_s=max(0.0, self._warm_until - self.clock.monotonic()))
        if w is None:
            self._cold_workers += 1
            return None
        c = self.config
        return assign(
            w,
            env=env,
            entry=c.worker.entrypoint,
            args=c.worker.args,
            module=c.worker.module,
            rank=rank,
            local_rank=local_rank,
            log_dir=wdir,
            console=self.outputs.console(local_rank, rank),
        )

    # -- monitoring --------------------------------------------------------------------------
    def poll(self) -> Exited | None:
        if self.group is None:
            return None
        self.progress.update(self.clock.monotonic())
        if self.hang_limits is not None:
            self._detect_hangs(self.group, self.hang_limits)
        results = self.group.poll()
        if not results:
            return None
        exits = []
        for r in results:
            cause = self.group.cause(r).replace(node=self.node_id) if r.returncode else None
            exits.append(
                WorkerExit(
                    r.rank,
                    r.exit_code,
                    r.ended_at,
                    local_rank=r.local_rank,
                    pid=r.pid,
                    signal=r.signal_name,
                    cause=cause,
                    consequence=cause is not None and is_consequence(cause),
                )
            )
        peers = len(self.round.members) if self.round is not None else 1
        return Exited(tuple(exits), self.group.all_done(), peers)

    def made_progress(self) -> bool | None:
        """A step was completed by a worker of the current (or last) round; None: no
        worker's progress hook is installed, nothing can tell."""
        return self.progress.made_progress()

    def kept_until(self) -> float | None:
        return self.progress.kept_until()

    def lost_s(self) -> float:
        return 0.0  # (a failure stops the round: kept_until bounds what survives)

    def first_step_mono(self) -> float | None:
        """When a step of the current round was first seen (monotonic), if one was."""
        return self.progress.first_step_mono()

    def _detect_hangs(self, group: WorkerGroup, limits: HangLimits) -> None:
        """A rank silent past its calibrated limit (see :mod:`flexrun.agent.progress`) is
        hung: capture the stacks of every local worker whose hook is installed (only those
        answer SIGUSR2; it kills the others), record them, and fail the rank to blame."""
        now = self.clock.wall()
        alive = [w for w in group.workers if w.result is None and w.proc.poll() is None]
        quiet = self.progress.quiet(now, {w.rank for w in alive})
        silent = self.progress.silent(now, limits, {w.rank for w in alive})
        if not silent:
            return
        hooked = [w for w in alive if self.progress.ranks[w.rank].hooked]
        stacks = {w.rank: capture_stacks(w.proc.pid, w.log_dir / "stacks.txt") for w in hooked}
        blamed = blame_hang(silent, {r: in_collective(s) for r, s in stacks.items()}, quiet)
        silent_s = silent.get(blamed, quiet.get(blamed, 0.0))
        w = next(x for x in alive if x.rank == blamed)
        rp = self.progress.ranks[blamed]
        hang_dir = self.config.output.run_dir / "hangs"
        path = hang_dir / f"round_{self.round.number if self.round else 0}_rank_{blamed}.txt"
        try:
            hang_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(
                "".join(f"=== rank {r} ===\n{text}\n" for r, text in sorted(stacks.items()))
            )
        except OSError as exc:  # (a full disk must not keep a hung job from recovering)
            log.warning("could not write the stacks of the hang to %s: %s", path, exc)
        log.error(
            "rank %d made no progress for %.1fs (limit %.1fs, %s): stacks in %s; "
            "treating it as failed",
            blamed,
            silent_s,
            rp.limit_s(limits),
            "before its first step" if rp.steps == 0 else f"after step {rp.steps}",
            path,
        )
        self.events.emit(
            "hang_detected",
            rank=blamed,
            pid=w.proc.pid,
            silent_s=round(silent_s, 2),
            silent_ranks=sorted(silent),
            limit_s=round(rp.limit_s(limits), 2),
            steps=rp.steps,
            step_time_s=round(rp.step_time_s, 4) if rp.step_time_s is not None else None,
            longest_gap_s=round(rp.longest_gap_s, 3),
            floor_s=limits.floor_s,
            cap_s=limits.cap_s,
            factor=limits.factor,
            first_step_s=limits.first_step_s,
            stacks_file=str(path),
            stacks=stacks.get(blamed, "")[-20000:],
        )
        w.note = f"hang: no progress for {silent_s:.1f}s (stacks: {path})"
        kill_session(w.proc.pid)
        w.proc.wait()

    def tend(self) -> None:
        if self.pool is None or not self.runs:
            return
        if (
            self.group is None
            or self._cold_workers == 0
            or self.clock.monotonic() - self._started_at >= SPARE_DELAY_S
        ):
            self.pool.fill()

    # -- stopping ----------------------------------------------------------------------------
    def stop(
        self,
        grace_s: float,
        *,
        on_first_exit: Callable[[], None] | None = None,
        sig: int = signal.SIGTERM,
    ) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.stop(grace_s, sig, on_first_exit=on_first_exit)
        elif on_first_exit is not None:
            on_first_exit()
        self.outputs.end()  # (after the group's drains: they feed its filtered copies)

    def close(self) -> None:
        self.stop(0)
        remove_memory_dir(self.memory_dir)
        if self._on_close is not None:
            self._on_close()
        if self.pool is not None:
            self.pool.close()
