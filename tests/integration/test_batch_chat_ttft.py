"""Chat keeps its turn while a Batch API job runs at full speed.

One ``whoseturn serve`` (Batch API on, TTFT target 50 ms) in front of one
``whoseturn sim`` (cpu-tiny, ten times real time), child processes on loopback.
The same chat load (four streaming clients, one short question after another)
runs twice in one run: with no batch work, then while a job of 1,000-token prompts
keeps the runner's window full. Chat TTFT p95 beside the job must stay under
``MAX_RATIO`` times chat TTFT p95 alone, or under ``FLOOR_S`` when chat alone is so
fast that a ratio says nothing (p95 16.9 ms alone against 153 ms beside the job read
as 9.1 in one CI run): on the loaded 2-core development machine the ratio measured
0.89 to 2.34 in quiet runs and 4.1 and 5.8 while the whole suite ran beside it, and
20.9 (p95 1.6 s)
with the prefill budget made useless (``min_tokens`` = ``max_tokens`` = 1,000,000,
so the window's 64 lines all prefill at once ahead of chat). The job must have
recorded lines meanwhile: keeping chat fast by stopping the job would not count.
``python -m loadtests.bench.batch_store --ttft`` is the printed, longer version.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.bench.batch_store import chat_beside_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MAX_RATIO = 8.0
FLOOR_S = 0.4  # eight times the target; a useless budget gave 1.6 s
TTFT_TARGET_S = 0.05
MIN_JOB_LINES = 20


def test_chat_ttft_p95_beside_a_running_batch_job(tmp_path: Path) -> None:
    result = chat_beside_job(tmp_path, chat_s=6.0, job_lines=2000, ttft_target_s=TTFT_TARGET_S)
    print()
    print("\n".join(result.lines()))
    assert result.chat_errors == 0
    assert len(result.alone_s) >= 50 and len(result.beside_s) >= 50
    assert result.job_lines >= MIN_JOB_LINES, "the job hardly ran beside chat"
    beside_p95 = result.p(result.beside_s, 95)
    assert result.ratio <= MAX_RATIO or beside_p95 <= FLOOR_S, result.lines()
