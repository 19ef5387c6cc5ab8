"""Recovery of REAL library scripts: kill -9 of one of 2 workers of an HF ``Trainer`` script
and of a Lightning script, flexrun (with ``--spare-preload``) vs torchrun, one run.

Workloads: ``examples/libraries/hf_trainer.py`` (``ElasticTrainer``, checkpoint every 5
steps) and ``examples/libraries/lightning_fit.py`` (``FlexrunCallback``, ``ModelCheckpoint``
every 5 steps); both resume from their newest checkpoint when restarted and append one JSON
progress line per optimizer step. Launchers, interleaved trial by trial (the order rotates):

* flexrun restart mode, ``--warm-spares 2 --spare-preload <the script's modules>``
  (``transformers.trainer``; ``lightning.pytorch``);
* torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/user/running.md).

Both ``--standalone --nproc-per-node 2 --max-restarts 3``. The kill (SIGKILL of rank 1's
worker) comes once both ranks completed ``--warm-steps`` steps and, for flexrun, both warm
spares are ready. Recovery = from the kill to the first completed step of the restarted
attempt (a progress line from a new pid); a trial succeeds when both ranks of it train.
"redo" = steps completed before the kill and again after it (back to the last checkpoint).

Every process started is killed at the end of each trial (``bench_recovery.Procs``).

    python bench/bench_libraries.py --trials 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from bench_recovery import FLEXRUN, SHARE_OFF, TORCHRUN, Procs, poll, read_progress, tail

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "hf": (ROOT / "examples" / "libraries" / "hf_trainer.py", "transformers.trainer"),
    "lightning": (ROOT / "examples" / "libraries" / "lightning_fit.py", "lightning.pytorch"),
}
LAUNCHERS = ("flexrun", "torchrun")
TARGET = 0.3


@dataclass
class Outcome:
    ok: bool
    recovery: float | None = None
    redo: int | None = None
    note: str = ""


def trial(script: str, launcher: str, base: Path, n: int, a: argparse.Namespace) -> Outcome:
    path, modules = SCRIPTS[script]
    d = base / f"{script}-{launcher}-{n}"
    d.mkdir(parents=True)
    progress, run_dir = d / "progress.jsonl", d / "run"
    common = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
    if launcher == "torchrun":
        cmd, env = TORCHRUN + common, dict(SHARE_OFF)
    else:
        cmd = FLEXRUN + common + ["--run-dir", str(run_dir), "--warm-spares", "2"]
        cmd += ["--spare-preload", modules]
        env = {}
    cmd += [str(path), "--out", str(d / "ckpt"), "--steps", "100000", "--save-steps", "5"]
    cmd += ["--step-time", str(a.step_time), "--progress", str(progress)]
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))  # fmt: skip
    procs = Procs(d)
    t0 = time.monotonic()
    deadline = t0 + a.trial_timeout
    agent = procs.start("launcher", cmd, env)
    try:
        need = 0 if launcher == "torchrun" else 2

        def warm() -> bool:
            ranks = {r["rank"] for r in read_progress(progress) if r["step"] >= a.warm_steps}
            spares = len(list((run_dir / "logs").rglob("spare-*.ready"))) if need else 0
            return ranks == {0, 1} and spares >= need

        if not poll(warm, deadline, procs, watch=agent):
            return Outcome(False, note="never warm: " + tail(procs.logs["launcher"], 8))
        rows = read_progress(progress)
        old = {r["pid"] for r in rows}
        victim = max((r for r in rows if r["rank"] == 1), key=lambda r: r["ts"])["pid"]
        try:
            kids = {k.pid for k in psutil.Process(agent.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            kids = set()
        if victim not in kids:
            return Outcome(False, note=f"rank 1 pid {victim} is not a child of the launcher")
        last = max(r["step"] for r in rows)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def new_rows() -> list[dict]:
            return [r for r in read_progress(progress) if r["ts"] > t_kill and r["pid"] not in old]

        if not poll(lambda: {r["rank"] for r in new_rows()} == {0, 1}, deadline, procs):
            return Outcome(False, note="no recovery: " + tail(procs.logs["launcher"], 8))
        rs = new_rows()
        first = min(r["ts"] for r in rs)
        redo = len({r["step"] for r in rs if r["step"] <= last})
        return Outcome(True, first - t_kill, redo)
    finally:
        left = procs.kill_all()
        if left:
            print(f"  WARNING: {left} processes of {d.name} survived", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--scripts", default="hf,lightning", help="of: " + ",".join(SCRIPTS))
    ap.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    ap.add_argument("--warm-steps", type=int, default=6, help="steps of both ranks before a kill")
    ap.add_argument("--trial-timeout", type=float, default=180.0)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    scripts = [s for s in a.scripts.split(",") if s]
    base = Path(tempfile.mkdtemp(prefix="bench-libraries-"))
    t_all = time.monotonic()
    results: dict[tuple[str, str], list[Outcome]] = {}
    print(f"## kill -9 of 1 of 2 workers, {a.trials} trials, step time {a.step_time}s", flush=True)
    try:
        for i in range(a.trials):
            for script in scripts:
                order = LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1]
                for launcher in order:
                    o = trial(script, launcher, base, i, a)
                    results.setdefault((script, launcher), []).append(o)
                    rec = f"{o.recovery:6.2f}s" if o.recovery is not None else "     -"
                    print(f"  trial {i + 1} {script:9} {launcher:8} {'ok  ' if o.ok else 'FAIL'}"
                          f" {rec}  redo {o.redo} {o.note}", flush=True)  # fmt: skip
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    print("\nscript     launcher   ok   median     min     max   (recovery: kill -> first "
          "step of the new workers, s)")  # fmt: skip
    verdict = 0
    for script in scripts:
        med = {}
        for launcher in LAUNCHERS:
            outs = results[(script, launcher)]
            got = [o.recovery for o in outs if o.ok and o.recovery is not None]
            ok = f"{len(got)}/{len(outs)}"
            if got:
                med[launcher] = statistics.median(got)
                print(f"{script:10} {launcher:9} {ok:4} {med[launcher]:7.2f} {min(got):7.2f} "
                      f"{max(got):7.2f}")  # fmt: skip
            else:
                print(f"{script:10} {launcher:9} {ok:4}       -")
        if len(med) == 2 and all(o.ok for ln in LAUNCHERS for o in results[(script, ln)]):
            ratio = med["flexrun"] / med["torchrun"]
            passed = ratio <= TARGET
            verdict |= 0 if passed else 1
            print(f"ratio {script} flexrun / torchrun (medians): {ratio:.2f}x   target <= "
                  f"{TARGET:.2f}x: {'PASS' if passed else 'FAIL'}")  # fmt: skip
        else:
            verdict = 1
            print(f"ratio {script}: not all trials succeeded: FAIL")
    print(f"\ntotal wall time {time.monotonic() - t_all:.0f}s", flush=True)
    return verdict


if __name__ == "__main__":
    sys.exit(main())
