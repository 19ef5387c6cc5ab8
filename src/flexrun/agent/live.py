"""Live mode's runner: worker slots that survive rounds, warm spares, liveness.

Owns this node's live workers: it starts them once, replaces a dead or frozen one (from a
warm spare when it has one) while the survivors keep running, and keeps the job's
membership epoch current (:mod:`flexrun.agent.live_epochs`) for the workers'
``flexrun.train.live.LiveLoop`` to follow. It never restarts survivors. Node membership
still comes from the rendezvous rounds; an epoch is the list of live workers of the
round's nodes, in node order then local rank. Whether a failure counts against
``--max-restarts`` is the policy's (:mod:`flexrun.agent.policy`); the protocol with the
workers is :mod:`flexrun.live_protocol`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.agent.console import AttemptOutputs
from flexrun.agent.live_epochs import EpochPublisher
from flexrun.agent.live_groups import MATE_EXIT_WAIT_S, ReplicaGroups
from flexrun.agent.policy import LiveFailed, LiveFinished
from flexrun.agent.runner import LoopProgress, RoundStart
from flexrun.agent.spec import worker_envs
from flexrun.cause import FailureCause
from flexrun.config import SECRET_ENV, SECRET_ENV_FILE, RunConfig
from flexrun.events import EventLog
from flexrun.live_protocol import EpochRecord, heartbeat_age, holds_state, worker_env
from flexrun.proc import (
    ExitClock,
    Tee,
    Worker,
    WorkerResult,
    build_command,
    kill_session,
    read_cause,
    reap,
    spawn_worker,
    start_tees,
    stopped,
)
from flexrun.proc.drain import Console
from flexrun.rendezvous.state import MasterRecord, RoundRecord
from flexrun.spares.pool import WarmPool, assign
from flexrun.store.api import Store
from flexrun.store.signed import place_secret_file, remove_secret_file

log = logging.getLogger("flexrun.agent")

SPARE_BOOT_WAIT_S = 60.0
"""A node's first workers were started as spares when its agent started: one still
importing torch is ready sooner than a process started now (waits end early if none is
booting)."""


@dataclass
class LiveWorker:
    """One live worker process (or a spare waiting to become one)."""

    worker_id: str
    worker: Worker
    heartbeat: Path
    included: bool = False
    """Part of this node's published member list."""
    finished: bool = False
    tees: list[Tee] = field(default_factory=list)
    stopped_since: float | None = None
    """When the agent first saw it stopped by a signal (monotonic; None: running)."""
    stopped_mark: int | None = None
    """Its scheduling count then: a stop that lasts leaves it unchanged."""


STOPPED_GRACE_S = 0.3
"""A live worker stopped by a signal (SIGSTOP) this long without running in between is
frozen: it cannot heart-beat, and the others' collectives wait on it. (Brief stops, or a
stop and continue duty cycle that slows a worker, are let be.)"""


def _frozen(lw: LiveWorker, age_s: float | None, mono: float, timeout_s: float) -> str | None:
    """Why ``lw`` (heartbeat ``age_s`` old; None: none yet) is frozen, or None. A worker
    stopped before it reaches the loop counts too: the others may be waiting for it."""
    if age_s is not None and age_s > timeout_s:
        return f"sent no heartbeat for {age_s:.1f}s"
    mark = stopped(lw.worker.proc.pid)
    if mark is None or mark != lw.stopped_mark:  # (running, or it ran since: a new stop)
        lw.stopped_since, lw.stopped_mark = (None if mark is None else mono), mark
        return None
    if lw.stopped_since is not None and mono - lw.stopped_since >= STOPPED_GRACE_S:
        return f"stopped by a signal for {mono - lw.stopped_since:.1f}s"
    return None


def _in_loop(slots: dict[int, LiveWorker], now_wall: float) -> bool:
    """Every worker in ``slots`` has reached the training loop (or finished)."""
    return all(
        lw.finished or heartbeat_age(lw.heartbeat, now_wall) is not None for lw in slots.values()
    )


def _cold(command: list[str], env: dict[str, str], wdir: Path, slot: int, con: Console) -> Worker:
    """A fresh worker for ``slot``, its output drained by the agent (a terminal stays one)."""
    return spawn_worker(
        command,
        env,
        wdir,
        rank=slot,
        local_rank=slot,
        stdin=None,  # (inherited, as torchrun's)
        console=con,
    )


def _warm(
    spare: Worker, c: RunConfig, env: dict[str, str], wdir: Path, slot: int, con: Console
) -> Worker:
    """Warm ``spare`` assigned to ``slot``; its output drained as a fresh worker's."""
    return assign(
        spare,
        env=env,
        entry=c.worker.entrypoint,
        args=c.worker.args,
        module=c.worker.module,
        rank=slot,
        local_rank=slot,
        log_dir=wdir,
        console=con,
    )


def _tees(w: Worker, wid: str, console: frozenset[str], done: threading.Event) -> list[Tee]:
    """Console copies of a warm spare's log files (it writes them itself); none for a
    worker whose output the agent drains."""
    if w.output is not None:
        return []
    return start_tees(w.log_dir, f"[{wid}]:", console, done, w.log_offsets)


class LiveRunner(LoopProgress):
    """This node's live workers for the whole job."""

    def __init__(
        self,
        config: RunConfig,
        *,
        node_id: str,
        store: Store,
        store_addr: tuple[str, int],
        events: EventLog,
        pool: WarmPool | None = None,
        clock: Clock = SYSTEM_CLOCK,
        wake: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.node = node_id
        self._exits = ExitClock([], wake)  # (wakes the agent's loop when a worker exits)
        self.store_addr = store_addr
        self.events = events
        self.clock = clock
        self.epochs = EpochPublisher(store, run_id=config.run_id, node_id=node_id, events=events)
        self.slots: dict[int, LiveWorker] = {}
        self.groups = ReplicaGroups(node_id, config.worker.nproc_per_node, config.live_shards)
        self.round: RoundRecord | None = None
        self.pool = pool
        """This node's first workers boot (Python, torch) as spares while the agent meets
        the others (the launcher fills it before connecting to the store)."""
        self._seq = 0
        self._failures: list[FailureCause] = []
        self._dead: list[int] = []
        """Failures seen and slots emptied, not yet reported and refilled (the store was
        unreachable when they were found)."""
        self._tee_done = threading.Event()
        self._command = build_command(
            config.worker.entrypoint,
            config.worker.args,
            module=config.worker.module,
            no_python=config.worker.no_python,
            python=config.worker.python_exec,
        )
        self._log_root = (config.output.log_dir or config.output.run_dir / "logs") / "live"
        self.outputs = AttemptOutputs(config)  # (once per start: a new worker keeps its slot's)
        self._hb_root = config.output.run_dir / "live-heartbeats" / node_id
        self._secret_file = (
            place_secret_file(config.output.run_dir / f".job-secret-{node_id}", config.store.secret)
            if config.store.secret is not None
            else None
        )

    @property
    def active(self) -> bool:
        return bool(self.slots)

    # -- rounds ------------------------------------------------------------------------------
    def prepare_round(self, rnd: RoundRecord) -> None:
        """Nothing to end: live workers carry on into the new round."""

    def run_round(self, rnd: RoundRecord, master: MasterRecord | None) -> RoundStart:
        """Start this node's workers (once per job, or after a stop); later rounds change
        only the membership epoch, never the survivors (``master``: None, unused)."""
        self.events.round = rnd.number
        self.round = rnd
        if self.slots:
            log.info(
                "round %d (%s): live workers carry on; publishing the new membership",
                rnd.number,
                rnd.reason,
            )
            self.epochs.publish(rnd, self._included())
            start = RoundStart.CONTINUED
        else:
            self._start(rnd)
            start = RoundStart.FRESH
        self.events.emit(
            "rendezvous_completed",
            round=rnd.number,
            members=rnd.member_ids,
            world_size=rnd.world_size(),
            group_rank=rnd.group_rank(self.node),
            reason=rnd.reason,
            mode="live",
        )
        return start

    def _start(self, rnd: RoundRecord) -> None:
        n, first = self.config.worker.nproc_per_node, self.epochs.current() is None
        ids = [f"{self.node}.w{self._seq + 1 + s}" for s in range(n)]  # (as _fill names them)
        envs = lambda: [self._env(s, w, self._hb_root / w) for s, w in enumerate(ids)]  # noqa: E731
        self.outputs.begin(self._log_root, envs, range(n))
        for slot in range(n):
            self._fill(slot, include_now=first, boot_wait_s=SPARE_BOOT_WAIT_S, joining=not first)
        if self.pool is not None:
            self.pool.trim()  # (and refilled by tend() once these workers are up)
        self.epochs.publish(rnd, self._included())

    def _included(self) -> list[str]:
        return self.groups.members(self.slots)

    # -- processes ---------------------------------------------------------------------------
    def _next_id(self) -> str:
        self._seq += 1
        return f"{self.node}.w{self._seq}"

    def _env(self, slot: int, worker_id: str, heartbeat: Path) -> dict[str, str]:
        assert self.round is not None
        return live_worker_env(
            self.config,
            self.round,
            node_id=self.node,
            slot=slot,
            worker_id=worker_id,
            heartbeat=heartbeat,
            store_addr=self.store_addr,
            secret_file=self._secret_file,
            group=self.groups.worker_group(slot),
        )

    def _fill(
        self, slot: int, *, include_now: bool, boot_wait_s: float = 0.0, joining: bool = False
    ) -> None:
        """Put a worker in ``slot``: a ready warm spare joins the next epoch at once (the
        world size, and so bitwise reproducibility, is kept); otherwise a fresh process is
        started and joins at a step boundary once it is up, while the others carry on.
        ``boot_wait_s``: wait that long for a spare that is still importing torch.
        ``joining``: a new node's worker; even a spare enters an epoch only once its script
        has reached the loop; a sharded job's spare always does (the healthy groups go on
        with the lost group's portion of the batch: ``flexrun.train.live_portions``)."""
        wid = self._next_id()
        hb = self._hb_root / wid
        hb.unlink(missing_ok=True)
        env = self._env(slot, wid, hb)
        wdir = self._log_root / wid
        spare = self.pool.take(wait_s=boot_wait_s) if self.pool is not None else None
        if spare is None:
            w = _cold(self._command, env, wdir, slot, self.outputs.console(slot, slot))
            included = include_now
        else:
            w = _warm(spare, self.config, env, wdir, slot, self.outputs.console(slot, slot))
            included = include_now or not (joining or self.groups.sharded)
            log.info("slot %d: a warm spare takes over as %s", slot, wid)
        self._exits.add(w.proc.pid)
        lw = LiveWorker(wid, w, hb, included=included)
        lw.tees = _tees(w, wid, self.config.output.console_streams, self._tee_done)
        self.slots[slot] = lw
        self.events.emit(
            "worker_started",
            worker_id=wid,
            local_rank=slot,
            pid=w.proc.pid,
            spare=spare is not None,
            **(
                {"spare_ready_ts": self.pool.last_ready_ts}
                if spare is not None and self.pool is not None
                else {}
            ),
        )

    # -- monitoring --------------------------------------------------------------------------
    def poll(self) -> LiveFailed | LiveFinished | None:
        """Check workers; replace the dead; publish changes.

        Raises:
            StoreUnavailable: the store cannot be reached. The dead are replaced and
                reported by the first poll that reaches it (membership changes wait).
        """
        failures, dead = self._failures, self._dead
        now = self.clock.wall()
        for slot, lw in sorted(self.slots.items()):
            if lw.finished:
                continue
            rc = lw.worker.proc.poll()
            if rc is None:
                self._watch(lw, now)
                continue
            result = WorkerResult(slot, slot, lw.worker.proc.pid, rc, now)
            self.events.emit(
                "worker_exited",
                worker_id=lw.worker_id,
                local_rank=slot,
                pid=result.pid,
                exit_code=result.exit_code,
                signal=result.signal_name,
            )
            if rc == 0:
                lw.finished = True
                continue
            cause = read_cause(lw.worker, result).replace(node=self.node, worker_id=lw.worker_id)
            reap(lw.worker)
            del self.slots[slot]
            log.warning(
                "worker %s failed (%s): %s", cause.worker_id, cause.describe(), cause.message
            )  # fmt: skip  (the agent says whether it is replaced)
            failures.append(cause)
            dead.append(slot)
        epoch = self.epochs.current() if failures else None
        if dead and not any(other.finished for other in self.slots.values()):
            # (When some worker finished, training is complete: nothing left to replace.)
            self.groups.take_out(dead, failures, self.slots, self.events)
            lost = self._state_lost(epoch)
            if lost is not None:
                self._fall_back(lost)
            while dead:
                self._fill(dead.pop(0), include_now=lost is not None)
        dead.clear()
        if self.slots and all(lw.finished for lw in self.slots.values()):
            return LiveFinished()
        if self.round is not None:
            self.epochs.publish(self.round, self._included())
        self.groups.reap_dying()
        if failures:
            self._failures = []
            return LiveFailed(tuple(failures), epoch.number if epoch is not None else 0)
        return None

    def _watch(self, lw: LiveWorker, now_wall: float) -> None:
        """Admit a running worker once it reaches the loop; kill it when it is frozen."""
        age, mono = heartbeat_age(lw.heartbeat, now_wall), self.clock.monotonic()
        if age is not None:  # (None: not in the loop yet, or done with it)
            lw.included = self.saw_loop(mono, lw.heartbeat)
        why = _frozen(lw, age, mono, self.config.rendezvous.heartbeat_timeout_s)
        if why is not None:
            log.warning("worker %s %s: killing it", lw.worker_id, why)
            hung = {"worker_id": lw.worker_id, "silent_s": round(age or 0.0, 2), "why": why}
            self.events.emit("hang_detected", **hung)
            kill_session(lw.worker.proc.pid)

    def _state_lost(self, current: EpochRecord | None) -> int | None:
        """The number of the current epoch if no living worker can hold its state (every
        member died), else None. Another node's published workers count as holders: the
        workers themselves fall back if they turn out to have none (``live_plan``)."""
        if current is None or not self.epochs.formed():
            return None  # no epoch has trained yet: nothing to lose
        if any(
            lw.worker.proc.poll() is None and holds_state(lw.heartbeat)
            for lw in self.slots.values()
        ):
            return None
        if self.epochs.others_hold(self.round, current):
            return None
        return current.number

    def _fall_back(self, epoch: int) -> None:
        """Every member of ``epoch`` died: restart mode. All of this node's workers (fresh
        ones and spares) enter the next epoch together, at the full world size, and resume
        from the latest durable checkpoint (the new epoch's rank 0 loads and broadcasts it)."""
        detail = (
            f"every worker of live epoch {epoch} died: restarting all workers from the latest "
            "durable checkpoint"
        )
        log.warning("live fallback: %s", detail)
        self.events.emit("restart", reason="live_fallback", detail=detail, epoch=epoch, mode="live")
        for lw in self.slots.values():
            lw.included = True

    def tend(self) -> None:
        """Refill the warm pool once every worker here is in the loop (not to slow them)."""
        if self.pool is not None and self.slots and _in_loop(self.slots, self.clock.wall()):
            self.pool.fill()

    # -- stopping ----------------------------------------------------------------------------
    def stop(
        self,
        grace_s: float,
        *,
        on_first_exit: Callable[[], None] | None = None,
        sig: int = signal.SIGTERM,
    ) -> None:
        if self.pool is not None:
            self.pool.close()
        procs = list(self.slots.values())
        for lw in procs:
            if lw.worker.proc.poll() is None:
                kill_session(lw.worker.proc.pid, sig)
        deadline = self.clock.monotonic() + grace_s
        for lw in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                lw.worker.proc.wait(timeout=max(0.001, deadline - self.clock.monotonic()))
            reap(lw.worker)
        if on_first_exit is not None:
            # (Not earlier: a preempted live node's workers leave after a committed step,
            # and the others re-form once this node is gone from the rendezvous.)
            on_first_exit()
        self._tee_done.set()
        for lw in procs:
            for t in lw.tees:
                t.join(timeout=2)
        self._tee_done = threading.Event()
        self.groups.reap_dying(wait_s=MATE_EXIT_WAIT_S)
        self.outputs.end()  # (after the workers' drains, reaped above)
        self.slots.clear()
        self._failures, self._dead = [], []
        self.epochs.forget()

    def close(self) -> None:
        self.stop(0)
        self._exits.close()
        if self._secret_file is not None:
            remove_secret_file(self._secret_file)


def live_worker_env(
    c: RunConfig,
    rnd: RoundRecord,
    *,
    node_id: str,
    slot: int,
    worker_id: str,
    heartbeat: Path,
    store_addr: tuple[str, int],
    secret_file: Path | None,
    group: tuple[int, str, int] | None = None,
) -> dict[str, str]:
    """The environment of the live worker ``worker_id`` in local slot ``slot`` (``group``:
    its replica group in a sharded job, see ``flexrun.live_protocol.worker_env``)."""
    env = worker_envs(
        base=c.worker.environ,
        rnd=rnd,
        node_id=node_id,
        nproc=c.worker.nproc_per_node,
        master=MasterRecord(c.local_addr, 0),
        role=c.worker.role,
        run_id=c.run_id,
        run_dir=c.output.run_dir,
        restart_count=0,
        max_restarts=c.rendezvous.max_restarts,
        settings=c,
    )[slot]
    # Live workers form their own groups per epoch: no default process group address.
    # Their bounded store waits time out routinely; c10d would warn about each one.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    # Workers sign and verify the live records with the job secret, given as a file
    # (never a variable's value: /proc/<pid>/environ, crash reports).
    env.pop(SECRET_ENV, None)
    if secret_file is not None:
        env[SECRET_ENV_FILE] = str(secret_file)
    else:
        env.pop(SECRET_ENV_FILE, None)
    env.update(
        worker_env(
            store=store_addr,
            worker_id=worker_id,
            heartbeat=heartbeat,
            heartbeat_interval_s=min(0.5, c.rendezvous.heartbeat_interval_s),
            group=group,
        )
    )
    return env
