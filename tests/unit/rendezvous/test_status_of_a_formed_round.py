"""`flexrun status` reads a round the rendezvous wrote (header, member list in chunks),
and says what to do when the job's records are signed and it has no secret."""

from __future__ import annotations

import pytest

from flexrun.config import RendezvousSettings
from flexrun.errors import ConfigError
from flexrun.events import EventLog
from flexrun.observe.status import read_status
from flexrun.rendezvous import NodeRecord, RendezvousHandler, Run
from flexrun.store.memory import MemoryStore
from flexrun.store.signed import SignedStore
from flexrun.testing import FakeClock


def _form(store: object, n: int, clock: FakeClock) -> list[RendezvousHandler]:
    s = RendezvousSettings(min_nodes=n, max_nodes=n, last_call_s=0)
    hs = []
    for i in range(n):
        h = RendezvousHandler(
            store,  # type: ignore[arg-type]
            run_id="job",
            me=NodeRecord(f"n{i}", f"10.0.0.{i}", 2),
            settings=s,
            events=EventLog(None, run_id="job", node=f"n{i}"),
            clock=clock,
        )
        h._beat()
        h.store.put(h.keys.node(h.me.node_id), h.me.encode())
        hs.append(h)
    for h in hs:
        h.step(None)
    for h in hs:
        assert isinstance(h.step(None), Run)
    return hs


def test_status_lists_the_members_of_a_round_written_as_header_and_slices() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    _form(store, 5, clock)
    st = read_status(store, "job", observe_s=0, clock=clock)
    assert (st.round, st.state, st.world_size) == (1, "running", 10)
    assert [m.node_id for m in st.members] == [f"n{i}" for i in range(5)]
    assert st.members[3].ranks == (6, 7) and st.members[3].group_rank == 3


def test_status_of_a_signed_job_needs_the_secret() -> None:
    clock = FakeClock()
    raw = MemoryStore(clock)
    signed = SignedStore(raw, b"s" * 32, clock=clock)
    _form(signed, 2, clock)
    with pytest.raises(ConfigError, match="secret"):
        read_status(raw, "job", observe_s=0, clock=clock)
    st = read_status(SignedStore(raw, b"s" * 32, clock=clock), "job", observe_s=0, clock=clock)
    assert st.round == 1 and len(st.members) == 2
