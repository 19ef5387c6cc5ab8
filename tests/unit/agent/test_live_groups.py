"""Sharded live mode at the agent: a replica group (``--live-shards S`` consecutive slots) is
the unit of failure, enters an epoch whole, and gets a new id when it is replaced.

Fake processes (see test_runners), the in-memory store: milliseconds per test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_runners import FakePool, epoch, events_of, live_runner, rnd

from flexrun.agent import policy as p
from flexrun.agent.live import LiveRunner
from flexrun.agent.live_groups import ReplicaGroups
from flexrun.config import RendezvousSettings
from flexrun.errors import ConfigError
from flexrun.live_protocol import LiveKeys, mark_state, touch_heartbeat
from flexrun.testing import MemoryStore
from flexrun.testing.config import run_config


def sharded_runner(tmp_path: Path, pool: FakePool) -> tuple[LiveRunner, MemoryStore, Path]:
    return live_runner(tmp_path, pool, mode="live", live_shards=2, nproc_per_node=4)


def _env(pool: FakePool, k: int) -> dict[str, str]:
    return json.loads(pool.taken[k].proc.stdin.sent)["env"]  # type: ignore[union-attr]


@pytest.mark.timeout(20)
def test_a_dead_shard_takes_its_group_out_and_a_new_group_replaces_it(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, store, run_dir = sharded_runner(tmp_path, pool)
    runner.run_round(rnd(1, ("n1", 4)), None)
    groups = [(_env(pool, k)["FLEXRUN_LIVE_GROUP"], _env(pool, k)["FLEXRUN_LIVE_SHARD"])
              for k in range(4)]  # fmt: skip
    assert groups[0][0] == groups[1][0] != groups[2][0] == groups[3][0]
    assert [s for _, s in groups] == ["0", "1", "0", "1"]
    assert {_env(pool, k)["FLEXRUN_LIVE_SHARDS"] for k in range(4)} == {"2"}
    for lw in runner.slots.values():
        touch_heartbeat(lw.heartbeat)
        mark_state(lw.heartbeat)
    store.put(LiveKeys("job").formed, b"1")
    keep = [runner.slots[s].worker for s in (0, 1)]
    mate = runner.slots[2].worker
    runner.slots[3].worker.proc.end(-9)  # type: ignore[attr-defined]

    ev = runner.poll()

    assert isinstance(ev, p.LiveFailed) and [c.worker_id for c in ev.causes] == ["n1.w4"]
    assert mate not in [lw.worker for lw in runner.slots.values()], "the group-mate stayed"
    assert [runner.slots[s].worker for s in (0, 1)] == keep, "the healthy group was touched"
    assert len(pool.taken) == 6
    new = [_env(pool, k) for k in (4, 5)]
    assert {e["FLEXRUN_LIVE_GROUP"] for e in new} == {new[0]["FLEXRUN_LIVE_GROUP"]}
    assert new[0]["FLEXRUN_LIVE_GROUP"] not in {g for g, _ in groups}
    assert sorted(e["FLEXRUN_LIVE_SHARD"] for e in new) == ["0", "1"]
    rec = epoch(store)  # (the healthy group goes on alone: the new one is not in the loop yet)
    assert rec.number == 2 and rec.abort and rec.members == ("n1.w1", "n1.w2")
    dropped = [e for e in events_of(run_dir) if e["event"] == "live_group_dropped"]
    assert len(dropped) == 1 and dropped[0]["killed"] == [2] and dropped[0]["cause"] == ["n1.w4"]
    touch_heartbeat(runner.slots[2].heartbeat)  # (one of the new group reached the loop)
    assert runner.poll() is None and epoch(store).number == 2
    touch_heartbeat(runner.slots[3].heartbeat)  # (and its mate: the group joins, whole)
    assert runner.poll() is None
    rec = epoch(store)
    assert rec.number == 3 and not rec.abort and len(rec.members) == 4
    assert not {"n1.w3", "n1.w4"} & set(rec.members)
    runner.close()
    assert mate.proc.poll() is not None, "the killed group-mate was never reaped"


@pytest.mark.timeout(20)
def test_two_deaths_in_one_group_are_one_failure_its_signalled_one(tmp_path: Path) -> None:
    pool = FakePool(tmp_path)
    runner, store, _ = sharded_runner(tmp_path, pool)
    runner.run_round(rnd(1, ("n1", 4)), None)
    store.put(LiveKeys("job").formed, b"1")
    for lw in runner.slots.values():
        touch_heartbeat(lw.heartbeat)
        mark_state(lw.heartbeat)
    runner.slots[0].worker.proc.end(1)  # type: ignore[attr-defined]  # (saw its peer reset)
    runner.slots[1].worker.proc.end(-9)  # type: ignore[attr-defined]
    ev = runner.poll()
    assert isinstance(ev, p.LiveFailed)
    assert [(c.worker_id, c.signal) for c in ev.causes] == [("n1.w2", "SIGKILL")]
    runner.close()


def test_a_group_enters_an_epoch_whole_or_not_at_all() -> None:
    g = ReplicaGroups("n", 4, 2)
    assert g.admitted({0: True, 1: True, 2: True, 3: False}) == {0, 1}
    assert g.admitted({0: True, 2: True, 3: True}) == {2, 3}  # (slot 1 empty)
    assert ReplicaGroups("n", 4, 1).admitted({0: True, 1: False}) == {0}


def test_live_shards_must_divide_the_node_and_apply_to_live_mode_only(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    base = {"entrypoint": str(script), "run_dir": tmp_path / "r",
            "rendezvous": RendezvousSettings()}  # fmt: skip
    with pytest.raises(ConfigError, match="must divide --nproc-per-node 4"):
        run_config(**base, nproc_per_node=4, mode="live", live_shards=3)
    with pytest.raises(ConfigError, match="applies to --mode live only"):
        run_config(**base, nproc_per_node=4, mode="restart", live_shards=2)
    with pytest.raises(ConfigError, match="--live-shards 0"):
        run_config(**base, nproc_per_node=4, mode="live", live_shards=0)
    assert run_config(**base, nproc_per_node=4, mode="live", live_shards=4).live_shards == 4
