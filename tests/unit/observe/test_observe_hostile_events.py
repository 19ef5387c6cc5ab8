"""Hostile event lines never crash or stall the readers (issue 18, point 9).

The metrics follower skips and counts them and goes on tailing; ``clean_event`` keeps
the event but drops a wrong-typed field; ``flexrun.events.read_events`` (the raw reader)
must skip a line that is not UTF-8 like any other undecodable line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.events import EventLog, read_events
from flexrun.observe.eventcheck import clean_event
from flexrun.observe.metrics import AgentMetrics, EventFollower, EventMetrics

HOSTILE = [
    b'{"ts": "abc", "event": "failure", "round": 0}\n',
    b'{"ts": 1.0, "event": "failure", "round": "zz"}\n',
    b'{"ts": 1.0, "event": "x\xff"}\n',
    b"[" * 100000 + b"\n",
    b"null\n",
    b'{"ts": Infinity, "event": "failure"}\n',
    b'{"ts": 1.0, "event": ["failure"]}\n',
    b'{"ts": 1.0, "event": "resources", "gpus": "many"}\n',
]


@pytest.mark.timeout(30)
def test_the_follower_skips_and_counts_hostile_lines_and_tails_on(tmp_path: Path) -> None:
    metrics = AgentMetrics(None)
    got: list[dict] = []
    em = EventMetrics(metrics, node="a")

    def sink(e: dict) -> None:
        got.append(e)
        em.observe(e)

    f = EventFollower(tmp_path, sink)
    log = EventLog(tmp_path, run_id="j", node="a")
    log.emit("rendezvous_completed", round=0, members=["a"], world_size=2)
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.writelines(HOSTILE)
    assert f.poll() == 1 and f.skipped == len(HOSTILE)
    log.emit("worker_started", round=0, rank=0)
    assert f.poll() == 1 and got[-1]["event"] == "worker_started"
    assert f.skipped == len(HOSTILE)


def test_clean_event_drops_wrong_typed_fields_but_keeps_the_event() -> None:
    e = clean_event(
        {"ts": 3, "event": "rendezvous_completed", "round": 1, "world_size": "x", "members": 5}
    )
    assert e is not None and e["ts"] == 3.0 and "world_size" not in e and "members" not in e
    assert clean_event({"ts": True, "event": "x"}) is None
    assert clean_event({"ts": 1.0, "event": "x", "round": 1.5}) is None
    assert clean_event({"ts": -1.0, "event": "x"}) is None
    # a resources sample with null counters: read as absent (the summary's defaults)
    r = clean_event({"ts": 1.0, "event": "resources", "mem_used_bytes": None, "gpus": [{}]})
    assert r is not None and "mem_used_bytes" not in r
    from flexrun.observe.resources import summarize_resources

    assert summarize_resources([r])[str(r.get("node", "?"))]["mem_max_bytes"] == 0
    assert clean_event({"ts": 1.0, "event": "resources", "gpus": [{"index": "0"}]}) is None


def test_read_events_skips_a_non_utf8_and_a_too_deep_line(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_bytes(
        b'{"ts": 1.0, "event": "a"}\n' + HOSTILE[2] + HOSTILE[3] + b'{"ts": 2.0, "event": "b"}\n'
    )
    assert [e["event"] for e in read_events(tmp_path)] == ["a", "b"]


@pytest.mark.timeout(10)
def test_status_skips_a_node_record_that_does_not_decode_and_escapes_markup() -> None:
    from rich.console import Console

    from flexrun.observe.status import read_status, render_table
    from flexrun.rendezvous.state import Keys, NodeRecord
    from flexrun.testing import FakeClock, MemoryStore

    store, keys = MemoryStore(), Keys("job")
    store.put(keys.node("a"), NodeRecord("[/bold][red]x", "[link=evil]", 1, pid=1).encode())
    store.put(keys.node("b"), b"\xff\x00 not a record")
    store.put(keys.node("c"), b'{"node_id": "c", "addr": "h", "nproc": 1e400}')
    st = read_status(store, "job", observe_s=0.0, clock=FakeClock())
    assert st.skipped_records == 2 and [n.node_id for n in st.waiting] == ["[/bold][red]x"]
    console = Console(record=True, width=200)
    console.print(render_table(st))
    text = console.export_text()
    assert "[/bold][red]x" in text and "2 node record(s) did not decode" in text


HUGE = 10**400


def test_huge_integers_are_invalid_fields_never_an_overflow(tmp_path: Path) -> None:
    assert clean_event({"ts": HUGE, "event": "x"}) is None
    assert clean_event({"ts": -HUGE, "event": "x"}) is None
    e = clean_event({"ts": 2, "event": "progress", "steps_per_s": HUGE, "step": HUGE, "rank": 0})
    assert e is not None and "steps_per_s" not in e and "step" not in e and e["rank"] == 0
    assert clean_event({"ts": 1.0, "event": "resources", "mem_used_bytes": HUGE}) is None
    assert clean_event({"ts": 1.0, "event": "resources", "gpus": [{"temp_c": HUGE}]}) is None
    # the metrics follower (`flexrun run --metrics-port`) reads the same lines
    got: list[dict] = []
    f = EventFollower(tmp_path, got.append)
    (tmp_path / "events.jsonl").write_text(
        f'{{"ts": {HUGE}, "event": "x"}}\n'
        f'{{"ts": 1.0, "event": "resources", "mem_used_bytes": {HUGE}}}\n'
        f'{{"ts": 1.0, "event": "progress", "steps_per_s": {HUGE}}}\n'
    )
    assert f.poll() == 1 and f.skipped == 2 and "steps_per_s" not in got[0]
