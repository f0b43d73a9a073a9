"""Where an interactive request goes among the engines that can take it.

The predicted wait for a first token on an engine is measured in prompt tokens:
those ahead of the request there (everything in prefill) plus its own. Conversation affinity keeps a
conversation on the engine whose prefix cache holds it, unless that engine's
predicted wait is worse than the best by more than the slack.
"""

from __future__ import annotations

import heapq
import operator
from collections import OrderedDict
from collections.abc import Sequence

from proxy.scheduler.state import EngineState
from proxy.scheduler.types import Job


def predicted_wait(engine: EngineState, job: Job) -> float:
    """Prompt tokens that must be prefilled on ``engine`` before ``job``'s first token."""
    return float(engine.prefill_tokens() + job.prompt_tokens)


class AffinityMap:
    """Conversation key -> engine it last ran on; least recently used keys drop out."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str | None) -> str | None:
        if key is None or key not in self._map:
            return None
        self._map.move_to_end(key)
        return self._map[key]

    def remember(self, key: str | None, engine: str) -> None:
        if key is None:
            return
        self._map[key] = engine
        self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


def pick_engine(
    candidates: Sequence[EngineState], job: Job, preferred: str | None, slack_tokens: int
) -> EngineState:
    """The candidate with the least predicted wait, or the preferred one if close enough.

    The wait is the engine's prefill tokens plus the job's own, the same for every
    engine, so the least wait is the least :attr:`EngineState.rank` (prefill tokens,
    jobs in flight, name), a counter read per engine."""
    best = min(candidates, key=_RANK)
    if preferred is None or preferred == best.name:
        return best
    other = next((e for e in candidates if e.name == preferred), None)
    return with_affinity(best, other, job, slack_tokens)


def with_affinity(
    best: EngineState, preferred: EngineState | None, job: Job, slack_tokens: int
) -> EngineState:
    """``preferred`` (the conversation's engine, if it can take ``job``) when its
    predicted wait is within the slack of ``best``'s, else ``best``."""
    if preferred is None or preferred is best:
        return best
    close = predicted_wait(preferred, job) <= predicted_wait(best, job) + slack_tokens
    return preferred if close else best


class LeastRank:
    """The engine of least :attr:`~EngineState.rank` among ``engines`` (one model's),
    without a walk over them: what :func:`pick_engine` returns when all of them can
    take the job.

    A heap of (rank, engine) entries. When an engine's rank changes the scheduler
    calls :meth:`moved`, which pushes the new entry; the old one stays behind and is
    dropped when it reaches the top (an entry is current while its rank is the very
    tuple the engine holds: :meth:`EngineState._add_phase` makes a new one per
    change). Ranks end with the engine's name, so no two compare equal and the
    engines themselves are never compared. The heap is rebuilt from the engines when
    stale entries make it several times their number, so it stays small."""

    __slots__ = ("_engines", "_heap", "_limit")

    def __init__(self, engines: Sequence[EngineState]) -> None:
        self._engines = engines
        self._limit = 8 * len(engines) + 64
        self._heap: list[tuple[tuple[int, int, str], EngineState]] = []
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(e.rank, e) for e in self._engines]
        heapq.heapify(self._heap)

    def moved(self, engine: EngineState) -> None:
        """``engine``'s rank changed (it must be one of the engines)."""
        heapq.heappush(self._heap, (engine.rank, engine))
        if len(self._heap) > self._limit:
            self._rebuild()

    def least(self) -> EngineState:
        """The engine of least rank (the engines must not be empty); drops the stale
        entries above it."""
        heap = self._heap
        while heap[0][0] is not heap[0][1].rank:
            heapq.heappop(heap)
        return heap[0][1]


_RANK = operator.attrgetter("rank")
