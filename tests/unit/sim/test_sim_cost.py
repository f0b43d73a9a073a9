"""The step-time model: arithmetic from hand-built steps, and the H100 profile's figures."""

from __future__ import annotations

import pytest

from loadtests.sim.cost import step_seconds
from loadtests.sim.profile import StepCost, load_profile
from loadtests.sim.step_scheduler import ScheduledChunk, SchedulerOutput

from .helpers import drain, make_engine, run_with_arrivals, unique_prompt

COST = StepCost(
    fixed_s=1.0,
    prefill_per_token_s=0.1,
    decode_per_token_s=10.0,
    prefill_attention_per_token_context_s=0.001,
    decode_per_context_token_s=0.0001,
    decode_step_overhead_s=100.0,
)
H100 = load_profile("h100-llama3-8b").step


def output(*chunks: ScheduledChunk) -> SchedulerOutput:
    return SchedulerOutput(chunks=list(chunks))


def test_empty_step_costs_the_fixed_part() -> None:
    assert step_seconds(COST, output()) == pytest.approx(1.0)


def test_prefill_chunk_pays_per_token_and_attention_over_its_context() -> None:
    # 10 tokens after 20 computed: each attends on average to 20 + 10/2 = 25 tokens.
    chunk = ScheduledChunk("a", 10, 20, is_decode=False)
    expected = 1.0 + 0.1 * 10 + 0.001 * 10 * 25
    assert step_seconds(COST, output(chunk)) == pytest.approx(expected)


def test_decodes_pay_the_overhead_once_and_read_their_contexts() -> None:
    d1 = ScheduledChunk("a", 1, 99, is_decode=True)
    d2 = ScheduledChunk("b", 1, 9, is_decode=True)
    expected = 1.0 + 100.0 + 10.0 * 2 + 0.0001 * (100 + 10)
    assert step_seconds(COST, output(d1, d2)) == pytest.approx(expected)


def test_mixed_step_adds_both_parts() -> None:
    p = ScheduledChunk("p", 4, 0, is_decode=False)
    d = ScheduledChunk("d", 1, 49, is_decode=True)
    expected = 1.0 + 0.1 * 4 + 0.001 * 4 * 2 + 100.0 + 10.0 + 0.0001 * 50
    assert step_seconds(COST, output(p, d)) == pytest.approx(expected)


def test_step_time_grows_with_the_prefill_in_it() -> None:
    times = [step_seconds(H100, output(ScheduledChunk("p", n, 0, False))) for n in (1, 100, 8000)]
    assert times == sorted(times)
    assert times[2] - times[0] == pytest.approx(7999 * H100.prefill_per_token_s)


# -- the H100 profile in virtual time ------------------------------------------------


def test_h100_ttft_of_a_1000_token_prompt_alone_is_tens_of_ms() -> None:
    engine, clock = make_engine(H100)
    request = engine.add_request(unique_prompt(1000), 1)
    drain(engine, clock)
    assert request.first_token_time is not None
    ttft = request.first_token_time - request.arrival_time
    assert 0.010 <= ttft <= 0.050


def test_h100_batch_of_one_decodes_in_6_to_7_ms_per_token() -> None:
    engine, clock = make_engine(H100)
    request = engine.add_request(unique_prompt(1000), 100)
    results = drain(engine, clock)
    gaps = [t.gap for r in results for t in r.tokens if t.gap is not None]
    assert len(request.output_token_ids) == 100
    assert len(gaps) == 99
    assert all(0.006 <= g <= 0.007 for g in gaps)


def test_h100_chat_behind_64_long_prompts_waits_seconds() -> None:
    engine, clock = make_engine(H100, max_model_len=16_384)
    for _ in range(64):
        engine.add_request(unique_prompt(8000), 16)
    chat = engine.add_request(unique_prompt(1000), 16)
    drain(engine, clock)
    assert chat.first_token_time is not None
    ttft = chat.first_token_time - chat.arrival_time
    # 512,000 prompt tokens ahead of it at 8,192 a step, ~0.15 s a step.
    assert 5.0 <= ttft <= 20.0


def worst_chat_gap(chunked: bool, budget: int) -> float:
    """Worst token gap of a running chat when an 8,000-token prompt lands beside it."""
    engine, clock = make_engine(H100, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    arrivals = [(0.0, unique_prompt(200), 60), (0.05, unique_prompt(8000), 1)]
    (chat, batch), results = run_with_arrivals(engine, clock, arrivals)
    assert batch.first_scheduled_time is not None and chat.finished_time is not None
    assert batch.first_scheduled_time < chat.finished_time, "the prompt must land mid-chat"
    return max(t.gap for r in results for t in r.tokens if t.request is chat and t.gap is not None)


def test_chunked_prefill_off_stalls_running_decodes_for_the_whole_prompt() -> None:
    whole = worst_chat_gap(chunked=False, budget=8192)
    chunked = worst_chat_gap(chunked=True, budget=512)
    # The stalled step computes all 8,000 prompt tokens.
    assert whole >= 8000 * H100.prefill_per_token_s
    assert chunked <= H100.fixed_s + 512 * H100.prefill_per_token_s + 0.002
    assert whole > 5 * chunked


def test_a_step_cost_scaled_is_every_part_scaled() -> None:
    cost = StepCost(fixed_s=1.0, prefill_per_token_s=2.0, decode_per_token_s=3.0,
                    prefill_attention_per_token_context_s=4.0,
                    decode_per_context_token_s=5.0, decode_step_overhead_s=6.0)  # fmt: skip
    assert cost.scaled(2.0) == StepCost(fixed_s=2.0, prefill_per_token_s=4.0,
                                        decode_per_token_s=6.0,
                                        prefill_attention_per_token_context_s=8.0,
                                        decode_per_context_token_s=10.0,
                                        decode_step_overhead_s=12.0)  # fmt: skip
