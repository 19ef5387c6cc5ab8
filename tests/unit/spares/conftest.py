"""Fixtures for the warm-interpreter unit tests (helpers live in ``spares_support.py``)."""

from spares_support import pools, served  # noqa: F401
