"""Reading an engine's load from its Prometheus text."""

from __future__ import annotations

import pytest

from loadtests.sim.server.metrics import SimMetrics
from loadtests.sim.step_scheduler import SchedulerConfig
from proxy.engines import parse_load, parse_prefix_cache_hits
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


def test_prefix_cache_hits_are_summed_over_ranks_and_created_is_ignored() -> None:
    text = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1024.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 512.0\n'
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 9999.0\n'
    )
    assert parse_prefix_cache_hits(text) == 1536.0
    assert parse_prefix_cache_hits("vllm:prefix_cache_hits_total 7\n") == 7.0


def test_no_prefix_cache_hits_counter_reads_none() -> None:
    assert parse_prefix_cache_hits(METRICS_TEXT.replace("prefix_cache_hits", "other")) is None
    assert parse_prefix_cache_hits("") is None


def test_a_prefix_cache_hits_sample_without_a_number_is_a_parse_error() -> None:
    with pytest.raises(MetricsParseError):
        parse_prefix_cache_hits('vllm:prefix_cache_hits_total{engine="0"} lots\n')


def test_the_simulated_engine_counts_prefix_cache_hits() -> None:
    metrics = SimMetrics("tiny", SchedulerConfig(max_model_len=2048))
    metrics.prefix_hits.inc(4096)
    assert parse_prefix_cache_hits(metrics.render().decode()) == 4096.0
