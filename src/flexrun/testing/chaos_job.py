"""Chaos, the job harness: a standalone ``flexrun store`` plus N ``flexrun run`` agents as N
nodes (or one ``torchrun`` for comparison), all running ``flexrun.testing.chaos_workload``,
and the injector that applies each fault to them.

Owns every process of a chaos run (tracked and stopped at the end) and the effect of each
fault kind; the schedule is :mod:`flexrun.testing.chaos_schedule`'s. A fault that cannot
apply right now (no second node to lose, no checkpoint to corrupt) is logged as
``skipped`` with the reason; the schedule itself never changes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from flexrun.errors import ConfigError
from flexrun.testing import invariants as inv
from flexrun.testing.chaos_schedule import Fault
from flexrun.testing.ports import free_port

WORKLOAD = Path(__file__).with_name("chaos_workload.py")
# is_host=0: the agents are clients of the standalone store that restart_store restarts. An
# agent started during that outage would otherwise host the store on the endpoint's port
# itself (c10d semantics, as torchrun), the restarted store then failed EADDRINUSE for the
# injector's 20 s and the job's store died with that agent (seen re-running the long run).
RDZV_CONF = (
    "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=120,is_host=0"
)


@dataclass(kw_only=True)
class JobSpec:
    """What to run. ``launcher`` is ``restart`` or ``live`` (flexrun) or ``torchrun``.
    ``shards`` > 1 (live only): an HSDP job, every ``shards`` workers of an agent one
    replica group of FSDP2 shards (``--live-shards``)."""

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
    shards: int = 1
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shards > 1 and (self.launcher != "live" or self.nproc % self.shards):
            raise ConfigError(
                f"shards {self.shards}: a sharded job is a live one whose workers per agent "
                f"({self.nproc}) are a multiple of the shards"
            )

    @property
    def shard_out(self) -> Path:
        """Where a sharded job's ranks write their final shards."""
        return self.root / "final-shards"

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
        ]  # fmt: skip
        if self.launcher == "live":
            args.append("--live-loop")
        if self.shards > 1:
            args += ["--shards", str(self.shards), "--shard-out", str(self.shard_out)]
        return args + list(self.extra_args)


def worker_env() -> dict[str, str]:
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
                env=env or worker_env(),
                start_new_session=True,
                cwd=self.root,
            )
        self.seen.add(proc.pid)
        return proc

    def start(self) -> None:
        self.t_start = time.time()
        if self.spec.launcher == "torchrun":
            env = worker_env()
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(self.spec.nodes * self.spec.nproc),
                "--max-restarts", "1000", "--monitor-interval", "0.1",
                str(WORKLOAD), *self.spec.workload_args(self.final),
            ]  # fmt: skip
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

    def agent_argv(self, name: str) -> list[str]:
        """The command line of node ``name``'s agent (``flexrun run``) and its workload."""
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
        ]  # fmt: skip
        if s.warm_spares is not None:
            argv += ["--warm-spares", str(s.warm_spares)]
        if s.shards > 1:
            argv += ["--live-shards", str(s.shards)]
        return [*argv, str(WORKLOAD), *s.workload_args(self.final)]

    def add_agent(self) -> str:
        name = f"n{self._next_node}"
        self._next_node += 1
        self.agents[name] = self._popen(name, self.agent_argv(name))
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
