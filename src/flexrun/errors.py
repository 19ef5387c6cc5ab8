"""The one exception tree of flexrun.

Owns every exception type the library raises on purpose (and the two control-flow
signals of live mode's workers, :class:`LiveAborted` and :class:`TrainingFinished`). I/O boundaries translate
foreign errors into these (``raise StoreUnavailable(...) from exc``); the CLI turns any
:class:`FlexrunError` into one line on stderr and exit code 2. Anything else that escapes
is a bug and keeps its traceback.
"""

from __future__ import annotations


class FlexrunError(Exception):
    """Base of every error flexrun raises deliberately."""


class ConfigError(FlexrunError):
    """Bad user input: flags, environment, spec files. Message names the problem and the fix."""


class StoreError(FlexrunError):
    """A key-value store operation failed."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (refused, timed out, closed)."""


class StoreTimeout(StoreError):
    """A bounded wait on the store expired."""


class RendezvousError(FlexrunError):
    """The rendezvous could not complete."""


class RendezvousTimeout(RendezvousError):
    """Not enough nodes arrived before the join timeout."""


class AgentError(FlexrunError):
    """The elastic agent could not run its workers (a worker process could not start)."""


class LiveAborted(FlexrunError):
    """Live mode, in a worker: the current membership epoch ended under a step (a member
    died or the membership changed); the worker re-forms with the next epoch."""


class TrainingFinished(FlexrunError):
    """Live mode, in a worker: not a failure. The job's members completed every step while
    this worker waited to join (a replacement that came too late leaves quietly)."""


class CheckpointError(FlexrunError):
    """A checkpoint could not be saved, verified or loaded."""


class StorageFailure(CheckpointError):
    """A checkpoint file operation failed because of the storage itself: full, over quota,
    failing or read-only (``errno`` says which). A later save may well succeed, so the
    Checkpointer counts these (``max_failed_saves``) instead of stopping training.

    Also importable as ``flexrun.train.storage.StorageFailure``.
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code

    @property
    def reason(self) -> str:
        """The errno's symbolic name (``ENOSPC``, ``EIO`` ...)."""
        import errno

        return errno.errorcode.get(self.errno, str(self.errno))


class FencedError(CheckpointError):
    """A checkpoint writer from an older round tried to write after a newer round claimed
    the directory (a straggler), or lost a conditional write to a newer round's.

    Also importable as ``flexrun.train.FencedError`` and ``flexrun.train.commit.FencedError``.
    """


class PreconditionFailed(CheckpointError):
    """A conditional object write or delete lost: the object exists, or changed since it
    was read (HTTP 412 on S3). The commit protocol turns it into FencedError or retries."""


class SpecError(ConfigError):
    """A spec file (Kubernetes job, pipeline) is invalid; the message names the field."""


class SparesError(FlexrunError):
    """An exchange with a node's warm interpreters (``flexrun spares``) failed."""


class SparesUntrusted(SparesError):
    """The spares directory or a socket in it is not this user's alone (wrong owner or mode,
    a symlink, not a directory, a peer of another uid): nothing is sent to it."""


class SparesProtocolError(SparesError):
    """A request or reply on a spares socket (or a spare's assignment) is malformed."""


class JobFailed(FlexrunError):
    """A job started through the Python API (``flexrun.launch``, ``flexrun.cli.main``)
    ended in failure, as torch's ``ChildFailedError``: ``exit_code`` is the agent's exit
    code; ``rank``, ``exc_type``, ``exc_message`` and ``remote_traceback`` describe the
    root cause as the failing rank reported it (empty when it left no record, e.g. killed by
    a signal); ``failures`` maps every rank that reported an exception to
    ``(exc_type, exc_message, remote_traceback)``."""

    def __init__(
        self,
        summary: str,
        *,
        exit_code: int,
        rank: int | None = None,
        exc_type: str = "",
        exc_message: str = "",
        remote_traceback: str = "",
        failures: dict[int, tuple[str, str, str]] | None = None,
    ) -> None:
        super().__init__(summary)
        self.exit_code = exit_code
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.failures = dict(failures or {})

    def __str__(self) -> str:
        text = str(self.args[0]) if self.args else ""
        if self.remote_traceback:
            text += "\n\nTraceback of the failing rank:\n" + self.remote_traceback.rstrip()
        return text
