"""Chaos: a seeded schedule of faults injected into a real job on this host.

Owns wiring three things together (``run_chaos``): the schedule (pure, in
``chaos_schedule``: ``make_schedule(seed, ...)`` always returns the same faults), the job
harness and its injector (``chaos_job``), and the run itself here: each fault applied at
its time and logged to ``<root>/chaos.jsonl``, then the verdict of
``flexrun.testing.invariants``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flexrun.testing import invariants as inv
from flexrun.testing.chaos_job import WORKLOAD, ChaosJob, JobSpec, worker_env
from flexrun.testing.chaos_schedule import KINDS, Fault, make_schedule

__all__ = [
    "KINDS",
    "WORKLOAD",
    "ChaosJob",
    "Fault",
    "JobSpec",
    "check",
    "make_schedule",
    "run_chaos",
]


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
    that kept one world size must match it bitwise). A sharded job's reference writes its
    final shards into the directory ``out``."""
    launcher = [sys.executable]
    live = spec.launcher == "live"
    if world > 1 or live:
        launcher += [
            "-m", "flexrun", "run", "--standalone", "--nproc-per-node", str(world),
            "--mode", "live" if live else "restart", "--warm-spares", "0",
            "--run-dir", str(out.parent / "reference-run"),
        ]  # fmt: skip
    sharded = []
    if spec.shards > 1:
        launcher += ["--live-shards", str(spec.shards)]
        sharded = ["--shards", str(spec.shards), "--shard-out", str(out)]
    argv = [
        *launcher, str(WORKLOAD),
        "--steps", str(spec.steps), "--samples", str(spec.samples),
        "--global-batch", str(spec.global_batch), "--seed", str(spec.seed),
        "--log-dir", str(out.parent / "reference-steps"), "--final", str(out),
        *(["--live-loop"] if live else []), *sharded,
    ]  # fmt: skip
    done = subprocess.run(
        argv, env=worker_env(), timeout=timeout_s, capture_output=True, cwd=out.parent
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors="replace")[-1500:]
        raise subprocess.SubprocessError(f"exit {done.returncode}: {tail}")


def _check_final(job: ChaosJob, worlds: set[int], result: inv.CheckResult) -> None:
    """The final weights against a fault-free reference run (bitwise when the world size
    never changed); a sharded job's replicas against each other too."""
    s = job.spec
    constant = len(worlds) == 1
    world = next(iter(worlds)) if constant else max(1, s.shards)
    reference = job.root / ("reference-shards" if s.shards > 1 else "reference.pt")
    try:
        run_reference(s, reference, world=world)
    except (subprocess.SubprocessError, OSError) as exc:
        result.add("final_weights", f"reference run failed: {exc}")
        if s.shards > 1:  # (the replicas can still be compared with each other)
            inv.check_shard_states(
                s.shard_out, None, shards=s.shards, constant_world=constant, result=result
            )
        return
    if s.shards > 1:
        inv.check_shard_states(
            s.shard_out, reference, shards=s.shards, constant_world=constant, result=result
        )
    else:
        inv.check_weights(job.final, reference, constant_world=constant, result=result)


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
    steps = inv.read_step_logs(job.root / "steps")
    events = inv.read_events(job.root / "runs")
    if s.launcher == "live":
        inv.check_clean_end(steps, events, result)
    if not any(c == 0 for c in job.exits.values()):
        result.add("job_completed", "no launcher exited 0")
    final = s.shard_out if s.shards > 1 else job.final
    if not final.exists():
        result.add("job_completed", "no final weights written")
    inv.check_exactly_once(
        steps, steps=s.steps, samples=s.samples, global_batch=s.global_batch, result=result
    )
    inv.check_rounds(steps, result)
    worlds = {int(r["world"]) for r in steps if "ids" in r}
    if final.exists():
        _check_final(job, worlds, result)
    corrupted = {
        int(r["step"])
        for r in records
        if r.get("kind") == "corrupt_checkpoint" and r.get("outcome") == "done"
    }
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
    # The last fault's window ends no later than the longest gap between two faults.
    gaps = [b - a for a, b in zip(sorted(done), sorted(done)[1:], strict=False)]
    st["stall_s"] = inv.stalls_after(
        inv.read_step_logs(spec.root / "steps"), done, horizon_s=max(gaps) if gaps else None
    )
    (spec.root / "check.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return result
