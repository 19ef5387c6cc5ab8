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

Each run is hit at rank 3 (shard 1 of the second group) once every rank has logged
``--hsdp-kill-at`` steps (flexrun: and two spares are ready). ``--hsdp-fault`` picks how
(``all``: each in turn, one line each):

* ``kill``: kill -9;
* ``stop``: SIGSTOP (flexrun's agent takes a worker stopped for 0.3 s out; torchrun never
  notices one: its other workers wait in a collective until gloo's timeout, so it is given
  ``--hsdp-stop-wait`` seconds and reported as not recovered);
* ``transfer-kill``: kill -9, then a second kill -9 while the state is being recovered:
  flexrun: of the healthy group's worker whose ``live_transfer_sending`` event (emitted by
  a source once its shard is packed, before the first byte goes out) appears first, so no
  group holds the state and the durable checkpoint (``--ckpt-dir``, every
  ``--hsdp-ckpt-every`` steps, as torchrun's) must take over; torchrun: of the restarted
  attempt's first worker to log that it is loading the DCP checkpoint.

Recovery = the first kill (or stop) -> the first step committed after it that is past the
last step committed before it (the optimizer stepped: torchrun's progress lines, written after
``opt.step()``; flexrun's ``--commits`` lines, written by the example's ``on_commit``, which
``LiveLoop`` calls right after ``optimizer.step()``) by a new process (torchrun) or in a later
membership epoch (flexrun).
Survivors kept: the healthy group's workers (ranks 0 and 1) that logged the last steps with
the pids they had before the kill.
Recomputed: step numbers logged before the kill and again after it. Equal: every shard's final
model and Adam state, both replicas, bitwise equal to a flexrun run of the same length without
the kill (started first, in the same run).

One line per trial and fault, and whether it met its target::

    hsdp live: recovery <s> s, torchrun <s> s, ratio <r>, survivors kept <k>/<n>, recomputed <m>, equal <b>
    hsdp live (sigstop): ...
    hsdp live (kill during transfer): ...
"""

from __future__ import annotations

import argparse
import json
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
FAULTS = {"kill": "hsdp live", "stop": "hsdp live (sigstop)",
          "transfer-kill": "hsdp live (kill during transfer)"}  # fmt: skip


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hsdp", action="store_true", help="run the HSDP case (FSDP2, 2x2)")
    ap.add_argument("--hsdp-trials", type=int, default=1)
    ap.add_argument("--hsdp-fault", choices=[*FAULTS, "all"], default="kill",
                    help="kill (-9), stop (SIGSTOP), transfer-kill (a second kill during the "
                    "state transfer), all (each in turn)")  # fmt: skip
    ap.add_argument("--hsdp-stop-wait", type=float, default=30.0,
                    help="stop: seconds torchrun is given to recover from a stopped worker")  # fmt: skip
    ap.add_argument("--hsdp-steps", type=int, default=40)
    ap.add_argument("--hsdp-dim", type=int, default=512)
    ap.add_argument("--hsdp-blocks", type=int, default=5)
    ap.add_argument("--hsdp-kill-at", type=int, default=8)
    ap.add_argument("--hsdp-ckpt-every", type=int, default=5)
    ap.add_argument("--hsdp-timeout", type=float, default=600.0, help="per run (s)")


def _model_args(a: argparse.Namespace, d: Path) -> list[str]:
    return ["--steps", str(a.hsdp_steps), "--dim", str(a.hsdp_dim), "--blocks",
            str(a.hsdp_blocks), "--global-batch", "32", "--progress", str(d / "p.jsonl")]  # fmt: skip


def _live_cmd(a: argparse.Namespace, d: Path, fault: str) -> list[str]:
    durable = ["--ckpt-dir", str(d / "ck"), "--ckpt-every", str(a.hsdp_ckpt_every)]
    return [sys.executable, "-m", "flexrun", "run", "--standalone", "--nproc-per-node", "4",
            "--mode", "live", "--live-shards", "2", "--max-restarts", "3", "--run-dir",
            str(d / "run"), str(EXAMPLE), *_model_args(a, d), "--out", str(d / "out"),
            "--commits", str(d / "c.jsonl"),
            *(durable if fault == "transfer-kill" else [])]  # fmt: skip


def _torchrun_cmd(a: argparse.Namespace, d: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", "--max-restarts", "3", str(DCP_SCRIPT), "--shards", "2", "--ckpt-dir",
            str(d / "ck"), "--ckpt-every", str(a.hsdp_ckpt_every), *_model_args(a, d)]  # fmt: skip


def _lines(path: Path) -> list[dict]:
    """Every whole JSON object line of ``path`` (a line being written is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def _second_victim(kind: str, d: Path, after: float) -> dict | None:
    """The worker to kill while the state is being recovered, once one is under way:
    flexrun: the first source to announce its transfer (``live_transfer_sending``);
    torchrun: the first worker of a restarted attempt to log its checkpoint restore."""
    if kind == "live":
        for e in _lines(d / "run" / "events.jsonl"):
            if e.get("event") == "live_transfer_sending" and e["ts"] > after:
                return e
        return None
    for r in _lines(d / "p.jsonl"):
        if "restoring" in r and r["attempt"] >= 1 and r["ts"] > after:
            return r
    return None


def _transfer_outcome(d: Path, hit: dict) -> dict[str, Any]:
    """What the flexrun run did after the kill during the transfer: how many members joined
    the transfer's epoch (a torn transfer: none may), and where it resumed from."""
    events = _lines(d / "run" / "events.jsonl")
    joined = [e for e in events if e.get("event") == "live_joined" and e["epoch"] == hit["epoch"]]
    fb = [e for e in events if e.get("event") == "live_fallback" and e["epoch"] > hit["epoch"]]
    return {"joined": len(joined), "fallback": fb[0] if fb else None}


def _trial(
    kind: str,
    fault: str,
    a: argparse.Namespace,
    d: Path,
    procs: Any,
    poll: Callable[..., object],
    _rows: Callable[[Path], list[dict]],
) -> dict[str, Any]:
    """One run of ``kind`` (live, torchrun, reference) hit by ``fault``; what the summary
    line needs."""
    d.mkdir(parents=True)
    cmd = _torchrun_cmd(a, d) if kind == "torchrun" else _live_cmd(a, d, fault)
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
        os.kill(pids[3], signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        out.update(t_kill=t_kill, last=last, healthy={pids[0], pids[1]})
        if fault == "transfer-kill":
            hit = poll(lambda: _second_victim(kind, d, t_kill), deadline, procs,
                       interval=0.002, watch=launcher)  # fmt: skip
            if not isinstance(hit, dict):
                out["error"] = "no state transfer (restore) seen after the first kill"
                return out
            os.kill(hit["pid"], signal.SIGKILL)
            out["hit"] = {**hit, "delay": time.time() - hit["ts"], "after": hit["ts"] - t_kill}

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

        hung = kind == "torchrun" and fault == "stop"
        until = min(deadline, time.monotonic() + a.hsdp_stop_wait) if hung else deadline
        rec = poll(recovered, until, procs, interval=0.05, watch=launcher)
        if rec is None and hung:
            # (what it would do next: wait out gloo's collective timeout, 30 min by default)
            out.update(ok=True, hung=a.hsdp_stop_wait, recovery=None)
            return out
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
    if kind == "live" and fault == "transfer-kill":
        out.update(_transfer_outcome(d, out["hit"]))
    if kind != "torchrun":
        out["shards"] = read_shards(d / "out")
    return out


def _faults(a: argparse.Namespace) -> list[str]:
    return list(FAULTS) if a.hsdp_fault == "all" else [a.hsdp_fault]


def bench_hsdp(
    a: argparse.Namespace,
    base: Path,
    lines: list[str],
    procs_cls: Any,
    poll: Callable[..., object],
    read_progress: Callable[[Path], list[dict]],
) -> int:
    faults = _faults(a)
    print(f"\n## HSDP: {', '.join(faults)} of a shard worker, 2 groups x 2 shards, "
          f"{a.hsdp_trials} trial(s)", flush=True)  # fmt: skip
    rc = 0
    lines += ["", "HSDP (2 replica groups x 2 FSDP2 shards, CPU/gloo, "
              f"dim {a.hsdp_dim} x {a.hsdp_blocks} blocks, Adam, {a.hsdp_steps} steps):"]  # fmt: skip
    for i in range(a.hsdp_trials):
        res: dict[str, dict[str, Any]] = {}
        runs = [("reference", "kill"), *((k, f) for f in faults for k in ("live", "torchrun"))]
        for kind, fault in runs:
            name = kind if kind == "reference" else f"{kind}-{fault}"
            d = base / f"hsdp{i}-{name}"
            procs = procs_cls(d.parent)
            try:
                res[name] = _trial(kind, fault, a, d, procs, poll, read_progress)
            finally:
                left = procs.kill_all()
            if left and not res[name].get("hung"):
                res[name]["error"] = f"{left} process(es) left alive"
                res[name]["ok"] = False
            print(f"  trial {i} {name}: {_brief(res[name])}", flush=True)
        for fault in faults:
            line, ok = _summary(fault, res["reference"], res[f"live-{fault}"],
                                res[f"torchrun-{fault}"])  # fmt: skip
            lines.append(line if ok is not None else f"{FAULTS[fault]} trial {i}: FAIL ({line})")
            if ok is not None:
                lines.append(f"  target {_TARGETS[fault]}: {'PASS' if ok else 'FAIL'}")
            rc |= 0 if ok else 1
    return rc


_TARGETS = {
    "kill": "ratio <= 0.05, survivors kept, recomputed <= 1, equal",
    "stop": "ratio <= 0.05, survivors kept, recomputed <= 1, equal",
    "transfer-kill": "the job completes from the durable checkpoint, nobody joined the torn "
    "transfer's epoch, equal",
}


def _summary(
    fault: str, ref: dict[str, Any], live: dict[str, Any], tr: dict[str, Any]
) -> tuple[str, bool | None]:
    """The fault's line, and whether it met its target (None: a run failed; the line then
    says which)."""
    if not (live["ok"] and tr["ok"] and ref["ok"]):
        return f"{_brief(live)}; {_brief(tr)}; {_brief(ref)}", None
    equal = equal_runs(live["shards"], ref["shards"], replicas=2)
    if tr.get("hung"):
        trs, ratio = f">{tr['hung']:.2f} s", f"<{live['recovery'] / tr['hung']:.3f}"
        note = "torchrun: no step in that time, a stopped worker is never noticed"
        r = live["recovery"] / tr["hung"]
    else:
        r = live["recovery"] / tr["recovery"]
        trs, ratio = f"{tr['recovery']:.2f} s", f"{r:.3f}"
        note = f"torchrun recomputed {tr['recomputed']}"
    line = (
        f"{FAULTS[fault]}: recovery {live['recovery']:.2f} s, torchrun {trs}, ratio {ratio}, "
        f"survivors kept {live['kept']}/2, recomputed {live['recomputed']}, equal {equal}"
    )
    if fault != "transfer-kill":
        return f"{line}   ({note})", r <= 0.05 and live["kept"] == 2 and live[
            "recomputed"
        ] <= 1 and equal
    hit, fb = live["hit"], live["fallback"]
    where = f"the durable checkpoint at step {fb['step']}" if fb else "NO fallback event"
    line += (
        f"   ({note}; second kill: the shard-{hit['shard']} source "
        f"{hit['after']:.2f} s after the first kill, {hit['delay'] * 1000:.0f} ms after its "
        f"live_transfer_sending ({hit['bytes'] / 1e6:.0f} MB); members that joined that epoch "
        f"{live['joined']}/4; resumed from {where}; torchrun's second kill "
        f"{tr['hit']['after']:.2f} s after its first, during its DCP restore)"
    )
    return line, bool(fb) and live["joined"] == 0 and equal


def _brief(o: dict[str, Any]) -> str:
    if not o.get("ok"):
        return f"failed: {o.get('error')}"
    if o.get("hung"):
        return f"ok, no recovery in {o['hung']:.0f} s (stopped worker not noticed)"
    rec = o.get("recovery")
    return "ok" if rec is None else f"ok, recovery {rec:.2f} s, recomputed {o['recomputed']}"
