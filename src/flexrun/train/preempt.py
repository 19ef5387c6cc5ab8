"""Graceful preemption: a signal sets a flag, ranks agree at a step boundary, the job exits 143.

Owns the signal handlers (SIGTERM, optionally SIGUSR1), the one small all-reduce by which
every rank learns that any rank was told to stop, and the exit code (128 + SIGTERM = 143,
which Kubeflow and flexrun treat as retryable). It does not save the final checkpoint
itself: the training loop does, between :meth:`PreemptionGuard.should_stop` and
:meth:`PreemptionGuard.exit`, so a script controls what a final checkpoint holds.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from flexrun.events import EventLog
from flexrun.train import stopsignal
from flexrun.train.context import TrainContext, current, single_process_context
from flexrun.train.progress import install_stack_dump

EXIT_CODE = 128 + int(signal.SIGTERM)


class PreemptionGuard:
    """Turns SIGTERM/SIGUSR1 into an agreed stop at the next step boundary."""

    def __init__(
        self,
        *,
        ctx: TrainContext | None = None,
        signals: Iterable[int] = (signal.SIGTERM,),
        events: EventLog | None = None,
    ) -> None:
        """Install handlers (main thread only) for ``signals``; the previous ones are kept
        for :meth:`uninstall`.

        Raises:
            ValueError: not called from the main thread (Python's signal rule).
        """
        install_stack_dump()
        self._ctx = ctx or current() or single_process_context()
        self._flag = threading.Event()
        self._signum: int | None = None
        self._events = events
        if events is None and self._ctx.run_dir is not None:
            self._events = EventLog(self._ctx.run_dir, run_id=self._ctx.run_id, node=self._ctx.node)
            self._events.round = self._ctx.round
        self._previous: dict[int, Any] = {}
        for sig in signals:
            self._previous[int(sig)] = signal.signal(sig, self._handle)
            # A script that dies of an exception (a peer's death seen in a collective) can
            # no longer stop at a step boundary: the signal then ends it at once.
            stopsignal.hold(sig, self._handle, self._previous[int(sig)], self._unhonoured)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._signum = signum
        self._flag.set()

    def _unhonoured(self) -> bool:
        return self._signum is not None

    @property
    def requested(self) -> bool:
        """True once this process received one of the signals (no communication)."""
        return self._flag.is_set()

    def request(self) -> None:
        """Ask for a stop as if a signal had arrived (tests, custom triggers)."""
        self._flag.set()

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop. Collective: call it on every rank, every step."""
        local = 1 if self._flag.is_set() else 0
        if self._ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
            t = torch.tensor([local], dtype=torch.int32)
            if dist.get_backend() == "nccl":
                t = t.to(self._ctx.device)
            # Keep the work object alive until after wait(): if gloo's thread dropped the
            # last reference it would need the GIL to free ``t`` (see context.shutdown).
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
            assert work is not None
            work.wait()
            stop = bool(t.item())
            del work
        else:
            stop = bool(local)
        if stop:
            self._flag.set()
        return stop

    def exit(self, *, step: int | None = None) -> NoReturn:
        """Record the preemption and exit with 143 (128 + SIGTERM)."""
        if self._events is not None and self._ctx.is_main:
            self._events.emit(
                "preempted",
                rank=self._ctx.rank,
                step=step,
                signal=self._signum,
                exit_code=EXIT_CODE,
            )
        self.uninstall()
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(EXIT_CODE)

    def uninstall(self) -> None:
        """Restore the signal handlers that were there before."""
        stopsignal.release(self._handle)
        for sig, handler in self._previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        self._previous.clear()
