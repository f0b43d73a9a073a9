"""``GET /metrics`` has vLLM V1's series, fed by what the engine did."""

from __future__ import annotations

import pytest

from .simserver import MODEL, SimServer

pytestmark = pytest.mark.integration

PROMPT = "Metrics tell whose turn it was: " + " ".join(f"item{i}" for i in range(40))
MAX_TOKENS = 5

HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
]


def complete(sim: SimServer) -> int:
    """Run one request to the end; returns its prompt tokens as ``usage`` says."""
    with sim.openai() as client:
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def test_one_request_shows_in_every_series(sim: SimServer) -> None:
    prompt_tokens = complete(sim)
    m = sim.metric
    labels = {"model_name": MODEL, "engine": "0"}
    assert m("vllm:prompt_tokens_total", **labels) == prompt_tokens
    assert m("vllm:generation_tokens_total", **labels) == MAX_TOKENS
    assert m("vllm:request_success_total", finished_reason="length") == 1
    assert m("vllm:request_success_total", finished_reason="abort") == 0
    for name in HISTOGRAMS:
        assert m(f"{name}_count") == 1, name
    assert m("vllm:inter_token_latency_seconds_count") == MAX_TOKENS - 1
    assert m("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert m("vllm:request_generation_tokens_sum") == MAX_TOKENS
    # One prefill step computes the prompt, then one decode step per further token.
    assert m("vllm:iteration_tokens_total_count") == MAX_TOKENS
    assert m("vllm:iteration_tokens_total_sum") == prompt_tokens + MAX_TOKENS - 1
    assert m("vllm:prefix_cache_queries_total") == prompt_tokens
    assert m("vllm:prefix_cache_hits_total") == 0
    assert m("vllm:num_preemptions_total") == 0
    assert m("vllm:cache_config_info", block_size="16") == 1


def test_latencies_are_model_seconds_of_the_profile(sim: SimServer) -> None:
    prompt_tokens = complete(sim)
    step = sim.settings.profile.step
    prefill = step.fixed_s + step.prefill_per_token_s * prompt_tokens
    decode = step.fixed_s + step.decode_per_token_s
    ttft = sim.metric("vllm:time_to_first_token_seconds_sum")
    assert prefill <= ttft < prefill + 0.5
    assert sim.metric("vllm:request_prefill_time_seconds_sum") == pytest.approx(prefill, rel=1e-6)
    itl = sim.metric("vllm:inter_token_latency_seconds_sum") / (MAX_TOKENS - 1)
    assert itl >= decode * 0.999


def test_a_repeated_prompt_hits_the_prefix_cache(sim: SimServer) -> None:
    prompt_tokens = complete(sim)
    complete(sim)
    assert sim.metric("vllm:prefix_cache_queries_total") == 2 * prompt_tokens
    block = sim.settings.scheduler.block_size
    assert sim.metric("vllm:prefix_cache_hits_total") == (prompt_tokens - 1) // block * block


def test_gauges_are_back_to_zero_after_the_work(sim: SimServer) -> None:
    complete(sim)
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting"]:
        assert sim.metric(name) == 0
    assert sim.metric("vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert sim.metric("vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert sim.metric("vllm:kv_cache_usage_perc") == 0


def test_lag_is_reported_and_zero_when_idle(sim: SimServer) -> None:
    assert sim.metric("whoseturn_sim_lag_seconds") == 0
    complete(sim)
    assert sim.metric("whoseturn_sim_steps_total") == MAX_TOKENS
    # The loop went idle after the last step: it is behind on nothing.
    sim.wait_for(lambda: sim.metric("whoseturn_sim_lag_seconds") == 0, timeout=1)
    assert sim.metric("whoseturn_sim_lag_accumulated_seconds_total") >= 0
    assert not any(name.startswith("vllm:whoseturn") for name, _ in sim.metrics())
