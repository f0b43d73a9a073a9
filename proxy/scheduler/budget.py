"""The batch prefill budget and the feedback loop that adapts it (AIMD).

The controller watches two signals of interactive service over a sliding window:
time to first token, and the gaps between tokens of interactive streams (prefill
steals decode time as well as queue time). Gaps are judged by the streams' time,
not by their tokens (:func:`time_weighted_percentile`): tokens held up somewhere
and then delivered in one burst add hundreds of near-zero gaps, which would
otherwise hide the one long gap before them and open the budget just when the
streams stall. Once per ``interval`` it compares a high
percentile of each against ``aim`` x its target, aiming below the target so that
headroom absorbs a prompt twice as long as usual:

- either above its aim: the budget is cut multiplicatively (``decrease``);
- both below and batch work waiting: the budget grows additively (``increase``).

After a cut, only samples observed since the cut are judged, so one bad burst
costs one cut, not one per interval until the burst leaves the window. Several
proxies running this loop in front of the same engines converge the way AIMD flows
share a link, without talking to each other.
"""

from __future__ import annotations

import math
from collections import deque

from proxy.config import BudgetConfig


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    # round off float error first: 0.07 * 100 is 7.000000000000001, and rank 7 is meant
    rank = max(1, math.ceil(round(q * len(ordered), 9)))
    return ordered[rank - 1]


def time_weighted_percentile(gaps: list[float], q: float) -> float:
    """The gap that a ``q`` share of the streams' waiting time was spent in gaps no
    longer than: each gap weighs its own length. A non-empty list; all zeros give 0.

    Ten gaps of 10 ms and one of 1 s: by tokens the p95 is 10 ms, by time 1 s.
    """
    ordered = sorted(gaps)
    total = sum(ordered)
    if total <= 0:
        return ordered[-1]
    threshold = q * total
    reached = 0.0
    for gap in ordered:
        reached += gap
        # round off float error first, as percentile() does
        if round(reached - threshold, 12) >= 0:
            return gap
    return ordered[-1]


class SlidingWindow:
    """Timestamped samples no older than ``span`` seconds.

    ``added`` counts the samples ever added: a mark in the stream that
    ``values(now, after=mark)`` judges from, even when many share one instant.
    """

    def __init__(self, span: float) -> None:
        self.span = span
        self.added = 0
        self._samples: deque[tuple[float, int, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self.added += 1
        self._samples.append((t, self.added, value))
        while self._samples[0][0] < t - self.span:
            self._samples.popleft()

    def values(self, now: float, after: int = 0) -> list[float]:
        """The samples within the span before ``now`` added after ``after`` (a read)."""
        return [v for t, n, v in self._samples if n > after and t >= now - self.span]


class BudgetController:
    """The budget ``B`` of one engine: prompt tokens that may be in prefill at once."""

    def __init__(self, settings: BudgetConfig, now: float) -> None:
        self.settings = settings
        self.tokens = settings.initial_tokens
        self.ttft = SlidingWindow(settings.window_s)
        self.gaps = SlidingWindow(settings.window_s)
        self._last_update = now
        self._cut_marks = (0, 0)  # samples of each signal already judged by a cut
        self.history: deque[tuple[float, int]] = deque([(now, self.tokens)], maxlen=600)

    def observe_ttft(self, now: float, seconds: float) -> None:
        self.ttft.add(now, seconds)

    def observe_gap(self, now: float, seconds: float) -> None:
        self.gaps.add(now, seconds)

    def signal(self, now: float) -> tuple[float | None, float | None]:
        """The judged percentiles of TTFT (by request) and gap (by time; see
        :func:`time_weighted_percentile`); None: too few samples."""
        s = self.settings
        ttft = self.ttft.values(now, self._cut_marks[0])
        gaps = self.gaps.values(now, self._cut_marks[1])
        p_ttft = percentile(ttft, s.percentile) if len(ttft) >= s.min_samples else None
        enough = len(gaps) >= s.min_samples
        p_gap = time_weighted_percentile(gaps, s.percentile) if enough else None
        return p_ttft, p_gap

    def update(self, now: float, batch_waiting: bool) -> int:
        """Run the loop if an interval has passed; returns the budget."""
        s = self.settings
        if now - self._last_update < s.interval_s:
            return self.tokens
        self._last_update = now
        p_ttft, p_gap = self.signal(now)
        over = (p_ttft is not None and p_ttft > s.aim * s.ttft_target_s) or (
            p_gap is not None and p_gap > s.aim * s.gap_target_s
        )
        before = self.tokens
        if over:
            self.tokens = max(s.min_tokens, int(self.tokens * s.decrease))
            self._cut_marks = (self.ttft.added, self.gaps.added)
        elif batch_waiting:
            self.tokens = min(s.max_tokens, self.tokens + s.increase_tokens)
        if self.tokens != before:
            self.history.append((now, self.tokens))
        return self.tokens
