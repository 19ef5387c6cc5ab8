"""A static job whose store port (the master port + 1) is held by something that is not a
store (issue 33, "a busy port"): node rank 0's agent says so in one line naming the port
and what holds it, and exits 2, instead of silently using the squatter as its store (a
30 s wait and a C++ backtrace, or a hang when the squatter accepts and never answers)."""

from __future__ import annotations

import os
import socket

import pytest
from support import Procs, free_port
from test_static import start_node, steps


def _port_pair() -> tuple[int, socket.socket]:
    """A free master port P and a socket listening on P + 1 that never answers."""
    for _ in range(50):
        port = free_port()
        squatter = socket.socket()
        try:
            squatter.bind(("0.0.0.0", port + 1))
        except OSError:
            squatter.close()
            continue
        squatter.listen(8)
        return port, squatter
    raise AssertionError("no free pair of ports")


@pytest.mark.timeout(120)
def test_a_squatter_on_the_store_port_is_one_clear_line_naming_it(procs: Procs) -> None:
    port, squatter = _port_pair()
    try:
        node0 = start_node(procs, port, 0, steps(procs.tmp / "p.jsonl", procs.tmp / "ck", 5))
        code = node0.wait(timeout=90)
        err = procs.stderr("node0")
    finally:
        squatter.close()
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if f"port {port + 1}" in line]
    assert len(lines) == 1, err[-2000:]
    assert f"process {os.getpid()}" in lines[0], lines[0]  # psutil named this test's process
    assert "Traceback" not in err and "frame #" not in err, err[-2000:]
