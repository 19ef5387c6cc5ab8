"""Preempting one of two nodes (SIGTERM to its agent) on a shared `flexrun store`.

The ranks agree on the stop and save; the preempted node leaves the rendezvous as soon as
its first worker is gone; the survivor's agent does not count its workers' agreed exit
(143) as a failure and re-forms alone at once, however long the preempted node's last
worker takes to go.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest
from support import Procs, node_args, read_events, wait_for

from flexrun.testing import chaos_workload

LINGER_S = 6.0


def _steps(log_dir) -> list[dict]:  # type: ignore[no-untyped-def]
    out = []
    for f in sorted(log_dir.glob("steps-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if "step" in rec and "t0" in rec:
                    out.append(rec)
    return out


def _agent(procs: Procs, store: tuple[str, int], name: str, nproc: int):  # type: ignore[no-untyped-def]
    host, port = store
    return procs.start(
        [
            *node_args(f"{host}:{port}", name, procs.tmp / f"run-{name}", nproc=nproc),
            "--max-restarts",
            "0",  # a survivor counting the agreed stop as a failure would end the job
            "--mode",
            "restart",
            "--stop-grace",
            str(LINGER_S + 10),
            chaos_workload.__file__,
            "--steps",
            "100000",
            "--step-sleep",
            "0.05",
            "--ckpt-dir",
            str(procs.tmp / "ckpt"),
            "--log-dir",
            str(procs.tmp / "steps"),
            "--linger-on-preempt",
            str(LINGER_S),
        ],
        name=name,
    )


@pytest.mark.timeout(300)
def test_preempting_one_node_lets_the_survivor_re_form_without_counting_a_failure(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    steps = procs.tmp / "steps"
    a = _agent(procs, store_server, "a", 2)
    b = _agent(procs, store_server, "b", 1)
    wait_for(lambda: any(s["world"] == 3 for s in _steps(steps)), 120, "a 2-node round (world 3)")
    t_term = time.time()
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=60) == 143, procs.stderr("a")[-2000:]
    ev_a = read_events(procs.tmp / "run-a")
    finished_a = next(e["ts"] for e in ev_a if e["event"] == "job_finished")
    ev_all = ev_a + read_events(procs.tmp / "run-b")
    stopped = [e for e in ev_all if e["event"] == "preempted" and "step" in e]
    assert stopped, "the ranks did not agree on a preemption stop"

    def alone() -> list[dict]:
        return [
            e
            for e in read_events(procs.tmp / "run-b")
            if e["event"] == "rendezvous_completed" and e["members"] == ["b"]
        ]

    wait_for(lambda: alone(), 60, "the survivor to re-form alone")
    wait_for(
        lambda: any(s["world"] == 1 and s["t0"] > finished_a for s in _steps(steps)),
        90,
        "the survivor to train alone",
    )
    assert b.poll() is None, procs.stderr("b")[-2000:]
    ev_b = read_events(procs.tmp / "run-b")
    # (A survivor whose own worker was still finishing the agreed step when the new round
    # formed restarts it for reason node_left, as a loaded machine makes likely: that is no
    # failure. A failure is a `failure` event or a restart for one, after the SIGTERM: the
    # scale_up restart when a joined b's first round alone is the job's start.)
    failures = [
        e
        for e in ev_b
        if e["ts"] >= t_term
        and (
            e["event"] == "failure" or (e["event"] == "restart" and e.get("reason") != "node_left")
        )
    ]
    assert failures == [], f"the agreed stop was counted as a failure: {failures}"
    # The preempted node left as soon as its first worker was gone: the survivor's new
    # round formed while the other (lingering) worker was still exiting.
    assert alone()[0]["ts"] < finished_a, (alone()[0]["ts"], finished_a)
    print(
        f"survivor re-formed {finished_a - alone()[0]['ts']:.2f}s before a finished",
        file=sys.stderr,
    )
