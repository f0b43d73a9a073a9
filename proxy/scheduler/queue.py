"""The scheduler's queues: jobs in arrival order, indexed by model.

A :class:`JobQueue` reads like the deque it replaces (iteration in order, ``len``,
``[0]``, ``append``, ``appendleft``, ``remove``), but every change is O(1) and it
keeps one line per model, so a dispatch decision reads only the heads of the
models an engine serves instead of scanning the whole queue.

Order is ``Job.order``: the tier's band, the job's fair tag (:mod:`proxy.scheduler.fair`;
0 with fair share off) and a sequence number: ``append`` gives the next one up,
``appendleft`` (a job requeued after a failure) the next one down, in a band before
every other. Each line keeps one flow per tenant's chats or batch job, whose orders
rise in arrival order; each flow keeps the jobs pushed to its back and those pushed
to its front in two insertion-ordered dicts, so both ends and removal by id are O(1).
A line's first job is the least first of its flows (one flow: O(1)); it is read in
order by merging its flows.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from proxy.scheduler.types import Job


class _Flow:
    """One flow's jobs in order (:mod:`proxy.scheduler.fair`): ``front`` (pushed
    left, newest first) then ``back``; their orders rise along it."""

    __slots__ = ("back", "front")

    def __init__(self) -> None:
        self.front: dict[str, Job] = {}
        self.back: dict[str, Job] = {}

    def first(self) -> Job | None:
        if self.front:
            return next(reversed(self.front.values()))
        return next(iter(self.back.values()), None)

    def __iter__(self) -> Iterator[Job]:
        yield from reversed(self.front.values())
        yield from self.back.values()


def _order(job: Job) -> tuple[int, float, int]:
    return job.order


class _Line:
    """Jobs in order: per flow (a tenant's chats, a batch job) in arrival order, and
    across flows by each job's ``order`` (tier band, fair tag, sequence)."""

    __slots__ = ("excluding", "flows", "n", "pinned")

    def __init__(self) -> None:
        self.flows: dict[tuple[str, str], _Flow] = {}
        self.n = 0
        # counted as jobs come and go; a look over the line at each read instead: chat
        # 64 x 10,000 16 times as long, cap 64 x 10,000 37 times (the scheduler figure:
        # proxy.scheduler.core's docstring)
        self.excluding = 0  # jobs here that some engine may not take (job.excluded)
        self.pinned = 0  # jobs here pinned to one engine (job.pinned)

    def push(self, job: Job, left: bool) -> None:
        key = (job.tenant, job.flow)
        flow = self.flows.get(key)
        if flow is None:
            flow = self.flows[key] = _Flow()
        (flow.front if left else flow.back)[job.id] = job
        self.n += 1
        if job.excluded:
            self.excluding += 1
        if job.pinned is not None:
            self.pinned += 1

    def pop(self, job: Job) -> None:
        key = (job.tenant, job.flow)
        flow = self.flows[key]
        if flow.back.pop(job.id, None) is None:
            del flow.front[job.id]
        if not flow.front and not flow.back:
            del self.flows[key]
        self.n -= 1
        if job.excluded:
            self.excluding -= 1
        if job.pinned is not None:
            self.pinned -= 1

    def first(self) -> Job | None:
        if len(self.flows) == 1:
            return next(iter(self.flows.values())).first()
        best: Job | None = None
        for flow in self.flows.values():
            job = flow.first()
            if job is not None and (best is None or job.order < best.order):
                best = job
        return best

    def __iter__(self) -> Iterator[Job]:
        if len(self.flows) == 1:
            return iter(next(iter(self.flows.values())))
        return heapq.merge(*self.flows.values(), key=_order)

    def __len__(self) -> int:
        return self.n


class JobQueue:
    """One class's queued jobs, in order overall and per model."""

    def __init__(self) -> None:
        self._all = _Line()
        # one line per model; built from the whole queue at each read instead: chat
        # 64 x 1,000 300 µs, not 18; cap 64 x 1,000 450, not 10 (and it grows with the
        # queue; the scheduler figure: proxy.scheduler.core's docstring)
        self._models: dict[str, _Line] = {}
        self._seq: dict[str, int] = {}
        self._next = 0
        self._prev = -1

    def append(self, job: Job, band: int = 1, tag: float = 0.0) -> None:
        """Queue ``job`` last of its ``band`` (a tier's rank) at fair ``tag``."""
        job.order = (band, tag, self._next)
        self._push(job, self._next, left=False)
        self._next += 1

    def appendleft(self, job: Job) -> None:
        """Queue ``job`` first of all (a job requeued: it had its turn already)."""
        job.order = (-1, 0.0, self._prev)
        self._push(job, self._prev, left=True)
        self._prev -= 1

    def _push(self, job: Job, seq: int, left: bool) -> None:
        if job.id in self._seq:
            raise ValueError(f"job {job.id!r} is queued already")
        self._seq[job.id] = seq
        self._all.push(job, left)
        line = self._models.get(job.model)
        if line is None:
            line = self._models[job.model] = _Line()
        line.push(job, left)

    def remove(self, job: Job) -> None:
        """Take ``job`` out (ValueError if it is not queued here)."""
        if self._seq.pop(job.id, None) is None:
            raise ValueError(f"job {job.id!r} is not queued")
        self._all.pop(job)
        line = self._models[job.model]
        line.pop(job)
        if not line:
            del self._models[job.model]

    def seq(self, job: Job) -> tuple[int, float, int]:
        """The job's place in the order (smaller is earlier)."""
        return job.order

    def models(self) -> list[str]:
        """The models with queued jobs."""
        return list(self._models)

    def of_model(self, model: str) -> Iterator[Job]:
        """The model's queued jobs, in order."""
        line = self._models.get(model)
        return iter(line) if line is not None else iter(())

    def count_of_model(self, model: str) -> int:
        """How many jobs of ``model`` are queued."""
        line = self._models.get(model)
        return len(line) if line is not None else 0

    def first_of_model(self, model: str) -> Job | None:
        line = self._models.get(model)
        return line.first() if line is not None else None

    def none_excluding(self) -> bool:
        """Whether :meth:`all_eligible` holds for every model (no queued job has failed
        somewhere): one counter, not a walk over the models."""
        return self._all.excluding == 0

    def earliest_first(self, models: Iterable[str]) -> Job | None:
        """The earliest of the first jobs of ``models``; None if none is queued."""
        best: Job | None = None
        for model in models:
            line = self._models.get(model)
            job = line.first() if line is not None else None
            if job is not None and (best is None or job.order < best.order):
                best = job
        return best

    def all_eligible(self, model: str) -> bool:
        """Whether every queued job of ``model`` may go to any engine serving it (none
        has failed somewhere), so the line's first job is every such engine's first."""
        line = self._models.get(model)
        return line is None or line.excluding == 0

    def nth_of_model(self, model: str, n: int) -> Job | None:
        """The model's ``n``-th queued job (0 first), None past the end; O(n)."""
        line = self._models.get(model)
        if line is None:
            return None
        if n == 0:
            return line.first()
        return next(itertools.islice(line, n, None), None)

    def first_for(self, name: str, models: Iterable[str]) -> Job | None:
        """The first queued job of any of ``models`` that engine ``name`` may take:
        per model the first job not excluding it, the earliest of those."""
        best: Job | None = None
        for model in models:
            line = self._models.get(model)
            if line is None:
                continue
            if line.excluding == 0:
                job = line.first()
            else:
                job = next((j for j in line if name not in j.excluded), None)
            if job is not None and (best is None or job.order < best.order):
                best = job
        return best

    def __contains__(self, job: object) -> bool:
        return isinstance(job, Job) and self._seq.get(job.id) is not None

    def __iter__(self) -> Iterator[Job]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._seq)

    def __bool__(self) -> bool:
        return bool(self._seq)

    def __getitem__(self, index: int) -> Job:
        if index == 0 and self._seq:
            first = self._all.first()
            assert first is not None
            return first
        jobs = list(self._all)
        return jobs[index]

    def count_for(self, name: str, models: Iterable[str]) -> int:
        """How many queued jobs of ``models`` engine ``name`` may take (neither
        excluding it nor pinned elsewhere): a line's length where none of its jobs
        excludes an engine or is pinned, a walk of the line otherwise."""
        total = 0
        for model in models:
            line = self._models.get(model)
            if line is None:
                continue
            if line.excluding == 0 and line.pinned == 0:
                total += len(line)
            else:
                total += sum(
                    1
                    for j in line
                    if name not in j.excluded and (j.pinned is None or j.pinned == name)
                )
        return total
