"""Recovery and scale-up benchmark: flexrun vs torchrun, same workload, one run.

Two measurements (issue 2, last acceptance bullet; anchors in ARCHITECTURE.md):

1. kill -9 of one of 4 workers on one node (``--standalone --nproc-per-node 4
   --max-restarts 3``). Recovery time = from the kill to the first completed training
   step of the restarted attempt (a progress line from a new worker pid). Success = all 4
   ranks of the restarted attempt complete a step within ``--trial-timeout``. Launchers
   are interleaved trial by trial (the order alternates) and killed the same rank.
   torchrun gets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that it works; with
   ``--torchrun-default`` a third column runs torchrun with default settings, counting
   failures and hangs (hard timeout ``--default-timeout`` per trial).
2. scale-up: a second node joins a running 1-node job (``--nnodes 1:2`` and ``1:3``,
   ``--nproc-per-node 1``, c10d backend on 127.0.0.1). Time = from starting the second
   agent to the first completed step of its worker. flexrun agents use a standalone
   ``flexrun store``; torchrun's first agent hosts the store.

Workload: ``tests/integration/scripts/ddp_steps.py`` (plain torchrun-style DDP on gloo,
checkpoint every ``--ckpt-every`` steps, one JSON progress line per completed step).

Every process started is killed at the end of each trial (its process group, then any
descendant seen during the trial); every wait is bounded; ports come from the OS.

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

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "integration" / "scripts" / "ddp_steps.py"
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
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
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
        self, name: str, cmd: list[str], env_extra: dict[str, str] | None = None
    ) -> subprocess.Popen:
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
            kids = psutil.Process(launcher.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for k in kids:
            self.seen.setdefault(k.pid, k)
            try:
                if WORKLOAD.name in " ".join(k.cmdline()):
                    out.append(k)
            except psutil.Error:
                continue
        return out

    def kill_all(self) -> int:
        """SIGKILL every process group started and every descendant seen; return leftovers."""
        self.sweep()
        for p in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for proc in list(self.seen.values()):
            try:
                if proc.is_running():
                    proc.kill()
            except psutil.Error:
                pass
        for p in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=10)
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


def workload_args(d: Path, progress: Path, step_time: float) -> list[str]:
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
    ]


# --------------------------------------------------------------------------- recovery


@dataclass
class Outcome:
    ok: bool
    seconds: float | None = None
    note: str = ""
    detail: str = ""
    spawn: float | None = None  # event -> the launcher's new worker process exists


@dataclass
class Launcher:
    name: str
    kind: str  # "flexrun" or "torchrun"
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 120.0


def recovery_trial(
    launcher: Launcher, victim_rank: int, base: Path, trial: int, a: argparse.Namespace
) -> Outcome:
    slug = "".join(c if c.isalnum() else "-" for c in launcher.name)
    d = base / f"recovery-{slug}-{trial}"
    d.mkdir(parents=True)
    progress = d / "progress.jsonl"
    procs = Procs(d)
    if launcher.kind == "flexrun":
        cmd = FLEXRUN + [
            "--standalone",
            "--nproc-per-node",
            "4",
            "--max-restarts",
            "3",
            "--run-dir",
            str(d / "run"),
        ]
    else:
        cmd = TORCHRUN + ["--standalone", "--nproc-per-node", "4", "--max-restarts", "3"]
    cmd += workload_args(d, progress, a.step_time)
    t_start = time.monotonic()
    deadline = t_start + launcher.timeout
    agent = procs.start("agent", cmd, launcher.env)
    try:
        # Steady state: all 4 ranks past the first checkpoint.
        warm = poll(
            lambda: (
                {r["rank"] for r in read_progress(progress) if r["step"] >= a.warm_steps}
                == {0, 1, 2, 3}
            ),
            deadline,
            procs,
            watch=agent,
        )
        if not warm:
            return Outcome(
                False, note="never trained before the kill", detail=tail(procs.logs["agent"])
            )
        workers = procs.workers(agent)
        rows = read_progress(progress)
        by_rank = {r["rank"]: r["pid"] for r in rows}
        old_pids = {w.pid for w in workers} | {r["pid"] for r in rows}
        victim = by_rank[victim_rank]
        if victim not in {w.pid for w in workers}:
            return Outcome(
                False, note=f"rank {victim_rank} pid {victim} not a child of the launcher"
            )
        last_step = max(r["step"] for r in rows)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def new_rows() -> list[dict]:
            return [
                r for r in read_progress(progress) if r["pid"] not in old_pids and r["ts"] > t_kill
            ]

        spawned: list[float] = []

        def first_rows() -> list[dict]:
            # Also note when the launcher has started a new worker process (its own share).
            if not spawned and any(w.pid not in old_pids for w in procs.workers(agent)):
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
        # Success: the whole restarted world (4 ranks) trains.
        full = poll(
            lambda: {r["rank"] for r in new_rows() if r["world"] == 4} == {0, 1, 2, 3},
            deadline,
            procs,
            watch=agent,
        )
        rec = t_first - t_kill
        resumed = min(r["step"] for r in first)
        spawn = f"new workers at +{spawned[0] - t_kill:.2f}s, " if spawned else ""
        note = f"{spawn}killed rank {victim_rank} after step {last_step}, resumed at step {resumed}"
        if not full:
            return Outcome(
                False,
                rec,
                note=note + "; restarted world never reached 4 ranks",
                detail=tail(procs.logs["agent"]),
            )
        return Outcome(True, rec, note=note, spawn=spawned[0] - t_kill if spawned else None)
    finally:
        left = procs.kill_all()
        if left:
            print(f"    WARNING: {left} process(es) survived SIGKILL cleanup", flush=True)


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
    env = {} if kind == "flexrun" else SHARE_OFF
    try:
        if kind == "flexrun":
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
            if kind == "flexrun":
                pre = (
                    FLEXRUN
                    + common
                    + ["--node-id", f"node-{node}", "--run-dir", str(d / f"run-{node}")]
                )
            else:
                pre = TORCHRUN + common
            return pre + workload_args(d, prog[node], a.step_time)

        first_agent = procs.start("agent-a", agent_cmd("a"), env)
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
        t0 = time.time()
        joiner = procs.start("agent-b", agent_cmd("b"), env)
        spawned: list[float] = []

        def joiner_rows() -> list[dict]:
            if not spawned and procs.workers(joiner):
                spawned.append(time.time())
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
        if not both or first["world"] != 2:
            return Outcome(
                False, secs, note=note + "; not a 2-node world", detail=tail(procs.logs["agent-b"])
            )
        return Outcome(True, secs, note=note, spawn=spawned[0] - t0 if spawned else None)
    finally:
        left = procs.kill_all()
        if left:
            print(f"    WARNING: {left} process(es) survived SIGKILL cleanup", flush=True)


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
    ap.add_argument("--skip-calibration", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--skip-scaleup", action="store_true")
    ap.add_argument("--seed", type=int, default=0, help="seed for the killed ranks")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, run dirs)")
    a = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="flexrun-bench-"))
    t_all = time.monotonic()
    print(
        f"flexrun bench: python {sys.version.split()[0]}, torch {_torch_version()}, "
        f"{os.cpu_count()} cpus, work dir {base}",
        flush=True,
    )
    print(
        f"workload: {WORKLOAD.relative_to(ROOT)} --step-time {a.step_time} --ckpt-every 5",
        flush=True,
    )
    rc = 0
    try:
        lines: list[str] = []
        if not a.skip_calibration:
            calibrate(lines)
        if not a.skip_recovery:
            rc |= bench_recovery(a, base, lines)
        if not a.skip_scaleup:
            rc |= bench_scaleup(a, base, lines)
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
    flex = Launcher("flexrun", "flexrun", timeout=a.trial_timeout)
    torch_ok = Launcher(
        "torchrun (SHARE_RDZV_TCP_STORE off)", "torchrun", dict(SHARE_OFF), timeout=a.trial_timeout
    )
    launchers = [flex, torch_ok]
    if a.torchrun_default:
        launchers.append(
            Launcher("torchrun (default settings)", "torchrun", timeout=a.default_timeout)
        )
    rng = random.Random(a.seed)
    results: dict[str, list[Outcome]] = {ln.name: [] for ln in launchers}
    print(
        f"\n## kill -9 of one of 4 workers, --standalone --nproc-per-node 4 --max-restarts 3, "
        f"{a.trials} trials",
        flush=True,
    )
    for i in range(a.trials):
        rank = rng.randrange(4)
        order = launchers if i % 2 == 0 else [launchers[1], launchers[0], *launchers[2:]]
        print(f"  trial {i + 1}: kill rank {rank}", flush=True)
        for ln in order:
            if ln.name.endswith("(default settings)") and i >= a.default_trials:
                continue
            o = recovery_trial(ln, rank, base, i, a)
            results[ln.name].append(o)
            report_trial(
                ln.name, o, show_detail=True, short=not (ln.kind == "flexrun" or bool(ln.env))
            )
    hdr = f"{'launcher':<38} {'ok':>6}  {'median':>7}  {'min':>7}  {'max':>7}  {'spawn med':>9}"
    lines += [
        "kill -9 of 1 of 4 workers: recovery = kill -> first completed step of the restarted attempt (s);",
        "spawn = kill -> the launcher's first new worker process exists (its own share of the recovery)",
        hdr,
        "-" * len(hdr),
    ]
    meds: dict[str, float | None] = {}
    for ln in launchers:
        row, med = summary(results[ln.name])
        meds[ln.name] = med
        extra = ""
        if ln is launchers[-1] and a.torchrun_default:
            outs = results[ln.name]
            hung = sum(1 for o in outs if o.note.startswith("hung"))
            failed = sum(1 for o in outs if not o.ok) - hung
            extra = f"   ({failed} failed, {hung} hung > {a.default_timeout:g}s)"
        lines.append(f"{ln.name:<38} {row}{extra}")
    fm, tm = meds[flex.name], meds[torch_ok.name]
    if fm is not None and tm is not None:
        ratio = fm / tm
        verdict = "PASS" if ratio <= 0.6 and all(o.ok for o in results[flex.name]) else "FAIL"
        lines.append(f"ratio flexrun/torchrun (medians): {ratio:.2f}x   target <= 0.60x: {verdict}")
        sf = [o.spawn for o in results[flex.name] if o.ok and o.spawn is not None]
        st = [o.spawn for o in results[torch_ok.name] if o.ok and o.spawn is not None]
        if sf and st:
            lines.append(
                f"launcher's own share (spawn medians) flexrun/torchrun: "
                f"{statistics.median(sf):.2f}s / {statistics.median(st):.2f}s = "
                f"{statistics.median(sf) / statistics.median(st):.2f}x"
            )
    else:
        verdict = "FAIL"
        lines.append(
            "ratio flexrun/torchrun: n/a (no successful trials on one side)   target <= 0.60x: FAIL"
        )
    return 0 if verdict == "PASS" else 1


def bench_scaleup(a: argparse.Namespace, base: Path, lines: list[str]) -> int:
    print(
        f"\n## scale-up: a 2nd node joins a running 1-node job (--nproc-per-node 1), "
        f"{a.scale_trials} trials",
        flush=True,
    )
    kinds = ["flexrun", "torchrun"]
    res: dict[tuple[int, str], list[Outcome]] = {}
    for max_nodes in (2, 3):
        for i in range(a.scale_trials):
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                o = scaleup_trial(kind, max_nodes, base, i, a)
                res.setdefault((max_nodes, kind), []).append(o)
                label = f"--nnodes 1:{max_nodes} {kind}" + (
                    " (SHARE off)" if kind == "torchrun" else ""
                )
                report_trial(label, o, show_detail=True)
    hdr = f"{'nnodes':<8} {'launcher':<37} {'ok':>6}  {'median':>7}  {'min':>7}  {'max':>7}  {'spawn med':>9}"
    lines += [
        "",
        "scale-up: 2nd agent started -> its first completed step (s); spawn = -> its worker process exists",
        hdr,
        "-" * len(hdr),
    ]
    worst = 0.0
    flex_ok = True
    for max_nodes in (2, 3):
        for kind in kinds:
            outs = res[(max_nodes, kind)]
            row, _ = summary(outs)
            name = "flexrun" if kind == "flexrun" else "torchrun (SHARE_RDZV_TCP_STORE off)"
            lines.append(f"1:{max_nodes:<6} {name:<37} {row}")
            if kind == "flexrun":
                flex_ok &= all(o.ok for o in outs)
                worst = max([worst, *[o.seconds or 0.0 for o in outs if o.ok]])
    verdict = "PASS" if flex_ok and worst <= 5.0 else "FAIL"
    lines.append(
        f"flexrun joiner's worst time {worst:.2f}s   target <= 5 s for every MAX: {verdict}"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
