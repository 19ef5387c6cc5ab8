"""Key-value stores behind the rendezvous: memory (tests), tcp (embedded), etcd (v3)."""

from flexrun.store.api import Entry, Store
from flexrun.store.memory import MemoryStore

__all__ = ["Entry", "MemoryStore", "Store"]
