"""One attempt of a stage as a process session: console, log file, timeout, clean stop.

Owns starting a stage's argv in its own session in the run directory, streaming its
output line by line to ``logs/<stage>.log`` and to the console with a ``[stage]`` prefix,
waiting with a per-attempt timeout, stopping its whole process tree on a stop request
(SIGTERM, grace, SIGKILL), and stopping every attempt still running on the way out. It
does not decide what runs or how often (``runner``); the state file is updated through
the ``on_start`` callback.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TextIO

import psutil

from flexrun.pipeline import _proc

#: (exit code, "exited" | "timeout" | "interrupted")
Outcome = tuple[int, str]


class Console:
    """The runner's console: whole lines, never interleaved between threads."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out or sys.stdout
        self._lock = threading.Lock()

    def say(self, message: str) -> None:
        """A line from the runner itself (``[pipeline] ...``)."""
        self.line("pipeline", message)

    def line(self, source: str, text: str) -> None:
        with self._lock:
            print(f"[{source}] {text}", file=self._out, flush=True)


class Attempts:
    """Runs attempts (one per stage at a time) and can stop all of them."""

    def __init__(
        self, run_dir: Path, console: Console, stop: threading.Event, stop_grace_s: float
    ) -> None:
        self.run_dir = run_dir
        self.console = console
        self._stop = stop
        self._grace_s = stop_grace_s
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def run(
        self,
        name: str,
        argv: list[str],
        env: Mapping[str, str],
        *,
        attempt: int,
        timeout_s: float,
        on_start: Callable[[int, float], None],
    ) -> Outcome:
        """Run one attempt of stage ``name``; ``on_start(pid, create_time)`` once it runs."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        with log_path.open("ab") as log:
            log.write(f"=== attempt {attempt} at {time.ctime()}: {' '.join(argv)}\n".encode())
            log.flush()
            try:
                proc = _proc.start(argv, cwd=self.run_dir, env=env)
            except OSError as exc:
                log.write(f"cannot start: {exc}\n".encode())
                self.console.say(f"{name}: cannot start {argv[0]!r}: {exc.strerror}")
                return 127, "exited"
            with self._lock:
                self._procs[name] = proc
            try:
                created = psutil.Process(proc.pid).create_time()
            except psutil.Error:
                created = time.time()
            on_start(proc.pid, created)
            reader = threading.Thread(target=self._pump, args=(name, proc.stdout, log), daemon=True)
            reader.start()
            rc, how = self._wait(proc, timeout_s)
            reader.join(timeout=5)
            if reader.is_alive():  # a background child still holds the pipe: end the session
                _proc.stop_tree(proc, 1.0, signal.SIGKILL)
                reader.join(timeout=5)
            with self._lock:
                self._procs.pop(name, None)
        return (128 - rc if rc < 0 else rc), how

    def _wait(self, proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return proc.wait(timeout=0.1), "exited"
            except subprocess.TimeoutExpired:
                pass
            if self._stop.is_set():
                return _proc.stop_tree(proc, self._grace_s), "interrupted"
            if time.monotonic() >= deadline:
                return _proc.stop_tree(proc, self._grace_s), "timeout"

    def _pump(self, name: str, stream: IO[bytes] | None, log: IO[bytes]) -> None:
        if stream is None:
            return
        with stream:
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                self.console.line(name, raw.decode(errors="replace").rstrip("\n"))

    def stop_all(self) -> None:
        """Stop every attempt still running (SIGTERM, grace, SIGKILL)."""
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                _proc.stop_tree(proc, self._grace_s)
