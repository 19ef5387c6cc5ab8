"""Fuzz: event logs through every reader (report/analysis, the metrics follower and
:class:`EventMetrics`). An event log is outside input: anything that can write the run
directory can append any line, and logs are copied between machines.

Property: the readers skip and count what is not a usable event and never raise anything
but :class:`ConfigError` (no usable event at all); ``analyze`` of whatever survives gives
finite numbers and renders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fuzz_support import FEW, FUZZ, mangled, values
from hypothesis import given
from hypothesis import strategies as st

from flexrun.errors import ConfigError
from flexrun.observe.analysis import analyze, load_events
from flexrun.observe.metrics import AgentMetrics, EventFollower, EventMetrics
from flexrun.observe.report import plot_lost, plot_timeline, render_html

pytestmark = pytest.mark.timeout(180)


def _e(ts: float, event: str, rnd: int | None = 0, **kw: object) -> dict:
    return {"ts": ts, "event": event, "round": rnd, "run_id": "j", "node": "a", **kw}


RUN = [
    _e(100, "rendezvous_started"),
    _e(101, "rendezvous_completed", world_size=2, members=["a", "b"], duration_s=0.5),
    _e(101.5, "worker_started", rank=0),
    _e(102, "train_metrics", step=1, steps_per_s=2.0, samples_per_s=8.0),
    _e(103, "train_metrics", step=3, steps_per_s=2.0),
    _e(103.2, "checkpoint_saved", step=3),
    _e(
        103.5,
        "resources",
        cpu_ratio=0.5,
        mem_used_bytes=10,
        net_rx_bytes=1,
        net_tx_bytes=2,
        gpus=[{"index": 0, "util_ratio": 0.9, "mem_used_bytes": 5, "temp_c": 60.0}],
    ),
    _e(104, "failure", rank=1, exit_code=3, message="ValueError: x", signal=None),
    _e(104.1, "restart", 1, reason="failure"),
    _e(104.2, "store_unavailable", error="refused"),
    _e(104.3, "store_recovered"),
    _e(105, "rendezvous_completed", 1, world_size=2, members=["a", "b"]),
    _e(106, "scale_up", 2, joined=["c"], nodes=3),
    _e(106.5, "rendezvous_completed", 2, world_size=3, members=["a", "b", "c"]),
    _e(107, "train_metrics", 2, step=9, steps_per_s=3.0),
    _e(108, "job_finished", 2, exit_code=0, ettr=0.8),
]


def _hostile_log(data: st.DataObject) -> list[bytes]:
    lines = [json.dumps(e).encode() + b"\n" for e in RUN]
    for _ in range(data.draw(st.integers(1, 4), label="changes")):
        at = data.draw(st.integers(0, len(lines) - 1), label="at")
        how = data.draw(st.sampled_from(["mangle", "insert", "bytes", "delete"]), label="how")
        if how == "mangle":
            doc = RUN[at % len(RUN)]
            lines[at] = json.dumps(mangled(data, doc), allow_nan=True).encode() + b"\n"
        elif how == "insert":
            lines.insert(at, json.dumps(data.draw(values), allow_nan=True).encode() + b"\n")
        elif how == "bytes":
            lines.insert(at, data.draw(st.binary(max_size=40)).replace(b"\n", b"") + b"\n")
        elif len(lines) > 1:
            del lines[at]
    return lines


def _check(a: object) -> None:
    from flexrun.observe.analysis import RunAnalysis

    assert isinstance(a, RunAnalysis)
    assert math.isfinite(a.wall_s) and math.isfinite(a.productive_s) and a.wall_s >= 0
    assert a.ettr is None or math.isfinite(a.ettr)
    for inc in a.incidents:
        assert math.isfinite(inc.lost_s) and inc.lost_s >= 0
    assert all(math.isfinite(v) for v in a.lost_by_cause().values())
    assert "<html" in render_html(a, {})


@FUZZ
@given(data=st.data())
def test_a_hostile_event_log_is_analysed_from_its_good_lines(
    data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = tmp_path_factory.getbasetemp() / "events-run"
    run.mkdir(exist_ok=True)
    lines = _hostile_log(data)
    (run / "events.jsonl").write_bytes(b"".join(lines))
    skipped: list[int] = []
    try:
        events = load_events([run], skipped=skipped)
        a = analyze(events)
    except ConfigError as exc:
        assert "event" in str(exc)
        return
    assert 0 <= skipped[0] <= len(lines)
    _check(a)


@FUZZ
@given(data=st.data())
def test_analyze_takes_any_records_and_skips_the_unusable(data: st.DataObject) -> None:
    events = [mangled(data, e) if data.draw(st.booleans()) else e for e in RUN]
    try:
        a = analyze(events)
    except ConfigError:
        return
    _check(a)


@FEW
@given(data=st.data())
def test_the_figures_render_from_a_hostile_log(data: st.DataObject) -> None:
    events = [mangled(data, e) if data.draw(st.booleans()) else e for e in RUN]
    try:
        a = analyze(events)
    except ConfigError:
        return
    assert plot_timeline(a).startswith(b"\x89PNG") and plot_lost(a).startswith(b"\x89PNG")


@FUZZ
@given(data=st.data())
def test_the_metrics_follower_survives_any_log(
    data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run: Path = tmp_path_factory.getbasetemp() / "follow-run"
    run.mkdir(exist_ok=True)
    lines = _hostile_log(data)
    (run / "events.jsonl").write_bytes(b"".join(lines))
    metrics = AgentMetrics(None)
    follower = EventFollower(run, EventMetrics(metrics, node="a").observe)
    delivered = follower.poll()
    assert delivered + follower.skipped <= b"".join(lines).count(b"\n")
    assert follower.poll() == 0  # everything was consumed: a bad line never stalls the tail
