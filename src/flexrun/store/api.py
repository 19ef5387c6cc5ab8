"""The store protocol every rendezvous backend implements.

Owns the contract only: revisions, compare-and-set, keys that expire unless refreshed,
batched writes and a bounded wait for change. It does not know about rounds, nodes or
ranks (that is ``flexrun.rendezvous``) nor about authentication (``flexrun.store.signed``
wraps any store). Values are bytes; callers store schema-versioned JSON, never pickles.

Revisions are store-wide and increase with every write (etcd's ``mod_revision``; a
counter on the tcp store). Revision 0 means "absent", so ``compare_and_set(...,
expected_revision=0)`` creates a key only if it does not exist.

Cost model (what the rendezvous at 10,000 nodes relies on): every call is O(size of what
it returns or writes), except the reads and watches named below. A lost compare-and-set
returns ``(False, None)``: the caller learns that it lost, never the winner's value (etcd
transfers nothing; the tcp server's own compare-and-set answers with the current value, so
callers keep compare-and-set values small). A repeated ``get_prefix`` of the same prefix
transfers only what changed since the previous one (both backends keep a snapshot).

Optional: a store whose reads report the store revision they saw (etcd) also has
``get_at(key) -> (Entry | None, revision)``, one request that stands for :meth:`revision`
then :meth:`get` (:class:`ReadsAt`); callers fall back to those two without it.

Optional, together: a store whose change notifications carry the written values (etcd's
watch events hold them) has ``get_prefix_at(prefix) -> (entries, revision)``, every live
entry under ``prefix`` and the revision they are as of, in one request, and
``watch_values(prefix, since_revision, timeout_s) -> (events, revision)``, which blocks as
:meth:`Store.wait_for_change` but returns what changed: ``events`` lists ``(key, entry)``
in revision order for every write under ``prefix`` after ``since_revision`` (``entry``
None: deleted or expired), empty when ``timeout_s`` passed, None when the store can no
longer tell (its history was compacted: read the prefix again); ``revision`` is the next
``since_revision``, no event at or below it is missing. With both, a reader keeps a copy
of a small prefix up to date at no request per change (:mod:`flexrun.rendezvous.changewatch`).
Callers ask for them as :class:`WatchesValues`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Entry:
    """A value and the store revision that last wrote it."""

    value: bytes
    revision: int


Event = tuple[str, "Entry | None"]
"""One change under a watched prefix: the key and what it holds now (None: gone)."""


@runtime_checkable
class Store(Protocol):
    """A small consistent key-value store shared by the agents of one job."""

    def get(self, key: str) -> Entry | None:
        """Return the live entry for ``key``, or None if absent or expired.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        """Return every live entry whose key starts with ``prefix``.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        """Write unconditionally and return the new revision.

        With ``ttl_s`` the key is a keep-alive: it counts as absent once it has not been
        written for ``ttl_s`` seconds, and writing it again (same value, same ``ttl_s``)
        refreshes it. Who judges expiry differs by backend: etcd attaches the key to a
        lease that etcd expires (whole seconds, at least etcd's minimum TTL, checked every
        500 ms; a refresh is a lease keep-alive that leaves the key's revision unchanged);
        the tcp store lets each reader judge (it must have watched the key unchanged for
        ``ttl_s``, so a key it sees for the first time looks fresh for a full TTL: such a
        store sets a class attribute ``judges_ttl_locally = True``, which callers read
        with :func:`judges_ttl_locally`).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def put_many(self, items: Mapping[str, bytes]) -> int:
        """Write several keys (no TTL) in as few requests as the backend allows; return
        the highest new revision (0 for no items). Not atomic: a reader may see some of
        them before the others, so write what must be complete first, then publish it
        with one compare-and-set.

        Raises:
            StoreUnavailable: the store cannot be reached (some keys may be written).
        """
        ...

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        """Write only if the key's revision is ``expected_revision`` (0: key absent).

        Returns ``(True, new_entry)`` on success, else ``(False, None)``: a lost
        compare-and-set never hands back the current value (read it with :meth:`get`
        when needed).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting an absent key is not an error.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key under ``prefix`` (which must not be empty). Meant for keys
        nobody reads any more (a superseded round's slices): on the tcp store a reader of
        one of them at that instant may wait out its op timeout.

        Raises:
            StoreUnavailable: the store cannot be reached (some keys may be left).
        """
        ...

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        """Block until a key under ``prefix`` is written after ``since_revision``, or timeout.

        Returns ``(changed, revision)``: pass ``revision`` as the next ``since_revision``.
        Spurious wake-ups are allowed (``changed`` may be True for a write that left the
        value equal, or for a write in the same directory when ``prefix`` does not end
        with ``/``); a missed change is not.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def revision(self) -> int:
        """The store's current revision (read it *before* reading state you will watch).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


@runtime_checkable
class ReadsAt(Protocol):
    """Optional: a read that reports the store revision it saw (etcd)."""

    def get_at(self, key: str) -> tuple[Entry | None, int]: ...


@runtime_checkable
class WatchesValues(Protocol):
    """Optional: change notifications that carry the written values (etcd)."""

    def get_prefix_at(self, prefix: str) -> tuple[dict[str, Entry], int]: ...

    def watch_values(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[list[Event] | None, int]: ...


@runtime_checkable
class JudgesTtl(Protocol):
    """A store whose readers judge a keep-alive's age themselves (tcp: see :meth:`Store.put`)."""

    judges_ttl_locally: bool


def judges_ttl_locally(store: object) -> bool:
    """Whether ``store``'s readers judge keep-alive TTLs themselves (:class:`JudgesTtl`)."""
    return isinstance(store, JudgesTtl) and bool(store.judges_ttl_locally)


def local_expiry(store: object, key: str) -> float | None:
    """When (monotonic clock) ``store``'s client will judge the keep-alive ``key`` expired
    unless it reads a newer write first: the optional ``expires_at(key)`` of a store that
    judges TTLs locally (tcp). None: the store does not say (etcd expires keys itself),
    or this client has not read that keep-alive."""
    at = getattr(store, "expires_at", None)
    return at(key) if callable(at) else None
