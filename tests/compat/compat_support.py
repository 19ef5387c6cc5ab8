"""The differential harness: one case, run under torchrun and under ``flexrun run``.

A :class:`Case` is a launcher command line (torchrun's options), the worker script and its
arguments, extra environment, and how many agents ("nodes") to start. :class:`Runner` runs
it under both launchers at once (each in its own directory, on its own free ports), once
per session, and keeps what each saw: exit code, console output, the probes the workers
wrote (``scripts/probe.py``: one JSON per rank) and the files under ``--log-dir``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest

from flexrun.testing.ports import free_port

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
PROBE = SCRIPTS / "probe.py"
SRC = HERE.parents[1] / "src"
LAUNCHERS = ("torchrun", "flexrun")
TORCH = version("torch")
_TORCH_MINOR = tuple(int(x) for x in TORCH.split("+")[0].split(".")[:2])


def torchrun_2_13(why: str) -> pytest.MarkDecorator:
    """Skip a case whose reference is a torchrun 2.13 behaviour the installed torchrun
    lacks: flexrun follows torch 2.13's launcher on purpose, whatever torch is installed."""
    return pytest.mark.skipif(
        _TORCH_MINOR < (2, 13), reason=f"torchrun {TORCH} {why}; flexrun follows torchrun 2.13"
    )


OLD_DEFAULT_BACKEND = torchrun_2_13(
    "runs its static backend on 127.0.0.1:29500 without rendezvous flags (2.13: c10d on "
    "localhost:0, MASTER_ADDR=localhost)"
)
NO_SHUTDOWN_TIMEOUT = torchrun_2_13("has no --shutdown-timeout")
WORKER_LINE = re.compile(r"(?:out|err) line \d+ rank \d+.*|trained .*|stdin said .*|handshake .*")


def squatted_port() -> tuple[int, socket.socket]:
    """A free port P and an unrelated socket listening on P + 1 that never answers."""
    for _ in range(50):
        port = free_port()
        squatter = socket.socket()
        try:
            squatter.bind(("0.0.0.0", port + 1))
        except OSError:
            squatter.close()
            continue
        squatter.listen(8)
        return port, squatter
    raise AssertionError("no free pair of ports")


@dataclass(frozen=True)
class Case:
    """One command line, as a torchrun user would type it."""

    name: str
    args: tuple[str, ...] = ()
    """Launcher options; ``{port}`` is replaced by a free port (one per launcher)."""
    script: str = str(PROBE)
    script_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    nodes: tuple[tuple[str, ...], ...] = ((),)
    """Extra options of each agent (one entry per agent started)."""
    stdin: str | None = None
    """Text piped to the agent's stdin (None: /dev/null)."""
    node_env: tuple[Mapping[str, str], ...] = ()
    """Extra environment of each agent (``PET_NODE_RANK`` per node, say)."""
    pty: bool = False
    """Run the (single) agent on a pseudo-terminal: stdin, stdout and stderr."""
    timeout: float = 120.0
    squat_next_port: bool = False
    """An unrelated process listens on ``{port}`` + 1 while the case runs."""
    action: Callable[[Run, list[subprocess.Popen[str]]], None] | None = None
    """Called once the agents run (e.g. to signal them); it may wait for probes."""


@dataclass
class Run:
    """What one launcher did with a case."""

    launcher: str
    workdir: Path
    port: str = ""
    """The free port its ``{port}`` placeholders became."""
    rc: list[int] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    squatter: socket.socket | None = field(default=None, repr=False)

    @property
    def probe_dir(self) -> Path:
        return self.workdir / "probe"

    @property
    def probes(self) -> dict[int, dict]:
        out = {}
        for p in sorted(self.probe_dir.glob("*.json")):
            data = json.loads(p.read_text())
            out[int(data["env"]["RANK"])] = data
        return out

    def worker_lines(self, stream: str = "stdout") -> list[str]:
        """Worker output lines on the console, with any ``[...]:`` prefix kept."""
        text = self.stdout if stream == "stdout" else self.stderr
        return [ln for ln in text.replace("\r", "\n").splitlines() if WORKER_LINE.search(ln)]

    def bare_worker_lines(self, stream: str = "stdout") -> list[str]:
        """The same lines without prefixes, sorted (workers interleave freely)."""
        return sorted(
            m.group(0) for ln in self.worker_lines(stream) if (m := WORKER_LINE.search(ln))
        )

    def files(self, under: str) -> dict[str, str]:
        """Relative path -> text of every file below ``workdir/under``."""
        root = self.workdir / under
        return {
            str(p.relative_to(root)): p.read_text(errors="replace")
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }


def _command(launcher: str, args: list[str], script: str, script_args: list[str]) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *args, script, *script_args]
    return [sys.executable, "-m", "flexrun", "run", *args, script, *script_args]


def base_env(workdir: Path, extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), str(SCRIPTS)]),
        PROBE_OUT=str(workdir / "probe"),
        # torch 2.13's shared rendezvous store is unreliable after a restart (docs/user/running.md)
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        TMPDIR=str(workdir / "tmp"),  # torchrun's default log dir goes there, not /tmp
        COMPAT_SENTINEL="from-the-parent",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def kill_tree(proc: subprocess.Popen[str]) -> None:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for k in kids:
        with contextlib.suppress(psutil.NoSuchProcess):
            k.kill()


def start(case: Case, launcher: str, workdir: Path) -> tuple[Run, list[subprocess.Popen[str]]]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tmp").mkdir(exist_ok=True)
    squatter = None
    if case.squat_next_port:
        number, squatter = squatted_port()
        port = str(number)
    else:
        port = str(free_port())
    env = base_env(
        workdir,
        {
            k: v.replace("{port}", port).replace("{workdir}", str(workdir))
            for k, v in case.env.items()
        },
    )
    procs = []
    if case.pty:
        return _start_on_pty(case, launcher, workdir, env)
    for i, node in enumerate(case.nodes):
        args = [
            a.replace("{port}", port).replace("{workdir}", str(workdir))
            for a in (*case.args, *node)
        ]
        cmd = _command(
            launcher, args, case.script.replace("{workdir}", str(workdir)), list(case.script_args)
        )
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=workdir,
                env=dict(env, **(case.node_env[i] if case.node_env else {})),
                stdin=subprocess.PIPE if case.stdin is not None else subprocess.DEVNULL,
                stdout=(workdir / f"stdout.{i}").open("w"),
                stderr=(workdir / f"stderr.{i}").open("w"),
                text=True,
                start_new_session=True,
            )
        )
    if case.stdin is not None:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(case.stdin)
            p.stdin.close()
    return Run(launcher, workdir, port=port, squatter=squatter), procs


class _PtyReader(threading.Thread):
    """Copies the terminal's output to ``path``; touches ``seen`` once ``marker`` shows."""

    def __init__(self, fd: int, path: Path, marker: bytes, seen: Path) -> None:
        super().__init__(daemon=True)
        self.fd, self.path, self.marker, self.seen = fd, path, marker, seen

    def run(self) -> None:
        data = b""
        with self.path.open("wb") as out:
            while True:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out.write(chunk)
                out.flush()
                data += chunk
                if self.marker in data and not self.seen.exists():
                    self.seen.parent.mkdir(parents=True, exist_ok=True)
                    self.seen.touch()


def _start_on_pty(
    case: Case, launcher: str, workdir: Path, env: dict[str, str]
) -> tuple[Run, list[subprocess.Popen[str]]]:
    master, slave = pty.openpty()
    args = [a.replace("{workdir}", str(workdir)) for a in case.args]
    proc = subprocess.Popen(
        _command(launcher, args, case.script, list(case.script_args)),
        cwd=workdir,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        text=True,
        start_new_session=True,
    )
    os.close(slave)
    (workdir / "stderr.0").write_text("")
    reader = _PtyReader(
        master, workdir / "stdout.0", b"step 1/3", workdir / "probe" / "progress_seen"
    )
    reader.start()
    proc.pty_reader = reader  # type: ignore[attr-defined]
    proc.pty_master = master  # type: ignore[attr-defined]
    return Run(launcher, workdir), [proc]


def finish(case: Case, run: Run, procs: list[subprocess.Popen[str]], deadline: float) -> Run:
    try:
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(p)
                p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
                p.wait(timeout=30)
        if run.squatter is not None:
            run.squatter.close()
    for p in procs:
        reader = getattr(p, "pty_reader", None)
        if reader is not None:
            reader.join(timeout=10)
            with contextlib.suppress(OSError):
                os.close(p.pty_master)  # type: ignore[attr-defined]
    run.rc = [p.returncode for p in procs]
    run.stdout = "".join((run.workdir / f"stdout.{i}").read_text() for i in range(len(procs)))
    run.stderr = "".join((run.workdir / f"stderr.{i}").read_text() for i in range(len(procs)))
    return run


def run_case(case: Case, root: Path) -> dict[str, Run]:
    """Both launchers, started together; each waited for up to ``case.timeout``."""
    started = {name: start(case, name, root / name) for name in LAUNCHERS}
    deadline = time.monotonic() + case.timeout
    try:
        if case.action is not None:
            for run, procs in started.values():
                case.action(run, procs)
    finally:
        out = {name: finish(case, run, procs, deadline) for name, (run, procs) in started.items()}
    return out


def wait_for_probes(run: Run, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(run.probe_dir.glob("*.json"))) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{run.launcher}: {count} probes not written in {timeout}s")
        time.sleep(0.05)


class Runner:
    """Runs each case once per session (several checks share a run)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, dict[str, Run]] = {}

    def __call__(self, case: Case) -> dict[str, Run]:
        if case.name not in self._done:
            self._done[case.name] = run_case(case, self.root / case.name)
        return self._done[case.name]
