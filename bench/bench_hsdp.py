"""bench_recovery's HSDP case (``--hsdp``): a sharded model's recovery, flexrun live mode beside
torchrun, in one run.

2 replica groups x 2 FSDP2 shards on CPU/gloo, one node (``--nproc-per-node 4``), the model
of examples/train_live_hsdp.py at ``--hsdp-dim 512 --hsdp-blocks 5`` (10.5M parameters) with
Adam, ``--hsdp-steps`` steps of a global batch of 32:

* flexrun: ``flexrun run --mode live --live-shards 2`` on examples/train_live_hsdp.py (two
  warm spares, the default in this mode);
* torchrun: ``torchrun --max-restarts 3`` on bench/hsdp_dcp_steps.py, the same model on a
  (replicate, shard) mesh, a DCP checkpoint every ``--hsdp-ckpt-every`` steps and a resume
  from the newest one (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the other cases).

Each run is killed (kill -9) at rank 3 (shard 1 of the second group) once every rank has
logged ``--hsdp-kill-at`` steps (flexrun: and two spares are ready). Recovery = the kill ->
the first step committed after it that is past the last step committed before it (the
optimizer stepped: torchrun's progress lines, written after ``opt.step()``; flexrun's
``--commits`` lines) by a new process (torchrun) or in a later membership epoch (flexrun).
Survivors kept: the healthy group's workers (ranks 0 and 1) that logged the last steps with
the pids they had before the kill.
Recomputed: step numbers logged before the kill and again after it. Equal: every shard's final
model and Adam state, both replicas, bitwise equal to a flexrun run of the same length without
the kill (started first, in the same run).

One line per trial and the summary line::

    hsdp live: recovery <s> s, torchrun <s> s, ratio <r>, survivors kept <k>/<n>, recomputed <m>, equal <b>
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexrun.testing.shard_states import equal_runs, read_shards

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_live_hsdp.py"
DCP_SCRIPT = ROOT / "bench" / "hsdp_dcp_steps.py"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hsdp", action="store_true", help="run the HSDP case (FSDP2, 2x2)")
    ap.add_argument("--hsdp-trials", type=int, default=1)
    ap.add_argument("--hsdp-steps", type=int, default=40)
    ap.add_argument("--hsdp-dim", type=int, default=512)
    ap.add_argument("--hsdp-blocks", type=int, default=5)
    ap.add_argument("--hsdp-kill-at", type=int, default=8)
    ap.add_argument("--hsdp-ckpt-every", type=int, default=5)
    ap.add_argument("--hsdp-timeout", type=float, default=600.0, help="per run (s)")


def _model_args(a: argparse.Namespace, d: Path) -> list[str]:
    return ["--steps", str(a.hsdp_steps), "--dim", str(a.hsdp_dim), "--blocks",
            str(a.hsdp_blocks), "--global-batch", "32", "--progress", str(d / "p.jsonl")]  # fmt: skip


def _live_cmd(a: argparse.Namespace, d: Path) -> list[str]:
    return [sys.executable, "-m", "flexrun", "run", "--standalone", "--nproc-per-node", "4",
            "--mode", "live", "--live-shards", "2", "--max-restarts", "3", "--run-dir",
            str(d / "run"), str(EXAMPLE), *_model_args(a, d), "--out", str(d / "out"),
            "--commits", str(d / "c.jsonl")]  # fmt: skip


def _torchrun_cmd(a: argparse.Namespace, d: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", "--max-restarts", "3", str(DCP_SCRIPT), "--shards", "2", "--ckpt-dir",
            str(d / "ck"), "--ckpt-every", str(a.hsdp_ckpt_every), *_model_args(a, d)]  # fmt: skip


def _trial(
    kind: str,
    a: argparse.Namespace,
    d: Path,
    procs: Any,
    poll: Callable[..., object],
    _rows: Callable[[Path], list[dict]],
) -> dict[str, Any]:
    """One run of ``kind`` (live, torchrun, reference); what the summary line needs."""
    d.mkdir(parents=True)
    cmd = _torchrun_cmd(a, d) if kind == "torchrun" else _live_cmd(a, d)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if kind == "torchrun" else None
    launcher = procs.start(kind, cmd, env_extra=env)
    deadline = time.monotonic() + a.hsdp_timeout
    out: dict[str, Any] = {"ok": False}
    prog = d / "p.jsonl"
    if kind != "reference":

        def ready() -> bool:
            rows = _rows(prog)
            ranks = {r["rank"] for r in rows if r["step"] >= a.hsdp_kill_at}
            spares = kind == "torchrun" or len(list(d.rglob("spare-*.ready"))) >= 2
            return ranks == {0, 1, 2, 3} and spares

        if not poll(ready, deadline, procs, interval=0.05, watch=launcher):
            out["error"] = f"never reached step {a.hsdp_kill_at}"
            return out
        before = _rows(prog)
        pids = {r["rank"]: r["pid"] for r in before if r.get("epoch", 1) in (1, None)}
        if kind == "torchrun":
            pids = {r["rank"]: r["pid"] for r in before if r["attempt"] == 0}
        last = max(r["step"] for r in before)
        done = prog if kind == "torchrun" else d / "c.jsonl"  # (committed steps)
        t_kill = time.time()
        last_done = max((r["step"] for r in _rows(done) if r["ts"] < t_kill), default=-1)
        procs.sweep()
        os.kill(pids[3], signal.SIGKILL)
        out.update(t_kill=t_kill, last=last, healthy={pids[0], pids[1]})

        def recovered() -> float | None:
            for r in _rows(done):
                if r["ts"] <= t_kill or r["step"] <= last_done or r["pid"] == pids[3]:
                    continue
                if kind == "torchrun" and r["pid"] in pids.values():
                    continue  # (torchrun: a new process)
                if kind == "live" and (r.get("epoch") or 0) <= 1:
                    continue  # (live: a step of the epoch formed after the kill)
                return float(r["ts"] - t_kill)
            return None

        rec = poll(recovered, deadline, procs, interval=0.05, watch=launcher)
        if rec is None:
            out["error"] = "no step after the kill"
            return out
        out["recovery"] = rec
    try:
        rc = launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001  (a hung run: reported, killed below)
        rc = None
    if rc != 0:
        out["error"] = f"exit code {rc}"
        return out
    rows = _rows(prog)
    out["ok"] = True
    if kind != "reference":
        late = {r["pid"] for r in rows if r["step"] >= a.hsdp_steps - 1}
        out["kept"] = len(out["healthy"] & late)
        again = {r["step"] for r in rows if r["ts"] > out["t_kill"] and r["step"] <= out["last"]}
        out["recomputed"] = len(again)
    if kind != "torchrun":
        out["shards"] = read_shards(d / "out")
    return out


def bench_hsdp(
    a: argparse.Namespace,
    base: Path,
    lines: list[str],
    procs_cls: Any,
    poll: Callable[..., object],
    read_progress: Callable[[Path], list[dict]],
) -> int:
    print(f"\n## HSDP: kill -9 of a shard worker, 2 groups x 2 shards, {a.hsdp_trials} trial(s)",
          flush=True)  # fmt: skip
    rc = 0
    lines += ["", "HSDP (2 replica groups x 2 FSDP2 shards, CPU/gloo, "
              f"dim {a.hsdp_dim} x {a.hsdp_blocks} blocks, Adam, {a.hsdp_steps} steps):"]  # fmt: skip
    for i in range(a.hsdp_trials):
        res: dict[str, dict[str, Any]] = {}
        for kind in ("reference", "live", "torchrun"):
            d = base / f"hsdp{i}-{kind}"
            procs = procs_cls(d.parent)
            try:
                res[kind] = _trial(kind, a, d, procs, poll, read_progress)
            finally:
                left = procs.kill_all()
            if left:
                res[kind]["error"] = f"{left} process(es) left alive"
                res[kind]["ok"] = False
            print(f"  trial {i} {kind}: {_brief(res[kind])}", flush=True)
        live, tr, ref = res["live"], res["torchrun"], res["reference"]
        if not (live["ok"] and tr["ok"] and ref["ok"]):
            lines.append(f"hsdp trial {i}: FAIL ({_brief(live)}; {_brief(tr)}; {_brief(ref)})")
            rc = 1
            continue
        ratio = live["recovery"] / tr["recovery"]
        equal = equal_runs(live["shards"], ref["shards"], replicas=2)
        line = (
            f"hsdp live: recovery {live['recovery']:.2f} s, torchrun {tr['recovery']:.2f} s, "
            f"ratio {ratio:.3f}, survivors kept {live['kept']}/2, recomputed "
            f"{live['recomputed']}, equal {equal}   (torchrun recomputed {tr['recomputed']})"
        )
        lines.append(line)
        ok = ratio <= 0.05 and live["kept"] == 2 and live["recomputed"] <= 1 and equal
        lines.append(f"  target ratio <= 0.05, survivors kept, recomputed <= 1, equal: "
                     f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
        rc |= 0 if ok else 1
    return rc


def _brief(o: dict[str, Any]) -> str:
    if not o.get("ok"):
        return f"failed: {o.get('error')}"
    rec = o.get("recovery")
    return "ok" if rec is None else f"ok, recovery {rec:.2f} s, recomputed {o['recomputed']}"
