"""Fixtures for the train integration tests (helpers live in ``train_support.py``)."""

from train_support import launcher  # noqa: F401
