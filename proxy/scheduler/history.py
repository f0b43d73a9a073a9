"""Each engine's turns second by second, in a bounded ring.

:class:`TurnHistory` keeps, for each of the last ``span_s`` whole seconds of the
scheduler's clock, how long the engine spent in each turn. The scheduler charges
it as it accounts the time (:meth:`EngineState.account`), so it costs nothing per
read; a reader adds the time since the last event with :meth:`TurnHistory.seconds`
without changing it. ``GET /turn`` judges the recent window from it and
``GET /turn/history`` serves it, so a page opened now shows the last minute at once.
"""

from __future__ import annotations

import math
from collections import deque

from proxy.scheduler.types import Turn

Second = tuple[int, dict[Turn, float]]
DEFAULT_SPAN_S = 300


class TurnHistory:
    """Seconds spent in each turn, per whole second of the clock, the last
    ``span_s`` seconds only."""

    def __init__(self, span_s: int = DEFAULT_SPAN_S) -> None:
        self.span_s = span_s
        self._seconds: deque[Second] = deque(maxlen=span_s)

    def charge(self, start: float, end: float, turn: Turn) -> None:
        """Charge the time from ``start`` to ``end`` to ``turn``, split at whole seconds."""
        t = max(start, end - self.span_s)
        while t < end:
            second = math.floor(t)
            upto = min(end, second + 1.0)
            self._second(second)[turn] += upto - t
            t = upto

    def _second(self, second: int) -> dict[Turn, float]:
        if not self._seconds or self._seconds[-1][0] < second:
            self._seconds.append((second, dict.fromkeys(Turn, 0.0)))
        return self._seconds[-1][1]

    def seconds(
        self, start: float, end: float, turn: Turn, last: int | None = None
    ) -> list[Second]:
        """The ``last`` seconds (all kept, if None) as they stand at ``end``: the
        time from ``start`` (the last charge) to ``end`` counted as ``turn``. A read."""
        keep = self.span_s if last is None else max(1, last)
        recent = list(self._seconds)[-(keep + 1) :]
        copy = TurnHistory(self.span_s)
        copy._seconds.extend((s, dict(shares)) for s, shares in recent)
        copy.charge(start, end, turn)
        return list(copy._seconds)[-keep:]


def shares(seconds: list[Second]) -> dict[Turn, float]:
    """The share of the time in each turn over ``seconds`` (all zero if none)."""
    totals = dict.fromkeys(Turn, 0.0)
    for _, spent in seconds:
        for turn, s in spent.items():
            totals[turn] += s
    whole = sum(totals.values())
    return {t: (s / whole if whole > 0 else 0.0) for t, s in totals.items()}
