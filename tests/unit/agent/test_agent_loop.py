"""The agent's loop against a fake rendezvous and a fake runner, with a fake clock.

What the loop must do with the policy's decisions: report a failure once (and retry it
across a store outage), not report one that a lost peer explains, count live failures
once per epoch, close the job when the workers finish, exit with the rendezvous' code,
and keep the workers through an outage. Milliseconds per test: no processes, no store.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable

import pytest

from flexrun.agent import policy as p
from flexrun.agent.agent import Agent
from flexrun.agent.runner import RoundStart
from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.errors import RendezvousError, StoreUnavailable
from flexrun.events import EventLog
from flexrun.rendezvous import Exit, NodeRecord, Run, Stop, Wait
from flexrun.rendezvous.decide import Action
from flexrun.rendezvous.state import RUNNING, MasterRecord, Member, RoundRecord
from flexrun.testing import FakeClock
from flexrun.testing.config import run_config


def rnd(number: int, *nodes: str, state: str = RUNNING, restarts: int = 0) -> RoundRecord:
    return RoundRecord(number, state, tuple(Member(n, "127.0.0.1", 1) for n in nodes), restarts)


class FakeRendezvous:
    """Scripted ``step`` results; records what the agent tells the rendezvous."""

    def __init__(self, script: list[Action | Callable[[int | None], Action]]) -> None:
        self.me = NodeRecord("n1", "127.0.0.1", 1)
        self.script = deque(script)
        self.round: RoundRecord | None = None
        self.steps: list[int | None] = []
        self.reports: list[tuple[int, FailureCause]] = []
        self.counted: list[FailureCause] = []
        self.closed: list[int] = []
        self.fail_reports = 0  # how many report_failure calls raise StoreUnavailable first
        self.left = False

    def join(self) -> None:
        pass

    def leave(self) -> None:
        self.left = True

    def step(self, running: int | None) -> Action:
        self.steps.append(running)
        if not self.script:
            # Training goes on until the runner's script ends it; a loop that never ends
            # fails the test instead of hanging it.
            return Wait("training") if len(self.steps) < 200 else Exit(99, "never ended")
        nxt = self.script.popleft()
        action = nxt(running) if callable(nxt) else nxt
        if isinstance(action, Run):
            self.round = action.round
        return action

    def wait(self, timeout_s: float) -> bool:
        return False

    def report_failure(
        self, failed_round: int, cause: FailureCause, *, progressed: bool | None = None
    ) -> RoundRecord:
        if self.fail_reports:
            self.fail_reports -= 1
            raise StoreUnavailable("store down")
        self.reports.append((failed_round, cause))
        rec = rnd(failed_round + 1, "n1", restarts=len(self.reports))
        self.round = RoundRecord(rec.number, RUNNING, rec.members, rec.restarts, "failure")
        return self.round

    def count_failure(self, cause: FailureCause, *, progressed: bool | None = None) -> RoundRecord:
        self.counted.append(cause)
        assert self.round is not None
        return self.round

    def close(self, running_round: int) -> None:
        self.closed.append(running_round)


class FakeRunner:
    """Scripted poll events; records rounds, stops and tending."""

    def __init__(self, events: list[p.Event | None], start: RoundStart = RoundStart.FRESH) -> None:
        self.events = deque(events)
        self.start = start
        self.rounds: list[int] = []
        self.stops: list[float] = []
        self.running = False
        self.closed = False
        self.progressed: bool | None = None
        self.first_step: float | None = None
        self.prepared: list[int] = []
        self.masters: list[MasterRecord | None] = []
        self.lost = 0.0

    def made_progress(self) -> bool | None:
        return self.progressed

    def first_step_mono(self) -> float | None:
        return self.first_step

    def kept_until(self) -> float | None:
        return None

    def lost_s(self) -> float:
        return self.lost

    @property
    def active(self) -> bool:
        return self.running

    def prepare_round(self, r: RoundRecord) -> None:
        self.prepared.append(r.number)

    def run_round(self, r: RoundRecord, master: MasterRecord | None) -> RoundStart | None:
        self.rounds.append(r.number)
        self.masters.append(master)
        self.running = True
        return self.start

    def poll(self) -> p.Event | None:
        return self.events.popleft() if self.events else None

    def tend(self) -> None:
        pass

    def stop(
        self, grace_s: float, *, on_first_exit: Callable[[], None] | None = None, sig: int = 15
    ) -> None:
        if self.running:
            self.stops.append(grace_s)
        self.running = False
        if on_first_exit is not None:
            on_first_exit()

    def close(self) -> None:
        self.closed = True
        self.running = False


def make(
    tmp_path,
    rdzv: FakeRendezvous,
    runner: FakeRunner,
    *,
    max_restarts: int = 3,
    masters: Callable[[RoundRecord], MasterRecord | None] | None = None,
) -> tuple[Agent, FakeClock]:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    config = run_config(
        entrypoint=str(script),
        run_dir=tmp_path,
        rendezvous=RendezvousSettings(max_restarts=max_restarts),
    )
    clock = FakeClock()
    events = EventLog(tmp_path, run_id="job", node="n1", clock=clock)
    agent = Agent(config, rdzv, runner, events=events, masters=masters, clock=clock)
    return agent, clock


def failure(rank: int, *, echo: bool = False, peers: int = 1, done: bool = True) -> p.Exited:
    msg = "Connection reset by peer" if echo else "ValueError: boom"
    cause = FailureCause(rank=rank, exit_code=1, message=msg)
    return p.Exited((p.WorkerExit(rank, 1, 1.0, cause=cause, consequence=echo),), done, peers)


def finished() -> p.Exited:
    return p.Exited((p.WorkerExit(0, 0, 1.0),), True, 1)


@pytest.mark.timeout(10)
def test_workers_that_finish_close_the_job_and_exit_zero(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1"))])
    runner = FakeRunner([finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert rdzv.closed == [1] and runner.rounds == [1] and runner.closed and rdzv.left


@pytest.mark.timeout(10)
def test_the_loop_hands_each_round_its_master_and_starts_none_whose_master_never_came(
    tmp_path,
) -> None:
    """The round hand-off: the runner ends the earlier round, the loop awaits the master
    (the rendezvous' business, never the runner's), then the runner starts with it."""
    master = MasterRecord("10.0.0.1", 29555)
    asked: list[int] = []

    def masters(r: RoundRecord) -> MasterRecord | None:
        asked.append(r.number)
        return None if r.number == 1 else master  # round 1 moved on while awaited

    rdzv = FakeRendezvous([Run(rnd(1, "n1")), Run(rnd(2, "n1"))])
    runner = FakeRunner([finished()])
    agent, _ = make(tmp_path, rdzv, runner, masters=masters)
    assert agent.run() == 0
    assert asked == [1, 2] and runner.prepared == [1, 2]
    assert runner.rounds == [2] and runner.masters == [master]  # round 1 never started
    assert rdzv.closed == [2]


@pytest.mark.timeout(10)
def test_a_failure_is_reported_once_then_the_next_round_runs(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1")), Run(rnd(2, "n1"))])
    runner = FakeRunner([failure(0), None, finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert [r for r, _ in rdzv.reports] == [1]
    assert rdzv.reports[0][1].node == "n1" and rdzv.reports[0][1].round == 1
    assert runner.rounds == [1, 2] and runner.stops[0] == 2.0  # the failure's short grace


@pytest.mark.timeout(10)
def test_a_report_interrupted_by_a_store_outage_is_retried_not_lost(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1")), Run(rnd(2, "n1"))])
    rdzv.fail_reports = 2
    runner = FakeRunner([failure(0), None, finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert len(rdzv.reports) == 1  # retried until taken, counted once
    # While the report was pending the rendezvous was not stepped (no restart of round 1).
    assert rdzv.steps[:2] == [None, None] and 1 not in rdzv.steps


@pytest.mark.timeout(10)
def test_an_echo_that_a_lost_peer_explains_is_followed_not_reported(tmp_path) -> None:
    two = rnd(1, "n1", "n2")
    rdzv = FakeRendezvous(
        [Run(two), Wait("training"), Run(rnd(2, "n1"))]  # the peer's loss forms round 2
    )
    runner = FakeRunner([failure(0, echo=True, peers=2), None, finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert rdzv.reports == []
    # Settling, the node still held round 1: the rendezvous could not restart it.
    assert rdzv.steps[1] == 1
    assert runner.rounds == [1, 2]


@pytest.mark.timeout(10)
def test_an_echo_is_reported_when_the_round_never_moves(tmp_path) -> None:
    two = rnd(1, "n1", "n2")
    held: list[int | None] = []

    def training(running: int | None) -> Action:
        held.append(running)
        return Wait("training")

    rdzv = FakeRendezvous([Run(two), *([training] * 40), Run(rnd(2, "n1", "n2"))])
    runner = FakeRunner([failure(0, echo=True, peers=2), None, finished()])
    agent, clock = make(tmp_path, rdzv, runner)

    real_wait = rdzv.wait

    def wait(timeout_s: float) -> bool:
        clock.advance(timeout_s)  # the settle wait passes in fake time
        return real_wait(timeout_s)

    rdzv.wait = wait  # type: ignore[method-assign]
    assert agent.run() == 0
    assert [r for r, _ in rdzv.reports] == [1]
    # Settling for settle_s (12 s of fake time, a heartbeat interval per step), the node
    # held round 1; once reported it stepped as a non-member until round 2 came.
    assert held[:10] == [1] * 10 and held[-1] is None and runner.rounds == [1, 2]


@pytest.mark.timeout(10)
def test_an_echo_on_one_node_waits_for_the_cause_without_stepping_the_rendezvous(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1")), Run(rnd(2, "n1"))])
    real = p.Exited(
        (
            p.WorkerExit(
                0, 1, 1.0, cause=FailureCause(rank=0, message="reset by peer"), consequence=True
            ),
            p.WorkerExit(1, 1, 1.001, cause=FailureCause(rank=1, message="ValueError: x")),
        ),
        True,
        1,
    )
    runner = FakeRunner([failure(0, echo=True, done=False), real, None, finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert rdzv.reports[0][1].rank == 1  # the real error, not its echo
    assert 1 not in rdzv.steps  # no rendezvous step while awaiting the cause


@pytest.mark.timeout(10)
def test_live_failures_are_counted_once_per_epoch_and_the_workers_keep_running(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1")), Wait("training"), Wait("training")])
    dead = (FailureCause(rank=0, worker_id="n1.w1"),)
    runner = FakeRunner(
        [p.LiveFailed(dead, 2), p.LiveFailed(dead, 2), p.LiveFinished()],
        start=RoundStart.FRESH,
    )
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert [c.worker_id for c in rdzv.counted] == ["n1.w1"]
    assert rdzv.reports == [] and runner.rounds == [1] and rdzv.closed == [1]


@pytest.mark.timeout(10)
def test_the_rendezvous_exit_code_ends_the_agent_and_stops_its_workers(tmp_path) -> None:
    cause = FailureCause(rank=3, exit_code=7, message="ValueError: elsewhere", node="n2")
    rdzv = FakeRendezvous(
        [Run(rnd(1, "n1", "n2")), Exit(7, "job failed: restarts_exhausted", cause)]
    )
    runner = FakeRunner([None])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 7
    assert runner.stops and not runner.running


@pytest.mark.timeout(10)
def test_a_stop_halts_the_workers_and_a_later_round_starts_them_again(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1")), Stop("too few nodes"), Run(rnd(3, "n1"))])
    runner = FakeRunner([None, finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert runner.rounds == [1, 3] and rdzv.closed == [3]


@pytest.mark.timeout(10)
def test_the_workers_keep_running_through_a_store_outage(tmp_path) -> None:
    outage = [StoreUnavailable("down")] * 3

    def flaky(running: int | None) -> Action:
        if outage:
            raise outage.pop()
        return Wait("training")

    rdzv = FakeRendezvous([Run(rnd(1, "n1")), flaky, flaky])
    rdzv.script.insert(2, flaky)
    rdzv.script.insert(2, flaky)
    runner = FakeRunner([None, None, None, None, None, finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert runner.stops == [0.0]  # stopped once, at the finish: never for the outage
    events = (tmp_path / "events.jsonl").read_text()
    assert '"store_unavailable"' in events and '"store_recovered"' in events


@pytest.mark.timeout(10)
def test_workers_that_cannot_start_are_one_clear_agent_error(tmp_path) -> None:
    from flexrun.errors import AgentError

    rdzv = FakeRendezvous([Run(rnd(1, "n1"))])
    runner = FakeRunner([])

    def no_fork(r: RoundRecord, master: MasterRecord | None) -> RoundStart | None:
        raise OSError(24, "Too many open files")

    runner.run_round = no_fork  # type: ignore[method-assign]
    agent, _ = make(tmp_path, rdzv, runner)
    with pytest.raises(AgentError, match="could not start the workers of round 1"):
        agent.run()
    assert rdzv.left and runner.closed


@pytest.mark.timeout(10)
def test_workers_still_running_when_the_job_finished_elsewhere_get_a_bounded_wait(
    tmp_path,
) -> None:
    """A round formed as the job ended never trains (its peers are gone): its workers get
    FINISH_WAIT_S to end by themselves, then they are stopped and the agent exits 0,
    instead of waiting for them (torch's own store timeout: 300 s)."""
    from flexrun.agent.agent import FINISH_WAIT_S, STOP_GRACE_S

    rdzv = FakeRendezvous([Run(rnd(2, "n1", "n2")), Exit(0, "job finished by an earlier round")])
    runner = FakeRunner([])  # the new worker never ends by itself
    agent, clock = make(tmp_path, rdzv, runner)
    t0 = clock.monotonic()
    assert agent.run() == 0
    waited = clock.monotonic() - t0
    assert FINISH_WAIT_S <= waited < FINISH_WAIT_S + 1.0
    assert runner.stops == [STOP_GRACE_S]


@pytest.mark.timeout(10)
def test_workers_finishing_the_same_training_as_the_job_are_not_cut_short(tmp_path) -> None:
    """A live survivor whose peer closed the job a step earlier: its workers end within
    the wait, and the agent exits as soon as they have."""
    from flexrun.agent.agent import FINISH_WAIT_S

    rdzv = FakeRendezvous([Run(rnd(2, "n1", "n2")), Exit(0, "job finished by an earlier round")])
    runner = FakeRunner([None, None, finished()])
    agent, clock = make(tmp_path, rdzv, runner)
    t0 = clock.monotonic()
    assert agent.run() == 0
    assert clock.monotonic() - t0 < FINISH_WAIT_S / 2
    assert not runner.events  # it polled them to their end


def _unparsable(running: int | None) -> Action:
    raise RendezvousError("corrupt round record in the store: Expecting value")


@pytest.mark.timeout(10)
def test_a_record_that_does_not_parse_is_reported_and_read_again_not_an_exit(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1")), _unparsable, _unparsable, _unparsable])
    runner = FakeRunner([None, None, None, None, finished()])
    agent, _ = make(tmp_path, rdzv, runner)
    assert agent.run() == 0
    assert runner.rounds == [1] and rdzv.closed == [1]
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    rejected = [e for e in map(json.loads, lines) if e["event"] == "store_record_rejected"]
    assert len(rejected) == 1 and rejected[0]["key"] == "rendezvous"  # (once: rate-limited)


@pytest.mark.timeout(10)
def test_a_record_that_never_parses_ends_the_agent_after_the_join_timeout(tmp_path) -> None:
    rdzv = FakeRendezvous([Run(rnd(1, "n1"))] + [_unparsable] * 1000)
    runner = FakeRunner([None] * 1000)
    agent, clock = make(tmp_path, rdzv, runner)
    with pytest.raises(RendezvousError, match="corrupt round record"):
        agent.run()
    assert clock.monotonic() >= RendezvousSettings().join_timeout_s


def _finished_with_lost(tmp_path, lost: float) -> dict:
    rdzv = FakeRendezvous([Run(rnd(1, "n1"))])
    runner = FakeRunner([None, None, p.LiveFinished()], start=RoundStart.FRESH)
    agent, clock = make(tmp_path, rdzv, runner)
    runner.first_step, runner.lost = clock.monotonic(), lost
    scripted = runner.poll

    def poll() -> p.Event | None:
        clock.advance(10.0)  # (each poll: 10 s of training)
        return scripted()

    runner.poll = poll  # type: ignore[method-assign]
    assert agent.run() == 0
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return next(e for e in map(json.loads, lines) if e["event"] == "job_finished")


@pytest.mark.timeout(10)
def test_the_time_live_workers_lost_comes_off_the_jobs_productive_time(tmp_path) -> None:
    """Live mode's pauses and slowed steps do not stop a round; what the workers judged
    lost (LiveRunner.lost_s) is taken off the productive time, so off the ETTR."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    clean, hit = _finished_with_lost(tmp_path / "a", 0.0), _finished_with_lost(tmp_path / "b", 4.0)
    assert clean["lost_s"] == 0.0 and hit["lost_s"] == 4.0
    assert clean["productive_s"] >= 29.0 and hit["wall_s"] == clean["wall_s"]
    assert hit["productive_s"] == pytest.approx(clean["productive_s"] - 4.0)
    assert hit["ettr"] == round(hit["productive_s"] / hit["wall_s"], 4) < clean["ettr"]
