"""TTFT by prompt length (loadtests.harness.buckets): the bucket edges, the figures per
bucket over a run's measured window, and their table in the report."""

from __future__ import annotations

import math

import pytest

from loadtests.harness.buckets import bucket, by_length
from loadtests.harness.client import Record
from loadtests.harness.measures import Window
from loadtests.harness.report_sections import length_lines

from .records import record


@pytest.mark.parametrize(
    ("tokens", "name"),
    [
        (0, "<512"),
        (511, "<512"),
        (512, "512-2k"),
        (2047, "512-2k"),
        (2048, "2k-8k"),
        (8191, "2k-8k"),
        (8192, ">=8k"),
        (120_000, ">=8k"),
        (None, "unknown"),
    ],
)
def test_bucket_edges(tokens: int | None, name: str) -> None:
    assert bucket(tokens) == name


def _record(i: int, sent: float, ttft: float | None, tokens: int | None) -> Record:
    times = [] if ttft is None else [sent + ttft]
    return record(i, kind="c", sent_at=sent, token_times=times, prompt_tokens=tokens)


def test_figures_per_bucket_over_the_measured_window() -> None:
    records = [
        _record(0, 11.0, 0.010, 100),
        _record(1, 12.0, 0.030, 300),
        _record(2, 13.0, 0.020, 400),
        _record(3, 14.0, 0.500, 3000),
        _record(4, 15.0, 0.700, 5000),
        _record(5, 16.0, None, None),  # failed: no usage, no token
        _record(6, 5.0, 9.0, 100),  # sent during the warm-up: left out
        _record(7, 17.0, 9.0, 100),  # closed by the client: left out
    ]
    records[7].closed_at = 18.0
    rows = by_length([Window(records, 10.0, 20.0, counted_from=0.0)])
    assert [(f.bucket, f.requests, f.with_ttft) for f in rows] == [
        ("<512", 3, 3),
        ("2k-8k", 2, 2),
        ("unknown", 1, 0),
    ]
    short, long, unknown = rows
    assert (short.ttft_p50, short.ttft_p95) == pytest.approx((0.020, 0.030))
    assert (long.ttft_p50, long.ttft_p95) == pytest.approx((0.500, 0.700))
    assert math.isnan(unknown.ttft_p50)
    table = "\n".join(length_lines({"direct": {"c": rows}, "proxy": {"c": rows[:1]}}))
    assert "| c | <512 | 3: 20 ms / 30 ms | 3: 20 ms / 30 ms |" in table
    assert "| c | 2k-8k | 2: 500 ms / 700 ms | - |" in table
