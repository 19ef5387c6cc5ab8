"""Fixtures for integration tests (helpers live in ``support.py``, imported by name)."""

from support import endpoint, procs, store_server  # noqa: F401
