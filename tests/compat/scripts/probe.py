"""The compat suite's worker: records what a torchrun worker sees, then does what it is told.

Writes ``$PROBE_OUT/<RANK>.json`` (the launcher's variables, argv, ``__file__``, cwd, TTYs)
and then, as its options say: prints lines, fails, raises under torch's ``@record``, draws
a ``\\r`` progress bar, trains with gloo, reads stdin. Imports torch only when it must, so
most cases cost the launchers' own start-up only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

WATCHED = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "COMPAT_SENTINEL", "COMPAT_PYTHON_EXEC",
)  # fmt: skip


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--exit", type=int, default=0, help="exit with this code ...")
    p.add_argument("--exit-rank", type=int, default=None, help="... on this rank only")
    p.add_argument("--raise", dest="raise_", action="store_true", help="raise under @record")
    p.add_argument("--lines", type=int, default=0, help="print N lines to stdout and stderr")
    p.add_argument("--progress", action="store_true", help="a \\r progress bar, handshaking")
    p.add_argument("--train", type=int, default=0, help="N all-reduce steps with gloo")
    p.add_argument("--stdin", action="store_true", help="read one line from stdin")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--fail-once", type=int, default=0, help="exit N on the first attempt only")
    p.add_argument("--kill-self", action="store_true", help="SIGKILL itself (after recording)")
    p.add_argument("--note-signal", default="", help="record this signal's arrival, then exit")
    p.add_argument("rest", nargs="*")
    return p.parse_known_args()[0]


def say(line: str, stream: TextIO = sys.stdout) -> None:
    """One line in one write: workers sharing a console never split each other's lines."""
    stream.write(line + "\n")
    stream.flush()


def record(out: Path) -> None:
    env = {k: os.environ[k] for k in WATCHED if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("TORCHELASTIC_")})
    info = {
        "env": env,
        "argv": sys.argv,
        "file": __file__,
        "cwd": os.getcwd(),
        "name": __name__,
        "stdin_tty": os.isatty(0),
        "stdout_tty": os.isatty(1),
        "stdin_open": _stdin_kind(),
        "executable": os.path.basename(sys.executable),
        "elastic_launched": os.getenv("TORCHELASTIC_RUN_ID") is not None,
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{os.environ.get('RANK', 'x')}.json.tmp"
    tmp.write_text(json.dumps(info, sort_keys=True))
    tmp.rename(out / f"{os.environ.get('RANK', 'x')}.json")


def _stdin_kind() -> str:
    try:
        st = os.fstat(0)
    except OSError:
        return "closed"
    import stat

    if stat.S_ISCHR(st.st_mode):
        return "tty" if os.isatty(0) else "chardev"
    return "pipe" if stat.S_ISFIFO(st.st_mode) else "file"


def progress(rank: str) -> None:
    """Draw ``\\r``-updated steps; step 1 waits (10 s at most) until the test has seen it."""
    seen = Path(os.environ["PROBE_OUT"]) / "progress_seen"
    sys.stdout.write(f"\rstep 1/3 rank{rank}")
    sys.stdout.flush()
    deadline = time.monotonic() + 10
    while not seen.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.write(f"\rstep 2/3 rank{rank}\rstep 3/3 rank{rank}\n")
    sys.stdout.write("handshake ok\n" if seen.exists() else "handshake timed out\n")
    sys.stdout.flush()


def note_signal(name: str, rank: str) -> None:
    """Write ``signal_<rank>`` when ``name`` arrives; wait 30 s at most for it."""

    def handler(signum: int, frame: object) -> None:
        (Path(os.environ["PROBE_OUT"]) / f"signal_{rank}").write_text(signal.Signals(signum).name)
        sys.exit(0)

    signal.signal(getattr(signal, name), handler)
    (Path(os.environ["PROBE_OUT"]) / f"armed_{rank}").touch()
    time.sleep(30)


def train(steps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(4)
    for _ in range(steps):
        dist.all_reduce(t)
        t /= dist.get_world_size()
    say(f"trained {steps} world {dist.get_world_size()} rank {dist.get_rank()}")
    dist.destroy_process_group()


def main() -> None:
    a = _args()
    rank = os.environ.get("RANK", "x")
    record(Path(os.environ["PROBE_OUT"]))
    for i in range(a.lines):
        say(f"out line {i} rank {rank} apple" if i % 2 else f"out line {i} rank {rank}")
        say(f"err line {i} rank {rank} orange", sys.stderr)
    if a.fail_once and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        sys.exit(a.fail_once)
    if a.kill_self and rank == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if a.note_signal:
        note_signal(a.note_signal, rank)
    if a.stdin:
        say(f"stdin said {sys.stdin.readline().strip()!r}")
    if a.progress:
        progress(rank)
    if a.train:
        train(a.train)
    if a.sleep:
        time.sleep(a.sleep)
    if a.raise_:
        from torch.distributed.elastic.multiprocessing.errors import record as torch_record

        @torch_record
        def fail() -> None:
            raise ValueError(f"probe failure on rank {rank}")

        if a.exit_rank is None or str(a.exit_rank) == rank:
            fail()
    if a.exit and (a.exit_rank is None or str(a.exit_rank) == rank):
        sys.exit(a.exit)


if __name__ == "__main__":
    main()
