"""The elastic agent of one node: rendezvous -> run the workers -> react, until the job ends.

Owns the loop that composes the rendezvous handler (membership), a
:class:`~flexrun.agent.runner.Runner` (the workers, restart or live mode, chosen once),
the round hand-off between them (the round's master address published or awaited here,
then handed to the runner: no runner steps the rendezvous),
the pure failure policy (:mod:`flexrun.agent.policy`: this module only carries its actions
out), store outages, the agent's own signals, productive-time bookkeeping and the exit
code (:mod:`flexrun.exitcodes`): 0 success; a failed worker's own code when 1..127;
86 (NO_PROGRESS) for a crash loop; 128+N when the job stopped on signal N (143 for a
preemption's SIGTERM).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.agent import policy
from flexrun.agent.failure_log import log_live_failure, report_failure
from flexrun.agent.runner import MasterSource, RoundStart, Runner
from flexrun.agent.unreadable import Unreadable
from flexrun.agent.uptime import Uptime
from flexrun.cause import FailureCause
from flexrun.config import RunConfig
from flexrun.errors import (
    AgentError,
    RendezvousError,
    RendezvousTimeout,
    StoreError,
    StoreUnavailable,
)
from flexrun.events import EventLog
from flexrun.exitcodes import NO_PROGRESS, STORE_LOST, for_signal
from flexrun.recovery import RecoverySettings
from flexrun.rendezvous import Exit, RendezvousHandler, Run, Stop
from flexrun.rendezvous.decide import Action
from flexrun.rendezvous.state import FAILED, RUNNING, RoundRecord
from flexrun.rendezvous.static import store_host_lost

log = logging.getLogger("flexrun.agent")

STOP_GRACE_S = 2.0
"""SIGTERM -> SIGKILL when the rendezvous stops this node's workers (a round without it,
too few nodes, the job failed elsewhere): peers are gone, a clean exit is unlikely."""
CAUSE_POLL_S = 0.05
"""How often workers are polled while the policy waits for a failure's real cause."""
FINISH_WAIT_S = 5.0
"""How long a node still running workers when the job finished elsewhere lets them end by
themselves before stopping them: live survivors finishing the same last step end within it;
a round formed as the job ended (a peer's failure, a join) never trains and is stopped."""


class _Terminated(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Agent:
    """Runs this node's workers for as long as the job runs."""

    def __init__(
        self,
        config: RunConfig,
        rdzv: RendezvousHandler,
        runner: Runner,
        *,
        events: EventLog,
        masters: MasterSource | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.rdzv = rdzv
        self.runner = runner
        self.masters = masters
        """Each round's master address (None: the runner needs none, live mode)."""
        self.events = events
        self.clock = clock
        self.settings = policy.PolicySettings.from_rendezvous(config.rendezvous)
        self.recovery = RecoverySettings.of(config.rendezvous, hang_timeout_s=config.hang_timeout_s)
        self.phase: policy.Phase = policy.Idle()
        self.uptime = Uptime(clock)
        self._runs = 0  # fresh starts of this node's workers
        self._started = clock.monotonic()
        self._outage_since: float | None = None
        self._outage_tries = 0
        self._unreadable = Unreadable(self)

    # -- entry point ------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job finishes, fails or this agent is signalled; return the exit code."""
        previous = _install_signals(self.config.worker.signal_numbers)
        try:
            code = self._join()
            if code is None:
                code = self._loop()
            self._finish(code)
            if code == 0:
                _wait_for_others_to_leave(self.config, self.rdzv, self.clock)
            return code
        except _Terminated as t:
            name, grace = signal.Signals(t.signum).name, self.config.worker.stop_grace_s
            log.warning("received %s: stopping workers (grace %gs)", name, grace)
            self.events.emit("preempted", signal=name)
            # Leave the rendezvous as soon as a worker is gone (the ranks agreed on the
            # stop and saved before any exits): the survivors re-form at once instead of
            # waiting for the slowest worker's teardown.
            sig = worker_signal(t.signum)
            self._stop(grace, productive=True, on_first_exit=self.rdzv.leave, sig=sig)
            code = for_signal(t.signum)
            self._finish(code)
            return code
        finally:
            self._stop(0, productive=True)
            self.runner.close()
            self.rdzv.leave()
            _restore_signals(previous)

    def _finish(self, code: int) -> None:
        wall = self.clock.monotonic() - self._started
        lost = self.runner.lost_s()  # (live mode: time lost without a stopped round)
        productive = max(self.uptime.total_s - lost, 0.0)
        overhead = min(self.uptime.overhead_s(self._started), wall - productive)
        self.events.emit(
            "job_finished",
            exit_code=code,
            wall_s=round(wall, 3),
            productive_s=round(productive, 3),
            overhead_s=round(overhead, 3),
            lost_s=round(lost, 3),
            ettr=round(productive / wall, 4) if wall > 0 else None,
            failure_ettr=round((productive + overhead) / wall, 4) if wall > 0 else None,
            rounds_run=self._runs,
        )

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> int:
        while True:
            try:
                code = self._tick()
            except StoreUnavailable as exc:
                if self._on_outage(exc):
                    return STORE_LOST
                lost = self._store_host_lost()
                if lost is not None:
                    self._follow(Exit(lost.exit_code, "job failed: node_lost", lost))
                    return lost.exit_code
                continue
            except RendezvousTimeout:
                raise
            except RendezvousError as exc:
                self._unreadable.seen(exc)
                continue
            self._unreadable.since = None
            if self._outage_since is not None:
                down = self.clock.monotonic() - self._outage_since
                log.warning("store reachable again after %.1fs", down)
                self.events.emit("store_recovered", down_s=round(down, 3))
                self._outage_since, self._outage_tries = None, 0
                self._decide(policy.StoreBack())
            if code is not None:
                return code

    def _tick(self) -> int | None:
        """One pass: a pending report first, then the workers, then the rendezvous."""
        if isinstance(self.phase, policy.Reporting):  # (an outage interrupted it)
            return self._decide_actions((policy.Report(self.phase.round, self.phase.cause),))
        if self.runner.active:
            event = self.runner.poll()
            self.uptime.observe(self.runner.first_step_mono())
            if event is not None:
                code = self._decide(event)
                if code is not None:
                    return code
        if isinstance(self.phase, policy.AwaitingCause):
            self.clock.sleep(CAUSE_POLL_S)  # (the other workers may still be ending)
            return None
        if isinstance(self.phase, policy.Reporting):
            return None  # reported on the next pass (a store outage retries it there)
        self.runner.tend()
        action = self.rdzv.step(policy.hold_round(self.phase))
        if isinstance(self.phase, policy.Settling):
            # Has the rendezvous moved on (a lost peer explains the failure), or is it
            # time to count the failure?
            rnd = self.rdzv.round
            self._decide(policy.RoundSeen(rnd.number if rnd is not None else None))
            if isinstance(self.phase, policy.Settling) and not isinstance(action, Exit):
                left = max(self.phase.until - self.clock.monotonic(), 0.01)
                self.rdzv.wait(min(self.config.rendezvous.heartbeat_interval_s, left))
                return None
        return self._follow(action)

    def _follow(self, action: Action) -> int | None:
        """Carry out the rendezvous' decision."""
        if isinstance(action, Run):
            try:
                start = start_round(self.runner, self.masters, action.round)
            except OSError as exc:
                raise AgentError(
                    f"could not start the workers of round {action.round.number}: {exc}"
                ) from exc
            if start is RoundStart.FRESH:
                self._runs += 1
                self.uptime.restart()
            if start is not None:
                return self._decide(policy.Started(action.round.number))
            return None
        if isinstance(action, Stop):
            log.info("stopping workers: %s", action.reason)
            self._stop(STOP_GRACE_S, productive=True)
            return self._decide(policy.Halted())
        if isinstance(action, Exit):
            if action.code == 0 and self.runner.active:
                log.info("%s: this node's workers get %gs to end", action.reason, FINISH_WAIT_S)
                await_own_exit(self.runner, self.clock, FINISH_WAIT_S)
            self._stop(STOP_GRACE_S, productive=True)
            if action.code == NO_PROGRESS:
                _crash_loop_exit(self.events, self.recovery.crash_loop_restarts)
            if action.code != 0:
                report_failure(action, self.config.output.launcher_error_file, self.clock.wall())
            return action.code
        interval = self.config.worker.monitor_interval_s
        self.rdzv.wait(interval if self.runner.active else max(interval, 0.5))
        return None

    # -- the policy's actions ---------------------------------------------------------------
    def _decide(self, event: policy.Event) -> int | None:
        decision = policy.step(self.phase, event, self.clock.monotonic(), self.settings)
        self.phase = decision.phase
        return self._decide_actions(decision.actions)

    def _decide_actions(self, actions: tuple[policy.Action, ...]) -> int | None:
        for a in actions:
            if isinstance(a, policy.EmitExits):
                for e in a.exits:
                    self.events.emit(
                        "worker_exited",
                        rank=e.rank,
                        local_rank=e.local_rank,
                        pid=e.pid,
                        exit_code=e.exit_code,
                        signal=e.signal,
                    )
            elif isinstance(a, policy.StopWorkers):
                log.debug("stopping workers (%s)", a.reason)
                self._stop(a.grace_s, productive=a.productive)
            elif isinstance(a, policy.Report):
                self._report(a)
            elif isinstance(a, policy.Follow):
                log.info(
                    "rank %s lost a peer; following the new round (not counted as a failure)",
                    a.cause.rank,
                )
            elif isinstance(a, policy.Finish):
                try:
                    self.rdzv.close(a.round)
                except StoreUnavailable as exc:
                    log.warning("workers finished, but the store could not be told (%s)", exc)
                return 0
        return None

    def _report(self, a: policy.Report) -> None:
        """Count a failure against --max-restarts (restart mode: the next round, or the
        job's end; live mode: the round stays)."""
        cause = a.cause.replace(node=a.cause.node or self.rdzv.me.node_id)
        progressed = self.runner.made_progress()
        if a.live:
            self.events.emit("failure", **cause.to_dict())
            rec = self.rdzv.count_failure(cause, progressed=progressed)
            log_live_failure(cause, rec, self.recovery)
            return
        rec = self.rdzv.report_failure(a.round, cause, progressed=progressed)
        self.phase = policy.step(self.phase, policy.Reported(), 0.0, self.settings).phase
        self.events.emit("failure", **{k: v for k, v in cause.to_dict().items() if k != "round"})
        what = f"rank {cause.rank} failed ({cause.describe()})"
        max_restarts = self.recovery.max_restarts
        if rec.state == FAILED and rec.reason == "no_progress":
            log.error("%s; no step completed since the last restart", what)
        elif rec.state == FAILED:
            log.error("%s; restarts exhausted (%d allowed)", what, max_restarts)
        elif rec.state == RUNNING and rec.reason == "failure":
            self.events.emit("restart", round=rec.number, reason="failure", restarts=rec.restarts)
            log.warning(
                "%s: %s; restarting (failure %d of at most %d)",
                what,
                cause.message,
                rec.restarts,
                max_restarts,
            )

    def _stop(
        self,
        grace_s: float,
        *,
        productive: bool,
        on_first_exit: Callable[[], None] | None = None,
        sig: int = signal.SIGTERM,
    ) -> None:
        kept = self.runner.kept_until()
        self.runner.stop(grace_s, on_first_exit=on_first_exit, sig=sig)
        self.uptime.stop(productive=productive, kept_until=kept)

    # -- store outages ----------------------------------------------------------------------
    def _store_host_lost(self) -> FailureCause | None:
        """A static job whose store (node rank 0's agent) is gone for a heartbeat timeout."""
        static, since = self.config.static, self._outage_since
        if static is None or since is None:
            return None
        host, port = self.config.store.endpoints[0]
        outage_s = self.clock.monotonic() - since
        return store_host_lost(static.node_rank, f"{host}:{port}", outage_s, self.config.rendezvous)

    def _join(self) -> int | None:
        """Announce this node, waiting out a store outage (a store restarted while this
        agent starts): None once joined, STORE_LOST after a join timeout without it."""
        while True:
            try:
                self.rdzv.join()
            except StoreUnavailable as exc:
                if self._on_outage(exc):
                    return STORE_LOST
                continue
            return None

    def _on_outage(self, exc: StoreUnavailable) -> bool:
        """The store is unreachable: keep the workers (their process group is formed),
        retry with backoff, and only give up (True) when no workers ran for a join
        timeout (a store that was reached and went away is not bad input: no exit 2)."""
        now = self.clock.monotonic()
        running = self.runner.active
        if self._outage_since is None:
            self._outage_since = now
            if running:
                log.warning("store unreachable (%s); workers keep training, retrying", exc)
            else:
                log.warning(
                    "store unreachable (%s); waiting for it: no membership change can happen meanwhile",
                    exc,
                )
            self.events.emit("store_unavailable", error=str(exc), workers_running=running)
        elif not running and now - self._outage_since > self.config.rendezvous.join_timeout_s:
            log.error(
                "the store stayed unreachable for %.0fs with no workers running: giving up (%s)",
                now - self._outage_since,
                exc,
            )
            self.events.emit(
                "store_lost", error=str(exc), down_s=round(now - self._outage_since, 3)
            )
            return True
        self._outage_tries += 1
        self.clock.sleep(min(2.0, 0.05 * 2 ** min(self._outage_tries, 6)))
        return False


def start_round(
    runner: Runner, masters: MasterSource | None, rnd: RoundRecord
) -> RoundStart | None:
    """The round hand-off: the runner ends the earlier round's workers, the loop publishes
    or awaits the round's master address (the rendezvous steps meanwhile if it must: a
    round that moves on ends the wait), then the runner starts the workers with it. None:
    the round moved on before its master came."""
    runner.prepare_round(rnd)
    master = None
    if masters is not None:
        master = masters(rnd)
        if master is None:
            return None  # the round moved on while we waited; the next step re-decides
    return runner.run_round(rnd, master)


# -- signals ------------------------------------------------------------------------------------
_OWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Caught whatever ``--signals-to-handle`` says: they stop the job in order (workers
stopped, the rendezvous left) rather than killing the agent outright."""


def await_own_exit(runner: Runner, clock: Clock, timeout_s: float) -> None:
    """Poll ``runner``'s workers until all have ended or ``timeout_s`` passed."""
    deadline = clock.monotonic() + timeout_s
    while runner.active and clock.monotonic() < deadline:
        event = runner.poll()
        if isinstance(event, policy.LiveFinished):
            return
        if isinstance(event, policy.Exited) and event.all_done:
            return
        clock.sleep(CAUSE_POLL_S)


def _crash_loop_exit(events: EventLog, k: int) -> None:
    line = (
        f"crash loop: the job failed {k + 1} times in a row without completing a "
        f"training step (--crash-loop-restarts {k}); giving up with exit code "
        f"{NO_PROGRESS} (do not requeue: the same start will fail again)"
    )
    print(f"flexrun: {line}", file=sys.stderr)
    events.emit("no_progress", crash_loop_restarts=k, message=line)


def _install_signals(listed: tuple[int, ...] = ()) -> dict[int, Any]:
    """SIGTERM/INT/HUP and the ``listed`` ones (``--signals-to-handle``) raise
    :class:`_Terminated` in the main thread (the loop stops the workers with
    :func:`worker_signal`, leaves and exits 128+N); the previous handlers, to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(signum)

    wanted = dict.fromkeys((*_OWN_SIGNALS, *listed))
    return {s: signal.signal(s, handler) for s in wanted}


def worker_signal(signum: int) -> int:
    """What the workers get when the agent caught ``signum``: SIGTERM for the agent's own
    stop signals (flexrun.train's agreed save at the next step listens for it, and the
    Python API interrupts the agent with SIGINT), else ``signum`` itself, forwarded as
    torchrun does; SIGKILL follows after the stop grace either way."""
    return signal.SIGTERM if signum in _OWN_SIGNALS else signum


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, h in previous.items():
        signal.signal(sig, h)


def _wait_for_others_to_leave(config: RunConfig, rdzv: RendezvousHandler, clock: Clock) -> None:
    """A static job's node rank 0 hosts the store: after a finished job it keeps it up
    until the other nodes have left (their keep-alives deleted or expired), so that leaving
    first does not make them report an unreachable store on every successful run. (The one
    read of other nodes' keep-alives outside the watcher, once per job.)"""
    if config.static is None or not config.store.host_store:
        return
    deadline = clock.monotonic() + config.rendezvous.heartbeat_timeout_s + 1.0
    while clock.monotonic() < deadline:
        mine = rdzv.keys.heartbeat(rdzv.me.node_id)
        try:
            beats = rdzv.store.get_prefix(rdzv.keys.heartbeats)
            if not [key for key in beats if key != mine]:
                return
        except StoreError:
            return  # (nothing to wait for: no one can reach it either)
        clock.sleep(0.1)
    log.debug("job finished; closing the store with other nodes still registered")
