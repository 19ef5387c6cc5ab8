"""Where each kill's pause goes, from the artifacts of a ``bench/bench_goodput.py`` run.

For a flexrun launcher's directory under the bench's ``--root`` (``restart`` or ``live``),
reads the fault schedule as executed (``chaos.jsonl``), the agent's event log
(``runs/*/events.jsonl``) and the workload's step logs (``steps/``), and prints, per kill
and as median / mean / max over the kills, the stages from the last committed step before
the kill to training going on, then the start-up and the teardown. No process is started.

    python bench/goodput_timeline.py /tmp/goodput/r1/restart
    python bench/goodput_timeline.py /tmp/goodput/r1/live

Restart-mode stages (seconds; "C" is the checkpoint the next round resumed from):
  ckpt_to_kill       end of step C -> the kill (steps trained after C, all recomputed)
  kill_to_exited     the kill -> the agent's worker_exited of the victim
  exited_to_failure  -> the failure event (the agent stopping the survivors: their exit)
  failure_to_start   -> the new round's workers started (report, rendezvous, spares taken)
  start_to_resume    -> the last rank's "resume" line (adoption, init_process_group, DDP,
                        checkpoint load)
  kill_to_first_step the kill -> the first step of the new round starts
  pause              end of step C -> start of step C+1 (what the bench calls the pause)
  recompute          first step of the new round -> the step last trained before the kill
                     is done again
Live-mode stages: kill -> worker_exited, -> live_epoch (the survivors told), -> the
replacement ready, -> every rank joined the new epoch, -> the next step starts.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # (a line torn by a kill)
    return out


def _steps(root: Path) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for f in sorted((root / "steps").glob("*.jsonl")):
        recs.extend(_jsonl(f))
    return recs


def _committed(steps: list[dict[str, Any]]) -> dict[int, tuple[int, float, float]]:
    """step -> (round, earliest t0, latest ts) of its last attempt."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in steps:
        by.setdefault(r["step"], []).append(r)
    out = {}
    for s, rs in by.items():
        last_t0 = max(r["t0"] for r in rs)
        grp = [r for r in rs if last_t0 - r["t0"] < 0.05]
        out[s] = (grp[0]["round"], min(r["t0"] for r in grp), max(r["ts"] for r in grp))
    return out


def _first(ev: list[dict[str, Any]], name: str, after: float, **match: Any) -> float | None:
    for e in ev:
        if e["event"] == name and e["ts"] >= after and all(e.get(k) == v for k, v in match.items()):
            return float(e["ts"])
    return None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def restart_rows(root: Path) -> list[dict[str, Any]]:
    ev = _jsonl(next(root.glob("runs/*/events.jsonl")))
    recs = _steps(root)
    steps = [r for r in recs if "t0" in r]
    resumes = [r for r in recs if "resume" in r]
    com = _committed(steps)
    rows = []
    for k in _jsonl(root / "chaos.jsonl"):
        if k.get("kind") != "kill_worker" or k.get("outcome") != "done":
            continue
        tk = k["ts"]
        old_round = max(r["round"] for r in steps if r["ts"] < tk)
        before = [s for s, (rnd, _, ts) in com.items() if rnd == old_round and ts < tk]
        if not before:
            continue
        c = max(before)
        later = [s for s in com if s > c]
        if not later:
            continue
        nxt = min(later)
        new_round = com[nxt][0]
        last_run = max(r["step"] for r in steps if r["round"] == old_round and r["ts"] <= tk)
        redo = [r["ts"] for r in steps if r["round"] == new_round and r["step"] == last_run]
        exited = _first(ev, "worker_exited", tk - 0.01, pid=k.get("pid"))
        failure = _first(ev, "failure", tk - 0.01)
        started = _first(ev, "worker_started", tk - 0.01)
        res = [r["ts"] for r in resumes if r["round"] == new_round]
        rows.append(
            {
                "at_s": k["at_s"],
                "C": c,
                "lost_steps": last_run - c,
                "ckpt_to_kill": tk - com[c][2],
                "kill_to_exited": _minus(exited, tk),
                "exited_to_failure": _minus(failure, exited),
                "failure_to_start": _minus(started, failure),
                "start_to_resume": _minus(max(res), started) if res else None,
                "kill_to_first_step": com[nxt][1] - tk,
                "pause": com[nxt][1] - com[c][2],
                "recompute": (max(redo) - com[nxt][1]) if redo and last_run > c else 0.0,
            }
        )
    return rows


def live_rows(root: Path) -> list[dict[str, Any]]:
    ev = _jsonl(next(root.glob("runs/*/events.jsonl")))
    com = _committed([r for r in _steps(root) if "t0" in r])
    rows = []
    for k in _jsonl(root / "chaos.jsonl"):
        if k.get("kind") != "kill_worker" or k.get("outcome") != "done":
            continue
        tk = k["ts"]
        before = [s for s, (_, _, ts) in com.items() if ts < tk]
        later = [s for s in com if before and s > max(before)]
        if not later:
            continue
        c, nxt = max(before), min(later)
        joins = [e["ts"] for e in ev if e["event"] == "live_joined" and tk <= e["ts"] < tk + 5]
        rows.append(
            {
                "at_s": k["at_s"],
                "last_commit_to_kill": tk - com[c][2],
                "kill_to_exited": _minus(
                    _first(ev, "worker_exited", tk - 0.01, pid=k.get("pid")), tk
                ),
                "kill_to_epoch": _minus(_first(ev, "live_epoch", tk - 0.01), tk),
                "kill_to_spare_ready": _minus(_first(ev, "live_worker_ready", tk - 0.01), tk),
                "kill_to_all_joined": (max(joins[:2]) - tk) if joins else None,
                "kill_to_next_step": com[nxt][1] - tk,
                "pause": com[nxt][1] - com[c][2],
            }
        )
    return rows


def ends(root: Path) -> dict[str, float | None]:
    """Start-up and teardown stages, from the first event and the last step."""
    ev = _jsonl(next(root.glob("runs/*/events.jsonl")))
    recs = _steps(root)
    steps = [r for r in recs if "t0" in r]
    t_first, t_last = min(r["t0"] for r in steps), max(r["ts"] for r in steps)
    done = [r["ts"] for r in recs if r.get("done")]
    t0 = ev[0]["ts"]
    exits = [e["ts"] for e in ev if e["event"] == "worker_exited" and e["ts"] >= t_last]
    return {
        "agent_up_to_workers_started": _minus(_first(ev, "worker_started", t0), t0),
        "workers_started_to_first_step": _minus(t_first, _first(ev, "worker_started", t0)),
        "last_step_to_last_done_line": (max(done) - t_last) if done else None,
        "done_line_to_worker_exited": (max(exits) - max(done)) if exits and done else None,
        "worker_exited_to_job_finished": _minus(_first(ev, "job_finished", t_last), max(exits))
        if exits
        else None,
    }


def _fmt(v: Any) -> str:
    return f"{v:7.3f}" if isinstance(v, float) else f"{v!s:>7}"


def main() -> int:
    root = Path(sys.argv[1])
    rows = live_rows(root) if root.name.startswith("live") else restart_rows(root)
    if not rows:
        print("no kill found")
        return 1
    keys = list(rows[0])
    print(" ".join(f"{k[:18]:>18}" for k in keys))
    for r in rows:
        print(" ".join(f"{_fmt(r[k]):>18}" for k in keys))
    print(f"{'stage':22s} {'median':>7} {'mean':>7} {'max':>7}   ({len(rows)} kills)")
    for k in keys[1:]:
        vals = [float(r[k]) for r in rows if r[k] is not None]
        if vals:
            med, mean = statistics.median(vals), statistics.mean(vals)
            print(f"{k:22s} {med:7.3f} {mean:7.3f} {max(vals):7.3f}")
    print("start-up and teardown (s):")
    for k, v in ends(root).items():
        print(f"  {k:32s} {_fmt(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
