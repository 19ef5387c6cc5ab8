"""Live mode: a step loop whose surviving workers never restart.

Owns the worker side of live recovery: membership epochs published by the agents, the
gradient all-reduce (which the loop controls, so that a dead peer can be abandoned),
agreement on the last committed step, state transfer to members that lack it, a fresh
process group per epoch, and the per-step data split that keeps the global batch and the
sample order independent of the world size. It does not decide membership (the agents do,
in ``flexrun.agent.live``) and does not read the environment beyond ``LiveEnv``.

How a recovery works (ARCHITECTURE.md, "Live mode: facts measured here"):

1. The agents publish ``live/epoch`` = (epoch number, member worker ids in rank order,
   abort flag). A dead or frozen worker's agent publishes a new epoch at once.
2. Every worker polls that key while it waits for its asynchronous all-reduce; on an
   aborting change (or a collective error) it abandons the old process group (leaks it:
   aborting a gloo group does not unblock a peer stuck in ``recv``).
3. Members of the new epoch post ``(committed step, has state)`` under the epoch's own
   store prefix, agree on the highest committed step, and the lowest-ranked member at
   that step broadcasts model and optimizer state to everyone (a replacement has none).
4. A new ``ProcessGroupGloo`` on ``PrefixStore("…/pg/<epoch>")`` carries on; the step in
   flight is recomputed, nothing else.

A joining node is admitted at a step boundary: a non-aborting epoch change is signalled
by one extra element appended to the gradient all-reduce, so every member switches after
the same step. Data for step ``s`` is the global positions ``[s*G, (s+1)*G)`` of a seeded
per-epoch permutation, split contiguously among the current ranks, and the loss of each
micro-batch is scaled by its share of ``G``: the summed gradient is the single-process
gradient of the global batch whatever the world size, and at an unchanged world size the
run is bitwise identical to one that never failed.

When live state cannot be trusted (nobody holds it: every member died; or the members'
committed steps or model checksums disagree), the epoch's rank 0 restores the newest
durable checkpoint and broadcasts it, as restart mode would, with a ``live_fallback``
event; the decision is ``flexrun.train.live_plan.plan_recovery``.

Backends: gloo with CPU tensors is the only implemented and tested path. NCCL is not
implemented (and has not been run: no GPU here). The intended design: a
``ProcessGroupNCCL`` per epoch on the same fresh ``PrefixStore`` namespace, with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (which the agent sets) and the old group's
``abort()`` (``ncclCommAbort``, which, unlike gloo's abort, does release kernels stuck on
a dead peer) instead of leaking it; gradients and the state broadcast on the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flexrun.errors import CheckpointError, ConfigError, FlexrunError
from flexrun.live_protocol import STATE_MARK, EpochRecord, formed_key, live_keys
from flexrun.observe.events import EventLog
from flexrun.train.live_plan import MemberReport, plan_recovery

log = logging.getLogger("flexrun.train.live")

PREEMPTED_EXIT = 143


class LiveAborted(FlexrunError):
    """The current epoch ended under a step (a member died or the membership changed)."""


class _TrainingFinished(Exception):
    """The job's members completed every step while this worker waited to join."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveEnv:
    """What the agent tells a live worker (``FLEXRUN_LIVE_*``)."""

    store_host: str
    store_port: int
    run_id: str
    worker_id: str
    heartbeat_file: Path
    heartbeat_interval_s: float
    run_dir: str | None
    round: int

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> LiveEnv:
        """Raises ConfigError when the script was not started by ``flexrun run --mode live``."""
        if env.get("FLEXRUN_LIVE") != "1":
            raise ConfigError(
                "LiveLoop needs `flexrun run --mode live` (or auto mode with a script that uses it); "
                "under torchrun or restart mode use the Checkpointer and ElasticSampler instead"
            )
        try:
            host, _, port = env["FLEXRUN_LIVE_STORE"].rpartition(":")
            return cls(
                store_host=host,
                store_port=int(port),
                run_id=env["FLEXRUN_RUN_ID"],
                worker_id=env["FLEXRUN_WORKER_ID"],
                heartbeat_file=Path(env["FLEXRUN_LIVE_HEARTBEAT"]),
                heartbeat_interval_s=float(env.get("FLEXRUN_LIVE_HEARTBEAT_INTERVAL", "0.5")),
                run_dir=env.get("FLEXRUN_RUN_DIR") or None,
                round=int(env.get("FLEXRUN_ROUND", "0")),
            )
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"live-mode environment incomplete or malformed: {exc}") from exc


def state_checksum(model: torch.nn.Module) -> str:
    """sha256 of the model's state in a fixed order (survivors must agree after recovery)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def split_share(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s contiguous share of a global batch (sizes differ by <= 1)."""
    base, extra = divmod(global_batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class Step:
    """One global step as seen by one rank: its samples and a scaled ``backward``."""

    def __init__(self, loop: LiveLoop, number: int) -> None:
        self._loop = loop
        self.number = number
        self.rank = loop.rank
        self.world_size = loop.world_size
        start, end = split_share(loop.global_batch, loop.world_size, loop.rank)
        self.indices: list[int] = [
            loop.sample_index(number * loop.global_batch + p) for p in range(start, end)
        ]

    def batches(self, micro_batch: int | None = None) -> Iterator[Any]:
        """This rank's share of the step's global batch, collated, in micro-batches."""
        size = micro_batch or max(1, len(self.indices))
        for i in range(0, len(self.indices), size):
            chunk = self.indices[i : i + size]
            self._loop._current_micro = len(chunk)
            yield self._loop.collate([self._loop.dataset[j] for j in chunk])

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss that is the mean over the last micro-batch, weighted by its
        share of the global batch (uneven splits are exact, not rejected)."""
        (loss * (self._loop._current_micro / self._loop.global_batch)).backward()


def _default_collate(items: Sequence[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate(list(items))


class LiveLoop:
    """Iterate training steps that survive worker and node loss in-process.

    Usage::

        loop = LiveLoop(model, optimizer, dataset, global_batch=64, steps=500)
        for step in loop:
            for x, y in step.batches():
                step.backward(F.cross_entropy(model(x), y))

    After each ``for`` body, gradients are summed across the current members and the
    optimizer steps; that is the step's commit. Do not wrap the model in DDP.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        global_batch: int,
        steps: int,
        seed: int = 0,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 0,
        timeout_s: float = 120.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if global_batch < 1 or steps < 0:
            raise ConfigError(
                f"global_batch must be >= 1 and steps >= 0 (got {global_batch}, {steps})"
            )
        self.env = LiveEnv.from_environ(os.environ if environ is None else environ)
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.global_batch = global_batch
        self.total_steps = steps
        self.seed = seed
        self.collate = collate_fn or _default_collate
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.timeout_s = timeout_s
        self.committed = 0
        self.has_state = False
        self.rank = 0
        self.world_size = 1
        self.epoch: EpochRecord | None = None
        self._pg: Any = None
        self._abandoned: list[Any] = []  # old groups are leaked on purpose, never aborted
        self._perm_cache: tuple[int, list[int]] | None = None
        self._current_micro = 0
        self._pending_change = False
        self._next_epoch_check = 0.0
        self._preempted = False
        self._params = [p for p in model.parameters()]
        self._ckpt: Any = None
        self._ckpt_rank0 = False
        self.events = EventLog(self.env.run_dir, run_id=self.env.run_id, node=self.env.worker_id)
        self.events.round = self.env.round
        self._epoch_key, self._ns = live_keys(self.env.run_id)
        self._done_key = self._epoch_key.rsplit("/", 1)[0] + "/done"
        self._formed_key = formed_key(self.env.run_id)

        from flexrun.store.tcp import TcpStore

        self.store = TcpStore(self.env.store_host, self.env.store_port, connect_timeout_s=30)
        self._raw = dist.TCPStore(
            self.env.store_host, self.env.store_port, None, False, timedelta(seconds=timeout_s)
        )
        self._stop_hb = threading.Event()
        self._hb = threading.Thread(
            target=self._heartbeat, name="flexrun-live-heartbeat", daemon=True
        )
        self._touch()  # the agent admits this worker into an epoch once this file exists
        self._hb.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- plumbing -----------------------------------------------------------------------
    def _touch(self) -> None:
        self.env.heartbeat_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.env.heartbeat_file, "a"):
            os.utime(self.env.heartbeat_file)

    def _heartbeat(self) -> None:
        while not self._stop_hb.wait(self.env.heartbeat_interval_s):
            try:
                self._touch()
            except OSError as exc:
                log.warning("live heartbeat failed: %s", exc)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted = True

    def sample_index(self, position: int) -> int:
        """Dataset index at global sample ``position`` (seeded permutation per data epoch)."""
        n = len(self.dataset)
        data_epoch, offset = divmod(position, n)
        if self._perm_cache is None or self._perm_cache[0] != data_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + data_epoch)
            self._perm_cache = (data_epoch, torch.randperm(n, generator=g).tolist())
        return self._perm_cache[1][offset]

    def _read_epoch(self) -> EpochRecord | None:
        entry = self.store.get(self._epoch_key)
        return EpochRecord.decode(entry.value) if entry is not None else None

    # -- the loop ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        self.events.emit("live_worker_ready", pid=os.getpid())  # (joiner latency breakdown)
        try:
            self._rejoin(reason="start")
        except _TrainingFinished:
            # A replacement that arrived after the last step: nothing to train, and no
            # trained state to hand to the code after the loop. Leave quietly.
            self.events.emit("live_late_joiner_exit", committed=self.committed)
            self._retire()
            sys.exit(0)
        try:
            while self.committed < self.total_steps:
                torch.manual_seed(self.seed * 7919 + self.committed * 104729 + self.rank)
                for p in self._params:
                    p.grad = None
                step = Step(self, self.committed)
                yield step
                if not self._commit(step):
                    continue
                if self._preempted_all():
                    return
            self.store.put(self._done_key, str(self.total_steps).encode())
            if self._ckpt is not None:
                self._ckpt.wait()
        finally:
            self._retire()

    def _retire(self) -> None:
        """Leave the live protocol: stop heart-beating (the agent then stops watching for
        hangs) and make sure no process group is ever destroyed. A gloo group's destructor
        joins threads that may be stuck in ``recv`` from a peer of an old epoch, which would
        hang the process at exit."""
        self._stop_hb.set()
        if self._hb.is_alive():
            self._hb.join(timeout=2)
        with contextlib.suppress(OSError):
            self.env.heartbeat_file.unlink()
        for pg in [*self._abandoned, self._pg]:
            if pg is not None:
                _leak(pg)

    def _commit(self, step: Step) -> bool:
        try:
            # Once per step too: a small world's all-reduce may complete before _wait ever
            # looks, and a joiner would wait many steps to be noticed.
            self._check_epoch(time.monotonic())
        except LiveAborted as exc:
            self._rejoin(reason=str(exc))
            return False
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in self._params
        ]
        flags = torch.tensor(
            [1.0 if self._pending_change else 0.0, 1.0 if self._preempted else 0.0],
            dtype=grads[0].dtype if grads else torch.float32,
        )
        buf = torch.cat([*grads, flags]) if grads else flags
        try:
            self._wait(self._pg.allreduce([buf]))
        except LiveAborted as exc:
            self._rejoin(reason=str(exc))
            return False
        offset = 0
        for p in self._params:
            n = p.numel()
            p.grad = buf[offset : offset + n].view_as(p).clone()
            offset += n
        self.optimizer.step()
        self.committed += 1
        self.has_state = True
        self._flags = (float(buf[-2]), float(buf[-1]))
        if self.checkpoint_every and self.committed % self.checkpoint_every == 0 and self.rank == 0:
            self._checkpointer().save(self.committed, extra={"step": self.committed})
        if self._flags[0] > 0 and not self._flags[1] > 0:
            self._rejoin(reason="membership change at a step boundary")
        return True

    def _preempted_all(self) -> bool:
        """SIGTERM seen by some ranks: everyone agreed through the all-reduce flag."""
        flags = getattr(self, "_flags", (0.0, 0.0))
        if not flags[1] > 0:
            return False
        if int(flags[1]) >= self.world_size:
            if self.rank == 0 and self.checkpoint_dir:
                self._checkpointer().save(
                    self.committed, extra={"step": self.committed}, blocking=True
                )
            self.events.emit("preempted", step=self.committed, rank=self.rank)
            self._retire()
            sys.exit(PREEMPTED_EXIT)
        if self._preempted:
            # Only this node is going away: leave after a committed step; the others
            # re-form without us and lose nothing.
            self.events.emit("preempted", step=self.committed, rank=self.rank, partial=True)
            self._retire()
            sys.exit(PREEMPTED_EXIT)
        return False

    def _wait(self, work: Any) -> None:
        """Wait for a collective, watching for an aborting epoch change."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if work.is_completed():
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise LiveAborted(
                        f"collective failed: {str(exc).splitlines()[0][:200]}"
                    ) from exc
                return
            now = time.monotonic()
            self._check_epoch(now)
            if now > deadline:
                raise LiveAborted(f"collective did not complete in {self.timeout_s:g}s")
            time.sleep(0.0005)

    def _check_epoch(self, now: float) -> None:
        """At most every 5 ms: an aborting epoch change raises LiveAborted; a growing one
        is flagged, to be agreed at the next step boundary."""
        if now < self._next_epoch_check:
            return
        self._next_epoch_check = now + 0.005
        rec = self._read_epoch()
        current = self.epoch.number if self.epoch else -1
        if rec is not None and rec.number != current:
            if rec.abort or self.env.worker_id not in rec.members:
                raise LiveAborted(f"epoch {rec.number} replaced epoch {current}")
            self._pending_change = True

    # -- membership -------------------------------------------------------------------------
    def _next_epoch(self, after: int) -> EpochRecord:
        """Wait until an epoch newer than ``after`` that includes this worker is published."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            since = self.store.revision()
            self._check_finished()
            rec = self._read_epoch()
            if rec is not None and rec.number > after:
                if self.env.worker_id in rec.members:
                    return rec
                if time.monotonic() > deadline:
                    raise LiveAborted(f"excluded from epoch {rec.number}")
            if time.monotonic() > deadline:
                raise LiveAborted(
                    f"no new membership epoch after {after} within {self.timeout_s:g}s"
                )
            self.store.wait_for_change(self._epoch_key, since, 0.5)

    def _check_finished(self) -> None:
        if not self.has_state and self.store.get(self._done_key) is not None:
            raise _TrainingFinished()

    def _rejoin(self, *, reason: str) -> None:
        t0 = time.monotonic()
        if self._pg is not None:
            self._abandoned.append(self._pg)
            _leak(self._pg)
            self._pg = None
        after = self.epoch.number if self.epoch is not None else -1
        while True:
            rec = self._next_epoch(after)
            try:
                self._join(rec, reason=reason, t0=t0)
                return
            except LiveAborted as exc:
                log.info("epoch %d did not form (%s); waiting for the next", rec.number, exc)
                after = rec.number

    def _join(self, rec: EpochRecord, *, reason: str, t0: float) -> None:
        rank, world = rec.members.index(self.env.worker_id), len(rec.members)
        prefix = dist.PrefixStore(f"{self._ns}{rec.number}/", self._raw)
        report: dict[str, Any] = {"step": self.committed, "has_state": self.has_state}
        if self.has_state:
            report["checksum"] = state_checksum(self.model)
        prefix.set(f"ready/{rank}", json.dumps(report))
        names = [f"ready/{r}" for r in range(world)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                prefix.wait(names, timedelta(seconds=0.2))
                break
            except RuntimeError as exc:
                if "timeout" not in str(exc).lower():
                    raise LiveAborted(f"store failed during agreement: {exc}") from exc
            self._check_finished()
            latest = self._read_epoch()
            if latest is not None and latest.number != rec.number:
                raise LiveAborted(f"epoch {latest.number} superseded {rec.number} during agreement")
            if time.monotonic() > deadline:
                raise LiveAborted(f"members of epoch {rec.number} did not all arrive")
        reports = [
            MemberReport(int(d["step"]), bool(d["has_state"]), d.get("checksum"))
            for d in (json.loads(bytes(v)) for v in prefix.multi_get(names))
        ]
        plan = plan_recovery(reports, formed=self.store.get(self._formed_key) is not None)
        pg = dist.ProcessGroupGloo(prefix, rank, world, timedelta(seconds=self.timeout_s))
        self._pg, self.epoch, self.rank, self.world_size = pg, rec, rank, world
        self._pending_change = False
        self._flags = (0.0, 0.0)
        error = None
        if plan.load_durable and rank == plan.source:
            try:
                self._restore_durable(rec.number, plan.fallback)
            except CheckpointError as exc:
                error = str(exc)
        if plan.transfer:
            self._transfer(plan.source, error)
        elif error is not None:
            raise CheckpointError(error)
        first = not self.has_state
        self.has_state = True
        self.events.round = self.env.round
        self.events.emit(
            "live_joined",
            epoch=rec.number,
            rank=rank,
            world_size=world,
            step=self.committed,
            source=plan.source if plan.transfer else None,
            fallback=plan.fallback,
            checksum=state_checksum(self.model),
            duration_s=round(time.monotonic() - t0, 4),
            reason=reason,
        )
        if first:
            # Tells the agent that this worker holds live state (see LiveSupervisor).
            with contextlib.suppress(OSError):
                self.env.heartbeat_file.write_text(STATE_MARK + "\n")
            self.store.put(self._formed_key, str(rec.number).encode())

    def _transfer(self, source: int, error: str | None = None) -> None:
        """Every member takes ``source``'s state. ``error`` (on the source): it has no
        state to give; every member raises CheckpointError with that message."""
        payload = torch.empty(0, dtype=torch.uint8)
        if self.rank == source and error is not None:
            blob = error.encode()[:4096]
            payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            size = torch.tensor([-payload.numel()], dtype=torch.int64)
        elif self.rank == source:
            buf = io.BytesIO()
            torch.save(
                {
                    "model": self.model.state_dict(),
                    "optim": self.optimizer.state_dict(),
                    "step": self.committed,
                },
                buf,
            )
            payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(self._pg.broadcast(size, source))
        n = int(size.item())
        if self.rank != source:
            payload = torch.empty(abs(n), dtype=torch.uint8)
        self._wait(self._pg.broadcast(payload, source))
        if n < 0:
            raise CheckpointError(
                f"live recovery impossible (rank {source}): "
                + payload.numpy().tobytes().decode(errors="replace")
            )
        if self.rank != source:
            state = torch.load(
                io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True
            )
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
            self.committed = int(state["step"])

    # -- durability -------------------------------------------------------------------------
    def _checkpointer(self) -> Any:
        if self._ckpt is None:
            if not self.checkpoint_dir:
                raise CheckpointError("checkpoint_dir is not set")
            from flexrun.train.checkpoint import Checkpointer
            from flexrun.train.context import single_process_context

            ctx = single_process_context(run_dir=self.env.run_dir, round=self.env.round)
            self._ckpt = Checkpointer(self.checkpoint_dir, ctx=ctx, save_rng=False)
            self._ckpt.register("model", self.model)
            self._ckpt.register("optim", self.optimizer)
        return self._ckpt

    def _restore_durable(self, epoch: int, fallback: str | None) -> None:
        """Restore the newest durable checkpoint into this (source) member, as restart mode
        would: at the job's start (a resume), or because live state is lost or inconsistent
        (``fallback`` says why; then the event log says so).

        Raises:
            CheckpointError: live state is inconsistent and there is no durable checkpoint
                to fall back to, or checkpoints exist and none verifies.
        """
        loaded = self._checkpointer().load() if self.checkpoint_dir else None
        if loaded is not None:
            self.committed = int(loaded.extra.get("step", loaded.step))
            self.has_state = True
            source = "durable checkpoint"
        elif fallback is not None and self.has_state:
            # The weights in memory were trained past step 0 and some member's differ:
            # there is nothing trustworthy to continue from.
            raise CheckpointError(
                f"{fallback}, and there is no durable checkpoint to fall back to"
                f" (checkpoint_dir={self.checkpoint_dir!r})"
            )
        else:
            # Fresh processes: their state is the script's initial state, as in a restart
            # without a checkpoint.
            self.committed = 0
            source = "initial state (no durable checkpoint)"
        if fallback is not None:
            log.warning(
                "live fallback in epoch %d: %s; resuming from %s at step %d",
                epoch,
                fallback,
                source,
                self.committed,
            )
            self.events.emit(
                "live_fallback", epoch=epoch, reason=fallback, step=self.committed, source=source
            )

    def close(self) -> None:
        """Wait for the last durable checkpoint and leave the live protocol. Idempotent."""
        self._retire()
        if self._ckpt is not None:
            self._ckpt.close()


_LEAKED: set[int] = set()


def _leak(obj: Any) -> None:
    """Give ``obj`` one reference that is never released, so that interpreter shutdown
    never runs its destructor (see ``LiveLoop._retire``)."""
    if id(obj) not in _LEAKED:
        _LEAKED.add(id(obj))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


__all__ = [
    "EpochRecord",
    "LiveAborted",
    "LiveEnv",
    "LiveLoop",
    "Step",
    "live_keys",
    "split_share",
    "state_checksum",
]
