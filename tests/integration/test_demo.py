"""A very short ``whoseturn demo``, as a user runs it: real processes on loopback, the
table on stdout, and a whole result directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

PNG = b"\x89PNG\r\n\x1a\n"


def test_short_demo_writes_the_table_and_the_result_directory(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "proxy", "demo", "--duration", "3", "--warmup", "1"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=140
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| chat TTFT p95 |" in done.stdout
    assert "| batch valid records per hour |" in done.stdout
    (out,) = tmp_path.iterdir()
    result = json.loads((out / "result.json").read_text())
    for key in ("date", "workload", "setup", "summaries", "answer_check", "reasoning"):
        assert result[key], key
    assert result["retest_when"]
    assert set(result["summaries"]) == {"direct", "proxy"}
    assert result["setup"]["launch_commands"]["proxy"][-1][-3:-1] == ["serve", "--config"]
    assert result["answer_check"]["differing"] == 0
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in rows} == {"direct", "proxy"}
    assert any(r["text"] for r in rows)
    for name in ("ttft.png", "timeline-proxy.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert "Answer check:" in (out / "report.md").read_text()
    # the servers were watched: each one's /metrics scraped, its processes' peaks kept
    peaks = result["machine"]["proxy"]["servers"]
    assert set(peaks) == {"engine-0", "engine-1", "proxy"}
    assert all(p["rss_peak_bytes"] > 10 * 2**20 for p in peaks.values())
    assert "# scraped_at" in (out / "metrics" / "proxy-proxy.prom").read_text()
