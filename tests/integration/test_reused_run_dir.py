"""Issue 18 point 7: a reused run directory never blames yesterday's error.

The run directory (the default ``./flexrun-runs/<rdzv-id>``, or a ``--run-dir`` given
again) holds yesterday's logs: a rank's ``stderr.log`` ending in ``ValueError: OLD ERROR
from yesterday``, its ``stdout.log``, and yesterday's ``error.json``. Today's worker ends
with ``os._exit(3)``, leaving no traceback. The root cause on flexrun's stderr, in the
``failure`` event and in the FAILED round record on the store names exit code 3, never
the old error; the console (``--tee 3``) shows only today's lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import Procs, free_port, node_args, read_events, wait_for

from flexrun.rendezvous.state import FAILED, Keys, RoundRecord
from flexrun.store.tcp import TcpStore

OLD = "ValueError: OLD ERROR from yesterday"
SCRIPT = (
    "import os, sys\n"
    "print('NEW stdout line', flush=True)\n"
    "print('NEW stderr line', file=sys.stderr, flush=True)\n"
    "os._exit(3)\n"
)


def _yesterday(run_dir: Path) -> None:
    rank = run_dir / "logs" / "round_1" / "rank_0"
    rank.mkdir(parents=True)
    (rank / "stderr.log").write_text(
        f'Traceback (most recent call last):\n  File "train.py", line 1, in <module>\n{OLD}\n'
    )
    (rank / "stdout.log").write_text("OLD stdout line from yesterday\n")
    (rank / "error.json").write_text(
        json.dumps({"message": {"message": OLD, "extraInfo": {"py_callstack": OLD}}})
    )


def _check_today(procs: Procs, run_dir: Path, name: str) -> None:
    err, out = procs.stderr(name), (procs.tmp / f"{name}.out").read_text()
    assert "OLD" not in err and "OLD" not in out, err + out  # no old line, no old cause
    assert "exited with code 3" in err and "NEW stderr line" in err, err
    assert "NEW stdout line" in out, out
    failures = [e for e in read_events(run_dir) if e["event"] == "failure"]
    assert failures and all("OLD" not in json.dumps(e) for e in failures), failures
    assert failures[-1]["exit_code"] == 3


@pytest.mark.timeout(180)
def test_the_default_run_dir_of_a_reused_rdzv_id_blames_only_todays_exit(procs: Procs) -> None:
    _yesterday(procs.tmp / "flexrun-runs" / "yesterday")
    (procs.tmp / "exit3.py").write_text(SCRIPT)
    p = procs.start(
        [
            "run",
            "--standalone",
            "--rdzv-id",
            "yesterday",
            "--max-restarts",
            "0",
            "--tee",
            "3",
            "exit3.py",
        ],
        name="a",
    )
    assert p.wait(timeout=150) == 3, procs.stderr("a")
    _check_today(procs, procs.tmp / "flexrun-runs" / "yesterday", "a")


@pytest.mark.timeout(180)
def test_the_failed_round_on_the_store_names_todays_cause(procs: Procs) -> None:
    port = free_port()
    procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name="store")
    wait_for(lambda: "listening" in (procs.tmp / "store.out").read_text(), 30, "the store")
    run_dir = procs.tmp / "run-a"
    _yesterday(run_dir)
    (procs.tmp / "exit3.py").write_text(SCRIPT)
    p = procs.start(
        [
            *node_args(f"127.0.0.1:{port}", "a", run_dir, nproc=1, nnodes="1:2"),
            "--max-restarts",
            "0",
            "--tee",
            "3",
            "exit3.py",
        ],
        name="a",
        env={"FLEXRUN_JOB_SECRET_FILE": "", "FLEXRUN_JOB_SECRET": ""},
    )
    assert p.wait(timeout=150) == 3, procs.stderr("a")
    _check_today(procs, run_dir, "a")
    store = TcpStore("127.0.0.1", port, connect_timeout_s=10)
    try:
        entry = store.get(Keys("job").round)
        assert entry is not None
        rnd = RoundRecord.decode(entry.value)
    finally:
        store.close()
    assert rnd.state == FAILED and rnd.root_cause is not None, rnd
    assert rnd.root_cause.exit_code == 3 and "OLD" not in json.dumps(rnd.root_cause.to_dict())
