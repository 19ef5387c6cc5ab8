"""Prometheus metrics of one agent: the registry, the HTTP endpoint, and events -> metrics.

Owns the metric names (``flexrun_`` prefix, units in names, ``_total`` for counters), one
private :class:`~prometheus_client.CollectorRegistry` per :class:`AgentMetrics` (so several
agents or tests in one process never collide), and the mapping from event-log records to
metric updates (:class:`EventMetrics`). It does not decide what happened (the agent and
the train library emit events) and does not sample the node (``resources.py`` does).

The agent needs one hook: every event it (or a worker) appends to the run's
``events.jsonl`` reaches :meth:`EventMetrics.observe`, either directly or through an
:class:`EventFollower` that tails the file, which also picks up what workers write
(``checkpoint_saved``, ``train_metrics``) without any extra plumbing.

Training throughput arrives as ``train_metrics`` events (rank 0, through
``flexrun.train``) with optional fields ``step``, ``steps_per_s``, ``samples_per_s``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError
from flexrun.events import EVENTS_FILE
from flexrun.observe.eventcheck import clean_event

log = logging.getLogger("flexrun.observe")

RECOVERY_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TRAIN_METRICS_EVENTS = frozenset({"train_metrics"})

# Events that interrupt training; recovery ends when workers of a later round start.
_INTERRUPTIONS = frozenset(
    {"failure", "scale_up", "scale_down", "node_lost", "node_left", "preempted", "hang_detected"}
)


def failure_cause(event: Mapping[str, Any]) -> str:
    """A low-cardinality label for why training was interrupted (also the report's cause).

    ``worker_failure`` (a worker exited non-zero or was killed), ``hang`` (no progress),
    ``node_lost`` (keep-alive expired), ``node_left`` (graceful leave), ``preempted``
    (the agent was signalled), ``scale_up``, ``scale_down``, ``store_outage``.
    """
    kind = str(event.get("event", ""))
    return {
        "failure": "worker_failure",
        "hang_detected": "hang",
        "store_unavailable": "store_outage",
    }.get(kind, kind)


def restart_cause(reason: str) -> str:
    """The :func:`failure_cause` label for a ``restart`` event's (a new round's) reason."""
    return {"failure": "worker_failure", "hang": "hang"}.get(reason, reason or "unknown")


class AgentMetrics:
    """The metrics of one agent and (optionally) the HTTP endpoint serving them.

    Construction registers every metric; :meth:`start` serves them on ``port`` (0 picks a
    free port; read :attr:`port` afterwards) and :meth:`close` stops serving.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        clock: Clock = SYSTEM_CLOCK,
        run_id: str = "",
        node: str = "",
    ) -> None:
        if port is not None and not 0 <= port < 65536:
            raise ConfigError(f"--metrics-port {port}: out of range 0-65535")
        self.registry = CollectorRegistry(auto_describe=True)
        self.host = host
        self.port = port
        self._clock = clock
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._last_checkpoint_wall: float | None = None
        r = self.registry

        def gauge(name: str, doc: str, labelnames: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labelnames, registry=r)

        self.info = Gauge(
            "flexrun_agent_info",
            "This agent (value 1), labelled by job and node",
            ("job", "node"),
            registry=r,
        )
        self.world_size = gauge("flexrun_world_size", "Workers in the current round, all nodes")
        self.nodes = gauge("flexrun_nodes", "Nodes (agents) in the current round")
        self.round = gauge("flexrun_round", "Number of the current rendezvous round")
        self.workers_up = gauge("flexrun_workers_up", "Worker processes running on this node")
        self.restarts = Counter(
            "flexrun_restarts",
            "Worker-group restarts by reason",
            ("reason",),
            registry=r,
        )
        self.failures = Counter(
            "flexrun_failures",
            "Interruptions of training by cause",
            ("cause",),
            registry=r,
        )
        self.events_total = Counter(
            "flexrun_events", "Events in the run's event log", ("event",), registry=r
        )
        self.recovery = Histogram(
            "flexrun_recovery_duration_seconds",
            "From an interruption to the next round's workers starting",
            buckets=RECOVERY_BUCKETS_S,
            registry=r,
        )
        self.last_recovery = gauge(
            "flexrun_last_recovery_duration_seconds", "Duration of the most recent recovery"
        )
        self.rendezvous = Histogram(
            "flexrun_rendezvous_duration_seconds",
            "Rendezvous (round start to workers spawned) duration",
            buckets=RECOVERY_BUCKETS_S,
            registry=r,
        )
        self.checkpoint_age = gauge(
            "flexrun_last_checkpoint_age_seconds",
            "Seconds since the last checkpoint was saved (NaN before the first)",
        )
        self.checkpoint_age.set_function(self._checkpoint_age)
        self.checkpoint_step = gauge("flexrun_last_checkpoint_step", "Step of the last checkpoint")
        self.step = gauge("flexrun_train_step", "Last training step reported by rank 0")
        self.steps_per_s = gauge("flexrun_train_steps_per_second", "Training steps per second")
        self.samples_per_s = gauge(
            "flexrun_train_samples_per_second", "Training samples per second"
        )
        self.ettr = gauge(
            "flexrun_ettr_ratio", "Effective training time ratio (productive / wall) at job end"
        )
        self.failure_ettr = gauge(
            "flexrun_failure_ettr_ratio",
            "ETTR with start-up and wrap-up not counted as lost: 1 - time lost to disruptions"
            " / wall, at job end",
        )
        self.info.labels(job=run_id, node=node).set(1)

    # -- serving ----------------------------------------------------------------------------
    def start(self) -> int:
        """Serve ``/metrics`` over HTTP and return the bound port.

        Raises:
            ConfigError: no port was given, or it cannot be bound (in use, no permission).
        """
        if self._server is not None:
            return int(self.port or 0)
        if self.port is None:
            raise ConfigError("metrics: no port to serve on (pass --metrics-port)")
        try:
            server, thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {self.port}: cannot listen on {self.host} ({exc.strerror}); "
                "choose a free port"
            ) from exc
        self._server, self._thread = server, thread
        self.port = int(server.server_address[1])
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)
        return self.port

    def close(self) -> None:
        """Stop serving. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def render(self) -> bytes:
        """The exposition text, exactly as a scrape would return it."""
        return bytes(generate_latest(self.registry))

    # -- updates (the API an agent may call directly) -----------------------------------------
    def on_round(self, *, round: int, world_size: int, nodes: int) -> None:
        self.round.set(round)
        self.world_size.set(world_size)
        self.nodes.set(nodes)

    def on_workers(self, up: int) -> None:
        self.workers_up.set(max(up, 0))

    def on_failure(self, cause: str) -> None:
        self.failures.labels(cause=cause).inc()

    def on_restart(self, reason: str) -> None:
        self.restarts.labels(reason=reason or "unknown").inc()

    def on_recovery(self, duration_s: float) -> None:
        if duration_s >= 0:
            self.recovery.observe(duration_s)
            self.last_recovery.set(duration_s)

    def on_checkpoint(self, *, step: int | None = None, wall_ts: float | None = None) -> None:
        self._last_checkpoint_wall = self._clock.wall() if wall_ts is None else wall_ts
        if step is not None:
            self.checkpoint_step.set(step)

    def on_throughput(
        self,
        *,
        step: int | None = None,
        steps_per_s: float | None = None,
        samples_per_s: float | None = None,
    ) -> None:
        if step is not None:
            self.step.set(step)
        if steps_per_s is not None:
            self.steps_per_s.set(steps_per_s)
        if samples_per_s is not None:
            self.samples_per_s.set(samples_per_s)

    def _checkpoint_age(self) -> float:
        if self._last_checkpoint_wall is None:
            return math.nan
        return max(self._clock.wall() - self._last_checkpoint_wall, 0.0)


class EventMetrics:
    """Updates :class:`AgentMetrics` from event-log records: feed it every event, in order.

    Stateful only to measure recoveries: an interruption starts a clock that the next
    ``worker_started``/``rendezvous_completed`` of a later round stops.
    """

    def __init__(self, metrics: AgentMetrics, *, node: str | None = None) -> None:
        self.metrics = metrics
        self.node = node
        """Only this node's agent events move per-node gauges (None: accept every node)."""
        self._interrupted_at: float | None = None
        self._interrupted_round: int | None = None
        self._workers: set[int] = set()
        self._lock = threading.Lock()

    def observe(self, event: Mapping[str, Any]) -> None:
        """Apply one event; unknown events only count in ``flexrun_events_total``."""
        kind = str(event.get("event", ""))
        if not kind:
            return
        with self._lock:
            self._observe(kind, event)

    def _observe(self, kind: str, e: Mapping[str, Any]) -> None:
        m = self.metrics
        m.events_total.labels(event=kind).inc()
        ts = _float(e.get("ts"))
        mine = self.node is None or e.get("node") == self.node
        rnd = _int(e.get("round"))
        if kind in _INTERRUPTIONS:
            if kind != "scale_up":  # growing is not a failure of anything
                m.on_failure(failure_cause(e))
            if self._interrupted_at is None and ts is not None:
                self._interrupted_at = ts
                # failure/preempted/hang carry the running round; the others the new one
                self._interrupted_round = (
                    rnd if kind in ("failure", "preempted", "hang_detected") else None
                )
                if rnd is not None and self._interrupted_round is None:
                    self._interrupted_round = rnd - 1
        elif kind == "restart":
            m.on_restart(str(e.get("reason") or ""))
            # Every running node logs a restart; the triggering event may be in another
            # node's log (a scale-up proposed by the joining node).
            if mine and self._interrupted_at is None and ts is not None:
                self._interrupted_at = ts
                self._interrupted_round = rnd - 1 if rnd is not None else None
        elif kind == "rendezvous_completed" and mine:
            members = e.get("members") or []
            m.on_round(
                round=rnd or 0,
                world_size=_int(e.get("world_size")) or 0,
                nodes=len(members) if isinstance(members, list) else 0,
            )
            dur = _float(e.get("duration_s"))
            if dur is not None:
                m.rendezvous.observe(dur)
            self._maybe_recovered(ts, rnd)
        elif kind == "worker_started" and mine:
            self._workers.add(_int(e.get("rank")) or 0)
            m.on_workers(len(self._workers))
            self._maybe_recovered(ts, rnd)
        elif kind == "worker_exited" and mine:
            self._workers.discard(_int(e.get("rank")) or 0)
            m.on_workers(len(self._workers))
        elif kind in ("checkpoint_saved",):
            m.on_checkpoint(step=_int(e.get("step")), wall_ts=ts)
        elif kind in TRAIN_METRICS_EVENTS:
            m.on_throughput(
                step=_int(e.get("step")),
                steps_per_s=_float(e.get("steps_per_s")),
                samples_per_s=_float(e.get("samples_per_s")),
            )
        elif kind == "job_finished" and mine:
            self._workers.clear()
            m.on_workers(0)
            for gauge_, field in ((m.ettr, "ettr"), (m.failure_ettr, "failure_ettr")):
                value = _float(e.get(field))
                if value is not None:
                    gauge_.set(value)
        if kind in ("restart", "rendezvous_started") and mine and self._workers:
            # the agent stops its workers before a new round, without worker_exited events
            self._workers.clear()
            m.on_workers(0)

    def _maybe_recovered(self, ts: float | None, rnd: int | None) -> None:
        if self._interrupted_at is None or ts is None:
            return
        if self._interrupted_round is not None and (rnd is None or rnd <= self._interrupted_round):
            return
        self.metrics.on_recovery(ts - self._interrupted_at)
        self._interrupted_at = None
        self._interrupted_round = None


def _int(v: object) -> int | None:
    try:
        return None if v is None or isinstance(v, bool) else int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _float(v: object) -> float | None:
    try:
        return None if v is None or isinstance(v, bool) else float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


class EventFollower:
    """Tails an ``events.jsonl`` (or a run directory's) and hands each new complete line on.

    Starts at the beginning of the file (so a metrics endpoint started late still counts
    the run so far), tolerates the file appearing later and partial last lines (read again
    once complete). ``poll()`` reads what is new; ``start()`` polls in a daemon thread.
    A line that is not a usable event (not JSON or UTF-8, nested beyond the parser, a ``ts``
    or ``round`` of the wrong type: :func:`~flexrun.observe.eventcheck.clean_event`) is
    skipped and counted in :attr:`skipped`, never an exception that would stall the tail.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        sink: Callable[[dict[str, Any]], None],
        *,
        interval_s: float = 0.25,
    ) -> None:
        p = Path(path)
        self.path = p / EVENTS_FILE if p.is_dir() or not p.suffix else p
        self.sink = sink
        self.interval_s = interval_s
        self._offset = 0
        self.skipped = 0
        """Lines read that were not usable events."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> int:
        """Deliver every complete line added since the last call; return how many."""
        import json

        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return 0
        n = 0
        end = data.rfind(b"\n")
        if end < 0:
            return 0
        self._offset += end + 1
        for raw in data[:end].split(b"\n"):  # (not splitlines: a \r is inside a line)
            if not raw.strip():
                continue
            try:
                rec = clean_event(json.loads(raw))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                rec = None
            if rec is None:
                self.skipped += 1
                continue
            self.sink(rec)
            n += 1
        return n

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="flexrun-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - metrics must never take the agent down
                log.exception("metrics: reading %s failed", self.path)
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        """Stop the thread after a last poll. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with contextlib.suppress(OSError):
            self.poll()


def serve_run_metrics(
    run_dir: str | os.PathLike[str],
    port: int,
    *,
    node: str | None = None,
    run_id: str = "",
    host: str = "127.0.0.1",
    resources: bool = True,
) -> tuple[AgentMetrics, EventFollower]:
    """The whole agent hook in one call: metrics on ``port`` fed from ``run_dir``'s events.

    Close both (follower first) when the agent exits.

    Raises:
        ConfigError: the port cannot be bound.
    """
    metrics = AgentMetrics(port, host=host, run_id=run_id, node=node or "")
    if resources:
        from flexrun.observe.resources import ResourceCollector

        metrics.registry.register(ResourceCollector(disk_path=str(run_dir)))
    follower = EventFollower(run_dir, EventMetrics(metrics, node=node).observe)
    follower.poll()
    metrics.start()
    follower.start()
    return metrics, follower


__all__ = ["AgentMetrics", "EventFollower", "EventMetrics", "failure_cause", "serve_run_metrics"]
