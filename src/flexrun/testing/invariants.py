"""The chaos invariant checker: after a job ends, did it lose, repeat or tear anything?

Owns the judgement, from evidence only: the workload's step logs
(``flexrun.testing.chaos_workload``: one line per step attempt per rank), the event logs
of every run directory, the fault log (``chaos.jsonl``), the checkpoint directory, the
final and reference weights, and the exit codes and process ids the harness recorded. It
does not run or perturb anything (``flexrun.testing.chaos`` does).

Definitions:

* An *attempt* of global step ``s`` is the set of lines for ``s`` written in one round.
  The *committed* attempt is the one whose round wrote the last line for ``s`` (the last
  log line for each step wins): a step redone after a failure replaces the earlier try.
* *Exactly once*: the committed attempts of steps ``1..S`` together hold, per data epoch,
  every sample id once (the last epoch: as many distinct ids as ``S`` steps consumed
  from it, none twice).
* *Rounds never interleave*: ordered by time, no step line carries a round lower than
  one already seen.
* *Replicas agree* (a sharded live job): every shard index's final state, as written by
  each replica group that finished, is bitwise the same in every group.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INVARIANTS = (
    "job_completed",
    "exactly_once",
    "final_weights",
    "replicas_agree",
    "checkpoints_intact",
    "rounds_never_interleave",
    "no_process_left",
)


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str


@dataclass(kw_only=True, slots=True)
class CheckResult:
    """Violations found, and figures about the run for reports."""

    violations: list[Violation] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def failed(self, invariant: str) -> bool:
        return any(v.invariant == invariant for v in self.violations)

    def add(self, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, detail))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "violations": [{"invariant": v.invariant, "detail": v.detail} for v in self.violations],
            "stats": self.stats,
        }


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Lines of a JSONL file; a torn last line (the writer was killed) is skipped."""
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_step_logs(log_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of every ``steps-*.jsonl`` under ``log_dir``."""
    recs: list[dict[str, Any]] = []
    for p in sorted(glob.glob(os.path.join(os.fspath(log_dir), "steps-*.jsonl"))):
        recs.extend(read_jsonl(p))
    return recs


def committed_attempts(records: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Step -> the lines of its committed attempt (the round of the step's last line)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if "step" in r and "ids" in r:
            by_step[int(r["step"])].append(r)
    out = {}
    for s, lines in by_step.items():
        last = max(lines, key=lambda r: r["ts"])
        out[s] = [r for r in lines if r["round"] == last["round"]]
    return out


def check_exactly_once(
    records: list[dict[str, Any]],
    *,
    steps: int,
    samples: int,
    global_batch: int,
    result: CheckResult,
) -> None:
    """Every sample of every epoch consumed once by the committed steps ``1..steps``."""
    result.checked.append("exactly_once")
    attempts = committed_attempts(records)
    missing_steps = [s for s in range(1, steps + 1) if s not in attempts]
    if missing_steps:
        result.add("exactly_once", f"steps never committed: {_short(missing_steps)}")
    extra = sorted(s for s in attempts if s > steps)
    if extra:
        result.add("exactly_once", f"steps beyond the last ({steps}): {_short(extra)}")
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for s in sorted(attempts):
        if s > steps:
            continue
        lines = attempts[s]
        worlds = {int(r["world"]) for r in lines}
        ranks = Counter(int(r["rank"]) for r in lines)
        if (
            len(worlds) != 1
            or sorted(ranks) != list(range(next(iter(worlds))))
            or max(ranks.values()) > 1
        ):
            result.add(
                "exactly_once",
                f"step {s} round {lines[0]['round']}: ranks {sorted(ranks.elements())} "
                f"at worlds {sorted(worlds)} (not one line per rank)",
            )
        for r in lines:
            per_epoch[int(r["epoch"])].update(int(i) for i in r["ids"])
    total = steps * global_batch
    for epoch in range(-(-total // samples)):
        want = min(samples, total - epoch * samples)
        got = per_epoch.pop(epoch, Counter())
        dup = sorted(i for i, n in got.items() if n > 1)
        bad = sorted(i for i in got if not 0 <= i < samples)
        if dup:
            result.add("exactly_once", f"epoch {epoch}: {len(dup)} samples twice, e.g. {dup[:8]}")
        if bad:
            result.add("exactly_once", f"epoch {epoch}: ids out of range {bad[:8]}")
        if len(got) != want:
            missing = sorted(set(range(samples)) - set(got)) if want == samples else []
            result.add(
                "exactly_once",
                f"epoch {epoch}: {len(got)} distinct samples, expected {want}"
                + (f"; missing e.g. {missing[:8]}" if missing else ""),
            )
    if per_epoch:
        result.add("exactly_once", f"samples logged for unexpected epochs {sorted(per_epoch)}")
    result.stats["steps_committed"] = len([s for s in attempts if s <= steps])


def check_rounds(records: list[dict[str, Any]], result: CheckResult) -> None:
    """Ordered by time, no step line's round is lower than one already seen."""
    result.checked.append("rounds_never_interleave")
    lines = sorted((r for r in records if "step" in r and "ids" in r), key=lambda r: r["ts"])
    high: dict[str, Any] | None = None
    bad = 0
    for r in lines:
        if high is not None and r["round"] < high["round"]:
            bad += 1
            if bad <= 3:
                result.add(
                    "rounds_never_interleave",
                    f"round {r['round']} (pid {r['pid']}) logged step {r['step']} at "
                    f"{r['ts']:.3f}, after round {high['round']} (pid {high['pid']}) logged "
                    f"step {high['step']} at {high['ts']:.3f}",
                )
        if high is None or r["round"] > high["round"]:
            high = r
    if bad > 3:
        result.add("rounds_never_interleave", f"... {bad} interleaved lines in all")
    result.stats["rounds"] = len({r["round"] for r in lines})


def attempt_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Productive step time (committed attempts only), steps attempted and recomputed."""
    attempts = committed_attempts(records)
    productive = 0.0
    for lines in attempts.values():
        productive += max(r["ts"] for r in lines) - min(r["t0"] for r in lines)
    # Step-to-step: a committed step that follows the previous committed step in the same
    # round counts from that step's end (so the framework's per-step work outside the
    # script's step body, e.g. live mode's gradient all-reduce and optimizer step, and
    # checkpoint stalls count as productive); the first step of a round counts from its own
    # start (the recovery before it is lost time).
    cycle = 0.0
    for s, lines in attempts.items():
        prev = attempts.get(s - 1)
        end = max(r["ts"] for r in lines)
        if prev is not None and prev[0]["round"] == lines[0]["round"]:
            cycle += end - max(r["ts"] for r in prev)
        else:
            cycle += end - min(r["t0"] for r in lines)
    lines = [r for r in records if "step" in r and "ids" in r]
    tried = {(r["round"], int(r["step"])) for r in lines}
    return {
        "productive_s": productive,
        "productive_cycle_s": cycle,
        "steps_attempted": len(tried),
        "steps_recomputed": len(tried) - len(attempts),
        "first_step_t0": min((r["t0"] for r in lines), default=None),
        "last_step_ts": max((r["ts"] for r in lines), default=None),
    }


def stalls_after(
    records: list[dict[str, Any]], times: Iterable[float], *, horizon_s: float | None = None
) -> list[float]:
    """For each time ``t`` (a fault), the longest pause in committed progress from the last
    step committed by ``t`` until the next time in ``times`` (or the end), and at most
    ``horizon_s`` after ``t`` when given (so the last fault's window is not the rest of the
    run: a checkpoint stall a minute later is not that fault's): detection, restart and
    recomputation together. A step counts as committed at its committed attempt's end (the
    latest ``ts`` over ranks), so a step done before ``t`` but redone after it is not
    progress before ``t``; a step already in flight at ``t`` that still commits does not
    hide the pause after it."""
    ends = sorted(max(r["ts"] for r in lines) for lines in committed_attempts(records).values())
    ts = sorted(times)
    out = []
    for i, t in enumerate(ts):
        stop = ts[i + 1] if i + 1 < len(ts) else float("inf")
        if horizon_s is not None:
            stop = min(stop, t + horizon_s)
        before = [e for e in ends if e <= t]
        points = ([before[-1]] if before else []) + [e for e in ends if t < e <= stop]
        gaps = [b - a for a, b in zip(points, points[1:], strict=False)]
        if gaps:
            out.append(round(max(gaps), 3))
    return out


def check_weights(
    final: str | os.PathLike[str],
    reference: str | os.PathLike[str],
    *,
    constant_world: bool,
    result: CheckResult,
    rtol: float = 1e-5,
) -> None:
    """Bitwise equal at a constant world size, else within ``rtol`` (norm-relative)."""
    import torch

    result.checked.append("final_weights")
    try:
        a = torch.load(final, map_location="cpu", weights_only=True)
        b = torch.load(reference, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        result.add("final_weights", f"cannot load final or reference weights: {exc}")
        return
    if set(a) != set(b):
        result.add("final_weights", f"different tensors: {sorted(set(a) ^ set(b))}")
        return
    worst = 0.0
    for k in sorted(b):
        if constant_world and not torch.equal(a[k], b[k]):
            result.add("final_weights", f"{k}: not bitwise equal to the reference (same world)")
        rel = float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30))
        worst = max(worst, rel)
    if worst > rtol:
        result.add("final_weights", f"relative difference {worst:.3g} > {rtol:g}")
    result.stats["weights_rel_diff"] = worst
    result.stats["weights_compare"] = "bitwise" if constant_world else f"rtol {rtol:g}"


def check_shard_states(
    final_dir: str | os.PathLike[str],
    reference_dir: str | os.PathLike[str] | None,
    *,
    shards: int,
    constant_world: bool,
    result: CheckResult,
    rtol: float = 1e-5,
) -> None:
    """A sharded job's final states (:mod:`flexrun.testing.shard_states`): every shard index
    written by at least one replica, its replicas bitwise equal (model and optimizer), and
    the model shards against the reference run's like :func:`check_weights`."""

    from flexrun.testing.shard_states import read_shards, same_state

    result.checked += ["replicas_agree", "final_weights"]
    got = read_shards(Path(final_dir))
    if sorted(got) != list(range(shards)):
        result.add("final_weights", f"final shards {sorted(got)}, expected 0..{shards - 1}")
        return
    for i, states in sorted(got.items()):
        differ = [n for n, st in enumerate(states[1:], 1) if not same_state(states[0], st)]
        if differ:
            result.add("replicas_agree", f"shard {i}: replicas {differ} differ from replica 0")
    result.stats["final_replicas"] = {i: len(v) for i, v in sorted(got.items())}
    if reference_dir is None:
        return
    ref = read_shards(Path(reference_dir))
    if sorted(ref) != sorted(got):
        result.add("final_weights", f"reference shards {sorted(ref)}, final {sorted(got)}")
        return
    worst = 0.0
    for i in sorted(got):
        a, b = got[i][0], ref[i][0]
        if constant_world and not same_state(a, b):
            result.add("final_weights", f"shard {i}: not bitwise equal to the reference")
        if set(a["model"]) != set(b["model"]):
            result.add("final_weights", f"shard {i}: other tensors than the reference's")
            continue
        for k, want in b["model"].items():
            rel = float((a["model"][k] - want).norm() / want.norm().clamp_min(1e-30))
            worst = float("inf") if math.isnan(rel) else max(worst, rel)
    if worst > rtol:
        result.add("final_weights", f"relative difference {worst:.3g} > {rtol:g}")
    result.stats["weights_rel_diff"] = worst
    result.stats["weights_compare"] = "bitwise" if constant_world else f"rtol {rtol:g}"


def check_checkpoints(
    ckpt_dir: str,
    *,
    corrupted: set[int],
    events: list[dict[str, Any]],
    resumes: list[dict[str, Any]],
    result: CheckResult,
) -> None:
    """``latest`` and every retained checkpoint not corrupted on purpose verify and load
    (flexrun.train's verifier and weights-only loader); no resume went back past a
    checkpoint that had been committed, unless chaos corrupted it."""
    from flexrun.errors import CheckpointError
    from flexrun.train.checkpoint import load_weights_only
    from flexrun.train.commit import list_steps, read_latest, verify_checkpoint
    from flexrun.train.dcp_io import read_safe_metadata
    from flexrun.train.storage import LocalStorage

    result.checked.append("checkpoints_intact")
    storage = LocalStorage()
    try:
        latest = read_latest(storage, ckpt_dir)
        steps = list_steps(storage, ckpt_dir)
    except CheckpointError as exc:
        result.add("checkpoints_intact", f"cannot read {ckpt_dir}: {exc}")
        return
    if latest is None:
        result.add("checkpoints_intact", f"{ckpt_dir}: no `latest` pointer")
    elif latest not in steps:
        result.add("checkpoints_intact", f"`latest` names step {latest}, which does not exist")
    for s in steps:
        if s in corrupted:
            continue
        try:
            manifest, blobs = verify_checkpoint(storage, ckpt_dir, s)
            for name, blob in blobs.items():
                if manifest.meta.get("kind") != "dcp" or name.endswith(".pt"):
                    load_weights_only(blob, what=f"step_{s}/{name}")
                elif name == ".metadata":  # (DCP's: read through flexrun's allow-list)
                    read_safe_metadata(blob, files=manifest.files)
        except CheckpointError as exc:
            result.add("checkpoints_intact", f"step_{s} (not corrupted by chaos): {exc}")
    saved = sorted(
        (e["ts"], int(e["step"])) for e in events if e.get("event") == "checkpoint_saved"
    )
    for r in resumes:
        if r.get("resume", -1) < 0:
            continue  # live mode: state comes from peers, the durable fallback is logged apart
        before = [s for ts, s in saved if ts < r["ts"] and s not in corrupted]
        if before and r["resume"] < max(before):
            result.add(
                "checkpoints_intact",
                f"pid {r['pid']} resumed at step {r['resume']} although step {max(before)} "
                "had been committed (a lost checkpoint)",
            )
    result.stats["checkpoints"] = steps
    result.stats["latest"] = latest


def check_clean_end(
    steps: list[dict[str, Any]], events: list[dict[str, Any]], result: CheckResult
) -> None:
    """Live mode: no worker fails on its own once the last step is trained (one killed by
    a signal is a fault's; one that exits with an error then is a bug, which the agents'
    exit codes do not show: the job had finished). A ``job_completed`` violation."""
    last = max((r["ts"] for r in steps if "ids" in r), default=None)
    if last is None:
        return
    for e in events:
        if e.get("event") == "failure" and e["ts"] > last and not e.get("signal"):
            result.add(
                "job_completed",
                f"{e.get('worker_id')} exited {e.get('exit_code')} after the last step: "
                f"{str(e.get('message'))[:200]}",
            )


def check_processes(pids: Iterable[int], result: CheckResult) -> None:
    """None of the processes the job ever had is still alive."""
    import psutil

    result.checked.append("no_process_left")
    left = []
    for pid in sorted(set(pids)):
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            continue
    if left:
        result.add("no_process_left", f"{len(left)} alive: {left[:5]}")


def read_events(run_root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Events of every run directory under ``run_root`` (one per agent)."""
    out: list[dict[str, Any]] = []
    for p in sorted(
        glob.glob(os.path.join(os.fspath(run_root), "**", "events.jsonl"), recursive=True)
    ):
        out.extend(read_jsonl(p))
    return out


def _short(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 10 else f"{xs[:10]} ... ({len(xs)} in all)"


__all__ = [
    "INVARIANTS",
    "CheckResult",
    "Violation",
    "attempt_stats",
    "check_checkpoints",
    "check_clean_end",
    "check_exactly_once",
    "check_processes",
    "check_rounds",
    "check_shard_states",
    "check_weights",
    "committed_attempts",
    "read_events",
    "read_jsonl",
    "read_step_logs",
    "stalls_after",
]
