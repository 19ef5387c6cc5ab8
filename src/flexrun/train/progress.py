"""Step progress for the agent's hang detection and crash-loop control, and stacks on demand.

Owns the script-facing side of :mod:`flexrun.worker_hook`: :func:`report_progress`
counts a step in the progress file the agent names in ``FLEXRUN_PROGRESS_FILE`` (the hook
already counts ``torch.optim`` steps by itself; calling this too is for loops without a
torch optimizer), and :func:`install_stack_dump` makes sure :mod:`faulthandler` dumps all
threads' stacks to ``FLEXRUN_STACK_FILE`` on SIGUSR2. Under ``flexrun run`` both are
normally installed before the script runs; importing ``flexrun.train`` does nothing by
itself. Under torchrun (no ``FLEXRUN_PROGRESS_FILE``) both are no-ops.
"""

from __future__ import annotations

from flexrun import worker_hook


def report_progress(step: int | None = None) -> None:
    """Tell the agent this rank completed a step (call once per training step)."""
    if not worker_hook.installed():
        worker_hook.install()
    worker_hook.step()


def install_stack_dump() -> bool:
    """Dump all threads' stacks to ``FLEXRUN_STACK_FILE`` on SIGUSR2 (with the progress
    hook that tells the agent so). Idempotent."""
    return worker_hook.installed() or worker_hook.install()
