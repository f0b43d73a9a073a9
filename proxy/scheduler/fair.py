"""Tenants' fair share within a traffic class: start-time fair queuing charged in tokens.

Each class keeps its own :class:`FairShare`. A job is queued with a *tag*, its
place in virtual time, and the queue serves the least tag first (within a tier,
:class:`~proxy.scheduler.types.Tier`: the bands are strict):

- A *flow* is what shares fairly: a tenant's chats, or one batch job of a tenant
  (``Job.flow``, its id). A tenant's weight is split evenly between its flows that
  have work, so a tenant's batch jobs share its part, and two tenants' parts are in
  the ratio of their weights however many jobs each runs.
- A job's tag is ``S = max(V, F)``, where ``V`` is the class's virtual time (the
  largest tag dispatched so far) and ``F`` the flow's finish tag; then
  ``F = S + cost / weight``. The cost is charged in tokens as the Virtual Token
  Counter charges them (Sheng et al., OSDI '24): prompt tokens once, output tokens
  twice (an output token costs a decode step per stream). The output is not
  known when the job is queued: its ``max_tokens``, else the mean its tenant's
  answers had; at the finish the flow's ``F`` is moved by the difference, so what a
  flow is charged is what it used. Within a flow tags never go back (a flow is
  served in arrival order).
- Work-conserving: a tag orders, it never waits; a job is held only for the reasons
  an engine refuses it. A flow that was idle starts at ``V``: it banks no credit
  for its idle time, and takes its part again at once.

Why start-time fair queuing over deficit round robin and over the Virtual Token
Counter's own counters: a tag is fixed when a job is queued, so the queue stays an
order (the batch pass reads the n-th job of a model's line, and a job held on an
engine keeps its place), where VTC's counters move at each dispatch and would
reorder the lines under the pass; DRR needs a quantum larger than the largest job
(a 32,000-token prompt) to be fair in one round, which makes its rounds coarse. The
bound (Goyal, Vin and Cheng, 1996): between two flows ``f`` and ``g`` backlogged
over an interval, the service each received divided by its weight differs by at most
``c_f / w_f + c_g / w_g``, the largest cost of a job of each over its weight. Here
a cost is an estimate until the job finishes, so the gap may be off by the answers
still in flight (what was estimated and not yet corrected) besides; the unit tests
measure it against the bound (tests/unit/scheduler/test_sched_fair.py).

Fairness that stops at the proxy's queue would be undone by the engine's own
queue: a chat sent beside 32 long prompts of another tenant waits behind them in
an engine that serves in arrival order. So while two or more tenants have sent
chats in the last ``ACTIVE_S`` seconds, a tenant may hold at most the engine's
budget ``B`` in chat prompt tokens in prefill there (one chat always, if it has
none there): its next chats wait in the proxy, in fair order (held:
``tenant_share``). ``B`` is the prefill in flight under which chat meets its target
beside batch; the same amount of one tenant's prefill is what another tenant's
chat may find ahead of it.

What a class served is kept per tenant per second over ``WINDOW_S``: each tenant's
share, what it is owed (its weight over the weights of the tenants active in the
window), and Jain's fairness index over the tenants that waited in the window
(:meth:`FairShare.fairness`). Reads never change state.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from proxy.scheduler.types import Job, Tier, TrafficClass

__all__ = ["ACTIVE_S", "WINDOW_S", "FairShare", "TenantShare"]

WINDOW_S = 60.0  # the window shares and the fairness index are read over
ACTIVE_S = 10.0  # a tenant that sent a chat this recently counts for the prefill share
OUTPUT_WEIGHT = 2  # an output token costs twice a prompt token (VTC's weights)
DEFAULT_OUTPUT = 128  # a tenant's expected answer before any of its answers is seen
_EMA = 0.2  # how much each answer moves its tenant's mean output


@dataclass(frozen=True)
class TenantShare:
    """What a tenant got of its class over the window (a read; see the module)."""

    tenant: str
    cls: TrafficClass
    weight: float
    tier: Tier
    queued: int
    in_flight: int
    tokens: int  # prompt tokens at dispatch and output tokens at the finish
    share: float  # its part of its class's tokens served in the window
    owed: float  # its weight over the weights of its class's active tenants


class _Flow:
    __slots__ = ("finish", "jobs", "last", "weight")

    def __init__(self) -> None:
        self.finish = 0.0  # the finish tag of its last job queued
        self.last = -math.inf  # the tag of its last job queued (tags never go back)
        self.jobs = 0  # its jobs queued or in flight
        self.weight = 1.0  # the weight its last job was tagged at


class _Tenant:
    __slots__ = ("flows", "output", "seen", "served", "tier", "waited", "weight")

    def __init__(self) -> None:
        self.flows: dict[str, _Flow] = {}
        self.output = float(DEFAULT_OUTPUT)  # the mean output of its answers
        self.weight = 1.0
        self.tier = Tier.STANDARD
        self.seen = -math.inf  # when its last job was queued
        self.waited = -math.inf  # when a job of it was last held
        self.served: deque[list[int]] = deque()  # [second, tokens], oldest first


class FairShare:
    """One class's fair queue: tags for its jobs, and what each tenant was served."""

    def __init__(self, cls: TrafficClass) -> None:
        self.cls = cls
        self.vtime = 0.0
        self._tenants: dict[str, _Tenant] = {}
        self._charged: dict[str, tuple[str, float]] = {}  # job id -> (flow, expected output)

    # -- writes ------------------------------------------------------------------

    def tag(self, job: Job, now: float) -> float:
        """Queue ``job`` (a first time): its tag, its flow charged for it."""
        tenant = self._tenants.get(job.tenant)
        if tenant is None:
            tenant = self._tenants[job.tenant] = _Tenant()
        tenant.weight, tenant.tier, tenant.seen = job.weight, job.tier, now
        flow = tenant.flows.get(job.flow)
        if flow is None:
            flow = tenant.flows[job.flow] = _Flow()
        flow.jobs += 1
        active = sum(1 for f in tenant.flows.values() if f.jobs)
        flow.weight = max(job.weight, 1e-9) / active
        output = job.expected_output or tenant.output
        start = max(self.vtime, flow.finish, flow.last)
        flow.last = start
        flow.finish = start + (job.prompt_tokens + OUTPUT_WEIGHT * output) / flow.weight
        self._charged[job.id] = (job.flow, output)
        return start

    def dispatched(self, job: Job, now: float) -> None:
        """``job`` was sent: virtual time reaches its tag; its prompt is served."""
        self.vtime = max(self.vtime, job.order[1])
        self._serve(job.tenant, job.uncached_tokens, now)

    def held(self, job: Job, now: float) -> None:
        """A job of the tenant waited: it counts in the fairness index."""
        tenant = self._tenants.get(job.tenant)
        if tenant is not None:
            tenant.waited = now

    def left(self, job: Job, now: float, output_tokens: int | None) -> None:
        """``job`` left (finished, failed or cancelled); ``output_tokens``, where
        known, are served and settle its flow's charge."""
        charged = self._charged.pop(job.id, None)
        tenant = self._tenants.get(job.tenant)
        if charged is None or tenant is None:
            return
        flow = tenant.flows.get(charged[0])
        if flow is not None:
            flow.jobs -= 1
            if output_tokens is not None:
                flow.finish += OUTPUT_WEIGHT * (output_tokens - charged[1]) / flow.weight
        if output_tokens is not None:
            tenant.output += _EMA * (output_tokens - tenant.output)
            self._serve(job.tenant, output_tokens, now)
        self._forget(now)

    def _serve(self, name: str, tokens: int, now: float) -> None:
        tenant = self._tenants.get(name)
        if tenant is None or tokens <= 0:
            return
        second = int(now)
        served = tenant.served
        if served and served[-1][0] == second:
            served[-1][1] += tokens
        else:
            served.append([second, tokens])
        while served and served[0][0] <= now - WINDOW_S:
            served.popleft()

    def _forget(self, now: float) -> None:
        """Drop tenants idle past the window, with nothing queued or in flight."""
        if len(self._tenants) < 64:
            return
        for name in [
            n
            for n, t in self._tenants.items()
            if t.seen < now - WINDOW_S and not any(f.jobs for f in t.flows.values())
        ]:
            del self._tenants[name]

    # -- reads ---------------------------------------------------------------------

    def several_active(self, now: float) -> bool:
        """Whether two or more tenants queued work in the last ``ACTIVE_S``."""
        since = now - ACTIVE_S
        seen = 0
        for tenant in self._tenants.values():
            if tenant.seen >= since:
                seen += 1
                if seen > 1:
                    return True
        return False

    def served(self, now: float) -> dict[str, int]:
        """Tokens each tenant was served in the window."""
        since = now - WINDOW_S
        return {
            n: sum(tokens for second, tokens in t.served if second > since)
            for n, t in self._tenants.items()
        }

    def shares(
        self, now: float, queued: dict[str, int], in_flight: dict[str, int]
    ) -> list[TenantShare]:
        """Every tenant active in the window (served, queued or in flight)."""
        served = self.served(now)
        names = [n for n in self._tenants if served[n] or queued.get(n) or in_flight.get(n)]
        total = sum(served[n] for n in names)
        weights = sum(self._tenants[n].weight for n in names)
        out = []
        for n in sorted(names):
            t = self._tenants[n]
            out.append(
                TenantShare(
                    tenant=n,
                    cls=self.cls,
                    weight=t.weight,
                    tier=t.tier,
                    queued=queued.get(n, 0),
                    in_flight=in_flight.get(n, 0),
                    tokens=served[n],
                    share=served[n] / total if total else 0.0,
                    owed=t.weight / weights if weights else 0.0,
                )
            )
        return out

    def fairness(self, now: float, queued: dict[str, int]) -> float | None:
        """Jain's index over the tenants that waited in the window (held, or queued
        now), of the tokens each was served over its weight: 1 is fair; 1/n is one
        tenant served alone. A tenant that never waited got what it asked and is
        left out. None with fewer than two such tenants."""
        since = now - WINDOW_S
        served = self.served(now)
        xs = [
            served[n] / t.weight
            for n, t in self._tenants.items()
            if t.waited > since or queued.get(n)
        ]
        if len(xs) < 2:
            return None
        squares = sum(x * x for x in xs)
        if squares == 0:
            return 1.0
        return sum(xs) ** 2 / (len(xs) * squares)
