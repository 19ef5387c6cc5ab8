"""A warm spare worker: Python and torch already imported, waiting for an assignment.

Owns only the hand-over: the agent starts ``python -m flexrun.train.spare`` ahead of need;
when a live worker dies, it writes one JSON line to the spare's stdin (the worker's
environment, argv and entry point) and the spare becomes that worker without paying the
interpreter and torch start-up again. End of stdin without an assignment: exit 0.

A spare started by a node's ``flexrun spares`` daemon (not by the agent that assigns it)
also gets the agent's pid, its working directory and where to record its exit code: it
then dies with that agent instead of with the daemon (its parent), and its exit code
survives the daemon.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys

import torch  # (the point of a spare: pay these imports before they are needed)
import torch.distributed  # noqa: F401

import flexrun.train.live  # noqa: F401
from flexrun.agent.adopt import die_with, exit_code_of, record_exit


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
    if task.get("cwd"):
        os.chdir(task["cwd"])
    for entry in reversed(task["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)  # the spare's own PYTHONPATH may have been another
    if task.get("agent_pid"):
        die_with(int(task["agent_pid"]))
    threads = task["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # torch sized its thread pool from the spare's environment at import.
        torch.set_num_threads(int(threads))
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the assignment channel is done)
    entry = task["entry"]
    sys.argv = [entry, *task["args"]]
    record = task.get("exit_record")
    try:
        if task.get("module"):
            runpy.run_module(entry, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))
            runpy.run_path(entry, run_name="__main__")
    except SystemExit as exc:
        if record:
            record_exit(record, exit_code_of(exc.code))
        raise
    except KeyboardInterrupt:
        if record:
            record_exit(record, -signal.SIGINT)
        raise
    except BaseException:
        if record:
            record_exit(record, 1)
        raise
    if record:
        record_exit(record, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
