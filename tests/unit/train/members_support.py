"""Several live members played by threads of one test process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


def run_members(fns: Sequence[Callable[[], Any]], timeout_s: float = 60.0) -> list[Any]:
    """Run each member's part in its own thread; their results, or the exceptions they
    raised (for the test to assert on), in order. Fails when one has not returned."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as exc:  # handed back to the test, which asserts on it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), "a member never returned"
    return out
