"""A squatter for the spares-socket tests: a process of user ``nobody`` that listens where
flexrun's spares socket should be, sends nothing, and records what it was sent (shared by
tests/unit/spares and tests/integration/test_nodepool.py)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Listens at argv[1] (relative to its working directory), sends nothing, and prints what
# it received ({"connections", "bytes", "fds", "data"}) once its stdin closes.
SQUATTER = r"""
import json, os, select, socket, sys
ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
ls.bind(sys.argv[1])
ls.listen(8)
print("listening", flush=True)
got = {"connections": 0, "bytes": 0, "fds": 0, "data": ""}
conns = []
def drain(c):
    data, fds, _, _ = socket.recv_fds(c, 65536, 16)
    got["bytes"] += len(data)
    got["fds"] += len(fds)
    got["data"] += data[:300].decode(errors="replace")
    for fd in fds:
        os.close(fd)
    if not data:
        conns.remove(c)
        c.close()
while True:
    r = select.select([ls, sys.stdin, *conns], [], [], 60)[0]
    for c in [c for c in conns if c in r]:
        drain(c)
    if ls in r:
        c, _ = ls.accept()
        conns.append(c)
        got["connections"] += 1
    if not r or (sys.stdin in r and not sys.stdin.readline()):
        break
ls.setblocking(False)
while True:
    try:
        conns.append(ls.accept()[0])
        got["connections"] += 1
    except BlockingIOError:
        break
for c in list(conns):
    c.settimeout(0.2)
    try:
        drain(c)
    except OSError:
        pass
print(json.dumps(got), flush=True)
"""

NOBODY = "nobody"


@functools.cache
def nobody_python() -> str | None:
    """A Python that user nobody may run (this one may sit in root's home)."""
    pw = pwd.getpwnam(NOBODY)
    for exe in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            res = subprocess.run(
                [exe, "-I", "-S", "-c", "import socket; socket.recv_fds"],
                user=pw.pw_uid,
                group=pw.pw_gid,
                extra_groups=[],
                capture_output=True,
                timeout=30,
            )
        except OSError:
            continue
        if res.returncode == 0:
            return exe
    return None


def need_root_and_nobody() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (to run a process as another user)")
    try:
        pwd.getpwnam(NOBODY)
    except KeyError:
        pytest.skip("no user nobody here")
    if nobody_python() is None:
        pytest.skip("no Python that user nobody may run")


def chown_nobody(path: Path) -> None:
    pw = pwd.getpwnam(NOBODY)
    os.chown(path, pw.pw_uid, pw.pw_gid)


class Squatter:
    """A process of user ``nobody`` serving ``directory/name`` (``directory`` must let it
    in: the test chowns it first)."""

    def __init__(self, directory: Path, name: str = "pool.sock") -> None:
        pw = pwd.getpwnam(NOBODY)
        self.proc = subprocess.Popen(
            [str(nobody_python()), "-I", "-S", "-c", SQUATTER, name],
            cwd=directory,
            user=pw.pw_uid,
            group=pw.pw_gid,
            extra_groups=[],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "listening"
        self.pid = self.proc.pid

    def received(self) -> dict:
        """Stop it; what it was sent."""
        out, _ = self.proc.communicate(timeout=20)
        return dict(json.loads(out.strip().splitlines()[-1]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def squatter(directory: Path, name: str = "pool.sock") -> Iterator[Squatter]:
    s = Squatter(directory, name)
    try:
        yield s
    finally:
        s.kill()
