"""The checkpoint memory tier of sharded (FSDP2 / DTensor) state: each rank keeps its own shards.

Owns, for :class:`flexrun.train.sharded.ShardedCheckpointer` with ``durable_every``: each
rank's copy of its own part of the state (the local tensors of its DTensors, its other
tensors and the non-tensor state, its RNG and the save's ``extra``) written every save into
a folder of its own (``rank_<R>``) in the node's memory directory (``FLEXRUN_MEMORY_DIR``,
owned by the agent, so a copy outlives a kill -9 of the worker), with the file format,
atomic write and :data:`~flexrun.train.memsave.KEEP` bound of
:mod:`flexrun.train.memsave`; which saves also go to durable storage (the first one, then
every ``durable_every`` steps, and every save once the tier is off on any rank: the ranks
agree on that over the checkpointer's gloo group before each memory-only save); and the
collective choice at load time: the newest step of which EVERY rank holds a copy of its own
shards that verifies (:func:`common_step`), unless durable storage holds a newer one. Each
rank verifies its own copies (checksum trailer, ``weights_only``; a corrupt one is reported
with ``checkpoint_memory_skipped`` and the one before it tried) and the copy must have been
written at the same world size and rank with the same local shard shapes as the state it
is loaded into (same mesh and placements); otherwise the load goes to durable storage,
where DCP reshards. No rank holds another rank's shards, so a lost node's state comes from
durable storage. It does not write DCP checkpoints (:mod:`flexrun.train.sharded`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flexrun import worker_hook
from flexrun._clock import Clock
from flexrun.errors import CheckpointError
from flexrun.events import EventLog
from flexrun.train.context import TrainContext
from flexrun.train.durable_load import EXTRA_FILE, RNG_FILE
from flexrun.train.memload import decode, verify_blob
from flexrun.train.memsave import (
    KEEP,
    copy_name,
    copy_steps,
    payload_nbytes,
    write_copy,
)
from flexrun.train.memtier import TierBase
from flexrun.train.options import CheckpointOptions
from flexrun.train.rankzero import Loaded
from flexrun.train.state import capture_rng, restore_rng

log = logging.getLogger(__name__)

META = "__memshard__"
"""Payload key of a copy's own record (step, world size, rank)."""
OBJECTS = "objects"


def to_local(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by a host copy of its local shard and every
    other tensor by a host copy (what a copy of this rank's state holds)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().to("cpu", copy=True)
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_local(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_local(v) for v in obj)
    return obj


def layout(obj: Any, where: str = "") -> list[str]:
    """How ``obj``'s DTensors are sharded: path, global shape, mesh shape and placements of
    each (a copy loads only into the same layout)."""
    if isinstance(obj, DTensor):
        mesh = tuple(obj.device_mesh.shape)
        return [f"{where}:{tuple(obj.shape)}:{mesh}:{obj.placements}"]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in layout(v, f"{where}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in layout(v, f"{where}/{i}")]
    return []


def from_local(saved: Any, template: Any, where: str = "") -> Any:
    """``saved`` (what :func:`to_local` made) shaped as ``template`` (the live state):
    each local shard back in a DTensor of the template's mesh and placements, each tensor
    on the template's device.

    Raises:
        CheckpointError: a shard's shape or dtype differs from the template's (another
            sharding), or a DTensor of the template has no tensor in the copy.
    """
    if isinstance(template, DTensor):
        local = template.to_local()
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointError(
                f"{where}: local shard {got} in the copy, {tuple(local.shape)} here "
                "(another sharding)"
            )
        if saved.dtype != local.dtype:
            raise CheckpointError(f"{where}: dtype {saved.dtype} in the copy, {local.dtype} here")
        return DTensor.from_local(
            saved.to(local.device),
            device_mesh=template.device_mesh,
            placements=template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(template.device)
    if isinstance(saved, dict):
        sub = template if isinstance(template, dict) else {}
        return {k: from_local(v, sub.get(k), f"{where}/{k}") for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        subs = list(template) if isinstance(template, (list, tuple)) else []
        subs += [None] * (len(saved) - len(subs))
        out = [
            from_local(v, t, f"{where}/{i}")
            for i, (v, t) in enumerate(zip(saved, subs, strict=True))
        ]
        return out if isinstance(saved, list) else tuple(out)
    return saved


def common_step(per_rank: list[list[int]], durable_newest: int | None) -> int | None:
    """The newest step every rank holds a verified copy of, unless ``durable_newest`` is
    newer (``None``: load from durable storage)."""
    if not per_rank:
        return None
    common = set(per_rank[0]).intersection(*per_rank[1:])
    if not common:
        return None
    best = max(common)
    if durable_newest is not None and durable_newest > best:
        return None
    return best


class _Checkpointer(Protocol):
    """What the tier uses of its :class:`~flexrun.train.sharded.ShardedCheckpointer`."""

    def steps(self) -> list[int]: ...
    def _state_objects(self) -> dict[str, Any]: ...
    def _gather(self, obj: Any) -> list[Any]: ...
    def _broadcast(self, obj: Any) -> Any: ...
    def _emit(self, event: str, **fields: Any) -> None: ...
    def _group(self) -> Any: ...
    def _distributed(self) -> bool: ...


class ShardMemoryTier(TierBase):
    """One ShardedCheckpointer's memory tier on this rank (see the module docstring)."""

    label = "sharded checkpoint memory tier"

    @classmethod
    def open(
        cls,
        directory: str,
        options: CheckpointOptions,
        ctx: TrainContext,
        events: EventLog | None,
        clock: Clock,
    ) -> ShardMemoryTier | None:
        """The tier of a checkpointer of ``directory``; ``None`` without ``durable_every``."""
        if options.durable_every is None:
            return None
        return cls(directory, options, ctx, events, clock)

    def __init__(
        self,
        directory: str,
        options: CheckpointOptions,
        ctx: TrainContext,
        events: EventLog | None,
        clock: Clock,
    ) -> None:
        super().__init__(options, ctx, events, writer=True)  # (each rank its own shards)
        self.save_rng = options.save_rng
        self._clock = clock
        path = self._base_dir(options, directory, "-sharded")
        if path is not None:
            self._open_dir(path / f"rank_{ctx.rank}")

    # -- saving -----------------------------------------------------------------------------
    def _off_anywhere(self, ck: _Checkpointer) -> bool:
        """Whether the tier is off on any rank (collective when distributed)."""
        flag = torch.tensor([0 if self.off is None else 1], dtype=torch.int32)
        if ck._distributed():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ck._group())
        if flag.item() and self.off is None:
            self._turn_off("off on another rank")
        return bool(flag.item())

    def save(self, ck: _Checkpointer, step: int, extra: Mapping[str, Any] | None) -> bool:
        """Write this rank's copy of ``step``; whether the save also goes to durable
        storage (the same answer on every rank). Collective.

        Raises:
            CheckpointError: the copy failed for another reason than a full or vanished
                memory filesystem (those turn the tier off).
        """
        last = self.last_durable
        durable = last is None or step < last or step - last >= self.every
        if self._off_anywhere(ck):
            return True
        if durable:
            self.last_durable = step
        assert self.dir is not None
        states = {n: o.state_dict() for n, o in ck._state_objects().items()}
        record: dict[str, Any] = {"step": step, "world_size": self._ctx.world_size}
        record.update(rank=self._ctx.rank, layout=layout(states))
        payload: dict[str, Any] = {META: record, OBJECTS: to_local(states)}
        payload[EXTRA_FILE] = to_local(dict(extra or {}))
        if self.save_rng:
            payload[RNG_FILE] = capture_rng()
        nbytes = payload_nbytes(payload)
        if self.cap is not None and KEEP * nbytes > self.cap:
            self._turn_off(
                f"this rank's shards take {nbytes} bytes; {KEEP} copies pass "
                f"memory_max_bytes={self.cap}"
            )
            return durable
        try:
            write_copy(self.dir, step, payload)
            worker_hook.saved(worker_hook.counted())  # (synchronous: the state is now's)
        except OSError as exc:
            self._turn_off(f"memory copy failed: {exc}")
        except Exception as exc:
            raise CheckpointError(
                f"memory checkpoint copy failed on rank {self._ctx.rank}: {exc!r}"
            ) from exc
        return durable

    # -- loading ----------------------------------------------------------------------------
    def _verified(self) -> dict[int, dict[str, Any]]:
        """This rank's copies that verify and match this world and rank, by step (each
        newer one that does not is reported with ``checkpoint_memory_skipped``)."""
        found: dict[int, dict[str, Any]] = {}
        if self.dir is None or self.off is not None:
            return found
        for step in reversed(copy_steps(self.dir)):
            what = f"memory copy {self.dir / copy_name(step)}"
            try:
                blob = (self.dir / copy_name(step)).read_bytes()
                verify_blob(blob, what=what)
                state = decode(blob, what=what)
                meta = state.pop(META, None)
                want = {"step": step, "world_size": self._ctx.world_size, "rank": self._ctx.rank}
                if not isinstance(meta, dict) or {k: meta.get(k) for k in want} != want:
                    raise CheckpointError(f"{what}: written as {meta}, loading as {want}")
                state[META] = meta
            except (OSError, CheckpointError) as exc:
                log.warning("%s unusable, trying the one before: %s", what, exc)
                self.emit("checkpoint_memory_skipped", step=step, reason=str(exc))
                continue
            found[step] = state
        return found

    def load(self, ck: _Checkpointer, t0: float) -> Loaded | None:
        """Collective: restore the newest step every rank holds a verified copy of, unless
        durable storage holds a newer one or a copy does not fit this sharding (``None``:
        load from durable storage)."""
        found = self._verified()
        durable_newest = max(ck.steps(), default=None) if self._ctx.is_main else None
        gathered = ck._gather((sorted(found), durable_newest))
        self.last_durable = gathered[0][1]
        best = common_step([s for s, _ in gathered], self.last_durable)
        if best is None:
            return None
        objects = ck._state_objects()
        state, error, rebuilt = found[best], None, {}
        try:
            templates = {name: obj.state_dict() for name, obj in objects.items()}
            if state[META].get("layout") != layout(templates):
                raise CheckpointError(
                    f"the copy of step {best} was sharded otherwise (another mesh or placements)"
                )
            saved = state[OBJECTS]
            if set(saved) != set(objects):
                raise CheckpointError(
                    f"objects {sorted(saved)} in the copy, {sorted(objects)} here"
                )
            for name in objects:
                rebuilt[name] = from_local(saved[name], templates[name], name)
        except (CheckpointError, KeyError, TypeError) as exc:
            error = f"rank {self._ctx.rank}: {exc}"
        errors = [e for e in ck._gather(error) if e]
        if errors:
            ck._emit("checkpoint_memory_unusable", step=best, reason="; ".join(errors))
            return None
        for name, obj in objects.items():
            obj.load_state_dict(rebuilt[name])
        if self.save_rng and RNG_FILE in state:
            restore_rng(state[RNG_FILE])
        extra = ck._broadcast(dict(state.get(EXTRA_FILE) or {}))
        ck._emit(
            "checkpoint_loaded",
            step=best,
            load_s=round(self._clock.monotonic() - t0, 6),
            saved_world_size=self._ctx.world_size,
            skipped=[],
            restored_from="memory",
            sharded=True,
        )
        return Loaded(step=best, extra=extra, world_size=self._ctx.world_size, skipped=())
