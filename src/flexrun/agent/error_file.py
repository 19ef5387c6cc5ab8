"""The launcher's own error file (``TORCHELASTIC_ERROR_FILE`` set for flexrun itself).

Owns the record a failed job leaves there: torch's error-file format (what
``torch.distributed.elastic.multiprocessing.errors.ErrorHandler`` writes and a scheduler
such as TorchX reads), ``{"message": {"message", "extraInfo": {"py_callstack",
"timestamp"}, "errorCode"}}``, built from the job's root cause. torchrun copies the failed
worker's own error file there (with ``errorCode`` set to its exit code); the root cause
carries that file's message and traceback, so the record says the same. Unlike torchrun,
a failure without a worker error file (a signal, an exit code) is written too, with the
line flexrun prints and the stderr tail it read as the call stack.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from flexrun.cause import FailureCause

log = logging.getLogger(__name__)


def torch_error_record(cause: FailureCause, *, timestamp: float) -> dict[str, Any]:
    """The root cause ``cause`` in torch's error-file format."""
    return {
        "message": {
            "message": cause.message or cause.describe(),
            "extraInfo": {
                "py_callstack": cause.traceback,
                "timestamp": str(int(timestamp)),
            },
            "errorCode": cause.exit_code,
        }
    }


def write_launcher_error_file(path: Path, cause: FailureCause, *, timestamp: float) -> bool:
    """Write ``cause`` to ``path`` (replacing what was there, as torch does); False, with a
    warning, when it cannot be written (the job's exit code is what matters then)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(torch_error_record(cause, timestamp=timestamp)))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not write the root cause to TORCHELASTIC_ERROR_FILE %s: %s", path, exc)
        if tmp.is_file():
            tmp.unlink()
        return False
    return True
