"""The engines' queue and prefill histograms reduced per phase
(loadtests.harness.engine_histograms): hand-written scrapes with known deltas, two label
sets summed, interpolated quantiles, a restarted engine, a server without them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadtests.harness.engine_histograms import (
    Span,
    engine_view,
    histograms,
    phase_deltas,
    quantile,
    read_scrapes,
)
from loadtests.harness.report_sections import engine_lines

BOUNDS = ("0.1", "0.5", "1.0", "+Inf")


def _family(name: str, sets: dict[str, tuple[list[float], float]]) -> str:
    """One histogram family: per engine label, (cumulative bucket counts, sum)."""
    lines = [f"# HELP {name} x", f"# TYPE {name} histogram"]
    for engine, (counts, total) in sets.items():
        labels = f'engine="{engine}",model_name="tiny"'
        lines += [
            f'{name}_bucket{{{labels},le="{le}"}} {c}' for le, c in zip(BOUNDS, counts, strict=True)
        ]
        lines += [f"{name}_count{{{labels}}} {counts[-1]}", f"{name}_sum{{{labels}}} {total}"]
    return "\n".join(lines) + "\n"


QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
OTHER = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n"
SCRAPES = [
    (
        0.0,
        _family(QUEUE, {"0": ([2, 3, 4, 4], 1.0), "1": ([0, 0, 0, 0], 0.0)})
        + _family(PREFILL, {"0": ([4, 4, 4, 4], 0.2)})
        + OTHER,
    ),
    (
        5.0,
        _family(QUEUE, {"0": ([4, 7, 9, 10], 6.0), "1": ([1, 1, 1, 2], 2.05)})
        + _family(PREFILL, {"0": ([10, 12, 12, 12], 1.8)})
        + OTHER,
    ),
    (
        10.0,
        _family(QUEUE, {"0": ([5, 9, 11, 12], 7.0), "1": ([1, 1, 1, 2], 2.05)})
        + _family(PREFILL, {"0": ([10, 12, 12, 12], 1.8)}),
    ),
]


def _file(scrapes: list[tuple[float, str]]) -> str:
    return "".join(f"# scraped_at {t:.3f}\n{text}" for t, text in scrapes)


def test_the_scrape_file_is_read_back_in_order() -> None:
    assert [t for t, _ in read_scrapes(_file(SCRAPES))] == [0.0, 5.0, 10.0]
    assert "vllm:num_requests_running 3.0" in read_scrapes(_file(SCRAPES))[0][1]


def test_label_sets_are_summed() -> None:
    found = histograms(SCRAPES[1][1])
    assert set(found) == {"queue", "prefill"}  # no TTFT histogram exported
    queue = found["queue"]
    assert queue.count == 12 and queue.sum == pytest.approx(8.05)
    assert queue.buckets == ((0.1, 5), (0.5, 8), (1.0, 10), (math.inf, 12))


def test_a_phase_is_the_difference_of_the_scrapes_around_it() -> None:
    # (1.0, 5.0): from the scrape at 0.0 (the last at or before its start) to the one
    # at 5.0 (the first at or after its end)
    deltas = phase_deltas(SCRAPES, [Span("measured", 1.0, 5.0)])["measured"]
    queue = deltas["queue"]
    assert queue.count == 8 and queue.sum == pytest.approx(7.05)
    assert queue.buckets == ((0.1, 3), (0.5, 5), (1.0, 6), (math.inf, 8))
    # p50: rank 4 in (0.1, 0.5] holding ranks 4..5: 0.1 + 0.4 * (4 - 3) / 2
    assert quantile(queue, 0.50) == pytest.approx(0.3)
    # p95: rank 7.6 in the +Inf bucket: the highest finite bound
    assert quantile(queue, 0.95) == pytest.approx(1.0)
    prefill = deltas["prefill"]
    assert prefill.count == 8 and prefill.sum == pytest.approx(1.6)
    assert quantile(prefill, 0.50) == pytest.approx(0.1 * 4 / 6)


def test_the_engine_view_per_phase_and_pooled(tmp_path: Path) -> None:
    path = tmp_path / "proxy-engine-0.prom"
    path.write_text(_file(SCRAPES))
    spans = [Span("warm-0 measured", 1.0, 5.0), Span("warm-1 measured", 5.0, 10.0)]
    pooled = {"warm measured": ["warm-0 measured", "warm-1 measured"]}
    view = engine_view(path, spans, pooled)
    first = view["warm-0 measured"]["queue"]
    assert first["requests"] == 8 and first["mean"] == pytest.approx(7.05 / 8)
    assert (first["p50"], first["p95"]) == (pytest.approx(0.3), pytest.approx(1.0))
    second = view["warm-1 measured"]
    assert second["queue"]["requests"] == 2 and second["queue"]["mean"] == pytest.approx(0.5)
    assert second["prefill"] == {"requests": 0, "mean": None, "p50": None, "p95": None}
    together = view["warm measured"]["queue"]
    assert together["requests"] == 10 and together["mean"] == pytest.approx(8.05 / 10)
    assert view["warm measured"]["ttft"]["requests"] is None  # not exported


def test_a_restarted_engine_and_a_server_without_histograms_give_no_figure(
    tmp_path: Path,
) -> None:
    restarted = [SCRAPES[1], (9.0, SCRAPES[0][1])]
    assert phase_deltas(restarted, [Span("m", 5.0, 9.0)]) == {"m": {}}
    proxy = tmp_path / "proxy-proxy.prom"
    proxy.write_text(_file([(0.0, OTHER), (1.0, OTHER)]))
    assert engine_view(proxy, [Span("m", 0.0, 1.0)], {}) == {}
    assert engine_view(tmp_path / "absent.prom", [Span("m", 0.0, 1.0)], {}) == {}


def test_the_report_sets_the_engines_beside_the_client(tmp_path: Path) -> None:
    path = tmp_path / "proxy-engine-0.prom"
    path.write_text(_file(SCRAPES))
    pooled = {"warm measured": ["warm-0 measured"]}
    view = engine_view(path, [Span("warm-0 measured", 1.0, 5.0)], pooled)
    client = {
        "requests": 7.0,
        "ttft_p50": 0.25,
        "ttft_p95": 0.9,
        "queue_p50": None,
        "queue_p95": 0.4,
    }
    lines = "\n".join(engine_lines({"proxy": {"engines": {"engine-0": view}, "client": client}}))
    assert "| proxy | engine engine-0 | 8 | 881 ms / 300 ms / 1,000 ms |" in lines
    assert "| proxy | client, all classes | 7 | - / - / 400 ms | - | - / 250 ms / 900 ms |" in lines
