"""Sharded live mode with real processes: 2 replica groups x 2 FSDP2 shards on CPU/gloo.

A kill -9 or a SIGSTOP of one shard worker takes its group out; the other group keeps its
processes and commits the step alone, with the lost group's portion of the batch (it keeps
the gradient of its own); a new group (warm spares) joins at a step boundary once its
script reaches the loop, taking each shard's model and optimizer state from the healthy
group's same shard, and the run ends bitwise equal to one without the failure (at two
groups, a step's gradient is the same sum of two portions whoever computed them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from live_support import (
    HB,
    assert_at_most_step_in_flight_redone,
    assert_every_sample_once_per_data_epoch,
    spare_ready,
    step_rows,
    wait_step,
)
from support import Procs, SharedRuns, read_events, wait_for

from flexrun.testing.shard_states import read_shards, same_state

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_live_hsdp.py"
STEPS = 160
BATCH, DATA = 32, 1024


def start(
    procs: Procs, name: str, *extra: str, script: tuple[str, ...] = ()
) -> tuple[object, Path]:
    run = procs.tmp / name
    run.mkdir()
    agent = procs.start(
        ["run", "--standalone", "--nproc-per-node", "4", "--mode", "live", "--live-shards",
         "2", "--max-restarts", "5", "--rdzv-conf", HB, "--run-dir", str(run / "run"), *extra,
         str(EXAMPLE), "--steps", str(STEPS), "--step-time", "0.05", "--global-batch",
         str(BATCH), "--progress", str(run / "p.jsonl"), "--out", str(run / "out"), *script],
        name=name,
    )  # fmt: skip
    return agent, run


@pytest.fixture(scope="module")
def reference(shared_runs: SharedRuns) -> dict[int, list[dict]]:
    def make(procs: Procs) -> Path:
        agent, run = start(procs, "reference")
        assert procs.wait(agent, 240) == 0, procs.stderr("reference")[-3000:]  # type: ignore[arg-type]
        return run / "out"

    return read_shards(shared_runs.get("hsdp-reference", make))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill_9", "sigstop"])
def test_a_lost_shard_worker_costs_its_group_only_and_the_run_stays_bitwise_equal(
    procs: Procs, reference: dict[int, list[dict]], sig: signal.Signals
) -> None:
    assert sorted(reference) == [0, 1] and all(len(r) == 2 for r in reference.values())
    agent, run = start(procs, "hit", script=("--commits", str(procs.tmp / "hit" / "c.jsonl")))
    wait_step(run, 15)
    wait_for(lambda: spare_ready(run), 90, "warm spares to be ready")
    wait_for(lambda: len([p for p in run.rglob("spare-*.ready")]) >= 2, 90, "two warm spares")
    first = {r["rank"]: r["pid"] for r in step_rows(run) if r["epoch"] == 1}
    assert sorted(first) == [0, 1, 2, 3]
    t_hit = time.time()
    os.kill(first[3], sig)  # (shard 1 of the second group)
    assert max(r["step"] for r in step_rows(run)) < STEPS - 30, "hit too late to test"
    assert procs.wait(agent, 300) == 0, procs.stderr("hit")[-3000:]  # type: ignore[arg-type]

    rows = step_rows(run)
    late = {r["pid"] for r in rows if r["step"] >= STEPS - 3}
    assert {first[0], first[1]} <= late, "the healthy group's workers were restarted"
    assert not {first[2], first[3]} & late, "the hit group was not replaced"
    events = read_events(run / "run")
    dropped = [e for e in events if e["event"] == "live_group_dropped"]
    assert len(dropped) == 1 and dropped[0]["killed"] == [2], dropped
    if sig == signal.SIGSTOP:
        # Seen stopped (0.3 s), not waited out to the heartbeat timeout (3 s here).
        hang = [e for e in events if e["event"] == "hang_detected"]
        assert hang and hang[0]["why"].startswith("stopped by a signal"), hang
        assert hang[0]["ts"] - t_hit < 2.0, hang
    joined = [e for e in events if e["event"] == "live_joined" and e["epoch"] >= 2]
    alone = [e for e in joined if e["epoch"] == joined[0]["epoch"]]
    assert sorted(e["rank"] for e in alone) == [0, 1], alone  # (the healthy group, at once)
    assert all(e["world_size"] == 2 and e["source"] is None for e in alone), alone
    kept = {e["node"] for e in alone}
    new = [e for e in joined if e["node"] not in kept]
    assert sorted(e["rank"] for e in new) == [2, 3], joined  # (then the new group)
    assert all(e["source"] == 0 and e["step"] > 0 for e in new), new  # (from a peer)
    assert_at_most_step_in_flight_redone(run, recoveries=1)
    assert_every_sample_once_per_data_epoch(rows, global_batch=BATCH, dataset=DATA)
    # LiveLoop's on_commit: every step once per survivor, in order, though a body ran twice.
    commits = [json.loads(x) for x in (run / "c.jsonl").read_text().splitlines()]
    for pid in (first[0], first[1]):
        assert [c["step"] for c in commits if c["pid"] == pid] == list(range(STEPS)), pid
    for c in commits:  # (a commit follows its own step's body, on that rank)
        assert any(r["pid"] == c["pid"] and r["step"] == c["step"] and r["ts"] <= c["ts"]
                   for r in rows), c  # fmt: skip
    got = read_shards(run / "out")
    assert sorted(got) == [0, 1] and all(len(r) == 2 for r in got.values())
    for i in (0, 1):
        assert all(same_state(got[i][0], r) for r in got[i][1:]), f"shard {i}: replicas differ"
        assert same_state(got[i][0], reference[i][0]), (
            f"shard {i}: not bitwise equal to the reference"
        )


@pytest.mark.timeout(420)
def test_a_replacement_lost_during_the_recovery_is_replaced_again_and_nothing_torn_is_loaded(
    procs: Procs, reference: dict[int, list[dict]]
) -> None:
    """The new group's shard 1 is stopped the moment it starts (SIGSTOP, before it reaches
    the loop: the healthy group trains on alone meanwhile), so the agent takes that group
    out too; a third group (warm spares again) takes the state, and the run ends bitwise
    equal."""
    agent, run = start(procs, "twice", "--warm-spares", "4")  # (two groups' worth)
    wait_step(run, 15)
    wait_for(lambda: len(list(run.rglob("spare-*.ready"))) >= 4, 90, "four warm spares")
    first = {r["rank"]: r["pid"] for r in step_rows(run) if r["epoch"] == 1}
    t_kill = time.time()
    os.kill(first[3], signal.SIGKILL)
    victim = replacement(run, 3, after=t_kill)
    os.kill(victim, signal.SIGSTOP)
    assert procs.wait(agent, 300) == 0, procs.stderr("twice")[-3000:]  # type: ignore[arg-type]

    events = read_events(run / "run")
    started = [e for e in events if e["event"] == "worker_started" and e["pid"] == victim]
    joined = {e["node"] for e in events if e["event"] == "live_joined"}
    assert started and started[0]["worker_id"] not in joined, "stopped after it had joined"
    assert len([e for e in events if e["event"] == "live_group_dropped"]) == 2
    hang = [e for e in events if e["event"] == "hang_detected"]
    assert hang and hang[0]["why"].startswith("stopped by a signal"), hang
    assert not [e for e in events if e["event"] == "live_fallback"]
    rows = step_rows(run)
    assert {first[0], first[1]} <= {r["pid"] for r in rows if r["step"] >= STEPS - 3}
    assert_every_sample_once_per_data_epoch(rows, global_batch=BATCH, dataset=DATA)
    got = read_shards(run / "out")
    for i in (0, 1):
        assert len(got[i]) == 2, got.keys()
        assert all(same_state(reference[i][0], r) for r in got[i]), f"shard {i} differs"


@pytest.mark.timeout(420)
def test_the_sending_group_lost_during_the_transfer_resumes_from_the_durable_checkpoint_bitwise(
    procs: Procs, reference: dict[int, list[dict]]
) -> None:
    """Every group that held the state is lost, the second during the peer transfer: a kill
    -9 takes the second group out; the first group's source of shard 1 is slowed (stopped
    40 ms in every 60, never long enough to count as frozen) and killed, stopped, once a
    source has announced its transfer (``live_transfer_sending``). One shard's transfer may
    have completed, the epoch's cannot (shard 1's or the vote that closes them waits for
    the killed source), so no member of that epoch may count as holding state (nothing torn
    is loaded; without the vote a receiver with its shard ran its first FSDP all-gather
    beside a group-mate still waiting for its own, and the job hung): the replacements
    restore the newest durable checkpoint (the first group's shards, DCP through flexrun's
    commit) and the run ends bitwise equal."""
    ckpt = procs.tmp / "ckpt"
    agent, run = start(
        procs, "all", "--warm-spares", "4", script=("--ckpt-dir", str(ckpt), "--ckpt-every", "10")
    )
    wait_for(lambda: len(durable(ckpt)) >= 2, 120, "two durable checkpoints")
    wait_for(lambda: len(list(run.rglob("spare-*.ready"))) >= 4, 90, "four warm spares")
    first = {r["rank"]: r["pid"] for r in step_rows(run) if r["epoch"] == 1}
    t_kill = time.time()
    os.kill(first[3], signal.SIGKILL)
    hit = kill_while_sending(run, first[1], receiver=replacement(run, 3, after=t_kill))
    assert procs.wait(agent, 300) == 0, procs.stderr("all")[-3000:]  # type: ignore[arg-type]

    events = read_events(run / "run")
    joined = [e for e in events if e["event"] == "live_joined" and e["epoch"] == hit["epoch"]]
    assert not joined, f"the kill came after the transfer of epoch {hit['epoch']}: {joined}"
    fb = [e for e in events if e["event"] == "live_fallback"]
    assert fb and fb[0]["source"] == "durable checkpoint" and fb[0]["epoch"] > hit["epoch"], fb
    rows = step_rows(run)
    before = max(r["step"] for r in rows if r["ts"] < hit["ts"])  # (the healthy group's)
    assert fb[0]["step"] % 10 == 0 and 20 <= fb[0]["step"] <= before + 1, (fb, before)
    after = [r for r in rows if r["ts"] > fb[0]["ts"]]
    assert not {r["pid"] for r in after} & set(first.values()), "a lost worker trained again"
    assert min(r["step"] for r in after) == fb[0]["step"], "did not resume at the checkpoint"
    got = read_shards(run / "out")
    for i in (0, 1):
        assert len(got[i]) == 2 and all(same_state(reference[i][0], r) for r in got[i]), i


def replacement(run: Path, slot: int, *, after: float) -> int:
    """The pid of the worker started in ``slot`` after ``after`` (epoch seconds)."""

    def started() -> int | None:
        return next((e["pid"] for e in read_events(run / "run") if e["event"] == "worker_started"
                     and e["local_rank"] == slot and e["ts"] > after), None)  # fmt: skip

    return wait_for(started, 60, f"the replacement in slot {slot}", interval=0.005)


def kill_while_sending(run: Path, source: int, *, receiver: int) -> dict:
    """Kill -9 ``source`` (the healthy group's shard-1 worker) once a source of the new
    epoch has announced its transfer (``live_transfer_sending``), before that epoch can
    complete; returns the event. Source and ``receiver`` (shard 1's new replica) run in
    turns, 20 ms each and never together (each stopped well under the 0.3 s freeze rule):
    the epoch ends with a vote of all its members, which the receiver can only cast after
    it took the shard the source sends in its turn, so a source seen sending at the end of
    its turn has an epoch that cannot yet be whole. (Stopping the source alone let it
    catch up with members waiting for it and send and vote within one running slice.)"""

    def sending() -> dict | None:
        return next((e for e in read_events(run / "run") if e["event"] == "live_transfer_sending"
                     and e["ts"] > started), None)  # fmt: skip

    started, deadline = time.time(), time.monotonic() + 60
    hit, turn = None, [receiver, source]
    os.kill(source, signal.SIGSTOP)
    try:
        while hit is None and time.monotonic() < deadline:
            os.kill(turn[0], signal.SIGCONT)
            time.sleep(0.02)
            os.kill(turn[0], signal.SIGSTOP)
            hit = sending()  # (both stopped)
            turn.reverse()
        assert hit is not None, "no peer transfer within 60 s"
        os.kill(source, signal.SIGKILL)
    finally:
        for pid in (receiver, source):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    return hit


def durable(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit())
