"""vLLM's async scheduling in the simulated engine, at virtual time.

Every step takes one second (``UNIT_COST``), so times read as step counts.
"""

from __future__ import annotations

import pytest

from loadtests.cli import parse, sim_settings
from loadtests.sim.step_loop import SimEngine
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner
from proxy.clock import VirtualClock

from .helpers import UNIT_COST, make_request, make_scheduler, sample_position, unique_prompt


def _runner(async_scheduling: bool, **config: object) -> VirtualRunner:
    clock = VirtualClock()
    cfg = SchedulerConfig(async_scheduling=async_scheduling, **config)  # type: ignore[arg-type]
    return VirtualRunner(SimEngine(cfg, UNIT_COST, clock), clock)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_lone_request_on_an_idle_engine_starts_at_once_and_takes_no_extra_step(
    async_scheduling: bool,
) -> None:
    # vLLM schedules the first step as soon as a request arrives at an idle engine;
    # the step planned ahead is its decode, and none is planned past max_tokens.
    runner = _runner(async_scheduling)
    box = runner.submit_at(0.5, unique_prompt(8), 3)
    steps = runner.run()
    (request,) = box
    assert request.first_token_time == 1.5
    assert request.finished_time == 3.5
    assert steps == 3


@pytest.mark.parametrize(("async_scheduling", "ttft"), [(False, 1.5), (True, 2.5)])
def test_a_request_arriving_while_the_engine_runs_waits_one_step_more(
    async_scheduling: bool, ttft: float
) -> None:
    # Steps [0,1], [1,2], [2,3], ... for the running request. B arrives at 2.5, in
    # step [2,3]; with async scheduling step [3,4] was planned at 2, so B's prefill
    # runs in [4,5] instead of [3,4].
    runner = _runner(async_scheduling)
    a = runner.submit_at(0.0, unique_prompt(4), 10)
    b = runner.submit_at(2.5, unique_prompt(4), 2)
    runner.run()
    assert b[0].first_token_time is not None
    assert b[0].first_token_time - b[0].arrival_time == ttft
    # The running request's tokens are released at the same times either way.
    assert a[0].first_token_time == 1.0
    assert a[0].finished_time == 10.0


def _mixed_run(
    async_scheduling: bool, prompts: list[list[int]]
) -> tuple[dict[str, list[int]], int]:
    """Staggered requests under a small budget and a small KV cache (preemptions)."""
    runner = _runner(
        async_scheduling,
        max_num_batched_tokens=24,
        max_model_len=64,
        block_size=4,
        num_gpu_blocks=24,
        long_prefill_token_threshold=16,
    )
    boxes = [
        runner.submit_at(0.7 * i, prompt, 6 + 3 * i, request_id=f"r{i}")
        for i, prompt in enumerate(prompts)
    ]
    runner.run()
    requests = [box[0] for box in boxes]
    assert all(r.finish_reason == "length" for r in requests)
    tokens = {r.request_id: r.output_token_ids for r in requests}
    return tokens, runner.engine.scheduler.num_preemptions


def test_greedy_tokens_are_the_same_with_and_without_async_scheduling() -> None:
    prompts = [unique_prompt(n) for n in (30, 5, 41, 12, 7, 20)]
    sync_tokens, _ = _mixed_run(False, prompts)
    async_tokens, preemptions = _mixed_run(True, prompts)
    assert async_tokens == sync_tokens
    assert all(len(t) == 6 + 3 * i for i, t in enumerate(sync_tokens.values()))
    # the run did preempt, so a step planned before a preemption was applied safely
    assert preemptions > 0


def test_the_step_planned_ahead_decodes_a_request_whose_prefill_is_in_flight() -> None:
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("a", 10, 2))
    sched.add_request(make_request("b", 6, 1))
    first = sched.schedule()
    ahead = sched.schedule()  # planned before ``first`` is applied
    # a decodes its placeholder token; b's only token is in flight: nothing more
    planned = [
        (c.request_id, c.num_tokens, c.num_computed_before, c.is_decode) for c in ahead.chunks
    ]
    assert planned == [("a", 1, 10, True)]
    tokens = sched.update_from_output(first)
    assert [(t.request.request_id, t.token_id, t.finished) for t in tokens] == [
        ("a", sample_position(tokens[0].request, 0), False),
        ("b", sample_position(tokens[1].request, 0), True),
    ]
    (last,) = sched.update_from_output(ahead)
    assert (last.request.request_id, last.finished) == ("a", True)
    assert sched.schedule().is_empty
    assert not sched.has_unfinished_requests


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sim"], True),
        (["sim", "--no-async-scheduling"], False),
        (["sim", "--profile", "cpu-tiny"], False),
        (["sim", "--profile", "vllm-cpu-tiny"], False),
        (["sim", "--profile", "cpu-tiny", "--async-scheduling"], True),
        (["sim", "--async-scheduling", "interference"], True),
        (["sim", "interference", "--no-async-scheduling"], False),
    ],
)
def test_the_flag_takes_vllms_name_and_defaults_to_the_profiles_choice(
    argv: list[str], expected: bool
) -> None:
    args = parse(argv[0], argv[1:])
    assert sim_settings(args).scheduler.async_scheduling is expected
