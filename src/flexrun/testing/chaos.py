"""Chaos: a seeded schedule of faults injected into a real job on this machine.

Owns three things: the schedule (pure: ``make_schedule(seed, ...)`` always returns the same
faults), the job harness (a standalone ``flexrun store`` plus N ``flexrun run`` agents as
N nodes, or one ``torchrun`` for comparison, all running
``flexrun.testing.chaos_workload``, every process tracked and stopped at the end), and the
injector, which applies each fault at its time and logs it to ``<root>/chaos.jsonl``. The
verdict belongs to ``flexrun.testing.invariants``; ``run_chaos`` wires the three together.

A fault that cannot apply right now (no second node to lose, no checkpoint to corrupt)
is logged as ``skipped`` with the reason; the schedule itself never changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from flexrun.errors import ConfigError
from flexrun.testing import invariants as inv

KINDS = (
    "kill_worker",
    "kill_agent",
    "stop_worker",
    "term_agent",
    "add_node",
    "restart_store",
    "slow_rank",
    "corrupt_checkpoint",
    "disk_full",
)
"""Every fault kind the injector knows."""

WORKLOAD = Path(__file__).with_name("chaos_workload.py")
# is_host=0: the agents are clients of the standalone store that restart_store restarts. An
# agent started during that outage would otherwise host the store on the endpoint's port
# itself (c10d semantics, as torchrun), the restarted store then failed EADDRINUSE for the
# injector's 20 s and the job's store died with that agent (seen re-running the long run).
RDZV_CONF = (
    "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=120,is_host=0"
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault: when (seconds after the job started), what, and a seed for
    picking its target among those present at that moment."""

    at_s: float
    kind: str
    pick: int
    hold_s: float


def make_schedule(
    seed: int,
    *,
    duration_s: float,
    interval_s: float,
    kinds: tuple[str, ...] = KINDS,
    start_s: float | None = None,
    jitter: float = 0.3,
) -> list[Fault]:
    """The faults of a run: about one every ``interval_s`` (+-``jitter``), kinds drawn uniformly.

    Raises:
        ConfigError: unknown kind or non-positive interval.
    """
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ConfigError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if interval_s <= 0:
        raise ConfigError(f"interval must be > 0, got {interval_s}")
    rng = random.Random(seed)
    t = interval_s if start_s is None else start_s
    out = []
    while t < duration_s:
        kind = kinds[rng.randrange(len(kinds))]
        out.append(
            Fault(round(t, 3), kind, rng.randrange(1 << 30), round(rng.uniform(1.0, 3.0), 3))
        )
        t += interval_s * (1 + rng.uniform(-jitter, jitter))
    return out


@dataclass(kw_only=True)
class JobSpec:
    """What to run. ``launcher`` is ``restart`` or ``live`` (flexrun) or ``torchrun``."""

    root: Path
    launcher: str = "restart"
    nodes: int = 2
    max_nodes: int = 3
    nproc: int = 1
    steps: int = 300
    samples: int = 256
    global_batch: int = 32
    ckpt_every: int = 10
    step_sleep: float = 0.05
    seed: int = 0
    hang_timeout_s: float = 0.0
    warm_spares: int | None = None
    extra_args: list[str] = field(default_factory=list)

    def workload_args(self, final: Path) -> list[str]:
        args = [
            "--steps", str(self.steps),
            "--samples", str(self.samples),
            "--global-batch", str(self.global_batch),
            "--seed", str(self.seed),
            "--ckpt-dir", str(self.root / "ckpt"),
            "--ckpt-every", str(self.ckpt_every),
            "--log-dir", str(self.root / "steps"),
            "--final", str(final),
            "--step-sleep", str(self.step_sleep),
            "--enospc-flag", str(self.root / "enospc"),
        ]
        if self.launcher == "live":
            args.append("--live")
        return args + list(self.extra_args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class ChaosJob:
    """A job under test: its processes, their pids (ever seen), and the fault actions."""

    def __init__(self, spec: JobSpec) -> None:
        spec.root = spec.root.resolve()  # processes run with the job root as their cwd
        self.spec = spec
        self.root = spec.root
        self.root.mkdir(parents=True, exist_ok=True)
        self.final = self.root / "final.pt"
        self.port = free_port()
        self.store: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.exits: dict[str, int] = {}
        self.expected_exit: dict[str, set[int]] = {}
        self.seen: set[int] = set()
        self.t_start = 0.0
        self._next_node = 0
        self._stopped: set[int] = set()
        self._leaving: set[str] = set()  # agents sent SIGTERM: alive until they finish leaving

    # -- processes ----------------------------------------------------------------------
    def _popen(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env or _env(),
                start_new_session=True,
                cwd=self.root,
            )
        self.seen.add(proc.pid)
        return proc

    def start(self) -> None:
        self.t_start = time.time()
        if self.spec.launcher == "torchrun":
            env = _env()
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(self.spec.nodes * self.spec.nproc),
                "--max-restarts", "1000", "--monitor-interval", "0.1",
                str(WORKLOAD), *self.spec.workload_args(self.final),
            ]
            self.agents["torchrun"] = self._popen("torchrun", argv, env)
            self.expected_exit["torchrun"] = {0}
            return
        self.start_store()
        for _ in range(self.spec.nodes):
            self.add_agent()

    def start_store(self) -> None:
        out = self.root / "store.out"
        before = out.stat().st_size if out.exists() else 0
        argv = [
            sys.executable,
            "-m",
            "flexrun",
            "store",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.store = self._popen("store", argv)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if b"listening" in out.read_bytes()[before:]:
                return
            if self.store.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(
            f"flexrun store did not start on port {self.port}: {out.read_text()[-500:]}"
        )

    def add_agent(self) -> str:
        name = f"n{self._next_node}"
        self._next_node += 1
        s = self.spec
        argv = [
            sys.executable, "-m", "flexrun", "run",
            "--nnodes", f"1:{s.max_nodes}", "--nproc-per-node", str(s.nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", "chaos", "--rdzv-conf", RDZV_CONF,
            "--max-restarts", "1000", "--monitor-interval", "0.1",
            "--node-id", name, "--run-dir", str(self.root / "runs" / name),
            "--mode", s.launcher, "--hang-timeout", str(s.hang_timeout_s),
            "--stop-grace", "5",
        ]
        if s.warm_spares is not None:
            argv += ["--warm-spares", str(s.warm_spares)]
        argv += [str(WORKLOAD), *s.workload_args(self.final)]
        self.agents[name] = self._popen(name, argv)
        self.expected_exit[name] = {0}
        return name

    def alive_agents(self) -> list[str]:
        return [n for n, p in sorted(self.agents.items()) if p.poll() is None]

    def poll(self) -> bool:
        """Record exits and descendants; True once every agent has exited."""
        for name, p in self.agents.items():
            code = p.poll()
            if code is None:
                for c in _descendants(p.pid):
                    self.seen.add(c.pid)
            elif name not in self.exits:
                self.exits[name] = code
        return bool(self.agents) and not self.alive_agents()

    def workers(self, recent_s: float = 3.0) -> list[tuple[int, int]]:
        """(rank, pid) of processes that logged a step in the last ``recent_s`` seconds."""
        now = time.time()
        last: dict[int, dict[str, Any]] = {}
        for r in inv.read_step_logs(self.root / "steps"):
            if "step" in r and "ids" in r and now - r["ts"] < recent_s:
                last[r["pid"]] = r
        return sorted(
            (r["rank"], pid) for pid, r in last.items() if pid not in self._stopped and _alive(pid)
        )

    def stop(self) -> None:
        """Stop everything still running (CONT first: a stopped process ignores TERM)."""
        self.poll()
        procs = [*self.agents.values(), *([self.store] if self.store else [])]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for pid in sorted(self.seen):
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)

    # -- faults -------------------------------------------------------------------------
    def inject(self, fault: Fault) -> dict[str, Any]:
        """Apply one fault now; returns what was done (target, outcome) for the log."""
        fn = getattr(self, f"_f_{fault.kind}")
        try:
            return dict(fn(fault))
        except (OSError, psutil.Error, RuntimeError) as exc:
            return {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}

    def _pick_worker(self, fault: Fault, wait_s: float = 30.0) -> tuple[int, int] | None:
        """A worker that is training now, waiting (bounded) through a restart in progress."""
        deadline = time.monotonic() + wait_s
        while True:
            ws = self.workers()
            if ws:
                return ws[fault.pick % len(ws)]
            if time.monotonic() > deadline or self.poll():
                return None
            time.sleep(0.2)

    def _f_kill_worker(self, fault: Fault) -> dict[str, Any]:
        w = self._pick_worker(fault)
        if w is None:
            return {"outcome": "skipped", "reason": "no worker training"}
        os.kill(w[1], signal.SIGKILL)
        return {"outcome": "done", "rank": w[0], "pid": w[1]}

    def _f_stop_worker(self, fault: Fault) -> dict[str, Any]:
        w = self._pick_worker(fault)
        if w is None:
            return {"outcome": "skipped", "reason": "no worker training"}
        self._stopped.add(w[1])
        try:
            os.kill(w[1], signal.SIGSTOP)
            time.sleep(fault.hold_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w[1], signal.SIGCONT)
            self._stopped.discard(w[1])
        return {"outcome": "done", "rank": w[0], "pid": w[1], "stopped_s": fault.hold_s}

    def _f_slow_rank(self, fault: Fault) -> dict[str, Any]:
        """Throttle one worker to about half speed for ``2 * hold_s`` (STOP/CONT duty cycle)."""
        w = self._pick_worker(fault)
        if w is None:
            return {"outcome": "skipped", "reason": "no worker training"}
        end = time.monotonic() + 2 * fault.hold_s
        self._stopped.add(w[1])
        try:
            while time.monotonic() < end and _alive(w[1]):
                os.kill(w[1], signal.SIGSTOP)
                time.sleep(0.05)
                os.kill(w[1], signal.SIGCONT)
                time.sleep(0.05)
        except ProcessLookupError:
            pass  # the worker died meanwhile (another fault's restart): nothing left to slow
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w[1], signal.SIGCONT)
            self._stopped.discard(w[1])
        return {"outcome": "done", "rank": w[0], "pid": w[1], "slow_s": 2 * fault.hold_s}

    def _pick_agent(self, fault: Fault) -> str | None:
        """An agent to take away, as long as another one stays. A preempted agent is still
        alive while it stops its workers, but it is leaving: it does not count as staying
        (a kill_agent right after a term_agent left no node at all)."""
        staying = [n for n in self.alive_agents() if n not in self._leaving]
        return staying[fault.pick % len(staying)] if len(staying) >= 2 else None

    def _f_kill_agent(self, fault: Fault) -> dict[str, Any]:
        if self.spec.launcher == "torchrun":
            return {"outcome": "skipped", "reason": "torchrun: one node"}
        name = self._pick_agent(fault)
        if name is None:
            return {"outcome": "skipped", "reason": "only one node left"}
        p = self.agents[name]
        self.poll()
        self.expected_exit[name] = {-signal.SIGKILL}
        os.killpg(p.pid, signal.SIGKILL)  # the agent and its workers: the node is gone
        p.wait(timeout=10)
        return {"outcome": "done", "node": name, "pid": p.pid}

    def _f_term_agent(self, fault: Fault) -> dict[str, Any]:
        if self.spec.launcher == "torchrun":
            return {"outcome": "skipped", "reason": "torchrun: one node"}
        name = self._pick_agent(fault)
        if name is None:
            return {"outcome": "skipped", "reason": "only one node left"}
        p = self.agents[name]
        self.expected_exit[name] = {0, 143, -signal.SIGTERM}
        self._leaving.add(name)
        p.send_signal(signal.SIGTERM)  # a preemption notice to the agent only
        return {"outcome": "done", "node": name, "pid": p.pid}

    def _f_add_node(self, fault: Fault) -> dict[str, Any]:
        if self.spec.launcher == "torchrun":
            return {"outcome": "skipped", "reason": "torchrun: one node"}
        if len(self.alive_agents()) >= self.spec.max_nodes:
            return {"outcome": "skipped", "reason": f"already {self.spec.max_nodes} nodes"}
        name = self.add_agent()
        return {"outcome": "done", "node": name, "pid": self.agents[name].pid}

    def _f_restart_store(self, fault: Fault) -> dict[str, Any]:
        if self.store is None:
            return {"outcome": "skipped", "reason": "no standalone store"}
        old = self.store
        old.terminate()
        old.wait(timeout=10)
        time.sleep(min(fault.hold_s, 1.0))
        deadline = time.monotonic() + 20
        while True:  # the port can stay busy for a moment after the old server closed
            try:
                self.start_store()
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        return {"outcome": "done", "old_pid": old.pid, "new_pid": self.store.pid}

    def _f_corrupt_checkpoint(self, fault: Fault) -> dict[str, Any]:
        ckpt = self.root / "ckpt"
        steps = sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit())
        if not steps:
            return {"outcome": "skipped", "reason": "no checkpoint yet"}
        step = steps[-1]
        files = sorted(p for p in (ckpt / f"step_{step}").glob("*.pt"))
        if not files:
            return {"outcome": "skipped", "reason": f"step_{step} has no data file"}
        target = files[fault.pick % len(files)]
        data = bytearray(target.read_bytes())
        pos = len(data) // 2
        data[pos : pos + 16] = bytes(b ^ 0xFF for b in data[pos : pos + 16])
        target.write_bytes(bytes(data))
        return {"outcome": "done", "step": step, "file": target.name}

    def _f_disk_full(self, fault: Fault) -> dict[str, Any]:
        flag = self.root / "enospc"
        flag.write_text("chaos: checkpoint writes fail with ENOSPC while this file exists\n")
        try:
            time.sleep(2 * fault.hold_s)
        finally:
            flag.unlink()
        return {"outcome": "done", "enospc_s": 2 * fault.hold_s}


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_faults(job: ChaosJob, faults: list[Fault], *, timeout_s: float) -> list[dict[str, Any]]:
    """Start the job, inject ``faults`` at their times, wait for the end (bounded).

    Every fault is appended to ``<root>/chaos.jsonl`` as it is applied. The job is always
    stopped on return.
    """
    log_path = job.root / "chaos.jsonl"
    records: list[dict[str, Any]] = []
    job.start()
    t_launch = time.monotonic()
    t0 = t_launch + timeout_s  # fault times count from the first step trained
    pending = list(faults)
    try:
        while time.monotonic() - t_launch < timeout_s:
            if t0 > time.monotonic() and any(
                "ids" in r for r in inv.read_step_logs(job.root / "steps")
            ):
                t0 = time.monotonic()
            if job.poll():
                break
            if pending and time.monotonic() - t0 >= pending[0].at_s:
                f = pending.pop(0)
                rec = {"ts": time.time(), **asdict(f)}
                rec.update(job.inject(f))
                rec["ts_end"] = time.time()
                records.append(rec)
                with open(log_path, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                continue
            time.sleep(0.1)
        else:
            records.append(
                {"ts": time.time(), "kind": "timeout", "outcome": f"job not done in {timeout_s:g}s"}
            )
    finally:
        job.stop()
        job.poll()
    return records


def run_reference(spec: JobSpec, out: Path, *, world: int = 1, timeout_s: float = 300) -> None:
    """The same workload without faults or checkpoints: the weights to match. At ``world``
    1 a plain process; else ``flexrun run --standalone`` with that many workers (a run
    that kept one world size must match it bitwise)."""
    launcher = [sys.executable]
    live = spec.launcher == "live"
    if world > 1 or live:
        launcher += [
            "-m", "flexrun", "run", "--standalone", "--nproc-per-node", str(world),
            "--mode", "live" if live else "restart", "--warm-spares", "0",
            "--run-dir", str(out.parent / "reference-run"),
        ]
    argv = [
        *launcher, str(WORKLOAD),
        "--steps", str(spec.steps), "--samples", str(spec.samples),
        "--global-batch", str(spec.global_batch), "--seed", str(spec.seed),
        "--log-dir", str(out.parent / "reference-steps"), "--final", str(out),
        *(["--live"] if live else []),
    ]
    done = subprocess.run(argv, env=_env(), timeout=timeout_s, capture_output=True, cwd=out.parent)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors="replace")[-1500:]
        raise subprocess.SubprocessError(f"exit {done.returncode}: {tail}")


def check(job: ChaosJob, records: list[dict[str, Any]]) -> inv.CheckResult:
    """Every invariant of ``flexrun.testing.invariants`` on a finished job."""
    s = job.spec
    result = inv.CheckResult()
    result.checked.append("job_completed")
    for r in records:
        if r.get("kind") == "timeout":
            result.add("job_completed", str(r["outcome"]))
    for name, code in sorted(job.exits.items()):
        if code not in job.expected_exit.get(name, {0}):
            result.add(
                "job_completed", f"{name} exited {code}, expected {sorted(job.expected_exit[name])}"
            )
    if not any(c == 0 for c in job.exits.values()):
        result.add("job_completed", "no launcher exited 0")
    if not job.final.exists():
        result.add("job_completed", "no final weights written")
    steps = inv.read_step_logs(job.root / "steps")
    inv.check_exactly_once(
        steps, steps=s.steps, samples=s.samples, global_batch=s.global_batch, result=result
    )
    inv.check_rounds(steps, result)
    worlds = {int(r["world"]) for r in steps if "ids" in r}
    reference = job.root / "reference.pt"
    if job.final.exists():
        constant = len(worlds) == 1
        world = next(iter(worlds)) if constant else 1
        try:
            run_reference(s, reference, world=world)
        except (subprocess.SubprocessError, OSError) as exc:
            result.add("final_weights", f"reference run failed: {exc}")
        else:
            inv.check_weights(job.final, reference, constant_world=constant, result=result)
    corrupted = {
        int(r["step"])
        for r in records
        if r.get("kind") == "corrupt_checkpoint" and r.get("outcome") == "done"
    }
    events = inv.read_events(job.root / "runs")
    if s.launcher != "live" or (job.root / "ckpt").exists():
        inv.check_checkpoints(
            str(job.root / "ckpt"),
            corrupted=corrupted,
            events=events,
            resumes=[r for r in steps if "resume" in r],
            result=result,
        )
    inv.check_processes(job.seen, result)
    result.stats.update(inv.attempt_stats(steps))
    result.stats["worlds"] = sorted(worlds)
    result.stats["faults"] = _fault_counts(records)
    return result


def _fault_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        key = f"{r.get('kind')}:{r.get('outcome')}"
        out[key] = out.get(key, 0) + 1
    return out


def run_chaos(spec: JobSpec, faults: list[Fault], *, timeout_s: float) -> inv.CheckResult:
    """Run the job under ``faults``, then check every invariant; the result also lands in
    ``<root>/check.json``."""
    job = ChaosJob(spec)
    t0 = time.time()
    records = run_faults(job, faults, timeout_s=timeout_s)
    t_end = time.time()
    wall = t_end - t0
    result = check(job, records)
    st = result.stats
    st["wall_s"] = round(wall, 3)
    st["ettr"] = round(st["productive_s"] / wall, 4) if wall > 0 else 0.0
    first, last = st.pop("first_step_t0", None), st.pop("last_step_ts", None)
    if first is not None and last is not None:
        # Where the wall time went: launch to the first step, the training span (first
        # step's start to last step's end: faults, recovery, recomputation, checkpoints),
        # and the last step to every process gone.
        st["startup_s"] = round(first - t0, 3)
        st["span_s"] = round(last - first, 3)
        st["teardown_s"] = round(t_end - last, 3)
        st["ettr_span"] = round(st["productive_s"] / (last - first), 4) if last > first else 0.0
    st["ettr_cycle"] = round(st["productive_cycle_s"] / wall, 4) if wall > 0 else 0.0
    done = [r["ts"] for r in records if r.get("outcome") == "done" and "at_s" in r]
    st["stall_s"] = inv.stalls_after(inv.read_step_logs(spec.root / "steps"), done)
    (spec.root / "check.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return result
