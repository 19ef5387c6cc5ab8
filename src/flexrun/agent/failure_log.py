"""What the agent tells its user about a failure: the console lines and the launcher's error file.

Owns the wording of a live-mode replacement or give-up, and a failed job's root cause on
stderr (and in ``--launcher-error-file``'s file when set); it does not decide anything (the
policy and the rendezvous do) nor count restarts.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from flexrun.agent.error_file import write_launcher_error_file
from flexrun.cause import FailureCause
from flexrun.recovery import RecoverySettings
from flexrun.rendezvous import Exit
from flexrun.rendezvous.state import FAILED, RoundRecord

log = logging.getLogger("flexrun.agent")


def log_live_failure(cause: FailureCause, rec: RoundRecord, recovery: RecoverySettings) -> None:
    """What a live-mode failure did: replaced (survivors keep running) or, with the
    restarts spent, left out."""
    who = cause.worker_id or cause.rank
    if rec.state == FAILED:
        log.error(
            "worker %s failed (%s); restarts exhausted (%d allowed%s): not replacing it",
            who,
            cause.describe(),
            recovery.max_restarts,
            _window(recovery.restart_window_s),
        )
        return
    log.warning(
        "worker %s failed (%s): %s; replacing it, survivors keep running "
        "(failure %d of at most %d%s)",
        who,
        cause.describe(),
        cause.message,
        rec.restarts,
        recovery.max_restarts,
        _window(recovery.restart_window_s),
    )


def _window(window_s: float) -> str:
    return f" per {window_s:g}s window" if window_s > 0 else ""


def report_failure(action: Exit, error_file: Path | None, wall: float) -> None:
    """A failed job's root cause on stderr, and in the launcher's own error file if set."""
    _print_root_cause(action.root_cause, action.reason)
    if action.root_cause is not None and error_file is not None:
        write_launcher_error_file(error_file, action.root_cause, timestamp=wall)


def _print_root_cause(cause: FailureCause | None, reason: str) -> None:
    if cause is None:
        print(f"flexrun: {reason}", file=sys.stderr)
        return
    if cause.kind == "node_lost":  # a whole node, not one worker
        print(f"flexrun: {reason}. Root cause: {cause.message}", file=sys.stderr)
        return
    sig = f" ({cause.signal})" if cause.signal else ""
    print(
        f"flexrun: {reason}. Root cause: rank {cause.rank} on node {cause.node} "
        f"exited with code {cause.exit_code}{sig}: {cause.message or 'no message'}",
        file=sys.stderr,
    )
    tb = cause.traceback.strip()
    if tb:
        print("flexrun: traceback of the failing rank:\n" + tb, file=sys.stderr)
    if cause.log_dir:
        print(f"flexrun: logs: {cause.log_dir}", file=sys.stderr)
