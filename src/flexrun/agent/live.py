"""The agent's side of live mode: worker slots, warm spares, liveness, membership epochs.

Owns this node's live workers: it starts them once, replaces a dead or frozen one (from a
warm spare when it has one), and publishes the job's membership epoch that the workers'
``flexrun.train.live.LiveLoop`` follows. It never restarts survivors. Node membership
(who is in the job) still comes from the rendezvous rounds; an epoch is the list of live
workers of the round's nodes, in node order then local rank.

Store keys (under ``flexrun/<run_id>/live/``): ``nodes/<node_id>`` = this node's included
workers; ``epoch`` = the current :class:`~flexrun.train.live.EpochRecord`, changed by
compare-and-set by whichever agent sees a change first (they all compute the same list).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.agent.spec import worker_envs
from flexrun.agent.warm import live_pool
from flexrun.cause import FailureCause
from flexrun.config import RunConfig
from flexrun.events import EventLog
from flexrun.live_protocol import STATE_MARK, EpochRecord, formed_key, live_keys
from flexrun.proc import Tee, Worker, WorkerResult, read_cause, reap, spawn_worker, start_tees
from flexrun.rendezvous import RendezvousHandler
from flexrun.rendezvous.state import MasterRecord, RoundRecord
from flexrun.spares.pool import WarmPool, assign
from flexrun.store.api import Store

log = logging.getLogger("flexrun.agent")

# A node's first workers were started as spares when its agent started: one still importing
# torch is ready sooner than a process started now (waits end early if none is booting).
SPARE_BOOT_WAIT_S = 60.0


@dataclass
class LiveWorker:
    """One live worker process (or a spare waiting to become one)."""

    worker_id: str
    worker: Worker
    heartbeat: Path
    included: bool = False
    """Part of this node's published member list."""
    finished: bool = False
    tees: list[Tee] = field(default_factory=list)


class LiveSupervisor:
    """This node's live workers for the whole job."""

    def __init__(
        self,
        config: RunConfig,
        rdzv: RendezvousHandler,
        store: Store,
        store_addr: tuple[str, int],
        command: list[str],
        *,
        events: EventLog,
        warm_spares: int,
        clock: Clock = SYSTEM_CLOCK,
        pool: WarmPool | None = None,
    ) -> None:
        self.config = config
        self.rdzv = rdzv
        self.store = store
        self.store_addr = store_addr
        self.command = command
        self.events = events
        self.warm_spares = warm_spares
        self.clock = clock
        self.node = rdzv.me.node_id
        self.slots: dict[int, LiveWorker] = {}
        self.round: RoundRecord | None = None
        self._seq = 0
        self._tee_done = threading.Event()
        self._epoch_key, _ = live_keys(config.run_id)
        self._node_key = f"flexrun/{config.run_id}/live/nodes/{self.node}"
        self._formed_key = formed_key(config.run_id)
        self._published: tuple[int, tuple[str, ...]] | None = None
        self._counted_epoch = -1
        self._log_root = (config.log_dir or config.run_dir / "logs") / "live"
        self._hb_root = config.run_dir / "live-heartbeats" / self.node
        # This node's own first workers boot (Python, torch) while the agent meets the
        # others: a joining node trains that much sooner. The launcher starts them before
        # it connects to the store (``pool``); built here otherwise.
        self.pool: WarmPool | None = pool if pool is not None else live_pool(config)
        if self.pool is not None:
            self.pool.fill(count=config.nproc_per_node)

    @property
    def active(self) -> bool:
        return bool(self.slots)

    # -- processes ----------------------------------------------------------------------------
    def _next_id(self) -> str:
        self._seq += 1
        return f"{self.node}.w{self._seq}"

    def _env(self, slot: int, worker_id: str, heartbeat: Path) -> dict[str, str]:
        assert self.round is not None
        env = worker_envs(
            base=self.config.environ,
            rnd=self.round,
            node_id=self.node,
            nproc=self.config.nproc_per_node,
            master=MasterRecord(self.config.local_addr, 0),
            role=self.config.role,
            run_id=self.config.run_id,
            run_dir=self.config.run_dir,
            restart_count=0,
            max_restarts=self.config.rendezvous.max_restarts,
        )[slot]
        # Live workers form their own groups per epoch: no default process group address.
        # Their bounded store waits time out routinely; c10d would warn about each one.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env.pop("MASTER_ADDR", None)
        env.pop("MASTER_PORT", None)
        env.update(
            FLEXRUN_LIVE="1",
            FLEXRUN_LIVE_STORE=f"{self.store_addr[0]}:{self.store_addr[1]}",
            FLEXRUN_WORKER_ID=worker_id,
            FLEXRUN_LIVE_HEARTBEAT=str(heartbeat),
            FLEXRUN_LIVE_HEARTBEAT_INTERVAL=str(
                min(0.5, self.config.rendezvous.heartbeat_interval_s)
            ),
        )
        return env

    def _spawn(self, slot: int) -> LiveWorker:
        wid = self._next_id()
        hb = self._hb_root / wid
        hb.unlink(missing_ok=True)
        w = spawn_worker(
            self.command, self._env(slot, wid, hb), self._log_root / wid, rank=slot, local_rank=slot
        )
        lw = LiveWorker(wid, w, hb)
        lw.tees = start_tees(
            w.log_dir, f"[{wid}]:", self.config.console_streams, self._tee_done, w.log_offsets
        )
        self.events.emit(
            "worker_started", worker_id=wid, local_rank=slot, pid=w.proc.pid, spare=False
        )
        return lw

    def _fill(
        self, slot: int, *, include_now: bool, boot_wait_s: float = 0.0, joining: bool = False
    ) -> None:
        """Put a worker in ``slot``: a ready warm spare joins the next epoch at once (the
        world size, and so bitwise reproducibility, is kept); otherwise a fresh process is
        started and joins at a step boundary once it is up, while the others carry on.
        ``boot_wait_s``: wait that long for a spare that is still importing torch.
        ``joining``: a new node's worker; even a spare enters an epoch only once its script
        has reached the loop (the running members must not wait for the script's set-up)."""
        spare = self.pool.take(wait_s=boot_wait_s) if self.pool is not None else None
        if spare is None:
            lw = self._spawn(slot)
            lw.included = include_now
            self.slots[slot] = lw
            return
        wid = self._next_id()
        hb = self._hb_root / wid
        hb.unlink(missing_ok=True)
        assign(
            spare,
            env=self._env(slot, wid, hb),
            entry=self.config.entrypoint,
            args=self.config.args,
            module=self.config.module,
            rank=slot,
            local_rank=slot,
            log_dir=self._log_root / wid,
        )
        lw = LiveWorker(wid, spare, hb, included=include_now or not joining)
        lw.tees = start_tees(
            spare.log_dir,
            f"[{wid}]:",
            self.config.console_streams,
            self._tee_done,
            spare.log_offsets,
        )
        self.slots[slot] = lw
        self.events.emit(
            "worker_started",
            worker_id=wid,
            local_rank=slot,
            pid=spare.proc.pid,
            spare=True,
            spare_ready_ts=self.pool.last_ready_ts if self.pool is not None else None,
        )
        log.info("slot %d: a warm spare takes over as %s", slot, wid)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, rnd: RoundRecord) -> None:
        """Start this node's workers (once per job, or after a stop)."""
        self.round = rnd
        first_in_job = self.store.get(self._epoch_key) is None
        for slot in range(self.config.nproc_per_node):
            self._fill(
                slot,
                include_now=first_in_job,
                boot_wait_s=SPARE_BOOT_WAIT_S,
                joining=not first_in_job,
            )
        if self.pool is not None:
            self.pool.trim()  # (and refilled by poll() once these workers are up)
        self.publish()

    def on_round(self, rnd: RoundRecord) -> None:
        """Node membership changed: survivors keep running; only the epoch changes."""
        self.round = rnd
        self.publish()

    def stop(self, grace_s: float) -> None:
        if self.pool is not None:
            self.pool.close()
        procs = list(self.slots.values())
        for lw in procs:
            if lw.worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(lw.worker.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for lw in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                lw.worker.proc.wait(timeout=max(0.001, deadline - time.monotonic()))
            reap(lw.worker)
        self._tee_done.set()
        for lw in procs:
            for t in lw.tees:
                t.join(timeout=2)
        self._tee_done = threading.Event()
        self.slots.clear()
        self._published = None

    # -- monitoring ---------------------------------------------------------------------------
    def poll(self) -> int | None:
        """Check workers; replace the dead; publish changes. Returns 0 when all finished."""
        changed = False
        dead: list[int] = []
        now = time.time()
        timeout = self.config.rendezvous.heartbeat_timeout_s
        for slot, lw in sorted(self.slots.items()):
            if lw.finished:
                continue
            rc = lw.worker.proc.poll()
            if rc is None:
                try:
                    mtime = lw.heartbeat.stat().st_mtime
                except FileNotFoundError:
                    continue  # not in the loop yet, or done with it: nothing to watch
                if True:
                    if not lw.included:
                        lw.included, changed = True, True
                    age = now - mtime
                    if age > timeout:
                        log.warning(
                            "worker %s sent no heartbeat for %.1fs: killing it", lw.worker_id, age
                        )
                        self.events.emit(
                            "hang_detected", worker_id=lw.worker_id, silent_s=round(age, 2)
                        )
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(lw.worker.proc.pid, signal.SIGKILL)
                continue
            result = WorkerResult(slot, slot, lw.worker.proc.pid, rc, now)
            self.events.emit(
                "worker_exited",
                worker_id=lw.worker_id,
                local_rank=slot,
                pid=result.pid,
                exit_code=result.exit_code,
                signal=result.signal_name,
            )
            if rc == 0:
                lw.finished = True
                continue
            cause = read_cause(lw.worker, result).replace(node=self.node, worker_id=lw.worker_id)
            reap(lw.worker)
            del self.slots[slot]
            self._count_failure(cause)
            dead.append(slot)
        if dead and not any(other.finished for other in self.slots.values()):
            # (When some worker finished, training is complete: nothing left to replace.)
            lost = self._state_lost()
            if lost is not None:
                self._fall_back(lost)
            for slot in dead:
                self._fill(slot, include_now=lost is not None)
            changed = True
        if self.slots and all(lw.finished for lw in self.slots.values()):
            return 0
        if self.pool is not None and self._settled():
            # Not earlier: a spare importing torch would slow this node's workers' start.
            self.pool.fill()
        if changed or self._published is None or self.round is not None:
            self.publish()
        return None

    def _settled(self) -> bool:
        """Every worker of this node has reached the loop (or finished)."""
        return all(lw.finished or lw.heartbeat.exists() for lw in self.slots.values())

    def _state_lost(self) -> int | None:
        """The number of the current epoch if no living worker can hold its state (every
        member died), else None. Another node's published workers count as holders: the
        workers themselves fall back if they turn out to have none (``live_plan``)."""
        if self.store.get(self._formed_key) is None:
            return None  # no epoch has trained yet: nothing to lose
        entry = self.store.get(self._epoch_key)
        if entry is None:
            return None
        current = EpochRecord.decode(entry.value)
        if any(lw.worker.proc.poll() is None and _holds_state(lw) for lw in self.slots.values()):
            return None
        prefix = f"flexrun/{self.config.run_id}/live/nodes/"
        records = self.store.get_prefix(prefix)
        others = self.round.members if self.round is not None else ()
        for m in others:
            rec = records.get(prefix + m.node_id)
            if m.node_id == self.node or rec is None:
                continue
            if set(json.loads(rec.value)["workers"]) & set(current.members):
                return None
        return current.number

    def _fall_back(self, epoch: int) -> None:
        """Every member of ``epoch`` died: restart mode. All of this node's workers (fresh
        ones and spares) enter the next epoch together, at the full world size, and resume
        from the latest durable checkpoint (the new epoch's rank 0 loads and broadcasts it)."""
        detail = (
            f"every worker of live epoch {epoch} died: restarting all workers from the latest "
            "durable checkpoint"
        )
        log.warning("live fallback: %s", detail)
        self.events.emit("restart", reason="live_fallback", detail=detail, epoch=epoch, mode="live")
        for lw in self.slots.values():
            lw.included = True

    def _count_failure(self, cause: FailureCause) -> None:
        entry = self.store.get(self._epoch_key)
        epoch = EpochRecord.decode(entry.value).number if entry is not None else 0
        log.warning(
            "worker %s failed (%s): %s; replacing it, survivors keep running",
            cause.worker_id,
            cause.describe(),
            cause.message,
        )
        if epoch == self._counted_epoch:
            return  # several deaths under one epoch are one incident
        self._counted_epoch = epoch
        self.events.emit("failure", **cause.to_dict())
        self.rdzv.count_failure(cause)

    # -- membership epochs --------------------------------------------------------------------
    def publish(self) -> None:
        """Publish this node's included workers and, if the job's list changed, a new epoch."""
        if self.round is None:
            return
        mine = tuple(lw.worker_id for _, lw in sorted(self.slots.items()) if lw.included)
        if self._published != (self.round.number, mine):
            self.store.put(
                self._node_key,
                json.dumps({"round": self.round.number, "workers": list(mine)}).encode(),
            )
            self._published = (self.round.number, mine)
        members: list[str] = []
        prefix = f"flexrun/{self.config.run_id}/live/nodes/"
        records = self.store.get_prefix(prefix)
        for m in self.round.members:
            entry = records.get(prefix + m.node_id)
            if entry is not None:
                members.extend(json.loads(entry.value)["workers"])
        if not members:
            return
        entry = self.store.get(self._epoch_key)
        current = EpochRecord.decode(entry.value) if entry is not None else None
        if current is not None and current.members == tuple(members):
            return
        abort = current is not None and any(w not in members for w in current.members)
        rec = EpochRecord((current.number + 1) if current else 1, tuple(members), abort)
        ok, _ = self.store.compare_and_set(
            self._epoch_key, rec.encode(), expected_revision=entry.revision if entry else 0
        )
        if ok:
            self.events.emit(
                "live_epoch",
                epoch=rec.number,
                members=list(rec.members),
                abort=abort,
                world_size=len(rec.members),
            )
            log.info(
                "live epoch %d: %d worker(s)%s",
                rec.number,
                len(members),
                " (abort)" if abort else "",
            )


def _holds_state(lw: LiveWorker) -> bool:
    """The worker has joined an epoch (``LiveLoop`` marks its heartbeat file then)."""
    try:
        return lw.heartbeat.read_text().startswith(STATE_MARK)
    except OSError:
        return False
