"""Issue 33: a restart-mode worker never holds a secret's value in its environment (the
job secret, the etcd password), and the run directory and worker logs are its owner's
only (0700 / 0600)."""

from __future__ import annotations

import json
import stat

import pytest
from support import Procs

SCRIPT = """
import json, os, sys
raw = open("/proc/self/environ", "rb").read()
print("worker log line")
open(sys.argv[1], "w").write(json.dumps({
    "names": sorted(os.environ),
    "in_proc_environ": [n for n in ("FLEXRUN_JOB_SECRET", "FLEXRUN_ETCD_PASSWORD")
                        if (n + "=").encode() in raw],
}))
"""
SECRET = "s3cr3t-" + "x" * 40


@pytest.mark.timeout(180)
def test_a_restart_mode_worker_gets_no_secret_and_its_run_dir_is_private(procs: Procs) -> None:
    (procs.tmp / "look.py").write_text(SCRIPT)
    out = procs.tmp / "env.json"
    run_dir = procs.tmp / "run"
    p = procs.start(
        ["run", "--standalone", "--run-dir", str(run_dir), "look.py", str(out)],
        env={"FLEXRUN_JOB_SECRET": SECRET, "FLEXRUN_ETCD_PASSWORD": "pw-value"},
        name="a",
    )
    assert procs.wait(p, 150) == 0, procs.stderr("a")
    got = json.loads(out.read_text())
    assert "FLEXRUN_JOB_SECRET" not in got["names"], got
    assert "FLEXRUN_ETCD_PASSWORD" not in got["names"], got
    assert got["in_proc_environ"] == [], got
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    files = [f for f in run_dir.rglob("*") if f.is_file()]
    logs = [f for f in files if f.suffix in (".log", ".jsonl")]
    assert logs, files
    loose = {str(f.relative_to(run_dir)): oct(stat.S_IMODE(f.stat().st_mode)) for f in logs}
    assert all(m == "0o600" for m in loose.values()), loose
    for f in files:
        assert SECRET.encode() not in f.read_bytes(), f
