"""Prometheus metrics: names, HTTP scrape on loopback, events -> metrics, tailing the log."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
from support import scrape_metrics

from flexrun.errors import ConfigError
from flexrun.events import EventLog
from flexrun.observe.metrics import AgentMetrics, EventFollower, EventMetrics, serve_run_metrics
from flexrun.testing import FakeClock


def ev(event: str, ts: float, round: int | None = None, node: str = "a", **kw: object) -> dict:
    return {"ts": ts, "event": event, "run_id": "job", "node": node, "round": round, **kw}


RUN = [
    ev("node_joined", 0.0, node_id="a"),
    ev("rendezvous_started", 1.0, 1),
    ev("rendezvous_completed", 1.5, 1, members=["a"], world_size=2, duration_s=0.5),
    ev("worker_started", 1.5, 1, rank=0, pid=10),
    ev("worker_started", 1.5, 1, rank=1, pid=11),
    ev("train_metrics", 3.0, 1, rank=0, step=10, steps_per_s=5.0, samples_per_s=80.0),
    ev("checkpoint_saved", 4.0, 1, rank=0, step=10, bytes=100),
    ev("worker_exited", 5.0, 1, rank=1, exit_code=137, signal="SIGKILL"),
    ev("worker_exited", 5.0, 1, rank=0, exit_code=1, signal=None),
    ev("failure", 5.0, 1, rank=1, exit_code=137, signal="SIGKILL"),
    ev("restart", 5.0, 2, reason="failure", restarts=1),
    ev("rendezvous_started", 5.1, 2),
    ev("rendezvous_completed", 7.0, 2, members=["a"], world_size=2, duration_s=1.9),
    ev("worker_started", 7.0, 2, rank=0, pid=12),
    ev("worker_started", 7.0, 2, rank=1, pid=13),
    # a scale-up proposed by the joining node: this node only logs its restart
    ev("restart", 10.0, 3, reason="scale_up"),
    ev("rendezvous_started", 10.0, 3),
    ev("rendezvous_completed", 13.0, 3, members=["a", "b"], world_size=4, duration_s=3.0),
    ev("worker_started", 13.0, 3, rank=0, pid=14),
    ev("worker_started", 13.0, 3, rank=1, pid=15),
    ev("rendezvous_completed", 13.0, 3, node="b", members=["a", "b"], world_size=4),
]


@pytest.mark.timeout(30)
def test_metrics_follow_rounds_failures_recoveries_and_throughput_over_http() -> None:
    clock = FakeClock()
    m = AgentMetrics(0, host="127.0.0.1", clock=clock)
    port = m.start()
    try:
        assert math.isnan(scrape_metrics(port)["flexrun_last_checkpoint_age_seconds"])
        em = EventMetrics(m, node="a")
        for e in RUN:
            e = dict(e, ts=e["ts"] + clock.wall() - 20)  # the run happened 20 s ago
            em.observe(e)
        s = scrape_metrics(port)
    finally:
        m.close()
    assert (s["flexrun_world_size"], s["flexrun_nodes"], s["flexrun_round"]) == (4, 2, 3)
    assert s["flexrun_workers_up"] == 2
    assert s['flexrun_failures_total{cause="worker_failure"}'] == 1
    assert s['flexrun_restarts_total{reason="failure"}'] == 1
    assert s['flexrun_restarts_total{reason="scale_up"}'] == 1
    assert s["flexrun_recovery_duration_seconds_count"] == 2
    assert s["flexrun_recovery_duration_seconds_sum"] == pytest.approx(2.0 + 3.0)
    assert s["flexrun_last_recovery_duration_seconds"] == pytest.approx(3.0)
    assert s['flexrun_recovery_duration_seconds_bucket{le="2.0"}'] == 1
    assert s["flexrun_train_steps_per_second"] == 5 and s["flexrun_train_samples_per_second"] == 80
    assert s["flexrun_last_checkpoint_step"] == 10
    assert s["flexrun_last_checkpoint_age_seconds"] == pytest.approx(16.0)
    assert s['flexrun_events_total{event="worker_started"}'] == 6
    assert s["flexrun_rendezvous_duration_seconds_count"] == 3  # node b's round is not ours


@pytest.mark.timeout(30)
def test_both_ettrs_of_the_nodes_job_finished_are_gauges() -> None:
    m = AgentMetrics(0, host="127.0.0.1")
    port = m.start()
    try:
        em = EventMetrics(m, node="a")
        em.observe(ev("job_finished", 9.0, 1, node="b", ettr=0.1, failure_ettr=0.2))  # not ours
        before = scrape_metrics(port)
        em.observe(ev("job_finished", 10.0, 1, exit_code=0, ettr=0.7, failure_ettr=0.8))
        after = scrape_metrics(port)
    finally:
        m.close()
    assert before["flexrun_ettr_ratio"] == 0 and before["flexrun_failure_ettr_ratio"] == 0
    assert (after["flexrun_ettr_ratio"], after["flexrun_failure_ettr_ratio"]) == (0.7, 0.8)


@pytest.mark.timeout(30)
def test_metric_names_follow_prometheus_conventions() -> None:
    m = AgentMetrics(run_id="job", node="a")
    m.on_failure("hang")
    m.on_restart("failure")
    m.on_recovery(1.0)
    text = m.render().decode()
    types = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE")}
    assert all(n.startswith("flexrun_") for n in types)
    counters = [n for n, t in types.items() if t == "counter"]
    assert counters and all(n.endswith("_total") for n in counters)
    assert 'flexrun_failures_total{cause="hang"} 1.0' in text
    assert 'flexrun_agent_info{job="job",node="a"} 1.0' in text
    assert types["flexrun_recovery_duration_seconds"] == "histogram"
    assert types["flexrun_last_checkpoint_age_seconds"] == "gauge"


@pytest.mark.timeout(30)
def test_a_port_in_use_is_a_config_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        m = AgentMetrics(s.getsockname()[1], host="127.0.0.1")
        with pytest.raises(ConfigError, match="metrics-port"):
            m.start()
    with pytest.raises(ConfigError):
        AgentMetrics(70000)


@pytest.mark.timeout(30)
def test_the_follower_delivers_complete_lines_once_and_waits_for_partial_ones(
    tmp_path: Path,
) -> None:
    got: list[dict] = []
    f = EventFollower(tmp_path, got.append)
    assert f.poll() == 0  # no file yet
    log = EventLog(tmp_path, run_id="job", node="a")
    log.emit("node_joined")
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'{"ts": 1, "event": "fail')  # a writer mid-line
    assert f.poll() == 1 and got[-1]["event"] == "node_joined"
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'ure"}\n')
    assert f.poll() == 1 and got[-1]["event"] == "failure"
    assert f.poll() == 0


@pytest.mark.timeout(30)
def test_serve_run_metrics_exports_the_run_and_the_node(tmp_path: Path) -> None:
    log = EventLog(tmp_path, run_id="job", node="a")
    log.emit("rendezvous_completed", round=1, members=["a"], world_size=2, duration_s=0.1)
    metrics, follower = serve_run_metrics(tmp_path, 0, node="a", host="127.0.0.1")
    try:
        s = scrape_metrics(int(metrics.port or 0))
        assert s["flexrun_world_size"] == 2
        assert s["flexrun_node_memory_total_bytes"] > 0 and s["flexrun_node_cpus"] >= 1
        assert any(k.startswith("flexrun_node_disk_used_bytes{") for k in s)
        log.emit("rendezvous_completed", round=2, members=["a", "b"], world_size=4, duration_s=0.1)
        follower.poll()
        assert scrape_metrics(int(metrics.port or 0))["flexrun_world_size"] == 4
    finally:
        follower.close()
        metrics.close()
