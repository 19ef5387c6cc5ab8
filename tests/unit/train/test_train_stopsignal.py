"""A SIGTERM held for a step boundary ends a script that died of an exception at once.

The agent restarting a round SIGTERMs the survivors of a dead peer; they have raised from
their collective and are tearing down their interpreter. Before flexrun.train.stopsignal,
PreemptionGuard's flag-only handler swallowed that SIGTERM and the survivor took its whole
teardown (or the agent's grace, until SIGKILL) to go, which delayed every restart.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from flexrun.train import stopsignal

SCRIPT = textwrap.dedent(
    """
    import signal, sys, threading, time
    from flexrun.train import PreemptionGuard
    from flexrun.train.context import single_process_context

    guard = PreemptionGuard(ctx=single_process_context(), signals=(signal.SIGTERM,))
    # A teardown that takes long: the interpreter joins this thread before it exits.
    threading.Thread(target=time.sleep, args=(120,)).start()
    print("ready", flush=True)
    if sys.argv[1] == "before":
        while not guard.requested:  # the agent's SIGTERM came while the step was blocked
            time.sleep(0.01)
    raise RuntimeError("Connection closed by peer")
    """
)


def _start(mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _ended_by_sigterm(proc: subprocess.Popen[str]) -> tuple[int | None, str]:
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None, ""
    assert proc.stderr is not None
    return proc.returncode, proc.stderr.read()


@pytest.mark.timeout(90)
def test_a_sigterm_caught_before_the_exception_ends_the_process_after_the_traceback() -> None:
    proc = _start("before")
    proc.send_signal(signal.SIGTERM)
    code, err = _ended_by_sigterm(proc)
    assert code == -signal.SIGTERM, "the survivor sat out its interpreter teardown"
    assert "RuntimeError: Connection closed by peer" in err  # (the traceback still printed)


@pytest.mark.timeout(90)
def test_a_sigterm_during_the_teardown_after_an_exception_ends_the_process() -> None:
    proc = _start("during")
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # the traceback is printed before the teardown starts
        seen.append(line)
        if "RuntimeError: Connection closed by peer" in line:
            break
    proc.send_signal(signal.SIGTERM)
    code, _ = _ended_by_sigterm(proc)
    assert code == -signal.SIGTERM, "SIGTERM was swallowed by the flag-only handler"


def test_give_back_restores_each_handler_and_delivers_only_a_caught_signal() -> None:
    caught = {signal.SIGUSR1: True, signal.SIGUSR2: False}
    handlers: dict[int, Any] = {}
    before = {s: signal.getsignal(s) for s in caught}
    try:
        for sig in caught:
            handlers[sig] = lambda signum, frame: None
            previous = signal.signal(sig, handlers[sig])
            stopsignal.hold(sig, handlers[sig], previous, lambda s=sig: caught[s])
        delivered: list[tuple[int, int]] = []
        again = stopsignal.give_back(kill=lambda pid, sig: delivered.append((pid, sig)))
        assert again == [signal.SIGUSR1]
        assert [sig for _, sig in delivered] == [signal.SIGUSR1]
        for sig in caught:
            assert signal.getsignal(sig) == before[sig]
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


def test_a_handler_the_script_installed_since_is_left_alone() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    try:

        def ours(signum: int, frame: Any) -> None:
            return None

        def theirs(signum: int, frame: Any) -> None:
            return None

        previous = signal.signal(signal.SIGUSR1, ours)
        stopsignal.hold(signal.SIGUSR1, ours, previous, lambda: True)
        signal.signal(signal.SIGUSR1, theirs)
        assert stopsignal.give_back(kill=lambda pid, sig: pytest.fail("delivered")) == []
        assert signal.getsignal(signal.SIGUSR1) is theirs
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_released_handler_is_not_given_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    try:

        def ours(signum: int, frame: Any) -> None:
            return None

        previous = signal.signal(signal.SIGUSR1, ours)
        stopsignal.hold(signal.SIGUSR1, ours, previous, lambda: True)
        stopsignal.release(ours)
        assert stopsignal.give_back(kill=lambda pid, sig: pytest.fail("delivered")) == []
        assert signal.getsignal(signal.SIGUSR1) is ours
    finally:
        signal.signal(signal.SIGUSR1, before)
