"""Rendezvous at scale without training: N agents on one store, up to thousands.

Issue 16. For each backend and N, N agents run flexrun's real rendezvous code
(``RendezvousHandler``: join, step/wait until ``Run``, then ``master_for``) as threads
spread over ``--procs`` processes (bench/rdzv_scale_harness.py), each agent with its own
store client, counted. Scenarios:

* ``form``: every agent released at once (all clients connected before the clock starts);
  time until all N hold ``Run`` for one round and its master address (``--nnodes N:N``).
* ``join``: a job of N formed (``--nnodes 1:N+2``, untimed), one more agent joins: time
  from its join to all N+1 running the grown round.
* ``lose``: then one agent (never the watcher) is killed as SIGKILL would (no more steps
  or keep-alives, nothing deleted): time from the kill to the N survivors running the
  round without it.

Reported per phase: time, store requests and bytes (both directions, at the client: what
the store serves) in total and per node, split between the agents' own threads and their
keep-alive threads, the store server's CPU, and StoreUnavailable retries. ``--backends
torch`` runs torch's own ``DynamicRendezvousHandler`` (c10d backend on a TCPStore; form
only) on the same harness for the ratio.

This VM's resolver drops about 1 in 25 reverse lookups (5 s each), and torch's TCPStore
client looks up the server's address on every connect; so by default the bench re-runs
itself in a private mount namespace whose /etc/hosts names ``::ffff:127.0.0.1`` (no effect
outside the bench; ``--no-hosts-fix`` to measure without it).

    python bench/bench_rdzv_scale.py --backends tcp etcd --sizes 1024 4096
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rdzv_scale_harness import child_main  # noqa: E402


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 1 << 20)), hard))


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hosts_fix(argv: list[str]) -> None:
    """Re-exec under ``unshare -m`` with an /etc/hosts that maps ::ffff:127.0.0.1."""
    if os.environ.get("FLEXRUN_BENCH_HOSTS") == "1" or shutil.which("unshare") is None:
        return
    if os.geteuid() != 0:
        return
    hosts = Path(tempfile.gettempdir()) / f"flexrun-bench-hosts-{os.getpid()}"
    hosts.write_text(Path("/etc/hosts").read_text() + "\n::ffff:127.0.0.1 localhost\n")
    cmd = " ".join(f"'{a}'" for a in [sys.executable, *argv])
    os.environ["FLEXRUN_BENCH_HOSTS"] = "1"
    os.execvp("unshare", ["unshare", "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && exec {cmd}"])


# -- servers -----------------------------------------------------------------------------------
@contextlib.contextmanager
def tcp_server() -> Any:
    code = (
        "import sys, resource\n"
        "s, h = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (h, h))\n"
        "from flexrun.store.tcp import TcpStoreServer\n"
        "srv = TcpStoreServer('127.0.0.1', 0)\n"
        "print(srv.port, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, -10)
        yield ("127.0.0.1", int(line), proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def etcd_server() -> Any:
    from flexrun.testing.etcd_server import EtcdCluster

    with tempfile.TemporaryDirectory(prefix="flexrun-rdzv-scale-") as tmp, EtcdCluster(Path(tmp)) as c:
        proc = c.procs[0]
        assert proc is not None
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, -10)
        yield (*c.endpoints[0], proc.pid)


# -- one configuration ---------------------------------------------------------------------
class Run:
    """The children of one configuration and what they report."""

    def __init__(self, backend: str, n: int, extra: int, cfg: dict[str, Any], procs: int) -> None:
        self.n, self.total = n, n + extra
        ctx = mp.get_context("fork")
        self.results: Any = ctx.Queue()
        ids = list(range(self.total))
        self.owner = {aid: aid % procs for aid in ids}
        self.commands = [ctx.Queue() for _ in range(procs)]
        self.children = [
            ctx.Process(
                target=child_main,
                args=(p, [a for a in ids if self.owner[a] == p], cfg, self.commands[p], self.results),
            )
            for p in range(procs)
        ]
        self.runs: dict[int, tuple[int, float]] = {}  # agent -> (latest round, when)
        self.firsts: dict[int, float] = {}  # round -> when the first agent ran it
        self.joined: dict[int, float] = {}  # agent -> when its join returned
        self.watcher: int | None = None
        self.errors: list[str] = []
        self.retries = 0
        self.retry_example = ""
        self.snapshots: dict[str, dict[int, Any]] = {}
        self.ran: dict[int, int] = {}  # round -> agents that ran it
        self.ran_at: dict[int, list[float]] = {}  # round -> when each agent ran it
        self.reasons: dict[int, tuple[str, int]] = {}  # round -> (reason, members)
        self.headers: dict[tuple[int, str], tuple[str, int, float]] = {}  # first sight
        self.watch_changes: list[tuple[float, int, bool]] = []  # (when, agent, watching)
        self.beats: dict[str, dict[str, float]] = {}  # snapshot -> keep-alive gaps before it
        self._pending: list[Any] = []

    def start(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        for c in self.children:
            c.start()
        ready = 0
        while ready < len(self.children):
            msg = self._get(t0 + timeout_s)
            if msg is None:
                raise RuntimeError(f"only {ready} of {len(self.children)} processes set up")
            if msg[0] == "ready":
                ready += 1
        return time.monotonic() - t0

    def _get(self, deadline: float) -> Any:
        try:
            msg = self.results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return None
        return self._get_one(msg)

    def _get_one(self, msg: Any) -> Any:
        kind = msg[0]
        if kind == "run":
            aid, number, t, watching, members = msg[2:7]
            if number >= self.runs.get(aid, (0, 0.0))[0]:
                self.runs[aid] = (number, t)
            self.firsts[number] = min(t, self.firsts.get(number, t))
            self.ran[number] = self.ran.get(number, 0) + 1
            self.ran_at.setdefault(number, []).append(t)
            if len(msg) > 7:
                self.reasons.setdefault(number, (msg[7], members))
            if watching:
                self.watcher = aid
        elif kind == "header":
            aid, number, state, reason, size, t = msg[2:8]
            key = (number, state)
            if key not in self.headers or t < self.headers[key][2]:
                self.headers[key] = (reason, size, t)
        elif kind == "watching":
            self.watch_changes.append((msg[4], msg[2], msg[3]))
        elif kind == "beats":
            name, got = msg[2], msg[3]
            agg = self.beats.setdefault(name, {"max_gap": 0.0, "lapsed": 0, "failed": 0})
            agg["max_gap"] = max(agg["max_gap"], got["max_gap"])
            agg["lapsed"] += got["lapsed"]
            agg["failed"] += got["failed"]
            cpu = agg.setdefault("cpu", {})
            for kind, seconds in got.get("cpu", {}).items():
                cpu[kind] = cpu.get(kind, 0.0) + seconds
        elif kind == "joined":
            self.joined[msg[2]] = msg[3]
        elif kind == "error":
            self.errors.append(f"agent {msg[2]}: {msg[3]}")
        elif kind == "retry":
            self.retries += 1
            self.retry_example = msg[3]
        elif kind == "snapshot":
            self.snapshots.setdefault(msg[2], {}).update(msg[3])
        return msg

    def send(self, cmd: str, *args: Any, to: int | None = None) -> None:
        for p, q in enumerate(self.commands):
            if to is None or p == to:
                q.put((cmd, *args))

    def snapshot(self, name: str, timeout_s: float = 120) -> None:
        self.send("snapshot", name)
        deadline = time.monotonic() + timeout_s
        while len(self.snapshots.get(name, {})) < sum(1 for _ in self.owner) and time.monotonic() < deadline:
            self._get(deadline)
        with contextlib.suppress(queue.Empty):  # the last process's gaps follow its snapshot
            while True:
                msg = self.results.get(timeout=0.2)
                self._get_one(msg)
                if msg[0] == "beats" and msg[2] == name:
                    break

    def until_round(self, agents: set[int], above: int, deadline: float) -> tuple[int, float] | None:
        """Wait until every agent of ``agents`` runs one round numbered above ``above``."""
        while time.monotonic() < deadline:
            got = [self.runs.get(a) for a in agents]
            if all(g is not None and g[0] > above for g in got):
                numbers = {g[0] for g in got if g is not None}
                if len(numbers) == 1:
                    return numbers.pop(), max(g[1] for g in got if g is not None)
            if len(self.errors) > 20:
                return None
            self._get(min(deadline, time.monotonic() + 0.5))
        return None

    def stop(self) -> None:
        self.send("stop")
        for c in self.children:
            c.join(timeout=30)
        for c in self.children:
            if c.is_alive():
                c.kill()
                c.join(timeout=10)


def phase_cost(run: Run, before: str, after: str, agents: set[int]) -> dict[str, float]:
    """Requests and bytes between two snapshots, over ``agents``."""
    out: dict[str, float] = {}
    for field in ("req", "out", "inp"):
        for role in ("rdzv", "hb"):
            total = 0
            for a in agents:
                b = run.snapshots.get(before, {}).get(a)
                e = run.snapshots.get(after, {}).get(a)
                if e is not None:
                    total += e[field][role] - (b[field][role] if b is not None else 0)
            out[f"{field}_{role}"] = total
    ops: dict[str, list[float]] = {}
    for a in agents:
        b = run.snapshots.get(before, {}).get(a) or {}
        e = run.snapshots.get(after, {}).get(a)
        for op, (req, nbytes) in (e or {}).get("ops", {}).items():
            r0, b0 = b.get("ops", {}).get(op, (0, 0))
            c = ops.setdefault(op, [0, 0])
            c[0] += req - r0
            c[1] += nbytes - b0
    out["ops"] = ops  # type: ignore[assignment]
    return out


def measure(backend: str, n: int, scenarios: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    growth = any(s in scenarios for s in ("join", "lose"))
    procs = max(1, min(args.procs, n))
    server = etcd_server() if backend == "etcd" else tcp_server()
    with server as (host, port, server_pid):
        cfg = {
            "backend": backend,
            "host": host,
            "port": port,
            "run_id": f"scale-{backend}-{n}",
            "min_nodes": 1 if growth else n,
            "max_nodes": n + 2 if growth else n,
            "last_call_s": args.last_call,
            "hb_interval_s": args.heartbeat_interval,
            "hb_timeout_s": args.heartbeat_timeout,
            "round_timeout_s": args.round_timeout,
            "wait_s": args.wait,
            "wait_watcher_s": args.wait_watcher,
            "request_timeout_s": args.request_timeout,
            "secret": args.secret,
        }
        run = Run(backend, n, 1 if growth else 0, cfg, procs)
        try:
            setup_s = run.start(args.setup_timeout)
            first = set(range(n))
            run.snapshot("t0")
            cpu0 = cpu_s(server_pid)
            t0 = time.monotonic()
            run.send("start", sorted(first))
            got = run.until_round(first, 0, t0 + args.round_timeout)
            t_form = (got[1] - t0) if got is not None else None
            run.snapshot("formed")
            cpu_form = cpu_s(server_pid) - cpu0
            rows.append(_row(backend, n, "form" if not growth else "form (1:N+2)", t_form, run,
                             "t0", "formed", first, cpu_form, setup_s, args))
            timeline(run, t0, first, got[0] if got is not None else None, "formed")
            if got is None or not growth:
                return rows
            number = got[0]
            if "join" in scenarios:
                time.sleep(args.settle)
                run.snapshot("before-join")
                cpu0 = cpu_s(server_pid)
                joiner = n
                t1 = time.monotonic()
                run.send("start", [joiner], to=run.owner[joiner])
                everyone = first | {joiner}
                got = run.until_round(everyone, number, t1 + args.round_timeout)
                run.snapshot("joined")
                rows.append(_row(backend, n, "join 1", (got[1] - t1) if got else None, run,
                                 "before-join", "joined", everyone, cpu_s(server_pid) - cpu0, 0, args))
                timeline(run, t1, {joiner}, got[0] if got else None, "joined", since=number)
                if got is None:
                    return rows
                number, first = got[0], everyone
            if "lose" in scenarios:
                time.sleep(args.settle)
                victim = max(a for a in first if a != run.watcher)
                run.snapshot("before-loss")
                cpu0 = cpu_s(server_pid)
                run.send("kill", victim, to=run.owner[victim])
                t2 = time.monotonic()
                survivors = first - {victim}
                got = run.until_round(survivors, number, t2 + args.round_timeout)
                run.snapshot("lost")
                rows.append(_row(backend, n, "lose 1", (got[1] - t2) if got else None, run,
                                 "before-loss", "lost", survivors, cpu_s(server_pid) - cpu0, 0, args))
                timeline(run, t2, set(), got[0] if got else None, "lost", since=number)
        finally:
            run.stop()
    return rows


def _row(backend: str, n: int, phase: str, t: float | None, run: Run, a: str, b: str,
         agents: set[int], cpu: float, setup_s: float, args: argparse.Namespace) -> dict[str, Any]:
    cost = phase_cost(run, a, b, agents)
    k = len(agents)
    row = {
        "backend": backend, "n": n, "phase": phase, "t": t, "agents": k, "cpu": cpu,
        "setup_s": setup_s, "retries": run.retries, "errors": run.errors[:3],
        "req": cost["req_rdzv"], "req_hb": cost["req_hb"],
        "bytes": cost["out_rdzv"] + cost["inp_rdzv"], "bytes_hb": cost["out_hb"] + cost["inp_hb"],
        "load": os.getloadavg()[0],
    }
    print(
        f"{backend:5} N={n:<5} {phase:13} {fmt(t, '.2f'):>7} s | requests {row['req']:>9.0f} "
        f"({row['req'] / k:6.1f}/node) | bytes {row['bytes'] / 1e6:8.2f} MB "
        f"({row['bytes'] / k:8.0f}/node) | keep-alive {row['req_hb'] / k:5.1f} req/node "
        f"{row['bytes_hb'] / 1e6:6.2f} MB | store cpu {cpu:6.1f} s | retries {run.retries} | "
        f"load {row['load']:.1f}" + (f" | setup {setup_s:.0f} s" if setup_s else ""),
        flush=True,
    )
    ops = sorted(cost["ops"].items(), key=lambda kv: -kv[1][0])  # type: ignore[union-attr]
    if ops:
        print("      loop's requests/node (bytes/node) by Store method: " + ", ".join(
            f"{op} {req / k:.1f} ({nbytes / k:.0f})" + (f" [{req} in all]" if req < k / 10 else "")
            for op, (req, nbytes) in ops), flush=True)
    for e in run.errors[:3]:
        print(f"      error: {e}", flush=True)
    if run.retry_example:
        print(f"      retried (example): {run.retry_example}", flush=True)
    return row


def timeline(run: Run, t0: float, agents: set[int], number: int | None, snap: str = "",
             since: int = 0) -> None:
    """Where a phase's time went: agents joined (their join returned); every round header
    seen after ``since`` (its reason, size, when first seen by any agent, when first run and
    by how many): a replaced round says why; watcher changes; the keep-alive scheduler's
    longest gap between two beats of one agent (``snap``: the snapshot ending the phase)."""
    joins = sorted(run.joined[a] - t0 for a in agents if a in run.joined and run.joined[a] >= t0)
    parts = []
    if joins:
        parts.append(f"joined: half {joins[len(joins) // 2]:.2f} s, all {joins[-1]:.2f} s "
                     f"({len(joins)})")
    if number is not None and number in run.firsts:
        parts.append(f"round {number} first run {run.firsts[number] - t0:.2f} s")
    if parts:
        print("      timeline: " + "; ".join(parts), flush=True)
    for (num, state), (reason, size, t) in sorted(run.headers.items(), key=lambda kv: kv[1][2]):
        if num <= since:
            continue
        ran = ""
        if state == "running" and num in run.firsts:
            at = sorted(run.ran_at.get(num, []))
            ran = (f", first run {run.firsts[num] - t0:.2f} s by {run.ran.get(num, 0)} agents"
                   f" (half {at[len(at) // 2] - t0:.2f} s, 90 % {at[len(at) * 9 // 10] - t0:.2f} s,"
                   f" all {at[-1] - t0:.2f} s)")
        print(f"      round {num} {state:8} reason {reason or '-':14} {size:5} members, "
              f"first seen {t - t0:7.2f} s{ran}", flush=True)
    changes = [(t, a, w) for t, a, w in run.watch_changes if t >= t0]
    if changes:
        shown = ", ".join(f"{t - t0:.2f} s agent {a} {'claimed' if w else 'gave up'}"
                          for t, a, w in changes[:6])
        print(f"      watcher: {shown}" + (f" (+{len(changes) - 6})" if len(changes) > 6 else ""),
              flush=True)
    beats = run.beats.get(snap)
    if beats:
        print(f"      keep-alives: longest gap between two beats of one agent "
              f"{beats['max_gap']:.2f} s, gaps past the timeout {beats['lapsed']:.0f}, failed "
              f"beats {beats['failed']:.0f}", flush=True)
        cpu = sorted(beats.get("cpu", {}).items(), key=lambda kv: -kv[1])
        if cpu:
            print("      harness cpu by thread (all processes, this phase): " + ", ".join(
                f"{kind} {seconds:.1f} s" for kind, seconds in cpu), flush=True)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def exponents(rows: list[dict[str, Any]]) -> None:
    print("\ngrowth exponent k (metric ~ N^k) between successive N of one backend and phase:")
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["backend"], r["phase"]), []).append(r)
    for (backend, phase), rs in by.items():
        for p, r in zip(rs, rs[1:], strict=False):
            parts = []
            for name, get in (("time", lambda x: x["t"]), ("bytes", lambda x: x["bytes"]),
                              ("requests/node", lambda x: x["req"] / x["agents"]),
                              ("store cpu", lambda x: x["cpu"])):
                a, b = get(p), get(r)
                ok = a is not None and b is not None and a > 0 and b > 0
                parts.append(f"{name} {math.log(b / a) / math.log(r['n'] / p['n']):.2f}" if ok else f"{name} -")
            print(f"  {backend:5} {phase:13} {p['n']:>5} -> {r['n']:<5} " + ", ".join(parts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["tcp", "etcd"], choices=["tcp", "etcd", "torch"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--torch-sizes", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--scenarios", nargs="+", default=["form", "join", "lose"],
                    choices=["form", "join", "lose"])
    ap.add_argument("--procs", type=int, default=16, help="processes the agents are spread over")
    ap.add_argument("--last-call", type=float, default=1.0)
    ap.add_argument("--heartbeat-interval", type=float, default=None,
                    help="default: the agent's default for this N and backend "
                    "(flexrun.config.keepalive_defaults)")
    ap.add_argument("--heartbeat-timeout", type=float, default=None,
                    help="default: the agent's default (5 x a given interval)")
    ap.add_argument("--wait", type=float, default=0.5,
                    help="an agent's tick: h.wait() timeout between steps (the agent uses 0.1 s "
                    "with workers, 0.5 s without; a quiet tick costs a follower no store request "
                    "either way, but 4096 agents ticking 10 times a second cost 2 cores)")
    ap.add_argument("--wait-watcher", type=float, default=0.1,
                    help="the watcher's tick (it steps to see keep-alives expire)")
    ap.add_argument("--request-timeout", type=float, default=30.0)
    ap.add_argument("--setup-timeout", type=float, default=900.0)
    ap.add_argument("--round-timeout", type=float, default=180.0)
    ap.add_argument("--settle", type=float, default=3.0, help="pause between phases")
    ap.add_argument("--secret", default=None, help="sign every record with this job secret")
    ap.add_argument("--no-hosts-fix", action="store_true")
    args = ap.parse_args()
    if not args.no_hosts_fix:
        hosts_fix(sys.argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    raise_nofile()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch
    import torch.distributed  # noqa: F401  (imported once, inherited by the forked children)

    print(
        f"flexrun rdzv scale bench: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, procs {args.procs}, last_call "
        f"{args.last_call:g}s, waits {args.wait:g}s (watcher {args.wait_watcher:g}s), hosts fix "
        f"{os.environ.get('FLEXRUN_BENCH_HOSTS') == '1'}, secret {bool(args.secret)}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        sizes = args.torch_sizes if backend == "torch" else args.sizes
        scenarios = ["form"] if backend == "torch" else args.scenarios
        for n in sizes:
            from flexrun.config import keepalive_defaults

            default = keepalive_defaults(n, "etcd" if backend == "etcd" else "c10d")
            interval = args.heartbeat_interval or default[0]
            timeout = args.heartbeat_timeout or (default[1] if not args.heartbeat_interval
                                                 else 5 * interval)
            a = argparse.Namespace(**{**vars(args), "heartbeat_interval": interval,
                                      "heartbeat_timeout": timeout})
            print(f"-- {backend} N={n}: keep-alive every {interval:g}s (timeout {timeout:g}s)",
                  flush=True)
            try:
                for phase in (["form"] if "form" in scenarios else []) + (
                    [[s for s in scenarios if s != "form"]] if set(scenarios) - {"form"} else []
                ):
                    rows += measure(backend, n, [phase] if isinstance(phase, str) else phase, a)
            except Exception as exc:  # noqa: BLE001 (one failed configuration is a result)
                print(f"   FAILED: {type(exc).__name__}: {exc}", flush=True)
    exponents(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
