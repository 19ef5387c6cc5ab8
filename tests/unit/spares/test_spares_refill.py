"""WarmPool's refill policy: a pool larger than one restart's need refills in batches of
``max_booting``, so one restart's worth of spares is ready first."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flexrun.spares.pool import WarmPool

pytestmark = pytest.mark.timeout(60)

NEVER_READY = [sys.executable, "-c", "import sys; sys.stdin.read()"]


def test_a_refill_boots_at_most_max_booting_spares_at_once(tmp_path: Path) -> None:
    pool = WarmPool(5, os.environ, tmp_path / "p", spare_command=NEVER_READY, max_booting=2)
    try:
        pool.fill()
        assert len(pool.spares) == 2  # both still importing: no third yet
        pool.fill()
        assert len(pool.spares) == 2
        pool.spares[0][1].write_text("")  # one is ready: one more may boot
        pool.fill()
        assert len(pool.spares) == 3
        for _, ready in pool.spares:
            ready.write_text("")
        pool.fill()
        assert len(pool.spares) == 5  # (the size bounds it)
        pool.close()
        pool.fill(count=4)  # a node's first workers: not held back
        assert len(pool.spares) == 4
    finally:
        pool.close()
