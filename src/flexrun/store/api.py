"""The store protocol every rendezvous backend implements.

Owns the contract only: revisions, compare-and-set, keys that expire unless refreshed,
and a bounded wait for change. It does not know about rounds, nodes or ranks (that is
``flexrun.rendezvous``). Values are bytes; callers store schema-versioned JSON, never
pickles.

Revisions are store-wide and increase with every write (etcd's ``mod_revision``; a
counter on the tcp store). Revision 0 means "absent", so ``compare_and_set(...,
expected_revision=0)`` creates a key only if it does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Entry:
    """A value and the store revision that last wrote it."""

    value: bytes
    revision: int


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
        written for ``ttl_s`` seconds (etcd: a lease; tcp: judged by the reader, who must
        have watched the key unchanged for that long, so a key it sees for the first time
        looks fresh for a full TTL: such a store sets a class attribute
        ``judges_ttl_locally = True``, which the rendezvous reads with ``getattr``).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        """Write only if the key's revision is ``expected_revision`` (0: key absent).

        Returns ``(True, new_entry)`` on success, else ``(False, current_entry_or_None)``.

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

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        """Block until a key under ``prefix`` is written after ``since_revision``, or timeout.

        Returns ``(changed, revision)``: pass ``revision`` as the next ``since_revision``.
        Spurious wake-ups are allowed (``changed`` may be True for a write that left the
        value equal); a missed change is not.

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
