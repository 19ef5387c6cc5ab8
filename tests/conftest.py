"""Suite-wide reporting: where the suite's time goes, by directory.

At the end of a run the summary lists, for each test directory, the summed durations of its
tests (setup, call and teardown) and how many ran: what to look at first when the suite
outgrows CI's budget. With pytest-xdist the sums are of all workers' time, so they add up
to more than the wall time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import PurePosixPath

import pytest

_spent: defaultdict[str, float] = defaultdict(float)
_counted: defaultdict[str, int] = defaultdict(int)


def _directory(nodeid: str) -> str:
    parts = PurePosixPath(nodeid.split("::", 1)[0]).parts
    return "/".join(parts[:3]) if len(parts) > 3 else "/".join(parts[:-1]) or "."


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    where = _directory(report.nodeid)
    _spent[where] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _counted[where] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _spent:
        return
    terminalreporter.section("time by directory (summed test durations)")
    for where, seconds in sorted(_spent.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:9.1f} s  {_counted[where]:5d} tests  {where}")
