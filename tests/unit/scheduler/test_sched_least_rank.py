"""The index of engines by rank (:class:`~proxy.scheduler.routing.LeastRank`) against
the walk it replaces: after any sequence of admissions, first tokens and releases,
each followed by :meth:`~LeastRank.moved` where the rank changed (as the scheduler's
mark does), the least engine is the one ``min`` over the engines' ranks gives."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.config import EngineConfig
from proxy.scheduler import EngineState, Job, TrafficClass
from proxy.scheduler.routing import LeastRank

OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "first", "release"]), st.integers(0, 7), st.integers(1, 5)),
    max_size=300,
)


@given(engines=st.integers(1, 8), ops=OPS)
def test_least_rank_is_the_least_rank_after_any_changes(
    engines: int, ops: list[tuple[str, int, int]]
) -> None:
    states = [
        EngineState(EngineConfig(name=f"e{i}", models=frozenset({"m"})), 0.0)
        for i in range(engines)
    ]
    index = LeastRank(states)
    ranked = [e.rank for e in states]
    ids = iter(range(10**6))
    for kind, k, tokens in ops:
        i = k % engines
        e = states[i]
        if kind == "admit":
            cls = TrafficClass.BATCH if tokens % 2 else TrafficClass.INTERACTIVE
            e.admit(
                Job(id=f"j{next(ids)}", cls=cls, model="m", prompt_tokens=tokens * 100, arrival=0.0)
            )
        elif e.inflight:
            j = list(e.inflight.values())[tokens % len(e.inflight)]
            if kind == "first":
                e.start_decode(j)
            else:
                e.release(j.id)
        if e.rank is not ranked[i]:
            ranked[i] = e.rank
            index.moved(e)
        assert index.least() is min(states, key=lambda s: s.rank)
