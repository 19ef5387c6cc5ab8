"""Fixtures for integration tests (helpers live in ``support.py``, imported by name)."""

from support import procs, store_server  # noqa: F401
