"""A warm agent: ``python -m flexrun.warm_agent``, kept by a node's ``flexrun spares
--agents N`` for the next ``flexrun run --spares-dir``.

Owns only what makes an agent warm: the agent's imports (torch for its store client, the
CLI) done before a ``flexrun run`` needs them. It sits beside ``__main__`` because it runs
the CLI, which no package below may import. The hand-over (its own unix socket, a client
of this uid only, its argv, environment, working directory and stdin/stdout/stderr) is
:func:`flexrun.spares.become.await_handover`; this process then *is* that ``flexrun run``:
same output, same exit code (recorded, and the client relays signals to it), and it dies
with the client. End of the connection without a hand-over: exit 0.
"""

from __future__ import annotations

import os
import sys

import torch.distributed  # noqa: F401  (the point: the agent's store client needs it)

import flexrun.agent.launch  # noqa: F401
import flexrun.cli
from flexrun.errors import SparesError
from flexrun.spares.become import await_handover
from flexrun.spares.lifeline import run_recorded
from flexrun.spares.protocol import AGENT_SOCKET_ENV, EXIT_RECORD_ENV, READY_ENV


def main() -> int:
    record = os.environ.get(EXIT_RECORD_ENV)
    try:
        req = await_handover(os.environ[AGENT_SOCKET_ENV], os.environ.get(READY_ENV))
    except SparesError as exc:
        print(f"flexrun warm agent: {exc}", file=sys.stderr)
        return 2
    if req is None:
        return 0
    return run_recorded(
        lambda: flexrun.cli.main(list(req.argv), delegate=False, raise_on_failure=False), record
    )


if __name__ == "__main__":
    sys.exit(main())
