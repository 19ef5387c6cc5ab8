"""How an idle interpreter becomes what it is handed: a worker or a ``flexrun run``.

Owns the receiving side of both hand-overs: a spare's assignment (one line on its stdin,
from the agent that took it, see :func:`flexrun.spares.pool.assign`) and a ``flexrun run``
handing itself to a warm agent (one line and three descriptors on the agent's own socket,
from a peer of this uid only, see :func:`flexrun.spares.client.run_in_warm_agent`). Either
way it announces readiness, reads and validates the one message, takes on the sender's
context (environment, working directory, output, ``sys.path``) and ties this process's
life to its new owner. A spare that becomes a worker takes the command line a worker
started fresh would have (``ps``, ``pgrep -f train.py`` and ``/proc/PID/cmdline`` show the
script, not the spare). What makes an interpreter warm (torch) is its entry point's
(:mod:`flexrun.spares.spare`, :mod:`flexrun.warm_agent`); standard library and
``setproctitle`` only here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import runpy
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from typing import IO, Any

import setproctitle

from flexrun.errors import SparesError, SparesProtocolError, SparesUntrusted
from flexrun.spares.lifeline import die_with, run_recorded
from flexrun.spares.protocol import (
    EXIT_RECORD_ENV,
    MAX_HANDOVER,
    READY_ENV,
    Assignment,
    Handover,
    close_fds,
    parse_assignment,
    parse_handover,
    recv_line_with_fds,
)
from flexrun.spares.trust import check_peer

HANDOVER_TIMEOUT_S = 10.0
"""How long a warm agent waits for the hand-over once a client connected."""

Prepare = Callable[[Mapping[str, str]], None]
"""Called with the worker's environment just before its entry point runs (e.g. to size
torch's thread pool, which read the spare's environment at import)."""


def announce_ready(path: str | None) -> None:
    """Tell whoever keeps this spare that its imports are done (its pid in ``path``)."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(tmp, path)  # (whoever sees the file sees the pid)


def _take_context(env: Mapping[str, str], cwd: str, owner_pid: int | None) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if owner_pid:
        die_with(owner_pid)


# -- a spare becomes a worker ---------------------------------------------------------------
def serve_assignment(prepare: Prepare | None = None, stdin: IO[bytes] | None = None) -> int:
    """Wait for an assignment on stdin and run it; 0 at end of input without one.

    A bad assignment is one line on stderr and exit code 2."""
    record = os.environ.get(EXIT_RECORD_ENV)
    announce_ready(os.environ.get(READY_ENV))
    line = (stdin or sys.stdin.buffer).readline(MAX_HANDOVER + 1)
    if not line.strip():
        return 0
    try:
        task = parse_assignment(line)
    except SparesProtocolError as exc:
        print(f"flexrun spare: {exc}", file=sys.stderr)
        return 2
    return run_recorded(lambda: _become_worker(task, prepare), record)


def _become_worker(task: Assignment, prepare: Prepare | None) -> int:
    for stream, fd in ((task.stdout, 1), (task.stderr, 2)):
        if stream:
            # The agent's drain for its rank (a FIFO or a pseudo-terminal, see
            # flexrun.proc.drain.output_paths) or its log file, as if started fresh. Never
            # a controlling terminal (this process leads its session).
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOCTTY
            target = os.open(stream, flags, 0o600)
            if task.private_output and stat.S_ISFIFO(os.fstat(target).st_mode):
                _remove_private(stream)
            os.dup2(target, fd)
            os.close(target)
    # (as flexrun.proc.spawn.build_command starts a fresh one; before the environment is
    # swapped: setproctitle finds the command line's memory from the environment's)
    fresh = [sys.executable, "-u", *(["-m"] if task.module else []), task.entry, *task.args]
    setproctitle.setproctitle(" ".join(fresh))
    _take_context(task.env, task.cwd, task.agent_pid)
    for entry in reversed(task.env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)  # the spare's own PYTHONPATH may have been another
    if prepare is not None:
        prepare(task.env)
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the assignment channel is done)
    sys.argv = [task.entry, *task.args]
    _run_script(task)
    return 0


_KEPT: list[dict[str, Any]] = []
"""The script's globals, alive until this interpreter's finalization (:func:`_run_script`)."""


def _run_script(task: Assignment) -> None:
    """Run the worker's script (or module) as ``__main__``, and keep its globals until the
    interpreter ends, as a fresh ``python script.py`` keeps its ``__main__`` module.

    ``runpy`` returns a copy of the script's globals and drops its module: let go here, the
    script's objects would be destroyed the moment its last line returns, with other threads
    still running. That order matters for a C++ destructor that joins a thread needing the
    GIL: a DDP model's reducer, freed right after ``destroy_process_group``, destroys its
    gloo process group, which joins its run loop while that loop frees the tensors of the
    last barrier and waits for the GIL the freeing thread holds (pytorch/pytorch#56297; seen
    with gdb on spare-turned-workers stuck for good after their training ended, about 1 run
    in 40 of a test under load). Kept until finalization, they go long after, as in a fresh
    interpreter. When the script raises (``sys.exit`` included), the globals of the frames of
    its traceback are kept: a fresh interpreter's ``__main__`` outlives its exception too."""
    try:
        if task.module:
            namespace = runpy.run_module(task.entry, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(task.entry)))
            namespace = runpy.run_path(task.entry, run_name="__main__")
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None:
            if not any(kept is tb.tb_frame.f_globals for kept in _KEPT):
                _KEPT.append(tb.tb_frame.f_globals)
            tb = tb.tb_next
        raise
    _KEPT.append(namespace)


def _remove_private(fifo: str) -> None:
    """Remove a private FIFO this worker has open, and its directory once empty: the
    agent removes them when the worker ends, unless it was killed first (kill -9)."""
    with contextlib.suppress(FileNotFoundError):  # (the agent's cleanup came first)
        os.unlink(fifo)
    try:
        os.rmdir(os.path.dirname(fifo))
    except OSError as exc:  # (not empty: the other stream's FIFO is still there)
        if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT):  # (a leftover, not a failure)
            print(f"flexrun spare: could not remove {fifo}'s directory: {exc}", file=sys.stderr)


# -- a warm agent becomes a `flexrun run` ---------------------------------------------------
def await_handover(path: str, ready: str | None) -> Handover | None:
    """Listen on ``path`` until a process of this uid connects, then take its hand-over:
    its stdin, stdout and stderr become this process's, its environment and working
    directory too, and this process dies with it. None when it ended the connection
    without one.

    Raises:
        SparesError: the hand-over is malformed (the connection is closed, nothing kept).
        OSError: the socket failed.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lsock:
        lsock.bind(path)
        os.chmod(path, 0o600)
        lsock.listen(1)
        announce_ready(ready)
        while True:
            conn, _ = lsock.accept()  # (the daemon's death ends this process: PDEATHSIG)
            try:
                client = check_peer(conn, "the client")
                break
            except SparesUntrusted as exc:
                print(f"flexrun warm agent: {exc}", file=sys.stderr)
                conn.close()
    os.unlink(path)
    with conn:
        conn.settimeout(HANDOVER_TIMEOUT_S)
        data, fds = recv_line_with_fds(conn, MAX_HANDOVER, 3)
        try:
            if not data.strip():
                close_fds(fds)
                return None
            if len(fds) != 3:
                raise SparesProtocolError(f"hand-over with {len(fds)} descriptors, not 3")
            req = parse_handover(data)
        except SparesError:
            close_fds(fds)
            raise
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _take_context(req.env, req.cwd, client)
        conn.sendall(b"ok\n")
    return req
