"""Issue 18 point 2: a ``--standalone`` agent's own rendezvous store listens on loopback
only (it bound every interface: torch's ``TCPStore`` server ignores the host). The worker
looks at what its agent process listens on, as the kernel reports it."""

from __future__ import annotations

import json

import pytest
from support import Procs

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
