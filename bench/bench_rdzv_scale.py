"""Rendezvous at scale without training: N lightweight agents join one round.

Issue 4, last acceptance bullet. For each backend (the embedded tcp store, etcd v3) and
each N, N agents run flexrun's real rendezvous code (``RendezvousHandler``: ``join()``,
then ``step(running=None)`` / ``wait()`` until the action is ``Run``, then ``leave()``)
as threads spread over ``--procs`` processes. Each agent has its own store client
wrapped in a counting proxy. Reported per (backend, N):

* time from releasing every agent at once (all clients already connected) to the last
  agent holding a ``Run`` action for the completed round;
* store operations per node until its ``Run`` (the Store protocol: get, get_prefix, put,
  compare_and_set, delete, wait_for_change, revision), mean / max over agents;
* backend requests per node (tcp: calls into the C++ ``TCPStore`` client; etcd: HTTP
  requests to the JSON gateway, watches included): what a protocol op really costs;
* node records read per node (entries returned by ``get_prefix``) and records fetched
  per node (values the backend actually sent: a repeated ``get_prefix`` fetches only
  the keys written since the previous one);
* keep-alive traffic (the heartbeat thread) separately, per node;
* StoreUnavailable retries: an agent that gets one backs off and retries exactly as
  ``Agent._on_outage`` does (0.1 s doubling to 2 s, reset after a good pass), bounded by
  ``--round-timeout``; how many, by how many agents, and in which protocol op;
* CPU seconds of the store process and of the agent processes during the timed phase
  (which of the two a saturated machine spent its cores on);
* growth factors and exponents between successive N.

The tcp store server runs in its own process (``TcpStoreServer``), etcd as a real
single-member server (``flexrun.testing.etcd_server.EtcdCluster``) with its data in a
temporary directory; either gets ``nice -10`` (when allowed) so that on a small machine
the 2N agent threads do not starve the one process a real job would run elsewhere. Every process and server started here is stopped at the end of each
configuration; every wait is bounded (``--round-timeout``).

    python bench/bench_rdzv_scale.py                       # tcp and etcd, N = 64 256 1024
    python bench/bench_rdzv_scale.py --backends tcp --sizes 64 256
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import queue
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HB_THREAD = "flexrun-heartbeat"  # the handler's keep-alive thread name
OPS = ("get", "get_prefix", "put", "compare_and_set", "delete", "wait_for_change", "revision")


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Counter:
    """Per-agent counts, split between the agent's own thread and its keep-alive thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops = {"rdzv": 0, "hb": 0}
        self.backend = {"rdzv": 0, "hb": 0}
        self.records = 0
        self.fetched = 0
        self.wait_timeouts = 0
        self.retries = 0  # StoreUnavailable raised into the agent loop (then backed off)
        self.join_retries = 0
        self.retry_ops: dict[str, int] = {}  # the protocol op that raised it
        self.last_error = ""
        self.by_op: dict[str, int] = dict.fromkeys(OPS, 0)
        self.req_by_op: dict[str, int] = dict.fromkeys(OPS, 0)
        self.local = threading.local()  # the protocol op this thread is inside

    @staticmethod
    def role() -> str:
        return "hb" if threading.current_thread().name == HB_THREAD else "rdzv"

    def op(self, name: str) -> None:
        role = self.role()
        self.local.op = name
        with self.lock:
            self.ops[role] += 1
            if role == "rdzv":
                self.by_op[name] += 1

    def request(self, fetched: int = 0) -> None:
        role = self.role()
        with self.lock:
            self.backend[role] += 1
            if role == "rdzv":
                self.fetched += fetched
            op = getattr(self.local, "op", None)
            if role == "rdzv" and op is not None:
                self.req_by_op[op] += 1

    def retried(self, joined: bool, error: str) -> None:
        op = getattr(self.local, "op", None) or "?"
        with self.lock:
            if joined:
                self.retries += 1
            else:
                self.join_retries += 1
            self.retry_ops[op] = self.retry_ops.get(op, 0) + 1
            self.last_error = error[:200]

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "retries": self.retries,
                "join_retries": self.join_retries,
                "retry_ops": dict(self.retry_ops),
                "last_error": self.last_error,
                "ops": dict(self.ops),
                "backend": dict(self.backend),
                "records": self.records,
                "fetched": self.fetched,
                "wait_timeouts": self.wait_timeouts,
                "by_op": dict(self.by_op),
                "req_by_op": dict(self.req_by_op),
            }


class CountingStore:
    """The Store protocol, forwarded to ``inner`` and counted."""

    def __init__(self, inner: Any, counter: Counter) -> None:
        self.inner = inner
        self.c = counter

    def get(self, key: str) -> Any:
        self.c.op("get")
        return self.inner.get(key)

    def get_prefix(self, prefix: str) -> Any:
        self.c.op("get_prefix")
        out = self.inner.get_prefix(prefix)
        if Counter.role() == "rdzv":
            with self.c.lock:
                self.c.records += len(out)
        return out

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        self.c.op("put")
        return int(self.inner.put(key, value, ttl_s=ttl_s))

    def compare_and_set(self, key: str, value: bytes, *, expected_revision: int) -> Any:
        self.c.op("compare_and_set")
        return self.inner.compare_and_set(key, value, expected_revision=expected_revision)

    def delete(self, key: str) -> None:
        self.c.op("delete")
        self.inner.delete(key)

    def wait_for_change(self, prefix: str, since_revision: int, timeout_s: float) -> Any:
        self.c.op("wait_for_change")
        changed, rev = self.inner.wait_for_change(prefix, since_revision, timeout_s)
        if not changed and Counter.role() == "rdzv":
            with self.c.lock:
                self.c.wait_timeouts += 1
        return changed, rev

    def revision(self) -> int:
        self.c.op("revision")
        return int(self.inner.revision())

    def close(self) -> None:
        self.inner.close()


def count_backend(store: Any, counter: Counter, backend: str) -> None:
    """Count the requests a store client really sends (instance attributes; src untouched)."""
    if backend == "tcp":
        call = store._call  # every TCPStore client call except the blocking wait goes here

        def counted_call(fn: Any, *args: Any) -> Any:
            name = getattr(fn, "__name__", "")
            keys = args[0] if name == "multi_get" else [args[0]] if name == "get" else []
            counter.request(sum(1 for k in keys if not k.startswith("__flexrun/")))
            return call(fn, *args)

        store._call = counted_call
    else:
        post, watch = store._post, store._watch  # every HTTP request to the gateway

        def counted_post(*a: Any, **kw: Any) -> Any:
            result = post(*a, **kw)
            kvs = list(result.get("kvs", []))
            for r in result.get("responses") or []:
                kvs += r.get("response_range", {}).get("kvs", [])
            counter.request(len(kvs))
            return result

        def counted_watch(*a: Any, **kw: Any) -> Any:
            counter.request()
            return watch(*a, **kw)

        store._post, store._watch = counted_post, counted_watch


def outage_backoff_s(tries: int) -> float:
    """The agent's pause after its ``tries``-th consecutive StoreUnavailable
    (``Agent._on_outage``: 0.1, 0.2, 0.4, ... s, at most 2 s)."""
    return min(2.0, 0.05 * 2 ** min(tries, 6))


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far; nan if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SERVER_NICE = -10  # the store gets the CPU a dedicated store machine would have


def prioritise(pid: int) -> str:
    """Give the store server priority over the 2N agent threads sharing these cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, SERVER_NICE)
    except OSError as exc:
        return f"server priority unchanged ({exc.strerror})"
    return f"server nice {SERVER_NICE}"


def make_store(backend: str, host: str, port: int, request_timeout_s: float) -> Any:
    if backend == "tcp":
        from flexrun.store.tcp import TcpStore

        return TcpStore(host, port, connect_timeout_s=60.0, op_timeout_s=60.0)
    from flexrun.config import StoreSettings
    from flexrun.store.etcd import EtcdStore

    settings = StoreSettings(
        backend="etcd-v3",
        endpoints=((host, port),),
        connect_timeout_s=60.0,
        conf={"request_timeout": f"{request_timeout_s:g}"},
    )
    return EtcdStore.from_settings(settings)


# -- child process: K agents as threads ------------------------------------------------------
def child_main(
    idx: int,
    ids: list[int],
    cfg: dict[str, Any],
    ready_q: Any,
    start_ev: Any,
    finish_ev: Any,
) -> None:
    raise_nofile()
    import logging

    logging.basicConfig(level=logging.ERROR)
    from flexrun.config import RendezvousSettings
    from flexrun.errors import StoreUnavailable
    from flexrun.events import EventLog
    from flexrun.rendezvous import Exit, NodeRecord, RendezvousHandler, Run, Stop

    n = cfg["n"]
    settings = RendezvousSettings(
        min_nodes=n,
        max_nodes=n,
        last_call_s=cfg["last_call_s"],
        heartbeat_interval_s=cfg["hb_interval_s"],
        heartbeat_timeout_s=cfg["hb_timeout_s"],
        join_timeout_s=cfg["round_timeout_s"] + 60,
    )
    go = threading.Event()
    setup_done = threading.Semaphore(0)
    results: list[dict[str, Any]] = []
    res_lock = threading.Lock()
    done = threading.Semaphore(0)

    def agent(i: int) -> None:
        node_id = f"n{i:05d}"
        res: dict[str, Any] = {"node": node_id, "ok": False, "t_run": None, "err": ""}
        counter = Counter()
        h = None
        store = None
        try:
            try:
                store = make_store(
                    cfg["backend"], cfg["host"], cfg["port"], cfg["request_timeout_s"]
                )
                count_backend(store, counter, cfg["backend"])
                h = RendezvousHandler(
                    CountingStore(store, counter),
                    run_id=cfg["run_id"],
                    me=NodeRecord(node_id, "127.0.0.1", 1),
                    settings=settings,
                    events=EventLog(None, run_id=cfg["run_id"], node=node_id),
                )
            finally:
                setup_done.release()
            if not go.wait(cfg["setup_timeout_s"] + 120):
                raise TimeoutError("never released")
            deadline = time.monotonic() + cfg["round_timeout_s"]
            tries = 0  # consecutive failed passes, reset by a good one (as the agent does)
            joined = False
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    res["err"] = "timeout: no Run action within --round-timeout"
                    break
                try:
                    if not joined:
                        h.join()
                        joined = True
                    action = h.step(running=None)
                    if isinstance(action, Run):
                        res["t_run"] = time.monotonic()
                        res["ok"] = True
                        res["round"] = action.round.number
                        res["members"] = len(action.round.members)
                        res["reason"] = action.round.reason
                        res["rank"] = action.round.group_rank(node_id)
                        break
                    if isinstance(action, (Exit, Stop)):
                        res["err"] = f"{type(action).__name__}: {action}"
                        break
                    h.wait(min(deadline - time.monotonic(), cfg["wait_s"]))
                    tries = 0
                except StoreUnavailable as exc:
                    counter.retried(joined, str(exc))
                    tries += 1
                    time.sleep(min(outage_backoff_s(tries), max(0.0, deadline - time.monotonic())))
        except BaseException as exc:  # noqa: BLE001 (reported, never hidden)
            res["err"] = f"{type(exc).__name__}: {exc}"[:300]
        res.update(counter.snapshot())
        with res_lock:
            results.append(res)
        done.release()
        # Stay registered (keep-alive running) until every agent everywhere is done, so a
        # leave cannot disturb a peer that has not yet seen the round.
        finish_ev.wait(cfg["round_timeout_s"] + 120)
        if h is not None:
            with contextlib.suppress(Exception):
                h.leave()
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in ids]
    for t in threads:
        t.start()
    setup_deadline = time.monotonic() + cfg["setup_timeout_s"]
    for _ in ids:
        setup_done.acquire(timeout=max(0.01, setup_deadline - time.monotonic()))
    ready_q.put(("ready", idx, None))
    if start_ev.wait(cfg["setup_timeout_s"] + 60):
        go.set()
    else:
        go.set()  # main gave up; the agents exit via their own timeouts
    done_deadline = time.monotonic() + cfg["round_timeout_s"] + 60
    for _ in ids:
        done.acquire(timeout=max(0.01, done_deadline - time.monotonic()))
    with res_lock:
        ready_q.put(("results", idx, list(results)))
    finish_ev.wait(cfg["round_timeout_s"] + 120)
    for t in threads:
        t.join(timeout=15)
    sys.stdout.flush()
    os._exit(0)  # daemon threads stuck in a store call must not keep the process alive


# -- servers ------------------------------------------------------------------------------
@contextlib.contextmanager
def tcp_server() -> Any:
    code = (
        "import sys\n"
        "from flexrun.store.tcp import TcpStoreServer\n"
        "s = TcpStoreServer('127.0.0.1', 0)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        preexec_fn=raise_nofile,
    )
    try:
        out = proc.stdout
        assert out is not None
        port_q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: port_q.put(out.readline().decode()), daemon=True).start()
        try:
            line = port_q.get(timeout=120)
        except queue.Empty:
            raise RuntimeError("tcp store server did not start within 120 s") from None
        print(f"   tcp store server pid {proc.pid}: {prioritise(proc.pid)}", flush=True)
        yield ("127.0.0.1", int(line), proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def etcd_server() -> Any:
    from flexrun.testing.etcd_server import EtcdCluster

    with (
        tempfile.TemporaryDirectory(prefix="flexrun-rdzv-scale-") as tmp,
        EtcdCluster(Path(tmp), size=1) as cluster,
    ):
        proc = cluster.procs[0]
        assert proc is not None
        print(f"   etcd pid {proc.pid}: {prioritise(proc.pid)}", flush=True)
        yield (*cluster.endpoints[0], proc.pid)


# -- one configuration ----------------------------------------------------------------------
def run_config(backend: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    procs = max(1, min(args.procs, n))
    server = tcp_server() if backend == "tcp" else etcd_server()
    ctx = mp.get_context("fork")  # the parent holds no threads or servers of its own
    with server as (host, port, server_pid):
        cfg = {
            "backend": backend,
            "n": n,
            "host": host,
            "port": port,
            "run_id": f"scale-{backend}-{n}",
            "last_call_s": args.last_call,
            "hb_interval_s": args.heartbeat_interval,
            "hb_timeout_s": args.heartbeat_timeout,
            "round_timeout_s": args.round_timeout,
            "wait_s": args.wait,
            "setup_timeout_s": args.setup_timeout,
            "request_timeout_s": args.request_timeout,
        }
        ready_q = ctx.Queue()
        start_ev, finish_ev = ctx.Event(), ctx.Event()
        chunks = [list(range(n))[p::procs] for p in range(procs)]
        children = [
            ctx.Process(target=child_main, args=(p, chunks[p], cfg, ready_q, start_ev, finish_ev))
            for p in range(procs)
        ]
        results: list[dict[str, Any]] = []
        timed_s, cpu = float("nan"), [float("nan")] * (procs + 1)
        t_setup = time.monotonic()
        try:
            for c in children:
                c.start()
            ready = 0
            setup_deadline = time.monotonic() + args.setup_timeout
            while ready < procs:
                try:
                    kind, _, _ = ready_q.get(timeout=max(0.1, setup_deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(f"only {ready} of {procs} processes connected") from None
                ready += kind == "ready"
            setup_s = time.monotonic() - t_setup
            pids = [server_pid] + [c.pid for c in children if c.pid is not None]
            cpu0 = [cpu_s(p) for p in pids]
            t0 = time.monotonic()
            start_ev.set()
            got = 0
            deadline = time.monotonic() + args.round_timeout + 90
            while got < procs:
                try:
                    kind, _, batch = ready_q.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if kind == "results":
                    results.extend(batch)
                    got += 1
            timed_s = time.monotonic() - t0
            cpu = [cpu_s(p) - c for p, c in zip(pids, cpu0, strict=True)]
        finally:
            finish_ev.set()
            start_ev.set()
            for c in children:
                c.join(timeout=30)
            for c in children:
                if c.is_alive():
                    c.kill()
                    c.join(timeout=10)
    ok = [r for r in results if r["ok"]]
    errors = sorted({r["err"] for r in results if r["err"]})
    rounds = sorted({(r.get("round"), r.get("members"), r.get("reason")) for r in ok})
    ranks = sorted(r["rank"] for r in ok)

    def stat(values: list[float]) -> tuple[float, float]:
        return (statistics.fmean(values), max(values)) if values else (float("nan"), float("nan"))

    return {
        "backend": backend,
        "n": n,
        "procs": procs,
        "setup_s": setup_s,
        "completed": len(ok),
        "reported": len(results),
        "t_round": (max(r["t_run"] for r in ok) - t0) if len(ok) == n else None,
        "t_first": (min(r["t_run"] for r in ok) - t0) if ok else None,
        "ops": stat([r["ops"]["rdzv"] for r in ok]),
        "backend_req": stat([r["backend"]["rdzv"] for r in ok]),
        "records": stat([r["records"] for r in ok]),
        "fetched": stat([r["fetched"] for r in ok]),
        "wait_timeouts": sum(r["wait_timeouts"] for r in ok),
        "hb_ops": stat([r["ops"]["hb"] for r in ok]),
        "hb_req": stat([r["backend"]["hb"] for r in ok]),
        "by_op": {op: statistics.fmean(r["by_op"][op] for r in ok) if ok else 0.0 for op in OPS},
        "req_by_op": {
            op: statistics.fmean(r["req_by_op"][op] for r in ok) if ok else 0.0 for op in OPS
        },
        "rounds": rounds,
        "ranks_ok": ranks == list(range(n)),
        "errors": errors[:5],
        "retries": sum(r["retries"] for r in results),
        "join_retries": sum(r["join_retries"] for r in results),
        "retried_agents": sum(1 for r in results if r["retries"] or r["join_retries"]),
        "max_retries": max((r["retries"] + r["join_retries"] for r in results), default=0),
        "retry_ops": {
            op: sum(r["retry_ops"].get(op, 0) for r in results)
            for op in sorted({op for r in results for op in r["retry_ops"]})
        },
        "retry_errors": sorted({r["last_error"] for r in results if r["last_error"]})[:3],
        "timed_s": timed_s,
        "server_cpu_s": cpu[0],
        "agents_cpu_s": sum(cpu[1:]),
    }


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def growth(a: float | None, b: float | None) -> str:
    if a is None or b is None or a != a or b != b or a <= 0:
        return "-"
    return f"x{b / a:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["tcp", "etcd"], choices=["tcp", "etcd"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[64, 256, 1024])
    ap.add_argument(
        "--etcd-sizes",
        nargs="+",
        type=int,
        default=None,
        help="sizes for etcd if different from --sizes (e.g. 64 256 512)",
    )
    ap.add_argument("--procs", type=int, default=8, help="processes the agents are spread over")
    ap.add_argument("--last-call", type=float, default=1.0)
    ap.add_argument(
        "--heartbeat-interval",
        type=float,
        default=30.0,
        help="keep-alive interval (--rdzv-conf heartbeat_interval); the agent's default is 1 s, "
        "a job of 1000+ nodes should use tens of seconds (N/interval writes per second)",
    )
    ap.add_argument("--heartbeat-timeout", type=float, default=120.0)
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="the store client's per-request bound (--rdzv-conf request_timeout; the tcp client's "
        "op timeout is 60 s); a request that exceeds it raises StoreUnavailable and the agent "
        "backs off and retries",
    )
    ap.add_argument(
        "--wait",
        type=float,
        default=5.0,
        help="timeout of each h.wait() between steps (the agent uses 0.1-0.5 s; a long one "
        "shows whether agents are woken by the store's change notification)",
    )
    ap.add_argument(
        "--setup-timeout",
        type=float,
        default=420.0,
        help="per configuration: connecting every client (not timed) may take this long",
    )
    ap.add_argument(
        "--round-timeout", type=float, default=180.0, help="per configuration: give up after this"
    )
    args = ap.parse_args()
    # A wall-clock bound (`timeout`) sends SIGTERM: unwind so every server and agent
    # process started here is stopped by the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    raise_nofile()
    os.environ.setdefault(
        "TORCH_CPP_LOG_LEVEL", "ERROR"
    )  # before torch: c10d's per-socket warnings
    if "tcp" in args.backends:
        # Import torch once here so the forked agent processes inherit it (no threads yet).
        import torch.distributed  # noqa: F401

    import torch

    print(
        f"flexrun rdzv scale bench: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}, procs {args.procs}, "
        f"last_call {args.last_call:g}s, wait {args.wait:g}s, keep-alive every {args.heartbeat_interval:g}s "
        f"(timeout {args.heartbeat_timeout:g}s), request timeout {args.request_timeout:g}s, "
        f"RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        sizes = args.etcd_sizes if (backend == "etcd" and args.etcd_sizes) else args.sizes
        for n in sizes:
            t = time.monotonic()
            print(f"-- {backend} N={n} ...", flush=True)
            try:
                row = run_config(backend, n, args)
            except Exception as exc:  # noqa: BLE001 (one failed configuration is a result)
                print(f"   FAILED: {type(exc).__name__}: {exc}", flush=True)
                continue
            rows.append(row)
            print(
                f"   {row['completed']}/{n} agents in the round; time to round "
                f"{fmt(row['t_round'], '.2f')}s (first agent {fmt(row['t_first'], '.2f')}s); "
                f"clients connected in {row['setup_s']:.1f}s; config wall {time.monotonic() - t:.0f}s; "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            print(
                "   rendezvous ops/node by kind (mean): "
                + ", ".join(f"{k} {v:.1f}" for k, v in row["by_op"].items()),
                flush=True,
            )
            print(
                "   backend requests/node by protocol op (mean): "
                + ", ".join(f"{k} {v:.1f}" for k, v in row["req_by_op"].items())
                + f"; keep-alive thread {fmt(row['hb_req'][0])}",
                flush=True,
            )
            print(
                f"   h.wait() calls that timed out instead of being woken: {row['wait_timeouts']}",
                flush=True,
            )
            print(
                f"   rounds seen (number, members, reason) {row['rounds']}, ranks 0..N-1 each once: {row['ranks_ok']}",
                flush=True,
            )
            print(
                f"   StoreUnavailable retried (agent backoff 0.1..2 s): {row['retries']} in the loop + "
                f"{row['join_retries']} in join, by {row['retried_agents']} agents (max "
                f"{row['max_retries']} per agent); raised in {row['retry_ops'] or '-'}",
                flush=True,
            )
            for e in row["retry_errors"]:
                print(f"   retried error (example): {e}", flush=True)
            print(
                f"   CPU during the timed phase ({row['timed_s']:.1f}s wall x {os.cpu_count()} cores = "
                f"{(os.cpu_count() or 1) * row['timed_s']:.0f} cpu-s): store server {row['server_cpu_s']:.1f} cpu-s, "
                f"agent processes {row['agents_cpu_s']:.1f} cpu-s",
                flush=True,
            )
            for e in row["errors"]:
                print(f"   error: {e}", flush=True)

    print()
    head = (
        f"{'backend':7} {'N':>5} {'round s':>8} {'x':>5} {'ops/node mean/max':>18} {'x':>5} "
        f"{'requests/node mean/max':>23} {'x':>5} {'records read/node':>17} {'x':>6} "
        f"{'fetched/node':>12} {'x':>6} "
        f"{'keep-alive req/node':>19} {'retries':>7} {'store cpu-s':>11}"
    )
    print(head)
    print("-" * len(head))
    prev: dict[str, dict[str, Any]] = {}
    for r in rows:
        p = prev.get(r["backend"])
        done = f"{r['completed']}/{r['n']}"
        rt = fmt(r["t_round"], ".2f") if r["t_round"] is not None else f"({done})"
        print(
            f"{r['backend']:7} {r['n']:>5} {rt:>8} "
            f"{growth(p['t_round'], r['t_round']) if p else '':>5} "
            f"{fmt(r['ops'][0]) + ' / ' + fmt(r['ops'][1], '.0f'):>18} "
            f"{growth(p['ops'][0], r['ops'][0]) if p else '':>5} "
            f"{fmt(r['backend_req'][0]) + ' / ' + fmt(r['backend_req'][1], '.0f'):>23} "
            f"{growth(p['backend_req'][0], r['backend_req'][0]) if p else '':>5} "
            f"{fmt(r['records'][0], '.0f'):>17} "
            f"{growth(p['records'][0], r['records'][0]) if p else '':>6} "
            f"{fmt(r['fetched'][0], '.0f'):>12} "
            f"{growth(p['fetched'][0], r['fetched'][0]) if p else '':>6} "
            f"{fmt(r['hb_req'][0]):>19} {r['retries'] + r['join_retries']:>7} "
            f"{fmt(r['server_cpu_s']):>11}"
        )
        prev[r["backend"]] = r
    print(
        "x = growth factor from the previous N of the same backend (N grows x4 at 64->256->1024)."
    )
    print("growth exponent k (metric ~ N^k) between successive N of the same backend:")
    metrics = (
        ("round s", lambda r: r["t_round"]),
        ("requests/node", lambda r: r["backend_req"][0]),
        ("fetched/node", lambda r: r["fetched"][0]),
    )
    last: dict[str, dict[str, Any]] = {}
    for r in rows:
        p = last.get(r["backend"])
        last[r["backend"]] = r
        if p is None:
            continue
        parts = []
        for name, get in metrics:
            a, b = get(p), get(r)
            ok = a is not None and b is not None and a == a and b == b and a > 0 and b > 0
            k = f"{math.log(b / a) / math.log(r['n'] / p['n']):.2f}" if ok else "-"
            parts.append(f"{name} {k}")
        print(f"  {r['backend']:5} {p['n']:>5} -> {r['n']:<5} " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
