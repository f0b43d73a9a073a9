"""Engines the harness starts (loadtests.harness.engines): startup facts read from flags, a
vLLM log and /metrics; the watch's arithmetic (loadtests.harness.watch): peaks and energy;
the Batch API class's counting (loadtests.harness.traffic, loadtests.harness.measures)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest

from loadtests.harness.engines import engine_argv, startup_facts
from loadtests.harness.measures import ClassSummary, judge, summarize_jobs
from loadtests.harness.traffic import Job, count_output
from loadtests.harness.watch import ProcessView, energy_joules, gpu_sample, peaks
from loadtests.harness.workload_file import Bar

VLLM_LOG = """\
(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'host': '127.0.0.1', \
'port': 39375, 'max_model_len': 8192, 'served_model_name': ['tiny'], \
'long_prefill_token_threshold': 256, 'scheduling_policy': 'priority'}
(APIServer pid=1) INFO Chunked prefill is enabled with max_num_batched_tokens=2048.
(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: \
model='x', enable_prefix_caching=True, chunked_prefill=True
"""
METRICS = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="False"} 1.0\n'


def test_facts_from_a_vllm_log_say_where_each_was_read() -> None:
    facts = startup_facts(["vllm", "serve"], VLLM_LOG, "")
    assert facts["long_prefill_token_threshold"] == {"value": 256, "from": "log"}
    assert facts["scheduling_policy"] == {"value": "priority", "from": "log"}
    assert facts["max_num_batched_tokens"] == {"value": 2048, "from": "log"}
    assert facts["chunked_prefill"] == {"value": True, "from": "log"}
    assert facts["prefix_caching"] == {"value": True, "from": "log"}
    assert facts["max_num_seqs"]["value"] is None
    assert facts["max_num_seqs"]["from"].startswith("not stated")


def test_a_flag_wins_over_the_log_and_the_log_over_the_metrics() -> None:
    argv = ["x", "--max-num-batched-tokens", "512", "--no-enable-prefix-caching"]
    facts = startup_facts(argv, VLLM_LOG, METRICS)
    assert facts["max_num_batched_tokens"] == {"value": 512, "from": "flag"}
    assert facts["prefix_caching"] == {"value": False, "from": "flag"}
    assert startup_facts(["x"], "", METRICS)["prefix_caching"] == {
        "value": False,
        "from": "metrics",
    }
    assert startup_facts(["x", "--long-prefill-token-threshold=64"], "", "")[
        "long_prefill_token_threshold"
    ] == {"value": 64, "from": "flag"}


def test_engine_argv_fills_the_port_and_runs_whoseturn_from_this_checkout() -> None:
    argv = engine_argv("whoseturn sim --profile cpu-tiny --port {port}", 8123)
    assert argv == [sys.executable, "-m", "proxy", "sim", "--profile", "cpu-tiny", "--port", "8123"]
    assert engine_argv("{python} -m http.server {port}", 9)[0] == sys.executable


def test_energy_is_the_area_under_the_power_samples() -> None:
    assert energy_joules([0, 1, 3], [100, 200, 200]) == pytest.approx(150 + 400)
    assert energy_joules([5], [300]) == 0


def test_peaks_per_server_and_gpu_energy_per_sample_span() -> None:
    def proc(rss: float, swap: float, cpu: float) -> dict[str, float]:
        return {"rss_bytes": rss, "swap_bytes": swap, "cpu_percent": cpu, "processes": 1}

    samples = [
        {
            "t": 0.0,
            "servers": {"e": proc(10, 0, 50), "p": None},
            "gpus": [{"memory_mib": 1000, "power_w": 100}, {"memory_mib": 500, "power_w": 50}],
        },
        {
            "t": 2.0,
            "servers": {"e": proc(30, 5, 20), "p": proc(7, 0, 1)},
            "gpus": [{"memory_mib": 2000, "power_w": 300}, {"memory_mib": 500, "power_w": 50}],
        },
    ]
    view = peaks(samples)
    assert view["servers"]["e"] == {
        "rss_peak_bytes": 30,
        "swap_peak_bytes": 5,
        "cpu_peak_percent": 50,
    }
    assert view["servers"]["p"]["rss_peak_bytes"] == 7
    assert view["gpu"]["memory_peak_mib"] == 2500
    assert view["gpu"]["power_peak_w"] == 350
    assert view["gpu"]["energy_j"] == pytest.approx((150 + 350) / 2 * 2)
    assert peaks([{"t": 0, "servers": {}, "gpus": None}])["gpu"] is None


def test_the_process_view_sees_this_process() -> None:
    view = ProcessView()
    first = view.sample(os.getpid())
    assert first is not None and first["rss_bytes"] > 1_000_000
    assert not math.isnan(first["cpu_percent"])
    assert view.sample(2**22 + 12345) is None  # no such process


def _line(status: int, finish: str, tokens: int) -> str:
    body = {"choices": [{"finish_reason": finish}], "usage": {"completion_tokens": tokens}}
    return json.dumps({"custom_id": "x", "response": {"status_code": status, "body": body}})


def test_a_job_output_counts_answered_and_whole_lines() -> None:
    text = "\n".join([_line(200, "length", 8), _line(200, "stop", 3), _line(500, "length", 8), ""])
    counted = count_output(text, 8)
    assert (counted.answered, counted.whole, counted.valid) == (3, 1, 1)
    assert counted.schema_checked == counted.schema_valid == 0


def test_job_figures_per_hour_over_the_runs_summed_length() -> None:
    done = Job("j-0", "jobs", 10, submitted_at=100.0, finished_at=102.0, status="completed")
    done.completed, done.valid = 10, 9
    cut = Job("j-1", "jobs", 10, submitted_at=101.0, finished_at=130.0, status="cancelled")
    cut.completed, cut.valid, cut.cancelled_by_client = 4, 4, True
    s = summarize_jobs([([done], 100.0, 118.0), ([cut], 200.0, 218.0)])
    assert (s.requests, s.valid) == (20, 13)
    assert s.records_per_hour == pytest.approx(14 * 3600 / 36)
    assert s.valid_per_hour == pytest.approx(13 * 3600 / 36)
    assert s.done_p50 == pytest.approx(2.0)  # the cancelled job's time is no completion
    empty = summarize_jobs([([], 0.0, 10.0)])
    assert math.isnan(empty.valid_per_hour) and math.isnan(empty.records_per_hour)


def _summary(**figures: float) -> ClassSummary:
    names = "ttft_p50 ttft_p95 ttft_p99 itl_p50 itl_p95 tpot_p50 done_p50 done_p95 queue_p95"
    base = dict.fromkeys([*names.split(), "valid_per_hour"], 1.0)
    return ClassSummary(requests=3, valid=3, **{**base, **figures})  # type: ignore[arg-type]


def test_bars_judge_ratios_of_two_arms_and_validity() -> None:
    bars = (
        Bar(figure="chat.ttft_p95", ratio=("fcfs", "proxy"), above=5),
        Bar(figure="batch.done_p95", ratio=("proxy", "fcfs"), at_most=1.2),
        Bar(figure="chat.ttft_p95", ratio=("proxy", "fcfs"), above=1),
        Bar(all_valid=True),
    )
    figures = {
        "fcfs": {"chat": _summary(ttft_p95=12.0), "batch": _summary(done_p95=10.0)},
        "proxy": {"chat": _summary(ttft_p95=0.4), "batch": _summary(done_p95=12.5)},
    }
    verdicts = judge(bars, figures)
    assert [v.met for v in verdicts] == [True, False, False, True]
    assert verdicts[0].line() == "chat.ttft_p95: fcfs / proxy = 30.00 (bar > 5): met"
    assert verdicts[1].line() == "batch.done_p95: proxy / fcfs = 1.25 (bar <= 1.2): NOT met"
    figures["proxy"]["chat"] = dataclasses.replace(figures["proxy"]["chat"], valid=2)
    assert judge(bars[3:], figures)[0].line() == "valid answers, all arms: 11 of 12: NOT met"
    one = Bar(figure="chat.ttft_p95", arm="proxy", at_most=0.5)
    assert judge([one], figures)[0].line() == "chat.ttft_p95: proxy = 0.40 s (bar <= 0.5): met"
    nan = _summary(ttft_p95=math.nan)
    assert not judge(bars[:1], {"fcfs": {"chat": nan}, "proxy": {"chat": nan}})[0].met


def test_the_compare_workload_parses_and_dry_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests import cli

    path = Path(__file__).parents[3] / "loadtests" / "workloads" / "compare.yaml"
    assert cli.main("loadtest", [str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "arm priority (via direct)" in out and "--scheduling-policy priority" in out
    assert "--long-prefill-token-threshold 256" in out
    assert out.count("\nbar: ") == 13
    assert "arm proxy-auto (via proxy)" in out
    assert "the proxy's engine settings: {'piecing': 'auto'}" in out


def test_gpu_samples_are_read_from_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in ``nvidia-smi`` on PATH prints what the real one prints for
    ``--query-gpu=memory.used,power.draw --format=csv,noheader,nounits``."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '81559, 120.50\\n1024, [N/A]\\n512, 75.00\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_sample() == [  # a GPU whose power is not available is left out
        {"memory_mib": 81559.0, "power_w": 120.5},
        {"memory_mib": 512.0, "power_w": 75.0},
    ]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_sample() is None
