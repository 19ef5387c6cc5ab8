"""Observability over a run: Prometheus metrics, node resources, ``flexrun status``,
``flexrun report`` and ``flexrun doctor``.

Owns turning what a run records (the event log, :mod:`flexrun.events`, and the store's
round) into things people read. It records nothing the agent decides on: the event log
itself lives below the rendezvous and the agent, in :mod:`flexrun.events`.
"""
