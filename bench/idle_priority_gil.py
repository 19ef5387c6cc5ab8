"""What a background thread at SCHED_IDLE does to its own process when other processes keep
the cores busy: the longest pause of the main thread and of a heartbeat thread.

Why (issue 32's Python 3.12 run, 2026-12-06): a live worker was killed as hung (no heartbeat
for 3.2 s) while its checkpoint persist ran at ``SCHED_IDLE`` (``persist_when_idle``). A
thread at idle priority gets almost no CPU while anything else is runnable; when the
scheduler takes the core from it while it holds the interpreter's lock (GIL), every other
thread of the process waits for that lock until the node has a core to spare.

The background thread here does what a persist does between its C calls: Python-level work
(pickling a nested object). Each variant runs for ``--seconds`` beside ``--hogs`` busy
processes (``while True: pass``), at idle priority and at normal priority.

    python bench/idle_priority_gil.py --hogs 3 --seconds 15
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import threading
import time


def _hog() -> None:
    while True:
        pass


def _variant(idle: bool, seconds: float) -> tuple[int, float, float]:
    """(main loop iterations, longest main-thread pause, longest heartbeat interval)."""
    stop = threading.Event()
    beats: list[float] = []

    def heartbeat() -> None:
        last = time.monotonic()
        while not stop.wait(0.5):
            now = time.monotonic()
            beats.append(now - last)
            last = now

    def background() -> None:
        if idle:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        obj = [{"k": i, "v": list(range(50))} for i in range(20000)]
        while not stop.is_set():
            pickle.loads(pickle.dumps(obj))

    threads = [threading.Thread(target=f, daemon=True) for f in (heartbeat, background)]
    for t in threads:
        t.start()
    t0 = last = time.monotonic()
    n, worst = 0, 0.0
    while last - t0 < seconds:
        sum(range(20000))
        n += 1
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    stop.set()
    for t in threads:
        t.join(30)
    return n, worst, max(beats, default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=3, help="busy processes beside the measured one")
    ap.add_argument("--seconds", type=float, default=15.0, help="per variant")
    a = ap.parse_args()
    if a.hogs < 0 or a.seconds <= 0:
        ap.error("--hogs must be >= 0 and --seconds > 0")
    print(f"cpus {os.cpu_count()}, busy processes beside this one: {a.hogs}")
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    try:
        for idle in (True, False):
            n, main_gap, beat_gap = _variant(idle, a.seconds)
            label = "SCHED_IDLE  " if idle else "SCHED_OTHER "
            print(
                f"background thread at {label}: main loop iterations {n}, longest main-thread "
                f"pause {main_gap:.2f} s, longest heartbeat interval {beat_gap:.2f} s (0.5 s asked)"
            )
    finally:
        for h in hogs:
            h.terminate()
            h.join(10)


if __name__ == "__main__":
    main()
