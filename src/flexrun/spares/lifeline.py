"""Whose life a taken interpreter's is tied to, and how its end is recorded.

Owns three small mechanisms of a process handed from one owner to another: dying with the
new owner instead of the parent (:func:`die_with`), passing the owner's signals on to it
(:func:`relay_signals`, the ``flexrun run`` client of a warm agent) and recording how a
taken interpreter ended where its owner can read it even if its parent is gone
(:func:`run_recorded`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading
from collections.abc import Callable

from flexrun.spares.protocol import exit_code_of, record_exit

_PR_SET_PDEATHSIG = 1
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def die_with(owner_pid: int) -> None:
    """Die (with everything in this session) when ``owner_pid`` exits, not when the parent
    that started this process does: the owner that took it answers for it now."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)  # (it named the parent, the daemon)
    try:
        fd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os.killpg(0, signal.SIGKILL)  # the owner is already gone
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="flexrun-owner-watch", daemon=True).start()


def relay_signals(pid: int) -> None:
    """From now on, the signals a launcher is sent (``RELAYED``) go to ``pid`` instead."""

    def relay(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in RELAYED:
        signal.signal(sig, relay)


def run_recorded(run: Callable[[], int | None], record: str | None) -> int:
    """``run()``'s exit code (None: 0), also written to the exit record ``record`` (when
    set) however it ends: returned, ``sys.exit``, Ctrl-C (-SIGINT) or an exception (1).
    Exceptions propagate after being recorded."""
    try:
        code = run()
    except SystemExit as exc:
        if record:
            record_exit(record, exit_code_of(exc.code))
        raise
    except KeyboardInterrupt:
        if record:
            record_exit(record, -signal.SIGINT)
        raise
    except BaseException:
        if record:
            record_exit(record, 1)
        raise
    rc = exit_code_of(code)
    if record:
        record_exit(record, rc)
    return rc
