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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

WORKLOAD = {
    "name": "tiny-mix",
    "plan": {"duration_s": 2, "warmup_s": 0.5},
    "classes": {
        "chat": {
            "route": "chat",
            "api": "chat",
            "arrival": {"process": "gamma", "rate": 5, "burstiness": 2},
            "prompt": {"chars": 200},
            "max_tokens": 4,
        },
        "batch": {
            "route": "batch",
            "api": "completions",
            "arrival": {"process": "closed", "concurrency": 2},
            "prompt": {"chars": 2000},
            "max_tokens": 4,
        },
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
