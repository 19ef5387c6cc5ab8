"""Node loss inside a Slurm allocation: flexrun vs torchrun, same allocation shape, same script.

Each trial starts a real Slurm on this machine (munged, slurmctld and two compute hosts
``n1``, ``n2`` in network namespaces: ``tests/integration/slurm_support.py``), submits a
2-node job (``sbatch -N2 --ntasks-per-node=1 --no-kill``, ``srun --no-kill
--kill-on-bad-exit=0``) running ``--nnodes 1:2 --nproc-per-node 1`` of
``tests/integration/scripts/ddp_steps.py`` (plain DDP on gloo, checkpoint every 5 steps, one
JSON progress line per step), and once both nodes have trained ``--warm-steps`` steps kills
host ``n2``'s slurmd and every process there (a lost node). Measured: from the kill to the
first step the survivor (``n1``) completes alone (a progress line of world size 1).

Columns, interleaved trial by trial (the order alternates):

- flexrun: ``srun flexrun run --nnodes 1:2 --nproc-per-node 1 ddp_steps.py ...``, nothing
  else (flexrun takes the c10d endpoint, port and run id from ``SLURM_*``), default
  heartbeat (``heartbeat_timeout`` 5 s);
- torchrun: ``srun python -m torch.distributed.run --nnodes 1:2 --nproc-per-node 1
  --rdzv-backend c10d --rdzv-endpoint $HEAD:PORT --rdzv-id $SLURM_JOB_ID --max-restarts 3``
  with the head host from ``scontrol show hostnames`` (what a torchrun user writes in the
  sbatch script) and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it torch 2.13's
  c10d agent often fails or hangs on a restart: docs/user/running.md), torch's default
  keep-alive.

A trial that does not see the survivor train alone within ``--timeout`` counts as failed.
Every cluster is removed after its trial (daemons, the job's processes, namespaces).
Needs root and the Debian packages ``slurmctld slurmd slurm-client munge``.

    python bench/bench_slurm_nodeloss.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from slurm_support import SlurmCluster, missing, slurm_cluster  # noqa: E402

WORKLOAD = ROOT / "tests" / "integration" / "scripts" / "ddp_steps.py"
HEARTBEAT_TIMEOUT_S = 5.0
"""flexrun's default ``heartbeat_timeout`` (config/rdzv_conf.py): the acceptance bound is
this + 1 s."""
TORCH_PORT = 29731


@dataclass
class Trial:
    launcher: str
    ok: bool
    seconds: float | None
    detail: str


def _progress(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _script(launcher: str, tmp: Path, steps: int, step_time: float) -> str:
    train = (
        f"{WORKLOAD} --steps {steps} --step-time {step_time} --ckpt {tmp}/ckpt.pt "
        f"--ckpt-every 5 --progress {tmp}/progress.jsonl"
    )
    srun = "srun --no-kill --kill-on-bad-exit=0"
    if launcher == "flexrun":
        body = f"{srun} {sys.executable} -m flexrun run --nnodes 1:2 --nproc-per-node 1 {train}"
    else:
        body = "\n".join(
            [
                'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                f"{srun} {sys.executable} -m torch.distributed.run --nnodes 1:2 "
                f"--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint $HEAD:{TORCH_PORT} "
                f"--rdzv-id $SLURM_JOB_ID --max-restarts 3 {train}",
            ]
        )
    return f"#!/bin/sh\n{body}\n"


def _wait(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def trial(launcher: str, args: argparse.Namespace) -> Trial:
    with slurm_cluster() as slurm:
        return _run(slurm, launcher, args)


def _run(slurm: SlurmCluster, launcher: str, args: argparse.Namespace) -> Trial:
    tmp = slurm.tmp
    progress = tmp / "progress.jsonl"
    job = slurm.sbatch(
        _script(launcher, tmp, args.steps, args.step_time),
        "-N2",
        "--ntasks-per-node=1",
        "--no-kill",
        f"--chdir={tmp}",
        f"--output={tmp}/job.out",
    )
    try:

        def warm() -> bool:
            lines = [ln for ln in _progress(progress) if ln["world"] == 2]
            return {ln["rank"] for ln in lines if int(ln["step"]) >= args.warm_steps} == {0, 1}  # type: ignore[call-overload]

        if not _wait(warm, 120):
            out = (
                (tmp / "job.out").read_text(errors="replace")[-2000:]
                if (tmp / "job.out").exists()
                else ""
            )
            return Trial(launcher, False, None, f"never trained on 2 nodes:\n{out}")
        before = max(int(ln["step"]) for ln in _progress(progress))  # type: ignore[call-overload]
        killed_at = time.time()
        slurm.kill_slurmd("n2")

        def alone() -> dict[str, object] | None:
            for ln in _progress(progress):
                if float(ln["ts"]) > killed_at and ln["world"] == 1:  # type: ignore[arg-type]
                    return ln
            return None

        if not _wait(lambda: alone() is not None, args.timeout):
            return Trial(launcher, False, None, f"no step of world 1 within {args.timeout:g}s")
        first = alone()
        assert first is not None
        took = float(first["ts"]) - killed_at  # type: ignore[arg-type]
        return Trial(
            launcher, True, took, f"kill after step {before}, alone from step {first['step']}"
        )
    finally:
        slurm.client(["scancel", job], check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=2000, help="never reached: the job is cancelled")
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--warm-steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=150, help="per trial, kill -> alone")
    args = p.parse_args()
    why = missing()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    import torch

    print(
        f"flexrun bench: python {platform.python_version()}, torch {torch.__version__}, "
        f"{len(__import__('os').sched_getaffinity(0))} cpus"
    )
    print(
        f"workload: ddp_steps.py --step-time {args.step_time} --ckpt-every 5; 2-node Slurm "
        f"allocation (--no-kill), --nnodes 1:2 --nproc-per-node 1; slurmd of n2 and its "
        f"processes SIGKILLed after step {args.warm_steps}"
    )
    results: dict[str, list[Trial]] = {"flexrun": [], "torchrun": []}
    for i in range(args.trials):
        order = ["flexrun", "torchrun"] if i % 2 == 0 else ["torchrun", "flexrun"]
        print(f"  trial {i + 1}:", flush=True)
        for launcher in order:
            t = trial(launcher, args)
            results[launcher].append(t)
            secs = f"{t.seconds:6.2f}s" if t.seconds is not None else "     - "
            print(f"    {launcher:9} {'ok  ' if t.ok else 'FAIL'} {secs}  {t.detail}", flush=True)
    print("\nkill -> survivor training alone (median of the trials that recovered):")
    medians: dict[str, float] = {}
    for launcher, trials in results.items():
        ok = [t.seconds for t in trials if t.ok and t.seconds is not None]
        if ok:
            medians[launcher] = statistics.median(ok)
        shown = f"{medians[launcher]:.2f} s" if launcher in medians else "-"
        print(f"  {launcher:9} {shown:>9}  ({len(ok)}/{len(trials)} recovered)")
    if len(medians) == 2:
        print(f"  ratio flexrun/torchrun: {medians['flexrun'] / medians['torchrun']:.2f}x")
    if "flexrun" in medians:
        bound = HEARTBEAT_TIMEOUT_S + 1
        verdict = "PASS" if medians["flexrun"] <= bound else "FAIL"
        print(f"  target: flexrun within heartbeat timeout + 1 s = {bound:g} s: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
