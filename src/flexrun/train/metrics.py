"""Training metrics: scalars logged by every rank, reduced across ranks, written by rank 0.

Owns :class:`MetricsLogger`: a script calls ``log(loss=..., samples=...)`` once per step on
every rank; every ``every_steps`` steps the ranks' windows are summed with ONE small
all-reduce (float64: per name the weighted sum and the weight, the sample count, a
checksum of the names and a rank count), so each value is the mean over ranks and over
the steps of the window (weighted by samples when asked). Rank 0 then appends a
``train_metrics`` event (``step``, ``steps_per_s``, ``samples_per_s``, ``world_size``,
``window_steps`` and the means) to the run's ``events.jsonl`` -- the record the agent's
Prometheus metrics and ``flexrun report`` already read -- and, when the ``tensorboard``
package is installed, the same scalars to a ``SummaryWriter`` in ``<run_dir>/tensorboard``.
``min_interval_s`` throttles writes further (reduced windows are merged until it passed).

Where the reduction runs: the default process group (``flexrun run`` restart mode and
plain ``torchrun``), nothing at all in a single process, or, with ``loop=``, a
:class:`~flexrun.train.live.LiveLoop`'s current group, waited for the way the loop waits
for its own collectives (watching the membership epoch). A live collective that fails
is the loop's business: the logger drops its window and the loop's next commit, on the
same broken group, raises, re-forms the group and redoes the step, as for a failed
gradient all-reduce. Throughput is measured on each rank's own clock; only the reduction
is collective, so the decision to reduce depends on the step number alone.

It does not decide what to log, does not read the environment (``flexrun.train.env``
does) and never imports ``flexrun.agent``.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError
from flexrun.events import EventLog
from flexrun.train.context import TrainContext, current
from flexrun.train.env import read_env
from flexrun.train.progress import install_stack_dump

if TYPE_CHECKING:
    from flexrun.train.live import LiveLoop

log = logging.getLogger("flexrun.train.metrics")

EVENT = "train_metrics"
TENSORBOARD_SUBDIR = "tensorboard"
RESERVED = frozenset(
    {
        "ts",
        "event",
        "run_id",
        "node",
        "round",
        "rank",
        "step",
        "steps_per_s",
        "samples_per_s",
        "samples",
        "world_size",
        "window_steps",
    }
)
"""Field names of the event that a scalar may not take."""


@dataclass(slots=True)
class Window:
    """Sums over some steps (and, once reduced, over ranks); merging windows is exact."""

    weighted: dict[str, float] = field(default_factory=dict)
    """Per name: the sum of ``weight * value``."""
    weights: dict[str, float] = field(default_factory=dict)
    """Per name: the sum of weights (1 a step, or the step's samples)."""
    samples: float = 0.0
    """Samples processed (summed over ranks once reduced)."""
    has_samples: bool = False
    """Whether any rank reported samples."""

    def add(self, scalars: Mapping[str, float], weight: float, samples: float | None) -> None:
        for name, value in scalars.items():
            self.weighted[name] = self.weighted.get(name, 0.0) + weight * value
            self.weights[name] = self.weights.get(name, 0.0) + weight
        if samples is not None:
            self.samples += samples
            self.has_samples = True

    def merge(self, other: Window) -> None:
        for name, value in other.weighted.items():
            self.weighted[name] = self.weighted.get(name, 0.0) + value
            self.weights[name] = self.weights.get(name, 0.0) + other.weights[name]
        self.samples += other.samples
        self.has_samples = self.has_samples or other.has_samples

    def means(self) -> dict[str, float]:
        """Per name, the (weighted) mean; names without weight are left out."""
        return {n: self.weighted[n] / w for n, w in sorted(self.weights.items()) if w > 0 and n}

    def pack(self, names: list[str]) -> torch.Tensor:
        """The all-reduce payload: sums per name, weights per name, samples, a samples
        flag, a checksum of the names and 1 (the rank count once summed)."""
        vec = [self.weighted.get(n, 0.0) for n in names]
        vec += [self.weights.get(n, 0.0) for n in names]
        vec += [self.samples, 1.0 if self.has_samples else 0.0, float(names_checksum(names)), 1.0]
        return torch.tensor(vec, dtype=torch.float64)

    @classmethod
    def unpack(cls, names: list[str], t: torch.Tensor) -> tuple[Window, int]:
        """Inverse of :meth:`pack` on a SUM-reduced payload; returns (window, ranks).

        Raises:
            ConfigError: the ranks logged different metric names.
        """
        v = t.tolist()
        k = len(names)
        ranks = round(v[-1])
        if ranks < 1 or v[-2] != ranks * names_checksum(names):
            raise ConfigError(
                f"ranks logged different metric names (this rank: {names}); every rank must "
                "log the same names at the same steps"
            )
        w = cls(
            weighted=dict(zip(names, v[:k], strict=True)),
            weights=dict(zip(names, v[k : 2 * k], strict=True)),
            samples=v[2 * k],
            has_samples=v[2 * k + 1] > 0,
        )
        return w, ranks


def names_checksum(names: list[str]) -> int:
    """A 20-bit checksum of the names: ranks x checksum stays exact in float64."""
    return zlib.crc32("\x00".join(names).encode()) & 0xFFFFF


class MetricsLogger:
    """Log scalars every step on every rank; rank 0 writes their cross-rank means.

    Usage (every rank, every step, the same names)::

        metrics = flexrun.train.MetricsLogger(every_steps=10)
        for step in range(start, steps):
            loss = train_step(batch)
            metrics.log(step + 1, loss=loss.item(), samples=len(batch))
        metrics.close()  # collective: flushes what is pending

    In live mode pass the loop (``MetricsLogger(loop=loop)``); ``step`` then defaults to
    the step being trained (``loop.committed + 1``).
    """

    def __init__(
        self,
        *,
        every_steps: int = 10,
        min_interval_s: float = 0.0,
        weight_by_samples: bool = False,
        tensorboard: bool | None = None,
        ctx: TrainContext | None = None,
        loop: LiveLoop | None = None,
        group: Any = None,
        run_dir: str | os.PathLike[str] | None = None,
        events: EventLog | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """
        Args:
            every_steps: reduce (one all-reduce) every this many steps (>= 1): at steps
                that are a multiple of it. The same on every rank.
            min_interval_s: rank 0 writes at most once per this many seconds; reduced
                windows in between are merged into the next write (0: every reduction).
            weight_by_samples: average each scalar weighted by the ``samples`` logged with
                it (a per-sample mean across uneven shards) instead of one vote a step.
            tensorboard: ``None`` writes TensorBoard scalars when the package is installed
                and a run directory is known; ``True`` requires both; ``False`` never.
            ctx: from :func:`flexrun.train.init`; default the current one, else the
                worker environment (rank, world size and run directory).
            loop: a live loop: reduce on its current group, ranks follow its epochs.
            group: a process group to reduce on instead of the default group (restart mode).
            run_dir: where ``events.jsonl`` and ``tensorboard/`` go; default the context's
                (``FLEXRUN_RUN_DIR``). Without one nothing is written, values are returned.
            events: the event log to write to (default: one in ``run_dir``).
            clock: time source for steps/s and the write interval.

        Raises:
            ConfigError: bad rates, or ``tensorboard=True`` without the package or a
                run directory.
        """
        install_stack_dump()
        if every_steps < 1:
            raise ConfigError(f"every_steps must be >= 1, got {every_steps}")
        if not min_interval_s >= 0:
            raise ConfigError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.every_steps = every_steps
        self.min_interval_s = float(min_interval_s)
        self.weight_by_samples = weight_by_samples
        self._loop = loop
        self._group = group
        self._clock = clock
        self._ctx = ctx or current()
        env = read_env() if self._ctx is None and loop is None else None
        if loop is not None:
            base_dir: str | None = loop.env.run_dir
        elif self._ctx is not None:
            base_dir = self._ctx.run_dir
        else:
            assert env is not None
            base_dir = env.run_dir
        self.run_dir = os.fspath(run_dir) if run_dir is not None else base_dir
        if events is None and loop is not None and run_dir is None:
            events = loop.events
        elif events is None and self.run_dir is not None:
            rid = self._ctx.run_id if self._ctx else env.run_id if env else "local"
            node = self._ctx.node if self._ctx else env.node if env else None
            events = EventLog(self.run_dir, run_id=rid, node=node)
            events.round = self._ctx.round if self._ctx else env.round if env else 0
        self._events = events
        self._env_rank = env.rank if env is not None else 0
        self._env_world = env.world_size if env is not None else 1
        self._tb_wanted = tensorboard
        self._tb: Any = None
        if tensorboard:
            if self.run_dir is None:
                raise ConfigError(
                    "tensorboard=True needs a run directory (run_dir= or flexrun run)"
                )
            if _summary_writer_class() is None:
                raise ConfigError(
                    "tensorboard=True but the tensorboard package is not installed; "
                    "pip install 'flexrun[tensorboard]'"
                )
        self._names: list[str] = []
        self._local = Window()
        self._pending = Window()
        self._pending_ranks = 0
        self._last_step: int | None = None
        self._counter = 0
        self._created = clock.monotonic()
        self._origin: tuple[float, int] | None = None  # (monotonic, step) of the last write
        self._closed = False
        self.dropped_windows = 0
        """Windows lost to a failed live collective (the loop redoes that step)."""

    # -- where this rank stands -----------------------------------------------------------

    @property
    def rank(self) -> int:
        if self._loop is not None:
            return int(self._loop.rank)
        if self._group is not None:
            return int(self._group.rank())
        if self._ctx is not None:
            return self._ctx.rank
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
        return self._env_rank

    @property
    def world_size(self) -> int:
        if self._loop is not None:
            return int(self._loop.world_size)
        if self._group is not None:
            return int(self._group.size())
        if self._ctx is not None:
            return self._ctx.world_size
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
        return self._env_world

    # -- the API ---------------------------------------------------------------------------

    def log(
        self, step: int | None = None, *, samples: float | None = None, **scalars: Any
    ) -> dict[str, Any] | None:
        """Record this rank's scalars for ``step`` (the number of steps done, this one
        included). Collective every ``every_steps`` steps: every rank must call it at
        every step with the same names.

        Returns the record when one was due at this call (the same means on every rank;
        only rank 0 writes it), else ``None``.

        Raises:
            ConfigError: a reserved or empty name, a value that is not a number, names
                that differ between ranks, or a call after :meth:`close`.
        """
        if self._closed:
            raise ConfigError("MetricsLogger.log() after close()")
        if step is None:
            step = int(self._loop.committed) + 1 if self._loop is not None else self._counter + 1
        step = int(step)
        values = {}
        for name, raw in scalars.items():
            if not name or name in RESERVED:
                raise ConfigError(f"metric name {name!r} is reserved or empty; pick another")
            try:
                values[name] = float(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"metric {name}={raw!r} is not a number") from exc
        if samples is not None and not (samples >= 0 and math.isfinite(samples)):
            raise ConfigError(f"samples must be a finite number >= 0, got {samples!r}")
        if self.weight_by_samples and samples is None and values:
            raise ConfigError("weight_by_samples=True needs samples= in every log() call")
        if self._last_step is not None and step <= self._last_step:
            # The same step again (a live recovery redoes it) or a resume from earlier:
            # what was gathered since no longer describes committed steps.
            self._local = Window()
            self._pending = Window()
            self._pending_ranks = 0
            self._origin = (self._clock.monotonic(), step - 1)
        if self._origin is None:
            self._origin = (self._created, step - 1)
        self._last_step = step
        self._counter = step
        weight = float(samples) if self.weight_by_samples and samples is not None else 1.0
        for name in values:
            if name not in self._names:
                self._names.append(name)
                self._names.sort()
        self._local.add(values, weight, None if samples is None else float(samples))
        if step % self.every_steps != 0:
            return None
        return self._reduce_and_emit(step, force=False)

    def flush(self) -> dict[str, Any] | None:
        """Reduce what is pending now and write it (ignores ``min_interval_s``).

        Collective: every rank must call it at the same point. Returns the record, or
        ``None`` when there was nothing to write.
        """
        if self._closed or self._last_step is None:
            return None
        return self._reduce_and_emit(self._last_step, force=True)

    def close(self, *, flush: bool = True) -> None:
        """Flush (collective, unless ``flush=False``) and close TensorBoard. Idempotent."""
        if self._closed:
            return
        try:
            if flush:
                self.flush()
                if self.world_size > 1 and self._loop is None:
                    # Let gloo's run loop retire the flush's work (dropping its Python-owned
                    # tensor needs the GIL) before a shutdown barrier can hold on to it: a
                    # work still held then is freed from that thread later, while the main
                    # thread holds the GIL joining it in DDP's reducer (seen once, torch 2.13).
                    time.sleep(0.02)
        finally:
            self._closed = True
            if self._tb is not None:
                self._tb.close()
                self._tb = None

    # -- reduction and writing ------------------------------------------------------------

    def _reduce_and_emit(self, step: int, *, force: bool) -> dict[str, Any] | None:
        names = list(self._names)
        window, self._local = self._local, Window()
        reduced = self._reduce(names, window)
        if reduced is None:
            return None
        self._pending.merge(reduced[0])
        self._pending_ranks = reduced[1]
        now = self._clock.monotonic()
        assert self._origin is not None
        t0, step0 = self._origin
        if not force and now - t0 < self.min_interval_s:
            return None
        if step <= step0:  # nothing logged since the last write
            return None
        record = self._record(step, step0, max(now - t0, 1e-9))
        self._pending = Window()
        self._origin = (now, step)
        if self.rank == 0:
            self._write(record)
        return record

    def _reduce(self, names: list[str], window: Window) -> tuple[Window, int] | None:
        """Sum ``window`` over the ranks; ``None`` when a live collective failed."""
        payload = window.pack(names)
        if self._loop is not None:
            from flexrun.train.live import LiveAborted

            loop = self._loop
            if loop.world_size > 1 and loop._pg is not None:
                try:
                    loop._wait(loop._pg.allreduce([payload]))
                except LiveAborted as exc:
                    self.dropped_windows += 1
                    log.warning("metrics window dropped: %s (the loop re-forms)", exc)
                    return None
        elif self._group is not None:
            self._group.allreduce([payload]).wait()
        elif self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(payload)
        return Window.unpack(names, payload)

    def _record(self, step: int, step0: int, elapsed_s: float) -> dict[str, Any]:
        steps = step - step0
        rec: dict[str, Any] = {
            "step": step,
            "steps_per_s": round(steps / elapsed_s, 4),
            "world_size": self._pending_ranks or self.world_size,
            "window_steps": steps,
        }
        if self._pending.has_samples:
            rec["samples_per_s"] = round(self._pending.samples / elapsed_s, 3)
        rec.update(self._pending.means())
        return rec

    def _write(self, record: Mapping[str, Any]) -> None:
        if self._events is not None:
            self._events.emit(EVENT, rank=0, **record)
        writer = self._writer()
        if writer is not None:
            step = int(record["step"])
            for name, value in record.items():
                if name in ("step", "window_steps", "world_size"):
                    continue
                tag = f"throughput/{name}" if name.endswith("_per_s") else f"train/{name}"
                writer.add_scalar(tag, value, step)
            writer.add_scalar("train/world_size", record["world_size"], step)

    def _writer(self) -> Any:
        if self._tb is not None or self._tb_wanted is False or self.run_dir is None:
            return self._tb
        cls = _summary_writer_class()
        if cls is None:
            self._tb_wanted = False
            return None
        self._tb = cls(log_dir=os.path.join(self.run_dir, TENSORBOARD_SUBDIR), flush_secs=10)
        return self._tb


def _summary_writer_class() -> Any:
    """torch's ``SummaryWriter`` when the ``tensorboard`` package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


__all__ = ["EVENT", "RESERVED", "MetricsLogger", "Window", "names_checksum"]
