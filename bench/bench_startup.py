"""Job start: flexrun vs torchrun, same workload, one run, columns interleaved.

One node (``--standalone --nproc-per-node N``), no failure: from starting the launcher to
the moment every rank has completed its first step ("first step"), to its exit ("wall"),
and the CPU the launcher and everything it started and reaped used ("CPU": the launcher's
own and its reaped descendants', from ``wait4``). Columns:

* ``torchrun``: ``python -m torch.distributed.run``, stdin ``/dev/null``;
* ``flexrun (stdin /dev/null)``: ``flexrun run``, default flags, as under a batch system or
  a pod: the first workers are forked from the warm pool's zygote (one ``import torch``);
* ``flexrun (stdin a pipe)``: the same with stdin a pipe that is never written, as from a
  terminal or a shell pipeline: the first workers start cold and inherit it, as torchrun's.

Workload: ``tests/integration/scripts/ddp_steps.py`` (torchrun-style DDP on gloo, one JSON
progress line per completed step), ``--steps`` steps of ``--step-time`` seconds. Every
process a trial starts is killed at its end (``bench_recovery.Procs`` semantics: its
session, then any descendant seen); every wait is bounded.

    python bench/bench_startup.py --trials 5 --nproc 2,4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from bench_recovery import FLEXRUN, TORCHRUN, read_progress

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "integration" / "scripts" / "ddp_steps.py"
COLUMNS = ("torchrun", "flexrun (stdin /dev/null)", "flexrun (stdin a pipe)")
TIMEOUT_S = 180.0


@dataclass
class Trial:
    ok: bool
    first_step_s: float | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    note: str = ""


def _command(column: str, n: int, d: Path, a: argparse.Namespace) -> list[str]:
    work = [str(WORKLOAD), "--steps", str(a.steps), "--step-time", str(a.step_time),
            "--progress", str(d / "progress.jsonl")]  # fmt: skip
    if column == "torchrun":
        return [*TORCHRUN, "--standalone", "--nproc-per-node", str(n), *work]
    return [*FLEXRUN, "--standalone", "--nproc-per-node", str(n), "--run-dir", str(d / "run"),
            *work]  # fmt: skip


def _kill_tree(p: subprocess.Popen, seen: dict[int, psutil.Process]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    for proc in seen.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(seen.values()), timeout=10)


def trial(column: str, n: int, base: Path, k: int, a: argparse.Namespace) -> Trial:
    d = base / f"{column.split()[0]}-{'pipe' if 'pipe' in column else 'null'}-{n}-{k}"
    d.mkdir(parents=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    seen: dict[int, psutil.Process] = {}
    with open(d / "launcher.log", "wb") as log:
        t0 = time.monotonic()
        wall0 = time.time()
        p = subprocess.Popen(
            _command(column, n, d, a),
            stdin=subprocess.PIPE if "pipe" in column else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=d,
            start_new_session=True,
        )
    status = rusage = None
    try:
        while time.monotonic() - t0 < TIMEOUT_S:
            with contextlib.suppress(psutil.Error):
                for kid in psutil.Process(p.pid).children(recursive=True):
                    seen.setdefault(kid.pid, kid)
            pid, status, rusage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.02)
        else:
            return Trial(False, note=f"no exit in {TIMEOUT_S:.0f} s")
        wall = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if p.stdin is not None:
            p.stdin.close()
        _kill_tree(p, seen)
    rows = read_progress(d / "progress.jsonl")
    last = {r["rank"] for r in rows if r["step"] == a.steps - 1}
    if p.returncode != 0 or last != set(range(n)):
        return Trial(False, note=f"exit {p.returncode}, ranks done {sorted(last)}")
    firsts: dict[int, float] = {}
    for r in rows:
        if r["step"] == 0:
            firsts[r["rank"]] = min(r["ts"], firsts.get(r["rank"], r["ts"]))
    cpu = rusage.ru_utime + rusage.ru_stime
    return Trial(True, max(firsts.values()) - wall0, wall, cpu)


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f}" if xs else "     -"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--nproc", default="2,4", help="comma-separated --nproc-per-node values")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=0.05)
    a = ap.parse_args()
    counts = [int(x) for x in a.nproc.split(",")]
    print(f"# bench_startup: {' '.join(sys.argv[1:]) or '(defaults)'}; python "
          f"{sys.version.split()[0]}; {os.cpu_count()} CPUs")  # fmt: skip
    failed = 0
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for n in counts:
            results: dict[str, list[Trial]] = {c: [] for c in COLUMNS}
            for k in range(a.trials):
                order = COLUMNS[k % 3 :] + COLUMNS[: k % 3]  # (the order rotates)
                for column in order:
                    t = trial(column, n, Path(tmp), k, a)
                    results[column].append(t)
                    failed += not t.ok
                    print(f"  N={n} trial {k} {column:26s} "
                          + (f"first step {t.first_step_s:5.2f} s  wall {t.wall_s:5.2f} s  "
                             f"CPU {t.cpu_s:5.1f} s" if t.ok else f"FAILED: {t.note}"),
                          flush=True)  # fmt: skip
            print(f"\nN={n}, median of {a.trials}    first step     wall      CPU   "
                  "first step / torchrun's")  # fmt: skip
            ref = [t.first_step_s for t in results["torchrun"] if t.first_step_s is not None]
            for column in COLUMNS:
                ts = [t for t in results[column] if t.ok]
                mine = [t.first_step_s for t in ts if t.first_step_s is not None]
                ratio = (
                    f"{statistics.median(mine) / statistics.median(ref):.2f}x"
                    if mine and ref
                    else "-"
                )
                print(f"  {column:26s} {_median(mine)} s  {_median([t.wall_s or 0.0 for t in ts])} s "
                      f"{_median([t.cpu_s or 0.0 for t in ts])} s   {ratio}   "
                      f"({len(ts)}/{a.trials} ok)")  # fmt: skip
            print()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
