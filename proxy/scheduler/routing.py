"""Where an interactive request goes among the engines that can take it.

The predicted wait for a first token on an engine is measured in prompt tokens:
those ahead of the request there (everything in prefill) plus its own. Conversation affinity keeps a
conversation on the engine whose prefix cache holds it, unless that engine's
predicted wait is worse than the best by more than the slack.
"""

from __future__ import annotations

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
    if preferred is not None and preferred != best.name:
        for engine in candidates:
            if engine.name == preferred:
                if predicted_wait(engine, job) <= predicted_wait(best, job) + slack_tokens:
                    return engine
                break
    return best


_RANK = operator.attrgetter("rank")
