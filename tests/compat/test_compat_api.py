"""The Python API (issue 21 item 4): ``main(argv)`` and a launch with a callable entrypoint.

torchrun users call ``torch.distributed.run.main(argv)`` (returns on success, raises on a
failed job) and ``elastic_launch(config, fn)(*args)`` (per-rank return values). Each case
runs a small driver in a fresh interpreter under both APIs and compares what it printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from compat_support import PROBE, base_env

TORCH_MAIN = """
import sys, torch.distributed.run as run
try:
    result = run.main(sys.argv[1:])
    print("RESULT", repr(result))
except BaseException as exc:
    print("RAISED", type(exc).__name__)
"""
FLEXRUN_MAIN = """
import sys, flexrun.cli as cli
try:
    result = cli.main(sys.argv[1:])
    print("RESULT", repr(result))
except BaseException as exc:
    print("RAISED", type(exc).__name__)
"""
TORCH_CALLABLE = """
import json, os
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
def work(x):
    return int(os.environ["RANK"]) * 10 + x
if __name__ == "__main__":
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                       rdzv_endpoint="localhost:0", run_id="api", max_restarts=0)
    print("RESULT", json.dumps({str(k): v for k, v in elastic_launch(cfg, work)(1).items()}))
"""
FLEXRUN_CALLABLE = """
import json, os
import flexrun
def work(x):
    return int(os.environ["RANK"]) * 10 + x
if __name__ == "__main__":
    out = flexrun.launch(work, 1, nproc_per_node=2)
    print("RESULT", json.dumps({str(k): v for k, v in out.items()}))
"""


def _drive(code: str, argv: list[str], tmp: Path) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tmp").mkdir(exist_ok=True)
    driver = tmp / "driver.py"
    driver.write_text(textwrap.dedent(code))
    env = base_env(tmp, {})
    res = subprocess.run(
        [sys.executable, str(driver), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("RESULT", "RAISED"))]
    assert lines, (res.returncode, res.stdout[-1500:], res.stderr[-1500:])
    return lines[-1]


@pytest.mark.timeout(300)
def test_main_returns_none_on_success_like_torchs(tmp_path: Path) -> None:
    argv = ["--standalone", str(PROBE)]
    assert _drive(TORCH_MAIN, argv, tmp_path / "t") == "RESULT None"
    ours = _drive(FLEXRUN_MAIN, ["run", *argv], tmp_path / "f")
    assert ours in ("RESULT None", "RESULT 0")  # flexrun.cli.main returns the exit code


@pytest.mark.timeout(300)
def test_main_raises_on_a_failed_job_like_torchs(tmp_path: Path) -> None:
    argv = ["--standalone", str(PROBE), "--exit", "3"]
    assert _drive(TORCH_MAIN, argv, tmp_path / "t") == "RAISED ChildFailedError"
    assert _drive(FLEXRUN_MAIN, ["run", *argv], tmp_path / "f").startswith("RAISED")


@pytest.mark.timeout(300)
def test_a_callable_entrypoint_returns_every_ranks_value(tmp_path: Path) -> None:
    theirs = _drive(TORCH_CALLABLE, [], tmp_path / "t")
    assert json.loads(theirs.split(" ", 1)[1]) == {"0": 1, "1": 11}
    ours = _drive(FLEXRUN_CALLABLE, [], tmp_path / "f")
    # (torch's dict is in the order the ranks finished: compare the values, not the text)
    assert json.loads(ours.split(" ", 1)[1]) == json.loads(theirs.split(" ", 1)[1]), (
        os.linesep.join([theirs, ours])
    )
