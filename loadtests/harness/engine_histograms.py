"""The engine's own view of each request's wait and prefill, from the ``/metrics``
scrapes the harness keeps (:mod:`loadtests.harness.watch`, about one a second).

vLLM's histograms, per phase of a run:

- ``vllm:request_queue_time_seconds``: arrival in the engine → first scheduled;
- ``vllm:request_prefill_time_seconds``: first scheduled → first token;
- ``vllm:time_to_first_token_seconds``: arrival → first token (when exported).

A phase's histogram is the difference between two scrapes: the last at or before
its start and the first at or after its end (the first and last scrapes when there
are none), so its edges are blurred by a scrape interval. Label sets (engine, model)
are summed. From it: the requests observed, the mean (``Δsum / Δcount``) and p50 and
p95 interpolated linearly within the bucket that holds the rank, as Prometheus's
``histogram_quantile`` does (a rank in the ``+Inf`` bucket gives the highest finite
bound). The engine observes a request when it records it (vLLM: as the request
finishes, or at its first token for TTFT), so a phase's requests are those the
engine recorded in it, not exactly those the client sent in it. A counter that went
down (the engine restarted) gives no figure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}
HEADER = re.compile(r"^# scraped_at (\S+)\n", re.MULTILINE)

Scrape = tuple[float, str]  # seconds from the watch's start, the exposition text


def read_scrapes(text: str) -> list[Scrape]:
    """A ``metrics/<arm>-<server>.prom`` file's scrapes, in order."""
    parts = HEADER.split(text)
    return [(float(t), body) for t, body in zip(parts[1::2], parts[2::2], strict=True)]


@dataclass(frozen=True)
class Histogram:
    """A histogram summed over its label sets: ``buckets`` are (upper bound,
    cumulative count), sorted, the last ``+Inf``."""

    count: float
    sum: float
    buckets: tuple[tuple[float, float], ...]


def histograms(text: str) -> dict[str, Histogram]:
    """The histograms of :data:`HISTOGRAMS` in an exposition, by short name; one the
    text does not have is absent."""
    wanted = {name: short for short, name in HISTOGRAMS.items()}
    sums: dict[str, dict[str, float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        short = wanted.get(family.name)
        if short is None:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                into = buckets.setdefault(short, {})
                into[le] = into.get(le, 0.0) + s.value
            elif s.name.endswith(("_count", "_sum")):
                key = s.name.rsplit("_", 1)[1]
                totals = sums.setdefault(short, {})
                totals[key] = totals.get(key, 0.0) + s.value
    return {
        short: Histogram(
            sums[short].get("count", 0.0),
            sums[short].get("sum", 0.0),
            tuple(sorted(buckets.get(short, {}).items())),
        )
        for short in sums
    }


def delta(before: Histogram, after: Histogram) -> Histogram | None:
    """``after - before``; None when a count went down or the buckets differ."""
    if [le for le, _ in before.buckets] != [le for le, _ in after.buckets]:
        return None
    counts = [(le, b - a) for (le, a), (_, b) in zip(before.buckets, after.buckets, strict=True)]
    if after.count < before.count or any(c < 0 for _, c in counts):
        return None
    return Histogram(after.count - before.count, after.sum - before.sum, tuple(counts))


def added(a: Histogram, b: Histogram) -> Histogram:
    """Two deltas of the same histogram together."""
    counts = tuple((le, x + y) for (le, x), (_, y) in zip(a.buckets, b.buckets, strict=True))
    return Histogram(a.count + b.count, a.sum + b.sum, counts)


def quantile(h: Histogram, q: float) -> float:
    """The ``q`` quantile (0 to 1), interpolated as ``histogram_quantile``; NaN for
    an empty histogram."""
    if h.count <= 0 or not h.buckets:
        return math.nan
    rank = q * h.buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, cumulative in h.buckets:
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cumulative
    return lower


def figures(h: Histogram | None) -> dict[str, float | None]:
    """``requests``, ``mean``, ``p50``, ``p95`` (seconds) of a delta; None for none."""
    if h is None or h.count <= 0:
        return {"requests": 0 if h is not None else None, "mean": None, "p50": None, "p95": None}
    return {
        "requests": h.count,
        "mean": h.sum / h.count,
        "p50": quantile(h, 0.50),
        "p95": quantile(h, 0.95),
    }


@dataclass(frozen=True)
class Span:
    """A phase in the scrapes' time (seconds from the watch's start)."""

    name: str
    start: float
    end: float


def phase_deltas(
    scrapes: Sequence[Scrape], spans: Sequence[Span]
) -> dict[str, dict[str, Histogram]]:
    """Each span's histograms (:func:`delta` between the scrapes around it), by span
    and short name; a histogram with no figure is absent."""
    if not scrapes:
        return {}
    times = [t for t, _ in scrapes]
    parsed: dict[int, dict[str, Histogram]] = {}

    def at(i: int) -> dict[str, Histogram]:
        if i not in parsed:
            parsed[i] = histograms(scrapes[i][1])
        return parsed[i]

    out: dict[str, dict[str, Histogram]] = {}
    for span in spans:
        first = max((i for i, t in enumerate(times) if t <= span.start), default=0)
        last = min((i for i, t in enumerate(times) if t >= span.end), default=len(times) - 1)
        before, after = at(first), at(last)
        found = {
            short: d
            for short in after
            if short in before and (d := delta(before[short], after[short])) is not None
        }
        out[span.name] = found
    return out


def engine_view(
    metrics: Path, spans: Sequence[Span], pooled: dict[str, list[str]]
) -> dict[str, Any]:
    """A server's scrape file reduced: per span, and per pooled group (a name: the
    spans it adds up), :func:`figures` of each histogram; empty when the server
    exports none of them (the proxy)."""
    if not metrics.exists():
        return {}
    deltas = phase_deltas(read_scrapes(metrics.read_text()), spans)
    if not any(deltas.values()):
        return {}
    groups = dict(deltas)
    for name, members in pooled.items():
        together: dict[str, Histogram] = {}
        for member in members:
            for short, h in deltas.get(member, {}).items():
                together[short] = added(together[short], h) if short in together else h
        groups[name] = together
    return {
        name: {short: figures(found.get(short)) for short in HISTOGRAMS}
        for name, found in groups.items()
    }
