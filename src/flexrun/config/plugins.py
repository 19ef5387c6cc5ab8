"""torchrun's plugin registries, looked up the way torchrun looks them up.

Owns the entry-point look-ups (``importlib.metadata``) of the two groups torchrun reads:
``torchrun.logs_specs`` (``--logs-specs NAME``: a ``LogsSpecs`` class deciding where each
worker's stdout, stderr and error file go) and ``torchrun.handlers`` (a rendezvous backend
NAME whose value builds a torch ``RendezvousHandler``). flexrun honours the first (the
agent builds the class as torchrun does and asks it for the paths) and cannot use the
second (its rendezvous runs over its own store records, not a torch handler): that one is
named in one clear error. It also holds torchrun's event-log handler names.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from flexrun.errors import ConfigError

LOGS_SPECS_GROUP = "torchrun.logs_specs"
HANDLERS_GROUP = "torchrun.handlers"
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")
"""The names in torch's ``torch.distributed.elastic.events.handlers`` registry."""


def find(group: str, name: str) -> metadata.EntryPoint | None:
    """The installed entry point ``name`` of ``group`` (None when no package declares it)."""
    for ep in metadata.entry_points(group=group):
        if ep.name == name:
            return ep
    return None


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f" from {dist.metadata['Name']}" if dist is not None else ""


def logs_specs_class(name: str) -> Any:
    """Load ``--logs-specs NAME`` (a ``torch.distributed.elastic.multiprocessing.LogsSpecs``
    subclass), as torchrun does.

    Raises:
        ConfigError: no such entry point, it cannot be imported, or it is not a LogsSpecs.
    """
    ep = find(LOGS_SPECS_GROUP, name)
    if ep is None:
        raise ConfigError(
            f"--logs-specs {name!r}: no entry point {LOGS_SPECS_GROUP}:{name} is installed "
            "(a package declares it in its entry points, as for torchrun)"
        )
    try:
        cls = ep.load()
    except Exception as exc:  # a third-party import may fail in any way: report it as input
        raise ConfigError(
            f"--logs-specs {name}: cannot load {ep.value}{_dist_name(ep)} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    from torch.distributed.elastic.multiprocessing import LogsSpecs

    if not (isinstance(cls, type) and issubclass(cls, LogsSpecs)):
        raise ConfigError(
            f"--logs-specs {name}: {ep.value} is not a LogsSpecs subclass (torchrun requires one)"
        )
    return cls


def rendezvous_handler_refusal(backend: str) -> str | None:
    """The one-line refusal for a ``--rdzv-backend`` that is a torchrun plugin (else None)."""
    ep = find(HANDLERS_GROUP, backend)
    if ep is None:
        return None
    return (
        f"--rdzv-backend {backend}: a torchrun rendezvous plugin ({HANDLERS_GROUP}:{backend} = "
        f"{ep.value}{_dist_name(ep)}); flexrun's rendezvous runs over its own store and cannot "
        "drive a torch RendezvousHandler: use --rdzv-backend c10d (a tcp store, or `flexrun "
        "store`), static, or etcd-v3, or launch this job with torchrun"
    )


def check_event_log_handler(name: str) -> str:
    """``--event-log-handler``: one of torch's registered names.

    Raises:
        ConfigError: a name torch's registry does not have (torchrun fails at the end of
            the job with a KeyError; flexrun says so before it starts).
    """
    if name not in EVENT_LOG_HANDLERS:
        raise ConfigError(
            f"--event-log-handler {name!r}: torch's registry has {', '.join(EVENT_LOG_HANDLERS)}"
        )
    return name
