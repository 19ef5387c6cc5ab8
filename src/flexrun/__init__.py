"""flexrun: elastic, fault-tolerant PyTorch distributed training.

The launcher is ``flexrun run`` (see ``flexrun.cli``); training scripts import
``flexrun.train``; Python callers launch jobs with :func:`flexrun.launch` or
:func:`flexrun.elastic_launch` (:mod:`flexrun.api`). This module exports the version, the
error tree and, lazily (importing flexrun stays cheap), the launch API.
"""

from typing import Any

from flexrun.errors import FlexrunError, JobFailed

__version__ = "0.1.0"

_API = ("launch", "elastic_launch", "LaunchConfig")

__all__ = ["FlexrunError", "JobFailed", "LaunchConfig", "__version__", "elastic_launch", "launch"]


def __getattr__(name: str) -> Any:
    if name in _API:
        from flexrun import api  # (lazy: only a caller of the API pays for its imports)

        return getattr(api, name)
    raise AttributeError(f"module 'flexrun' has no attribute {name!r}")
