"""Test helpers shipped with flexrun: fake clock, in-memory store, fault injection.

Never imported by production code paths.
"""

from flexrun.store.memory import MemoryStore
from flexrun.testing.clock import FakeClock

__all__ = ["FakeClock", "MemoryStore"]
