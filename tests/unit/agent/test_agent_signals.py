"""--signals-to-handle in the agent: which signals it catches and what workers get."""

from __future__ import annotations

import signal

from flexrun.agent.agent import _install_signals, _restore_signals, worker_signal


def test_the_agents_own_stop_signals_reach_workers_as_sigterm() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        assert worker_signal(sig) == signal.SIGTERM


def test_another_listed_signal_is_forwarded_as_itself() -> None:
    assert worker_signal(signal.SIGUSR1) == signal.SIGUSR1
    assert worker_signal(signal.SIGQUIT) == signal.SIGQUIT


def test_the_listed_signals_are_caught_with_the_agents_own() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    previous = _install_signals((int(signal.SIGUSR1), int(signal.SIGTERM)))
    try:
        assert set(previous) == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}
        assert signal.getsignal(signal.SIGUSR1) is not before
    finally:
        _restore_signals(previous)
    assert signal.getsignal(signal.SIGUSR1) is before
