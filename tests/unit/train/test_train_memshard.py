"""The memory tier of sharded state in one process: the step every rank agrees on, a rank's
copy encoded and verified, and ShardedCheckpointer saving every step to memory and every
``durable_every``-th durably, loading the newest verified copy and skipping a corrupt one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.events import read_events
from flexrun.train import ShardedCheckpointer
from flexrun.train.context import single_process_context
from flexrun.train.memload import decode
from flexrun.train.memsave import copy_steps, write_copy
from flexrun.train.memshard import OBJECTS, common_step, from_local, to_local


def test_the_common_step_is_the_newest_every_rank_holds() -> None:
    assert common_step([[3, 4], [3, 4]], None) == 4
    assert common_step([[3, 4], [3]], None) == 3  # rank 1's copy of 4 is missing or corrupt
    assert common_step([[4, 5], [3, 4]], 2) == 4
    assert common_step([[4], [3]], None) is None  # no step in common: durable
    assert common_step([[3, 4], []], None) is None  # a rank without copies: durable
    assert common_step([[3, 4], [3, 4]], 5) is None  # durable storage is newer
    assert common_step([[3, 4], [3, 4]], 4) == 4  # same step: memory is the faster read
    assert common_step([], None) is None


def test_a_ranks_state_round_trips_through_a_verified_copy(tmp_path: Path) -> None:
    state = {
        "model": {"w": torch.randn(3, 2), "b": torch.arange(4)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
    }
    write_copy(tmp_path, 7, {OBJECTS: to_local(state)})
    blob = (tmp_path / "step_7.mem").read_bytes()
    back = from_local(decode(blob, what="copy")[OBJECTS], state)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["model"]["b"], state["model"]["b"])
    assert back["optim"]["param_groups"] == [{"lr": 0.1}]
    assert torch.equal(back["optim"]["state"]["w"]["step"], torch.tensor(3.0))
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode(bytes(flipped), what="copy")


def _setup(tmp: Path, seed: int = 0) -> tuple[ShardedCheckpointer, torch.nn.Module, Any]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(6, 4)
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    ctx = single_process_context(run_dir=str(tmp / "run"))
    c = ShardedCheckpointer(tmp / "ck", ctx=ctx, durable_every=5, memory_dir=str(tmp / "shm"))
    c.register("model", m)
    c.register("optim", o)
    return c, m, o


def _train(tmp: Path, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    c, m, o = _setup(tmp)
    states = {}
    for s in range(1, steps + 1):
        m(torch.randn(3, 6)).pow(2).sum().backward()
        o.step()
        o.zero_grad()
        c.save(s, extra={"step": s})
        states[s] = {k: v.clone() for k, v in m.state_dict().items()}
    return states


def _events(tmp: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp / "run") if e["event"] == name]


def test_saves_go_to_memory_every_step_and_durably_every_nth(tmp_path: Path) -> None:
    states = _train(tmp_path, 7)
    c, m, o = _setup(tmp_path, seed=1)
    assert c.steps() == [1, 6]
    assert copy_steps(next((tmp_path / "shm").glob("ckpt-*-sharded/rank_0"))) == [6, 7]
    loaded = c.load()
    assert loaded is not None and loaded.step == 7 and loaded.extra == {"step": 7}
    for k, v in m.state_dict().items():
        assert torch.equal(v, states[7][k]), k
    assert o.state and all(int(st["step"]) == 7 for st in o.state.values())
    last = _events(tmp_path, "checkpoint_loaded")[-1]
    assert last["restored_from"] == "memory" and last["step"] == 7, last


def test_a_corrupt_copy_is_skipped_and_the_one_before_loaded(tmp_path: Path) -> None:
    states = _train(tmp_path, 7)
    newest = next((tmp_path / "shm").glob("ckpt-*-sharded/rank_0/step_7.mem"))
    blob = bytearray(newest.read_bytes())
    blob[len(blob) // 3] ^= 0x10
    newest.write_bytes(bytes(blob))
    c, m, _ = _setup(tmp_path, seed=1)
    loaded = c.load()
    assert loaded is not None and loaded.step == 6
    for k, v in m.state_dict().items():
        assert torch.equal(v, states[6][k]), k
    skipped = _events(tmp_path, "checkpoint_memory_skipped")
    assert [e["step"] for e in skipped] == [7] and "checksum mismatch" in skipped[0]["reason"], skipped
    assert _events(tmp_path, "checkpoint_loaded")[-1]["restored_from"] == "memory"


def test_a_newer_durable_step_wins_over_memory(tmp_path: Path) -> None:
    _train(tmp_path, 7)
    for p in (tmp_path / "shm").glob("ckpt-*-sharded/rank_0/step_*.mem"):
        p.unlink()
    c, _, _ = _setup(tmp_path, seed=1)
    loaded = c.load()
    assert loaded is not None and loaded.step == 6
    assert _events(tmp_path, "checkpoint_loaded")[-1].get("restored_from") != "memory"


def test_without_a_memory_directory_every_save_is_durable(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2)
    ctx = single_process_context(run_dir=str(tmp_path / "run"))
    c = ShardedCheckpointer(tmp_path / "ck", ctx=ctx, durable_every=5, keep_last=10)
    c.register("model", m)
    for s in (1, 2, 3):
        c.save(s)
    assert c.steps() == [1, 2, 3]
    assert _events(tmp_path, "checkpoint_memory_off"), "the tier said nothing"


def test_a_copy_of_other_sharding_is_refused() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from flexrun.train.memshard import layout

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).reshape(4, 3)
        sharded = {"w": distribute_tensor(full, mesh, [Shard(0)])}
        replicated = {"w": distribute_tensor(full, mesh, [Replicate()])}
        assert layout(sharded) != layout(replicated)
        assert layout(sharded) == layout({"w": distribute_tensor(full * 2, mesh, [Shard(0)])})
        saved = to_local(sharded)
        assert type(saved["w"]) is torch.Tensor
        back = from_local(saved, sharded)
        assert torch.equal(back["w"].full_tensor(), full)
        assert back["w"].placements == (Shard(0),)
        with pytest.raises(CheckpointError, match="another sharding"):
            from_local({"w": torch.zeros(2, 3)}, sharded)
        with pytest.raises(CheckpointError, match="dtype"):
            from_local({"w": torch.zeros(4, 3, dtype=torch.float64)}, sharded)
    finally:
        dist.destroy_process_group()
