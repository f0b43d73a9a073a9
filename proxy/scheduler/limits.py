"""Each tenant's limits (:class:`proxy.config.TenantLimits`) kept over an injected
clock: pure, no I/O, no tasks, no locks (one event loop calls it).

What it keeps, per tenant that has any limit (a tenant with none costs nothing):

- a sliding one-minute window of its requests and tokens (``requests_per_minute``,
  ``tokens_per_minute``; a request's prompt tokens count when it starts, as the
  proxy counted them, its completion tokens when it ends);
- its requests in flight (``streams``): interactive requests and batch lines alike;
- its batch lines and batch jobs in flight (``batch_lines``, ``batch_jobs``).

The API, as its callers use it::

    meter = TenantMeter(clock)                     # one, in the composition root

    # the HTTP edge, a completion request before it is queued:
    refusal = meter.check(tenant, prompt_tokens)   # a read: None, or why not now
    if refusal is not None:                        # 429, Retry-After: refusal.retry_after
        ...
    meter.started(tenant, prompt_tokens)           # the request counted, a stream open
    ...
    meter.finished(tenant, completion_tokens)      # the stream closed, the output counted

    # the batch runner (a line is never failed for a limit; it waits):
    refusal = meter.check(tenant, 0)               # requests, tokens, streams
    if refusal is not None: wait refusal.retry_after_s, then ask again
    if not meter.batch_lines_room(tenant): wait for one of its lines to end
    meter.line_started(tenant) ... meter.line_finished(tenant)
    if not meter.batch_job_room(tenant, running): leave the job queued
    meter.job_started(tenant) ... meter.job_finished(tenant)   # where the meter counts

A batch line sent through :meth:`proxy.api.forward.Forwarder.complete` counts as a
request and a stream there (``started`` and ``finished``), like a client's; the
runner's ``line_started``/``line_finished`` count it as a line besides.

Reads (:meth:`TenantMeter.check`, the ``*_room`` methods, :meth:`TenantMeter.usage`)
never change anything: a check that lets a request through does not count it, and
asking twice gives the same answer. Writes drop what has left the window. Only
tenants with limits are kept, and only the configured have any: the meter's size is
bounded by the config.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from proxy.clock import Clock
from proxy.config import Tenant

WINDOW_S = 60.0
"""The sliding window of ``requests_per_minute`` and ``tokens_per_minute``."""
STREAMS_RETRY_S = 1.0
"""Retry-After for a tenant at its ``streams``: when one ends is not known."""

REQUESTS_PER_MINUTE = "requests_per_minute"
TOKENS_PER_MINUTE = "tokens_per_minute"
STREAMS = "streams"


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's request may not start now: the ``limit`` it is at (a
    :class:`~proxy.config.TenantLimits` field's name), when to try again
    (``retry_after_s``: when the window will have freed enough), the limit's value
    (``allowed``) and what the tenant used of it (``used``). ``too_large``: the
    request alone is over the limit (its prompt has more tokens than a minute may)."""

    limit: str
    retry_after_s: float
    tenant: str = ""
    allowed: int = 0
    used: int = 0
    too_large: bool = False

    @property
    def retry_after(self) -> int:
        """``Retry-After``: whole seconds, at least one."""
        return max(1, math.ceil(self.retry_after_s))

    @property
    def kind(self) -> str:
        """OpenAI's error type for it: ``tokens`` or ``requests``."""
        return "tokens" if self.limit == TOKENS_PER_MINUTE else "requests"

    def message(self) -> str:
        """What the client is told: the tenant, the limit, what it used."""
        if self.too_large:
            return (
                f"Request too large for tenant {self.tenant}: {self.limit} {self.allowed}, "
                f"and the prompt alone has {self.used} tokens"
            )
        used = "in flight" if self.limit == STREAMS else "used"
        return (
            f"Rate limit reached for tenant {self.tenant}: {self.limit} {self.allowed} "
            f"({used} {self.used}); retry after {self.retry_after} s"
        )


@dataclass(frozen=True)
class Usage:
    """What a tenant uses now: requests and tokens in the window, requests, batch
    lines and batch jobs in flight."""

    requests: int = 0
    tokens: int = 0
    streams: int = 0
    lines: int = 0
    jobs: int = 0


Event = tuple[float, int, int]
"""(time, requests, tokens) counted in the window."""


@dataclass
class _Use:
    """One tenant's counts: the window's events, oldest first, with their sums
    (``requests``, ``tokens``), and what is in flight."""

    events: deque[Event] = field(default_factory=deque)
    requests: int = 0
    tokens: int = 0
    streams: int = 0
    lines: int = 0
    jobs: int = 0

    def add(self, event: Event) -> None:
        self.events.append(event)
        self.requests += event[1]
        self.tokens += event[2]

    def drop_until(self, start: float) -> None:
        """Drop the events at or before ``start``: they left the window."""
        while self.events and self.events[0][0] <= start:
            _, requests, tokens = self.events.popleft()
            self.requests -= requests
            self.tokens -= tokens

    def idle(self) -> bool:
        return not self.events and not (self.streams or self.lines or self.jobs)


@dataclass(frozen=True)
class _Window:
    """A read of a tenant's window: its sums now, and where its live events begin
    (the ones before ``first`` have left it but were not dropped yet)."""

    events: deque[Event]
    first: int
    requests: int
    tokens: int

    def live(self) -> Iterator[Event]:
        """The events still in the window, oldest first."""
        return itertools.islice(self.events, self.first, None)


class TenantMeter:
    """Every tenant's use of its limits (the module docstring says how it is used)."""

    def __init__(self, clock: Clock, window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self._uses: dict[str, _Use] = {}

    # -- reads -------------------------------------------------------------------------

    def check(self, tenant: Tenant, prompt_tokens: int = 0) -> Refusal | None:
        """Whether a request of ``prompt_tokens`` of ``tenant`` may start now; if not,
        the refusal that waits longest (trying sooner would be refused again)."""
        limits = tenant.limits
        if not limits.any():
            return None
        use = self._uses.get(tenant.name, _Use())
        window = self._window(use)
        refusals = [
            self._requests(tenant, window, limits.requests_per_minute),
            self._tokens(tenant, window, limits.tokens_per_minute, prompt_tokens),
        ]
        if limits.streams is not None and use.streams >= limits.streams:
            refusals.append(
                Refusal(STREAMS, STREAMS_RETRY_S, tenant.name, limits.streams, use.streams)
            )
        found = [r for r in refusals if r is not None]
        return max(found, key=lambda r: r.retry_after_s) if found else None

    def batch_lines_room(self, tenant: Tenant) -> bool:
        """Whether another batch line of ``tenant`` may be in flight."""
        limit = tenant.limits.batch_lines
        return limit is None or self._lines(tenant.name) < limit

    def batch_job_room(self, tenant: Tenant, running: int | None = None) -> bool:
        """Whether another batch job of ``tenant`` may run: ``running``, its jobs
        running now where the caller counts them (several replicas share one store),
        else those this meter was told of (:meth:`job_started`)."""
        limit = tenant.limits.batch_jobs
        if limit is None:
            return True
        use = self._uses.get(tenant.name)
        count = running if running is not None else (use.jobs if use is not None else 0)
        return count < limit

    def usage(self, name: str) -> Usage:
        """What tenant ``name`` uses now (nothing, for a tenant without limits)."""
        use = self._uses.get(name)
        if use is None:
            return Usage()
        window = self._window(use)
        return Usage(window.requests, window.tokens, use.streams, use.lines, use.jobs)

    def _window(self, use: _Use) -> _Window:
        """The tenant's window now. A read: the events that left it are skipped (the
        few since the last write), not dropped."""
        start = self.clock.now() - self.window_s
        first, requests, tokens = 0, use.requests, use.tokens
        for when, n, t in use.events:
            if when > start:
                break
            first, requests, tokens = first + 1, requests - n, tokens - t
        return _Window(use.events, first, requests, tokens)

    def _requests(self, tenant: Tenant, window: _Window, limit: int | None) -> Refusal | None:
        if limit is None:
            return None
        used = window.requests
        if used + 1 <= limit:
            return None
        wait = self._freed(window, used + 1 - limit, tokens=False)
        return Refusal(REQUESTS_PER_MINUTE, wait, tenant.name, limit, used)

    def _tokens(
        self, tenant: Tenant, window: _Window, limit: int | None, prompt: int
    ) -> Refusal | None:
        if limit is None:
            return None
        if prompt > limit:
            return Refusal(TOKENS_PER_MINUTE, self.window_s, tenant.name, limit, prompt, True)
        used = window.tokens
        if used + prompt <= limit:
            return None
        wait = self._freed(window, used + prompt - limit, tokens=True)
        return Refusal(TOKENS_PER_MINUTE, wait, tenant.name, limit, used)

    def _freed(self, window: _Window, needed: int, tokens: bool) -> float:
        """Seconds until the window's oldest events that hold ``needed`` requests
        (or ``tokens``) have left it."""
        freed = 0
        for when, n, t in window.live():
            freed += t if tokens else n
            if freed >= needed:
                return max(0.0, when + self.window_s - self.clock.now())
        return self.window_s  # unreachable while ``needed`` <= the window's sum

    def _lines(self, name: str) -> int:
        use = self._uses.get(name)
        return use.lines if use is not None else 0

    # -- writes ------------------------------------------------------------------------

    def started(self, tenant: Tenant, prompt_tokens: int) -> None:
        """A request of ``tenant`` starts: one request and ``prompt_tokens`` in the
        window now, one more in flight."""
        use = self._use(tenant)
        if use is None:
            return
        use.add((self.clock.now(), 1, max(0, prompt_tokens)))
        use.streams += 1

    def finished(self, tenant: Tenant, completion_tokens: int = 0) -> None:
        """A request of ``tenant`` ended: one fewer in flight, its
        ``completion_tokens`` in the window now."""
        use = self._use(tenant)
        if use is None:
            return
        if completion_tokens > 0:
            use.add((self.clock.now(), 0, completion_tokens))
        use.streams = max(0, use.streams - 1)
        self._forget_idle(tenant.name)

    def line_started(self, tenant: Tenant) -> None:
        """A batch line of ``tenant`` is in flight."""
        use = self._use(tenant)
        if use is not None:
            use.lines += 1

    def line_finished(self, tenant: Tenant) -> None:
        """A batch line of ``tenant`` is no longer in flight."""
        use = self._use(tenant)
        if use is not None:
            use.lines = max(0, use.lines - 1)
            self._forget_idle(tenant.name)

    def job_started(self, tenant: Tenant) -> None:
        """A batch job of ``tenant`` runs."""
        use = self._use(tenant)
        if use is not None:
            use.jobs += 1

    def job_finished(self, tenant: Tenant) -> None:
        """A batch job of ``tenant`` stopped running."""
        use = self._use(tenant)
        if use is not None:
            use.jobs = max(0, use.jobs - 1)
            self._forget_idle(tenant.name)

    def _use(self, tenant: Tenant) -> _Use | None:
        """The tenant's counts, with what left the window dropped; None for a tenant
        without limits (nothing is kept of it)."""
        if not tenant.limits.any():
            return None
        use = self._uses.setdefault(tenant.name, _Use())
        use.drop_until(self.clock.now() - self.window_s)
        return use

    def _forget_idle(self, name: str) -> None:
        """Nothing kept of a tenant with nothing in flight and an empty window."""
        use = self._uses.get(name)
        if use is not None and use.idle():
            del self._uses[name]
