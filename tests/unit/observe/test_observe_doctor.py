"""flexrun doctor's verdict and meeting protocol (pure parts, in memory)."""

from __future__ import annotations

import pytest

from flexrun.errors import ConfigError, RendezvousTimeout
from flexrun.observe.doctor import NodeResult, _Keys, flag_stragglers, meet
from flexrun.testing import FakeClock, MemoryStore


def r(node: str, compute_s: float, gbps: float) -> NodeResult:
    return NodeResult(
        node_id=node, rank=0, host="h", devices={"cpu": compute_s}, pair_gbps={"x": gbps}
    )


@pytest.mark.timeout(10)
def test_a_node_far_slower_than_the_others_median_is_flagged() -> None:
    nodes = [r("a", 0.010, 1.0), r("b", 0.011, 1.1), r("c", 0.050, 1.0), r("d", 0.010, 0.2)]
    flagged = flag_stragglers(nodes, threshold=2.0)
    assert [n.node_id for n in flagged] == ["c", "d"]
    assert "matmul 5.0x slower" in nodes[2].flags[0] and "bandwidth" in nodes[3].flags[0]


@pytest.mark.timeout(10)
def test_two_nodes_compare_with_each_other_and_one_node_is_never_flagged() -> None:
    fast, slow = r("a", 0.01, 1.0), r("b", 0.03, 1.0)
    assert flag_stragglers([fast, slow]) == [slow]
    assert flag_stragglers([r("a", 0.01, 1.0), r("b", 0.015, 1.0)]) == []
    assert flag_stragglers([slow]) == []


@pytest.mark.timeout(10)
def test_nodes_meet_in_a_roster_fixed_once_in_sorted_order() -> None:
    store, keys, clock = MemoryStore(), _Keys("job", "s"), FakeClock()
    store.put(keys.nodes + "b", b"1")
    assert meet(store, keys, "a", 2, timeout_s=5, sleep=clock.sleep, monotonic=clock.monotonic) == [
        "a",
        "b",
    ]
    with pytest.raises(ConfigError, match="without c"):
        meet(store, keys, "c", 2, timeout_s=5, sleep=clock.sleep, monotonic=clock.monotonic)
    with pytest.raises(RendezvousTimeout, match="1 of 3"):
        meet(MemoryStore(), keys, "a", 3, timeout_s=5, sleep=clock.sleep, monotonic=clock.monotonic)
