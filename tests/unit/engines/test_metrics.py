"""Reading an engine's load from its Prometheus text."""

from __future__ import annotations

import pytest

from loadtests.sim.server.metrics import SimMetrics
from loadtests.sim.step_scheduler import SchedulerConfig
from proxy.engines import parse_load
from proxy.engines._metrics import MetricsParseError
from proxy.scheduler import EngineLoad

from .helpers import METRICS_TEXT


def test_realistic_vllm_text_sums_counts_and_takes_the_fullest_cache() -> None:
    # Two data-parallel ranks; _created series, histograms, counters and
    # num_requests_waiting_by_reason must not leak into the numbers.
    assert parse_load(METRICS_TEXT) == EngineLoad(kv_usage=0.625, waiting=7, running=7)


def test_missing_series_count_as_zero() -> None:
    only_running = 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    assert parse_load(only_running) == EngineLoad(kv_usage=0.0, waiting=0, running=2)
    assert parse_load("") == EngineLoad()


def test_vllm_v0_cache_name_is_read_when_v1_is_absent() -> None:
    v0 = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    assert parse_load(v0).kv_usage == 0.5
    both = v0 + 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    assert parse_load(both).kv_usage == 0.25


def test_samples_that_are_not_finite_are_ignored() -> None:
    text = (
        'vllm:num_requests_waiting{engine="0"} NaN\n'
        'vllm:num_requests_waiting{engine="1"} 3\n'
        'vllm:kv_cache_usage_perc{engine="0"} +Inf\n'
    )
    assert parse_load(text) == EngineLoad(kv_usage=0.0, waiting=3, running=0)


def test_the_simulated_engines_exposition_reads_back() -> None:
    config = SchedulerConfig(max_model_len=2048)
    metrics = SimMetrics("tiny", config)
    metrics.running.set(4)
    metrics.waiting.set(9)
    metrics.kv_usage.set(0.375)
    assert parse_load(metrics.render().decode()) == EngineLoad(0.375, 9, 4)


@pytest.mark.parametrize("text", ["<html>Bad Gateway</html>", "vllm:num_requests_running{ 1"])
def test_garbage_is_a_parse_error(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_load(text)
