"""Hugging Face ``Trainer`` under flexrun: save on preemption, resume from the newest complete
checkpoint, every sample once across a change of world size.

Owns :class:`FlexrunCallback` (a ``transformers.TrainerCallback``: SIGTERM -> all ranks agree
at a step boundary -> ``control.should_save`` + ``control.should_training_stop`` -> the
Trainer saves ``checkpoint-N`` -> exit 143; a ``flexrun.json`` written beside each
``checkpoint-N`` once every rank has saved it), :class:`ElasticTrainer` (a ``Trainer`` whose
training batches come from flexrun's :class:`~flexrun.train.sampler.ElasticSampler` at a
constant global batch size) and :func:`latest_checkpoint`. It does not save or load model,
optimizer or scheduler state: the Trainer does, as it always does.

Why the data is exactly-once: the ``ElasticSampler`` orders an epoch globally and splits each
global step's samples among the current ranks, so a global step's samples do not depend on the
world size. The Trainer's own resume skips ``global_step % steps_per_epoch`` batches of the
resumed epoch; with a constant global batch size those are exactly the global steps already
trained, at any world size.

Importing this module imports ``transformers`` (``pip install 'flexrun[integrations]'``).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterable, Sized
from typing import Any, cast

from flexrun.errors import CheckpointError, ConfigError
from flexrun.integrations._common import EpochSampler, agreed, barrier, worker_context
from flexrun.train.preempt import PreemptionGuard

try:
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"flexrun.integrations.hf needs transformers: pip install 'flexrun[integrations]' ({exc})"
    ) from exc

MARKER = "flexrun.json"
"""Written beside a ``checkpoint-N``'s files once every rank has saved them."""

_SAMPLER_KEYS = ("seed", "num_samples", "global_batch_size", "shuffle", "drop_last")


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that every rank finished saving (it has
    :data:`MARKER`), or ``None``: pass it to ``trainer.train(resume_from_checkpoint=...)``.

    A ``checkpoint-N`` without the marker (a kill during its save) is skipped, not deleted.
    """
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = []
    for name in names:
        prefix, _, num = name.partition("-")
        if (
            prefix == "checkpoint"
            and num.isdigit()
            and os.path.isfile(os.path.join(output_dir, name, MARKER))
        ):
            steps.append(int(num))
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


class FlexrunCallback(TrainerCallback):
    """Preemption and checkpoint bookkeeping for a ``Trainer`` (any ``Trainer``; with
    :class:`ElasticTrainer` also the data position).

    Create it in the main thread before ``trainer.train()`` (it installs the SIGTERM handler
    then, so a signal during the Trainer's set-up is not lost).
    """

    def __init__(self, *, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        self.guard = PreemptionGuard(ctx=worker_context(), signals=signals)
        self.sampler: EpochSampler | None = None
        """Set by :class:`ElasticTrainer` when it builds its training loader."""
        self.preempted_step: int | None = None
        """The step after which the ranks agreed to stop, once they have."""

    # -- data position ------------------------------------------------------------------

    def _steps_per_epoch(self, args: Any) -> int:
        assert self.sampler is not None
        n, accum = len(self.sampler), args.gradient_accumulation_steps
        return max(n // accum + int(n % accum > 0), 1)  # (the Trainer's own formula)

    def _position(self, args: Any, state: Any) -> dict[str, Any]:
        assert self.sampler is not None
        per_epoch = self._steps_per_epoch(args)
        done = (state.global_step % per_epoch) * args.gradient_accumulation_steps
        s = self.sampler.state_dict()
        s["epoch"] = state.global_step // per_epoch
        s["consumed"] = min(s["num_samples"], done * self.sampler.global_batch_size)
        return s

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A resumed run checks that its sampler orders the data as the checkpoint's did."""
        if self.sampler is None or state.global_step == 0:
            return
        marker = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", MARKER)
        if not os.path.isfile(marker):
            return
        with open(marker, encoding="utf-8") as f:
            saved = json.load(f).get("sampler") or {}
        for key in _SAMPLER_KEYS:
            if key in saved and saved[key] != getattr(self.sampler, key):
                raise CheckpointError(
                    f"{marker}: the checkpoint's sampler had {key}={saved[key]!r}, this run "
                    f"{getattr(self.sampler, key)!r}: the data would not resume where it stopped"
                )

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Move the sampler to the epoch the Trainer is about to run (the Trainer's epoch is
        ``global_step // steps_per_epoch``, also when it resumes)."""
        if self.sampler is not None:
            self.sampler.set_epoch(state.global_step // self._steps_per_epoch(args))

    # -- preemption ---------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Every rank asks whether any rank was told to stop; if so save now and stop."""
        if agreed(self.guard):
            self.preempted_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Once every rank has saved ``checkpoint-N``, rank 0 writes :data:`MARKER` into it."""
        barrier()
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        record: dict[str, Any] = {
            "global_step": state.global_step,
            "world_size": args.world_size,
            "preempted": self.preempted_step is not None,
        }
        if self.sampler is not None:
            record["sampler"] = self._position(args, state)
        tmp = os.path.join(folder, f".{MARKER}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, MARKER))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After a preemption's save: exit 143 (retryable), else give the signals back."""
        if self.preempted_step is not None:
            barrier()
            self.guard.exit(step=self.preempted_step)
        self.guard.uninstall()


class ElasticTrainer(Trainer):
    """A ``Trainer`` whose training loader is an :class:`ElasticSampler` at a constant
    ``global_batch_size`` (samples per micro-step across all ranks; the Trainer's
    ``per_device_train_batch_size`` is not used for training). Adds a
    :class:`FlexrunCallback` unless ``callbacks`` has one.

    Keep ``global_batch_size``, ``seed`` (``sampler_seed``, default ``args.seed``) and the
    dataset the same across restarts; the world size may change. An epoch's last step should
    hold at least as many samples as there are ranks (or set ``dataloader_drop_last``).
    """

    def __init__(
        self, *args: Any, global_batch_size: int, sampler_seed: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.ignore_data_skip:
            raise ConfigError(
                "ElasticTrainer resumes the data through the Trainer's own batch skipping: "
                "ignore_data_skip=True would train the resumed epoch's first steps again"
            )
        self.global_batch_size = global_batch_size
        self.sampler_seed = sampler_seed
        found = [c for c in self.callback_handler.callbacks if isinstance(c, FlexrunCallback)]
        if found:
            self.flexrun_callback = found[0]
        else:
            self.flexrun_callback = FlexrunCallback()
            self.add_callback(self.flexrun_callback)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("ElasticTrainer: training requires a train_dataset")
        dataset, collator = self.train_dataset, self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        a = self.args
        seed = a.seed if self.sampler_seed is None else self.sampler_seed
        sampler = EpochSampler(
            len(cast(Sized, dataset)),
            global_batch_size=self.global_batch_size,
            rank=a.process_index,
            world_size=a.world_size,
            seed=seed,
            drop_last=a.dataloader_drop_last,
        )
        self.flexrun_callback.sampler = sampler
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collator,
            num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory,
        )
        prepared = self.accelerator.prepare(loader)
        # The sampler already gives each rank its share: make accelerate's per-process
        # sharding wrapper a passthrough (the Trainer does the same for its own rank-aware
        # BatchRebalanceSampler).
        wrapper = getattr(prepared, "batch_sampler", None)
        if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes = 1
            wrapper.process_index = 0
        return prepared


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


__all__ = ["MARKER", "ElasticTrainer", "FlexrunCallback", "latest_checkpoint"]
