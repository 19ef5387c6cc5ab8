"""Goodput under a stream of failures: flexrun (restart and live modes) vs torchrun, one run.

Issue 9, item 3. The same workload (``flexrun.testing.chaos_workload``, float64 MLP,
``--step-sleep`` making ~0.1 s steps, a checkpoint every ``--ckpt-every`` steps) and the
same seeded schedule (``kill_worker`` about every ``--interval`` s for ``--duration`` s,
counted from the first trained step) under:

* flexrun restart mode: one ``flexrun run`` agent (``--nnodes 1:1``) on a standalone
  ``flexrun store``, ``--nproc-per-node N``;
* flexrun live mode: the same with ``--mode live`` (LiveLoop; warm spare by default);
* torchrun ``--standalone --nproc-per-node N --max-restarts 1000`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
* ``restart+mem`` (only when named in ``--launchers``): restart mode with the checkpoint memory
  tier (issue 34): ``save()`` every step, a durable save every ``--ckpt-every`` steps
  (``Checkpointer(durable_every=...)``), so a restarted worker resumes from the agent's memory
  copy of the last step instead of the last durable checkpoint.

ETTR is computed one way for all three, from the workload's own step logs, as productive
step time over wall time. Productive step time counts step to step: each committed step
(the last attempt of each step) counts from the end of the previous committed step when
that one ran in the same round, and from its own start (earliest rank) when it is the
first of its round; it ends at its latest rank's end. So everything a training step needs
is productive, whoever does it (the script's forward/backward, DDP's or live mode's
gradient all-reduce and optimizer step, a checkpoint's stall), and what is lost is
start-up, detection and recovery, recomputed steps, and teardown. Wall time runs from
launch (the harness starting the store, or torchrun) to exit (every launcher process
gone). Also printed: ETTR(body), the same with each committed step counted only from its
own start to its end (the script's step body: this leaves out live mode's all-reduce and
optimizer step, which run between one step body and the next, and the checkpoint stalls of
all three), and ETTR(span), productive step time over the training span only (first step
to last step, no start-up or teardown), with the start-up and teardown seconds and, per
kill, the longest pause in committed steps from the last step committed before the kill to
the next kill (detection + restart + recomputation). Each run is bounded by ``--timeout``;
a run still going then counts as hung, a non-zero exit as died. After each run every
invariant of ``flexrun.testing.invariants`` is checked.

With ``--baseline`` (the default) each launcher first runs the same workload with no fault,
and ETTR is also given as issue 20 defines it: the wall time of the fault-free run over the
wall time of the run with the kills (``ETTR(#20)``; start-up and teardown are in both, so what
it measures is the time the kills cost), and the same over the training spans alone
(``span ratio``, free of the start-up's variance).

    flock -x -w 2400 /tmp/flexrun-heavy.lock timeout 1500 python3 bench/bench_goodput.py
    python3 bench/bench_goodput.py --interval 12 --jitter 0.167   # a kill every 10-14 s
    python3 bench/bench_goodput.py --interval 12 --jitter 0.167 --ckpt-every 4   # issue 20
    python3 bench/bench_goodput.py --interval 12 --jitter 0.167 \
        --launchers restart,restart+mem,live,torchrun                         # issue 34
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from flexrun.testing.chaos import JobSpec, make_schedule, run_chaos


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--duration", type=float, default=180.0)
    p.add_argument("--interval", type=float, default=15.0, help="mean seconds between kills")
    p.add_argument(
        "--jitter",
        type=float,
        default=0.3,
        help="each gap is interval x (1 +- jitter), uniform (default 0.3; --interval 12 "
        "--jitter 0.167: a kill every 10-14 s)",
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--step-sleep", type=float, default=0.09)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=420.0, help="per launcher")
    p.add_argument(
        "--launchers",
        default="restart,live,torchrun",
        help="comma-separated: restart, live, torchrun, and restart+mem (restart mode saving "
        "every step to the checkpoint memory tier, durably every --ckpt-every steps)",
    )
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each launcher with no fault first (issue 20's ETTR; default on)",
    )
    p.add_argument("--root", default=None)
    a = p.parse_args()

    root = Path(a.root or tempfile.mkdtemp(prefix="flexrun-goodput-"))
    faults = make_schedule(
        a.seed,
        duration_s=a.duration,
        interval_s=a.interval,
        kinds=("kill_worker",),
        jitter=a.jitter,
    )
    print(f"flexrun goodput bench: {os.cpu_count()} cpus, load {os.getloadavg()}, root {root}")
    print(
        f"workload: chaos_workload --steps {a.steps} --step-sleep {a.step_sleep} "
        f"--ckpt-every {a.ckpt_every}, {a.nproc} workers; schedule seed {a.seed}: "
        f"{len(faults)} worker kills at {[f.at_s for f in faults]}"
    )
    rows = []
    for launcher in a.launchers.split(","):
        mode, _, tier = launcher.partition("+")
        if (
            mode not in ("restart", "live", "torchrun")
            or tier not in ("", "mem")
            or (tier and mode != "restart")
        ):
            p.error(f"--launchers: unknown launcher {launcher!r}")
        extra = ["--durable-every", str(a.ckpt_every)] if tier else []
        spec = JobSpec(
            root=root / launcher, launcher=mode, nodes=1, max_nodes=1, nproc=a.nproc,
            steps=a.steps, step_sleep=a.step_sleep, ckpt_every=a.ckpt_every, seed=a.seed,
            extra_args=extra,
        )  # fmt: skip
        base: dict = {}
        if a.baseline:
            clean = JobSpec(
                root=root / f"{launcher}-nofault", launcher=mode, nodes=1, max_nodes=1,
                nproc=a.nproc, steps=a.steps, step_sleep=a.step_sleep, ckpt_every=a.ckpt_every,
                seed=a.seed, extra_args=extra,
            )  # fmt: skip
            res0 = run_chaos(clean, [], timeout_s=a.timeout)
            base = res0.stats
            print(
                f"  {launcher:9s} fault-free: wall {base.get('wall_s')} s, span "
                f"{base.get('span_s')} s, startup {base.get('startup_s')} s, teardown "
                f"{base.get('teardown_s')} s, violations {len(res0.violations)}, reported "
                f"failure_ettr {_reported_ettr(clean.root, 'failure_ettr')}",
                flush=True,
            )
        t0 = time.time()
        res = run_chaos(spec, faults, timeout_s=a.timeout)
        st = res.stats
        hung = any("not done" in v.detail for v in res.violations)
        died = not hung and res.failed("job_completed")
        row = {
            "launcher": launcher,
            "ettr": st.get("ettr"),
            "wall_s": st.get("wall_s"),
            "productive_s": round(st.get("productive_s", 0.0), 2),
            "productive_cycle_s": round(st.get("productive_cycle_s", 0.0), 2),
            "ettr_span": st.get("ettr_span"),
            "ettr_cycle": st.get("ettr_cycle"),
            "startup_s": st.get("startup_s"),
            "span_s": st.get("span_s"),
            "teardown_s": st.get("teardown_s"),
            "stall_s": st.get("stall_s"),
            "steps_completed": st.get("steps_committed"),
            "steps_recomputed": st.get("steps_recomputed"),
            "kills": st["faults"].get("kill_worker:done", 0),
            "kills_skipped": st["faults"].get("kill_worker:skipped", 0),
            "survived": (not res.failed("job_completed")),
            "hung": hung,
            "died": died,
            "violations": [f"{v.invariant}: {v.detail}" for v in res.violations],
            "fault_free_wall_s": base.get("wall_s"),
            "fault_free_span_s": base.get("span_s"),
            "ettr_issue20": _ratio(base.get("wall_s"), st.get("wall_s")),
            "span_ratio": _ratio(base.get("span_s"), st.get("span_s")),
            "reported_ettr": _reported_ettr(spec.root),
            "reported_failure_ettr": _reported_ettr(spec.root, "failure_ettr"),
        }
        rows.append(row)
        print(f"  {launcher:9s} done in {time.time() - t0:.0f}s: {json.dumps(row)}", flush=True)
    print()
    print(
        f"{'launcher':10s} {'ETTR':>6s} {'(body)':>6s} {'wall s':>7s} {'prod s':>7s} "
        f"{'steps':>6s} {'recomp':>6s} {'kills':>5s} {'survived':>8s} {'hung':>5s} "
        f"{'died':>5s} violations"
    )
    for r in rows:
        print(
            f"{r['launcher']:10s} {r['ettr_cycle'] or 0:6.3f} {r['ettr'] or 0:6.3f} "
            f"{r['wall_s']:7.1f} {r['productive_cycle_s']:7.1f} {r['steps_completed']!s:>6s} "
            f"{r['steps_recomputed']!s:>6s} {r['kills']:5d} {r['survived']!s:>8s} "
            f"{r['hung']!s:>5s} {r['died']!s:>5s} {len(r['violations'])}"
        )
    print()
    print("where the wall time went (s): launch->first step | training span | last step->exit")
    print(
        f"{'launcher':10s} {'startup':>7s} {'span':>7s} {'teardown':>8s} {'ETTR(span)':>10s}"
        "  per kill: longest pause in committed steps (s)"
    )
    for r in rows:
        ttp = r["stall_s"] or []
        mean = sum(ttp) / len(ttp) if ttp else float("nan")
        span = r["span_s"] or 0
        print(
            f"{r['launcher']:10s} {r['startup_s'] or 0:7.1f} {span:7.1f} "
            f"{r['teardown_s'] or 0:8.1f} {r['productive_cycle_s'] / span if span else 0:10.3f}"
            f"  mean {mean:.2f}: {ttp}"
        )
    if a.baseline:
        print()
        print("issue 20's ETTR: wall of the fault-free run / wall of the run with the kills")
        print(
            "(reported: the job's own job_finished event, torchrun has none: its ettr,"
            " productive / wall, and its failure_ettr, which compares with ETTR(#20))"
        )
        print(
            f"{'launcher':10s} {'ETTR(#20)':>9s} {'free wall':>9s} {'wall':>7s} "
            f"{'span ratio':>10s} {'free span':>9s} {'span':>7s} {'reported':>8s} "
            f"{'failure_ettr':>12s}"
        )
        for r in rows:
            rep, fail = r["reported_ettr"], r["reported_failure_ettr"]
            print(
                f"{r['launcher']:10s} {r['ettr_issue20'] or 0:9.3f} "
                f"{r['fault_free_wall_s'] or 0:9.1f} {r['wall_s']:7.1f} "
                f"{r['span_ratio'] or 0:10.3f} {r['fault_free_span_s'] or 0:9.1f} "
                f"{r['span_s'] or 0:7.1f} {'-' if rep is None else f'{rep:.3f}':>8s} "
                f"{'-' if fail is None else f'{fail:.3f}':>12s}"
            )
    for r in rows:
        for v in r["violations"]:
            print(f"violation {r['launcher']}: {v}")
    (root / "goodput.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"load after: {os.getloadavg()}")
    return 0


def _reported_ettr(root: Path, field: str = "ettr") -> float | None:
    """The ETTR the job's own ``job_finished`` event reported (one node's run directory):
    ``ettr`` (productive / wall) or ``failure_ettr`` (start-up and wrap-up not counted as
    lost: what ETTR(#20), fault-free wall / wall, measures from outside)."""
    for events in sorted(root.glob("runs/*/events.jsonl")):
        for line in events.read_text().splitlines():
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                if e.get("event") == "job_finished" and e.get(field) is not None:
                    return float(e[field])
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 4) if num and den else None


if __name__ == "__main__":
    sys.exit(main())
