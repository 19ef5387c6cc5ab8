"""Helpers of the library-integration tests: ``flexrun run`` of a worker script beside this
file, the sample logs it writes, and the exactly-once check. Every process is reaped."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[2] / "src"


def needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        bool(missing),
        reason=f"{', '.join(missing)} not installed (pip install 'flexrun[integrations]')",
    )


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ACCELERATE_"))}
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), e.get("PYTHONPATH", "")])
    e.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return e


def flexrun_cmd(tmp: Path, nproc: int, script: str, *args: str) -> list[str]:
    run_dir = tmp / f"run{len(list(tmp.glob('run*')))}"
    return [sys.executable, "-m", "flexrun", "run", "--nproc-per-node", str(nproc),
            "--max-restarts", "0", "--run-dir", str(run_dir), "--", str(HERE / script),
            *args]  # fmt: skip


def run(tmp: Path, nproc: int, script: str, *args: str, timeout: float = 200) -> str:
    """Run to the end; assert exit 0; the combined output."""
    p = subprocess.Popen(
        flexrun_cmd(tmp, nproc, script, *args), cwd=tmp, env=env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        reap(p)
    assert p.returncode == 0, out[-4000:]
    return out


def reap(p: subprocess.Popen[str]) -> None:
    """Kill the process's session if it is still there, and wait for it."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # (it ended meanwhile)
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def trained(log_prefix: Path, steps_per_epoch: int) -> dict[int, collections.Counter]:
    """(epoch -> sample id -> times trained) from every process's ``<step> <ids...>`` log."""
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in log_prefix.parent.glob(f"{log_prefix.name}.*"):
        for line in path.read_text().splitlines():
            step, *ids = map(int, line.split())
            seen[step // steps_per_epoch].update(ids)
    return seen


def assert_each_once(seen: dict[int, collections.Counter], epochs: int, n: int) -> None:
    assert sorted(seen) == list(range(epochs)), sorted(seen)
    for epoch, counts in seen.items():
        missing = sorted(set(range(n)) - set(counts))
        twice = sorted(i for i, c in counts.items() if c > 1)
        assert not missing and not twice, f"epoch {epoch}: missing {missing}, twice {twice}"
