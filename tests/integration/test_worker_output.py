"""Worker output as torchrun gives it, and never at the mercy of the log disk.

- A terminal stays a terminal (issue 21 item 3): under a pseudo-terminal, a worker of
  ``flexrun run --nproc-per-node 1`` sees ``isatty()`` on stdout and stderr, a ``\\r``
  progress bar reaches the console at once (before any newline) and tqdm's bar arrives
  byte for byte as under torchrun.
- A full log disk (issue 20 item 6): with ``--log-dir`` on a full tmpfs the workers' every
  print succeeds, the job ends with exit 0, the agent says once that it drops log lines,
  and logging resumes when space returns.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BAR_SCRIPT = """
import os, sys, time
from tqdm import tqdm
# one write: workers run unbuffered (python -u, as under torchrun), so print()'s pieces would
# be separate writes, and the agent's own lines on the terminal may fall between them
sys.stdout.write(f"ISATTY {sys.stdout.isatty()} {sys.stderr.isatty()}\\n")
sys.stdout.flush()
sys.stderr.write("\\rPING")
sys.stderr.flush()
go, deadline = os.environ["GO_FILE"], time.time() + 30
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.02)
print("SAW_GO" if os.path.exists(go) else "NO_GO", flush=True)
for _ in tqdm(range(5), bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}", mininterval=0):
    time.sleep(0.05)
"""


def _env(tmp: Path, go: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    env["GO_FILE"] = str(go)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _run_in_pty(argv: list[str], env: dict[str, str], cwd: Path, go: Path) -> bytes:
    """Run ``argv`` on a 100x30 pseudo-terminal; touch ``go`` once "PING" was seen there."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, start_new_session=True
    )
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                break
            if not chunk:
                break
            out += chunk
            if b"PING" in out and not go.exists():
                go.touch()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        os.close(master)
    assert proc.returncode == 0, out[-3000:]
    return out


def _bar(out: bytes) -> bytes:
    """tqdm's bytes: from its first frame to its last (all on one line, \\r between)."""
    start = out.index(b"  0%|")
    end = out.index(b"5/5", start) + 3
    return out[out.rindex(b"\r", 0, start) : end]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["restart", "live"])
def test_a_progress_bar_on_a_terminal_updates_in_place_as_under_torchrun(
    tmp_path: Path, mode: str
) -> None:
    # (Live mode's worker is a warm spare: it opens the agent's pseudo-terminal by path.)
    pytest.importorskip("tqdm")
    script = tmp_path / "bar.py"
    script.write_text(textwrap.dedent(BAR_SCRIPT))
    outs = {}
    for name, argv in {
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "flexrun": [
            *(sys.executable, "-m", "flexrun", "run", "--mode", mode),
            *("--run-dir", str(tmp_path / "run")),
        ],
    }.items():
        go = tmp_path / f"go-{name}"
        cmd = [*argv, "--standalone", "--nproc-per-node", "1", str(script)]
        outs[name] = _run_in_pty(cmd, _env(tmp_path, go), tmp_path, go)
    for name, out in outs.items():
        isatty = [line for line in out.splitlines() if b"ISATTY" in line]
        assert b"ISATTY True True" in out, (name, isatty, out[:3000])
        # "\rPING" had no newline: it reached the terminal at once, or the worker would
        # have waited in vain for the test to see it.
        assert b"SAW_GO" in out, (name, out[-2000:])
        bar = _bar(out)
        assert b"\n" not in bar and bar.count(b"\r") >= 6, (name, bar)
    assert _bar(outs["flexrun"]) == _bar(outs["torchrun"])
    # The per-rank log still has everything the worker wrote.
    logs = [p for p in (tmp_path / "run").rglob("stderr.log") if "spares" not in p.parts]
    assert len(logs) == 1 and _bar(logs[0].read_bytes()) == _bar(outs["torchrun"])


# -- a full log disk ------------------------------------------------------------------------
STEP_SCRIPT = """
import os, sys, time
rank = os.environ["RANK"]
go = os.environ["GO_FILE"]
for step in range(40):
    print(f"step {step} of rank {rank}", flush=True)
    print(f"err {step} of rank {rank}", file=sys.stderr, flush=True)
    if step == 19:
        deadline = time.time() + 60
        while not os.path.exists(go) and time.time() < deadline:
            time.sleep(0.02)
    time.sleep(0.01)
"""


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A 256 KiB tmpfs filled up: (mount point, the filler file to delete for space)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        (mnt / "logs").mkdir()
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0")
        finally:
            os.close(fd)
        yield mnt, filler
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["restart", "live"])
def test_workers_print_through_a_full_log_disk_and_logging_resumes(
    tmp_path: Path, full_tmpfs: tuple[Path, Path], mode: str
) -> None:
    # (Live mode's first workers are warm spares: their output goes the same way.)
    mnt, filler = full_tmpfs
    script = tmp_path / "steps.py"
    script.write_text(textwrap.dedent(STEP_SCRIPT))
    go = tmp_path / "go"
    cmd = [
        sys.executable, "-m", "flexrun", "run", "--standalone", "--nproc-per-node", "2",
        "--run-dir", str(tmp_path / "run"), "--log-dir", str(mnt / "logs"), "--mode", mode,
        str(script),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path, go), cwd=tmp_path
    )
    stdout: list[bytes] = []
    stderr: list[bytes] = []
    readers = [
        threading.Thread(target=lambda f=f, sink=sink: sink.extend(f), daemon=True)
        for f, sink in ((proc.stdout, stdout), (proc.stderr, stderr))
    ]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        seen = b"".join(stdout)
        if b"step 19 of rank 0" in seen and b"step 19 of rank 1" in seen:
            break
        time.sleep(0.05)
    time.sleep(0.3)  # (the agent has tried, and failed, to log step 19)
    filler.unlink()  # space returns ...
    go.touch()  # ... and the workers print on
    assert proc.wait(timeout=120) == 0, b"".join(stderr)[-3000:]
    for t in readers:
        t.join(timeout=10)
    out, err = b"".join(stdout).decode(), b"".join(stderr).decode()
    for rank in (0, 1):
        assert f"step 39 of rank {rank}" in out  # the console saw every line
        assert f"err 39 of rank {rank}" in err
    assert err.count("cannot write worker logs") == 1, err
    assert "worker logs are written again" in err
    logs = [p.read_text() for p in mnt.rglob("stdout.log") if "spares" not in p.parts]
    for rank in (0, 1):
        (text,) = [t for t in logs if f"of rank {rank}" in t]
        assert "step 39 of rank" in text  # logging resumed ...
        assert not re.search(r"^step 5 of rank", text, re.M)  # ... what the full disk lost
