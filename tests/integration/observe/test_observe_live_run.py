"""Observability on real runs: `flexrun status` on a two-node job, and a run with a kill -9,
a scale-up and a SIGTERM whose metrics are scraped live and whose report lists exactly
those three incidents."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import (
    DDP_STEPS,
    HtmlTables,
    Procs,
    node_args,
    read_events,
    read_progress,
    scrape_metrics,
    wait_for,
)

from flexrun.observe.analysis import analyze, load_events
from flexrun.observe.metrics import AgentMetrics, EventFollower, EventMetrics
from flexrun.observe.report import LOST_PNG, REPORT_FILE, TIMELINE_PNG

TRAIN = Path(__file__).parent / "scripts" / "train_events.py"


def _flexrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args], capture_output=True, text=True, timeout=timeout
    )


def _agent(
    procs: Procs,
    store: tuple[str, int],
    name: str,
    script_args: list[str],
    script: Path,
    *extra: str,
):  # type: ignore[no-untyped-def]
    host, port = store
    return procs.start(
        [
            *node_args(f"{host}:{port}", name, procs.tmp / "runs" / name, nproc=2),
            "--stop-grace",
            "5",
            *extra,
            str(script),
            *script_args,
        ],
        name=name,
    )


@pytest.mark.timeout(240)
def test_status_shows_both_members_of_a_running_two_node_job_and_rejects_an_unknown_id(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    progress = procs.tmp / "progress.jsonl"
    args = ["--steps", "100000", "--step-time", "0.05", "--progress", str(progress)]
    a = _agent(procs, store_server, "a", args, DDP_STEPS, "--max-restarts", "0")
    b = _agent(procs, store_server, "b", args, DDP_STEPS, "--max-restarts", "0")
    wait_for(lambda: 4 in {r["world"] for r in read_progress(progress)}, 120, "a 2-node round")
    endpoint = f"{store_server[0]}:{store_server[1]}"

    res = _flexrun("status", "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["state"] == "running" and st["world_size"] == 4
    members = {m["node_id"]: m for m in st["members"]}
    assert set(members) == {"a", "b"}
    assert sorted(tuple(m["ranks"]) for m in members.values()) == [(0, 1), (2, 3)]
    assert all(m["heartbeat"] and m["addr"] for m in members.values())
    # keep-alives every 0.5 s, expiring after 3 s: status watched them for 1.2 s
    assert all(
        m["heartbeat_age_s"] is not None and m["heartbeat_age_s"] < 3 for m in members.values()
    )
    assert st["waiting"] == []

    table = _flexrun("status", "--rdzv-endpoint", endpoint, "--rdzv-id", "job")
    assert table.returncode == 0, table.stderr
    assert (
        "running" in table.stdout
        and re.search(r"\ba\b", table.stdout)
        and re.search(r"\bb\b", table.stdout)
    )

    unknown = _flexrun("status", "--rdzv-endpoint", endpoint, "--rdzv-id", "nope", "--json")
    assert unknown.returncode == 2 and unknown.stdout == ""
    lines = unknown.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nope'" in lines[0] and "job" in lines[0], unknown.stderr
    assert a.poll() is None and b.poll() is None


def _rounds_after(progress: Path, ts: float) -> dict[int, int]:
    """round -> world size, for progress lines written after ``ts``."""
    return {r["round"]: r["world"] for r in read_progress(progress) if r["ts"] > ts}


@pytest.mark.timeout(300)
def test_report_lists_exactly_a_kill_9_a_scale_up_and_a_sigterm_with_their_recovery_times(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    progress = procs.tmp / "progress.jsonl"
    stop = procs.tmp / "stop"
    args = [
        "--step-time",
        "0.05",
        "--ckpt",
        str(procs.tmp / "ckpt.pt"),
        "--ckpt-every",
        "10",
        "--progress",
        str(progress),
        "--stop-file",
        str(stop),
    ]
    a = _agent(procs, store_server, "a", args, TRAIN, "--max-restarts", "3")
    run_a = procs.tmp / "runs" / "a"
    metrics = AgentMetrics(0, host="127.0.0.1")
    follower = EventFollower(run_a, EventMetrics(metrics, node="a").observe, interval_s=0.1)
    try:
        port = metrics.start()
        follower.start()
        wait_for(lambda: read_progress(progress), 120, "training at world 2")
        wait_for(
            lambda: scrape_metrics(port).get("flexrun_world_size") == 2, 10, "metrics: world size 2"
        )
        first_round = read_progress(progress)[-1]["round"]

        # 1. kill -9 of one worker
        victim = next(
            e["pid"]
            for e in read_events(run_a)
            if e["event"] == "worker_started" and e["rank"] == 1
        )
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: any(r > first_round for r in _rounds_after(progress, t_kill)),
            90,
            "training again after the kill",
        )
        t_back1 = time.time()
        scraped = scrape_metrics(port)
        assert scraped.get('flexrun_failures_total{cause="worker_failure"}') == 1
        assert scraped.get("flexrun_workers_up") == 2

        # 2. scale-up: a second agent joins
        t_join = time.time()
        b = _agent(procs, store_server, "b", args, TRAIN, "--max-restarts", "3")
        wait_for(lambda: 4 in _rounds_after(progress, t_join).values(), 120, "training at world 4")
        t_back2 = time.time()
        wait_for(
            lambda: scrape_metrics(port).get("flexrun_world_size") == 4, 10, "metrics: world size 4"
        )

        # 3. SIGTERM to that agent (a preemption)
        t_term = time.time()
        b.send_signal(signal.SIGTERM)
        assert procs.wait(b, 60) == 143
        wait_for(
            lambda: 2 in _rounds_after(progress, t_term).values(), 90, "training at world 2 again"
        )
        t_back3 = time.time()
        wait_for(
            lambda: scrape_metrics(port).get("flexrun_world_size") == 2,
            10,
            "metrics: world size back to 2",
        )

        stop.touch()
        assert procs.wait(a, 60) == 0, procs.stderr("a")[-3000:]
        follower.close()
        final = scrape_metrics(port)
        assert final["flexrun_recovery_duration_seconds_count"] == 3
        assert final["flexrun_last_checkpoint_step"] > 0
        assert final["flexrun_train_steps_per_second"] > 0
    finally:
        follower.close()
        metrics.close()

    # The report, from the parent directory holding both agents' run directories.
    runs = procs.tmp / "runs"
    res = _flexrun("report", str(runs))
    assert res.returncode == 0, res.stderr
    analysis = analyze(load_events([runs]))
    assert [i.cause for i in analysis.incidents] == ["worker_failure", "scale_up", "preempted"]
    kill, grow, term = analysis.incidents
    assert "SIGKILL" in kill.detail and "b" in grow.detail and "SIGTERM" in term.detail
    assert (kill.world_before, kill.world_after) == (2, 2)
    assert (grow.world_before, grow.world_after) == (2, 4)
    assert (term.world_before, term.world_after) == (4, 2)
    # Each recovery ends when the new round was up everywhere: after the incident, before the
    # test saw training resume; and it equals the gap between the logged events.
    for inc, t_cause, t_seen in (
        (kill, t_kill, t_back1),
        (grow, t_join, t_back2),
        (term, t_term, t_back3),
    ):
        assert inc.duration_s is not None and inc.recovered_ts is not None
        assert t_cause - 1 <= inc.ts <= inc.recovered_ts <= t_seen
        ups = [
            e["ts"]
            for e in load_events([runs])
            if e["event"] == "rendezvous_completed" and e["round"] == inc.recovered_round
        ]
        assert inc.duration_s == pytest.approx(max(ups) - inc.ts)
    assert analysis.ettr is not None and 0 < analysis.ettr < 1
    assert analysis.productive_basis == "train_metrics"
    assert {"startup", "worker_failure", "scale_up", "preempted"} <= set(analysis.lost_by_cause())
    assert all(inc.lost_s >= inc.duration_s for inc in analysis.incidents)

    page = runs / REPORT_FILE
    parser = HtmlTables(balanced=True)
    parser.feed(page.read_text())
    parser.close()
    assert parser.stack == []
    causes = [r[2] for r in parser.rows if len(r) == 8 and r[0].isdigit()]
    assert causes == ["worker_failure", "scale_up", "preempted"]
    assert len(parser.images) == 2
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        png = base64.b64decode(src.split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for name in (TIMELINE_PNG, LOST_PNG):
        data = (runs / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
