"""Builders and checks shared by the tests of the simulated engine's model."""

from __future__ import annotations

import itertools
import random
from typing import Any

from loadtests.sim.profile import StepCost
from loadtests.sim.request import SimRequest
from loadtests.sim.step_loop import SimEngine, StepResult
from loadtests.sim.step_scheduler import (
    EngineScheduler,
    SchedulerConfig,
    SchedulerOutput,
    TokenOutput,
)
from proxy.clock import VirtualClock

UNIT_COST = StepCost(fixed_s=1.0, prefill_per_token_s=0.0, decode_per_token_s=0.0)
"""Every step takes one second of model time: step counts read as times."""

_prompt_ids = itertools.count()


def unique_prompt(n: int) -> list[int]:
    """``n`` token ids that share no block with any other prompt made here."""
    rng = random.Random(next(_prompt_ids))
    return [rng.randrange(16, 1_000_000) for _ in range(n)]


def sample_position(request: SimRequest, index: int) -> int:
    """A sampler whose token says which output position it was drawn for."""
    return 1_000_000 + index


def make_request(
    request_id: str,
    num_prompt: int,
    max_tokens: int,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    prompt: list[int] | None = None,
) -> SimRequest:
    return SimRequest(
        request_id=request_id,
        prompt_token_ids=prompt if prompt is not None else unique_prompt(num_prompt),
        max_tokens=max_tokens,
        arrival_time=arrival,
        priority=priority,
    )


def make_scheduler(**config: Any) -> EngineScheduler:
    return EngineScheduler(SchedulerConfig(**config), sample_position)


def step(sched: EngineScheduler) -> tuple[SchedulerOutput, list[TokenOutput]]:
    """Plan one step and apply it at once."""
    out = sched.schedule()
    return out, sched.update_from_output(out)


def run_until_idle(sched: EngineScheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Step until nothing is left; returns the plans. Fails on a stall."""
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests:
            return outs
        out, _ = step(sched)
        assert not out.is_empty, "unfinished requests but an empty step"
        outs.append(out)
    raise AssertionError(f"not idle after {max_steps} steps")


def chunk_of(out: SchedulerOutput, request_id: str) -> int:
    """Tokens the step computes for a request (0 when not scheduled)."""
    return sum(c.num_tokens for c in out.chunks if c.request_id == request_id)


def make_engine(cost: StepCost = UNIT_COST, **config: Any) -> tuple[SimEngine, VirtualClock]:
    clock = VirtualClock()
    return SimEngine(SchedulerConfig(**config), cost, clock), clock


def engine_step(engine: SimEngine, clock: VirtualClock) -> StepResult | None:
    """One engine step by hand: plan, let its model time pass, apply."""
    plan = engine.begin_step()
    if plan is None:
        return None
    clock.advance(plan.duration)
    return engine.finish_step(plan)


def drain(engine: SimEngine, clock: VirtualClock, max_steps: int = 100_000) -> list[StepResult]:
    results = []
    for _ in range(max_steps):
        result = engine_step(engine, clock)
        if result is None:
            assert not engine.has_unfinished_requests, "engine stalled with work left"
            return results
        results.append(result)
    raise AssertionError(f"not idle after {max_steps} steps")


Arrival = tuple[float, list[int], int]
"""(time, prompt token ids, max_tokens) of a request to add during a run."""


def run_with_arrivals(
    engine: SimEngine, clock: VirtualClock, arrivals: list[Arrival], max_steps: int = 100_000
) -> tuple[list[SimRequest], list[StepResult]]:
    """Drive the engine by hand; a request due mid-step is added when that step ends.

    Returns the requests (in ``arrivals`` order) and every step's result.
    """
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    requests: dict[int, SimRequest] = {}
    results: list[StepResult] = []
    for _ in range(max_steps):
        while pending and pending[0][1][0] <= clock.now():
            i, (t, prompt, max_tokens) = pending.pop(0)
            requests[i] = engine.add_request(prompt, max_tokens, arrival_time=t)
        result = engine_step(engine, clock)
        if result is not None:
            results.append(result)
        elif pending:
            clock.advance_to(pending[0][1][0])
        else:
            assert not engine.has_unfinished_requests, "engine stalled with work left"
            return [requests[i] for i in range(len(arrivals))], results
    raise AssertionError(f"not idle after {max_steps} steps")


def check_kv_accounting(sched: EngineScheduler) -> None:
    """Blocks are either free or held; only running requests hold any."""
    kv = sched.kv
    held: set[int] = set()
    for request in sched.running:
        held.update(kv.blocks_of(request.request_id))
    for request in sched.waiting:
        assert kv.blocks_of(request.request_id) == [], request.request_id
    assert len(held) + kv.num_free_blocks == kv.num_blocks
    assert 0.0 <= kv.usage <= 1.0
