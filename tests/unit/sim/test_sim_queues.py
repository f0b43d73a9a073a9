"""Waiting queues: FCFS, priority (lower value first, ties by arrival), the factory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.sim.queues import (
    FCFSQueue,
    PriorityQueue,
    SchedulingPolicy,
    create_request_queue,
)

from .helpers import make_request


def test_fcfs_pops_in_insertion_order_and_prepend_goes_first() -> None:
    q = FCFSQueue()
    a, b, c = (make_request(r, 1, 1, priority=p) for r, p in [("a", 9), ("b", 0), ("c", 5)])
    for r in (a, b, c):
        q.add(r)
    assert [r.request_id for r in q] == ["a", "b", "c"]
    assert q.peek() is a
    assert q.pop() is a
    q.prepend(a)
    assert q.peek() is a
    q.remove(b)
    assert [q.pop(), q.pop()] == [a, c]
    assert len(q) == 0


def test_priority_pops_lower_value_first_then_earlier_arrival() -> None:
    q = PriorityQueue()
    spec = [("late-urgent", 0, 5.0), ("early-lazy", 3, 0.0), ("early-urgent", 0, 1.0)]
    for rid, priority, arrival in spec:
        q.add(make_request(rid, 1, 1, priority=priority, arrival=arrival))
    assert [r.request_id for r in q] == ["early-urgent", "late-urgent", "early-lazy"]
    assert q.peek().request_id == "early-urgent"
    assert [q.pop().request_id for _ in range(3)] == [
        "early-urgent",
        "late-urgent",
        "early-lazy",
    ]


def test_priority_accepts_negative_priorities() -> None:
    q = PriorityQueue()
    q.add(make_request("zero", 1, 1, priority=0))
    q.add(make_request("minus", 1, 1, priority=-10))
    assert q.pop().request_id == "minus"


def test_priority_prepend_keeps_rank_instead_of_jumping_the_queue() -> None:
    q = PriorityQueue()
    q.add(make_request("urgent", 1, 1, priority=0, arrival=2.0))
    q.prepend(make_request("preempted", 1, 1, priority=1, arrival=0.0))
    assert q.pop().request_id == "urgent"


def test_priority_remove_keeps_the_heap_ordered() -> None:
    q = PriorityQueue()
    requests = [make_request(f"r{p}", 1, 1, priority=p) for p in (4, 1, 3, 0, 2)]
    for r in requests:
        q.add(r)
    q.remove(requests[3])  # priority 0, the head
    q.remove(requests[0])
    assert [q.pop().request_id for _ in range(len(q))] == ["r1", "r2", "r3"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-3, 3), st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        min_size=1,
        max_size=30,
    )
)
def test_priority_order_is_priority_then_arrival_then_insertion(
    spec: list[tuple[int, float]],
) -> None:
    q = PriorityQueue()
    for i, (priority, arrival) in enumerate(spec):
        q.add(make_request(str(i), 1, 1, priority=priority, arrival=arrival))
    expected = sorted(range(len(spec)), key=lambda i: (spec[i][0], spec[i][1], i))
    assert [int(r.request_id) for r in q] == expected
    assert [int(q.pop().request_id) for _ in range(len(spec))] == expected


@pytest.mark.parametrize(
    ("policy", "kind"),
    [
        ("fcfs", FCFSQueue),
        ("priority", PriorityQueue),
        (SchedulingPolicy.FCFS, FCFSQueue),
        (SchedulingPolicy.PRIORITY, PriorityQueue),
    ],
)
def test_factory_builds_the_queue_for_a_policy(policy: object, kind: type) -> None:
    assert isinstance(create_request_queue(policy), kind)  # type: ignore[arg-type]


def test_factory_fails_loudly_on_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'lifo'.*fcfs.*priority"):
        create_request_queue("lifo")
