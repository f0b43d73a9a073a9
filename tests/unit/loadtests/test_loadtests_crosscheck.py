"""The cross-check against GuideLLM (loadtests.compare.crosscheck_guidellm): the prompts
file it reads, the figures read from its JSON report, the differences in percent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.compare.crosscheck_guidellm import differences, guidellm_ttft, harness_ttft, main

WORKLOAD = Path(__file__).parents[3] / "loadtests" / "workloads" / "crosscheck.yaml"


def test_prompts_are_the_harness_requests(tmp_path: Path) -> None:
    from loadtests.harness.traffic import body
    from loadtests.harness.workload_file import load_workload

    out = tmp_path / "p.jsonl"
    assert main(["prompts", str(WORKLOAD), "chat", "5", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    workload = load_workload(WORKLOAD)
    assert [r["prompt"] for r in rows] == [
        body(workload, workload.classes[0], i)["prompt"] for i in range(5)
    ]
    assert {r["output_tokens_count"] for r in rows} == {32}


def _report(ttfts_ms: list[float], median: float, p95: float) -> dict[str, object]:
    return {
        "benchmarks": [
            {
                "metrics": {
                    "time_to_first_token_ms": {
                        "successful": {"median": median, "percentiles": {"p95": p95}}
                    }
                },
                "requests": {"successful": [{"time_to_first_token_ms": t} for t in ttfts_ms]},
            }
        ]
    }


def test_guidellm_figures_its_own_and_nearest_rank() -> None:
    values = [float(v) for v in range(10, 210, 10)]  # 20 requests, 10..200 ms
    got = guidellm_ttft(_report(values, median=105.0, p95=190.5))
    assert got["requests"] == 20
    assert got["p50"] == pytest.approx(0.105) and got["p95"] == pytest.approx(0.1905)
    assert got["p50_nearest_rank"] == pytest.approx(0.100)
    assert got["p95_nearest_rank"] == pytest.approx(0.190)


def test_differences_are_percent_of_the_harness_figure() -> None:
    ours = harness_ttft(
        {"summaries": {"direct": {"chat": {"requests": 9, "ttft_p50": 0.2, "ttft_p95": 0.4}}}},
        "chat",
    )
    theirs = {"p50": 0.21, "p95": 0.36, "p50_nearest_rank": 0.2, "p95_nearest_rank": 0.44}
    diff = differences(ours, theirs)
    assert diff["p50"] == pytest.approx(5.0) and diff["p95"] == pytest.approx(-10.0)
    assert diff["p95_nearest_rank"] == pytest.approx(10.0)


def test_compare_fails_beyond_the_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = {"requests": 20, "ttft_p50": 0.1, "ttft_p95": 0.2}
    (tmp_path / "result.json").write_text(json.dumps({"summaries": {"direct": {"chat": summary}}}))
    report = tmp_path / "g.json"
    values = [float(v) for v in range(10, 210, 10)]
    report.write_text(json.dumps(_report(values, median=105.0, p95=190.0)))
    assert main(["compare", str(tmp_path), str(report), "chat"]) == 0
    assert "Worst difference 5.0%" in capsys.readouterr().out
    report.write_text(json.dumps(_report(values, median=125.0, p95=190.0)))
    assert main(["compare", str(tmp_path), str(report), "chat"]) == 1
