from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from flexrun.events import read_events
from flexrun.train import PREEMPTED_EXIT_CODE, PreemptionGuard
from flexrun.train.context import single_process_context


def test_a_real_sigterm_sets_the_flag_and_exit_is_143(tmp_path: Path) -> None:
    guard = PreemptionGuard(
        ctx=single_process_context(run_dir=str(tmp_path)), signals=(signal.SIGTERM, signal.SIGUSR1)
    )
    try:
        assert not guard.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.requested and guard.should_stop()
        with pytest.raises(SystemExit) as info:
            guard.exit(step=4)
        assert info.value.code == PREEMPTED_EXIT_CODE == 143
        (ev,) = [e for e in read_events(tmp_path) if e["event"] == "preempted"]
        assert ev["step"] == 4 and ev["signal"] == signal.SIGUSR1
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(
        signal.getsignal(signal.SIGTERM)
    )


def test_request_without_signal() -> None:
    guard = PreemptionGuard(ctx=single_process_context(), signals=())
    assert not guard.should_stop()
    guard.request()
    assert guard.should_stop()
