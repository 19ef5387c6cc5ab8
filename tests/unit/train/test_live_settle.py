"""live_settle.settle on a real 2-process gloo group: a replica group steps the optimizer
only when every member saw the step's vote complete, whatever the order they arrive in."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _member(
    store: str, rank: int, votes: list[bool], delay_s: float, leave: bool, q: mp.Queue
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from flexrun.train.live_settle import settle

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))  # fmt: skip
    if leave:
        q.put((rank, "left"))
        return  # (the process ends: its side of the group closes)
    out = []
    for v in votes:
        time.sleep(delay_s)
        t0 = time.monotonic()
        out.append((settle(voted=v), round(time.monotonic() - t0, 3)))
    q.put((rank, out))


def _run(tmp: Path, a: dict, b: dict) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = str(tmp / "store")
    procs = [ctx.Process(target=_member, args=(store, r, kw["votes"], kw.get("delay_s", 0.0),
                                               kw.get("leave", False), q))
             for r, kw in enumerate((a, b))]  # fmt: skip
    for p in procs:
        p.start()
    got = dict(q.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, p.exitcode
    return got


def test_both_step_only_when_both_saw_the_vote_and_a_late_mate_is_waited_for(
    tmp_path: Path,
) -> None:
    """Step 1: both voted; step 2: the mate's vote was abandoned (an aborting epoch), so
    neither steps; step 3: the mate arrives 1 s late (it was still waiting for its vote)
    and the first waits for it instead of leaving on its own."""
    got = _run(tmp_path, {"votes": [True, True, True]},
               {"votes": [True, False, True], "delay_s": 0.5})  # fmt: skip
    for rank in (0, 1):
        assert [ok for ok, _ in got[rank]] == [True, False, True], got
    assert all(waited >= 0.3 for _, waited in got[0]), got  # (rank 0 waited for the late mate)


def test_a_mate_that_is_gone_reads_as_not_settled(tmp_path: Path) -> None:
    got = _run(tmp_path, {"votes": [True], "delay_s": 1.0}, {"votes": [], "leave": True})
    assert got[1] == "left" and [ok for ok, _ in got[0]] == [False], got
