"""This user only: the spares directory's owner and mode, and the uid of every socket's
server, are checked before anything is sent; a squatter of another uid receives nothing."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest
from squatter_support import chown_nobody, need_root_and_nobody, squatter

from flexrun.errors import SparesUntrusted
from flexrun.spares.client import query_status, run_in_warm_agent, take_spares
from flexrun.spares.protocol import encode, read_line
from flexrun.spares.trust import check_dir, check_peer, connect

pytestmark = pytest.mark.timeout(60)


def test_the_directory_is_created_0700_and_must_stay_so(tmp_path: Path) -> None:
    root = tmp_path / "a" / "spares"
    assert check_dir(root) is False  # absent: nobody serves it
    assert check_dir(root, create=True) is True
    assert root.stat().st_mode & 0o777 == 0o700
    os.chmod(root, 0o750)
    with pytest.raises(SparesUntrusted, match=r"has mode 0750: it must be 0700 \(chmod 700"):
        check_dir(root)
    with pytest.raises(SparesUntrusted, match="0750"):
        check_dir(root, create=True)  # refused, never "fixed"
    os.chmod(root, 0o700)
    link = tmp_path / "link"
    link.symlink_to(root)
    with pytest.raises(SparesUntrusted, match="is a symlink"):
        check_dir(link)
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(SparesUntrusted, match="is not a directory"):
        check_dir(afile, create=True)


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    need_root_and_nobody()
    root = tmp_path / "spares"
    root.mkdir(mode=0o700)
    chown_nobody(root)
    with pytest.raises(SparesUntrusted, match=r"belongs to uid \d+, not to you"):
        check_dir(root)
    for call in (lambda: take_spares(root, 1), lambda: query_status(root)):
        with pytest.raises(SparesUntrusted):
            call()


def test_a_peer_of_this_uid_passes_and_a_wrong_pid_does_not() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert check_peer(a, "x") == os.getpid()
        with pytest.raises(SparesUntrusted, match="not by pid 1 as offered"):
            check_peer(a, "x", pid=1)


def _squatted(tmp_path: Path) -> Path:
    """A directory that passes every check, with a pool.sock planted by user nobody while
    the directory was still nobody's."""
    root = tmp_path / "spares"
    root.mkdir(mode=0o700)
    chown_nobody(root)
    return root


def _reclaim(root: Path) -> None:
    os.chown(root, os.geteuid(), os.getegid())
    os.chmod(root, 0o700)
    assert check_dir(root)


def test_a_squatted_pool_sock_receives_nothing_from_any_client(tmp_path: Path) -> None:
    need_root_and_nobody()
    root = _squatted(tmp_path)
    with squatter(root) as sq:
        _reclaim(root)
        for call in (
            lambda: take_spares(root, 2),
            lambda: query_status(root),
            lambda: run_in_warm_agent(root, ["run", "--secret-flag", "x.py"]),
        ):
            with pytest.raises(SparesUntrusted, match=r"served by uid \d+, not by you .*nothing"):
                call()
        got = sq.received()
    assert got["connections"] == 3  # (connecting is how its uid is learnt)
    assert got == {"connections": 3, "bytes": 0, "fds": 0, "data": ""}


def test_a_warm_agent_socket_of_another_uid_is_refused_before_the_hand_over(
    tmp_path: Path,
) -> None:
    """The daemon is ours, the agent socket it names is a squatter's: no argv, environment
    or descriptors go to it."""
    need_root_and_nobody()
    root = tmp_path / "spares"
    check_dir(root, create=True)
    (root / "spares").mkdir(mode=0o700)
    chown_nobody(root / "spares")
    with squatter(root / "spares", "a1-1.sock") as sq:
        os.chown(root / "spares", os.geteuid(), os.getegid())
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(root / "pool.sock"))
        listener.listen(1)

        def fake_daemon() -> None:
            conn, _ = listener.accept()
            with conn:
                read_line(conn)
                offer = {"pid": sq.pid, "name": "a1-1", "socket": str(root / "spares/a1-1.sock")}
                conn.sendall(encode(offer))

        t = threading.Thread(target=fake_daemon, daemon=True)
        t.start()
        with pytest.raises(SparesUntrusted, match="warm agent socket .* served by uid"):
            run_in_warm_agent(root, ["run", "x.py"])
        t.join(timeout=10)
        listener.close()
        got = sq.received()
    assert got == {"connections": 1, "bytes": 0, "fds": 0, "data": ""}


def test_connect_returns_none_when_nothing_listens(tmp_path: Path) -> None:
    assert connect(tmp_path / "none.sock", "x", 1.0) is None
    (tmp_path / "file.sock").write_text("")
    assert connect(tmp_path / "file.sock", "x", 1.0) is None
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    assert connect(tmp_path / "stale.sock", "x", 1.0) is None


def test_json_of_the_squatters_report_is_what_it_saw(tmp_path: Path) -> None:
    """The squatter itself records what it is sent (so 'nothing' above means nothing)."""
    need_root_and_nobody()
    root = _squatted(tmp_path)
    with squatter(root) as sq:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(root / "pool.sock"))
            socket.send_fds(s, [b'{"env": "PATH"}\n'], [0, 1])
        got = sq.received()
    assert got["bytes"] == 16 and got["fds"] == 2 and json.loads(got["data"]) == {"env": "PATH"}
