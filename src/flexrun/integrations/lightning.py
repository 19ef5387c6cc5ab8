"""Lightning under flexrun: save on preemption, resume from the newest checkpoint, every sample
once across a change of world size.

Owns :class:`FlexrunCallback` (a ``lightning.pytorch.Callback``): it places an
:class:`ElasticSampler` (the ``batch_sampler`` of the script's training ``DataLoader``) on this
run's rank and world size, advances it after each training batch, keeps its position in the
Lightning checkpoint (the callback's ``state_dict``), and turns SIGTERM into an agreed save at a
batch boundary (``last.ckpt`` in the ``ModelCheckpoint``'s directory, where
``trainer.fit(..., ckpt_path="last")`` finds it) followed by exit 143. It does not save or load
the model, optimizer or loop state: Lightning does.

Why the data is exactly-once: the sampler orders an epoch globally and its position counts
global samples, so a run restored at another world size consumes exactly the rest of the epoch.
Its ``len()`` stays a whole epoch's batches because Lightning counts the batches of a resumed
epoch from the epoch's start.

Importing this module imports ``lightning`` (``pip install 'flexrun[integrations]'``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import Any

from flexrun.errors import ConfigError
from flexrun.integrations._common import EpochSampler, agreed, barrier, worker_context
from flexrun.train.preempt import PreemptionGuard
from flexrun.train.sampler import ElasticSampler

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"flexrun.integrations.lightning needs lightning: pip install 'flexrun[integrations]' ({exc})"
    ) from exc

__all__ = ["EpochSampler", "FlexrunCallback"]


class FlexrunCallback(pl.Callback):
    """Elastic data and preemption for a Lightning ``Trainer``.

    Args:
        sampler: the ``batch_sampler`` of the training ``DataLoader`` (build it with any rank
            and world size; the callback sets this run's). Its ``global_batch_size``, seed and
            dataset must stay the same across restarts. ``None``: preemption only.
        signals: the signals that ask for a stop (SIGTERM by default).

    The ``Trainer`` needs ``use_distributed_sampler=False`` (the sampler already splits each
    step among the ranks) and, for the preemption save, a ``ModelCheckpoint``.
    """

    def __init__(
        self, sampler: ElasticSampler | None = None, *, signals: Iterable[int] = (signal.SIGTERM,)
    ) -> None:
        if sampler is not None and not isinstance(sampler, EpochSampler):
            raise ConfigError(
                "FlexrunCallback takes a flexrun.integrations.lightning.EpochSampler (an "
                "ElasticSampler whose len() is a whole epoch, as Lightning counts batches)"
            )
        self.sampler = sampler
        self.signals = tuple(signals)
        self.guard: PreemptionGuard | None = None
        self.preempted_step: int | None = None
        """The global step after which the ranks agreed to stop, once they have."""

    # -- data position ------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.sampler is None:
            return
        if trainer._accelerator_connector.use_distributed_sampler and trainer.world_size > 1:
            raise ConfigError(
                "FlexrunCallback with a sampler needs Trainer(use_distributed_sampler=False): "
                "Lightning would replace the sampler with a DistributedSampler"
            )
        assert isinstance(self.sampler, EpochSampler)
        self.sampler.place(trainer.global_rank, trainer.world_size)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Move the sampler to the epoch Lightning runs (Lightning calls ``set_epoch`` on a
        loader's sampler, not on its batch sampler); a restored position in that epoch stays."""
        if self.sampler is not None:
            self.sampler.set_epoch(trainer.current_epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()} if self.sampler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.sampler is not None and "sampler" in state_dict:
            self.sampler.load_state_dict(state_dict["sampler"])

    # -- preemption ---------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take SIGTERM over from Lightning's own handler for the training loop (Lightning's
        would end the run at the next batch without a checkpoint)."""
        self.guard = PreemptionGuard(ctx=worker_context(), signals=self.signals)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.sampler is not None:
            self.sampler.advance()  # (before ModelCheckpoint, which Lightning runs last)
        if self.guard is None or not agreed(self.guard):
            return
        self.preempted_step = trainer.global_step
        self._save_last(trainer)
        self.guard.exit(step=trainer.global_step)

    def _save_last(self, trainer: pl.Trainer) -> None:
        """``last.ckpt`` in the ``ModelCheckpoint``'s directory, replaced in one rename."""
        ckpt = trainer.checkpoint_callback
        if not isinstance(ckpt, ModelCheckpoint) or ckpt.dirpath is None:
            raise ConfigError("FlexrunCallback's preemption save needs a ModelCheckpoint(dirpath=)")
        final = os.path.join(ckpt.dirpath, ckpt.CHECKPOINT_NAME_LAST + ckpt.FILE_EXTENSION)
        tmp = os.path.join(ckpt.dirpath, ".flexrun-preempt.tmp")  # (no .ckpt: never "last")
        trainer.save_checkpoint(tmp)  # (every rank; rank 0 writes; ends with a barrier)
        if trainer.is_global_zero:
            os.replace(tmp, final)
        barrier()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._release()

    def _release(self) -> None:
        if self.guard is not None:
            self.guard.uninstall()
            self.guard = None
