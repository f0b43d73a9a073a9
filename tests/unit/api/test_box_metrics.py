"""The metrics of a box's workers as one exposition: each family once, every
worker's samples labelled with it, so that counters sum over workers and nothing
is lost or doubled; a worker left out is named; and a worker that does not answer
is not waited for (asked over a Unix socket where nothing listens)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.box import Box, box_metrics
from proxy.metrics import merge_expositions

pytestmark = pytest.mark.anyio


def worker(requests: int, budget: float, waits: list[float]) -> bytes:
    registry = CollectorRegistry()
    counter = Counter("whoseturn_requests", "Requests", ["class"], registry=registry)
    counter.labels("interactive").inc(requests)
    Gauge("whoseturn_budget_tokens", "Budget", registry=registry).set(budget)
    histogram = Histogram("whoseturn_wait_seconds", "Waits", buckets=(0.1, 1.0), registry=registry)
    for wait in waits:
        histogram.observe(wait)
    return generate_latest(registry)


def samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_each_workers_samples_are_kept_and_labelled() -> None:
    merged = merge_expositions([("w0", worker(3, 100, [0.05])), ("w1", worker(4, 200, [0.5, 2.0]))])
    text = merged.decode()
    assert text.count("# TYPE whoseturn_requests_total counter") == 1
    assert text.count("# TYPE whoseturn_wait_seconds histogram") == 1
    got = samples(merged)
    total = [v for (n, labels), v in got.items() if n == "whoseturn_requests_total"]
    assert sorted(total) == [3, 4]
    assert (
        got["whoseturn_requests_total", frozenset({("class", "interactive"), ("worker", "w1")})]
        == 4
    )
    assert got["whoseturn_budget_tokens", frozenset({("worker", "w0")})] == 100
    count = {
        dict(labels)["worker"]: v
        for (n, labels), v in got.items()
        if n == "whoseturn_wait_seconds_count"
    }
    assert count == {"w0": 1, "w1": 2}
    assert not any(n == "whoseturn_box_workers_missing" for n, _ in got)


def test_a_worker_left_out_is_named() -> None:
    got = samples(merge_expositions([("w0", worker(1, 1, []))], missing=["w1"]))
    assert got["whoseturn_box_workers_missing", frozenset({("worker", "w1")})] == 1
    assert any(dict(labels).get("worker") == "w0" for _, labels in got)


async def test_a_worker_that_does_not_answer_is_left_out_at_once(tmp_path: Path) -> None:
    box = Box(0, (str(tmp_path / "w0.sock"), str(tmp_path / "w1.sock")))
    started = time.monotonic()
    merged = await box_metrics(box, worker(2, 5, []), authorization=None)
    assert time.monotonic() - started < 1.0, "a socket nobody listens on refuses at once"
    got = samples(merged)
    assert got["whoseturn_box_workers_missing", frozenset({("worker", "w1")})] == 1
    assert (
        got["whoseturn_requests_total", frozenset({("class", "interactive"), ("worker", "w0")})]
        == 2
    )
