"""``flexrun <argv>`` as the console runs it, with a daemon thread inside a ``TCPStore``
wait (as the agent's own rendezvous watch can be) whose server is SIGKILLed while the
interpreter finalizes: the wait then fails and its thread wants the GIL back, which
Python 3.10-3.13 answer with ``pthread_exit`` and the C++ frames with ``std::terminate``
(exit 134). Environment: ``PROBE_STORE_PORT`` and ``PROBE_STORE_PID`` (the server, a
process of the test's)."""

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from flexrun.cli import main

client = dist.TCPStore(
    "127.0.0.1", int(os.environ["PROBE_STORE_PORT"]), None, False, timedelta(seconds=30)
)


def blocked() -> None:
    client.wait(["never-set"], timedelta(seconds=30))


class KillsTheServerWhileFinalizing:
    """Module globals are torn down after the interpreter is marked as finalizing."""

    def __del__(self) -> None:
        os.kill(int(os.environ["PROBE_STORE_PID"]), signal.SIGKILL)
        time.sleep(1.0)  # the blocked wait fails meanwhile and wants the GIL back


threading.Thread(target=blocked, daemon=True).start()
sentinel = KillsTheServerWhileFinalizing()
sys.argv = ["flexrun", *sys.argv[1:]]
sys.exit(main())
