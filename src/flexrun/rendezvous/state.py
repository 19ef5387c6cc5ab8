"""Records the rendezvous keeps in the store: schema-versioned JSON, one key per node.

Owns the key layout and (de)serialisation; no store I/O and no decisions here.

Layout under ``flexrun/<run_id>/``:

- ``s/round/current``    the current :class:`RoundRecord`, changed only by compare-and-set
- ``s/nodes/<node_id>``  a :class:`NodeRecord` per joined node (deleted on graceful leave)
- ``s/master/<round>``   the rank-0 node's fresh ``MASTER_ADDR``/``MASTER_PORT`` for that round
- ``hb/<node_id>``       the node's keep-alive (a key with a TTL, refreshed every interval)

Everything agents watch lives under ``s/``; keep-alives live apart so that they do not
wake every watcher every second. The round has a directory of its own so that an agent
can watch it alone (stores that notify per directory then do not wake it for each node
that joins): only one agent at a time watches the node records (see
:func:`flexrun.rendezvous.decide.watches_membership`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from flexrun.cause import FailureCause
from flexrun.errors import RendezvousError

SCHEMA_VERSION = 1

RUNNING = "running"
PENDING = "pending"  # too few nodes: no workers run until MIN nodes are back
CLOSED = "closed"  # the job finished: no new rounds
FAILED = "failed"  # restarts exhausted: every agent exits with exit_code


class Keys:
    """Key names of one job."""

    def __init__(self, run_id: str) -> None:
        self.root = f"flexrun/{run_id}/"
        self.watched = self.root + "s/"
        self.round_dir = self.watched + "round/"
        self.round = self.round_dir + "current"
        self.nodes = self.watched + "nodes/"
        self.heartbeats = self.root + "hb/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def heartbeat(self, node_id: str) -> str:
        return self.heartbeats + node_id

    def master(self, round_number: int) -> str:
        return f"{self.watched}master/{round_number}"


def _load(raw: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RendezvousError(f"corrupt {what} record in the store: {exc}") from exc
    if not isinstance(data, dict) or data.get("v") != SCHEMA_VERSION:
        raise RendezvousError(
            f"{what} record has schema version {data.get('v') if isinstance(data, dict) else '?'}, "
            f"expected {SCHEMA_VERSION}: are all nodes running the same flexrun version?"
        )
    return data


def _dump(obj: Any) -> bytes:
    data = asdict(obj)
    data["v"] = SCHEMA_VERSION
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node tells the others about itself when it joins."""

    node_id: str
    addr: str
    nproc: int
    pid: int = 0

    def encode(self) -> bytes:
        return _dump(self)

    @classmethod
    def decode(cls, raw: bytes) -> NodeRecord:
        d = _load(raw, "node")
        return cls(
            node_id=d["node_id"], addr=d["addr"], nproc=int(d["nproc"]), pid=int(d.get("pid", 0))
        )


@dataclass(frozen=True, slots=True)
class Member:
    """A node's place in a round."""

    node_id: str
    addr: str
    nproc: int


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """One generation of the job's membership."""

    number: int
    state: str
    members: tuple[Member, ...] = ()
    restarts: int = 0
    """Failures so far in this job (what --max-restarts bounds)."""
    reason: str = ""
    """Why this round was formed: start, failure, node_lost, node_left, scale_up, ..."""
    exit_code: int = 0
    root_cause: FailureCause | None = None

    @property
    def member_ids(self) -> list[str]:
        return [m.node_id for m in self.members]

    def group_rank(self, node_id: str) -> int | None:
        for i, m in enumerate(self.members):
            if m.node_id == node_id:
                return i
        return None

    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    def rank_base(self, node_id: str) -> int:
        """Global rank of ``node_id``'s local rank 0."""
        base = 0
        for m in self.members:
            if m.node_id == node_id:
                return base
            base += m.nproc
        raise RendezvousError(f"node {node_id} is not a member of round {self.number}")

    def encode(self) -> bytes:
        data = asdict(self)
        data["root_cause"] = data["root_cause"] or {}  # (asdict made the cause a dict)
        data["v"] = SCHEMA_VERSION
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> RoundRecord:
        d = _load(raw, "round")
        return cls(
            number=int(d["number"]),
            state=str(d["state"]),
            members=tuple(
                Member(m["node_id"], m["addr"], int(m["nproc"])) for m in d.get("members", [])
            ),
            restarts=int(d.get("restarts", 0)),
            reason=str(d.get("reason", "")),
            exit_code=int(d.get("exit_code", 0)),
            root_cause=FailureCause.from_dict(d.get("root_cause")),
        )


@dataclass(frozen=True, slots=True)
class MasterRecord:
    """Where round ``number``'s workers meet (rank 0's TCPStore for the process group)."""

    addr: str
    port: int

    def encode(self) -> bytes:
        return _dump(self)

    @classmethod
    def decode(cls, raw: bytes) -> MasterRecord:
        d = _load(raw, "master")
        return cls(addr=str(d["addr"]), port=int(d["port"]))
