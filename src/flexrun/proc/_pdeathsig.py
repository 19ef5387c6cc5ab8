"""Exec shim: ``python -I -S _pdeathsig.py PARENT_PID COMMAND...``.

Sets ``PR_SET_PDEATHSIG`` = SIGKILL, checks that the parent is still ``PARENT_PID`` (it may
have died before the setting took effect), then replaces itself with ``COMMAND`` (same
pid; the death signal survives ``execve``). This is what ``preexec_fn`` did between fork
and exec; run as a process of its own it is safe from a threaded parent, which
``preexec_fn`` is not (Python's documentation warns that it can deadlock the child).
Standard library only, no site: it costs a bare interpreter start, tens of
milliseconds.
"""

import ctypes
import os
import sys

_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def main() -> None:
    parent = int(sys.argv[1])
    command = sys.argv[2:]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the agent's own stop path still reaps its workers
    if os.getppid() != parent:
        os._exit(137)  # the parent died before the death signal was armed
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"flexrun: cannot start {command[0]!r}: {exc.strerror}\n")
        os._exit(127)


if __name__ == "__main__":
    main()
