"""Stop signals held for a step boundary are given back when the script dies of an exception.

Owns what becomes of a signal (SIGTERM) that flexrun.train turned into a flag (the
:class:`~flexrun.train.preempt.PreemptionGuard`'s agreed stop, live mode's loop) once the
script can no longer act on the flag: an uncaught exception ended it. Then the flag-only
handlers are replaced by what was there before them (normally ``SIG_DFL``) and a signal
that was caught and never acted on is delivered again, so the process ends as it would have
without flexrun.train: at once, not after its interpreter's teardown.

Why: a worker whose peer died raises from its next collective ("connection closed by
peer"), and the agent, restarting the round, sends it SIGTERM. With the flag-only handler
still installed, that SIGTERM did nothing and the worker went on tearing down its
interpreter (process groups, threads; 1-2 s on a loaded node, or the agent's whole grace
before SIGKILL), which delayed the new round by as much and cost restart mode's goodput.
A script that ends normally, or catches the exception, is not affected; nor is a handler
the script installed itself. Standard library only (no torch import).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any


@dataclass(slots=True)
class _Held:
    signum: int
    handler: Callable[[int, Any], None]
    previous: Any
    caught: Callable[[], bool]


_lock = threading.Lock()
_held: list[_Held] = []
_chained: Any = None
"""The excepthook that was in place when ours went in (None: ours is not installed)."""


def hold(
    signum: int, handler: Callable[[int, Any], None], previous: Any, caught: Callable[[], bool]
) -> None:
    """Register ``handler`` (already installed for ``signum`` in place of ``previous``) as
    a flag-only handler; ``caught()`` says whether it caught a signal not yet acted on.
    Installs the process's uncaught-exception hook on first use."""
    global _chained
    with _lock:
        _held.append(_Held(int(signum), handler, previous, caught))
        if _chained is None:
            _chained = sys.excepthook
            sys.excepthook = _on_uncaught


def release(handler: Callable[[int, Any], None]) -> None:
    """Forget ``handler`` (its owner restored the signal itself)."""
    with _lock:
        _held[:] = [h for h in _held if h.handler != handler]


def _on_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    (_chained or sys.__excepthook__)(exc_type, exc, tb)  # the traceback first
    if threading.current_thread() is threading.main_thread():  # (signal.signal's rule)
        give_back()


def give_back(kill: Callable[[int, int], None] = os.kill) -> list[int]:
    """Put back what each held handler replaced, where it is still installed, and deliver
    again each signal that was caught and not acted on (in that case, with ``SIG_DFL``
    back, the process ends here). Returns the signals delivered again."""
    with _lock:
        held, _held[:] = list(_held), []
    again: list[int] = []
    for h in held:
        if signal.getsignal(h.signum) != h.handler:
            continue  # replaced since (by the script, or another owner): not ours to undo
        signal.signal(h.signum, h.previous if h.previous is not None else signal.SIG_DFL)
        if h.caught() and h.signum not in again:
            again.append(h.signum)
    if again:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed or replaced: nothing to keep
                continue
    for signum in again:
        kill(os.getpid(), signum)
    return again
