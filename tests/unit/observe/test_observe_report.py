"""flexrun report: merging logs, grouping incidents, time lost, ETTR, and the HTML page."""

from __future__ import annotations

import base64
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest

from flexrun.cli import main
from flexrun.errors import ConfigError
from flexrun.observe.analysis import analyze, find_event_files, load_events
from flexrun.observe.report import (
    LOST_PNG,
    REPORT_FILE,
    TIMELINE_PNG,
    throughput_segments,
    write_report,
)


def ev(event: str, ts: float, round: int | None = None, node: str = "a", **kw: object) -> dict:
    return {"ts": 1000.0 + ts, "event": event, "run_id": "job", "node": node, "round": round, **kw}


def up(ts: float, rnd: int, members: list[str], world: int) -> list[dict]:
    return [
        ev("rendezvous_completed", ts, rnd, node=n, members=members, world_size=world)
        for n in members
    ]


def steps(t0: float, t1: float, rnd: int) -> list[dict]:
    out, t = [], t0
    while t <= t1 + 1e-9:
        out.append(ev("train_metrics", t, rnd, rank=0, step=int(t), steps_per_s=10.0))
        t += 1.0
    return out


# a at 2 workers; kill -9 at 10; b joins at 20 (b proposes the scale-up); b SIGTERMed at 30.
RUN = [
    ev("node_joined", 0, node_id="a"),
    *up(1, 1, ["a"], 2),
    *steps(2, 9, 1),
    ev("failure", 10, 1, rank=1, exit_code=137, signal="SIGKILL", message="killed by SIGKILL"),
    ev("restart", 10, 2, reason="failure", restarts=1),
    *up(11, 2, ["a"], 2),
    *steps(13, 19, 2),
    ev("node_joined", 19.5, node="b", node_id="b"),
    ev("scale_up", 20.1, 3, node="b", joined=["b"], nodes=2),
    ev("restart", 20, 3, reason="scale_up"),
    *up(22, 3, ["a", "b"], 4),
    *steps(25, 29, 3),
    ev("checkpoint_saved", 27, 3, rank=0, step=27, bytes=10),
    ev("preempted", 30, 3, node="b", signal="SIGTERM"),
    ev("job_finished", 30.2, 3, node="b", exit_code=143, ettr=0.9),
    ev("node_left", 30.3, 4, node_id="b"),
    ev("scale_down", 30.3, 4, nodes=1),
    ev("restart", 30.3, 4, reason="node_left"),
    *up(31, 4, ["a"], 2),
    *steps(33, 39, 4),
    ev(
        "job_finished",
        40,
        4,
        exit_code=0,
        wall_s=40,
        productive_s=30,
        ettr=0.75,
        failure_ettr=0.8125,
    ),
]


def write_logs(root: Path, events: list[dict]) -> None:
    for node in {e["node"] for e in events}:
        d = root / node
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "events.jsonl", "w") as fh:
            for e in events:
                if e["node"] == node:
                    fh.write(json.dumps(e) + "\n")


@pytest.mark.timeout(30)
def test_incidents_are_one_per_interruption_with_cause_recovery_and_time_lost() -> None:
    a = analyze(RUN)
    assert [i.cause for i in a.incidents] == ["worker_failure", "scale_up", "preempted"]
    kill, grow, term = a.incidents
    assert kill.detail.startswith("rank 1 on a killed by SIGKILL")
    assert (kill.ts, kill.recovered_ts, kill.duration_s) == (1010, 1011, 1)
    assert kill.lost_s == pytest.approx(2.0)  # the report at 13 covers steps from 12 (1 s windows)
    # the restart logged by a (t=20) starts the incident; b's scale_up names its cause
    assert (grow.ts, grow.duration_s, grow.node, grow.world_before, grow.world_after) == (
        1020,
        2,
        "b",
        2,
        4,
    )
    assert "b joined" in grow.detail and set(grow.events) == {"restart", "scale_up"}
    assert (term.ts, term.duration_s, term.recovered_round) == (1030, 1, 4)
    assert set(term.events) == {"preempted", "node_left", "scale_down", "restart"}
    assert a.productive_basis == "train_metrics"
    assert a.productive_s == pytest.approx(8 + 7 + 5 + 7)  # four rounds of reports + windows
    assert a.wall_s == 40 and a.ettr == pytest.approx(27 / 40)
    lost = a.lost_by_cause()
    assert lost["startup"] == pytest.approx(1.0) and lost["worker_failure"] == pytest.approx(2.0)
    assert lost["scale_up"] == pytest.approx(4.0) and lost["preempted"] == pytest.approx(2.0)
    assert a.node_finish["a"]["exit_code"] == 0 and a.node_finish["b"]["exit_code"] == 143
    assert [c["step"] for c in a.checkpoints] == [27]


@pytest.mark.timeout(30)
def test_a_lost_node_and_a_peer_failure_in_the_same_round_are_one_incident() -> None:
    events = [
        *up(1, 1, ["a", "b"], 4),
        *steps(2, 9, 1),
        ev(
            "failure",
            10.5,
            1,
            node="b",
            rank=2,
            exit_code=1,
            message="RuntimeError: Connection reset",
        ),
        ev("node_lost", 10, 2, node_id="c"),
        ev("scale_down", 10, 2, nodes=2),
        *up(12, 2, ["a", "b"], 4),
        *steps(13, 15, 2),
    ]
    (inc,) = analyze(events).incidents
    assert (
        inc.cause == "node_lost" and inc.duration_s == 2 and "c stopped heart-beating" in inc.detail
    )


@pytest.mark.timeout(30)
def test_an_unrecovered_failure_loses_the_rest_of_the_run_and_outages_lose_nothing() -> None:
    events = [
        *up(1, 1, ["a"], 2),
        ev("store_unavailable", 3, 1, error="refused", workers_running=True),
        ev("store_recovered", 5, 1, down_s=2),
        ev("failure", 8, 1, rank=0, exit_code=2, message="ValueError: bad"),
        ev("job_finished", 9, 1, exit_code=2),
    ]
    a = analyze(events)
    outage, fail = a.incidents
    assert (outage.cause, outage.duration_s) == ("store_outage", 2)
    assert fail.cause == "worker_failure" and fail.duration_s is None and fail.lost_s == 1
    assert "ValueError: bad" in fail.detail
    # no train_metrics: productive time is worker uptime (round up at 1 until the failure)
    assert a.productive_basis == "worker_uptime" and a.productive_s == 7
    assert "store_outage" not in a.lost_by_cause()


@pytest.mark.timeout(60)
def test_report_merges_per_node_dirs_and_writes_a_self_contained_page(tmp_path: Path) -> None:
    write_logs(tmp_path / "runs", RUN)
    (tmp_path / "runs" / "a" / "events.jsonl").open("a").write('{"ts": 1, "event": "tru')  # torn
    assert len(find_event_files([tmp_path / "runs"])) == 2
    assert len(load_events([tmp_path / "runs", tmp_path / "runs" / "a"])) == len(RUN)
    page = write_report([tmp_path / "runs"])
    assert page == tmp_path / "runs" / REPORT_FILE
    text = page.read_text()

    class P(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.imgs: list[str] = []
            self.cells: list[str] = []
            self.in_td = False

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "img":
                self.imgs.append(dict(attrs)["src"] or "")
            self.in_td = tag == "td"

        def handle_data(self, data: str) -> None:
            if self.in_td:
                self.cells.append(data)

    p = P()
    p.feed(text)
    assert len(p.imgs) == 2 and all(s.startswith("data:image/png;base64,") for s in p.imgs)
    assert all(base64.b64decode(s.split(",", 1)[1])[:4] == b"\x89PNG" for s in p.imgs)
    for cause in ("worker_failure", "scale_up", "preempted"):
        assert cause in p.cells
    assert "67.5%" in text  # ETTR
    assert "failure ETTR (agent)" in text and "0.8125" in p.cells  # node a's job_finished
    assert "http" not in text.replace("http-equiv", "")  # nothing fetched from the network
    for name in (TIMELINE_PNG, LOST_PNG):
        assert (tmp_path / "runs" / name).stat().st_size > 10_000


@pytest.mark.timeout(60)
def test_report_cli_writes_to_output_and_rejects_missing_or_empty_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_logs(tmp_path / "runs", RUN)
    assert main(["report", str(tmp_path / "runs"), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / REPORT_FILE).exists()
    assert main(["report", str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no such file" in err[0] and "no events.jsonl" in err[1]
    with pytest.raises(ConfigError, match="empty"):
        analyze([])


def test_throughput_line_breaks_at_incidents_and_silences() -> None:
    pts = [(0.0, 10.0), (1.0, 11.0), (2.0, 9.0), (3.0, 10.0), (30.0, 12.0), (31.0, 12.0)]
    line = throughput_segments(pts, breaks=[1.5])
    nans = [t for t, v in line if math.isnan(v)]
    assert nans == [1.5, 16.5]  # the incident at 1.5 s, and the 27 s silence
    assert [p for p in line if not math.isnan(p[1])] == pts
    assert throughput_segments(pts[:4], breaks=[]) == pts[:4]
    assert throughput_segments(pts[:1], breaks=[0.5]) == pts[:1]
