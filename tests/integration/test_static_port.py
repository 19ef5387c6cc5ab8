"""A static job needs only the master port it is given, as torchrun's (issue 33, "a busy
port"): node rank 0's agent hosts one store there, flexrun's records and the workers' keys
side by side. An unrelated process on the master port + 1 changes nothing; one on the
master port itself is one line naming the port and what holds it, exit 2, instead of a
30 s wait and a C++ backtrace, or a hang when the squatter accepts and never answers.
Between rounds node rank 0 empties the store of the earlier workers' keys (torch's put no
per-round prefix on them), so a restarted world meets in it as in a fresh one.
"""

from __future__ import annotations

import os
import socket

import pytest
from support import Procs, free_port, read_progress
from test_static import start_node, steps


def _squatted(offset: int) -> tuple[int, socket.socket]:
    """A free master port P and a socket listening on P + ``offset`` that never answers
    (on every interface, as an unrelated server would)."""
    for _ in range(50):
        port = free_port()
        squatter = socket.socket()
        try:
            squatter.bind(("0.0.0.0", port + offset))
        except OSError:
            squatter.close()
            continue
        squatter.listen(8)
        return port, squatter
    raise AssertionError("no free pair of ports")


@pytest.mark.timeout(240)
def test_a_squatter_on_the_port_after_the_master_changes_nothing(procs: Procs) -> None:
    port, squatter = _squatted(1)
    progress, ckpt = procs.tmp / "progress.jsonl", procs.tmp / "ckpt.pt"
    script = steps(progress, ckpt, 8)
    try:
        nodes = [start_node(procs, port, r, script) for r in (1, 0)]
        codes = [p.wait(timeout=180) for p in nodes]
    finally:
        squatter.close()
    for code, name in zip(codes, ("node1", "node0"), strict=True):
        err = procs.stderr(name)
        assert code == 0, err[-3000:]
        assert "Traceback" not in err and "frame #" not in err, err[-3000:]
    rows = read_progress(progress)
    assert {r["rank"] for r in rows if r["step"] == 7} == {0, 1}
    assert {r["world"] for r in rows} == {2}


@pytest.mark.timeout(120)
def test_a_squatter_on_the_master_port_is_one_clear_line_naming_it(procs: Procs) -> None:
    port, squatter = _squatted(0)
    try:
        node0 = start_node(procs, port, 0, steps(procs.tmp / "p.jsonl", procs.tmp / "ck", 5))
        code = node0.wait(timeout=90)
        err = procs.stderr("node0")
    finally:
        squatter.close()
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if f"port {port}" in line]
    assert len(lines) == 1, err[-2000:]
    assert f"process {os.getpid()}" in lines[0], lines[0]  # psutil named this test's process
    assert "Traceback" not in err and "frame #" not in err, err[-2000:]


@pytest.mark.timeout(300)
def test_a_restarted_world_meets_in_the_one_store_without_the_dead_worlds_keys(
    procs: Procs,
) -> None:
    # Rank 1 fails at step 3 of the first attempt, after the gloo world formed (its keys,
    # each rank's address among them, are in the store): the second world must not find them.
    port = free_port()
    progress, ckpt = procs.tmp / "progress.jsonl", procs.tmp / "ckpt.pt"
    script = [*steps(progress, ckpt, 8), "--fail-rank", "1", "--fail-once-at", "3",
              "--late-restart", "3"]  # fmt: skip
    nodes = [start_node(procs, port, r, script, "--max-restarts", "1") for r in (1, 0)]
    for p, name in zip(nodes, ("node1", "node0"), strict=True):
        assert p.wait(timeout=240) == 0, procs.stderr(name)[-3000:]
    rows = read_progress(progress)
    assert len({r["attempt"] for r in rows}) == 2, rows  # the first world and the restarted one
    assert {r["rank"] for r in rows if r["step"] == 7} == {0, 1}
