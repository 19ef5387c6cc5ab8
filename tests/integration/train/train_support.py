"""Real-process helpers for flexrun.train integration tests; every process is reaped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flexrun.testing.ports import free_port

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "train_elastic.py"
HERE = Path(__file__).resolve().parent


def wait_until(pred: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Group:
    """World-size-N worker processes started with the torchrun environment."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
        self.procs = procs
        self.logs = logs

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"workers did not finish in {timeout}s:\n{self.output()}"
                ) from None
        return codes

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)
        for p in self.procs:
            p.wait(30)

    def output(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs if log.exists()
        )


class Launcher:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.groups: list[Group] = []
        self._n = 0

    def start(
        self,
        world: int,
        args: list[str],
        *,
        script: Path = EXAMPLE,
        env: dict[str, str] | None = None,
        restart_count: int = 0,
    ) -> Group:
        port = free_port()
        self._n += 1
        procs, logs = [], []
        for rank in range(world):
            e = dict(os.environ)
            e.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT=str(restart_count),
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            )
            e.update(env or {})
            log = self.tmp / f"launch{self._n}-rank{rank}.log"
            logs.append(log)
            with log.open("wb") as fh:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script), *args],
                        env=e,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        cwd=REPO,
                    )
                )
        g = Group(procs, logs)
        self.groups.append(g)
        return g

    def close(self) -> None:
        for g in self.groups:
            g.kill()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    lau = Launcher(tmp_path)
    try:
        yield lau
    finally:
        lau.close()
