"""What an agent does when a rendezvous record it needs does not parse.

Owns the agent's patience with unreadable records (a stranger's write to an unauthenticated
store, a corrupt store): the workers keep running, the pass is retried after a pause, each
rejection is reported at a bounded rate, and the error is raised again once it has lasted
the join timeout. It does not read the store (the rendezvous does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexrun.errors import RendezvousError
from flexrun.store.rejects import Rejects

if TYPE_CHECKING:
    from flexrun.agent.agent import Agent


class Unreadable:
    """A rendezvous record a pass needed does not parse (a stranger's write to an
    unauthenticated store, a corrupt store): the workers keep running and the next pass
    reads again, after a pause. Logged and reported (``store_record_rejected``, at a bounded
    rate); re-raised once it has lasted the join timeout (nothing for the node to follow)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self.since: float | None = None
        self._rejects = Rejects(
            "a rendezvous record does not parse; reading it again",
            sink=self._emit,
            clock=agent.clock,
        )

    def _emit(self, key: str, reason: str) -> None:
        self._agent.events.emit("store_record_rejected", key=key, reason=reason)

    def seen(self, exc: RendezvousError) -> None:
        a = self._agent
        now = a.clock.monotonic()
        self.since = now if self.since is None else self.since
        self._rejects.report("rendezvous", str(exc))
        if now - self.since >= a.config.rendezvous.join_timeout_s:
            raise exc
        a.clock.sleep(min(1.0, a.config.rendezvous.heartbeat_interval_s))
