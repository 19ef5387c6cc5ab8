"""What the replicated and the sharded checkpointer share: rank 0 decides, events, options.

Owns the :class:`Stateful` protocol, the :class:`Loaded` record a load returns, resolving
``storage_options``, :class:`RankZero` (broadcast from rank 0, gather, the checkpoint
events of rank 0) and which tensors a save may copy after it returned (those only
``optimizer.step()`` changes). It does not save or load anything itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from flexrun.errors import CheckpointError
from flexrun.events import EventLog
from flexrun.storage_options import storage_options_from_env
from flexrun.train.context import TrainContext

log = logging.getLogger("flexrun.train.checkpoint")


StorageOptions = Mapping[str, Any] | Literal["env"] | None
"""fsspec options for a URL directory, or ``"env"``: the JSON object a launcher put in
``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (``flexrun.train.objstore``)."""


class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()`` (modules, optimizers, samplers...)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Loaded:
    """What :meth:`flexrun.train.Checkpointer.load` restored."""

    step: int
    """The step the checkpoint was saved at."""
    extra: dict[str, Any]
    """User extras passed to ``save(extra=...)`` (epoch, counters ...)."""
    world_size: int
    """World size of the run that saved it."""
    skipped: tuple[int, ...]
    """Newer checkpoints that failed verification and were skipped."""


def resolve_storage_options(value: StorageOptions) -> dict[str, Any] | None:
    """``storage_options`` as fsspec takes them (``"env"`` read from the environment).

    Raises:
        ConfigError: ``"env"`` and the variable is malformed or carries a credential.
        CheckpointError: any other string.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value != "env":
            raise CheckpointError(f"storage_options must be a mapping or 'env', got {value!r}")
        return storage_options_from_env()
    return dict(value)


class RankZero:
    """What both checkpointers share: rank 0 decides and tells the others; events."""

    _ctx: TrainContext
    _events: EventLog | None

    def _setup_events(self, events: EventLog | None) -> None:
        if events is None and self._ctx.run_dir is not None:
            events = EventLog(self._ctx.run_dir, run_id=self._ctx.run_id, node=self._ctx.node)
        if events is not None and events.round is None:
            events.round = self._ctx.round
        self._events = events

    def _distributed(self) -> bool:
        return self._ctx.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed():
            return [obj]
        out: list[Any] = [None] * self._ctx.world_size
        dist.all_gather_object(out, obj)
        return out

    def _emit(self, event: str, **fields: Any) -> None:
        if self._events is not None and self._ctx.is_main:
            try:
                self._events.emit(event, rank=self._ctx.rank, **fields)
            except OSError as exc:  # the run directory may share the full disk
                log.warning("could not log the %s event: %s", event, exc)


def deferrable_tensors(
    optimizers: list[torch.optim.Optimizer],
) -> Callable[[torch.Tensor], bool] | None:
    """Tensors only ``optimizer.step()`` changes: parameters and optimizer state."""
    if not optimizers:
        return None
    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            ptrs.update(p.data_ptr() for p in group["params"])
        for st in opt.state.values():
            ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    ptrs.discard(0)
    return lambda t: t.data_ptr() in ptrs
