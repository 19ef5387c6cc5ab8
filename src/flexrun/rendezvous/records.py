"""Reading and writing a round's records: the header, the slices, the member list.

Owns the store I/O that turns :mod:`flexrun.rendezvous.state` records into keys and back:
writing a member list (chunks, then every member's slice, in batched requests), reading
it back, reading one slice, and removing a list nobody references any more. Used by the
handler and by ``flexrun status``; no decisions here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from flexrun.errors import RendezvousError
from flexrun.rendezvous.state import (
    HEADER_VERSION,
    Keys,
    Member,
    Slice,
    chunks_of,
    digest_of,
    encode_chunk,
    read_members,
    read_round,
    slices_of,
    with_loader,
)
from flexrun.store.api import Entry, ReadsAt, Store


def write_members(store: Store, keys: Keys, members: Sequence[Member]) -> str:
    """Write ``members`` (chunks and slices) under its digest; returns the digest. Done
    before the header that names it is published, so a node that reads that header finds
    its slice."""
    digest = digest_of(members)
    if not members:
        return digest
    items = {
        keys.chunk(digest, i): encode_chunk(digest, i, chunk)
        for i, chunk in enumerate(chunks_of(members))
    }
    items.update({keys.slice(digest, s.node_id): s.encode() for s in slices_of(members)})
    store.put_many(items)
    return digest


def get_at(store: Store, key: str) -> tuple[Entry | None, int]:
    """``key``'s entry and a store revision read before or with it, to watch from: one
    request where the store has ``get_at`` (etcd: a read reports the revision it saw),
    else :meth:`Store.revision` then :meth:`Store.get`."""
    if isinstance(store, ReadsAt):
        entry, rev = store.get_at(key)
        return entry, int(rev)
    rev = store.revision()
    return store.get(key), rev


def read_slice(store: Store, keys: Keys, digest: str, node_id: str) -> Slice | None:
    """``node_id``'s slice of list ``digest``; None if absent or not for this list."""
    entry = store.get(keys.slice(digest, node_id))
    if entry is None:
        return None
    try:
        s = Slice.decode(entry.value)
    except RendezvousError:
        return None
    return s if s.digest == digest and s.node_id == node_id else None


def write_slice(store: Store, keys: Keys, s: Slice) -> None:
    store.put(keys.slice(s.digest, s.node_id), s.encode())


def ask_for_slice(store: Store, keys: Keys, node_id: str, digest: str) -> None:
    store.put(keys.ask(node_id), json.dumps({"v": HEADER_VERSION, "digest": digest}).encode())


def asked_digest(raw: bytes) -> str:
    try:
        d = json.loads(raw)
        return str(d["digest"]) if isinstance(d, dict) else ""
    except (ValueError, KeyError, UnicodeDecodeError):
        return ""


__all__ = [
    "ask_for_slice",
    "asked_digest",
    "get_at",
    "read_members",
    "read_round",
    "read_slice",
    "with_loader",
    "write_members",
    "write_slice",
]
