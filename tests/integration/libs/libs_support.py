"""Helpers of the library-integration tests: ``flexrun run`` of a worker script beside this
file, the sample logs it writes, and the exactly-once check. Every process is reaped."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def last_step(log_prefix: Path) -> int:
    """The newest step any process logged (``<step> <ids...>`` lines), -1 before the first."""
    steps = [int(line.split()[0]) for p in log_prefix.parent.glob(f"{log_prefix.name}.*")
             for line in p.read_text().splitlines()]  # fmt: skip
    return max(steps, default=-1)


def sigterm_after(tmp: Path, script: str, log_prefix: Path, *args: str) -> tuple[int, str]:
    """Start 2 workers of ``script``, SIGTERM the agent once step 3 was logged; (exit, output)."""
    agent = subprocess.Popen(
        flexrun_cmd(tmp, 2, script, *args), cwd=tmp, env=env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while last_step(log_prefix) < 3 and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.poll() is None, agent.communicate()[0][-4000:]
        assert last_step(log_prefix) >= 3, "no step 3 within 150 s"
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=60)
    finally:
        reap(agent)
    return agent.returncode, output


def worker_preempted(run_dir: Path) -> dict[str, Any]:
    """The one ``preempted`` event a worker (not the agent) wrote in ``run_dir``."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (pre,) = [e for e in events if e["event"] == "preempted" and "rank" in e]
    return pre


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
