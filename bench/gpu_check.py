"""GPU truth in one run: restart, live, checkpoint and observability paths on a CUDA device.

One prepared script (issue 39) for a machine with one GPU and a few minutes: it runs four
parts, each isolated (an exception, a hang or a failed check in one is recorded in its
entry and the others still run), and writes ``gpu_check.json`` and ``gpu_check.txt`` to
``--out`` (default: ``$OUT`` when set, else ``bench/results/gpu/<date>``):

1. ``restart``: ``flexrun run --standalone`` and ``torchrun`` side by side on the same
   worker script, on ``cuda:0``: NCCL with one rank, and gloo on CUDA tensors with
   ``--nproc`` ranks (NCCL refuses two ranks on one device). kill -9 of one worker once
   every rank has trained a few steps (and, for flexrun, once a warm spare is ready); the
   time from the kill to the next completed step, and where it went for the replacement
   process (process created, script start, ``import torch``, CUDA context, process group
   and first collective, first step), each relative to the kill. Each new worker also
   reports whether CUDA was initialised before its script started and whether torch sees
   a bad fork (a warm spare must never create a CUDA context before it is handed out).
2. ``live``: ``flexrun run --mode live`` with ``--nproc`` workers on the one device (model,
   gradients and the all-reduce on CUDA tensors, gloo), one warm spare; a reference run
   without a kill, then a run with kill -9 of one worker: survivors keep their PIDs, the
   recovery time, and whether the final weights are bitwise identical to the reference.
3. ``checkpoint``: ``bench/bench_gpu_checkpoint.py`` (a ~1B-parameter fp32 model with Adam
   state on the device): the stall of ``flexrun.train.Checkpointer.save`` vs
   ``torch.distributed.checkpoint.async_save`` vs a synchronous ``torch.save``, and the
   step time while persisting.
4. ``observe``: ``flexrun doctor`` on this node (device matmul, all-reduce) against a
   ``flexrun store``, then a running job's ``--metrics-port`` endpoint scraped for the
   NVML gauges (``flexrun_gpu_*``: utilisation, memory, temperature) next to a direct NVML
   sample.

``--device cpu`` is the dry run: the same parts on the CPU with gloo and small sizes
(``--ckpt-params``), used by the test suite; on the CPU the NVML gauges are expected to be
absent and the checks say so instead of requiring them.

    python bench/gpu_check.py                     # on the GPU machine, about 6-8 minutes
    python bench/gpu_check.py --device cpu --nproc 2 --ckpt-params 2e6   # the dry run
"""

from __future__ import annotations

import time

_T0 = time.time()  # a worker's script start, before anything heavy is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import urllib.request  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
FLEXRUN = [sys.executable, "-m", "flexrun"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SHARE_OFF = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # torchrun's restarts hang without it
PARTS = ("restart", "live", "checkpoint", "observe")
HB = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=60"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--out", default=None, help="output folder (default: $OUT, else bench/results/gpu/<date>)"
    )
    ap.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    ap.add_argument(
        "--nproc", type=int, default=4, help="ranks of the multi-worker runs (default 4)"
    )
    ap.add_argument(
        "--ckpt-params",
        type=float,
        default=None,
        help="checkpoint model size in parameters (default 1e9 on cuda, 2e6 on cpu)",
    )
    ap.add_argument(
        "--restart-worlds",
        default=None,
        help="world sizes of the restart part (default 1,NPROC; NCCL for 1 on cuda, else gloo)",
    )
    ap.add_argument("--ckpt-repeats", type=int, default=1, help="measured saves per method")
    ap.add_argument("--step-time", type=float, default=0.05, help="sleep per training step (s)")
    ap.add_argument("--part-timeout", type=float, default=240.0, help="seconds per launched job")
    # worker modes (the script runs itself under flexrun run / torchrun)
    ap.add_argument("--worker", choices=("restart", "live"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=40, help=argparse.SUPPRESS)
    ap.add_argument("--progress", default="", help=argparse.SUPPRESS)
    ap.add_argument("--final", default="", help=argparse.SUPPRESS)
    ap.add_argument("--matmul", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in a.parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part(s) {','.join(bad)}; choose from {','.join(PARTS)}")
    if not 1 <= a.nproc <= 8:
        ap.error("--nproc must be 1-8")
    try:
        a.restart_worlds = [int(w) for w in (a.restart_worlds or f"1,{a.nproc}").split(",")]
    except ValueError:
        ap.error("--restart-worlds: comma-separated world sizes, e.g. 1,4")
    if not all(1 <= w <= 8 for w in a.restart_worlds):
        ap.error("--restart-worlds: each world size must be 1-8")
    if a.ckpt_params is None:
        a.ckpt_params = 1e9 if a.device == "cuda" else 2e6
    if not 1e3 <= a.ckpt_params <= 1e10:
        ap.error("--ckpt-params must be between 1e3 and 1e10")
    return a


def _append(path: str, row: dict[str, Any]) -> None:
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)


# -- worker: restart mode (plain torchrun-style script on the device) ------------------------


def _created_at() -> float:
    """When this process was created, on ``time.time()``'s clock.

    Not ``psutil.Process().create_time()``: that adds the start tick to /proc/stat's boot
    time, which is whole seconds, so it can be up to a second early (0.6 s on one machine
    here), and a process started after a kill looked older than the kill. The start tick's
    age against /proc/uptime (centiseconds) puts it on the wall clock to about 10 ms.
    """
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    with open("/proc/uptime") as f:
        uptime_s = float(f.read().split()[0])
    return time.time() - (uptime_s - start_s)


def _descendants(pid: int) -> set[int]:
    """The PIDs of every process below ``pid`` now."""
    import psutil

    try:
        return {k.pid for k in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def restart_worker(a: argparse.Namespace) -> None:
    created = _created_at()
    import torch

    t_torch = time.time()
    cuda_before = bool(a.device == "cuda" and torch.cuda.is_initialized())
    bad_fork = bool(a.device == "cuda" and torch.cuda._is_in_bad_fork())
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if a.device == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
        torch.cuda.synchronize(dev)
    else:
        dev = torch.device("cpu")
    t_ctx = time.time()
    dist.init_process_group(a.backend)
    probe = torch.ones(1, device=dev)
    dist.all_reduce(probe)  # the first collective: connections are made here
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_pg = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ.get("FLEXRUN_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    load = torch.randn(a.matmul, a.matmul, device=dev) if a.matmul else None
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    for step in range(a.steps):
        x = torch.randn(32, 256, device=dev, generator=gen)
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        if load is not None:
            for _ in range(4):
                load = torch.tanh(load @ load)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        time.sleep(a.step_time)
        row: dict[str, Any] = {
            "ts": time.time(),
            "attempt": attempt,
            "rank": rank,
            "world": world,
            "step": step,
            "pid": os.getpid(),
            "device": str(dev),
            "backend": str(dist.get_backend()),
        }
        if step == 0:
            row["phases"] = {
                "process_created": created,
                "script_start": _T0,
                "torch_imported": t_torch,
                "device_ready": t_ctx,
                "group_ready": t_pg,
                "first_step": row["ts"],
            }
            row["cuda_initialized_before_script"] = cuda_before
            row["bad_fork"] = bad_fork
        _append(a.progress, row)
    dist.barrier()
    dist.destroy_process_group()


# -- worker: live mode on device tensors -----------------------------------------------------


def live_worker(a: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import TensorDataset

    from flexrun.train.live import LiveLoop, state_checksum

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    g = torch.Generator().manual_seed(42)
    x = torch.randn(240, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(240, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    ).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loop = LiveLoop(model, opt, TensorDataset(x, y), global_batch=24, steps=a.steps, seed=3)
    for step in loop:
        for xb, yb in step.batches(micro_batch=4):
            out = model(xb.to(dev))
            step.backward(torch.nn.functional.mse_loss(out, yb.to(dev)))
        time.sleep(a.step_time)
        _append(
            a.progress,
            {
                "ts": time.time(),
                "step": step.number,
                "rank": step.rank,
                "world": step.world_size,
                "pid": os.getpid(),
                "epoch": loop.epoch.number if loop.epoch else None,
                "device": str(next(model.parameters()).device),
            },
        )
    _append(
        a.progress,
        {
            "ts": time.time(),
            "done": True,
            "rank": loop.rank,
            "pid": os.getpid(),
            "checksum": state_checksum(model),
        },
    )
    if a.final and loop.rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, a.final)
    loop.close()


# -- the launcher side -------------------------------------------------------------------------


def _recovery_helpers() -> Any:
    sys.path.insert(0, str(HERE.parent))
    import bench_recovery  # Procs (nothing left behind), poll, free_port, read_progress

    return bench_recovery


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no output)"


def _rows(path: Path) -> list[dict[str, Any]]:
    br = _recovery_helpers()
    return [r for r in br.read_progress(path)]


class PartFailed(Exception):
    """A check of a part did not hold; the message says which (recorded, not fatal)."""


def _worker_cmd(
    a: argparse.Namespace, mode: str, backend: str, progress: Path, **kw: Any
) -> list[str]:
    cmd = [str(HERE), "--worker", mode, "--device", a.device, "--backend", backend]
    cmd += ["--step-time", str(kw.get("step_time", a.step_time)), "--progress", str(progress)]
    cmd += ["--steps", str(kw.get("steps", 40))]
    if kw.get("final"):
        cmd += ["--final", str(kw["final"])]
    if kw.get("matmul"):
        cmd += ["--matmul", str(kw["matmul"])]
    return cmd


def restart_trial(
    a: argparse.Namespace, work: Path, launcher: str, backend: str, nproc: int
) -> dict[str, Any]:
    """One kill -9 under ``launcher`` (flexrun or torchrun): recovery and its breakdown."""
    br = _recovery_helpers()
    d = work / f"restart-{launcher}-{backend}-{nproc}"
    d.mkdir(parents=True)
    progress = d / "progress.jsonl"
    # (enough steps that the kill lands mid-run: flexrun's trial first waits for a spare
    # per worker, which on a loaded machine can outlast 60 steps of 0.05 s: a rehearsal's
    # kill once found the victim gone, ProcessLookupError)
    warm_steps, steps = 5, 300
    wcmd = _worker_cmd(a, "restart", backend, progress, steps=steps)
    common = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "2"]
    if launcher == "flexrun":  # (the script also holds a LiveLoop worker: say which mode)
        cmd = [*FLEXRUN, "run", *common, "--mode", "restart", "--run-dir", str(d / "run"), *wcmd]
        env: dict[str, str] = {}
    else:
        cmd = [*TORCHRUN, *common, *wcmd]
        env = dict(SHARE_OFF)
    procs = br.Procs(d)
    out: dict[str, Any] = {"launcher": launcher, "backend": backend, "world": nproc}
    try:
        p = procs.start("launcher", cmd, env_extra={"PYTHONPATH": _pythonpath(), **env})
        deadline = time.monotonic() + a.part_timeout

        def warmed() -> list[dict[str, Any]] | None:
            rows = _rows(progress)
            ranks = {r["rank"] for r in rows if r["step"] >= warm_steps}
            return rows if len(ranks) == nproc else None

        rows = br.poll(warmed, deadline, procs, watch=p)
        if not rows:
            raise PartFailed(
                f"{launcher}: the workers never trained {warm_steps} steps:\n{_tail(procs.logs['launcher'])}"
            )
        if launcher == "flexrun":
            # The pool fills once the workers run; a restart replaces every local worker, so
            # wait for one spare each (with fewer, the victim's replacement may be forked after
            # the kill: warm, but not a process that existed before it).
            out["spare_ready_before_kill"] = bool(
                br.poll(
                    lambda: br.ready_spares(d / "run") >= nproc,
                    time.monotonic() + 180,
                    procs,
                    watch=p,
                )
            )
            rows = _rows(progress)
        if max(r["step"] for r in rows) > steps - 40:
            raise PartFailed(f"{launcher}: the run was nearly over before the kill (raise steps)")
        victim_rank = nproc - 1
        victim = max((r for r in rows if r["rank"] == victim_rank), key=lambda r: r["ts"])["pid"]
        old = {r["pid"] for r in rows}
        before = _descendants(p.pid)  # (a warm spare is one of them: a process before the kill)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def recovered() -> dict[str, Any] | None:
            new = [r for r in _rows(progress) if r["pid"] not in old and r["ts"] > t_kill]
            return min(new, key=lambda r: r["ts"]) if new else None

        first = br.poll(recovered, deadline, procs, watch=p)
        if not first:
            raise PartFailed(
                f"{launcher}: no step after the kill:\n{_tail(procs.logs['launcher'])}"
            )
        out["recovery_s"] = first["ts"] - t_kill
        rc = br.poll(lambda: p.poll() is not None, deadline, procs)
        out["exit_code"] = p.returncode if rc else None
        new_rows = [r for r in _rows(progress) if r["pid"] not in old and "phases" in r]
        mine = [r for r in new_rows if r["rank"] == victim_rank] or new_rows
        first_row = min(mine, key=lambda r: r["ts"])
        out["breakdown_s"] = {k: round(v - t_kill, 4) for k, v in first_row["phases"].items()}
        ph = first_row["phases"]
        out["phase_s"] = {
            "start_or_handoff": round(ph["script_start"] - max(ph["process_created"], t_kill), 4),
            "import_torch": round(ph["torch_imported"] - ph["script_start"], 4),
            "device_context": round(ph["device_ready"] - ph["torch_imported"], 4),
            "group_init": round(ph["group_ready"] - ph["device_ready"], 4),
            "first_step": round(ph["first_step"] - ph["group_ready"], 4),
        }
        # A process that existed before the kill is a warm spare: judged by its PID among the
        # launcher's descendants just before the kill, not by its start time (a clock tick's
        # resolution, 10 ms, while a spare forked from the pool's zygote can be ready within
        # milliseconds of the kill that waits for it: 11 ms once here, under load).
        out["warm_process"] = first_row["pid"] in before
        out["cuda_initialized_before_script"] = any(
            r["cuda_initialized_before_script"] for r in new_rows
        )
        out["bad_fork"] = any(r["bad_fork"] for r in new_rows)
        out["device"] = first_row["device"]
        out["ok"] = (
            out["exit_code"] == 0
            and not out["cuda_initialized_before_script"]
            and not out["bad_fork"]
        )
        if not out["ok"]:
            out["log_tail"] = _tail(procs.logs["launcher"])
        return out
    finally:
        out["left_alive"] = procs.kill_all()


def part_restart(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    configs = [("nccl" if a.device == "cuda" and n == 1 else "gloo", n) for n in a.restart_worlds]
    trials = []
    for backend, n in configs:
        for launcher in ("flexrun", "torchrun"):
            trials.append(
                _isolated(
                    f"{launcher} {backend} x{n}",
                    lambda lb=launcher, be=backend, n=n: restart_trial(a, work, lb, be, n),
                )
            )
    res: dict[str, Any] = {"trials": trials, "ok": all(t.get("ok") for t in trials)}
    res["warm_pool_note"] = (
        "A flexrun warm spare has torch imported but no CUDA context (checked: "
        "cuda_initialized_before_script / bad_fork stay false), so a restart saves process "
        "start and `import torch` and still pays CUDA context creation, process-group init "
        "and the first step."
    )
    return res


def part_live(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    br = _recovery_helpers()
    steps = 200

    def run(name: str, kill: bool) -> dict[str, Any]:
        d = work / f"live-{name}"
        d.mkdir(parents=True)
        progress, final = d / "progress.jsonl", d / "final.pt"
        cmd = [*FLEXRUN, "run", "--standalone", "--nproc-per-node", str(a.nproc), "--mode", "live"]
        cmd += ["--warm-spares", "1" if kill else "0", "--max-restarts", "10", "--rdzv-conf", HB]
        cmd += ["--run-dir", str(d / "run")]
        cmd += _worker_cmd(a, "live", "gloo", progress, steps=steps, final=final, step_time=0.02)
        procs = br.Procs(d)
        out: dict[str, Any] = {}
        try:
            p = procs.start("launcher", cmd, env_extra={"PYTHONPATH": _pythonpath()})
            deadline = time.monotonic() + a.part_timeout
            if kill:

                def started() -> list[dict[str, Any]] | None:
                    rows = [r for r in _rows(progress) if "step" in r]
                    return (
                        rows
                        if len({r["rank"] for r in rows if r["step"] >= 5}) == a.nproc
                        else None
                    )

                if not br.poll(started, deadline, procs, watch=p):
                    raise PartFailed(
                        f"live: the workers never trained:\n{_tail(procs.logs['launcher'])}"
                    )
                out["spare_ready_before_kill"] = bool(
                    br.poll(
                        lambda: br.ready_spares(d / "run"), time.monotonic() + 90, procs, watch=p
                    )
                )
                rows = [r for r in _rows(progress) if "step" in r]
                if max(r["step"] for r in rows) > steps - 40:
                    raise PartFailed(
                        "live: the run was nearly over before the kill (raise --steps)"
                    )
                last = {r["rank"]: r["pid"] for r in sorted(rows, key=lambda r: r["ts"])}
                victim = last[a.nproc - 1]
                before = max(r["step"] for r in rows)
                t_kill = time.time()
                os.kill(victim, signal.SIGKILL)
                out["survivors"] = sorted(set(last.values()) - {victim})

                def next_epoch_step() -> dict[str, Any] | None:
                    new = [
                        r
                        for r in _rows(progress)
                        if "step" in r
                        and r["ts"] > t_kill
                        and r["step"] > before
                        and r["epoch"] is not None
                        and r["epoch"] >= 2
                    ]
                    return min(new, key=lambda r: r["ts"]) if new else None

                first = br.poll(next_epoch_step, deadline, procs, watch=p)
                out["recovery_s"] = (first["ts"] - t_kill) if first else None
            done = br.poll(lambda: p.poll() is not None, deadline, procs)
            out["exit_code"] = p.returncode if done else None
            rows = _rows(progress)
            out["devices"] = sorted({r["device"] for r in rows if "device" in r})
            if kill:
                late = [r for r in rows if "step" in r and r["step"] >= steps - 5]
                out["survivors_kept_pids"] = set(out["survivors"]) <= {r["pid"] for r in late}
                out["final_world"] = sorted({r["world"] for r in late})
            if out["exit_code"] != 0:
                out["log_tail"] = _tail(procs.logs["launcher"])
            out["final"] = str(final) if final.exists() else None
            return out
        finally:
            out["left_alive"] = procs.kill_all()

    ref = run("reference", kill=False)
    killed = run("killed", kill=True)
    import torch

    bitwise = None
    if ref.get("final") and killed.get("final"):
        w0 = torch.load(ref["final"], weights_only=True)
        w1 = torch.load(killed["final"], weights_only=True)
        bitwise = set(w0) == set(w1) and all(torch.equal(w0[k], w1[k]) for k in w0)
    res = {
        "reference": ref,
        "killed": killed,
        "recovery_s": killed.get("recovery_s"),
        "survivors_kept_pids": killed.get("survivors_kept_pids"),
        "bitwise_identical": bitwise,
    }
    res["ok"] = bool(
        ref.get("exit_code") == 0
        and killed.get("exit_code") == 0
        and killed.get("survivors_kept_pids")
        and bitwise
        and all(d.startswith(a.device) for d in killed.get("devices", ["?"]))
    )
    return res


def part_checkpoint(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    layers = 15 if a.device == "cuda" else 3
    hidden = max(8, int(round(math.sqrt(a.ckpt_params / layers))))
    js = work / "checkpoint.json"
    cmd = [sys.executable, str(HERE.parent / "bench_gpu_checkpoint.py"), "--hidden", str(hidden)]
    cmd += ["--layers", str(layers), "--repeats", str(a.ckpt_repeats), "--steps-between", "3"]
    cmd += ["--dir", str(work / "ckpt"), "--out", "-", "--json", str(js)]
    cmd += ["--timeout", str(a.part_timeout)]
    if a.device == "cpu":
        cmd += ["--batch", "4", "--tiny"]
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    with open(work / "checkpoint.log", "wb") as fh:
        rc = subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=a.part_timeout + 60
        ).returncode
    if rc != 0 or not js.exists():
        raise PartFailed(f"bench_gpu_checkpoint exited {rc}:\n{_tail(work / 'checkpoint.log')}")
    res = json.loads(js.read_text())
    base = res["base_step_s"]
    table = {}
    for label, rows in res["rows"].items():
        if not rows:
            raise PartFailed(f"checkpoint: no measured save for {label}")
        table[label] = {
            "stall_s": sorted(r["stall_s"] for r in rows)[len(rows) // 2],
            "durable_s": sorted(r["persist_s"] for r in rows)[len(rows) // 2],
            "step_slowdown": sorted(r["step_while_s"] for r in rows)[len(rows) // 2] / base - 1,
        }
    return {
        "device": res["device"],
        "params": res["params"],
        "state_bytes": res["state_bytes"],
        "base_step_s": base,
        "methods": table,
        "memory_tier": "not measured: flexrun.train has no memory tier on this branch",
        "ok": len(table) == 3,
    }


def part_observe(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    br = _recovery_helpers()
    procs = br.Procs(work)
    out: dict[str, Any] = {}
    env = {"PYTHONPATH": _pythonpath()}
    try:
        port = br.free_port()
        store = procs.start(
            "store", [*FLEXRUN, "store", "--host", "127.0.0.1", "--port", str(port)], env_extra=env
        )
        if not br.poll(
            lambda: "listening" in _tail(procs.logs["store"]),
            time.monotonic() + 60,
            procs,
            watch=store,
        ):
            raise PartFailed(f"flexrun store did not start:\n{_tail(procs.logs['store'])}")
        doc = procs.start(
            "doctor",
            [
                *FLEXRUN,
                "doctor",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "gpucheck",
                "--iters",
                "3",
                "--matmul-size",
                "4096" if a.device == "cuda" else "256",
                "--size-mb",
                "64" if a.device == "cuda" else "4",
                "--json",
            ],
            env_extra=env,
        )
        if not br.poll(lambda: doc.poll() is not None, time.monotonic() + a.part_timeout, procs):
            raise PartFailed("flexrun doctor did not finish")
        text = procs.logs["doctor"].read_text(errors="replace")
        try:
            report = json.loads(text[text.index("{") :])
        except ValueError as exc:
            raise PartFailed(
                f"flexrun doctor printed no JSON (exit {doc.returncode}):\n{text[-2000:]}"
            ) from exc
        node = report["nodes"][0]
        out["doctor"] = {
            "exit_code": doc.returncode,
            "devices_matmul_s": node["devices"],
            "flagged": report["flagged"],
        }
        want = "cuda:0" if a.device == "cuda" else "cpu"
        doctor_ok = doc.returncode == 0 and node["devices"].get(want, 0) > 0

        from flexrun.observe.resources import sample_resources

        direct = sample_resources(str(work), gpus=True)
        out["nvml_direct"] = [dataclasses.asdict(g) for g in direct.gpus]
        mport = br.free_port()
        d = work / "metrics-job"
        d.mkdir()
        progress = d / "progress.jsonl"
        job = procs.start(
            "job",
            [
                *FLEXRUN,
                "run",
                "--standalone",
                "--nproc-per-node",
                "1",
                "--mode",
                "restart",
                "--metrics-port",
                str(mport),
                "--run-dir",
                str(d / "run"),
                *_worker_cmd(
                    a,
                    "restart",
                    "nccl" if a.device == "cuda" else "gloo",
                    progress,
                    steps=100000,
                    step_time=0.01,
                    matmul=8192 if a.device == "cuda" else 64,
                ),
            ],
            env_extra=env,
        )
        if not br.poll(
            lambda: len(_rows(progress)) >= 3, time.monotonic() + a.part_timeout, procs, watch=job
        ):
            raise PartFailed(f"the metrics job never trained:\n{_tail(procs.logs['job'])}")
        samples = []
        for _ in range(3):
            samples.append(_scrape(mport))
            time.sleep(1.0)
        gpu = {k: v for k, v in samples[-1].items() if k.startswith("flexrun_gpu_")}
        out["metrics_gpu"] = gpu
        out["metrics_node_cpus"] = samples[-1].get("flexrun_node_cpus")
        if a.device == "cuda":
            used = [v for k, v in gpu.items() if k.startswith("flexrun_gpu_memory_used_bytes")]
            util = [
                v
                for s in samples
                for k, v in s.items()
                if k.startswith("flexrun_gpu_utilization_ratio")
            ]
            out["gpu_utilization_max"] = max(util, default=None)
            metrics_ok = bool(used) and max(used) > 0 and bool(direct.gpus)
        else:  # the dry run: no NVML here, and the endpoint must say nothing about GPUs
            out["nvml"] = "absent (expected on the CPU dry run)" if not direct.gpus else "present"
            metrics_ok = not gpu and bool(out["metrics_node_cpus"])
        out["ok"] = doctor_ok and metrics_ok
        return out
    finally:
        out["left_alive"] = procs.kill_all()


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _pythonpath() -> str:
    src = str(REPO / "src")
    cur = os.environ.get("PYTHONPATH", "")
    return src if not cur else (cur if src in cur.split(os.pathsep) else f"{src}{os.pathsep}{cur}")


def _isolated(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        res = fn()
    except Exception as exc:  # one part failing must not stop the others: recorded
        res = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-3000:],
        }
    res["name"] = name
    res["wall_s"] = round(time.monotonic() - t0, 2)
    return res


def environment(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_arg": a.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:]),
    }
    if a.device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        env["driver"] = q.stdout.strip() or None
    return env


def summary(result: dict[str, Any]) -> str:
    e = result["environment"]
    lines = [
        f"# flexrun GPU check, {e['date']}: device {e.get('gpu', e['device_arg'])}, torch {e['torch']},"
        f" CUDA {e['cuda']}, driver {e.get('driver')}",
        f"# {e['command']}",
        "",
    ]
    for name, part in result["parts"].items():
        lines.append(f"## {name}: {'ok' if part.get('ok') else 'FAILED'} ({part.get('wall_s')} s)")
        if "error" in part:
            lines.append(f"   error: {part['error']}")
        if name == "restart":
            for t in part.get("trials", []):
                rec = t.get("recovery_s")
                lines.append(
                    f"   {t['name']:<24} {'ok' if t.get('ok') else 'FAILED':<7}"
                    f" kill -> next step {rec:.2f} s"
                    if rec is not None
                    else f"   {t['name']:<24} FAILED {t.get('error', '')[:200]}"
                )
                if "phase_s" in t:
                    lines.append(
                        "      "
                        + ", ".join(f"{k} {v:.2f}s" for k, v in t["phase_s"].items())
                        + f" (warm process: {t['warm_process']})"
                    )
        elif name == "live" and "recovery_s" in part:
            lines.append(
                f"   recovery {part['recovery_s']} s, survivors kept pids: {part['survivors_kept_pids']},"
                f" bitwise identical: {part['bitwise_identical']}"
            )
        elif name == "checkpoint" and "methods" in part:
            lines.append(
                f"   {part['params'] / 1e9:.3f}B params, {part['state_bytes'] / 2**30:.2f} GiB state"
                f" on {part['device']}, step {part['base_step_s'] * 1e3:.1f} ms"
            )
            for label, m in part["methods"].items():
                lines.append(
                    f"   {label:<42} stall {m['stall_s'] * 1e3:9.1f} ms  durable {m['durable_s']:7.2f} s"
                    f"  step while persisting {m['step_slowdown'] * 100:+.0f}%"
                )
        elif name == "observe" and "doctor" in part:
            lines.append(f"   doctor: {part['doctor']}")
            lines.append(f"   metrics: {part.get('metrics_gpu') or part.get('nvml')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker == "restart":
        restart_worker(a)
        return 0
    if a.worker == "live":
        live_worker(a)
        return 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device here (use --device cpu for the dry run)", file=sys.stderr
            )
            return 2
    out = Path(
        a.out
        or os.environ.get("OUT")
        or REPO / "bench" / "results" / "gpu" / datetime.date.today().isoformat()
    )
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(a), "parts": {}}
    funcs = {
        "restart": part_restart,
        "live": part_live,
        "checkpoint": part_checkpoint,
        "observe": part_observe,
    }
    with tempfile.TemporaryDirectory(prefix="flexrun-gpu-check-") as tmp:
        for name in a.parts:
            work = Path(tmp) / name
            work.mkdir()
            result["parts"][name] = _isolated(name, lambda f=funcs[name], w=work: f(a, w))
            print(
                f"gpu_check: {name}: {'ok' if result['parts'][name]['ok'] else 'FAILED'}",
                flush=True,
            )
            (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    result["ok"] = all(p["ok"] for p in result["parts"].values())
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    text = summary(result)
    (out / "gpu_check.txt").write_text(text)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
