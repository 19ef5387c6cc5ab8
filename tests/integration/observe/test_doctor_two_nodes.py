"""flexrun doctor on two local nodes: both reported with their all-reduce bandwidth; a node
with an injected compute delay is flagged."""

from __future__ import annotations

import json

import pytest
from support import Procs, wait_for


@pytest.mark.timeout(240)
def test_doctor_reports_both_nodes_and_flags_the_slow_one(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    host, port = store_server
    common = [
        "doctor",
        "--rdzv-endpoint",
        f"{host}:{port}",
        "--rdzv-id",
        "job",
        "--nnodes",
        "2",
        "--iters",
        "3",
        "--size-mb",
        "4",
        "--join-timeout",
        "120",
    ]
    a = procs.start([*common, "--node-id", "a", "--json"], name="doc-a")
    b = procs.start([*common, "--node-id", "b", "--inject-delay", "1.0"], name="doc-b")
    wait_for(lambda: a.poll() is not None and b.poll() is not None, 200, "both doctors to finish")
    assert a.returncode == 1 and b.returncode == 1, procs.stderr("doc-a") + procs.stderr("doc-b")
    report = json.loads((procs.tmp / "doc-a.out").read_text())
    nodes = {n["node_id"]: n for n in report["nodes"]}
    assert set(nodes) == {"a", "b"} and report["flagged"] == ["b"]
    assert all(
        n["pair_gbps"] and n["bandwidth_gbps"] > 0 and n["devices"]["cpu"] > 0
        for n in nodes.values()
    )
    assert (
        nodes["b"]["compute_s"] > 1.0
        and "slower" in nodes["b"]["flags"][0]
        and nodes["a"]["flags"] == []
    )
    table = (procs.tmp / "doc-b.out").read_text()
    assert (
        "GB/s" in table and "SLOW" in table.splitlines()[2] and table.splitlines()[1].endswith("ok")
    )


@pytest.mark.timeout(120)
def test_doctor_alone_is_healthy_and_without_peers_times_out_with_one_line(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    host, port = store_server
    common = ["doctor", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", "job", "--iters", "2"]
    solo = procs.start([*common, "--nnodes", "1", "--node-id", "a", "--session", "s1"], name="solo")
    wait_for(lambda: solo.poll() is not None, 90, "the single-node doctor")
    assert solo.returncode == 0, procs.stderr("solo")
    assert "ok" in (procs.tmp / "solo.out").read_text()
    lonely = procs.start(
        [*common, "--nnodes", "2", "--node-id", "a", "--session", "s2", "--join-timeout", "1"],
        name="lonely",
    )
    wait_for(lambda: lonely.poll() is not None, 60, "the doctor to give up")
    assert lonely.returncode == 2
    err = procs.stderr("lonely").strip().splitlines()
    assert len(err) == 1 and "1 of 2 node(s)" in err[0]
