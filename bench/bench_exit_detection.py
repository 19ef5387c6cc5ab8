"""How soon the agent acts on a worker's death: two source trees side by side, interleaved.

One node, ``--standalone --nproc-per-node 2`` (restart mode, default warm pool, stdin
``/dev/null``: the workers are forked from the pool's zygote), the workload
``tests/integration/scripts/ddp_steps.py``. Once every rank has logged ``--warm-steps``
steps, rank 1 is killed (SIGKILL) at a random instant; the agent's event log then gives,
relative to the kill: ``worker_exited`` (the agent saw the death), ``restart`` (the other
worker stopped, the failure counted, a new round begun) and the first ``worker_started``
of the new round (a warm spare assigned). Each trial's directory and processes are removed
at its end (``bench_recovery.Procs``); every wait is bounded.

``--src DIR`` names a tree's ``src`` (repeatable; default: this checkout's), so a change can
be measured against the commit before it in one run:

    git worktree add /tmp/before HEAD~1
    python bench/bench_exit_detection.py --trials 10 --src /tmp/before/src --src src
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_recovery import FLEXRUN, Procs, read_progress

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "integration" / "scripts" / "ddp_steps.py"
PHASES = ("worker_exited", "restart", "worker_started")
TIMEOUT_S = 120.0


def _trial(src: Path, a: argparse.Namespace, rng: random.Random) -> dict[str, float] | str:
    with tempfile.TemporaryDirectory(prefix="exitdet-") as tmp:
        d = Path(tmp)
        procs = Procs(d)
        progress = d / "progress.jsonl"
        cmd = [*FLEXRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
               "--run-dir", str(d / "run"), str(WORKLOAD), "--steps", str(a.warm_steps + 40),
               "--step-time", str(a.step_time), "--progress", str(progress)]  # fmt: skip
        try:
            agent = procs.start("agent", cmd, {"PYTHONPATH": str(src)})
            deadline = time.monotonic() + TIMEOUT_S
            rows: list[dict] = []
            while time.monotonic() < deadline:
                rows = read_progress(progress)
                if {r["rank"] for r in rows if r["step"] >= a.warm_steps} == {0, 1}:
                    break
                time.sleep(0.02)
            else:
                return "no steps"
            time.sleep(rng.uniform(0, a.step_time))  # (anywhere in a step)
            victim = [r["pid"] for r in rows if r["rank"] == 1][-1]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            if agent.wait(timeout=TIMEOUT_S) != 0:
                return f"exit {agent.returncode}"
            events = [json.loads(x) for x in (d / "run" / "events.jsonl").read_text().splitlines()]
            seen: dict[str, float] = {}
            for e in events:
                if e["ts"] >= killed and e["event"] in PHASES:
                    seen.setdefault(e["event"], e["ts"] - killed)
            return seen if len(seen) == len(PHASES) else f"events missing: {sorted(seen)}"
        finally:
            procs.kill_all()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--src", type=Path, action="append", help="a tree's src (repeatable)")
    p.add_argument("--warm-steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.trials < 1 or a.warm_steps < 1 or a.step_time <= 0:
        p.error("--trials and --warm-steps must be >= 1, --step-time > 0")
    srcs = [s.resolve() for s in (a.src or [ROOT / "src"])]
    for s in srcs:
        if not (s / "flexrun" / "__init__.py").is_file():
            p.error(f"--src {s}: no flexrun package there")
    rng = random.Random(a.seed)
    results: dict[Path, list[dict[str, float]]] = {s: [] for s in srcs}
    failed: dict[Path, list[str]] = {s: [] for s in srcs}
    for i in range(a.trials):
        for s in srcs[i % len(srcs) :] + srcs[: i % len(srcs)]:  # (the order rotates)
            r = _trial(s, a, rng)
            if isinstance(r, dict):
                results[s].append(r)
            else:
                failed[s].append(r)
            print(f"trial {i} {s}: {r}", file=sys.stderr, flush=True)
    print(f"kill -9 of one of 2 workers -> agent event, s (median / mean / max of {a.trials})")
    for s in srcs:
        rows = results[s]
        cells = []
        for ph in PHASES:
            xs = [r[ph] for r in rows]
            cells.append(
                f"{ph} {statistics.median(xs):.3f} / {statistics.mean(xs):.3f} / {max(xs):.3f}"
                if xs
                else f"{ph} -"
            )
        print(f"{s}  ok {len(rows)}/{a.trials}  " + "  ".join(cells))
        for why in failed[s]:
            print(f"  failed: {why}")
    return 0 if not any(failed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
