"""Records the rendezvous keeps in the store: schema-versioned JSON, O(1) bytes per node.

Owns the key layout and (de)serialisation, and reading a round back as an outside reader
sees it (:func:`read_round`: the header, its member list read from its chunks on first
use). Writing and every decision live elsewhere (``records.py``, ``decide.py``...).

Layout under ``flexrun/<run_id>/``:

- ``s/round/current``   the round *header* (:meth:`RoundRecord.header`): number, state,
  nodes, world size, member list digest, restarts, reason, root cause, a write sequence
- ``s/round/watcher``   who watches membership and proposes rounds (:class:`Claim`)
- ``s/nodes/<node_id>`` a :class:`NodeRecord` per joined node (deleted on graceful leave)
- ``s/ask/<node_id>``   a node that found no slice for the current round asks for it
- ``s/round/master/<round>`` the rank-0 node's fresh ``MASTER_ADDR``/``MASTER_PORT`` (under
  ``s/round/``: its publication wakes the members waiting for it)
- ``hb/<node_id>``      the node's keep-alive (its NodeRecord, with a TTL)
- ``r/<digest>/s/<node_id>`` the node's *slice* of the member list with that digest
  (:class:`Slice`: group rank, first global rank, node count, world size)
- ``r/<digest>/m/<i>``  the member list itself in chunks of :data:`CHUNK` members

A member list is written once per membership (a restart, closing, a live failure: the
header alone). A node reads the header and its own slice; only the watcher and ``flexrun
status`` read the list. Agents watch ``s/``, followers ``s/round/`` alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, overload

from flexrun.cause import FailureCause
from flexrun.errors import RendezvousError
from flexrun.rendezvous.keys import Keys
from flexrun.store.api import Store
from flexrun.store.jsonrec import loads_record

SCHEMA_VERSION = 1  # node, master and the old self-contained round record
HEADER_VERSION = 2  # round header, slices, member chunks, watcher claim
CHUNK = 512  # members per chunk key (~25 KB)

RUNNING = "running"
PENDING = "pending"  # too few nodes: no workers run until MIN nodes are back
CLOSED = "closed"  # the job finished: no new rounds
FAILED = "failed"  # restarts exhausted: every agent exits with exit_code
FINISHED_EARLIER = "finished_earlier"
"""A CLOSED round's reason when the node that finished ran an earlier round: the round was
formed (a peer's failure, a join) as the job ended, and its workers will never train."""


def _load(raw: bytes, what: str, versions: tuple[int, ...] = (SCHEMA_VERSION,)) -> dict[str, Any]:
    try:
        data = loads_record(raw)  # (no 1e999: int() of it raises OverflowError)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise RendezvousError(f"corrupt {what} record in the store: {exc}") from exc
    if not isinstance(data, dict) or data.get("v") not in versions:
        raise RendezvousError(
            f"{what} record has schema version {data.get('v') if isinstance(data, dict) else '?'}, "
            f"expected {' or '.join(map(str, versions))}: are all nodes running the same flexrun "
            "version?"
        )
    return data


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _dump(obj: Any, version: int = SCHEMA_VERSION) -> bytes:
    data = asdict(obj)
    data["v"] = version
    return _json(data)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node tells the others about itself when it joins."""

    node_id: str
    addr: str
    nproc: int
    pid: int = 0
    rank: int = -1  # a static job's --node-rank (-1: an elastic job)

    def encode(self) -> bytes:
        return _dump(self)

    @classmethod
    def decode(cls, raw: bytes) -> NodeRecord:
        d = _load(raw, "node")
        try:
            return cls(
                node_id=str(d["node_id"]),
                addr=str(d["addr"]),
                nproc=int(d["nproc"]),
                pid=int(d.get("pid", 0)),
                rank=int(d.get("rank", -1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousError(f"corrupt node record: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Member:
    """A node's place in a round."""

    node_id: str
    addr: str
    nproc: int


def digest_of(members: Sequence[Member]) -> str:
    """The digest naming a member list (empty list: "")."""
    if not members:
        return ""
    text = json.dumps([[m.node_id, m.addr, m.nproc] for m in members], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Slice:
    """One node's share of a member list: what it needs to start its workers."""

    digest: str
    node_id: str
    member: bool
    """False: the watcher's answer to a node that asked but is not in this list."""
    group_rank: int = -1
    rank_base: int = 0
    nproc: int = 0
    nodes: int = 0
    world: int = 0

    def encode(self) -> bytes:
        return _dump(self, HEADER_VERSION)

    @classmethod
    def decode(cls, raw: bytes) -> Slice:
        d = _load(raw, "slice", (HEADER_VERSION,))
        try:
            return cls(
                digest=str(d["digest"]),
                node_id=str(d["node_id"]),
                member=bool(d["member"]),
                group_rank=int(d.get("group_rank", -1)),
                rank_base=int(d.get("rank_base", 0)),
                nproc=int(d.get("nproc", 0)),
                nodes=int(d.get("nodes", 0)),
                world=int(d.get("world", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousError(f"corrupt slice record: {exc}") from exc


def slices_of(members: Sequence[Member]) -> list[Slice]:
    """Every member's slice of ``members``."""
    digest, world, out, base = digest_of(members), sum(m.nproc for m in members), [], 0
    for i, m in enumerate(members):
        out.append(Slice(digest, m.node_id, True, i, base, m.nproc, len(members), world))
        base += m.nproc
    return out


def kept_of(old: Sequence[Member], new: Sequence[Member]) -> int:
    """How many leading members ``new`` shares with ``old`` (:attr:`RoundRecord.kept`)."""
    n = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        n += 1
    return n


def carried_slice(old: Slice, rnd: RoundRecord) -> Slice | None:
    """``old`` (a slice of ``rnd.prev``'s list) carried over to ``rnd``'s list, if its
    member is one of the ``rnd.kept`` leading ones both lists share; else None."""
    if not (old.member and old.digest == rnd.prev and 0 <= old.group_rank < rnd.kept):
        return None
    nodes, world = len(rnd.members), rnd.world_size()
    return Slice(rnd.digest, old.node_id, True, old.group_rank, old.rank_base, old.nproc, nodes, world)


def encode_chunk(digest: str, index: int, members: Sequence[Member]) -> bytes:
    return _json(
        {
            "v": HEADER_VERSION,
            "digest": digest,
            "i": index,
            "members": [[m.node_id, m.addr, m.nproc] for m in members],
        }
    )


def decode_chunk(raw: bytes, digest: str, index: int) -> list[Member]:
    d = _load(raw, "member list", (HEADER_VERSION,))
    if d.get("digest") != digest or d.get("i") != index:
        raise RendezvousError(f"member chunk {index} does not belong to list {digest}")
    try:
        return [Member(str(a), str(b), int(c)) for a, b, c in d["members"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"corrupt member chunk: {exc}") from exc


def chunks_of(members: Sequence[Member]) -> list[list[Member]]:
    return [list(members[i : i + CHUNK]) for i in range(0, len(members), CHUNK)]


Loader = Callable[[], Sequence[Member]]


class Members(Sequence[Member]):
    """A round's member list known by its size and digest, read on first use.

    ``len()`` costs nothing; iterating or indexing calls the loader once (the handler's
    loader reads the list's chunks: O(N) bytes). Two lists are equal when their digests
    are. A loaded list whose digest differs from the header's is refused.
    """

    __slots__ = ("_count", "_digest", "_loaded", "_loader", "_lock", "_world")

    def __init__(self, count: int, world: int, digest: str, loader: Loader | None) -> None:
        self._count = count
        self._world = world
        self._digest = digest
        self._loader = loader
        self._loaded: tuple[Member, ...] | None = None if count else ()
        self._lock = threading.Lock()

    @property
    def digest(self) -> str:
        return self._digest

    @property
    def world(self) -> int:
        return self._world

    @property
    def loaded(self) -> bool:
        """Whether the list is in memory (iterating a list that is not reads the store)."""
        return self._loaded is not None

    def _all(self) -> tuple[Member, ...]:
        with self._lock:
            if self._loaded is None:
                if self._loader is None:
                    raise RendezvousError(
                        f"the member list {self._digest} of this round was not read from the store"
                    )
                got = tuple(self._loader())
                if len(got) != self._count or digest_of(got) != self._digest:
                    raise RendezvousError(f"the member list {self._digest} in the store is corrupt")
                self._loaded = got
            return self._loaded

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Member: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Member]: ...

    def __getitem__(self, index: int | slice) -> Member | Sequence[Member]:
        return self._all()[index]

    def __iter__(self) -> Iterator[Member]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Members):
            return self._digest == other._digest and self._count == other._count
        if isinstance(other, (tuple, list)):
            return len(other) == self._count and digest_of(other) == self._digest
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._digest, self._count))

    def __repr__(self) -> str:
        state = "loaded" if self._loaded is not None else "not loaded"
        return f"Members({self._count} nodes, digest {self._digest or '-'}, {state})"


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """One generation of the job's membership."""

    number: int
    state: str
    members: Sequence[Member] = ()
    restarts: int = 0
    """Failures so far in this job (what --max-restarts bounds)."""
    reason: str = ""
    """Why this round was formed: start, failure, node_lost, node_left, scale_up, ..."""
    exit_code: int = 0
    root_cause: FailureCause | None = None
    seq: int = 0
    """How many times the header has been written (a replayed older header has a lower one)."""
    prev: str = ""
    """Digest of the previous distinct member list (its records are deleted next)."""
    kept: int = 0
    """How many leading members this list shares with ``prev``'s: their slices carry over
    (same group rank and rank base; nodes and world from the header), so after a scale-up
    the members already there read no slice."""
    mine: Slice | None = field(default=None, compare=False)
    """The reading node's own slice (followers), when it read one."""
    stalled: int = 0  # failures in a row that completed no step (--crash-loop-restarts)
    window: float = 0.0  # with restart_window_s: its start (wall); restarts counts in it

    @property
    def digest(self) -> str:
        m = self.members
        return m.digest if isinstance(m, Members) else digest_of(m)

    @property
    def member_ids(self) -> list[str]:
        """Every member's id (a follower reads the member list for it: O(N) bytes)."""
        return [m.node_id for m in self.members]

    def known_member_ids(self) -> list[str] | None:
        """The members' ids if the list is in memory (the watcher's rounds), else None:
        what an event can record without reading the list from the store."""
        m = self.members
        return [x.node_id for x in m] if not isinstance(m, Members) or m.loaded else None

    def group_rank(self, node_id: str) -> int | None:
        if self.mine is not None and self.mine.node_id == node_id:
            return self.mine.group_rank if self.mine.member else None
        for i, m in enumerate(self.members):
            if m.node_id == node_id:
                return i
        return None

    def world_size(self) -> int:
        m = self.members
        return m.world if isinstance(m, Members) else sum(x.nproc for x in m)

    def rank_base(self, node_id: str) -> int:
        """Global rank of ``node_id``'s local rank 0."""
        if self.mine is not None and self.mine.node_id == node_id and self.mine.member:
            return self.mine.rank_base
        base = 0
        for m in self.members:
            if m.node_id == node_id:
                return base
            base += m.nproc
        raise RendezvousError(f"node {node_id} is not a member of round {self.number}")

    def _common(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "state": self.state,
            "restarts": self.restarts,
            "stalled": self.stalled,
            "window": self.window,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "root_cause": self.root_cause.to_dict() if self.root_cause is not None else {},
        }

    def header(self) -> bytes:
        """The header written to ``s/round/current``: O(1) bytes at any N."""
        return _json(
            {
                **self._common(),
                "v": HEADER_VERSION,
                "nodes": len(self.members),
                "world": self.world_size(),
                "digest": self.digest,
                "seq": self.seq,
                "prev": self.prev,
                "kept": self.kept,
            }
        )

    def encode(self) -> bytes:
        """A self-contained record with the member list inline (schema 1; tests and tools
        that write a round by hand; the rendezvous writes :meth:`header`)."""
        return _json(
            {**self._common(), "v": SCHEMA_VERSION, "members": [asdict(m) for m in self.members]}
        )

    @classmethod
    def decode(cls, raw: bytes, loader: Loader | None = None) -> RoundRecord:
        """A header (its member list read through ``loader`` on first use) or a
        self-contained record."""
        d = _load(raw, "round", (SCHEMA_VERSION, HEADER_VERSION))
        try:
            members: Sequence[Member]
            if d["v"] == SCHEMA_VERSION:
                members = tuple(
                    Member(str(m["node_id"]), str(m["addr"]), int(m["nproc"]))
                    for m in d.get("members", [])
                )
            else:
                members = Members(int(d["nodes"]), int(d["world"]), str(d["digest"]), loader)
            return cls(
                number=int(d["number"]),
                state=str(d["state"]),
                members=members,
                restarts=int(d.get("restarts", 0)),
                stalled=int(d.get("stalled", 0)),
                window=float(d.get("window", 0.0)),
                reason=str(d.get("reason", "")),
                exit_code=int(d.get("exit_code", 0)),
                root_cause=FailureCause.from_dict(d.get("root_cause")),
                seq=int(d.get("seq", 0)),
                prev=str(d.get("prev", "")),
                kept=int(d.get("kept", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousError(f"corrupt round record: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Claim:
    """Who watches membership (``node`` empty: nobody, the watcher left); ``term`` grows
    with every change of watcher."""

    node: str
    term: int

    def encode(self) -> bytes:
        return _dump(self, HEADER_VERSION)

    @classmethod
    def decode(cls, raw: bytes) -> Claim:
        d = _load(raw, "watcher", (HEADER_VERSION,))
        try:
            return cls(node=str(d["node"]), term=int(d["term"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousError(f"corrupt watcher record: {exc}") from exc


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
        try:
            return cls(addr=str(d["addr"]), port=int(d["port"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousError(f"corrupt master record: {exc}") from exc


def read_members(store: Store, keys: Keys, digest: str, count: int) -> tuple[Member, ...]:
    """The member list ``digest`` (``count`` members), chunk by chunk.

    Raises:
        RendezvousError: a chunk is missing, corrupt, or the list does not match its digest.
        StoreUnavailable: the store cannot be reached.
    """
    out: list[Member] = []
    for i in range((count + CHUNK - 1) // CHUNK):
        entry = store.get(keys.chunk(digest, i))
        if entry is None:
            raise RendezvousError(f"member list {digest}: chunk {i} is missing from the store")
        out.extend(decode_chunk(entry.value, digest, i))
    if len(out) != count or digest_of(out) != digest:
        raise RendezvousError(f"member list {digest} in the store does not match its digest")
    return tuple(out)


def with_loader(store: Store, keys: Keys, rnd: RoundRecord) -> RoundRecord:
    """``rnd`` whose member list (if only known by digest) is read from ``store`` on use."""
    m = rnd.members
    if not isinstance(m, Members) or m.loaded:
        return rnd
    digest, count = m.digest, len(m)
    members = Members(count, m.world, digest, lambda: read_members(store, keys, digest, count))
    return dataclasses.replace(rnd, members=members)


def read_round(store: Store, keys: Keys) -> RoundRecord | None:
    """The current round as a reader from outside sees it (its member list read on use).

    Raises:
        RendezvousError: the record is corrupt or from another flexrun version.
        StoreUnavailable: the store cannot be reached.
    """
    entry = store.get(keys.round)
    if entry is None:
        return None
    return with_loader(store, keys, RoundRecord.decode(entry.value))
