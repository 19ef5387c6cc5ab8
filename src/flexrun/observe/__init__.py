"""Observability: the event log (and, later, metrics, status and reports)."""

from flexrun.observe.events import EventLog, read_events

__all__ = ["EventLog", "read_events"]
