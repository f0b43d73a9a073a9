"""SimEngine against a virtual clock, by hand and through VirtualRunner."""

from __future__ import annotations

import pytest

from loadtests.sim import SimEngine, VirtualClock
from loadtests.sim.profile import StepCost
from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.request import RequestStatus
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner

from .helpers import UNIT_COST, drain, engine_step, make_engine, unique_prompt


def test_virtual_clock_moves_only_forward() -> None:
    clock = VirtualClock(5.0)
    clock.advance(1.5)
    assert clock.now() == 6.5
    clock.advance_to(3.0)
    assert clock.now() == 6.5
    clock.advance_to(7.0)
    assert clock.now() == 7.0
    with pytest.raises(ValueError):
        clock.advance(-0.1)


def test_idle_engine_has_no_step() -> None:
    engine, _ = make_engine()
    assert engine.begin_step() is None
    assert not engine.has_unfinished_requests


def test_plan_starts_now_and_lasts_the_cost_model_time() -> None:
    cost = StepCost(fixed_s=0.5, prefill_per_token_s=0.01, decode_per_token_s=0.0)
    engine, clock = make_engine(cost)
    clock.advance(2.0)
    engine.add_request(unique_prompt(10), 1)
    plan = engine.begin_step()
    assert plan is not None
    assert (plan.index, plan.start) == (0, 2.0)
    assert plan.duration == pytest.approx(0.5 + 0.1)
    assert plan.end == pytest.approx(2.6)


def test_token_times_gaps_and_lifecycle_stamps() -> None:
    engine, clock = make_engine(UNIT_COST)
    clock.advance(10.0)
    request = engine.add_request(unique_prompt(4), 3)
    assert request.arrival_time == 10.0
    results = drain(engine, clock)
    events = [t for r in results for t in r.tokens]
    assert [(e.time, e.is_first, e.gap, e.finished) for e in events] == [
        (11.0, True, None, False),
        (12.0, False, 1.0, False),
        (13.0, False, 1.0, True),
    ]
    assert request.first_scheduled_time == 10.0
    assert request.first_token_time == 11.0
    assert request.last_token_time == request.finished_time == 13.0
    assert request.status is RequestStatus.FINISHED
    assert [e.token_id for e in events] == request.output_token_ids
    assert results[0].newly_scheduled == [request]
    assert [r.plan.index for r in results] == [0, 1, 2]


def test_explicit_arrival_time_is_kept() -> None:
    engine, _ = make_engine()
    request = engine.add_request(unique_prompt(4), 1, arrival_time=-3.0, request_id="given")
    assert (request.request_id, request.arrival_time) == ("given", -3.0)


def test_running_and_waiting_counts_and_cache_usage() -> None:
    engine, clock = make_engine(max_num_seqs=1, block_size=4, num_gpu_blocks=100, max_model_len=64)
    engine.add_request(unique_prompt(8), 5)
    engine.add_request(unique_prompt(8), 5)
    assert (engine.num_running, engine.num_waiting, engine.kv_cache_usage) == (0, 2, 0.0)
    engine_step(engine, clock)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    # Slots are reserved when a step is planned: 8 prompt tokens fill 2 blocks of 4.
    assert engine.kv_cache_usage == pytest.approx(2 / 100)


def test_generation_is_repeatable_and_seeded() -> None:
    def answer(seed: int | None) -> list[int]:
        engine, clock = make_engine()
        request = engine.add_request(list(range(100, 120)), 12, seed=seed)
        drain(engine, clock)
        return request.output_token_ids

    assert answer(None) == answer(None)
    assert answer(1) == answer(1)
    assert answer(1) != answer(None)


def test_abort_between_plan_and_finish_yields_no_token_and_stamps_the_time() -> None:
    engine, clock = make_engine(UNIT_COST)
    keep = engine.add_request(unique_prompt(4), 2)
    drop = engine.add_request(unique_prompt(4), 2)
    plan = engine.begin_step()
    assert plan is not None
    clock.advance(0.25)
    assert engine.abort_request(drop.request_id) is drop
    assert drop.finished_time == 0.25
    clock.advance(plan.duration - 0.25)
    result = engine.finish_step(plan)
    assert [t.request for t in result.tokens] == [keep]
    assert drop.status is RequestStatus.ABORTED
    assert drop.first_token_time is None
    drain(engine, clock)
    assert drop.output_token_ids == []
    assert engine.kv_cache_usage == 0.0


def test_abort_of_an_unknown_request_is_none() -> None:
    engine, _ = make_engine()
    assert engine.abort_request("nope") is None


# -- VirtualRunner --------------------------------------------------------------------


def test_runner_refuses_an_engine_on_another_clock() -> None:
    engine, _ = make_engine()
    with pytest.raises(ValueError):
        VirtualRunner(engine, VirtualClock())


def test_request_arriving_mid_step_joins_the_next_step() -> None:
    engine, clock = make_engine(UNIT_COST)
    runner = VirtualRunner(engine, clock)
    first = runner.submit_at(0.0, unique_prompt(4), 5)
    late = runner.submit_at(1.5, unique_prompt(4), 2)
    runner.run()
    assert late[0].arrival_time == 1.5
    assert late[0].first_scheduled_time == 2.0
    assert late[0].first_token_time == 3.0
    assert first[0].finished_time == 5.0
    assert not engine.has_unfinished_requests


def test_runner_steps_several_engines_each_at_its_own_pace() -> None:
    clock = VirtualClock()
    config = SchedulerConfig()
    slow = SimEngine(config, UNIT_COST, clock)
    fast = SimEngine(
        config, StepCost(fixed_s=0.25, prefill_per_token_s=0, decode_per_token_s=0), clock
    )
    runner = VirtualRunner([slow, fast], clock)
    a = runner.submit_at(0.0, unique_prompt(4), 4, engine=0)
    b = runner.submit_at(0.0, unique_prompt(4), 4, engine=1)
    runner.run()
    assert a[0].finished_time == pytest.approx(4.0)
    assert b[0].finished_time == pytest.approx(1.0)


def test_runner_finishes_a_workload_whose_step_preempts_every_request_it_tried() -> None:
    # 8 blocks of 4: 'low' runs ahead and, being lowest ranked, preempts itself.
    engine, clock = make_engine(
        UNIT_COST,
        scheduling_policy=SchedulingPolicy.PRIORITY,
        block_size=4,
        num_gpu_blocks=8,
        max_model_len=32,
    )
    runner = VirtualRunner(engine, clock)
    low = runner.submit_at(0.0, unique_prompt(4), 20, priority=5)
    high = runner.submit_at(0.5, unique_prompt(4), 20, priority=0)
    runner.run()
    assert not engine.has_unfinished_requests
    assert low[0].num_preemptions == 1
    assert len(low[0].output_token_ids) == len(high[0].output_token_ids) == 20
