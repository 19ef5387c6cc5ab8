"""The elastic agent: per node, rendezvous -> spawn workers -> monitor -> react."""

from flexrun.agent.agent import ElasticAgent

__all__ = ["ElasticAgent"]
