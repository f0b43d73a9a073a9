"""scheduler_config: engine flags over a profile's defaults, as vLLM resolves them."""

from __future__ import annotations

import pytest

from loadtests.sim.profile import load_profile
from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.settings import SimSettings, scheduler_config

H100 = load_profile("h100-llama3-8b")
TINY = load_profile("cpu-tiny")


def test_defaults_come_from_the_profile() -> None:
    config = scheduler_config(TINY)
    engine = TINY.engine
    assert config.max_num_batched_tokens == engine.max_num_batched_tokens
    assert config.max_num_seqs == engine.max_num_seqs
    assert config.max_model_len == engine.max_model_len
    assert config.block_size == engine.block_size
    assert config.num_gpu_blocks == engine.num_gpu_blocks
    assert config.enable_chunked_prefill
    assert config.enable_prefix_caching
    assert config.scheduling_policy is SchedulingPolicy.FCFS


def test_flags_override_the_profile() -> None:
    config = scheduler_config(
        TINY,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=4096,
        long_prefill_token_threshold=128,
        scheduling_policy="priority",
        block_size=32,
        num_gpu_blocks=1000,
        enable_prefix_caching=False,
    )
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len) == (
        512,
        8,
        4096,
    )
    assert config.long_prefill_token_threshold == 128
    assert config.scheduling_policy is SchedulingPolicy.PRIORITY
    assert (config.block_size, config.num_gpu_blocks) == (32, 1000)
    assert not config.enable_prefix_caching


def test_chunked_prefill_off_with_a_too_small_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        scheduler_config(TINY, enable_chunked_prefill=False, max_num_batched_tokens=2048)


@pytest.mark.parametrize("profile", [TINY, H100], ids=lambda p: p.name)
def test_chunked_prefill_off_without_a_budget_raises_it_to_max_model_len(profile: object) -> None:
    config = scheduler_config(profile, enable_chunked_prefill=False)  # type: ignore[arg-type]
    assert not config.enable_chunked_prefill
    assert config.max_num_batched_tokens == config.max_model_len
    assert config.max_model_len > 2048


def test_chunked_prefill_off_keeps_a_profile_budget_already_above_max_model_len() -> None:
    config = scheduler_config(H100, enable_chunked_prefill=False, max_model_len=4096)
    assert config.max_num_batched_tokens == H100.engine.max_num_batched_tokens == 8192


def test_chunked_prefill_off_with_an_explicit_large_budget_is_accepted() -> None:
    config = scheduler_config(
        TINY, enable_chunked_prefill=False, max_num_batched_tokens=8192, max_model_len=8192
    )
    assert config.max_num_batched_tokens == 8192


def test_unknown_policy_name_is_refused() -> None:
    with pytest.raises(ValueError):
        scheduler_config(TINY, scheduling_policy="shortest-first")


def test_a_cache_smaller_than_one_context_is_refused() -> None:
    with pytest.raises(ValueError, match="KV cache"):
        scheduler_config(TINY, num_gpu_blocks=10, max_model_len=8192)


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_sim_settings_refuse_a_non_positive_time_scale(scale: float) -> None:
    with pytest.raises(ValueError, match="time_scale"):
        SimSettings(
            profile=TINY,
            scheduler=scheduler_config(TINY),
            served_model_name="tiny",
            time_scale=scale,
        )
