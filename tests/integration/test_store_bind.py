"""Issue 18 point 2: a ``--standalone`` agent's own rendezvous store listens on loopback
only (it bound every interface: torch's ``TCPStore`` server ignores the host). The worker
looks at what its agent process listens on, as the kernel reports it."""

from __future__ import annotations

import json

import pytest
from support import Procs, wait_for

SCRIPT = """
import json, sys, psutil
agents = [p for p in psutil.Process().parents() if "flexrun" in " ".join(p.cmdline())]
addrs = sorted({c.laddr.ip for a in agents for c in a.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN})
open(sys.argv[1], "w").write(json.dumps({"agents": len(agents), "addrs": addrs}))
"""


@pytest.mark.timeout(180)
def test_a_standalone_agents_store_listens_on_loopback_only(procs: Procs) -> None:
    (procs.tmp / "look.py").write_text(SCRIPT)
    out = procs.tmp / "listening.json"
    p = procs.start(["run", "--standalone", "look.py", str(out)], name="a")
    assert p.wait(timeout=150) == 0, procs.stderr("a")
    got = json.loads(out.read_text())
    assert got["agents"] >= 1, got
    assert got["addrs"] and set(got["addrs"]) <= {"127.0.0.1", "::1"}, got


@pytest.mark.timeout(120)
def test_flexrun_store_listens_on_loopback_unless_given_a_host(procs: Procs) -> None:
    import psutil

    p = procs.start(["store", "--port", "0"], name="store")
    wait_for(lambda: "listening" in (procs.tmp / "store.out").read_text(), 60, "the store")
    assert "listening on 127.0.0.1:" in (procs.tmp / "store.out").read_text()
    addrs = {
        c.laddr.ip
        for c in psutil.Process(p.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert addrs and addrs <= {"127.0.0.1"}, addrs
