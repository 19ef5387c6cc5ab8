"""A warm spare worker: ``python -m flexrun.spares.spare`` (or a fork server of them).

Owns only what makes a spare warm: Python, torch and ``flexrun.train`` imported before an
agent needs a worker, and the modules the run names (``--spare-preload``, passed as
:data:`~flexrun.spares.protocol.PRELOAD_ENV`): imported by name, nothing else, with CUDA
left uninitialised (a forked CUDA context is unusable: a preload that initialises it ends
the spare, and the worker starts cold). The hand-over itself (an assignment on stdin: the worker's
environment, argv and entry point; end of stdin without one: exit 0) is
:func:`flexrun.spares.become.serve_assignment`. With ``--fork-server`` the process is a
pool's zygote instead: it pays these imports once and forks each spare
(:func:`flexrun.spares.forks.serve_forks`); its spares keep this command line.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping

import torch  # (the point of a spare: pay these imports before they are needed)
import torch.distributed  # noqa: F401

import flexrun.train.live  # noqa: F401
from flexrun import worker_hook
from flexrun.spares.become import serve_assignment
from flexrun.spares.forks import serve_forks
from flexrun.spares.protocol import FORK_SERVER_FLAG, PRELOAD_ENV

_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _size_threads(env: Mapping[str, str]) -> None:
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # torch sized its thread pool from the spare's environment at import.
        torch.set_num_threads(int(threads))


def _prepare(env: Mapping[str, str]) -> None:
    _size_threads(env)
    worker_hook.adopt()  # (the progress hook a cold worker gets from its sitecustomize)


def preload(names: str) -> int:
    """Import each of the comma-separated ``names``; 0, or 3 when one initialised CUDA.

    A module that fails to import is reported on stderr (the spare's log) and skipped: the
    worker imports it again and fails with its own traceback. While importing,
    ``torch.cuda.is_available()`` asks NVML, not the driver (``cuInit`` in a process that
    forks leaves its children no usable CUDA).
    """
    saved = os.environ.get(_NVML_CHECK)
    os.environ[_NVML_CHECK] = "1"
    try:
        for name in filter(None, (n.strip() for n in names.split(","))):
            try:
                importlib.import_module(name)
            except Exception as exc:  # the user's module: any error, reported, not fatal
                print(f"flexrun spare: preload of {name} failed: {exc!r}", file=sys.stderr)
                continue
            if torch.cuda.is_initialized():
                print(
                    f"flexrun spare: importing {name} initialised CUDA, which a forked spare "
                    "cannot use; not keeping this spare",
                    file=sys.stderr,
                )
                return 3
    finally:
        if saved is None:
            os.environ.pop(_NVML_CHECK, None)
        else:
            os.environ[_NVML_CHECK] = saved
    return 0


def main() -> int:
    names = os.environ.pop(PRELOAD_ENV, "")
    if names:
        code = preload(names)
        if code:
            return code
    if sys.argv[1:] == [FORK_SERVER_FLAG]:
        return serve_forks(prepare=_prepare)
    return serve_assignment(prepare=_prepare)


if __name__ == "__main__":
    sys.exit(main())
