"""Waiting queues of the simulated engine: FCFS, or by ``priority`` (lower first).

As in vLLM, the policy is chosen by name through :func:`create_request_queue`,
which fails loudly on an unknown one.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from loadtests.sim.request import SimRequest


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(Protocol):
    def add(self, request: SimRequest) -> None: ...
    def prepend(self, request: SimRequest) -> None: ...
    def peek(self) -> SimRequest: ...
    def pop(self) -> SimRequest: ...
    def remove(self, request: SimRequest) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[SimRequest]: ...


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._items: deque[SimRequest] = deque()

    def add(self, request: SimRequest) -> None:
        self._items.append(request)

    def prepend(self, request: SimRequest) -> None:
        self._items.appendleft(request)

    def peek(self) -> SimRequest:
        return self._items[0]

    def pop(self) -> SimRequest:
        return self._items.popleft()

    def remove(self, request: SimRequest) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[SimRequest]:
        return iter(self._items)


class PriorityQueue:
    """Lowest ``(priority, arrival_time)`` first, ties in insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, SimRequest]] = []
        self._counter = itertools.count()

    def add(self, request: SimRequest) -> None:
        item = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, item)

    def prepend(self, request: SimRequest) -> None:
        self.add(request)

    def peek(self) -> SimRequest:
        return self._heap[0][3]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: SimRequest) -> None:
        self._heap = [item for item in self._heap if item[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[SimRequest]:
        return (item[3] for item in sorted(self._heap, key=lambda i: i[:3]))


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """The waiting queue for a policy given by enum or by name."""
    try:
        policy = SchedulingPolicy(policy)
    except ValueError:
        names = [p.value for p in SchedulingPolicy]
        raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {names}") from None
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    return FCFSQueue()
