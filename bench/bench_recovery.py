"""Recovery and scale-up benchmark: flexrun vs torchrun, same workload, one run.

Two measurements (issue 2, last acceptance bullet; why torchrun runs with its shared
store off: docs/user/running.md):

1. kill -9 of one of 4 workers on one node (``--standalone --nproc-per-node 4
   --max-restarts 3``), columns interleaved trial by trial (the order rotates), the same
   rank killed in each:

   * flexrun restart mode with its warm pool (default ``--warm-spares`` = 4);
   * flexrun live mode with one warm spare (default): the spare replaces the dead worker;
   * flexrun live mode with ``--warm-spares 0``: the job shrinks to 3 workers;
   * torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (so that it works);
   * with ``--torchrun-default``, torchrun with default settings, counting failures and
     hangs (hard timeout ``--default-timeout`` per trial).
   * with ``--libs a,b`` (a library's script: the workload imports them at start), the
     columns are flexrun restart mode with and without ``--spare-preload a,b``, and torchrun.

   The kill comes once every rank has completed ``--warm-steps`` steps and, for flexrun,
   once every warm spare is ready (``<run-dir>/logs/spares/spare-*.ready``).
   Restart mode: recovery = from the kill to the first completed step of the restarted
   attempt (a progress line from a new worker pid); success = all 4 ranks of it train.
   Live mode: recovery = from the kill to the first step completed in a later membership
   epoch whose number is greater than the highest step logged before the kill (survivors
   keep their pids); success = the whole new world (4 ranks with a spare, 3 without)
   trains and the survivors kept their pids. "dup" = (pid, step) pairs logged twice (a
   live survivor recomputing a step), "redo" = step numbers <= the last step before the
   kill completed again after it (restart mode: back to the last checkpoint).
2. burst (``--burst-trials``, restart mode and torchrun, ``ddp_steps.py``, which loads its
   checkpoint at start like the scripts in torchrun's docs): kill -9 of one worker as in
   1., then, ``--burst-gap`` seconds (default 3) after the first step of the recovered
   attempt, a second kill -9 of the same rank's new process; warm spares are not waited
   for before the second kill. Recovery of each kill as in 1. (kill -> first completed
   step by a process that did not exist before that kill). Targets (issue 20): the second
   flexrun recovery within 1.5x its first, and the two together <= 0.3x torchrun's two.
3. scale-up: a second node joins a running 1-node job (``--nnodes 1:2`` and ``1:3``,
   ``--nproc-per-node 1``, c10d backend on 127.0.0.1). Time = from starting the second
   agent to the first completed step of its worker. flexrun agents use a standalone
   ``flexrun store``; torchrun's first agent hosts the store. Under ``1:2`` a live-mode
   row: a second ``flexrun run --mode live`` agent joins a live job.

4. HSDP (``--hsdp``, ``bench_hsdp.py``): a sharded model (2 replica groups x 2 FSDP2 shards,
   10.5M parameters, Adam): kill -9 of one shard worker, flexrun live mode
   (``--live-shards 2``) beside torchrun restarting the same model from its DCP checkpoint.

Workloads: ``tests/integration/scripts/ddp_steps.py`` (plain torchrun-style DDP on gloo,
checkpoint every 5 steps, one JSON progress line per completed step) for restart mode and
torchrun; ``tests/integration/scripts/live_steps.py`` (``flexrun.train.LiveLoop``, one
JSON line per step body) for live mode. Same ``--step-time``.

Every process started is killed at the end of each trial (its process group, then any
descendant seen during the trial, then any process whose command line names the trial's
directory or that is a warm spare of its run directory, e.g. orphaned
``flexrun.spares.spare`` processes); every wait is bounded; ports come from the OS.

    python bench/bench_recovery.py --trials 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hsdp  # noqa: E402  (the HSDP case, --hsdp)

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "integration" / "scripts" / "ddp_steps.py"
LIVE_WORKLOAD = ROOT / "tests" / "integration" / "scripts" / "live_steps.py"
SHARE_OFF = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

FLEXRUN = [sys.executable, "-m", "flexrun", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_progress(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(r, dict) and "step" in r:  # live_steps.py also writes a "done" line
            rows.append(r)
    return rows


def tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no output file)"
    return "\n".join(lines[-n:])


class Procs:
    """Processes started in one trial; ``kill_all`` leaves none of them (or their trees)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[subprocess.Popen] = []
        self.seen: dict[int, psutil.Process] = {}
        self.logs: dict[str, Path] = {}

    def start(
        self,
        name: str,
        cmd: list[str],
        env_extra: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> subprocess.Popen:
        """Start ``cmd``; ``cpus``: pin it (and so everything it starts) to those CPUs."""
        env = dict(os.environ)
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(env_extra or {})
        log = self.workdir / f"{name}.log"
        self.logs[name] = log
        with open(log, "wb") as fh:
            p = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        self.started.append(p)
        return p

    def sweep(self) -> None:
        """Remember every descendant alive now (workers run in sessions of their own)."""
        for p in self.started:
            try:
                kids = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for k in kids:
                self.seen.setdefault(k.pid, k)

    def workers(self, launcher: subprocess.Popen) -> list[psutil.Process]:
        try:
            me = psutil.Process(launcher.pid)
            kids = me.children(recursive=True)
            own = me.cmdline()
        except psutil.Error:
            return []
        out = []
        for k in kids:
            self.seen.setdefault(k.pid, k)
            try:
                cmdline = k.cmdline()
                cl = " ".join(cmdline)
                # (A child with the launcher's own command line is a fork that has not yet
                # exec'd, e.g. a warm spare being started: not a worker.)
                if cmdline != own and (WORKLOAD.name in cl or LIVE_WORKLOAD.name in cl):
                    out.append(k)
            except psutil.Error:
                continue
        return out

    def strays(self) -> list[psutil.Process]:
        """Our processes that belong to this trial but may have lost their parent: the
        command line names the trial directory, or a warm spare whose ready file is in it."""
        me = os.getuid()
        tag = str(self.workdir)
        out = []
        for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
            try:
                if proc.pid == os.getpid() or proc.info["uids"] is None:
                    continue
                if proc.info["uids"].real != me:
                    continue
                cl = " ".join(proc.info["cmdline"] or [])
                spare = "flexrun.spares.spare" in cl and proc.environ().get(
                    "FLEXRUN_SPARE_READY", ""
                ).startswith(tag)
                if tag in cl or spare:
                    out.append(proc)
            except psutil.Error:
                continue
        return out

    def kill_all(self) -> int:
        """SIGKILL every process group started, every descendant seen and every stray of
        this trial; return how many are still alive."""
        self.sweep()
        for proc in self.strays():
            self.seen.setdefault(proc.pid, proc)
        for p in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for _ in range(2):  # a second pass for anything started while we were killing
            for proc in list(self.seen.values()):
                try:
                    if proc.is_running():
                        proc.kill()
                except psutil.Error:
                    pass
            for p in self.started:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
            psutil.wait_procs(list(self.seen.values()), timeout=10)
            for proc in self.strays():
                self.seen.setdefault(proc.pid, proc)
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=5)
        return len([a for a in alive if _alive(a)])


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def poll(
    pred: Callable[[], object],
    deadline: float,
    procs: Procs,
    interval: float = 0.02,
    watch: subprocess.Popen | None = None,
) -> object:
    """Poll ``pred`` until it is truthy, the deadline passes, or ``watch`` exits."""
    n = 0
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if watch is not None and watch.poll() is not None:
            return pred() or None
        n += 1
        if n % 25 == 0:
            procs.sweep()
        time.sleep(interval)
    return None


def workload_args(
    d: Path, progress: Path, step_time: float, live: bool = False, libs: str = ""
) -> list[str]:
    if live:
        return [
            str(LIVE_WORKLOAD),
            "--steps",
            "1000000",
            "--step-time",
            str(step_time),
            "--progress",
            str(progress),
        ]
    return [
        str(WORKLOAD),
        "--steps",
        "1000000",
        "--step-time",
        str(step_time),
        "--ckpt",
        str(d / "ckpt.pt"),
        "--ckpt-every",
        "5",
        "--progress",
        str(progress),
    ] + (["--import-libs", libs] if libs else [])


# --------------------------------------------------------------------------- recovery


@dataclass
class Outcome:
    ok: bool
    seconds: float | None = None
    note: str = ""
    detail: str = ""
    spawn: float | None = None  # event -> the launcher's new worker process exists
    dup: int | None = None  # (pid, step) pairs logged twice
    dup_steps: int | None = None  # how many distinct steps those pairs are
    redo: int | None = None  # steps <= the last one before the kill completed again
    recomputed: int | None = None  # distinct steps in dup or redo: steps of work lost


@dataclass
class Launcher:
    name: str
    kind: str  # "restart" (flexrun), "live" (flexrun) or "torchrun"
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 120.0
    spares: int | None = None  # flexrun --warm-spares (None: flexrun's default)
    wait_spares: int | None = None  # ready spares to wait for before a kill (None: all)

    def pool(self) -> int:
        """Warm spares to wait for before the kill."""
        if self.kind == "torchrun":
            return 0
        if self.wait_spares is not None:
            return self.wait_spares
        if self.spares is not None:
            return self.spares
        return 4 if self.kind == "restart" else 1


def ready_spares(run_dir: Path) -> int:
    """Ready warm spares: restart mode keeps them in logs/spares, live mode in logs/live/spares."""
    return len(list((run_dir / "logs").rglob("spare-*.ready")))


def dup_pairs(rows: list[dict]) -> tuple[int, set[int]]:
    """(pid, step) pairs logged twice, and the distinct steps they are."""
    seen: dict[tuple[int, int], int] = {}
    for r in rows:
        key = (r["pid"], r["step"])
        seen[key] = seen.get(key, 0) + 1
    twice = [k for k, n in seen.items() if n > 1]
    return len(twice), {step for _, step in twice}


def recovery_trial(
    launcher: Launcher, victim_rank: int, base: Path, trial: int, a: argparse.Namespace
) -> Outcome:
    slug = "".join(c if c.isalnum() else "-" for c in launcher.name)
    d = base / f"recovery-{slug}-{trial}"
    d.mkdir(parents=True)
    progress = d / "progress.jsonl"
    run_dir = d / "run"
    procs = Procs(d)
    live = launcher.kind == "live"
    if launcher.kind == "torchrun":
        cmd = TORCHRUN + ["--standalone", "--nproc-per-node", "4", "--max-restarts", "3"]
    else:
        cmd = FLEXRUN + [
            "--standalone",
            "--nproc-per-node",
            "4",
            "--max-restarts",
            "3",
            "--mode",
            launcher.kind,
            "--run-dir",
            str(run_dir),
        ]
        if launcher.spares is not None:
            cmd += ["--warm-spares", str(launcher.spares)]
    cmd += workload_args(d, progress, a.step_time, live=live, libs=a.libs)
    t_start = time.monotonic()
    deadline = t_start + launcher.timeout
    agent = procs.start("agent", cmd, launcher.env)
    need = launcher.pool()
    try:
        # Steady state: all 4 ranks past --warm-steps, and every warm spare ready.
        def trained() -> bool:
            return {r["rank"] for r in read_progress(progress) if r["step"] >= a.warm_steps} == {
                0,
                1,
                2,
                3,
            }

        warm = poll(
            lambda: trained() and ready_spares(run_dir) >= need, deadline, procs, watch=agent
        )
        if not warm:
            why = "never trained before the kill"
            if trained():
                why = f"warm pool never ready ({ready_spares(run_dir)}/{need} spares)"
            return Outcome(False, note=why, detail=tail(procs.logs["agent"]))
        t_warm = time.monotonic() - t_start
        procs.sweep()
        workers = procs.workers(agent)
        rows = read_progress(progress)
        by_rank: dict[int, int] = {}
        for r in sorted(rows, key=lambda r: r["ts"]):
            by_rank[r["rank"]] = r["pid"]
        old_pids = {w.pid for w in workers} | {r["pid"] for r in rows}
        victim = by_rank[victim_rank]
        try:
            kids = {k.pid for k in psutil.Process(agent.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            kids = set()
        if victim not in kids:
            return Outcome(
                False, note=f"rank {victim_rank} pid {victim} not a child of the launcher"
            )
        survivors = {pid for rank, pid in by_rank.items() if rank != victim_rank}
        last_step = max(r["step"] for r in rows)
        old_epoch = max((r.get("epoch") or 0) for r in rows) if live else 0
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        world = 4 if (not live or need > 0) else 3

        def post_rows() -> list[dict]:
            """Progress of the recovered job: new pids (restart), a later epoch (live)."""
            rs = [r for r in read_progress(progress) if r["ts"] > t_kill]
            if live:
                return [r for r in rs if (r.get("epoch") or 0) > old_epoch]
            return [r for r in rs if r["pid"] not in old_pids]

        def new_rows() -> list[dict]:
            rs = post_rows()
            return [r for r in rs if r["step"] > last_step] if live else rs

        spawned: list[float] = []

        def first_rows() -> list[dict]:
            # Also note when the launcher has started a new worker process (its own share).
            if (
                not live
                and not spawned
                and any(w.pid not in old_pids for w in procs.workers(agent))
            ):
                spawned.append(time.time())
            return new_rows()

        first = poll(first_rows, deadline, procs, watch=agent)
        if not first:
            rc = agent.poll()
            note = (
                "hung (no step after the kill)"
                if rc is None
                else f"launcher exited {rc} without recovering"
            )
            return Outcome(False, note=note, detail=tail(procs.logs["agent"]))
        t_first = min(r["ts"] for r in first)
        # Success: the whole new world trains.
        full = poll(
            lambda: {r["rank"] for r in post_rows() if r["world"] == world} == set(range(world)),
            deadline,
            procs,
            watch=agent,
        )
        # A few more steps, so that any recomputation has been logged.
        target = max(r["step"] for r in first) + 3
        poll(
            lambda: any(r["step"] >= target for r in post_rows()),
            min(deadline, time.monotonic() + 15),
            procs,
            watch=agent,
        )
        rec = t_first - t_kill
        allrows = read_progress(progress)
        post = post_rows()
        dup, dup_set = dup_pairs(allrows)
        dup_steps = len(dup_set)
        redo_set = {r["step"] for r in post if r["step"] <= last_step}
        redo = len(redo_set)
        resumed = min(r["step"] for r in post) if post else min(r["step"] for r in first)
        spawn = f"new workers at +{spawned[0] - t_kill:.2f}s, " if spawned else ""
        note = (
            f"{spawn}kill at +{t_warm:.1f}s after step {last_step}, "
            f"resumed at step {resumed}, dup {dup} ({dup_steps} step), redo {redo}"
        )
        if live:
            late = {r["pid"] for r in post}
            epochs = sorted({r.get("epoch") for r in post if r.get("epoch") is not None})
            note += f", epoch {old_epoch}->{epochs[0] if epochs else '?'}"
            if not survivors <= late:
                note += f"; SURVIVORS RESTARTED ({len(survivors - late)} pid(s) gone)"
                full = False
        o = Outcome(
            bool(full),
            rec,
            note=note,
            spawn=spawned[0] - t_kill if spawned else None,
            dup=dup,
            dup_steps=dup_steps,
            redo=redo,
            recomputed=len(dup_set | redo_set),
        )
        if not full:
            o.note += f"; new world never reached {world} ranks"
            o.detail = tail(procs.logs["agent"])
        return o
    finally:
        left = procs.kill_all()
        if left:
            print(f"    WARNING: {left} process(es) survived SIGKILL cleanup", flush=True)


# --------------------------------------------------------------------------- burst


def burst_trial(
    launcher: Launcher, victim_rank: int, base: Path, trial: int, a: argparse.Namespace
) -> tuple[Outcome, Outcome]:
    """Two kills of one rank, the second ``a.burst_gap`` s after the first recovery."""
    slug = "".join(c if c.isalnum() else "-" for c in launcher.name)
    d = base / f"burst-{slug}-{trial}"
    d.mkdir(parents=True)
    progress = d / "progress.jsonl"
    run_dir = d / "run"
    procs = Procs(d)
    if launcher.kind == "torchrun":
        cmd = TORCHRUN + ["--standalone", "--nproc-per-node", "4", "--max-restarts", "3"]
    else:
        cmd = FLEXRUN + ["--standalone", "--nproc-per-node", "4", "--max-restarts", "3"]
        cmd += ["--mode", "restart", "--run-dir", str(run_dir)]
        if launcher.spares is not None:
            cmd += ["--warm-spares", str(launcher.spares)]
    cmd += workload_args(d, progress, a.step_time)
    t_start = time.monotonic()
    deadline = t_start + launcher.timeout
    agent = procs.start("agent", cmd, launcher.env)
    need = launcher.pool()
    failed = Outcome(False, note="not reached")
    try:

        def trained() -> bool:
            ranks = {r["rank"] for r in read_progress(progress) if r["step"] >= a.warm_steps}
            return ranks == {0, 1, 2, 3}

        if not poll(
            lambda: trained() and ready_spares(run_dir) >= need, deadline, procs, watch=agent
        ):
            return Outcome(False, note="never warm", detail=tail(procs.logs["agent"])), failed
        outs: list[Outcome] = []
        for kill in (1, 2):
            procs.sweep()
            rows = read_progress(progress)
            by_rank: dict[int, int] = {}
            for r in sorted(rows, key=lambda r: r["ts"]):
                by_rank[r["rank"]] = r["pid"]
            # (Not every descendant seen: a warm spare becomes a worker with its own pid.)
            old_pids = {w.pid for w in procs.workers(agent)} | {r["pid"] for r in rows}
            victim = by_rank[victim_rank]
            last_step = max(r["step"] for r in rows)
            spares = ready_spares(run_dir)
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)

            def post_rows(t: float = t_kill, old: set[int] = old_pids) -> list[dict]:
                return [r for r in read_progress(progress) if r["ts"] > t and r["pid"] not in old]

            first = poll(post_rows, deadline, procs, watch=agent)
            if not first:
                rc = agent.poll()
                note = "hung" if rc is None else f"launcher exited {rc}"
                outs.append(Outcome(False, note=note, detail=tail(procs.logs["agent"])))
                break
            t_first = min(r["ts"] for r in first)
            full = poll(
                lambda: {r["rank"] for r in post_rows() if r["world"] == 4} == {0, 1, 2, 3},
                deadline,
                procs,
                watch=agent,
            )
            post = post_rows()
            redo = len({r["step"] for r in post if r["step"] <= last_step})
            resumed = min(r["step"] for r in post)
            outs.append(
                Outcome(
                    bool(full),
                    t_first - t_kill,
                    note=f"kill {kill} after step {last_step} ({spares} warm spare(s) ready), "
                    f"resumed at step {resumed}, redo {redo}",
                    redo=redo,
                )
            )
            if not full:
                break
            # The second kill: --burst-gap s after the first recovered step.
            time.sleep(max(0.0, t_first + a.burst_gap - time.time()))
        while len(outs) < 2:
            outs.append(failed)
        return outs[0], outs[1]
    finally:
        left = procs.kill_all()
        if left:
            print(f"    WARNING: {left} process(es) survived SIGKILL cleanup", flush=True)


def bench_burst(a: argparse.Namespace, base: Path, lines: list[str]) -> int:
    name = "flexrun restart (warm pool)"
    if a.burst_spares is not None:
        name = f"flexrun restart (--warm-spares {a.burst_spares})"
    restart = Launcher(name, "restart", timeout=a.trial_timeout, spares=a.burst_spares)
    if a.burst_spares is not None:
        restart.wait_spares = a.burst_wait
    torch_ok = Launcher(
        "torchrun (SHARE_RDZV_TCP_STORE off)", "torchrun", dict(SHARE_OFF), timeout=a.trial_timeout
    )
    launchers = [restart, torch_ok]
    rng = random.Random(a.seed + 1)
    results: dict[str, list[tuple[Outcome, Outcome]]] = {ln.name: [] for ln in launchers}
    print(
        f"\n## burst: two kill -9 of one rank, the second {a.burst_gap:g}s after the first "
        f"recovery, {a.burst_trials} trials",
        flush=True,
    )
    for i in range(a.burst_trials):
        rank = rng.randrange(4)
        order = launchers[i % 2 :] + launchers[: i % 2]
        print(f"  trial {i + 1}: kill rank {rank} twice", flush=True)
        for ln in order:
            o1, o2 = burst_trial(ln, rank, base, i, a)
            results[ln.name].append((o1, o2))
            report_trial(ln.name + " #1", o1, show_detail=True)
            report_trial(ln.name + " #2", o2, show_detail=True)
    hdr = f"{'launcher':<38} {'ok':>6}  {'1st med':>7}  {'2nd med':>7}  {'sum med':>7}  {'2nd/1st':>7}"
    lines += [
        f"burst: kill -9 of one of 4 workers, then of the same rank {a.burst_gap:g}s after the first",
        "recovery (s; kill -> first completed step by a process newer than that kill; medians)",
        hdr,
        "-" * len(hdr),
    ]
    meds: dict[str, tuple[float, float, float] | None] = {}
    for ln in launchers:
        pairs = results[ln.name]
        ok = [(o1.seconds, o2.seconds) for o1, o2 in pairs if o1.ok and o2.ok]
        cnt = f"{len(ok)}/{len(pairs)}"
        if not ok:
            meds[ln.name] = None
            lines.append(f"{ln.name:<38} {cnt:>6}  {'-':>7}  {'-':>7}  {'-':>7}  {'-':>7}")
            continue
        m1 = statistics.median(x for x, _ in ok)  # type: ignore[type-var]
        m2 = statistics.median(y for _, y in ok)  # type: ignore[type-var]
        ms = statistics.median(x + y for x, y in ok)  # type: ignore[operator]
        meds[ln.name] = (m1, m2, ms)
        lines.append(f"{ln.name:<38} {cnt:>6}  {m1:7.2f}  {m2:7.2f}  {ms:7.2f}  {m2 / m1:7.2f}")
    f, t = meds[restart.name], meds[torch_ok.name]
    all_ok = all(o1.ok and o2.ok for pairs in results.values() for o1, o2 in pairs)
    if f is None or t is None:
        lines.append("burst verdict: n/a (no successful trials on one side): FAIL")
        return 1
    second = f[1] <= 1.5 * f[0]
    total = f[2] <= 0.3 * t[2]
    ok = second and total and all_ok
    lines.append(
        f"burst verdict: flexrun 2nd/1st {f[1] / f[0]:.2f}x (target <= 1.5x), "
        f"sum / torchrun's sum {f[2] / t[2]:.2f}x (target <= 0.3x), all trials ok: "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


# --------------------------------------------------------------------------- scale-up


def wait_port(port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def scaleup_trial(
    kind: str, max_nodes: int, base: Path, trial: int, a: argparse.Namespace
) -> Outcome:
    d = base / f"scaleup-{kind}-1to{max_nodes}-{trial}"
    d.mkdir(parents=True)
    procs = Procs(d)
    port = free_port()
    run_id = f"bench{trial}x{max_nodes}"
    deadline = time.monotonic() + a.scale_timeout
    prog = {n: d / f"progress-{n}.jsonl" for n in ("a", "b")}
    flex = kind in ("flexrun", "live", "live-node", "live-agent")
    warm_node = kind in ("live-node", "live-agent")
    live = kind.startswith("live")
    env = {} if flex else SHARE_OFF
    # --pin-nodes: node a (and the store, which torchrun's c10d backend hosts in node a's
    # agent) on CPU 0, node b on CPU 1, so the joiner does not share a core with node a.
    pin: dict[str, set[int] | None] = (
        {"a": {0}, "b": {1}} if a.pin_nodes else {"a": None, "b": None}
    )
    try:
        if flex:
            store = procs.start(
                "store",
                [
                    sys.executable,
                    "-m",
                    "flexrun",
                    "store",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                cpus=pin["a"],
            )
            if not wait_port(port, deadline):
                return Outcome(
                    False, note="flexrun store never listened", detail=tail(procs.logs["store"])
                )
            if store.poll() is not None:
                return Outcome(
                    False,
                    note=f"flexrun store exited {store.returncode}",
                    detail=tail(procs.logs["store"]),
                )

        def agent_cmd(node: str) -> list[str]:
            common = [
                "--nnodes",
                f"1:{max_nodes}",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                run_id,
            ]
            if flex:
                pre = (
                    FLEXRUN
                    + common
                    + ["--node-id", f"node-{node}", "--run-dir", str(d / f"run-{node}")]
                    + (["--mode", "live"] if live else [])
                    + (["--spares-dir", str(d / "spares-b")] if warm_node and node == "b" else [])
                )
            else:
                pre = TORCHRUN + common
            return pre + workload_args(d, prog[node], a.step_time, live=live)

        first_agent = procs.start("agent-a", agent_cmd("a"), env, cpus=pin["a"])
        if not poll(
            lambda: any(r["step"] >= a.warm_steps for r in read_progress(prog["a"])),
            deadline,
            procs,
            interval=0.05,
            watch=first_agent,
        ):
            return Outcome(
                False, note="first node never trained", detail=tail(procs.logs["agent-a"])
            )
        a_pids = {r["pid"] for r in read_progress(prog["a"])}
        if warm_node:
            # Node b was up before its agent: its `flexrun spares` has one worker interpreter
            # warm (live-agent: and one agent interpreter, which `flexrun run` hands itself to).
            spares = d / "spares-b"
            agents = 1 if kind == "live-agent" else 0
            procs.start(
                "spares-b",
                [*FLEXRUN[:-1], "spares", "--dir", str(spares), "--count", "1"]
                + ["--agents", str(agents)],
                cpus=pin["b"],
            )
            if not poll(
                lambda: len(list((spares / "spares").glob("*.ready"))) == 1 + agents,
                deadline,
                procs,
                interval=0.05,
            ):
                return Outcome(
                    False,
                    note="node b's spare never got ready",
                    detail=tail(procs.logs["spares-b"]),
                )
        t0 = time.time()
        joiner = procs.start("agent-b", agent_cmd("b"), env, cpus=pin["b"])
        spawned: list[float] = []
        affinity: set[str] = set()

        def joiner_rows() -> list[dict]:
            ws = procs.workers(joiner)
            if not spawned and ws:
                spawned.append(time.time())
            if a.pin_nodes:
                for agent, node in ((first_agent, "a"), (joiner, "b")):
                    for w in procs.workers(agent):
                        with contextlib.suppress(psutil.Error):
                            affinity.add(f"{node}:{sorted(w.cpu_affinity())}")
            return read_progress(prog["b"])

        rows = poll(joiner_rows, deadline, procs, watch=joiner)
        if not rows:
            rc = joiner.poll()
            note = "joiner never trained" if rc is None else f"joiner exited {rc} without training"
            return Outcome(
                False,
                note=note,
                detail="--- joiner ---\n"
                + tail(procs.logs["agent-b"])
                + "\n--- first node ---\n"
                + tail(procs.logs["agent-a"]),
            )
        first = min(rows, key=lambda r: r["ts"])
        secs = first["ts"] - t0
        # The first node must train in the same world (its restarted attempt).
        both = poll(
            lambda: any(r["world"] == 2 and r["ts"] > t0 for r in read_progress(prog["a"])),
            deadline,
            procs,
            watch=first_agent,
        )
        spawn = f"its worker started at +{spawned[0] - t0:.2f}s, " if spawned else ""
        note = f"{spawn}first step {first['step']} at world {first['world']}"
        if a.pin_nodes:
            note += f", worker cpus {' '.join(sorted(affinity)) or '?'}"
        if live:
            later = {r["pid"] for r in read_progress(prog["a"]) if r["ts"] > t0 and r["world"] == 2}
            if later and not later <= a_pids:
                note += "; FIRST NODE'S WORKER RESTARTED"
                both = False
            else:
                note += ", first node's worker kept its pid"
        if live:
            note += "\n      breakdown: " + live_join_breakdown(d, t0, first["ts"])
        if not both or first["world"] != 2:
            return Outcome(
                False, secs, note=note + "; not a 2-node world", detail=tail(procs.logs["agent-b"])
            )
        return Outcome(True, secs, note=note, spawn=spawned[0] - t0 if spawned else None)
    finally:
        left = procs.kill_all()
        if left:
            print(f"    WARNING: {left} process(es) survived SIGKILL cleanup", flush=True)


def live_join_breakdown(d: Path, t0: float, first_step_ts: float) -> str:
    """Where a live joiner's time goes, from the two nodes' event logs (seconds after its
    agent started): spare = its worker's interpreter finished importing torch; rdzv = its
    agent's round completed; assigned = the spare was given the script; in loop = the
    script reached ``LiveLoop`` (data, model, store connections done); epoch = an epoch
    including it was published; joined = it joined (agreement, gloo group, state
    broadcast done); step = its first step body finished."""

    def events(node: str) -> list[dict]:
        p = d / f"run-{node}" / "events.jsonl"
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    b, both = events("b"), events("a") + events("b")
    started = [e for e in b if e["event"] == "worker_started" and e["ts"] >= t0]
    if not started:
        return "no worker_started event"
    wid = started[0].get("worker_id")
    marks: list[tuple[str, float | None]] = [
        ("spare", started[0].get("spare_ready_ts")),
        ("rdzv", next((e["ts"] for e in b if e["event"] == "rendezvous_completed"), None)),
        ("assigned", started[0]["ts"]),
        ("in loop", next((e["ts"] for e in b if e["event"] == "live_worker_ready"), None)),
        (
            "epoch",
            min(
                (
                    e["ts"]
                    for e in both
                    if e["event"] == "live_epoch" and wid in e.get("members", [])
                ),
                default=None,
            ),
        ),
        ("joined", next((e["ts"] for e in b if e["event"] == "live_joined"), None)),
        ("step", first_step_ts),
    ]
    return ", ".join(f"{k} {v - t0:+.2f}" if v else f"{k} -" for k, v in marks)


# --------------------------------------------------------------------------- report


def summary(outs: list[Outcome]) -> tuple[str, float | None]:
    ok = [o.seconds for o in outs if o.ok and o.seconds is not None]
    cnt = f"{len(ok)}/{len(outs)}"
    if not ok:
        return f"{cnt:>6}  {'-':>7}  {'-':>7}  {'-':>7}  {'-':>9}", None
    med = statistics.median(ok)
    sp = [o.spawn for o in outs if o.ok and o.spawn is not None]
    sps = f"{statistics.median(sp):9.2f}" if sp else f"{'-':>9}"
    return f"{cnt:>6}  {med:7.2f}  {min(ok):7.2f}  {max(ok):7.2f}  {sps}", med


def counts(outs: list[Outcome], attr: str) -> str:
    """max and total of a per-trial count over the trials that got that far."""
    v = [getattr(o, attr) for o in outs if getattr(o, attr) is not None]
    return f"{max(v):>3} {sum(v):>4}" if v else f"{'-':>3} {'-':>4}"


def report_trial(label: str, o: Outcome, show_detail: bool, short: bool = False) -> None:
    s = f"{o.seconds:6.2f}s" if o.seconds is not None else "    -  "
    print(f"    {label:<35} {'ok  ' if o.ok else 'FAIL'} {s}  {o.note}", flush=True)
    if not o.ok and o.detail and show_detail:
        lines = o.detail.splitlines()
        if short:  # the expected failures of default torchrun: the gist only
            keys = ("Error", "error", "refused", "imeout", "failed")
            lines = [ln.strip()[:220] for ln in lines if any(k in ln for k in keys)][-4:]
        print("      | " + "\n      | ".join(lines), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trials", type=int, default=5, help="kill -9 trials per launcher (default 5)")
    ap.add_argument(
        "--scale-trials",
        type=int,
        default=2,
        help="scale-up trials per launcher and MAX (default 2)",
    )
    ap.add_argument(
        "--torchrun-default",
        action="store_true",
        help="also run torchrun with default settings (shared store), counting failures and hangs",
    )
    ap.add_argument(
        "--default-trials",
        type=int,
        default=3,
        help="trials of the default-settings torchrun column (first N of --trials)",
    )
    ap.add_argument(
        "--default-timeout",
        type=float,
        default=45.0,
        help="hard timeout per trial for the default-settings torchrun column (s)",
    )
    ap.add_argument(
        "--trial-timeout", type=float, default=120.0, help="bound on one kill -9 trial (s)"
    )
    ap.add_argument(
        "--scale-timeout", type=float, default=120.0, help="bound on one scale-up trial (s)"
    )
    ap.add_argument("--step-time", type=float, default=0.05, help="workload sleep per step (s)")
    ap.add_argument(
        "--warm-steps", type=int, default=7, help="steps every rank completes before the event"
    )
    ap.add_argument(
        "--burst-trials", type=int, default=0, help="burst trials per launcher (default 0: none)"
    )
    ap.add_argument(
        "--burst-gap",
        type=float,
        default=3.0,
        help="burst: seconds from the first recovered step to the second kill (default 3)",
    )
    ap.add_argument(
        "--burst-spares",
        type=int,
        default=None,
        help="burst: flexrun's --warm-spares (default: flexrun's own default)",
    )
    ap.add_argument(
        "--burst-wait",
        type=int,
        default=4,
        help="burst with --burst-spares: ready spares the first kill waits for (default 4: one "
        "restart's worth; the whole pool for a job that has run a while)",
    )
    ap.add_argument(
        "--libs",
        default="",
        help="kill -9 with a library's script: the restart-mode workload imports these modules "
        "at start (e.g. transformers,lightning); columns: flexrun restart with and without "
        "--spare-preload of them, torchrun",
    )
    ap.add_argument(
        "--live-fresh",
        action="store_true",
        help="kill -9 columns: live mode with its default groups (in place on torch >= 2.14) "
        "beside the same with FLEXRUN_LIVE_RECONFIGURE=0 (a fresh group per epoch), and "
        "torchrun; no restart-mode column",
    )
    bench_hsdp.add_args(ap)
    ap.add_argument("--skip-calibration", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--skip-scaleup", action="store_true")
    ap.add_argument(
        "--scale-kinds",
        default="flexrun,live,live-node,live-agent,torchrun",
        help="scale-up launchers to run, of flexrun (restart), live, live-node, live-agent (live "
        "with the joining node's `flexrun spares` started before its agent; live-agent: with "
        "--agents 1 too), torchrun (default all)",
    )
    ap.add_argument(
        "--scale-nnodes",
        default="2,3",
        help="scale-up MAX values to run, of 2 and 3 (default both)",
    )
    ap.add_argument(
        "--pin-nodes",
        action="store_true",
        help="scale-up: pin node a (and the store) to CPU 0 and node b to CPU 1, every launcher",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed for the killed ranks")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, run dirs)")
    a = ap.parse_args()
    # A SIGTERM (`timeout`) unwinds like ^C: every trial's finally kills what it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    base = Path(tempfile.mkdtemp(prefix="flexrun-bench-"))
    t_all = time.monotonic()
    print(
        f"flexrun bench: python {sys.version.split()[0]}, torch {_torch_version()}, "
        f"{os.cpu_count()} cpus, work dir {base}",
        flush=True,
    )
    print(
        f"workloads: {WORKLOAD.relative_to(ROOT)} --ckpt-every 5 (restart mode, torchrun), "
        f"{LIVE_WORKLOAD.relative_to(ROOT)} (live mode); --step-time {a.step_time}",
        flush=True,
    )
    rc = 0
    try:
        lines: list[str] = []
        if not a.skip_calibration:
            calibrate(lines)
        if not a.skip_recovery:
            rc |= bench_recovery(a, base, lines)
        if a.burst_trials > 0:
            rc |= bench_burst(a, base, lines)
        if not a.skip_scaleup:
            rc |= bench_scaleup(a, base, lines)
        if a.hsdp:
            rc |= bench_hsdp.bench_hsdp(a, base, lines, Procs, poll, read_progress)
        print("\n" + "=" * 96)
        print("\n".join(lines))
        print(f"\ntotal wall time {time.monotonic() - t_all:.0f}s")
    finally:
        if a.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return rc


def calibrate(lines: list[str]) -> None:
    """The floor under any restart-mode launcher: cold-starting Python + torch.distributed."""
    code = "import torch, torch.distributed, torch.nn.parallel"
    out = []
    for n in (1, 4):
        t = time.monotonic()
        ps = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
        for p in ps:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        out.append(f"{n} at once {time.monotonic() - t:.2f}s")
    line = f"calibration: cold `import torch.distributed` (floor for any worker restart): {', '.join(out)}"
    print(line, flush=True)
    lines.append(line)
    lines.append("")


def _torch_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("torch")
    except md.PackageNotFoundError:
        return "?"


def bench_recovery(a: argparse.Namespace, base: Path, lines: list[str]) -> int:
    restart = Launcher("flexrun restart (warm pool)", "restart", timeout=a.trial_timeout)
    live1 = Launcher("flexrun live (warm spare)", "live", timeout=a.trial_timeout)
    live0 = Launcher("flexrun live (--warm-spares 0)", "live", timeout=a.trial_timeout, spares=0)
    torch_ok = Launcher(
        "torchrun (SHARE_RDZV_TCP_STORE off)", "torchrun", dict(SHARE_OFF), timeout=a.trial_timeout
    )
    launchers = [restart, live1, live0, torch_ok]
    fresh: list[Launcher] = []
    if a.live_fresh:
        # torch >= 2.14: live mode re-forms its groups in place; the same columns with that
        # turned off (FLEXRUN_LIVE_RECONFIGURE=0) make a fresh group per epoch, as on older torch.
        from flexrun.train.live_reconf import unsupported_reason

        why = unsupported_reason(True)
        print(f"  live default groups: {'in place' if why is None else why}", flush=True)
        tag = ", in-place groups)" if why is None else ", default groups)"
        live1.name, live0.name = (ln.name[:-1] + tag for ln in (live1, live0))
        off = {"FLEXRUN_LIVE_RECONFIGURE": "0"}
        fresh = [
            Launcher(
                "flexrun live (warm spare, fresh groups)",
                "live",
                dict(off),
                timeout=a.trial_timeout,
            ),  # fmt: skip
            Launcher(
                "flexrun live (--warm-spares 0, fresh groups)",
                "live",
                dict(off),
                timeout=a.trial_timeout,
                spares=0,
            ),  # fmt: skip
        ]
        launchers = [live1, fresh[0], live0, fresh[1], torch_ok]
    preload = restart
    if a.libs:
        # A library's script: what its imports cost a restart, with and without preloading.
        preload = Launcher(
            "flexrun restart (warm pool, --spare-preload)",
            "restart",
            {"PET_SPARE_PRELOAD": a.libs},
            timeout=a.trial_timeout,
        )
        launchers = [restart, preload, torch_ok]
    tdef = None
    if a.torchrun_default:
        tdef = Launcher("torchrun (default settings)", "torchrun", timeout=a.default_timeout)
        launchers.append(tdef)
    rng = random.Random(a.seed)
    results: dict[str, list[Outcome]] = {ln.name: [] for ln in launchers}
    print(
        f"\n## kill -9 of one of 4 workers, --standalone --nproc-per-node 4 --max-restarts 3, "
        f"{a.trials} trials",
        flush=True,
    )
    for i in range(a.trials):
        rank = rng.randrange(4)
        k = i % len(launchers)
        order = launchers[k:] + launchers[:k]  # rotate, so no column always runs first
        print(f"  trial {i + 1}: kill rank {rank}", flush=True)
        for ln in order:
            if ln is tdef and i >= a.default_trials:
                continue
            o = recovery_trial(ln, rank, base, i, a)
            results[ln.name].append(o)
            report_trial(ln.name, o, show_detail=True, short=ln is tdef)
    hdr = (
        f"{'launcher':<38} {'ok':>6}  {'median':>7}  {'min':>7}  {'max':>7}  {'spawn med':>9}"
        f"  {'dup max/sum':>11}  {'dupstep max':>11}  {'redo max/sum':>12}  {'recomp max':>10}"
    )
    lines += [
        "kill -9 of 1 of 4 workers (s). recovery: restart mode / torchrun = kill -> first completed",
        "step of the restarted attempt; live = kill -> first step of a later epoch numbered above the",
        "last step logged before the kill. spawn = kill -> the launcher's first new worker process",
        "(not seen when a warm spare takes over). dup = (pid, step) pairs logged twice (max per trial /",
        "sum over trials); dupstep = how many distinct step numbers those pairs are (max per trial);",
        "redo = step numbers <= the last pre-kill step completed again after it (max / sum);",
        "recomp = distinct step numbers in dup or redo (steps of work lost; max per trial)",
        hdr,
        "-" * len(hdr),
    ]
    meds: dict[str, float | None] = {}
    for ln in launchers:
        outs = results[ln.name]
        row, med = summary(outs)
        meds[ln.name] = med
        extra = ""
        if ln is tdef:
            hung = sum(1 for o in outs if o.note.startswith("hung"))
            failed = sum(1 for o in outs if not o.ok) - hung
            extra = f"   ({failed} failed, {hung} hung > {a.default_timeout:g}s)"
        dup, redo = counts(outs, "dup"), counts(outs, "redo")
        ds = [o.dup_steps for o in outs if o.dup_steps is not None]
        dsm = str(max(ds)) if ds else "-"
        rc_ = [o.recomputed for o in outs if o.recomputed is not None]
        rcm = str(max(rc_)) if rc_ else "-"
        lines.append(f"{ln.name:<38} {row}  {dup:>11}  {dsm:>11}  {redo:>12}  {rcm:>10}{extra}")
    tm = meds[torch_ok.name]
    rc = 0

    def verdict(ln: Launcher, limit: float, max_steps: int | None = None) -> None:
        nonlocal rc
        m = meds[ln.name]
        outs = results[ln.name]
        if m is None or tm is None:
            lines.append(f"{ln.name}: ratio n/a (no successful trials on one side): FAIL")
            rc = 1
            return
        ok = all(o.ok for o in outs) and m / tm <= limit
        dups = [o.dup for o in outs if o.dup is not None]
        steps = [o.recomputed for o in outs if o.recomputed is not None]
        extra = ""
        if max_steps is not None:
            # Issue 5: "<= 1 step recomputed" (the step in flight). Judged on distinct step
            # numbers; every survivor redoing that one step is still one step (the pairs
            # are printed beside it: with a smaller world each survivor's share changes,
            # so no survivor can keep its half-finished step).
            worst = max(steps) if steps else None
            ok = ok and worst is not None and worst <= max_steps
            extra = (
                f", worst {worst} step(s) recomputed (target <= {max_steps};"
                f" as (pid, step) pairs: {max(dups) if dups else '-'})"
            )
        v = "PASS" if ok else "FAIL"
        rc |= 0 if ok else 1
        lines.append(
            f"ratio {ln.name} / torchrun (medians): {m / tm:.2f}x   "
            f"target <= {limit:.2f}x{extra}, all trials ok: {v}"
        )

    if not a.live_fresh:
        verdict(restart, 0.6)  # issue 2
    if a.libs:
        verdict(preload, 0.3)  # issue 36: a library's script recovers as a torch-only one
    else:
        verdict(live1, 0.2, max_steps=1)  # issue 5
        verdict(live0, 0.2, max_steps=1)  # issue 5
        for ln in fresh:
            verdict(ln, 0.2, max_steps=1)
    sf = [o.spawn for o in results.get(restart.name, []) if o.ok and o.spawn is not None]
    st = [o.spawn for o in results[torch_ok.name] if o.ok and o.spawn is not None]
    if sf and st:
        lines.append(
            f"launcher's own share (spawn medians) flexrun restart/torchrun: "
            f"{statistics.median(sf):.2f}s / {statistics.median(st):.2f}s = "
            f"{statistics.median(sf) / statistics.median(st):.2f}x"
        )
    return rc


def bench_scaleup(a: argparse.Namespace, base: Path, lines: list[str]) -> int:
    print(
        f"\n## scale-up: a 2nd node joins a running 1-node job (--nproc-per-node 1), "
        f"{a.scale_trials} trials",
        flush=True,
    )
    names = {
        "flexrun": "flexrun restart",
        "live": "flexrun live",
        "live-node": "flexrun live, node's spares warm",
        "live-agent": "flexrun live, spares + agent warm",
        "torchrun": "torchrun (SHARE_RDZV_TCP_STORE off)",
    }
    wanted = set(a.scale_kinds.split(","))
    maxes = {int(n) for n in a.scale_nnodes.split(",")}
    if a.pin_nodes:
        print(
            "    pinned: node a's agent, workers (and the flexrun store) on CPU 0, node b's on CPU 1",
            flush=True,
        )
    plan = {
        n: [k for k in kinds if k in wanted]
        for n, kinds in {
            2: ["flexrun", "live", "live-node", "live-agent", "torchrun"],
            3: ["flexrun", "torchrun"],
        }.items()
        if n in maxes
    }
    plan = {n: kinds for n, kinds in plan.items() if kinds}
    res: dict[tuple[int, str], list[Outcome]] = {}
    for max_nodes, kinds in plan.items():
        for i in range(a.scale_trials):
            k = i % len(kinds)
            for kind in kinds[k:] + kinds[:k]:
                o = scaleup_trial(kind, max_nodes, base, i, a)
                res.setdefault((max_nodes, kind), []).append(o)
                label = f"--nnodes 1:{max_nodes} {names[kind]}"
                report_trial(label[:35], o, show_detail=True)
    hdr = f"{'nnodes':<8} {'launcher':<37} {'ok':>6}  {'median':>7}  {'min':>7}  {'max':>7}  {'spawn med':>9}"
    lines += [
        "",
        "scale-up: 2nd agent started -> its first completed step (s); spawn = -> its worker process exists",
        hdr,
        "-" * len(hdr),
    ]
    worst = {"flexrun": 0.0, "live": 0.0, "live-node": 0.0, "live-agent": 0.0}
    allok = {"flexrun": True, "live": True, "live-node": True, "live-agent": True}
    for max_nodes, kinds in plan.items():
        for kind in kinds:
            outs = res[(max_nodes, kind)]
            row, _ = summary(outs)
            lines.append(f"1:{max_nodes:<6} {names[kind]:<37} {row}")
            if kind in worst:
                allok[kind] &= all(o.ok for o in outs)
                worst[kind] = max([worst[kind], *[o.seconds or 0.0 for o in outs if o.ok]])
    rc = 0
    for kind, limit, scope in (
        ("flexrun", 5.0, "for every MAX"),
        ("live", 2.0, "(1:2)"),
        ("live-node", 2.0, "(1:2)"),
        ("live-agent", 2.0, "(1:2)"),
    ):
        if kind not in wanted:
            continue
        ok = allok[kind] and worst[kind] <= limit
        rc |= 0 if ok else 1
        lines.append(
            f"{names[kind]} joiner's worst time {worst[kind]:.2f}s   "
            f"target <= {limit:g} s {scope}: {'PASS' if ok else 'FAIL'}"
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
