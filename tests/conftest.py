"""Suite-wide reporting: where the suite's time and CPU go, by directory and by test.

At the end of a run the summary lists, for each test directory, the summed durations of its
tests (setup, call and teardown), the CPU they used (the test process's own and that of every
process it started and reaped: agents, workers, servers) and how many ran; then the tests
that used the most CPU. On 2-core CI machines the suite is CPU-bound (three pytest-xdist
workers keep both cores nearly busy), so its wall time is about its CPU over two: CPU, not
duration, says what to make cheaper first. With pytest-xdist the sums are of all workers'
time, so they add up to more than the wall time. A process that is not reaped by the test
(a daemon another process owns, e.g. slurmd's job steps) is not counted.
"""

from __future__ import annotations

import os
import resource
from collections import defaultdict
from collections.abc import Generator
from pathlib import PurePosixPath

import pytest

_spent: defaultdict[str, float] = defaultdict(float)
_cpu: defaultdict[str, float] = defaultdict(float)
_counted: defaultdict[str, int] = defaultdict(int)
_cpu_by_test: dict[str, float] = {}
_MOST_CPU = int(os.environ.get("FLEXRUN_TEST_CPU_TOP", "15"))


def _cpu_now() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def _directory(nodeid: str) -> str:
    parts = PurePosixPath(nodeid.split("::", 1)[0]).parts
    return "/".join(parts[:3]) if len(parts) > 3 else "/".join(parts[:-1]) or "."


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_START] = _cpu_now()
    yield


_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and _START in item.stash:  # (the report travels to xdist's
        report.user_properties.append(("cpu_s", _cpu_now() - item.stash[_START]))  # controller)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    where = _directory(report.nodeid)
    _spent[where] += report.duration
    for name, value in report.user_properties:
        if name == "cpu_s" and report.when == "teardown":
            _cpu[where] += value
            _cpu_by_test[report.nodeid] = value
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _counted[where] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _spent:
        return
    terminalreporter.section("time and CPU by directory (summed over tests)")
    for where, seconds in sorted(_spent.items(), key=lambda kv: -_cpu[kv[0]]):
        terminalreporter.write_line(
            f"{seconds:9.1f} s  {_cpu[where]:9.1f} s CPU  {_counted[where]:5d} tests  {where}"
        )
    terminalreporter.section(f"the {_MOST_CPU} tests that used the most CPU")
    for nodeid, cpu in sorted(_cpu_by_test.items(), key=lambda kv: -kv[1])[:_MOST_CPU]:
        terminalreporter.write_line(f"{cpu:9.1f} s CPU  {nodeid}")
