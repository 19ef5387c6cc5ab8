"""Injectable time: a Clock protocol and the real clock.

Library code takes a ``Clock`` so tests can drive time with
:class:`flexrun.testing.FakeClock` instead of sleeping. Nothing here patches ``time``.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Source of monotonic time and of sleeping."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes backwards."""
        ...

    def wall(self) -> float:
        """Epoch seconds, for records that humans and other hosts read."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds`` (a fake clock advances instead)."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()
