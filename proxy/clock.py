"""Clocks for the proxy's scheduler and for the simulated engine.

Neither reads the time itself: each is handed a :class:`Clock`. In
tests and offline experiments that clock is a :class:`VirtualClock` that only moves
when the driver advances it, so a run has no sleeps at all. In the server it is a
:class:`WallClock`, optionally running faster than real time (``time_scale``).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Model time in seconds; monotonic, origin arbitrary."""

    def now(self) -> float: ...


class VirtualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds} s")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)


class WallClock:
    """Model time that follows the monotonic wall clock, ``time_scale`` times faster.

    ``to_wall(dt)`` converts a span of model time to the wall time to sleep for it.
    """

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = time_scale
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.time_scale

    def to_wall(self, model_seconds: float) -> float:
        return model_seconds / self.time_scale
