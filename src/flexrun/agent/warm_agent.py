"""A warm agent: an interpreter with the agent's imports (torch for its store client) done,
kept by a node's ``flexrun spares --agents N`` for the next ``flexrun run --spares-dir``.

Owns only the hand-over on the agent's side: it listens on its own unix socket; the
``flexrun run`` client (:func:`flexrun.agent.adopt.run_in_warm_agent`) connects and sends
its argv, environment, working directory, pid and its stdin/stdout/stderr (``SCM_RIGHTS``).
This process then *is* that ``flexrun run``: same output, same exit code (the client
relays signals to it and exits with its status), and it dies with the client (kill -9 of
the client is kill -9 of the agent). End of the connection without a request: exit 0.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch.distributed  # noqa: F401  (the point: the agent's store client needs it)

import flexrun.agent.launch  # noqa: F401
import flexrun.cli
from flexrun.agent.adopt import die_with, exit_code_of, record_exit


def main() -> int:
    path = os.environ["FLEXRUN_WARM_AGENT_SOCKET"]
    ready = os.environ["FLEXRUN_SPARE_READY"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lsock:
        lsock.bind(path)
        lsock.listen(1)
        with open(ready, "w") as fh:
            fh.write(str(os.getpid()))
        conn, _ = lsock.accept()  # (the daemon's death ends this process: PDEATHSIG)
    os.unlink(path)
    with conn:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while data and not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            data += more
        if not data.strip() or len(fds) != 3:
            return 0
        req = json.loads(data)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        die_with(int(req["client_pid"]))
        conn.sendall(b"ok\n")
    record = req["exit_record"]
    try:
        code = flexrun.cli.main(req["argv"], delegate=False)
    except SystemExit as exc:
        record_exit(record, exit_code_of(exc.code))
        raise
    except BaseException:
        record_exit(record, 1)
        raise
    record_exit(record, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
