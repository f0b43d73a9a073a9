"""The simulated engine: scheduler, cost model and clock, stepped from outside.

A driver owns time. It calls :meth:`SimEngine.begin_step` to plan a step (which says
how long the step takes in model time), lets that much model time pass in whatever
way suits it (sleeping in the server, advancing a virtual clock in tests), then calls
:meth:`SimEngine.finish_step` to apply it. Requests added or aborted between the two
calls are seen by the next step, as in vLLM's engine loop.

With ``async_scheduling`` (vLLM's ``EngineCore.step_with_batch_queue`` with a batch
queue of two), planning a step also plans the one after it, before this one's
results are applied: vLLM schedules step N+1 right after launching step N and only
then waits for N's output. So a request that arrives while step N runs is first
scheduled in step N+2, one step later than without it, while a request arriving
at an idle engine starts at once either way; step N's tokens are still released
when step N ends.

Given a KV-event publisher, :meth:`SimEngine.finish_step` publishes the KV-cache
events of the step as one batch stamped with wall time, where vLLM's
``Scheduler.update_from_output`` does: so under async scheduling the batch of step N
also carries what planning step N+1 cached or evicted, as in vLLM.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from loadtests.sim.cost import step_seconds
from loadtests.sim.kv_events import EventPublisher, KVEventBatch
from loadtests.sim.profile import StepCost
from loadtests.sim.request import SimRequest
from loadtests.sim.step_scheduler import EngineScheduler, SchedulerConfig, SchedulerOutput
from loadtests.sim.tokenizer import SimTokenizer, prompt_seed
from proxy.clock import Clock


@dataclass(frozen=True)
class StepPlan:
    index: int
    start: float
    duration: float
    output: SchedulerOutput

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(frozen=True)
class TokenEvent:
    """A token a request received at the end of a step."""

    request: SimRequest
    token_id: int
    time: float
    is_first: bool
    gap: float | None
    finished: bool


@dataclass
class StepResult:
    plan: StepPlan
    tokens: list[TokenEvent] = field(default_factory=list)
    newly_scheduled: list[SimRequest] = field(default_factory=list)


class SimEngine:
    """One simulated vLLM engine."""

    def __init__(
        self,
        config: SchedulerConfig,
        cost: StepCost,
        clock: Clock,
        tokenizer: SimTokenizer | None = None,
        kv_events: EventPublisher | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.clock = clock
        self.tokenizer = tokenizer or SimTokenizer()
        self.scheduler = EngineScheduler(
            config, self._sample, kv_cache_events=kv_events is not None
        )
        self._kv_events = kv_events
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._seeds: dict[str, int] = {}
        # Under async scheduling: the next step, planned while the last one ran.
        self._next: SchedulerOutput | None = None

    def _sample(self, request: SimRequest, index: int) -> int:
        return self.tokenizer.sample(request.seed, index)

    # -- requests --------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        priority: int = 0,
        request_id: str | None = None,
        seed: int | None = None,
        arrival_time: float | None = None,
    ) -> SimRequest:
        """Queue a request; it arrives now unless ``arrival_time`` says otherwise."""
        request = SimRequest(
            request_id=request_id or f"sim-{next(self._ids)}",
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            arrival_time=self.clock.now() if arrival_time is None else arrival_time,
            priority=priority,
            seed=prompt_seed(prompt_token_ids, seed),
        )
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> SimRequest | None:
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            request.finished_time = self.clock.now()
        return request

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    @property
    def async_scheduling(self) -> bool:
        return self.config.async_scheduling

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv.usage

    # -- steps -----------------------------------------------------------------

    def begin_step(self, start: float | None = None) -> StepPlan | None:
        """Plan the next step, starting now or at ``start`` (a driver that anchors
        steps back to back passes the previous step's end); None when idle."""
        output, self._next = self._next, None
        if output is None:
            output = self._schedule()
            if output is None:
                return None
        now = self.clock.now() if start is None else start
        for rid in output.newly_scheduled:
            request = self.scheduler.requests.get(rid)
            if request is not None:
                request.first_scheduled_time = max(now, request.arrival_time)
        plan = StepPlan(next(self._steps), now, step_seconds(self.cost, output), output)
        if self.config.async_scheduling:
            self._next = self._schedule()
        return plan

    def _schedule(self) -> SchedulerOutput | None:
        if not self.scheduler.has_unfinished_requests:
            return None
        output = self.scheduler.schedule()
        return None if output.is_empty else output

    def finish_step(self, plan: StepPlan) -> StepResult:
        """Apply a planned step; token times are the step's end in model time."""
        result = StepResult(plan)
        requests = self.scheduler.requests
        result.newly_scheduled = [requests[r] for r in plan.output.newly_scheduled if r in requests]
        t = plan.end
        for out in self.scheduler.update_from_output(plan.output):
            request = out.request
            is_first = request.first_token_time is None
            last = request.last_token_time
            gap = None if is_first or last is None else t - last
            if is_first:
                request.first_token_time = t
            request.last_token_time = t
            if out.finished:
                request.finished_time = t
            result.tokens.append(TokenEvent(request, out.token_id, t, is_first, gap, out.finished))
        if self._kv_events is not None:
            events = self.scheduler.kv.take_events()
            if events:
                self._kv_events.publish(KVEventBatch(ts=time.time(), events=events))
        return result
