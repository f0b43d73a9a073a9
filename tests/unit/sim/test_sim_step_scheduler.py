"""EngineScheduler stepped by hand: budgets, order, chunking, preemption, abort."""

from __future__ import annotations

import pytest

from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.request import RequestStatus
from loadtests.sim.step_scheduler import EngineScheduler, SchedulerConfig, SchedulerOutput

from .helpers import chunk_of, make_request, make_scheduler, run_until_idle, step

FCFS, PRIORITY = SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY


def ids(sched: EngineScheduler) -> list[str]:
    return [r.request_id for r in sched.running]


# -- configuration and intake -------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 0},
        {"max_num_seqs": 0},
        {"max_model_len": 0},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048, "max_model_len": 4096},
        {"num_gpu_blocks": 3, "block_size": 16, "max_model_len": 64},
    ],
)
def test_config_rejects_impossible_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_config_message_names_both_flags_when_chunked_prefill_off() -> None:
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(2048\).*max_model_len \(4096\)"
    ):
        SchedulerConfig(
            enable_chunked_prefill=False, max_num_batched_tokens=2048, max_model_len=4096
        )


def test_add_request_rejects_duplicates_empty_and_too_long_prompts() -> None:
    sched = make_scheduler(max_model_len=32, block_size=4, num_gpu_blocks=8)
    sched.add_request(make_request("a", 4, 1))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("a", 4, 1))
    with pytest.raises(ValueError, match="at least one"):
        sched.add_request(make_request("b", 0, 1))
    with pytest.raises(ValueError, match="room"):
        sched.add_request(make_request("c", 32, 1))
    assert list(sched.requests) == ["a"]
    assert len(sched.waiting) == 1


def test_idle_scheduler_plans_an_empty_step() -> None:
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty
    assert out.num_tokens == 0
    assert not sched.has_unfinished_requests


# -- running before waiting ------------------------------------------------------------


def test_running_requests_get_their_tokens_before_waiting_ones_are_admitted() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, max_model_len=64, block_size=4)
    sched.add_request(make_request("a", 3, 10))
    sched.add_request(make_request("b", 3, 10))
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 3), ("b", 3)]

    sched.add_request(make_request("c", 20, 10))
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens, c.is_decode) for c in out.chunks] == [
        ("a", 1, True),
        ("b", 1, True),
        ("c", 8, False),
    ]

    # c is now running with an unfinished prefill: it is served before a new arrival.
    sched.add_request(make_request("d", 5, 10))
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 8)]
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [
        ("a", 1),
        ("b", 1),
        ("c", 4),
        ("d", 4),
    ]
    assert out.num_tokens == 10
    assert out.num_prefill_tokens == 8
    assert out.num_decode_tokens == 2


def test_no_admission_when_running_requests_use_the_whole_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=2, max_model_len=64, block_size=4)
    sched.add_request(make_request("a", 1, 10))
    sched.add_request(make_request("b", 1, 10))
    step(sched)
    sched.add_request(make_request("c", 1, 10))
    for _ in range(5):
        out, _ = step(sched)
        assert [c.request_id for c in out.chunks] == ["a", "b"]
        assert sched.requests["c"].status is RequestStatus.WAITING


# -- admission order -----------------------------------------------------------------

# (id, priority, arrival), added in this order.
ARRIVALS = [("r0", 2, 0.0), ("r1", 0, 0.3), ("r2", 1, 0.1), ("r3", 0, 0.2), ("r4", 1, 0.05)]


def admission_order(policy: SchedulingPolicy, budget: int) -> list[list[str]]:
    """Requests admitted in each step for ARRIVALS (4-token prompts, one token each)."""
    sched = make_scheduler(max_num_batched_tokens=budget, scheduling_policy=policy)
    for rid, priority, arrival in ARRIVALS:
        sched.add_request(make_request(rid, 4, 1, priority=priority, arrival=arrival))
    return [out.newly_scheduled for out in run_until_idle(sched)]


def test_fcfs_admits_in_arrival_order() -> None:
    assert admission_order(FCFS, budget=4) == [["r0"], ["r1"], ["r2"], ["r3"], ["r4"]]
    assert admission_order(FCFS, budget=100) == [["r0", "r1", "r2", "r3", "r4"]]


def test_priority_admits_lower_value_first_then_earlier_arrival() -> None:
    assert admission_order(PRIORITY, budget=4) == [["r3"], ["r1"], ["r4"], ["r2"], ["r0"]]
    assert admission_order(PRIORITY, budget=100) == [["r3", "r1", "r4", "r2", "r0"]]


def test_sequence_cap_holds_back_admissions_until_a_slot_frees() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 2, 3))
    admitted: list[list[str]] = []
    for out in run_until_idle(sched):
        assert len(out.chunks) <= 2
        admitted.append(out.newly_scheduled)
    assert admitted == [["r0", "r1"], [], [], ["r2", "r3"], [], [], ["r4"], [], []]


# -- chunked prefill ------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=128)
    sched.add_request(make_request("long", 300, 2))
    outs = run_until_idle(sched)
    assert [(c.num_tokens, c.num_computed_before, c.is_decode) for o in outs for c in o.chunks] == [
        (128, 0, False),
        (128, 128, False),
        (44, 256, False),
        (1, 300, True),
    ]


def test_long_prefill_threshold_caps_chunks_and_shares_the_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=128, long_prefill_token_threshold=50)
    sched.add_request(make_request("x", 120, 1))
    sched.add_request(make_request("y", 120, 1))
    outs = run_until_idle(sched)
    assert [[(c.request_id, c.num_tokens) for c in o.chunks] for o in outs] == [
        [("x", 50), ("y", 50)],
        [("x", 50), ("y", 50)],
        [("x", 20), ("y", 20)],
    ]


def decoding_plus_prompts(chunked: bool) -> EngineScheduler:
    """``a`` decoding; then ``b`` (50 tokens) and ``c`` (30 tokens) arrive; budget 64."""
    sched = make_scheduler(
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        enable_chunked_prefill=chunked,
    )
    sched.add_request(make_request("a", 4, 20))
    step(sched)
    sched.add_request(make_request("b", 50, 5))
    sched.add_request(make_request("c", 30, 5))
    return sched


def test_without_chunked_prefill_a_prompt_is_scheduled_whole_or_not_at_all() -> None:
    sched = decoding_plus_prompts(chunked=False)
    out, _ = step(sched)
    # c's 30 tokens do not fit in the 13 left: it waits, whole, for the next step.
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 50)]
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 30)]


def test_without_chunked_prefill_the_threshold_applies_before_the_step_budget() -> None:
    # vLLM caps a waiting prompt at --long-prefill-token-threshold first, and only then
    # checks it against the step budget: c's 60 tokens, capped at 10, fit in the 53 left
    sched = make_scheduler(
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=10,
    )
    sched.add_request(make_request("a", 4, 20))
    step(sched)
    sched.add_request(make_request("b", 60, 5))
    sched.add_request(make_request("c", 60, 5))
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 10), ("c", 10)]


def test_with_chunked_prefill_the_leftover_budget_starts_the_next_prompt() -> None:
    sched = decoding_plus_prompts(chunked=True)
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 50), ("c", 13)]


# -- preemption -----------------------------------------------------------------------


def growing_pair(policy: SchedulingPolicy, **config: object) -> EngineScheduler:
    """'low' (priority 5) admitted one step before 'high' (priority 0); 9 blocks of 4.

    Each ends at 4 + 20 tokens (6 blocks); both cannot fit, so one is preempted.
    """
    config = {"block_size": 4, "num_gpu_blocks": 9, "max_model_len": 32, **config}
    sched = make_scheduler(scheduling_policy=policy, **config)
    sched.add_request(make_request("low", 4, 20, priority=5, arrival=0.0))
    step(sched)
    sched.add_request(make_request("high", 4, 20, priority=0, arrival=0.1))
    step(sched)
    assert ids(sched) == ["low", "high"]
    return sched


def steps_until_preemption(sched: EngineScheduler) -> tuple[int, SchedulerOutput]:
    for n in range(1, 100):
        out, _ = step(sched)
        if out.preempted:
            return n, out
    raise AssertionError("no preemption")


def test_fcfs_preempts_the_last_admitted_request() -> None:
    _, out = steps_until_preemption(growing_pair(FCFS))
    assert out.preempted == ["high"]
    assert [c.request_id for c in out.chunks] == ["low"]


def test_priority_preempts_the_lowest_priority_request_even_if_already_scheduled() -> None:
    _, out = steps_until_preemption(growing_pair(PRIORITY))
    assert out.preempted == ["low"]
    # 'low' came first in the running list and had its decode token; it is taken back.
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("high", 1)]
    assert out.num_tokens == 1


def test_a_request_preempting_itself_does_not_leave_an_empty_plan() -> None:
    # With 8 blocks 'low' (one token ahead) is the first to need a fifth block; it is
    # also the lowest ranked, so it preempts itself before 'high' is looked at.
    sched = growing_pair(PRIORITY, num_gpu_blocks=8)
    _, out = steps_until_preemption(sched)
    assert out.preempted == ["low"]
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("high", 1)]
    run_until_idle(sched)


def test_equal_rank_requests_do_not_preempt_each_other_forever() -> None:
    # Neither fits beside the other at its end, and recomputing takes a step per token:
    # preempting the one furthest along each time would never finish either.
    sched = make_scheduler(
        scheduling_policy=PRIORITY,
        max_num_batched_tokens=3,
        long_prefill_token_threshold=1,
        block_size=1,
        num_gpu_blocks=13,
        max_model_len=13,
        enable_prefix_caching=False,
    )
    a = make_request("a", 1, 11, arrival=1.0)
    b = make_request("b", 1, 12, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    run_until_idle(sched, max_steps=500)
    assert (len(a.output_token_ids), len(b.output_token_ids)) == (11, 12)
    assert sched.num_preemptions <= 2


def test_a_plan_is_never_empty_while_requests_are_unfinished() -> None:
    for blocks in (8, 9, 10):
        for policy in (FCFS, PRIORITY):
            sched = growing_pair(policy, num_gpu_blocks=blocks)
            run_until_idle(sched)  # fails on an empty plan


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("policy", [FCFS, PRIORITY])
def test_preempted_request_is_recomputed_and_finishes_with_all_its_tokens(
    policy: SchedulingPolicy, prefix_caching: bool
) -> None:
    sched = growing_pair(policy, enable_prefix_caching=prefix_caching)
    _, out = steps_until_preemption(sched)
    victim = sched.requests[out.preempted[0]]
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert sched.kv.blocks_of(victim.request_id) == []
    assert victim in list(sched.waiting)
    assert sched.num_preemptions == 1
    context = victim.num_tokens
    assert context > 4 + 1

    chunks = [c for o in run_until_idle(sched) for c in o.chunks]
    resumed = next(c for c in chunks if c.request_id == victim.request_id)
    # The prompt and every token generated so far are recomputed (or found cached).
    assert resumed.num_computed_before + resumed.num_tokens == context
    if not prefix_caching:
        assert resumed.num_computed_before == 0
    assert victim.status is RequestStatus.FINISHED
    assert victim.output_token_ids == [1_000_000 + i for i in range(20)]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_preempted_request_goes_back_to_the_front_of_the_fcfs_queue() -> None:
    sched = growing_pair(FCFS, max_num_seqs=2)
    sched.add_request(make_request("later", 4, 1, arrival=0.2))
    steps_until_preemption(sched)
    assert [r.request_id for r in sched.waiting] == ["high", "later"]


def test_no_waiting_request_is_admitted_in_a_step_that_preempts() -> None:
    n, _ = steps_until_preemption(growing_pair(PRIORITY))
    sched = growing_pair(PRIORITY)
    for _ in range(n - 1):
        step(sched)
    # 'later' outranks the victim and would fit in the blocks the preemption frees.
    sched.add_request(make_request("later", 1, 1, priority=0, arrival=0.2))
    out, _ = step(sched)
    assert out.preempted == ["low"]
    assert out.newly_scheduled == []
    assert sched.requests["later"].status is RequestStatus.WAITING
    out, _ = step(sched)
    assert out.newly_scheduled == ["later"]


# -- finishing ------------------------------------------------------------------------


def test_request_stops_at_max_model_len_before_max_tokens() -> None:
    sched = make_scheduler(max_model_len=16, block_size=4, num_gpu_blocks=8)
    request = make_request("a", 10, 100)
    sched.add_request(request)
    run_until_idle(sched)
    assert len(request.output_token_ids) == 6
    assert request.num_tokens == 16
    assert request.status is RequestStatus.FINISHED
    assert request.finish_reason == "length"


def test_finished_requests_release_their_blocks_and_leave_the_scheduler() -> None:
    sched = make_scheduler(block_size=4, num_gpu_blocks=16, max_model_len=64)
    requests = [make_request(f"r{i}", 5 + i, 3) for i in range(3)]
    for r in requests:
        sched.add_request(r)
    run_until_idle(sched)
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    assert all(r.finish_reason == "length" for r in requests)
    assert all(len(r.output_token_ids) == 3 for r in requests)
    assert sched.requests == {}
    assert sched.running == []
    assert sched.kv.num_free_blocks == 16


# -- abort ----------------------------------------------------------------------------


def test_abort_of_a_waiting_request_removes_it_from_the_queue() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 4, 3))
    sched.add_request(make_request("b", 4, 3))
    step(sched)
    aborted = sched.abort_request("b")
    assert aborted is not None
    assert aborted.status is RequestStatus.ABORTED
    assert aborted.finish_reason == "abort"
    assert list(sched.waiting) == []
    outs = run_until_idle(sched)
    assert all(chunk_of(o, "b") == 0 for o in outs)


def test_abort_of_a_running_request_frees_its_blocks_at_once() -> None:
    sched = make_scheduler(
        max_num_batched_tokens=16, block_size=4, num_gpu_blocks=32, max_model_len=128
    )
    sched.add_request(make_request("a", 100, 3))
    step(sched)
    assert len(sched.kv.blocks_of("a")) == 4
    assert sched.kv.num_free_blocks == 28
    sched.abort_request("a")
    assert sched.kv.blocks_of("a") == []
    assert sched.kv.num_free_blocks == 32
    assert sched.running == []
    assert not sched.has_unfinished_requests


def test_abort_of_a_preempted_request_takes_it_off_the_waiting_queue() -> None:
    sched = growing_pair(FCFS)
    _, out = steps_until_preemption(sched)
    victim = sched.abort_request(out.preempted[0])
    assert victim is not None
    assert victim.status is RequestStatus.ABORTED
    assert list(sched.waiting) == []
    outs = run_until_idle(sched)
    assert all(chunk_of(o, victim.request_id) == 0 for o in outs)


def test_abort_of_an_unknown_request_returns_none() -> None:
    assert make_scheduler().abort_request("nope") is None


def test_a_step_planned_before_an_abort_does_not_resurrect_the_request() -> None:
    sched = make_scheduler(block_size=4, num_gpu_blocks=16, max_model_len=64)
    a = make_request("a", 8, 5)
    b = make_request("b", 8, 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert chunk_of(out, "a") == 8
    sched.abort_request("a")
    free_after_abort = sched.kv.num_free_blocks
    tokens = sched.update_from_output(out)
    assert [t.request.request_id for t in tokens] == ["b"]
    assert a.status is RequestStatus.ABORTED
    assert a.output_token_ids == []
    assert a.num_computed_tokens == 0
    assert ids(sched) == ["b"]
    assert sched.kv.blocks_of("a") == []
    assert sched.kv.num_free_blocks == free_after_abort
    outs = run_until_idle(sched)
    assert all(chunk_of(o, "a") == 0 for o in outs)
    assert len(b.output_token_ids) == 5
