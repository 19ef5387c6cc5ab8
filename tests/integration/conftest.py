"""Fixtures for integration tests (helpers live in ``support.py``, imported by name)."""

from support import endpoint, procs, shared_runs, store_server  # noqa: F401
