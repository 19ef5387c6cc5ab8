"""The agent side of bench_rdzv_scale.py: K rendezvous agents in one process.

Each agent is flexrun's real ``RendezvousHandler`` (or torch's ``DynamicRendezvousHandler``)
on a store client of its own, counted: requests and bytes each way, split between the
agent's loop and its keep-alives. The harness does what an agent's loop does (join, wait,
step; the round's master address once it has one) and nothing the protocol should: no
shared clients, no shared waits (each handler keeps its own long store watch in a thread
of its own, as in a real agent). What it shares is threads: two steppers per process tick
the agents' loops (an agent's tick never blocks on the store here: the master address is
polled where a real agent waits on its directory), and a few schedulers write every agent's
keep-alive at its interval (the handler's keep-alive thread, multiplexed: 32 agents each). With a thread
per loop and per keep-alive, 4096 agents on 2 cores spent their time handing 16 GILs
around (load average 1300, no round in 240 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HB_THREAD = "flexrun-heartbeat"  # the handler's keep-alive thread name
STORE_OPS = ("get", "get_at", "get_prefix", "put", "put_many", "compare_and_set", "delete",
             "delete_prefix", "wait_for_change", "revision")
KEYED_OPS = ("get", "get_at", "put", "compare_and_set")  # labelled with the kind of key too
_op = threading.local()  # the flexrun Store method this thread is in (what a request serves)


class Counter:
    """Requests and bytes of one agent's store client, by thread role."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.req = {"rdzv": 0, "hb": 0}
        self.out = {"rdzv": 0, "hb": 0}
        self.inp = {"rdzv": 0, "hb": 0}
        self.ops: dict[str, list[int]] = {}  # the loop's (rdzv) Store method -> [requests, bytes]

    def add(self, sent: int, received: int) -> None:
        role = "hb" if threading.current_thread().name in (HB_THREAD, "torch-hb") else "rdzv"
        with self.lock:
            self.req[role] += 1
            self.out[role] += sent
            self.inp[role] += received
            if role == "rdzv":
                c = self.ops.setdefault(getattr(_op, "name", None) or "other", [0, 0])
                c[0] += 1
                c[1] += sent + received

    def add_received(self, received: int) -> None:
        """Bytes that arrived on a stream already counted as a request (a watch read on)."""
        role = "hb" if threading.current_thread().name in (HB_THREAD, "torch-hb") else "rdzv"
        with self.lock:
            self.inp[role] += received
            if role == "rdzv":
                self.ops.setdefault(getattr(_op, "name", None) or "other", [0, 0])[1] += received

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"req": dict(self.req), "out": dict(self.out), "inp": dict(self.inp),
                    "ops": {k: list(v) for k, v in self.ops.items()}}


def key_kind(key: str) -> str:
    """What a rendezvous key is (``flexrun/<run>/...``), for the request breakdown."""
    rest = key.split("/", 2)[-1]
    for prefix, kind in (("s/round/current", "header"), ("s/round/watcher", "claim"),
                         ("s/round/master/", "master"), ("s/master/", "master"),
                         ("s/nodes/", "node"), ("s/ask/", "ask"), ("hb/", "keep-alive")):
        if rest.startswith(prefix):
            return kind
    if rest.startswith("r/"):
        return "slice" if "/s/" in rest else "list"
    return "other"


def name_ops(store: Any) -> None:
    """Label the requests of each flexrun ``Store`` method of ``store`` (instance patch), so
    that the counter can say which protocol operation they served (and on which kind of
    key: :func:`key_kind`)."""
    for name in STORE_OPS:
        fn = getattr(store, name, None)
        if fn is None:
            continue

        def labelled(*args: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            outer = getattr(_op, "name", None)
            label = _name
            if _name in KEYED_OPS and args and isinstance(args[0], str):
                label = f"{_name} {key_kind(args[0])}"
            _op.name = outer or label
            try:
                return _fn(*args, **kw)
            finally:
                _op.name = outer

        setattr(store, name, labelled)


def _size(x: Any) -> int:
    if isinstance(x, (bytes, bytearray, memoryview)):
        return len(x)
    if isinstance(x, str):
        return len(x.encode())
    if isinstance(x, (list, tuple)):
        return sum(_size(v) for v in x) + 8 * len(x)
    return 8


def count_tcp(store: Any, counter: Counter) -> None:
    """Count every request a TcpStore client sends to the TCPStore server (instance patch)."""
    call = store._call

    def counted(fn: Any, *args: Any) -> Any:
        result = call(fn, *args)
        counter.add(9 + sum(_size(a) for a in args), _size(result) if result is not None else 1)
        return result

    store._call = counted
    log = store._log
    server_wait = log._server_wait

    def counted_wait(c: Any, name: str, step_s: float) -> None:
        try:
            server_wait(c, name, step_s)
        finally:
            counter.add(17 + len(name), 1)

    log._server_wait = counted_wait


_watching = threading.local()  # the counter of the agent whose watch this thread reads


def _count_stream_reads() -> None:
    """Count the bytes of every watch message read (once per process)."""
    from flexrun.store.etcd_watch import Stream

    if getattr(Stream, "_counted", False):
        return
    read = Stream.next

    def counted_next(self: Any, read_s: float) -> Any:
        message = read(self, read_s)
        counter = getattr(_watching, "counter", None)
        if counter is not None and message is not None:
            counter.add_received(len(json.dumps(message)))
        return message

    Stream.next = counted_next  # type: ignore[method-assign]
    Stream._counted = True  # type: ignore[attr-defined]


def count_etcd(store: Any, counter: Counter) -> None:
    """Count every HTTP request an EtcdStore sends (bodies and answers, JSON as sent); a
    watch counts as a request when it opens a stream (a wait that reads on from the stream
    the last one left open sends nothing), its messages as bytes received."""
    _count_stream_reads()
    watches = store._watches
    watch = watches.watch

    def counted_watch(t: Any, request: Any, deadline: float, since: int, *rest: Any) -> Any:
        before = getattr(watches._local, "open", None)
        _watching.counter = counter
        try:
            return watch(t, request, deadline, since, *rest)
        finally:
            _watching.counter = None
            after = getattr(watches._local, "open", None)
            if after is not None and after is not before:
                counter.add(len("/watch") + len(json.dumps(request)) + 120, 100)

    watches.watch = counted_watch
    for t in store._transports:
        post = t.post

        def counted_post(path: str, payload: Any, timeout_s: float, *, auth: bool = True,
                         keep: bool = True, _post: Callable[..., Any] = post) -> Any:
            result = _post(path, payload, timeout_s, auth=auth, keep=keep)
            counter.add(len(path) + len(json.dumps(payload)) + 120, len(json.dumps(result)) + 100)
            return result

        t.post = counted_post


class CountingDistStore:
    """torch's c10d rendezvous backend's store, counted (it calls the methods by name)."""

    def __init__(self, inner: Any, counter: Counter) -> None:
        self._inner = inner
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)

        def counted(*args: Any, **kw: Any) -> Any:
            result = fn(*args, **kw)
            self._counter.add(9 + sum(_size(a) for a in args), _size(result))
            return result

        return counted


# -- one agent --------------------------------------------------------------------------------
class _NoThread:
    """Stands in for a handler's keep-alive thread: the process's scheduler beats instead."""

    def start(self) -> None:
        pass

    def join(self, timeout_s: float) -> None:
        pass


class KickCondition(threading.Condition):
    """A handler's change-watch condition that also wakes the process's steppers."""

    def __init__(self, kick: threading.Event) -> None:
        super().__init__()
        self._kick = kick

    def notify_all(self) -> None:
        super().notify_all()
        self._kick.set()


class Agent:
    """One flexrun agent: its own client, handler and change watch (a thread blocked in a
    store wait, as in a real agent); its loop is ticked by the process's steppers and its
    keep-alive written by the process's scheduler (the same writes at the same interval)."""

    def __init__(self, aid: int, cfg: dict[str, Any], report: Callable[..., None],
                 kick: threading.Event, seen: Seen | None = None) -> None:
        from flexrun.config import RendezvousSettings, StoreSettings
        from flexrun.events import EventLog
        from flexrun.rendezvous import NodeRecord, RendezvousHandler

        self.aid = aid
        self.node_id = f"n{aid:05d}"
        self.cfg = cfg
        self.report = report
        self.counter = Counter()
        self.dead = threading.Event()
        self.go = threading.Event()
        host, port = cfg["host"], cfg["port"]
        if cfg["backend"] == "tcp":
            from flexrun.store.tcp import TcpStore

            raw: Any = TcpStore(host, port, connect_timeout_s=120, op_timeout_s=120)
            count_tcp(raw, self.counter)
            name_ops(raw)
        else:
            from flexrun.store.etcd import EtcdStore

            raw = EtcdStore.from_settings(
                StoreSettings(
                    backend="etcd-v3",
                    endpoints=((host, port),),
                    connect_timeout_s=120,
                    conf={"request_timeout": str(cfg["request_timeout_s"])},
                )
            )
            count_etcd(raw, self.counter)
            name_ops(raw)
        store: Any = raw
        if cfg.get("secret"):
            from flexrun.store.signed import SignedStore

            store = SignedStore(raw, cfg["secret"].encode())
        self.store = store
        settings = RendezvousSettings(
            min_nodes=cfg["min_nodes"],
            max_nodes=cfg["max_nodes"],
            last_call_s=cfg["last_call_s"],
            heartbeat_interval_s=cfg["hb_interval_s"],
            heartbeat_timeout_s=cfg["hb_timeout_s"],
            join_timeout_s=cfg["round_timeout_s"] + 600,
        )
        self.h = RendezvousHandler(
            store,
            run_id=cfg["run_id"],
            me=NodeRecord(self.node_id, "127.0.0.1", 1),
            settings=settings,
            events=EventLog(None, run_id=cfg["run_id"], node=self.node_id),
        )
        self.h._keepalive = _NoThread()  # type: ignore[assignment]
        self.h._changes._cond = KickCondition(kick)
        self.joined = False
        self.running: int | None = None
        self.pending: Any = None  # a round whose master address is not known yet
        self.master_due = 0.0  # when to look for the pending round's address again
        self.next_tick = 0.0
        self.tries = 0
        self.seen = seen or Seen(report)
        self.was_watching = False

    def kill(self) -> None:
        """As a SIGKILL looks to the store: no more steps, no more keep-alives, no leave."""
        self.dead.set()
        self.h._stop.set()
        self.h._changes.close()

    def changed(self) -> bool:
        return bool(self.h._changes._changed)

    def tick(self, now: float) -> float:
        """One pass of an agent's loop (never blocks on the store); when to tick next."""
        from flexrun.errors import StoreUnavailable
        from flexrun.rendezvous import Exit, Run, Stop

        if self.dead.is_set():
            return now + 3600
        if not self.go.is_set():
            return now + 0.05
        try:
            if not self.joined:
                self.h.join()
                self.joined = True
                self.report("joined", self.aid, time.monotonic())
            changed = self.h.wait(0)  # the agent's wait, timed out (or woken) by now
            # A member waiting for its round's address looks for it first when woken, as
            # a real agent's master_for does (it reads the round again only if not found).
            waiting = self.pending is not None and (changed or now >= self.master_due)
            if waiting and self.look_for_master(now):
                return now + self.cfg["wait_s"]
            if self.pending is None or changed:
                action = self.h.step(self.running)
                self.seen.header(self.aid, self.h._header)
                if self.h.watching != self.was_watching:
                    self.was_watching = self.h.watching
                    self.report("watching", self.aid, self.h.watching, time.monotonic())
                if isinstance(action, Run) and action.round.number != self.running:
                    if self.pending is None or self.pending.number != action.round.number:
                        self.master_due = now  # a new round: look for its address at once
                    self.pending = action.round
                elif isinstance(action, Stop):
                    self.running = None
                elif isinstance(action, Exit):
                    self.report("error", self.aid, f"exit: {action.reason}")
                    self.dead.set()
                    return now + 3600
            if self.pending is not None and now >= self.master_due:
                self.look_for_master(now)
            self.tries = 0
            fast = self.h.watching or self.pending is not None
            return now + (self.cfg["wait_watcher_s"] if fast else self.cfg["wait_s"])
        except StoreUnavailable as exc:
            self.tries += 1
            self.report("retry", self.aid, str(exc)[:200])
            return now + min(2.0, 0.05 * 2 ** min(self.tries, 6))
        except Exception as exc:  # noqa: BLE001 (reported to the parent, never hidden)
            self.report("error", self.aid, f"{type(exc).__name__}: {exc}"[:300])
            self.dead.set()
            return now + 3600

    def look_for_master(self, now: float) -> bool:
        """As a real agent's ``master_for``: rank 0 publishes the address, the others look
        for it when their change watch (the round directory, where it is published)
        reports a change, and at least every keep-alive interval. Whether it was found."""
        rnd = self.pending
        self.master_due = now + self.cfg["hb_interval_s"]
        if rnd.group_rank(self.node_id) == 0:
            found = self.h.master_for(rnd, timeout_s=0) is not None
        else:
            found = self.h.published_master(rnd.number) is not None
        if found:
            self.pending, self.running = None, rnd.number
            self.report("run", self.aid, rnd.number, time.monotonic(), self.h.watching,
                        len(rnd.members), rnd.reason)
        return found

    def beat(self) -> None:
        if self.joined and not self.dead.is_set():
            self.h._beat()


class Seen:
    """The round headers this process's agents have seen: the first sight of each (number,
    state) is reported once per process, with its reason and size (the parent takes the
    earliest over processes: when the round was published)."""

    def __init__(self, report: Callable[..., None]) -> None:
        self.report = report
        self.lock = threading.Lock()
        self.keys: set[tuple[int, str]] = set()

    def header(self, aid: int, hdr: Any) -> None:
        if hdr is None:
            return
        key = (hdr.number, hdr.state)
        if key in self.keys:
            return
        with self.lock:
            if key in self.keys:
                return
            self.keys.add(key)
        self.report("header", aid, hdr.number, hdr.state, hdr.reason, len(hdr.members),
                    time.monotonic())


def stepper(agents: list[Agent], kick: threading.Event, stop: threading.Event) -> None:
    """Tick each agent when it is due or its change watch fired: one pass per wake, as a
    real agent's loop (``wait(timeout)`` returns once, on a change or at its timeout). An
    agent ticked early by its watch is due again from that tick only: its older heap entry
    is stale and skipped (kept, they piled up, ~6 an agent by the third round, and each
    agent's loop ran up to 6 times as often as a real one's)."""
    import heapq

    due = [0.0] * len(agents)
    heap = [(0.0, i) for i in range(len(agents))]
    heapq.heapify(heap)
    while not stop.is_set():
        now = time.monotonic()
        if kick.is_set():
            kick.clear()
            for i, a in enumerate(agents):
                if a.changed():
                    due[i] = a.tick(now)
                    heapq.heappush(heap, (due[i], i))
        while heap and heap[0][0] <= now:
            t, i = heapq.heappop(heap)
            if t != due[i]:
                continue
            due[i] = agents[i].tick(now)
            heapq.heappush(heap, (due[i], i))
        kick.wait(max(0.001, min(1.0, heap[0][0] - time.monotonic() if heap else 1.0)))


BEATERS_OF = 32  # agents per keep-alive scheduler thread


class BeatGaps:
    """The longest time between two keep-alives of one agent of this process (what a TTL
    must cover), and how many gaps passed the timeout, since the last snapshot (the
    process's keep-alive schedulers share one)."""

    def __init__(self, timeout_s: float) -> None:
        self.lock = threading.Lock()
        self.timeout_s = timeout_s
        self.last: dict[int, float] = {}
        self.max_gap = 0.0
        self.lapsed = 0
        self.failed = 0

    def beat(self, aid: int, now: float) -> None:
        with self.lock:
            prev = self.last.get(aid)
            self.last[aid] = now
            if prev is not None:
                gap = now - prev
                self.max_gap = max(self.max_gap, gap)
                self.lapsed += gap > self.timeout_s

    def fail(self) -> None:
        with self.lock:
            self.failed += 1

    def take(self) -> dict[str, float]:
        with self.lock:
            out = {"max_gap": self.max_gap, "lapsed": self.lapsed, "failed": self.failed}
            self.max_gap, self.lapsed, self.failed = 0.0, 0, 0
            return out


def thread_kind(name: str) -> str:
    """The harness's name for a kind of thread (``stepper-1`` -> ``stepper``)."""
    if name == HB_THREAD:
        return "keep-alive"
    if name.startswith("flexrun-rdzv-watch"):
        return "watch"
    if name == "MainThread":
        return "main"
    return name.rsplit("-", 1)[0] if name[-1:].isdigit() else name


class ThreadCpu:
    """This process's CPU time by kind of thread since the last :meth:`take` (Linux
    ``/proc/self/task``): where the harness's own time goes. Threads Python did not start
    (the store clients' native ones) are ``native``; those that exited, and the rounding
    of the process's total (clock ticks), ``exited``."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict[str, float] = {}
        for tid in os.listdir("/proc/self/task"):
            try:  # (schedstat: nanoseconds; stat's clock ticks would round each of
                # thousands of nearly idle threads down by up to 10 ms)
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9
            except OSError:
                continue  # (it exited meanwhile: counted below)
            kind = thread_kind(names[int(tid)]) if int(tid) in names else "native"
            out[kind] = out.get(kind, 0.0) + seconds
        t = os.times()
        out["exited"] = max(0.0, t.user + t.system - sum(out.values()))
        return out

    def take(self) -> dict[str, float]:
        now = self._now()
        # (a kind whose thread exited since shows less, and "exited" as much more)
        delta = {k: v - self.last.get(k, 0.0) for k, v in now.items()}
        self.last = now
        return delta


def keepalives(agents: list[Agent], interval_s: float, stop: threading.Event,
               gaps: BeatGaps | None = None) -> None:
    """Every agent's keep-alive once per interval, spread over it."""
    from flexrun.errors import StoreError

    while not stop.is_set():
        t0 = time.monotonic()
        for k, a in enumerate(agents):
            try:
                a.beat()
                if gaps is not None and a.joined and not a.dead.is_set():
                    gaps.beat(a.aid, time.monotonic())
            except StoreError:  # (retried at the next beat, as the handler's)
                if gaps is not None:
                    gaps.fail()
            delay = t0 + interval_s * (k + 1) / len(agents) - time.monotonic()
            if delay > 0 and stop.wait(delay):
                return


class TorchAgent:
    """One agent of torch's own DynamicRendezvousHandler over the c10d backend (a thread
    each: ``next_rendezvous`` blocks)."""

    def __init__(self, aid: int, cfg: dict[str, Any], report: Callable[..., None],
                 kick: threading.Event) -> None:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        self.aid = aid
        self.report = report
        self.counter = Counter()
        self.dead = threading.Event()
        self.go = threading.Event()
        t = timedelta(seconds=cfg["round_timeout_s"])
        self.store = dist.TCPStore(cfg["host"], cfg["port"], None, False, t)
        backend = C10dRendezvousBackend(CountingDistStore(self.store, self.counter), cfg["run_id"])
        self.h = DynamicRendezvousHandler.from_backend(
            run_id=cfg["run_id"],
            store=self.store,
            backend=backend,
            min_nodes=cfg["min_nodes"],
            max_nodes=cfg["max_nodes"],
            local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=t, last_call=timedelta(seconds=cfg["last_call_s"])),
        )
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"agent-{aid}")

    def kill(self) -> None:
        self.dead.set()

    def _main(self) -> None:
        self.go.wait()
        try:
            info = self.h.next_rendezvous()
            self.report("run", self.aid, 1, time.monotonic(), info.rank == 0, info.world_size)
        except Exception as exc:  # noqa: BLE001 (reported)
            self.report("error", self.aid, f"{type(exc).__name__}: {exc}"[:300])


# -- one process --------------------------------------------------------------------------------
STEPPERS = 2  # stepper threads per process


def child_main(idx: int, ids: list[int], cfg: dict[str, Any], commands: Any, results: Any) -> None:
    """K agents in this process; obeys ``commands`` until ``stop``."""
    threading.stack_size(512 * 1024)
    import logging

    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    def report(kind: str, *payload: Any) -> None:
        results.put((kind, idx, *payload))

    torch_mode = cfg["backend"] == "torch"
    kicks = [threading.Event() for _ in range(STEPPERS)]
    agents: dict[int, Any] = {}
    seen = Seen(report)
    try:
        for n, aid in enumerate(ids):
            if torch_mode:
                agents[aid] = TorchAgent(aid, cfg, report, kicks[n % STEPPERS])
            else:
                agents[aid] = Agent(aid, cfg, report, kicks[n % STEPPERS], seen)
            if torch_mode:
                agents[aid].thread.start()
    except Exception as exc:  # noqa: BLE001
        report("error", -1, f"setup: {type(exc).__name__}: {exc}"[:300])
    stop = threading.Event()
    gaps = BeatGaps(cfg["hb_timeout_s"])
    cpu = ThreadCpu()
    threads = []
    if not torch_mode:
        mine = [agents[a] for a in ids if a in agents]
        for k in range(STEPPERS):
            threads.append(threading.Thread(target=stepper, args=(mine[k::STEPPERS], kicks[k], stop),
                                            daemon=True, name=f"stepper-{k}"))
        # Several keep-alive schedulers a process, each for up to BEATERS_OF agents: one
        # for all 256 agents of a process at 4096 fell behind on a loaded machine (a beat's
        # round trips waiting for the GIL: gaps of 25 s against a 10 s timeout), so the
        # agents looked dead and the watcher role moved about: the harness's limit, not the
        # protocol's (a real agent has a keep-alive thread of its own).
        for k in range(0, len(mine), BEATERS_OF):
            threads.append(threading.Thread(target=keepalives,
                                            args=(mine[k:k + BEATERS_OF], cfg["hb_interval_s"],
                                                  stop, gaps),
                                            daemon=True, name=HB_THREAD))
        for t in threads:
            t.start()
    report("ready", len(agents))
    while True:
        cmd, *args = commands.get()
        if cmd == "start":
            for aid in args[0]:
                if aid in agents:
                    agents[aid].go.set()
            for kick in kicks:
                kick.set()
        elif cmd == "kill":
            if args[0] in agents:
                agents[args[0]].kill()
            report("killed", args[0], time.monotonic())
        elif cmd == "snapshot":
            report("snapshot", args[0], {aid: a.counter.snapshot() for aid, a in agents.items()})
            report("beats", args[0], {**gaps.take(), "cpu": cpu.take()})
        elif cmd == "stop":
            stop.set()
            for a in agents.values():
                a.dead.set()
                with contextlib.suppress(Exception):
                    a.h.shutdown() if torch_mode else a.h._stop.set()
            report("stopped")
            break
    sys.stdout.flush()
    os._exit(0)  # daemon threads blocked in a store call must not keep the process alive
