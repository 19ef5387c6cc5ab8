"""Fixtures for the train integration tests (helpers live in ``train_support.py`` and
``s3_support.py``)."""

from s3_support import s3, s3_endpoint  # noqa: F401
from train_support import launcher  # noqa: F401
