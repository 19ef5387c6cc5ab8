"""The elastic agent of one node, restart mode: rendezvous -> spawn -> monitor -> react.

Owns the loop that composes the rendezvous handler (membership), the worker group
(processes) and the event log, plus the agent's own signals and exit code. Membership
decisions live in ``flexrun.rendezvous.decide``; process mechanics in ``workers.py``.

Exit codes (ARCHITECTURE.md): 0 success; a failed worker's own code when 1..127; 128+N
when the job stopped on signal N (143 for a preemption's SIGTERM).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.agent.spec import worker_envs
from flexrun.cause import FailureCause
from flexrun.config import RunConfig
from flexrun.errors import ConfigError, StoreUnavailable
from flexrun.events import EventLog
from flexrun.proc import Worker, WorkerGroup, WorkerResult, build_command
from flexrun.proc.diagnose import first_failure, in_collective, is_consequence
from flexrun.proc.stacks import capture_stacks
from flexrun.rendezvous import Exit, NodeRecord, RendezvousHandler, Run, Stop
from flexrun.rendezvous.state import FAILED, RUNNING, RoundRecord
from flexrun.spares.pool import WarmPool, assign
from flexrun.store.api import Store

if TYPE_CHECKING:
    from flexrun.agent.live import LiveSupervisor

log = logging.getLogger("flexrun.agent")

# A restart stops workers that may be blocked in a collective with a dead peer: they will
# not reach a clean exit, so do not wait long before SIGKILL.
RESTART_GRACE_S = 2.0
# Warm spares are started this long after a round's workers, so that they do not compete
# with the workers' own start-up (interpreter and torch import) for CPU. Workers that came
# from spares have no such start-up: the pool is refilled at once after them (otherwise a
# round that fails within the delay, as under a stream of faults, waits a whole spare boot
# for its replacement; ~1.8 s on this machine, seen in the long chaos run).
SPARE_DELAY_S = 3.0
# A failure seen only as "peer closed the connection" waits up to this long for the other
# local workers to end by themselves before the root cause is chosen.
CAUSE_WAIT_S = 1.0
# A spare still importing torch will be ready before a process started now: wait this long.
SPARE_BOOT_WAIT_S = 10.0


class _Terminated(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class ElasticAgent:
    """Runs this node's workers for as long as the job runs."""

    def __init__(
        self,
        config: RunConfig,
        store: Store,
        *,
        events: EventLog,
        clock: Clock = SYSTEM_CLOCK,
        store_addr: tuple[str, int] | None = None,
        pool: WarmPool | None = None,
        live_spares: WarmPool | None = None,
    ) -> None:
        self.config = config
        self.events = events
        self.clock = clock
        self.me = NodeRecord(config.node_id, config.local_addr, config.nproc_per_node, pid=_pid())
        self.rdzv = RendezvousHandler(
            store,
            run_id=config.run_id,
            me=self.me,
            settings=config.rendezvous,
            events=events,
            clock=clock,
        )
        self.group: WorkerGroup | None = None
        self.running: int | None = None
        self._runs = 0
        self._started = clock.monotonic()
        self._productive_s = 0.0
        self._run_started = 0.0
        self._cold_workers = 0  # workers of the current round not taken from the warm pool
        self._outage_since: float | None = None
        self._outage_tries = 0
        self._pending_failure: tuple[int, FailureCause, bool] | None = None
        self._command = build_command(
            config.entrypoint, config.args, module=config.module, no_python=config.no_python
        )
        self.pool: WarmPool | None = pool if pool is not None else restart_pool(config)
        self.live: LiveSupervisor | None = None
        if config.mode == "live":
            if store_addr is None:
                raise ConfigError("--mode live needs the tcp store")
            # Imported here: live mode pulls in torch, which restart mode's agent avoids
            # until it needs a store (so a warm pool can start first).
            from flexrun.agent.live import LiveSupervisor

            self.live = LiveSupervisor(
                config,
                self.rdzv,
                store,
                store_addr,
                self._command,
                events=events,
                warm_spares=config.warm_spares,
                clock=clock,
                pool=live_spares,
            )

    # -- entry point ------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job finishes, fails or this agent is signalled; return the exit code."""
        previous = self._install_signals()
        try:
            self.rdzv.join()
            code = self._loop()
            self._finish(code)
            return code
        except _Terminated as t:
            log.warning(
                "received %s: stopping workers (grace %gs)",
                signal.Signals(t.signum).name,
                self.config.stop_grace_s,
            )
            self.events.emit("preempted", signal=signal.Signals(t.signum).name)
            # Leave the rendezvous as soon as a worker is gone (the ranks agreed on the
            # stop and saved before any exits): the survivors re-form at once instead of
            # waiting for the slowest worker's teardown.
            self._stop_workers(
                self.config.stop_grace_s, reason="signal", on_first_exit=self.rdzv.leave
            )
            code = 128 + t.signum
            self._finish(code)
            return code
        finally:
            self._stop_workers(0, reason="agent exit")
            if self.pool is not None:
                self.pool.close()
            self.rdzv.leave()
            self._restore_signals(previous)

    def _finish(self, code: int) -> None:
        wall = self.clock.monotonic() - self._started
        self.events.emit(
            "job_finished",
            exit_code=code,
            wall_s=round(wall, 3),
            productive_s=round(self._productive_s, 3),
            ettr=round(self._productive_s / wall, 4) if wall > 0 else None,
            rounds_run=self._runs,
        )

    # -- signals ----------------------------------------------------------------------------
    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: FrameType | None) -> None:
            raise _Terminated(signum)

        previous: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, handler)
        return previous

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> int:
        while True:
            try:
                code = self._tick()
            except StoreUnavailable as exc:
                self._on_outage(exc)
                continue
            if self._outage_since is not None:
                down = self.clock.monotonic() - self._outage_since
                log.warning("store reachable again after %.1fs", down)
                self.events.emit("store_recovered", down_s=round(down, 3))
                self._outage_since, self._outage_tries = None, 0
            if code is not None:
                return code

    def _tick(self) -> int | None:
        """One pass: settle a pending failure, check workers, follow the rendezvous."""
        if self._pending_failure is not None:
            self._settle_failure(*self._pending_failure)
            self._pending_failure = None
        if self.live is not None and self.live.active and self.live.poll() == 0:
            finished = self.running
            self._stop_workers(0, reason="finished")
            try:
                self.rdzv.close(finished if finished is not None else 0)
            except StoreUnavailable as exc:
                log.warning("workers finished, but the store could not be told (%s)", exc)
            return 0
        if self.group is not None:
            outcome = self._check_workers()
            if outcome is not None:
                return outcome
            if self._pending_failure is not None:
                return None
        if (
            self.pool is not None
            and self._runs
            and (
                self.group is None
                or self._cold_workers == 0
                or self.clock.monotonic() - self._run_started >= SPARE_DELAY_S
            )
        ):
            self.pool.fill()
        action = self.rdzv.step(self.running)
        if isinstance(action, Run) and self.live is not None:
            self._live_round(action.round)
        elif isinstance(action, Run):
            self._start_round(action.round)
        elif isinstance(action, Stop):
            log.info("stopping workers: %s", action.reason)
            self._stop_workers(RESTART_GRACE_S, reason=action.reason)
        elif isinstance(action, Exit):
            self._stop_workers(RESTART_GRACE_S, reason=action.reason)
            if action.code != 0:
                cause = action.root_cause.to_dict() if action.root_cause is not None else {}
                _print_root_cause(cause, action.reason)
            return action.code
        else:
            interval = self.config.monitor_interval_s
            busy = self.group is not None or (self.live is not None and self.live.active)
            self.rdzv.wait(interval if busy else max(interval, 0.5))
        return None

    def _live_round(self, rnd: RoundRecord) -> None:
        """Live mode: a new round changes the membership epoch, never the survivors."""
        assert self.live is not None
        self.events.round = rnd.number
        if self.live.active:
            log.info(
                "round %d (%s): live workers carry on; publishing the new membership",
                rnd.number,
                rnd.reason,
            )
            self.live.on_round(rnd)
        else:
            self.live.start(rnd)
            self._runs += 1
            self._run_started = self.clock.monotonic()
        self.running = rnd.number
        self.events.emit(
            "rendezvous_completed",
            round=rnd.number,
            members=rnd.member_ids,
            world_size=rnd.world_size(),
            group_rank=rnd.group_rank(self.me.node_id),
            reason=rnd.reason,
            mode="live",
        )

    def _on_outage(self, exc: StoreUnavailable) -> None:
        """The store is unreachable: keep the workers (their process group is formed),
        retry with backoff, and only give up when no workers run for a join timeout."""
        now = self.clock.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            if self.group is not None:
                log.warning("store unreachable (%s); workers keep training, retrying", exc)
            else:
                log.warning(
                    "store unreachable (%s); waiting for it: no membership change can happen meanwhile",
                    exc,
                )
            self.events.emit(
                "store_unavailable", error=str(exc), workers_running=self.group is not None
            )
        elif (
            self.group is None and now - self._outage_since > self.config.rendezvous.join_timeout_s
        ):
            raise exc
        self._outage_tries += 1
        self.clock.sleep(min(2.0, 0.05 * 2 ** min(self._outage_tries, 6)))

    def _start_round(self, rnd: RoundRecord) -> None:
        if self.group is not None:
            log.info("round %d (%s): restarting workers", rnd.number, rnd.reason)
            self.events.emit("restart", round=rnd.number, reason=rnd.reason)
            self._stop_workers(RESTART_GRACE_S, reason=f"round {rnd.number}")
        t0 = self.clock.monotonic()
        self.events.emit("rendezvous_started", round=rnd.number)
        master = self.rdzv.master_for(rnd, timeout_s=self.config.rendezvous.join_timeout_s)
        if master is None:
            return  # the round moved on while we waited; the next step re-decides
        self.events.round = rnd.number
        envs = worker_envs(
            base=self.config.environ,
            rnd=rnd,
            node_id=self.me.node_id,
            nproc=self.config.nproc_per_node,
            master=master,
            role=self.config.role,
            run_id=self.config.run_id,
            run_dir=self.config.run_dir,
            restart_count=self._runs,
            max_restarts=self.config.rendezvous.max_restarts,
        )
        log_root = self.config.log_dir or (self.config.run_dir / "logs")
        log_dir = log_root / f"round_{rnd.number}"
        self._cold_workers = 0
        if self.config.hang_timeout_s > 0:
            for env in envs:
                wdir = log_dir / f"rank_{env['RANK']}"
                env["FLEXRUN_PROGRESS_FILE"] = str(wdir / "progress")
                env["FLEXRUN_STACK_FILE"] = str(wdir / "stacks.txt")
        self.group = WorkerGroup.start(
            self._command,
            envs,
            log_dir,
            console_streams=self.config.console_streams,
            warm=self._warm if self.pool is not None else None,
        )
        self.running = rnd.number
        self._runs += 1
        self._run_started = self.clock.monotonic()
        self.events.emit(
            "rendezvous_completed",
            round=rnd.number,
            members=rnd.member_ids,
            world_size=rnd.world_size(),
            group_rank=rnd.group_rank(self.me.node_id),
            duration_s=round(self.clock.monotonic() - t0, 4),
            reason=rnd.reason,
        )
        for w in self.group.workers:
            self.events.emit("worker_started", rank=w.rank, local_rank=w.local_rank, pid=w.proc.pid)
        log.info(
            "round %d: %d node(s), world size %d, ranks %d-%d here",
            rnd.number,
            len(rnd.members),
            rnd.world_size(),
            rnd.rank_base(self.me.node_id),
            rnd.rank_base(self.me.node_id) + self.config.nproc_per_node - 1,
        )

    def _detect_hangs(self) -> None:
        """A rank that reported progress once and then none for --hang-timeout is hung:
        capture every local worker's stacks, record them, and fail the rank to blame."""
        assert self.group is not None
        now = time.time()
        silent: dict[int, float] = {}
        for w in self.group.workers:
            if w.result is not None or w.proc.poll() is not None:
                continue
            try:
                age = now - (w.log_dir / "progress").stat().st_mtime
            except FileNotFoundError:
                continue  # the script does not report progress: nothing to judge
            if age > self.config.hang_timeout_s:
                silent[w.rank] = age
        if not silent:
            return
        alive = [w for w in self.group.workers if w.proc.poll() is None]
        stacks = {w.rank: capture_stacks(w.proc.pid, w.log_dir / "stacks.txt") for w in alive}
        # Ranks waiting in a collective are victims of the one stuck elsewhere.
        own = [r for r in silent if not in_collective(stacks.get(r, ""))]
        blamed = max(own or list(silent), key=lambda r: silent[r])
        w = next(x for x in alive if x.rank == blamed)
        hang_dir = self.config.run_dir / "hangs"
        hang_dir.mkdir(parents=True, exist_ok=True)
        path = hang_dir / f"round_{self.running}_rank_{blamed}.txt"
        path.write_text(
            "".join(f"=== rank {r} ===\n{text}\n" for r, text in sorted(stacks.items()))
        )
        log.error(
            "rank %d made no progress for %.1fs: stacks in %s; treating it as failed",
            blamed,
            silent[blamed],
            path,
        )
        self.events.emit(
            "hang_detected",
            rank=blamed,
            pid=w.proc.pid,
            silent_s=round(silent[blamed], 2),
            silent_ranks=sorted(silent),
            stacks_file=str(path),
            stacks=stacks.get(blamed, "")[-20000:],
        )
        w.note = f"hang: no progress for {silent[blamed]:.1f}s (stacks: {path})"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait()

    def _warm(
        self, env: Mapping[str, str], wdir: Path, rank: int, local_rank: int
    ) -> Worker | None:
        """A warm spare for ``rank``, or None (then the worker is started fresh)."""
        assert self.pool is not None
        w = self.pool.take(wait_s=SPARE_BOOT_WAIT_S)
        if w is None:
            self._cold_workers += 1
            return None
        c = self.config
        return assign(
            w,
            env=env,
            entry=c.entrypoint,
            args=c.args,
            module=c.module,
            rank=rank,
            local_rank=local_rank,
            log_dir=wdir,
        )

    def _check_workers(self) -> int | None:
        assert self.group is not None and self.running is not None
        if self.config.hang_timeout_s > 0:
            self._detect_hangs()
        group = self.group
        results = group.poll()
        failed = [r for r in results if r.returncode != 0]
        causes = {r.rank: group.cause(r) for r in failed}
        if failed and all(is_consequence(causes[r.rank]) for r in failed):
            # Only "peer closed the connection" so far: the peer whose error explains it
            # may still be tearing down (seen under load: a rank that raised took over a
            # second to exit). Give the others a moment to end by themselves, so that the
            # root cause names the real error rather than its echo.
            deadline = self.clock.monotonic() + CAUSE_WAIT_S
            while not group.all_done() and self.clock.monotonic() < deadline:
                self.clock.sleep(0.05)
                results = group.poll()
            failed = [r for r in results if r.returncode != 0]
            causes = {r.rank: group.cause(r) for r in failed}
        if failed:
            first = first_failure(
                failed, lambda r: r.ended_at, lambda r: is_consequence(causes[r.rank])
            )
            cause = causes[first.rank].replace(node=self.me.node_id, round=self.running)
            for r in results:
                self._emit_exit(r)
            failed_round = self.running
            peers = self.rdzv.round.members if self.rdzv.round is not None else ()
            consequence = len(peers) > 1 and all(is_consequence(causes[r.rank]) for r in failed)
            self._stop_workers(RESTART_GRACE_S, reason="worker failure", productive=False)
            self._pending_failure = (failed_round, cause, consequence)
            self._settle_failure(*self._pending_failure)
            self._pending_failure = None
            return None
        if group.all_done():
            for r in results:
                self._emit_exit(r)
            finished = self.running
            self._stop_workers(0, reason="finished")
            try:
                self.rdzv.close(finished)
            except StoreUnavailable as exc:
                log.warning("workers finished, but the store could not be told (%s)", exc)
            return 0
        return None

    def _settle_failure(self, failed_round: int, cause: FailureCause, consequence: bool) -> None:
        """Count a local failure against --max-restarts, unless a peer's loss explains it."""
        if consequence and self._peer_moved_on(failed_round):
            log.info(
                "rank %s lost a peer; following the new round (not counted as a failure)",
                cause.rank,
            )
            return
        rec = self.rdzv.report_failure(failed_round, cause)
        self.events.emit("failure", **{k: v for k, v in cause.to_dict().items() if k != "round"})
        what = f"rank {cause.rank} failed ({cause.describe()})"
        if rec.state == FAILED:
            log.error(
                "%s; restarts exhausted (%d allowed)", what, self.config.rendezvous.max_restarts
            )
        elif rec.state == RUNNING and rec.reason == "failure":
            self.events.emit("restart", round=rec.number, reason="failure", restarts=rec.restarts)
            log.warning(
                "%s: %s; restarting (failure %d of at most %d)",
                what,
                cause.message,
                rec.restarts,
                self.config.rendezvous.max_restarts,
            )

    def _peer_moved_on(self, failed_round: int) -> bool:
        """After a local failure caused by a vanished peer, wait up to one heartbeat timeout
        for the rendezvous to notice the peer (lost node, or its own failure report).

        A membership change is not a failure: only if nothing changes in that time does
        this node count the failure against --max-restarts.
        """
        settings = self.config.rendezvous
        # Twice the timeout: the lost peer may have refreshed its keep-alive just before it
        # died, and a store may round leases up (etcd counts whole seconds).
        deadline = (
            self.clock.monotonic()
            + 2 * settings.heartbeat_timeout_s
            + 2 * settings.heartbeat_interval_s
        )
        while self.clock.monotonic() < deadline:
            self.rdzv.step(failed_round)
            rnd = self.rdzv.round
            if rnd is None or rnd.number != failed_round:
                return True
            self.rdzv.wait(
                min(settings.heartbeat_interval_s, max(deadline - self.clock.monotonic(), 0.01))
            )
        return False

    def _emit_exit(self, r: WorkerResult) -> None:
        self.events.emit(
            "worker_exited",
            rank=r.rank,
            local_rank=r.local_rank,
            pid=r.pid,
            exit_code=r.exit_code,
            signal=r.signal_name,
        )

    def _stop_workers(
        self,
        grace_s: float,
        *,
        reason: str,
        productive: bool = True,
        on_first_exit: Callable[[], None] | None = None,
    ) -> None:
        if self.live is not None and (self.live.active or self.live.pool is not None):
            self.live.stop(grace_s)
            if productive:
                self._productive_s += self.clock.monotonic() - self._run_started
            self.running = None
        if self.group is None:
            return
        group, self.group = self.group, None
        if not group.all_done():
            log.debug("stopping workers (%s)", reason)
        group.stop(grace_s, on_first_exit=on_first_exit)
        if productive:
            self._productive_s += self.clock.monotonic() - self._run_started
        self.running = None


def restart_pool(config: RunConfig) -> WarmPool | None:
    """The warm pool of a restart-mode agent (None when disabled or not applicable)."""
    if config.mode != "restart" or config.warm_spares <= 0 or config.no_python:
        return None
    log_root = config.log_dir or (config.run_dir / "logs")
    return WarmPool(config.warm_spares, config.environ, log_root / "spares", node=config.spares_dir)


def _in_collective(stack: str) -> bool:
    return any(
        m in stack for m in ("distributed_c10d", "all_reduce", "barrier", "broadcast", "all_gather")
    )


def _print_root_cause(cause: dict[str, Any] | Any, reason: str) -> None:
    if not cause:
        print(f"flexrun: {reason}", file=sys.stderr)
        return
    sig = f" ({cause.get('signal')})" if cause.get("signal") else ""
    print(
        f"flexrun: {reason}. Root cause: rank {cause.get('rank')} on node {cause.get('node')} "
        f"exited with code {cause.get('exit_code')}{sig}: {cause.get('message') or 'no message'}",
        file=sys.stderr,
    )
    tb = str(cause.get("traceback") or "").strip()
    if tb:
        print("flexrun: traceback of the failing rank:\n" + tb, file=sys.stderr)
    if cause.get("log_dir"):
        print(f"flexrun: logs: {cause.get('log_dir')}", file=sys.stderr)


def _pid() -> int:
    import os

    return os.getpid()
