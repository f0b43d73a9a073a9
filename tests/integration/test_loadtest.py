"""``whoseturn loadtest`` against a simulated engine and the proxy in front of it:
both arms run, their answers agree, the result directory is whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loadtests import cli
from tests.integration.proxyserver import engine, run_proxy
from tests.integration.simserver import SimServer
from tests.support.workloads import batch_class, chat_class

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

WORKLOAD = {
    "name": "tiny-mix",
    "plan": {"duration_s": 2, "warmup_s": 0.5},
    "classes": {
        "chat": chat_class(
            {"process": "gamma", "rate": 5, "burstiness": 2}, chars=200, max_tokens=4
        ),
        "batch": batch_class(concurrency=2, chars=2000, max_tokens=4),
    },
}


def test_loadtest_runs_both_arms_and_writes_the_result(
    sim: SimServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(WORKLOAD))
    with run_proxy([engine(sim.base_url, "sim-0")]) as proxy:
        argv = [str(path), "--target", proxy.base_url, "--direct", sim.base_url]
        status = cli.main("loadtest", [*argv, "--out", str(tmp_path / "out")])
    assert status == 0
    assert "| chat TTFT p95 |" in capsys.readouterr().out
    (out,) = (tmp_path / "out").iterdir()
    assert out.name.startswith("tiny-mix-")
    result = json.loads((out / "result.json").read_text())
    assert set(result["summaries"]) == {"direct", "proxy"}
    assert result["summaries"]["proxy"]["chat"]["valid"] > 0
    assert result["answer_check"]["compared"] > 0
    assert result["answer_check"]["differing"] == 0
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    proxied = [r for r in rows if r["arm"] == "proxy" and r["kind"] == "batch"]
    assert proxied and all(r["url"].endswith("/batch/v1/completions") for r in proxied)
    assert any(r["proxy_queue_ms"] is not None for r in proxied)
    assert (out / "timeline-proxy.png").exists() and (out / "ttft.png").exists()


def test_loadtest_starts_the_engines_and_the_proxy_it_names_and_watches_them(
    tmp_path: Path,
) -> None:
    """A workload with ``engines:`` and ``proxy:``: each arm on fresh engines the
    harness starts, timed until ready, their startup facts read, /metrics scraped and
    the OS view sampled during the run; every process stopped after."""
    import psutil

    workload = {
        **WORKLOAD,
        "name": "started",
        "engines": {
            "count": 1,
            "command": "whoseturn sim --profile cpu-tiny --time-scale 20 "
            "--long-prefill-token-threshold 256 --port {port}",
        },
        "proxy": {"settings": {"scrape_interval_s": 0.5}},
    }
    workload["classes"] = {
        **WORKLOAD["classes"],  # type: ignore[dict-item]
        "question": {
            "route": "chat",
            "api": "chat",
            "arrival": {"process": "poisson", "rate": 3},
            "prompt": {"source": "questions"},
            "max_tokens": 4,
        },
        "jobs": {
            "route": "batch-api",
            "api": "chat",
            "arrival": {"process": "closed", "concurrency": 1},
            "prompt": {"source": "extraction", "chars": 1000},
            "max_tokens": 4,
            "job_lines": 5,
            "poll_s": 0.2,
        },
    }
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(workload))
    assert cli.main("loadtest", [str(path), "--out", str(tmp_path / "out")]) == 0
    (out,) = (tmp_path / "out").iterdir()
    result = json.loads((out / "result.json").read_text())
    started = result["setup"]["started"]
    assert [s["name"] for s in started["direct"]] == ["engine-0"]
    assert [s["name"] for s in started["proxy"]] == ["engine-0", "proxy"]
    engine = started["proxy"][0]
    assert engine["ready_s"] > 0
    assert engine["startup_facts"]["long_prefill_token_threshold"] == {
        "value": 256,
        "from": "flag",
    }
    assert engine["startup_facts"]["prefix_caching"]["from"] == "metrics"
    assert result["summaries"]["proxy"]["question"]["valid"] > 0
    jobs = result["summaries"]["proxy"]["jobs"]
    # extraction prompts: every whole line's answer is checked against its schema (the
    # simulated engine's text is no JSON, so none follows it and none is valid)
    assert jobs["whole"] > 0 and jobs["schema_checked"] == jobs["whole"]
    assert jobs["valid"] == jobs["schema_valid"]
    assert jobs["records_per_hour"] > 0 and jobs["records_per_hour"] >= jobs["valid_per_hour"]
    assert result["summaries"]["direct"]["jobs"]["valid_per_hour"] is None  # no Batch API
    rows = [json.loads(line) for line in (out / "jobs.jsonl").read_text().splitlines()]
    assert rows and all(r["arm"] == "proxy" and r["batch_id"] for r in rows)
    for arm, names in (("direct", ["engine-0"]), ("proxy", ["engine-0", "proxy"])):
        for name in names:
            scrapes = (out / "metrics" / f"{arm}-{name}.prom").read_text()
            assert scrapes.count("# scraped_at") >= 2
        peaks = result["machine"][arm]["servers"]
        assert all(peaks[name]["rss_peak_bytes"] > 10 * 2**20 for name in names)
    report = (out / "report.md").read_text()
    assert "## Servers started by the harness" in report
    # the new parts: stops per phase, TTFT by prompt length, the engines' histograms
    assert set(result["stalls"]) == {"direct", "proxy"}
    assert result["stalls"]["proxy"]["count"] == len(result["stalls"]["proxy"]["stops"])
    assert "## The machine's stops" in report and "## TTFT by prompt length" in report
    lengths = result["ttft_by_prompt_length"]["proxy"]["question"]
    assert lengths and lengths[0]["bucket"] == "<512" and lengths[0]["ttft_p95"] > 0
    engine_view = result["engine_histograms"]["proxy"]["engines"]
    assert set(engine_view) == {"engine-0"}  # the proxy exports no vllm: histograms
    warm = engine_view["engine-0"]["warm measured"]
    assert warm["queue"]["requests"] > 0 and warm["prefill"]["mean"] > 0
    assert result["engine_histograms"]["proxy"]["client"]["ttft_p95"] > 0
    assert "## Queue and prefill as the engines saw them" in report
    ports = {int(s["url"].rsplit(":", 1)[1]) for arm in started.values() for s in arm}
    listening = {
        c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
    }
    assert not ports & listening  # every server stopped
