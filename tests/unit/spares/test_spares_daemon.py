"""SparesDaemon with fake spares, served by a thread: hand-overs, exit records, refills, the
warm agent's hand-over, and hostile requests that never crash it or stall it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spares_support import Served
from squatter_support import chown_nobody, need_root_and_nobody, nobody_python
from support import wait_for

from flexrun.errors import ConfigError, SparesUntrusted
from flexrun.proc import Worker
from flexrun.spares.adopted import AdoptedProcess
from flexrun.spares.client import query_status, take_spares
from flexrun.spares.daemon import SparesDaemon
from flexrun.spares.listener import Listener
from flexrun.spares.pool import WarmPool, assign
from flexrun.spares.protocol import MAX_LINE, REQUEST_TIMEOUT_S, Request, read_line

pytestmark = pytest.mark.timeout(60)


def _ask(root: Path, data: bytes) -> dict:
    """Send raw bytes to the daemon; its one-line answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(root / "pool.sock"))
        s.sendall(data)
        if not data.endswith(b"\n"):
            s.shutdown(socket.SHUT_WR)  # (the end of the stream ends the request)
        return dict(json.loads(read_line(s)))


def _run(w: Worker, code: int, tmp: Path) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "exit.py"
    script.write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    assign(
        w,
        env=dict(os.environ),
        entry=str(script),
        args=[str(code)],
        module=False,
        rank=0,
        local_rank=0,
        log_dir=tmp / "rank_0",
    )


def test_taken_spares_are_the_daemons_and_their_exit_codes_come_back(
    served: Served, tmp_path: Path
) -> None:
    served.wait_ready(2)
    ready_pids = {int(f.read_text()) for f in (served.root / "spares").glob("*.ready")}
    taken = take_spares(served.root, 2)
    assert {a.worker.proc.pid for a in taken} == ready_pids
    assert all(isinstance(a.worker.proc, AdoptedProcess) for a in taken)
    for a, code in zip(taken, (0, 5), strict=True):
        _run(a.worker, code, tmp_path / str(code))
    assert [a.worker.proc.wait(timeout=30) for a in taken] == [0, 5]
    status = served.wait_ready(2)  # refilled (refill delay 0)
    assert status["handed_out"] == 0


def test_an_agent_pool_takes_from_the_node_first(served: Served, tmp_path: Path) -> None:
    served.wait_ready(2)
    pool = WarmPool(
        3,
        os.environ,
        tmp_path / "own",
        node=served.root,
        spare_command=[sys.executable, "-c", "import sys; sys.stdin.read()"],
    )
    try:
        pool.fill()
        kinds = sorted(type(w.proc).__name__ for w, _ in pool.spares)
        assert kinds == ["AdoptedProcess", "AdoptedProcess", "Popen"]
    finally:
        pool.close()


def test_a_taker_of_another_python_gets_nothing(served: Served) -> None:
    served.wait_ready(2)
    reply = _ask(served.root, Request(op="take", count=1, interpreter="/other/python").encode())
    assert "not taken" in reply["error"]
    assert query_status(served.root)["ready"] == 2


@pytest.mark.parametrize(
    "data",
    [
        b"[1, 2, 3]\n",
        b'"status"\n',
        b"null\n",
        b'{"op": 5}\n',
        b'{"op": "take", "count": "all", "interpreter": "x"}\n',
        b'{"op": "take", "count": -1, "interpreter": "x"}\n',
        b'{"op": "take_agent", "interpreter": {"a": 1}}\n',
        b"{\"op\": \"__import__('os').system('id')\"}\n",
        b"\x80\x04\x95garbage pickle\x00\xff\n",
        b"[" * 60_000 + b"\n",
        b"x" * (MAX_LINE + 10),
        b'{"op": "status"',  # half a line, then the end of the stream
    ],
    ids=lambda data: repr(data[:24]),
)
def test_a_hostile_request_is_answered_with_an_error_and_the_daemon_serves_on(
    served: Served, data: bytes
) -> None:
    served.wait_ready(2)
    reply = _ask(served.root, data)
    assert set(reply) == {"error"} and reply["error"], reply
    assert served.thread.is_alive()
    assert query_status(served.root)["ready"] == 2
    assert len(take_spares(served.root, 1)) == 1


def test_a_client_that_never_sends_neither_stalls_others_nor_stays(served: Served) -> None:
    served.wait_ready(2)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.settimeout(10)
    silent.connect(str(served.root / "pool.sock"))
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.connect(str(served.root / "pool.sock"))
    gone.close()  # connects and leaves without a word
    with silent:
        for _ in range(3):
            assert query_status(served.root)["ready"] == 2  # served meanwhile
        served.clock.advance(REQUEST_TIMEOUT_S + 0.1)
        reply = json.loads(read_line(silent))
    assert "no request within" in reply["error"]
    assert served.thread.is_alive()


def test_an_idle_spare_that_dies_is_replaced_after_the_retry_delay(served: Served) -> None:
    served.wait_ready(2)
    victim = served.daemon.idle[0].proc.pid
    os.kill(victim, 9)

    def idle() -> int:
        s = query_status(served.root)
        return int(s["ready"] + s["booting"])

    wait_for(lambda: idle() == 1, 20, "the daemon to notice", interval=0.01)
    served.clock.advance(1.1)  # BOOT_RETRY_S starts at 1 s (on the daemon's clock)
    served.wait_ready(2)


def test_a_flexrun_run_hands_itself_to_a_warm_agent(tmp_path: Path) -> None:
    s = Served(tmp_path / "spares", count=1, agents=1)
    try:
        s.wait_ready(1, agents=1)
        work = tmp_path / "work"
        work.mkdir()
        client = (
            "import sys; from pathlib import Path; "
            "from flexrun.spares.client import run_in_warm_agent; "
            f"sys.exit(run_in_warm_agent(Path({str(s.root)!r}), ['4', 'x.py']))"
        )
        res = subprocess.run(
            [sys.executable, "-c", client],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "MARKER": "m1"},
        )
        assert res.returncode == 4, res.stderr
        got = json.loads(res.stdout)  # the agent wrote to the client's own stdout
        assert got == {"argv": ["4", "x.py"], "cwd": str(work), "marker": "m1"}
        assert query_status(s.root)["agents_ready"] in (0, 1)  # being refilled
    finally:
        s.close()


def test_the_daemon_refuses_an_unsafe_directory_and_a_second_daemon(tmp_path: Path) -> None:
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    os.chmod(wide, 0o755)
    link = tmp_path / "link"
    link.symlink_to(wide)
    for root, needle in ((wide, "mode 0755"), (link, "is a symlink")):
        with pytest.raises(SparesUntrusted, match=needle):
            SparesDaemon(root, 1, environ={})
    assert not (wide / "pool.sock").exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SparesUntrusted, match="is not a directory"):
        SparesDaemon(afile, 1, environ={})
    s = Served(tmp_path / "spares", count=1)
    try:
        with pytest.raises(ConfigError, match="already serves"):
            SparesDaemon(s.root, 1, environ={})
        s.wait_ready(1)  # untouched
    finally:
        s.close()


def test_a_client_of_another_uid_is_refused_by_the_listener(tmp_path: Path) -> None:
    need_root_and_nobody()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    chown_nobody(open_dir)  # (only so the stranger can reach the socket at all)
    listener = Listener(open_dir / "pool.sock")
    os.chmod(
        open_dir / "pool.sock", 0o666
    )  # (as if its directory's mode were all that kept strangers out)
    stranger = (
        "import contextlib, socket; s = socket.socket(socket.AF_UNIX); s.connect('pool.sock')\n"
        'with contextlib.suppress(OSError): s.sendall(b\'{"op": "status"}\\n\')\n'
        "print(s.recv(4096).decode())"
    )
    try:
        p = subprocess.Popen(
            [str(nobody_python()), "-I", "-S", "-c", stranger],
            cwd=open_dir,
            user="nobody",
            extra_groups=[],
            stdout=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while p.poll() is None and time.monotonic() < deadline:
            assert listener.poll(0.05) == []  # nothing of a stranger reaches the daemon
        out, _ = p.communicate(timeout=30)
    finally:
        listener.close()
    assert f"only uid {os.geteuid()} may use these spares" in json.loads(out)["error"]
