"""torchrun's console rules per local rank (agent/console.py), without processes."""

from __future__ import annotations

from pathlib import Path

from flexrun.agent.console import close_filtered, console_plan, filtered_logs
from flexrun.config import RunConfig
from flexrun.config.settings import StdStreams
from flexrun.testing.config import run_config

BOTH = frozenset({"stdout", "stderr"})


def _config(**kw: object) -> RunConfig:
    return run_config(entrypoint="mod", module=True, nproc_per_node=2, **kw)


def test_nothing_redirected_is_shown_unmodified_as_the_agents_own_stream() -> None:
    plan = console_plan(_config(), 0, 0)
    assert plan.streams == BOTH and dict(plan.prefixes) == {}


def test_teed_streams_carry_torchruns_prefix_or_the_template() -> None:
    tee = StdStreams(by_rank={1: frozenset({"stdout"})})
    plan = console_plan(_config(tee=tee, role="trainer"), 1, 7)
    assert plan.streams == BOTH and dict(plan.prefixes) == {"stdout": "[trainer1]:"}
    assert console_plan(_config(tee=tee), 0, 6).prefixes == {}
    templ = _config(
        tee=StdStreams(default=BOTH), log_line_prefix_template="<${rank}|${local_rank}>"
    )
    assert dict(console_plan(templ, 1, 7).prefixes) == {"stdout": "<7|1>", "stderr": "<7|1>"}


def test_redirected_streams_and_filtered_ranks_stay_off_the_console() -> None:
    red = _config(redirects=StdStreams(default=frozenset({"stdout"})))
    assert console_plan(red, 0, 0).streams == {"stderr"}
    filt = _config(local_ranks_filter=frozenset({1}), tee=StdStreams(default=BOTH))
    assert console_plan(filt, 0, 0).streams == frozenset()
    assert console_plan(filt, 1, 1).streams == BOTH


def test_duplicate_filters_make_the_attempts_files_and_reach_only_teed_streams(
    tmp_path: Path,
) -> None:
    c = _config(
        duplicate_stdout_filters=("apple",),
        tee=StdStreams(by_rank={0: frozenset({"stdout"})}),
        local_ranks_filter=frozenset({0}),
    )
    logs = filtered_logs(c, tmp_path / "round_1")
    try:
        assert set(logs) == {"stdout"}  # (no stderr filters: no filtered_stderr.log)
        assert (tmp_path / "round_1" / "filtered_stdout.log").exists()
        assert console_plan(c, 0, 0, logs).duplicates == {"stdout": logs["stdout"]}
        assert console_plan(c, 1, 1, logs).duplicates == {}  # not tee'd, and filtered out
    finally:
        close_filtered(logs)
    assert filtered_logs(_config(), tmp_path / "none") == {}
    assert not (tmp_path / "none").exists()
