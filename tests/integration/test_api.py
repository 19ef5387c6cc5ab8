"""The Python launch API (issue 21 item 4): ``flexrun.launch`` with a callable or a script,
per-rank return values, a failing rank's exception and traceback raised in the caller,
and ``flexrun.cli.main(argv)`` raising on a failed job as ``torch.distributed.run.main``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import api_support
import pytest

import flexrun
import flexrun.cli
from flexrun.errors import ConfigError, JobFailed


@pytest.mark.timeout(120)
def test_launch_runs_a_callable_on_two_ranks_and_returns_both_values(tmp_path: Path) -> None:
    out = flexrun.launch(
        api_support.rank_value, 5, nproc_per_node=2, fn_kwargs={"scale": 10}, run_dir=tmp_path
    )
    assert out == {
        0: {"rank": 0, "value": 5, "world": 2},
        1: {"rank": 1, "value": 15, "world": 2},
    }


@pytest.mark.timeout(120)
def test_a_raising_ranks_exception_and_traceback_reach_the_caller(tmp_path: Path) -> None:
    with pytest.raises(JobFailed) as info:
        flexrun.launch(api_support.fail_on_rank, 1, nproc_per_node=2, run_dir=tmp_path)
    err = info.value
    assert (err.rank, err.exc_type, err.exit_code) == (1, "ValueError", 1)
    assert err.exc_message == "rank 1 refuses this batch"
    assert "in fail_on_rank" in err.remote_traceback
    assert 'raise ValueError(f"rank {rank} refuses this batch")' in err.remote_traceback
    text = str(err)
    assert "rank 1 raised ValueError: rank 1 refuses this batch" in text
    assert "Traceback (most recent call last)" in text
    assert set(err.failures) == {1}


@pytest.mark.timeout(120)
def test_elastic_launch_takes_torchs_config_shape(tmp_path: Path) -> None:
    cfg = flexrun.LaunchConfig(nproc_per_node=2, run_id="api", options={"run_dir": tmp_path})
    out = flexrun.elastic_launch(cfg, api_support.rank_value)(1)
    assert [v["value"] for v in out.values()] == [1, 2]
    assert flexrun.elastic_launch(cfg)(api_support.rank_value)(0)[1]["rank"] == 1


@pytest.mark.timeout(120)
def test_a_script_entrypoint_and_cli_main_raising_on_failure(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            if os.environ["RANK"] == sys.argv[1]:
                raise RuntimeError("script rank failed on purpose")
            """
        )
    )
    assert flexrun.launch(str(script), "7", nproc_per_node=2, run_dir=tmp_path / "a") == {
        0: None,
        1: None,
    }
    with pytest.raises(JobFailed) as info:
        flexrun.cli.main(
            ["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "b"), str(script), "0"]
        )
    assert info.value.exit_code == 1 and info.value.rank == 0
    assert "RuntimeError: script rank failed on purpose" in str(info.value)
    # The console script's form (no argv given) keeps returning the exit code.
    code = flexrun.cli.main(
        ["run", "--run-dir", str(tmp_path / "c"), str(script), "0"], raise_on_failure=False
    )
    assert code == 1


def test_callables_the_workers_cannot_import_are_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="lambda"):
        flexrun.launch(lambda: 1, run_dir=tmp_path)
    with pytest.raises(ConfigError, match="cannot be pickled"):
        flexrun.launch(api_support.rank_value, lambda: 1, run_dir=tmp_path)
    with pytest.raises(ConfigError, match="nproc"):
        flexrun.launch(api_support.rank_value, 1, nproc_per_node=0, run_dir=tmp_path)
