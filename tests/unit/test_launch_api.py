"""flexrun.api without processes: option mapping, torch's LaunchConfig shape, sealed
records (a swapped file is refused before it is unpickled), the failure summary."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from flexrun import api
from flexrun.errors import JobFailed


def test_options_become_run_flags() -> None:
    args = api.option_args(
        {
            "nproc_per_node": 2,
            "max_restarts": 0,
            "standalone": True,
            "no_python": False,
            "rdzv_endpoint": None,
            "rdzv_conf": {"timeout": 5, "join_timeout": 9},
            "signals_to_handle": ("SIGTERM", "SIGINT"),
            "run_dir": Path("/x/y"),
        }
    )
    assert args == [
        "--nproc-per-node", "2", "--max-restarts", "0", "--standalone",
        "--rdzv-conf", "timeout=5,join_timeout=9", "--signals-to-handle", "SIGTERM,SIGINT",
        "--run-dir", "/x/y",
    ]  # fmt: skip


def test_a_torch_launch_config_is_read_by_field_name() -> None:
    torch_api = pytest.importorskip("torch.distributed.launcher.api")
    cfg = torch_api.LaunchConfig(
        min_nodes=1, max_nodes=3, nproc_per_node=2, run_id="j", rdzv_endpoint="h:1",
        rdzv_backend="c10d", max_restarts=2,
    )  # fmt: skip
    flags = api.flags_of(cfg)
    assert flags["nnodes"] == "1:3" and flags["nproc_per_node"] == 2
    assert (flags["rdzv_id"], flags["rdzv_endpoint"], flags["max_restarts"]) == ("j", "h:1", 2)
    assert flags["rdzv_conf"] == {"timeout": 900}  # torch's LaunchConfig default


def test_a_record_that_fails_its_hmac_is_never_unpickled(tmp_path: Path) -> None:
    key = b"k" * 32
    api._seal(tmp_path / "rank_0.0.rec", key, pickle.dumps(("ok", 41)))
    api._seal(tmp_path / "rank_0.1.rec", key, pickle.dumps(("ok", 42)))

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (exec, ("raise SystemExit('unpickled!')",))

    # An attacker's newer record, sealed under another key: skipped, not loaded.
    api._seal(tmp_path / "rank_0.7.rec", b"x" * 32, pickle.dumps(Boom()))
    (tmp_path / "rank_1.0.rec").write_bytes(b"\0" * 32 + pickle.dumps(Boom()))
    assert api.read_records(tmp_path, key) == {0: ("ok", 42)}


def test_the_failure_names_the_newest_attempts_blamed_rank(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"ts": 10.0, "event": "failure", "rank": 3, "message": "m"}) + "\n"
    )
    records = {
        0: ("error", "KeyError", "'a'", "tb0", 0),  # an earlier attempt
        2: ("error", "ValueError", "bad", "tb2", 1),
        3: ("error", "OSError", "disk", "tb3", 1),
        1: ("ok", 5),
    }
    err = api.job_failure(1, tmp_path, since=0.0, records=records)
    assert isinstance(err, JobFailed)
    assert (err.rank, err.exc_type, err.remote_traceback) == (3, "OSError", "tb3")
    assert set(err.failures) == {0, 2, 3}
    # No record (e.g. a script, or a rank killed by a signal): the agent's root cause.
    err = api.job_failure(137, tmp_path, since=0.0)
    assert (err.rank, err.exc_type, err.exc_message) == (3, "", "m")
    assert "rank 3 failed: m" in str(err)
