"""``--logs-specs``: what a torchrun LogsSpecs' ``reify`` answers, as each worker's
console and files (agent/logs_specs.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

from flexrun.agent.logs_specs import consoles_from_dest, reify, std_value
from flexrun.config.settings import StdStreams
from flexrun.errors import ConfigError

OUT, ERR = frozenset({"stdout"}), frozenset({"stderr"})


def test_flexruns_stream_settings_become_torchs_std_values() -> None:
    assert std_value(StdStreams()) == Std.NONE
    assert std_value(StdStreams(default=OUT | ERR)) == Std.ALL
    assert std_value(StdStreams(by_rank={0: OUT, 1: ERR})) == {0: Std.OUT, 1: Std.ERR}


def _envs(n: int) -> list[dict[str, str]]:
    return [
        {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "2", "RANK": str(i)}
        for i in range(n)
    ]


def test_torchs_default_specs_give_torchruns_files_console_and_error_file(tmp_path: Path) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.OUT, tee={1: Std.ERR})
    envs = _envs(2)
    got = reify(specs, envs, ["[default0]:", "[default1]:"])
    c0, c1 = got.consoles
    attempt = Path(envs[0]["TORCHELASTIC_ERROR_FILE"]).parent.parent
    assert attempt.name == "attempt_2" and attempt.parent.parent == tmp_path
    assert c0.files == {"stdout": attempt / "0" / "stdout.log"}  # stderr: the console's
    assert c0.streams == ERR and dict(c0.prefixes) == {}
    assert c0.error_file == attempt / "0" / "error.json" == Path(envs[0]["TORCHELASTIC_ERROR_FILE"])
    assert set(c1.files) == {"stdout", "stderr"} and c1.streams == ERR
    assert dict(c1.prefixes) == {"stderr": "[default1]:"}
    assert got.filtered == {
        "stdout": attempt / "filtered_stdout.log",
        "stderr": attempt / "filtered_stderr.log",
    }


def test_a_rank_the_plugin_leaves_out_or_a_failing_reify_is_one_clear_error() -> None:
    dest = SimpleNamespace(
        stdouts={0: ""}, stderrs={}, tee_stdouts={}, tee_stderrs={}, error_files={}
    )
    with pytest.raises(ConfigError, match="no stderr for local rank 0"):
        consoles_from_dest(dest, 1, ["p"])

    class Broken:
        def reify(self, envs: object) -> object:
            raise RuntimeError("boom")

    with pytest.raises(ConfigError, match="Broken.reify failed .RuntimeError: boom"):
        reify(Broken(), _envs(1), ["p"])


def test_a_devnull_tee_is_not_shown() -> None:
    dest = SimpleNamespace(
        stdouts={0: os.devnull},
        stderrs={0: os.devnull},
        tee_stdouts={0: os.devnull},
        tee_stderrs={},
        error_files={0: os.devnull},
    )
    (c,) = consoles_from_dest(dest, 1, ["p"]).consoles
    assert c.streams == frozenset() and c.error_file == Path(os.devnull)
