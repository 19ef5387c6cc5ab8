"""From the event logs of a run to a :class:`RunAnalysis`: incidents, productive time,
ETTR, time lost per cause, the world-size and throughput timeline.

Owns merging event logs (one per node, possibly in separate run directories) and reading
them as a history of the run; rendering it is :mod:`flexrun.observe.report`'s. It does
not emit events and does not read the store.

Incidents. Every event that interrupts training (``failure``, ``preempted``,
``hang_detected``, ``node_lost``, ``node_left``, ``scale_down``, ``scale_up``) is a
trigger. Triggers are grouped by the round that ended the interruption (the first round
whose workers started after the round they interrupted), so one kill -9 that makes every
node re-form is one incident, and a preempted node's departure seen by the survivors
(``node_left`` + ``scale_down``) belongs to its ``preempted`` incident. The cause is the
earliest trigger's; the recovery duration runs from it until the last node of the new
round has started its workers. A store outage (``store_unavailable`` ->
``store_recovered``) is an incident that interrupts no training.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrun.errors import ConfigError
from flexrun.events import EVENTS_FILE
from flexrun.observe.eventcheck import clean_event
from flexrun.observe.metrics import failure_cause, restart_cause

_RUNNING_ROUND_TRIGGERS = frozenset({"failure", "preempted", "hang_detected"})
_NEW_ROUND_TRIGGERS = frozenset({"node_lost", "node_left", "scale_down", "scale_up"})


@dataclass(slots=True)
class Incident:
    cause: str
    ts: float
    node: str
    detail: str
    interrupted_round: int | None
    recovered_round: int | None = None
    recovered_ts: float | None = None
    world_before: int | None = None
    world_after: int | None = None
    direct: bool = True
    """Caused by a logged trigger, not only inferred from a node's restart."""
    resumed_ts: float | None = None
    """When training steps were reported again (None without ``train_metrics`` events)."""
    lost_s: float = 0.0
    """Training time lost: until steps resumed (or, without step reports, until recovered;
    until the end of the run if it never recovered)."""
    events: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float | None:
        return None if self.recovered_ts is None else max(self.recovered_ts - self.ts, 0.0)


@dataclass(slots=True)
class RunAnalysis:
    run_ids: list[str]
    nodes: list[str]
    start_ts: float
    end_ts: float
    productive_s: float
    startup_s: float
    incidents: list[Incident]
    rounds: dict[int, dict[str, Any]]
    """round -> {ts (all workers up), world_size, members, reason}."""
    throughput: list[tuple[float, float]]
    """(ts, steps/s) from ``train_metrics`` events."""
    marks: list[tuple[float, str, str]]
    """(ts, kind, label): failures, restarts, joins, checkpoints, preemptions."""
    node_finish: dict[str, dict[str, Any]]
    """node -> its ``job_finished`` fields (exit code, its own ETTR)."""
    checkpoints: list[dict[str, Any]]
    resources: dict[str, dict[str, Any]]
    skipped_events: int = 0
    """Records that were not usable events (malformed fields), left out of the analysis."""
    productive_basis: str = "train_metrics"
    """What productive time was measured from: ``train_metrics`` (steps reported by rank
    0) or ``worker_uptime`` (rounds up, when the script reports no steps)."""

    @property
    def wall_s(self) -> float:
        return max(self.end_ts - self.start_ts, 0.0)

    @property
    def ettr(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def lost_by_cause(self) -> dict[str, float]:
        lost: dict[str, float] = {}
        if self.startup_s > 0:
            lost["startup"] = self.startup_s
        for inc in self.incidents:
            if inc.cause == "store_outage":
                continue  # training went on
            lost[inc.cause] = lost.get(inc.cause, 0.0) + inc.lost_s
        other = self.wall_s - self.productive_s - sum(lost.values())
        if other > 0.05 * max(self.wall_s, 1e-9):
            lost["other (idle, shutdown)"] = other
        return lost


# -- loading ------------------------------------------------------------------------------
def find_event_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Event logs under ``paths``: files as given, directories searched recursively.

    Raises:
        ConfigError: a path does not exist or holds no event log.
    """
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            files = sorted(q for q in p.rglob(EVENTS_FILE) if q.is_file())
            if not files:
                raise ConfigError(f"{p}: no {EVENTS_FILE} in this directory or below it")
            found.extend(files)
        else:
            raise ConfigError(f"{p}: no such file or directory (pass a run directory)")
    unique: dict[Path, Path] = {}
    for f in found:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def load_events(
    paths: Sequence[str | os.PathLike[str]], *, skipped: list[int] | None = None
) -> list[dict[str, Any]]:
    """Every event of every log under ``paths``, merged by timestamp, exact duplicates once.

    Lines that are not usable events (not JSON, not UTF-8, a ``ts`` that is not a number,
    a ``round`` that is not an integer: :func:`~flexrun.observe.eventcheck.clean_event`)
    are skipped; their number is appended to ``skipped`` when given.
    """
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    bad = 0
    for f in find_event_files(paths):
        for raw in _event_lines(f):
            if not raw.strip():
                continue  # an empty line is no event, and no damage either
            e = _parse_line(raw)
            if e is None:
                bad += 1
                continue
            key = json.dumps(e, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                out.append(e)
    out.sort(key=lambda e: e["ts"])
    if skipped is not None:
        skipped.append(bad)
    return out


def _event_lines(f: Path) -> Iterator[bytes]:
    """The complete lines of ``f``, streamed (a torn last line: not yet written)."""
    try:
        with f.open("rb") as fh:
            for raw in fh:
                if raw.endswith(b"\n"):
                    yield raw
    except OSError as exc:
        raise ConfigError(f"{f}: cannot read the event log ({exc.strerror})") from exc


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    try:
        return clean_event(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


# -- analysis -----------------------------------------------------------------------------
def _detail(e: Mapping[str, Any]) -> str:
    kind = e.get("event")
    if kind == "failure":
        how = f"killed by {e['signal']}" if e.get("signal") else f"exit code {e.get('exit_code')}"
        msg = str(e.get("message") or "").strip().splitlines()
        tail = f": {msg[-1][:160]}" if msg and msg[-1] != f"killed by {e.get('signal')}" else ""
        return f"rank {e.get('rank')} on {e.get('node')} {how}{tail}"
    if kind == "preempted":
        return f"agent {e.get('node')} received {e.get('signal') or 'a signal'}"
    if kind in ("node_lost", "node_left"):
        return (
            f"node {e.get('node_id')} {'stopped heart-beating' if kind == 'node_lost' else 'left'}"
        )
    if kind == "scale_up":
        return f"{', '.join(e.get('joined') or []) or 'a node'} joined ({e.get('nodes')} nodes)"
    if kind == "scale_down":
        return f"down to {e.get('nodes')} nodes"
    if kind == "hang_detected":
        return f"rank {e.get('rank')} on {e.get('node')} made no progress"
    if kind == "store_unavailable":
        return f"store unreachable from {e.get('node')}: {str(e.get('error') or '')[:120]}"
    return str(kind)


def analyze(events: Sequence[Mapping[str, Any]]) -> RunAnalysis:
    """Turn merged, time-ordered events into incidents, rounds, timeline and ETTR."""
    if not events:
        raise ConfigError("the event log is empty: nothing to report")
    from flexrun.observe.resources import summarize_resources

    usable = [c for c in (clean_event(e) for e in events) if c is not None]
    skipped = len(events) - len(usable)
    if not usable:
        raise ConfigError(f"the event log has no usable event ({skipped} malformed)")
    events = sorted(usable, key=lambda e: e["ts"])
    start_ts = float(events[0]["ts"])
    finishes = [e for e in events if e["event"] == "job_finished"]
    end_ts = float(finishes[-1]["ts"]) if finishes else float(events[-1]["ts"])

    rounds: dict[int, dict[str, Any]] = {}
    starting: dict[int, float] = {}
    for e in events:
        r = e.get("round")
        if r is None:
            continue
        if e["event"] == "rendezvous_completed":
            info = rounds.setdefault(int(r), {"ts": float(e["ts"]), "world_size": 0, "members": []})
            info["ts"] = max(info["ts"], float(e["ts"]))  # the round is up once every node is
            info["first_ts"] = min(info.get("first_ts", float(e["ts"])), float(e["ts"]))
            info["world_size"] = int(e.get("world_size") or 0)
            info["members"] = list(e.get("members") or [])
            info["reason"] = e.get("reason", "")
        elif e["event"] == "rendezvous_started":
            starting[int(r)] = min(starting.get(int(r), float(e["ts"])), float(e["ts"]))
    round_numbers = sorted(rounds)

    def recovery_round(after: int | None) -> int | None:
        for n in round_numbers:
            if after is None or n > after:
                return n
        return None

    incidents: dict[Any, Incident] = {}
    outages: list[Incident] = []
    open_outage: dict[str, Incident] = {}
    for e in events:
        kind = e["event"]
        ts = float(e["ts"])
        if kind == "store_unavailable":
            inc = Incident("store_outage", ts, str(e.get("node")), _detail(e), e.get("round"))
            open_outage.setdefault(str(e.get("node")), inc)
            continue
        if kind == "store_recovered" and str(e.get("node")) in open_outage:
            inc = open_outage.pop(str(e.get("node")))
            inc.recovered_ts = ts
            outages.append(inc)
            continue
        direct = kind in _RUNNING_ROUND_TRIGGERS or kind in _NEW_ROUND_TRIGGERS
        if not direct and kind != "restart":
            continue
        r = e.get("round")
        if kind in _RUNNING_ROUND_TRIGGERS:
            after = None if r is None else int(r)
        else:
            after = None if r is None else int(r) - 1
        target = recovery_round(after)
        key: Any = ("round", target) if target is not None else ("open", after)
        cause = failure_cause(e) if direct else restart_cause(str(e.get("reason") or ""))
        detail = _detail(e) if direct else f"restart ({e.get('reason')})"
        found = incidents.get(key)
        if found is None:
            inc = Incident(cause, ts, str(e.get("node")), detail, after, direct=direct)
            inc.recovered_round = target
            if target is not None:
                inc.recovered_ts = rounds[target]["ts"]
                inc.world_after = rounds[target]["world_size"]
            if after is not None and after in rounds:
                inc.world_before = rounds[after]["world_size"]
            incidents[key] = inc
        else:
            inc = found
            if direct and not inc.direct:
                # A node's restart (every node logs one) names the reason; the event that
                # caused it, logged by one node, names the cause: prefer it.
                inc.cause, inc.detail, inc.node, inc.direct = (
                    cause,
                    detail,
                    str(e.get("node")),
                    True,
                )
        inc.events.append(kind)
    outages.extend(open_outage.values())
    all_incidents = sorted([*incidents.values(), *outages], key=lambda i: i.ts)

    productive, startup, basis = _productive(
        events, rounds, starting, all_incidents, start_ts, end_ts
    )

    marks: list[tuple[float, str, str]] = []
    throughput: list[tuple[float, float]] = []
    checkpoints: list[dict[str, Any]] = []
    for e in events:
        kind, ts = e["event"], float(e["ts"])
        if kind == "failure":
            marks.append((ts, "failure", _detail(e)))
        elif kind == "restart":
            marks.append((ts, "restart", f"restart ({e.get('reason')})"))
        elif kind == "node_joined":
            marks.append((ts, "join", f"{e.get('node_id') or e.get('node')} joined"))
        elif kind == "checkpoint_saved":
            marks.append((ts, "checkpoint", f"checkpoint step {e.get('step')}"))
            checkpoints.append(dict(e))
        elif kind in ("preempted", "node_lost", "hang_detected"):
            marks.append((ts, kind, _detail(e)))
        elif kind == "train_metrics" and e.get("steps_per_s") is not None:
            throughput.append((ts, float(e["steps_per_s"])))
    return RunAnalysis(
        run_ids=sorted({str(e.get("run_id")) for e in events if e.get("run_id")}),
        nodes=sorted({str(e.get("node")) for e in events if e.get("node")}),
        start_ts=start_ts,
        end_ts=end_ts,
        productive_s=productive,
        startup_s=max(startup, 0.0),
        productive_basis=basis,
        incidents=all_incidents,
        rounds=rounds,
        throughput=throughput,
        marks=marks,
        node_finish={str(e.get("node")): dict(e) for e in finishes},
        checkpoints=checkpoints,
        resources=summarize_resources(events),
        skipped_events=skipped,
    )


def _productive(
    events: Sequence[Mapping[str, Any]],
    rounds: Mapping[int, Mapping[str, Any]],
    starting: Mapping[int, float],
    incidents: Sequence[Incident],
    start_ts: float,
    end_ts: float,
) -> tuple[float, float, str]:
    """(productive seconds, start-up seconds, basis); sets each incident's lost time.

    With ``train_metrics`` events, productive time is when steps were reported: per round,
    first to last report plus one reporting window (the median gap). Otherwise it is the
    time each round was up on every node until the next interruption.
    """
    per_round: dict[Any, list[float]] = {}
    for e in events:
        if e["event"] == "train_metrics":
            per_round.setdefault(e.get("round"), []).append(float(e["ts"]))
    stoppers = [i for i in incidents if i.cause != "store_outage"]
    if per_round:
        gaps = sorted(b - a for ts in per_round.values() for a, b in zip(ts, ts[1:], strict=False))
        window = gaps[len(gaps) // 2] if gaps else 0.0
        productive = sum(max(ts) - min(ts) + window for ts in per_round.values())
        reports = sorted(t for ts in per_round.values() for t in ts)
        for k, inc in enumerate(stoppers):
            # lost until steps resume, or the next incident takes over, or the run ends
            cap = stoppers[k + 1].ts if k + 1 < len(stoppers) else end_ts
            after = inc.recovered_ts if inc.recovered_ts is not None else inc.ts
            nxt = next((t for t in reports if t > after), None)
            inc.resumed_ts = None if nxt is None else max(nxt - window, after)
            until = min(inc.resumed_ts if inc.resumed_ts is not None else end_ts, cap)
            inc.lost_s = max(until - inc.ts, 0.0)
        first = min([reports[0] - window, *(i.ts for i in stoppers)])
        return min(productive, end_ts - start_ts), max(first - start_ts, 0.0), "train_metrics"
    numbers = sorted(rounds)
    stops = sorted(
        [i.ts for i in stoppers]
        + [t for n, t in starting.items() if numbers and n > numbers[0]]
        + [end_ts]
    )
    productive = 0.0
    for n in numbers:
        up = float(rounds[n]["ts"])
        productive += max(next((t for t in stops if t > up), end_ts) - up, 0.0)
    for k, inc in enumerate(stoppers):
        cap = stoppers[k + 1].ts if k + 1 < len(stoppers) else end_ts
        until = inc.recovered_ts if inc.recovered_ts is not None else end_ts
        inc.lost_s = max(min(until, cap) - inc.ts, 0.0)
    first_up = float(rounds[numbers[0]]["ts"]) if numbers else end_ts
    startup = min([first_up, *(i.ts for i in stoppers)]) - start_ts
    return productive, startup, "worker_uptime"
