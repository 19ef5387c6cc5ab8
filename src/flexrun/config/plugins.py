"""torchrun's plugin registries, looked up the way torchrun looks them up.

Owns the entry-point look-ups (``importlib.metadata``) of the two groups torchrun reads:
``torchrun.logs_specs`` (``--logs-specs NAME``: a ``LogsSpecs`` class deciding where each
worker's stdout, stderr and error file go) and ``torchrun.handlers`` (a rendezvous backend
NAME whose value builds a torch ``RendezvousHandler``). flexrun honours the first (found
here; the agent loads and builds the class as torchrun does and asks it for the paths) and cannot use the
second (its rendezvous runs over its own store records, not a torch handler): that one is
named in one clear error. It also holds torchrun's event-log handler names.
"""

from __future__ import annotations

from importlib import metadata

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


def logs_specs_entry(name: str) -> metadata.EntryPoint:
    """The installed ``--logs-specs NAME`` entry point (not loaded: its code imports torch
    and runs the user's module; the agent loads it, :mod:`flexrun.agent.logs_specs`).

    Raises:
        ConfigError: no package declares it (the message names those that exist).
    """
    ep = find(LOGS_SPECS_GROUP, name)
    if ep is None:
        names = sorted({e.name for e in metadata.entry_points(group=LOGS_SPECS_GROUP)})
        have = ", ".join(names) if names else "none is installed"
        raise ConfigError(
            f"--logs-specs {name!r}: no entry point {LOGS_SPECS_GROUP}:{name} is installed "
            f"(names: {have}; a package declares it in its entry points, as for torchrun)"
        )
    return ep


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
