"""Helpers for integration tests: real processes, real signals, always cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path

import psutil
import pytest
from filelock import FileLock

from flexrun.testing.etcd_server import MISSING, EtcdCluster, etcd_binary
from flexrun.testing.ports import free_port

SCRIPTS = Path(__file__).parent / "scripts"
DDP_STEPS = SCRIPTS / "ddp_steps.py"


def wait_for(
    pred: Callable[[], object], timeout: float, what: str, interval: float = 0.1
) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def worlds_after(progress: Path, ts: float) -> set[int]:
    """World sizes seen in progress lines written after ``ts``."""
    return {r["world"] for r in read_progress(progress) if r["ts"] > ts}


def read_events(run_dir: Path) -> list[dict]:
    p = run_dir / "events.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive_pids(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _worker_stacks(tree: list[psutil.Process]) -> list[str]:
    """The Python stacks of every worker in ``tree`` whose flexrun hook holds a stacks file
    open (the hook answers SIGUSR2 by dumping all its threads there; a process without
    that file open may have no handler, and SIGUSR2 would kill it)."""
    dumped: list[tuple[int, Path]] = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            for f in p.open_files():
                if f.path.endswith("stacks.txt"):
                    os.kill(p.pid, signal.SIGUSR2)
                    dumped.append((p.pid, Path(f.path)))
    if not dumped:
        return []
    time.sleep(1.0)  # (faulthandler writes from the signal handler, at once)
    lines = []
    for pid, path in dumped:
        lines.append(f"stacks of {pid} ({path}):")
        with contextlib.suppress(OSError):
            lines += path.read_text(errors="replace").splitlines()[-60:]
    return lines


class Procs:
    """Starts flexrun processes and guarantees they (and their trees) are gone afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []
        self.tree: set[int] = set()

    def start(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        name: str = "p",
        stdin: int | None = None,
    ) -> subprocess.Popen[str]:
        """``python -m flexrun ARGS``; ``stdin``: as Popen's (None: this process's own)."""
        full_env = dict(os.environ)
        full_env.update(env or {})
        out = open(self.tmp / f"{name}.out", "w")  # noqa: SIM115
        err = open(self.tmp / f"{name}.err", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "flexrun", *args],
            stdin=stdin,
            stdout=out,
            stderr=err,
            text=True,
            env=full_env,
            start_new_session=True,
            cwd=self.tmp,
        )
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def stderr(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def wait(self, proc: subprocess.Popen[str], timeout: float) -> int:
        """``proc``'s exit code; past ``timeout``, an AssertionError saying what was still
        running (each process of its tree with its state), the tail of its stderr and of
        its run directory's events, so a hang in CI explains itself."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        name = getattr(proc, "name", "p")
        lines = [f"{name} (pid {proc.pid}) still running after {timeout}s; its tree:"]
        tree: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):  # (it may end while this looks)
            tree = [psutil.Process(proc.pid), *descendants(proc.pid)]
        for p in tree:
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.cmdline())[:160]
                lines.append(f"  {p.pid} {p.status()} threads={p.num_threads()} {cmd}")
        lines += _worker_stacks(tree)
        for events in sorted(self.tmp.glob(f"**/{name}/events.jsonl")):
            lines.append(f"last events of {events}:")
            lines += events.read_text().splitlines()[-12:]
        lines.append("stderr tail:")
        lines.append(self.stderr(name)[-3000:])
        raise AssertionError("\n".join(lines))

    def remember_tree(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.tree.update(c.pid for c in descendants(p.pid))

    def cleanup(self) -> None:
        self.remember_tree()
        for p in self.procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, sig)
            p.wait(timeout=30)
        for pid in alive_pids(sorted(self.tree)):
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.cleanup()


class SharedRuns:
    """Fault-free reference runs made once per test session and shared by every test that
    asks for the same key, across pytest-xdist's workers (a file lock in the directory they
    share). A reference is the same job whichever test compares against it, and on a 2-core
    machine each costs tens of CPU seconds; a test's own runs (the ones with the faults) are
    never shared."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, key: str, make: Callable[[Procs], Path]) -> Path:
        """The path ``make`` returned for ``key``: ``make`` runs the job with a
        :class:`Procs` in a directory of its own (the first caller; the others wait on the
        lock, then reuse it). A ``make`` that raises caches nothing: the next caller runs
        it again and fails on its own."""
        assert key.replace("-", "").replace("_", "").isalnum(), key
        self.root.mkdir(parents=True, exist_ok=True)
        done = self.root / f"{key}.done"
        with FileLock(str(self.root / f"{key}.lock")):
            if not done.exists():
                workdir = self.root / key
                shutil.rmtree(workdir, ignore_errors=True)
                workdir.mkdir()
                procs = Procs(workdir)
                try:
                    result = make(procs)
                finally:
                    procs.cleanup()
                done.write_text(str(result))
            return Path(done.read_text())


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    base = tmp_path_factory.getbasetemp()
    # (each xdist worker's base is a directory of the run's own: their parent is shared)
    return SharedRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared")


@pytest.fixture
def store_server(procs: Procs) -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name="store")
    wait_for(
        lambda: "listening" in (procs.tmp / "store.out").read_text(), 30, "flexrun store to listen"
    )
    yield "127.0.0.1", port
    proc.terminate()
    proc.wait(timeout=10)


def scrape_metrics(port: int) -> dict[str, float]:
    """One scrape of an agent's Prometheus endpoint on loopback: sample name -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


_VOID_TAGS = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
)


class HtmlTables(HTMLParser):
    """The rows of every table (cell text as written, whitespace kept) and the ``src`` of
    every image of an HTML page. With ``balanced=True`` every end tag must close the
    innermost open element (an AssertionError says where not); ``stack`` then holds what
    is still open, ``[]`` for a well-formed page after ``close()``."""

    def __init__(self, *, balanced: bool = False) -> None:
        super().__init__()
        self.balanced = balanced
        self.stack: list[str] = []
        self.images: list[str] = []
        self.rows: list[list[str]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    @property
    def stripped_rows(self) -> list[list[str]]:
        return [[c.strip() for c in row] for row in self.rows]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in _VOID_TAGS:
            self.stack.append(tag)
        if tag == "img":
            self.images.append(dict(attrs).get("src") or "")
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if self.balanced:
            assert self.stack and self.stack[-1] == tag, (
                f"unbalanced </{tag}> after {self.stack[-3:]}"
            )
        if self.stack and self.stack[-1] == tag:
            self.stack.pop()
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


HB = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=60"
"""Fast keep-alives and short windows for multi-agent tests (``--rdzv-conf``)."""


def endless(script: Path, progress: Path) -> list[str]:
    """A training script's arguments to run until stopped (0.05 s steps), logging progress."""
    return [str(script), "--steps", "100000", "--step-time", "0.05", "--progress", str(progress)]


def node_args(
    endpoint: str,
    name: str,
    run_dir: Path,
    *,
    nproc: int,
    nnodes: str = "1:2",
    backend: str = "c10d",
    conf: str = HB,
) -> list[str]:
    """``flexrun run`` arguments of one agent as one node of job ``job`` (no script yet)."""
    return [
        "run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "job",
        "--rdzv-conf",
        conf,
        "--node-id",
        name,
        "--run-dir",
        str(run_dir),
    ]


@pytest.fixture(params=["tcp", "etcd"])
def endpoint(request: pytest.FixtureRequest, procs: Procs) -> Iterator[tuple[str, str]]:
    """(backend, endpoint) of a store the job and the stranger share."""
    if request.param == "tcp":
        port = free_port()
        proc = procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name="store")
        wait_for(lambda: "listening" in (procs.tmp / "store.out").read_text(), 30, "the store")
        yield "c10d", f"127.0.0.1:{port}"
        proc.terminate()
        proc.wait(timeout=10)
        return
    if etcd_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; CI must run the etcd tests")
        pytest.skip(MISSING)
    with EtcdCluster(procs.tmp / "etcd") as cluster:
        yield "etcd-v3", cluster.endpoint_arg
