"""TTFT by prompt length, so a reader sees whether long prompts (long conversations,
long documents) pay more for their first token.

A request's bucket is its prompt's length in the engine's own tokens, as the answer's
``usage.prompt_tokens`` says: under 512, 512 to 2k, 2k to 8k, 8k and over
(:data:`BUCKETS`). Tokens rather than conversation turns: every prompt source has
them, a turn's length varies tenfold, and prefill costs by the token. A request whose
answer carried no usage (it failed or was cut early) is counted under ``unknown``.

The records are those the class's latencies are of (:class:`loadtests.harness.measures.Window`:
sent within the measured window, not closed early); percentiles are nearest-rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.harness.measures import Window, pct

BOUNDS = (512, 2048, 8192)
BUCKETS = ("<512", "512-2k", "2k-8k", ">=8k")
UNKNOWN = "unknown"


def bucket(prompt_tokens: int | None) -> str:
    """The bucket of a prompt of ``prompt_tokens`` tokens (:data:`BUCKETS`)."""
    if prompt_tokens is None:
        return UNKNOWN
    return BUCKETS[bisect.bisect_right(BOUNDS, prompt_tokens)]


@dataclass(frozen=True)
class LengthFigures:
    """One bucket of one class of one arm: requests, those with a first token, and
    their TTFT p50 and p95 (seconds; NaN for none)."""

    bucket: str
    requests: int
    with_ttft: int
    ttft_p50: float
    ttft_p95: float


def by_length(windows: Sequence[Window]) -> list[LengthFigures]:
    """A class's requests over ``windows`` per prompt-length bucket, in bucket order
    (``unknown`` last); empty buckets left out."""
    ttfts: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for w in windows:
        for r in w.records:
            if not (w.start <= r.sent_at <= w.end) or r.closed_at is not None:
                continue
            name = bucket(r.prompt_tokens)
            counts[name] = counts.get(name, 0) + 1
            if (t := r.ttft) is not None:
                ttfts.setdefault(name, []).append(t)
    return [
        LengthFigures(
            name,
            counts[name],
            len(ttfts.get(name, [])),
            pct(ttfts.get(name, []), 0.50),
            pct(ttfts.get(name, []), 0.95),
        )
        for name in (*BUCKETS, UNKNOWN)
        if name in counts
    ]
