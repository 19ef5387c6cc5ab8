"""Live mode's agent <-> worker protocol: every key, record, file and variable between them.

Owns the whole contract, so that both sides share one definition without the agent
importing ``flexrun.train`` (which imports torch: an agent that imports torch takes
seconds longer to start, and a joining node's first step waits for it). Torch-free and
without I/O except the heartbeat file helpers. The three channels:

- **Environment** (agent -> worker, once): :class:`LiveEnv` (``FLEXRUN_LIVE_*``,
  ``FLEXRUN_WORKER_ID``), built by :func:`worker_env`, read by :meth:`LiveEnv.from_environ`.
- **Store** (both ways), keys of :class:`LiveKeys` under ``flexrun/<run_id>/live/``:
  ``epoch`` = the current :class:`EpochRecord` (agents, by compare-and-set; workers read),
  ``nodes/<node_id>`` = a node's included workers (:class:`NodeWorkers`, agents only),
  ``formed`` (some epoch has formed: a worker once held state), ``done`` (the last step
  was committed), and per epoch ``e/<n>/``: the members' arrival reports
  (``ready/<rank>``, :class:`MemberReport`) and the epoch's process-group namespace;
  ``reconf/`` holds the in-place groups' keys and id counter (torch >= 2.14).
- **Heartbeat file** (worker -> agent, per worker): touched every interval while the
  worker is in the loop; its content starts with :data:`STATE_MARK` once the worker holds
  live state (has joined an epoch). The agent judges a worker by the file's age.

The worker side is ``flexrun.train.live`` (and ``live_group``); the agent side
``flexrun.agent.live``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flexrun.errors import ConfigError

STATE_MARK = "state"
"""Written to a worker's heartbeat file once it holds live state (has joined an epoch)."""
LOST_MARK = "lost"
"""The heartbeat file's second line: ``lost <seconds>`` (:func:`mark_state`)."""

ENV_LIVE = "FLEXRUN_LIVE"
ENV_STORE = "FLEXRUN_LIVE_STORE"
ENV_WORKER_ID = "FLEXRUN_WORKER_ID"
ENV_HEARTBEAT = "FLEXRUN_LIVE_HEARTBEAT"
ENV_HEARTBEAT_INTERVAL = "FLEXRUN_LIVE_HEARTBEAT_INTERVAL"
ENV_SHARDS = "FLEXRUN_LIVE_SHARDS"
ENV_GROUP = "FLEXRUN_LIVE_GROUP"
ENV_SHARD = "FLEXRUN_LIVE_SHARD"
ENV_RECONFIGURE = "FLEXRUN_LIVE_RECONFIGURE"
"""``0``: never re-form live groups in place (torch >= 2.14), always a fresh group."""


class LiveKeys:
    """Store keys of one job's live mode."""

    def __init__(self, run_id: str) -> None:
        self.root = f"flexrun/{run_id}/live/"
        self.epoch = self.root + "epoch"
        self.nodes = self.root + "nodes/"
        self.formed = self.root + "formed"
        self.done = self.root + "done"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def epoch_namespace(self, number: int) -> str:
        """Prefix of epoch ``number``'s own keys (arrival reports, process group)."""
        return f"{self.root}e/{number}/"

    def group_namespace(self, group: str) -> str:
        """Prefix of replica group ``group``'s own process group (sharded live jobs)."""
        return f"{self.root}g/{group}/"

    @staticmethod
    def ready(rank: int) -> str:
        """Key (inside an epoch's namespace) of member ``rank``'s arrival report."""
        return f"ready/{rank}"


def _json_object(raw: bytes | str, what: str) -> dict[str, object]:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"unreadable {what} record: {type(exc).__name__}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{what} record is not an object")
    return data


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """Who trains in epoch ``number``, in rank order; ``abort``: a member of the previous
    epoch is gone, so its collectives must be abandoned now (not at a step boundary)."""

    number: int
    members: tuple[str, ...]
    abort: bool
    round: int = field(default=-1, compare=False)
    """The rendezvous round whose membership it was computed from (-1: not said). An agent
    still in an older round does not replace it (:mod:`flexrun.agent.live_epochs`)."""

    def encode(self) -> bytes:
        data = {"v": 1, "number": self.number, "members": list(self.members), "abort": self.abort}
        if self.round >= 0:
            data["round"] = self.round
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, raw: bytes) -> EpochRecord:
        """Raises ValueError on a malformed record."""
        d = _json_object(raw, "epoch")
        try:
            members = d["members"]
            if not isinstance(members, list):
                raise TypeError("members is not a list")
            return cls(
                int(str(d["number"])),
                tuple(str(m) for m in members),
                bool(d["abort"]),
                int(str(d.get("round", -1))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed epoch record: {exc}") from exc


def next_epoch(
    current: EpochRecord | None, members: Sequence[str], round: int = -1
) -> EpochRecord | None:
    """The epoch that follows ``current`` when the job's live workers are ``members``, as of
    rendezvous round ``round`` (None: nothing to publish, no members or no change). It
    aborts when a member of ``current`` is missing; a grown membership switches at a step
    boundary instead."""
    if not members or (current is not None and current.members == tuple(members)):
        return None
    abort = current is not None and any(w not in members for w in current.members)
    return EpochRecord((current.number + 1) if current else 1, tuple(members), abort, round)


@dataclass(frozen=True, slots=True)
class NodeWorkers:
    """A node's included live workers (``nodes/<node_id>``), as of its round ``round``."""

    round: int
    workers: tuple[str, ...]

    def encode(self) -> bytes:
        return json.dumps({"round": self.round, "workers": list(self.workers)}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> NodeWorkers:
        """Raises ValueError on a malformed record."""
        d = _json_object(raw, "node workers")
        workers = d.get("workers")
        if not isinstance(workers, list):
            raise ValueError("malformed node workers record: workers is not a list")
        return cls(int(str(d.get("round", 0))), tuple(str(w) for w in workers))


@dataclass(frozen=True, slots=True)
class MemberReport:
    """What one member posts when it arrives in an epoch."""

    step: int
    has_state: bool
    checksum: str | None = None
    group: str | None = None
    """Its replica group (sharded live jobs; None: a whole-model replica)."""
    shard: int = 0
    """Its shard index within the group."""
    lost_s: float = 0.0
    """Training time the job's disruptions cost so far, as it judged them
    (:mod:`flexrun.train.live_goodput`)."""
    handle: str | None = None
    """Its process group's reconfigure handle (in-place path, :mod:`flexrun.train.live_reconf`;
    None: this member forms a fresh group)."""
    portions: int = 0
    """Portions of a sharded step it knows of (:mod:`flexrun.train.live_portions`; 0: none)."""
    held: tuple[int, ...] = ()
    """Portions of step ``step`` whose gradients it holds (sharded live jobs)."""

    def encode(self) -> str:
        data: dict[str, object] = {"step": self.step, "has_state": self.has_state}
        if self.checksum is not None:
            data["checksum"] = self.checksum
        if self.group is not None:
            data["group"], data["shard"] = self.group, self.shard
        if self.lost_s:
            data["lost_s"] = round(self.lost_s, 4)
        if self.handle is not None:
            data["handle"] = self.handle
        if self.portions:
            data["portions"] = self.portions
        if self.held:
            data["held"] = list(self.held)
        return json.dumps(data)

    @classmethod
    def decode(cls, raw: bytes | str) -> MemberReport:
        """Raises ValueError on a malformed report."""
        d = _json_object(raw, "member report")
        try:
            checksum, group, handle = d.get("checksum"), d.get("group"), d.get("handle")
            return cls(
                int(str(d["step"])),
                bool(d["has_state"]),
                str(checksum) if checksum is not None else None,
                str(group) if group is not None else None,
                int(str(d.get("shard", 0))),
                _seconds(d.get("lost_s", 0.0)),
                str(handle) if handle is not None else None,
                *_portions(d.get("portions", 0), d.get("held", [])),
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"malformed member report: {exc}") from exc


_MAX_PORTIONS = 1 << 20


def _portions(count: object, held: object) -> tuple[int, tuple[int, ...]]:
    """A reported portion count and hold: whole numbers, the hold's below the count."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= _MAX_PORTIONS:
        raise ValueError(f"portions {count!r}: not a whole number 0 to {_MAX_PORTIONS}")
    if not isinstance(held, list) or len(held) > count:
        raise ValueError(f"held {held!r}: not a list of at most {count} portions")
    if any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < count for k in held):
        raise ValueError(f"held {held!r}: a portion outside 0..{count - 1}")
    return count, tuple(held)


_MAX_LOST_S = 1e8  # (three years)


def _seconds(raw: object) -> float:
    """A reported duration: a finite number of seconds, 0 to :data:`_MAX_LOST_S`."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"lost_s {raw!r}: not a number")
    if not 0.0 <= float(raw) <= _MAX_LOST_S:  # (NaN fails both)
        raise ValueError(f"lost_s {raw!r}: not between 0 and {_MAX_LOST_S:g}")
    return float(raw)


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveEnv:
    """What the agent tells a live worker."""

    store_host: str
    store_port: int
    run_id: str
    worker_id: str
    heartbeat_file: Path
    heartbeat_interval_s: float
    run_dir: str | None
    round: int
    shards: int = 1
    """Workers per replica group (``--live-shards``); 1: every worker a whole replica."""
    group: str = ""
    """This worker's replica group: the same id for the workers of one group, a new one
    each time the agent replaces the group (sharded jobs; "" otherwise)."""
    shard: int = 0
    """This worker's shard index within its group."""
    reconfigure: bool = True
    """Re-form the epoch's group in place where torch can (``FLEXRUN_LIVE_RECONFIGURE=0``:
    never)."""

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> LiveEnv:
        """Raises ConfigError when the script was not started by ``flexrun run --mode live``."""
        if env.get(ENV_LIVE) != "1":
            raise ConfigError(
                "LiveLoop needs `flexrun run --mode live` (or auto mode with a script that uses it); "
                "under torchrun or restart mode use the Checkpointer and ElasticSampler instead"
            )
        try:
            host, _, port = env[ENV_STORE].rpartition(":")
            out = cls(
                store_host=host,
                store_port=int(port),
                run_id=env["FLEXRUN_RUN_ID"],
                worker_id=env[ENV_WORKER_ID],
                heartbeat_file=Path(env[ENV_HEARTBEAT]),
                heartbeat_interval_s=float(env.get(ENV_HEARTBEAT_INTERVAL, "0.5")),
                run_dir=env.get("FLEXRUN_RUN_DIR") or None,
                round=int(env.get("FLEXRUN_ROUND", "0")),
                shards=int(env.get(ENV_SHARDS, "1")),
                group=env.get(ENV_GROUP, ""),
                shard=int(env.get(ENV_SHARD, "0")),
                reconfigure=env.get(ENV_RECONFIGURE, "1") != "0",
            )
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"live-mode environment incomplete or malformed: {exc}") from exc
        if out.shards < 1 or not 0 <= out.shard < out.shards or (out.shards > 1 and not out.group):
            raise ConfigError(
                f"live-mode environment malformed: shard {out.shard} of {out.shards} in group "
                f"{out.group!r}"
            )
        return out


def worker_env(
    *,
    store: tuple[str, int],
    worker_id: str,
    heartbeat: Path,
    heartbeat_interval_s: float,
    group: tuple[int, str, int] | None = None,
) -> dict[str, str]:
    """The live-mode variables of one worker (added to its torchrun-style environment);
    ``group``: (shards per group, group id, shard index) of a sharded job."""
    env = {
        ENV_LIVE: "1",
        ENV_STORE: f"{store[0]}:{store[1]}",
        ENV_WORKER_ID: worker_id,
        ENV_HEARTBEAT: str(heartbeat),
        ENV_HEARTBEAT_INTERVAL: str(heartbeat_interval_s),
    }
    if group is not None:
        env[ENV_SHARDS], env[ENV_GROUP], env[ENV_SHARD] = (str(x) for x in group)
    return env


# -- the heartbeat file ------------------------------------------------------------------------
def touch_heartbeat(path: Path) -> None:
    """Worker side: "I am in the loop" (creates the file; keeps its content).

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a"):
        os.utime(path)


def mark_state(path: Path, lost_s: float = 0.0) -> None:
    """Worker side: "I hold live state" (after joining an epoch), and the training time the
    job's disruptions cost so far as this worker judges it. Replaced whole (a reader never
    sees half of it); the mtime is a beat like any other.

    Raises:
        OSError: the file cannot be written.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{STATE_MARK}\n{LOST_MARK} {lost_s:.4f}\n")
    os.replace(tmp, path)


def heartbeat_age(path: Path, now_wall: float) -> float | None:
    """Agent side: seconds since the worker last beat, or None when it is not in the loop
    (not yet, or any more)."""
    try:
        return now_wall - path.stat().st_mtime
    except FileNotFoundError:
        return None


def reported_lost(path: Path) -> float:
    """Agent side: the lost training time the worker last reported (0.0: none, or not
    readable; the file is the worker's, so a malformed line counts as none)."""
    try:
        text = path.read_text()
    except OSError:
        return 0.0
    for line in text.splitlines()[1:]:
        key, _, value = line.partition(" ")
        if key == LOST_MARK:
            try:
                return _seconds(float(value))
            except ValueError:
                return 0.0
    return 0.0


def holds_state(path: Path) -> bool:
    """Agent side: the worker has joined an epoch (so it holds live state)."""
    try:
        return path.read_text().startswith(STATE_MARK)
    except OSError:
        return False


__all__ = [
    "STATE_MARK",
    "EpochRecord",
    "LiveEnv",
    "LiveKeys",
    "MemberReport",
    "NodeWorkers",
    "heartbeat_age",
    "holds_state",
    "mark_state",
    "next_epoch",
    "reported_lost",
    "touch_heartbeat",
    "worker_env",
]
