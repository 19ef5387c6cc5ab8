"""flexrun.train: what a training script imports so that resuming is done once, right.

Public API only, and importing it has no side effects (no signal handler, no file opened:
see ``flexrun.train.progress``). Works under ``flexrun run`` and plain ``torchrun`` (and
plain ``python`` as a single process); never imports ``flexrun.agent``: workers and agent
talk only through the environment, the run directory and signals.
"""

from __future__ import annotations

from flexrun.errors import FencedError, StorageFailure
from flexrun.storage_options import STORAGE_OPTIONS_ENV, storage_options_from_env
from flexrun.train.batch import BatchPlan
from flexrun.train.checkpoint import Checkpointer, Loaded, Stateful
from flexrun.train.context import TrainContext, current, init, shutdown
from flexrun.train.env import WorkerEnv, read_env
from flexrun.train.layout import Manifest
from flexrun.train.metrics import MetricsLogger
from flexrun.train.options import CheckpointOptions
from flexrun.train.preempt import EXIT_CODE as PREEMPTED_EXIT_CODE
from flexrun.train.preempt import PreemptionGuard
from flexrun.train.progress import install_stack_dump, report_progress
from flexrun.train.sampler import ElasticSampler
from flexrun.train.sharded import ShardedCheckpointer

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "STORAGE_OPTIONS_ENV",
    "BatchPlan",
    "CheckpointOptions",
    "Checkpointer",
    "ElasticSampler",
    "FencedError",
    "Loaded",
    "Manifest",
    "MetricsLogger",
    "PreemptionGuard",
    "ShardedCheckpointer",
    "Stateful",
    "StorageFailure",
    "TrainContext",
    "WorkerEnv",
    "current",
    "init",
    "install_stack_dump",
    "read_env",
    "report_progress",
    "shutdown",
    "storage_options_from_env",
]
