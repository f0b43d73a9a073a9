"""Where a request goes among the engines that can take it.

The predicted wait for a first token on an engine is measured in prompt tokens:
those ahead of the request there (everything in prefill) plus its own that the
engine must compute. By prefix (:func:`by_cost`, the default), the engine's own
are the prompt's tokens less those its prefix cache is expected to hold
(:mod:`proxy.scheduler.prefix`): a prompt goes where it costs least, so a
conversation stays on the engine that holds its history and a document's questions
follow the document, until that engine's queue outweighs what it holds.
Without a tokenized prompt, conversation affinity keeps a conversation on the
engine it last ran on, unless that engine's predicted wait is worse than the best
by more than the slack.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence

from proxy.scheduler.state import EngineState
from proxy.scheduler.types import Job, Route


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


def by_cost(
    candidates: Sequence[EngineState], job: Job, compute_first: bool = False
) -> tuple[EngineState, Route]:
    """The candidate where ``job`` waits least for its first token, counting what
    each holds of its prompt, and the receipt of the choice.

    The expected wait on an engine is its prompt tokens in prefill plus the job's
    uncached there. Ties go to the engine holding more of the prompt (an engine
    computing the prompt's prefix now: its wait counts that prefill, and a prompt
    sent behind it finds it cached, where another engine would compute it again),
    then to fewer jobs in flight, then to the emptier index (a new prefix goes
    where the cache has the most room: sequential requests on an idle fleet are
    spread, not all sent to the first engine), then to the name.
    Only engines holding the prompt's first block are matched further.

    ``compute_first`` (batch: its engines are those whose budget takes it now, and
    what counts is the work done, not one answer's wait) ranks by the uncached
    tokens first, then by the expected wait."""
    prompt, blocks = job.prompt_tokens, job.blocks
    won: EngineState | None = None
    won_key: tuple[int, int, int, int, int, str] | None = None
    won_cached = 0
    held: list[tuple[str, int]] = []
    for e in candidates:
        cached = 0
        if e.prefix.holds_first(blocks):
            cached = e.cached_tokens(job, pending=True)
            held.append((e.name, cached))
        rank = e.rank
        wait = rank[0] + prompt - cached
        first = prompt - cached if compute_first else wait
        key = (first, wait, -cached, rank[1], len(e.prefix), e.name)
        if won_key is None or key < won_key:
            won, won_key, won_cached = e, key, cached
    assert won is not None and won_key is not None, "no candidate"
    if won_cached == 0:
        held.append((won.name, 0))
    why = "prefix" if won_cached > 0 else "load"
    return won, Route(why, tuple(held), won_key[1])


class LeastRank:
    """The engine of least :attr:`~EngineState.rank` among ``engines`` (one model's),
    without a walk over them: what :func:`pick_engine` returns when all of them can
    take the job.

    A tournament tree over the engines, in a flat list: the leaves are the engines,
    each inner node holds the lesser-ranked of its two children, so the root holds
    the least. When an engine's rank changes the scheduler calls :meth:`moved`, which
    replays the matches on the leaf's path to the root (log2 of the engines: 6 for
    64); reading the least is reading the root. Nothing is allocated per change, and
    no entry goes stale. Ranks end with the engine's name, so no two compare equal and
    the least is the one ``min`` over the engines' ranks gives."""

    __slots__ = ("_place", "_tree")

    def __init__(self, engines: Sequence[EngineState]) -> None:
        leaves = 1
        while leaves < len(engines):
            leaves *= 2
        self._place = {e.name: leaves + i for i, e in enumerate(engines)}
        self._tree: list[EngineState | None] = [None] * leaves + list(engines)
        self._tree += [None] * (2 * leaves - len(self._tree))
        for node in range(leaves - 1, 0, -1):
            self._play(node)

    def _play(self, node: int) -> None:
        tree = self._tree
        a, b = tree[2 * node], tree[2 * node + 1]
        tree[node] = a if b is None or (a is not None and a.rank < b.rank) else b

    def moved(self, engine: EngineState) -> None:
        """``engine``'s rank changed (it must be one of the engines)."""
        tree, node = self._tree, self._place[engine.name] // 2
        while node:  # _play, inlined: it runs on every dispatch and finish
            a, b = tree[2 * node], tree[2 * node + 1]
            tree[node] = a if b is None or (a is not None and a.rank < b.rank) else b
            node //= 2

    def least(self) -> EngineState:
        """The engine of least rank (the engines must not be empty)."""
        best = self._tree[1]  # the root (with one engine, its leaf)
        assert best is not None
        return best


_RANK = operator.attrgetter("rank")
