"""A warm spare worker: Python and torch already imported, waiting for an assignment.

Owns only the hand-over: the agent starts ``python -m flexrun.train.spare`` ahead of need;
when a live worker dies, it writes one JSON line to the spare's stdin (the worker's
environment, argv and entry point) and the spare becomes that worker without paying the
interpreter and torch start-up again. End of stdin without an assignment: exit 0.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch  # (the point of a spare: pay these imports before they are needed)
import torch.distributed  # noqa: F401

import flexrun.train.live  # noqa: F401


def main() -> int:
    ready = os.environ.get("FLEXRUN_SPARE_READY")
    if ready:
        with open(ready, "w") as fh:
            fh.write(str(os.getpid()))
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    task = json.loads(line)
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        if task.get(stream):
            # The worker's own log file for its rank, as if it had been started fresh.
            target = os.open(task[stream], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
    os.environ.clear()
    os.environ.update(task["env"])
    threads = task["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # torch sized its thread pool from the spare's environment at import.
        torch.set_num_threads(int(threads))
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the assignment channel is done)
    entry = task["entry"]
    sys.argv = [entry, *task["args"]]
    if task.get("module"):
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))
        runpy.run_path(entry, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
