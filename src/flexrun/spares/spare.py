"""A warm spare worker: ``python -m flexrun.spares.spare`` (or a fork server of them).

Owns only what makes a spare warm: Python, torch and ``flexrun.train`` imported before an
agent needs a worker. The hand-over itself (an assignment on stdin: the worker's
environment, argv and entry point; end of stdin without one: exit 0) is
:func:`flexrun.spares.become.serve_assignment`. With ``--fork-server`` the process is a
pool's zygote instead: it pays these imports once and forks each spare
(:func:`flexrun.spares.forks.serve_forks`); its spares keep this command line.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch  # (the point of a spare: pay these imports before they are needed)
import torch.distributed  # noqa: F401

import flexrun.train.live  # noqa: F401
from flexrun import worker_hook
from flexrun.spares.become import serve_assignment
from flexrun.spares.forks import serve_forks
from flexrun.spares.protocol import FORK_SERVER_FLAG


def _size_threads(env: Mapping[str, str]) -> None:
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # torch sized its thread pool from the spare's environment at import.
        torch.set_num_threads(int(threads))


def _prepare(env: Mapping[str, str]) -> None:
    _size_threads(env)
    worker_hook.adopt()  # (the progress hook a cold worker gets from its sitecustomize)


def main() -> int:
    if sys.argv[1:] == [FORK_SERVER_FLAG]:
        return serve_forks(prepare=_prepare)
    return serve_assignment(prepare=_prepare)


if __name__ == "__main__":
    sys.exit(main())
