"""The Checkpointer's knobs as one frozen, validated record.

Owns :class:`CheckpointOptions` (what to keep, how a background persist may use the
machine, when failed saves end the run) and its validation. Live objects (the training
context, an event log, a storage, a clock) stay constructor arguments of the
Checkpointer; this record is plain data that can be built once, compared and logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from flexrun.errors import CheckpointError

DEFAULT_PERSIST_CPU_SHARE = 0.1
"""Default share of one core a background persist may use (see ``persist_cpu_share``)."""
DEFAULT_PERSIST_FREE_CPU_S = 0.05
"""Default CPU seconds of a background persist taken unpaced (see ``persist_free_cpu_s``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
    """How a :class:`~flexrun.train.Checkpointer` saves, keeps and reports checkpoints."""

    keep_last: int = 3
    """How many newest checkpoints that verify retention keeps (>= 1). A checkpoint that
    fails verification is not counted, so it never displaces a good one."""

    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (not verified at each
    save, not counted in ``keep_last``)."""

    async_save: bool = True
    """Persist on a background thread; the loop blocks only for the host copy."""

    defer_copy: bool = True
    """With ``async_save``, copy parameters and optimizer state of registered optimizers
    on the background thread too, and hold the next ``optimizer.step()`` (a step
    pre-hook) until that copy is done, so ``save()`` returns in milliseconds. Requires
    that those tensors change only inside ``optimizer.step()``; pass ``False`` if the
    script mutates parameters elsewhere."""

    persist_cpu_share: float | None = DEFAULT_PERSIST_CPU_SHARE
    """Pace the background persist (serializing, hashing, writing or uploading) to about
    this share of one CPU core: after each 4 MiB piece it rests for the CPU time the
    piece took times ``1/share - 1``. The default 0.1 is chosen so that training
    steps slow by about 10% at most while a persist runs, even where training keeps every
    core busy (bench/results/checkpoint.txt); a persist then takes roughly ten times its
    CPU time. ``wait()``, ``close()``, ``load()``
    and the next ``save()`` end the pacing. ``None`` (or 1.0): unpaced."""

    persist_free_cpu_s: float = DEFAULT_PERSIST_FREE_CPU_S
    """CPU seconds at the start of each background persist that ``persist_cpu_share``
    does not pace. A persist that costs less (a small model: tens of KB to a few MB)
    commits in about its own CPU time instead of ten times it; a failure between the save
    and the commit recomputes every step since the checkpoint before, so the commit's
    delay is work lost to each failure in that window. Larger persists are paced after
    this allowance, as before. 0: pace from the first byte."""

    persist_max_bytes_s: float | None = None
    """Also cap the background persist's average write rate (bytes/s; None: no cap)."""

    persist_when_idle: bool = False
    """Run the background persist under ``SCHED_IDLE`` (Linux), so that it takes only CPU
    time nothing else on the node wants. Off by default: the persist thread runs Python
    code and so holds the interpreter's lock (GIL) between its C calls, and a thread at
    idle priority that is descheduled while holding it keeps the training thread (and the
    live heartbeat, and the progress hook) from running until the node has a core to
    spare. With other processes keeping every core busy (other ranks, data-loader workers)
    that froze the rest of the process for 13 s (bench/idle_priority_gil.py,
    bench/results/idle_priority_gil.txt): a live worker was killed as hung for it. Turn it on
    only where nothing outside the process competes for its cores. Once the training
    thread waits for the persist (the next ``save()``, ``wait()``, ``load()``,
    ``close()``), it goes back to normal scheduling. Linux lets a process leave
    ``SCHED_IDLE`` only with ``CAP_SYS_NICE`` or ``ulimit -e 20``; without either the
    persist stays at normal priority whatever this says (logged once). Either way
    ``persist_cpu_share`` paces it."""

    save_rng: bool = True
    """Save and restore per-rank RNG states of torch/CUDA/numpy/Python."""

    max_failed_saves: int = 3
    """A save the storage refuses (``ENOSPC``, ``EDQUOT``, ``EIO``, ``EROFS``, an object
    store that cannot be reached or fails) leaves nothing behind, keeps the previous
    checkpoints, emits ``checkpoint_save_failed`` and lets training go on. When this many
    saves in a row have failed, and the first is at least ``failed_saves_grace_s`` old,
    the last failure raises on every rank. 1 (with a grace of 0): every failed save
    raises."""

    failed_saves_grace_s: float = 60.0
    """The shortest run of failed saves that raises (0: count only). A restart frees no
    disk space and throws away the steps since the last checkpoint, so a disk full for a
    few seconds must not end a run just because checkpoints are frequent."""

    durable_every: int | None = None
    """Turn on the memory tier: every ``save()`` stages a copy in host memory that the
    node's agent owns (it survives the worker, kill -9 included; every node keeps its
    own copy of replicated state) and a save at least this many steps after the last
    durable one (and every ``blocking`` save) is also written to the directory with the
    commit protocol. ``load()`` takes the newest copy that verifies, memory or durable.
    ``None``: every save is durable (no memory tier). See docs/user/train.md."""

    memory_dir: str | None = None
    """Where the memory tier keeps its copies; ``None``: the directory the agent passes
    in ``FLEXRUN_MEMORY_DIR`` (without one, e.g. under plain torchrun, the tier is off
    and only the durable saves happen, said once by a ``checkpoint_memory_off`` event)."""

    memory_max_bytes: int | None = None
    """Cap on the memory tier's use per node (two copies are kept); a state whose two
    copies exceed it turns the tier off (durable saves only, said once). ``None``: no
    cap beyond the memory filesystem's own size (a full one turns the tier off too)."""

    memory_copy_wait: bool = True
    """A save waits for the previous memory copy still being written (so a failure loses
    at most one step). ``False``: such a save skips its memory copy instead, so training
    never waits for the memory tier (where a copy takes longer than a step, a failure may
    then recompute several steps); the skips are counted (``memory_copies_skipped``)."""

    def __post_init__(self) -> None:
        if self.durable_every is not None and self.durable_every < 1:
            raise CheckpointError(f"durable_every must be >= 1 or None, got {self.durable_every}")
        if self.memory_max_bytes is not None and self.memory_max_bytes < 1:
            raise CheckpointError(f"memory_max_bytes must be >= 1, got {self.memory_max_bytes}")
        if self.keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise CheckpointError(f"keep_every must be >= 1 or None, got {self.keep_every}")
        if self.max_failed_saves < 1:
            raise CheckpointError(f"max_failed_saves must be >= 1, got {self.max_failed_saves}")
        if not math.isfinite(self.failed_saves_grace_s) or self.failed_saves_grace_s < 0:
            raise CheckpointError(
                f"failed_saves_grace_s must be >= 0, got {self.failed_saves_grace_s}"
            )
        share = self.persist_cpu_share
        if share is not None and not (math.isfinite(share) and 0 < share <= 1):
            raise CheckpointError("persist_cpu_share must be in (0, 1] or None")
        free = self.persist_free_cpu_s
        if not (math.isfinite(free) and free >= 0):
            raise CheckpointError(f"persist_free_cpu_s must be >= 0, got {free}")
        rate = self.persist_max_bytes_s
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise CheckpointError("persist_max_bytes_s must be > 0 or None")

    @classmethod
    def build(
        cls, base: CheckpointOptions | None, overrides: dict[str, object]
    ) -> CheckpointOptions:
        """``base`` (or the defaults) with ``overrides`` (the Checkpointer's old loose
        keyword arguments) applied.

        Raises:
            TypeError: an override is not an option (as for an unknown keyword argument).
            CheckpointError: a value is out of range.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
        values = {n: getattr(base, n) for n in names} if base is not None else {}
        values.update(overrides)
        return cls(**values)
