"""Each tenant's limits on its batch work, as the runner keeps them: over a limit a
job or a line waits, and nothing is failed for it.

The counts are the :class:`~proxy.scheduler.limits.TenantMeter`'s (one meter for
the HTTP edge and the runner; reads never change it): the gate asks it for room and
tells it what starts and ends; what it adds is the waiting, and who goes first when
room frees.

- ``batch_jobs``: a job waits for a slot before it feeds a line (its status stays
  ``in_progress``); the tenant's waiting jobs start oldest first, each as a running
  one ends (:meth:`TenantGate.job`).
- ``batch_lines``: a line waits for a slot before it is fed; a slot freed goes to
  the waiting job of that tenant with the fewest lines in flight, so that a
  tenant's jobs share its lines evenly (the scheduler then serves them by flow, the
  job's id) and a new job is not stuck behind its tenant's long one
  (:meth:`TenantGate.line`).
- ``requests_per_minute``, ``tokens_per_minute``, ``streams``: before each try at a
  line the meter is asked (:meth:`TenantGate.request`); a refusal waits its
  ``retry_after_s`` and asks again. A tenant's lines under ``requests_per_minute``
  start at most one per ``60 / requests_per_minute`` seconds (the meter's window
  over the limit): lines that asked
  together would otherwise all pass before the first was counted (the forwarder
  counts a request once its prompt is counted). Under ``tokens_per_minute`` alone
  the lines that pass in the same instant may overshoot it by what they bring.

Each line held for a limit is counted once (``limited(tenant, limit)``: the first
limit that held it), each job held for ``batch_jobs`` once. The limits hold within
this proxy: replicas that share a PostgreSQL store hold each tenant to them each.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio

from proxy.config import Tenant
from proxy.scheduler.limits import TenantMeter

logger = logging.getLogger(__name__)
Limited = Callable[[str, str], None]
"""``limited(tenant, limit)``: a line (or a job) held for ``limit``."""

BATCH_JOBS = "batch_jobs"
BATCH_LINES = "batch_lines"
REQUESTS_PER_MINUTE = "requests_per_minute"


def _uncounted(tenant: str, limit: str) -> None:
    """Holds counted nowhere (the runner's default)."""


@dataclass
class Slot:
    """A line's place under its tenant's ``batch_lines``: given by
    :meth:`TenantGate.line`, handed back by :meth:`TenantGate.line_done`.
    ``held``: whether a limit held the line (it is counted once)."""

    tenant: Tenant
    batch_id: str
    held: bool = False


@dataclass
class _Waiting:
    """One tenant's waiters: its jobs waiting for a job slot, oldest first; the jobs
    whose feeder waits for a line slot (one each), in the order they came; its
    lines in flight by job; when its next line may start (``requests_per_minute``)."""

    jobs: OrderedDict[str, anyio.Event] = field(default_factory=OrderedDict)
    lines: dict[str, anyio.Event] = field(default_factory=dict)
    in_flight: Counter[str] = field(default_factory=Counter)
    next_start: float = 0.0

    def idle(self) -> bool:
        return not (self.jobs or self.lines or +self.in_flight) and self.next_start == 0.0


class TenantGate:
    """The runner's waits for each tenant's batch limits (module docstring)."""

    def __init__(self, meter: TenantMeter, limited: Limited | None = None) -> None:
        self.meter = meter
        self.limited = limited or _uncounted
        self._tenants: dict[str, _Waiting] = {}

    def _of(self, name: str) -> _Waiting:
        return self._tenants.setdefault(name, _Waiting())

    def _forget(self, name: str) -> None:
        found = self._tenants.get(name)
        if found is not None and found.idle():
            del self._tenants[name]

    def waiting_job(self, tenant: str, batch_id: str) -> bool:
        """Whether the job waits for one of its tenant's ``batch_jobs`` slots (a read)."""
        found = self._tenants.get(tenant)
        return found is not None and batch_id in found.jobs

    # -- jobs ------------------------------------------------------------------------

    @asynccontextmanager
    async def job(self, tenant: Tenant, batch_id: str) -> AsyncIterator[None]:
        """The job running its lines for the block, once a ``batch_jobs`` slot is
        free (the tenant's jobs that waited before it go first)."""
        await self._job_slot(tenant, batch_id)
        try:
            yield
        finally:
            self._job_done(tenant)

    async def _job_slot(self, tenant: Tenant, batch_id: str) -> None:
        waiting = self._of(tenant.name)
        if not waiting.jobs and self.meter.batch_job_room(tenant):
            self.meter.job_started(tenant)
            return
        event = waiting.jobs[batch_id] = anyio.Event()
        self.limited(tenant.name, BATCH_JOBS)
        logger.info(
            "batch %s waits: tenant %s runs its batch_jobs (%s) already",
            batch_id, tenant.name, tenant.limits.batch_jobs,
        )  # fmt: skip
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # given a slot, and cancelled before it woke
                self._job_done(tenant)
            else:
                waiting.jobs.pop(batch_id, None)
                self._forget(tenant.name)
            raise

    def _job_done(self, tenant: Tenant) -> None:
        """A running job stops: its slot to the oldest waiting job of the tenant."""
        self.meter.job_finished(tenant)
        waiting = self._of(tenant.name)
        while waiting.jobs and self.meter.batch_job_room(tenant):
            _, event = waiting.jobs.popitem(last=False)
            self.meter.job_started(tenant)
            event.set()
        self._forget(tenant.name)

    # -- lines -----------------------------------------------------------------------

    async def line(self, tenant: Tenant, batch_id: str) -> Slot:
        """A ``batch_lines`` slot for one of the job's lines: at once while the
        tenant has room (and no job of it waits), else the next one freed that this
        job is owed. One waiter per job (its feeder feeds one line at a time)."""
        slot = Slot(tenant, batch_id)
        waiting = self._of(tenant.name)
        if not waiting.lines and self.meter.batch_lines_room(tenant):
            self._start(slot)
            return slot
        assert batch_id not in waiting.lines, "one feeder per job"
        event = waiting.lines[batch_id] = anyio.Event()
        self._hold(slot, BATCH_LINES)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # given the slot, and cancelled before it woke
                self.line_done(slot)
            else:
                waiting.lines.pop(batch_id, None)
                self._forget(tenant.name)
            raise
        return slot

    def _start(self, slot: Slot) -> None:
        self.meter.line_started(slot.tenant)
        self._of(slot.tenant.name).in_flight[slot.batch_id] += 1

    def line_done(self, slot: Slot) -> None:
        """The line is no longer in flight: its slot to the tenant's waiting job with
        the fewest lines in flight (the one that waited longest among equals)."""
        tenant = slot.tenant
        self.meter.line_finished(tenant)
        waiting = self._of(tenant.name)
        waiting.in_flight[slot.batch_id] -= 1
        while waiting.lines and self.meter.batch_lines_room(tenant):
            owed = min(waiting.lines, key=lambda job: waiting.in_flight[job])
            event = waiting.lines.pop(owed)
            self._start(Slot(tenant, owed))
            event.set()
        self._forget(tenant.name)

    # -- requests --------------------------------------------------------------------

    async def request(self, slot: Slot) -> None:
        """Wait until the meter lets a try at the line start (requests, tokens and
        streams per minute): spaced under ``requests_per_minute``, and each refusal
        waited out (its ``retry_after_s``) and asked again."""
        tenant = slot.tenant
        rpm = tenant.limits.requests_per_minute
        while True:
            if rpm:
                await self._pace(slot, self.meter.window_s / rpm)
            refusal = self.meter.check(tenant, 0)
            if refusal is None:
                return
            self._hold(slot, refusal.limit)
            await anyio.sleep(max(refusal.retry_after_s, 0.001))

    async def _pace(self, slot: Slot, interval_s: float) -> None:
        """This line's turn among its tenant's starts, ``interval_s`` apart."""
        waiting = self._of(slot.tenant.name)
        now = anyio.current_time()
        start = max(now, waiting.next_start)
        waiting.next_start = start + interval_s
        if start > now:
            self._hold(slot, REQUESTS_PER_MINUTE)
            await anyio.sleep(start - now)

    def _hold(self, slot: Slot, limit: str) -> None:
        """The line is held for ``limit``: counted, once per line."""
        if not slot.held:
            slot.held = True
            self.limited(slot.tenant.name, limit)
