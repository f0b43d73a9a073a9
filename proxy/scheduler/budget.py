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

- either above its aim, judged on at least ``min_samples`` samples: the budget is
  cut multiplicatively (``decrease``);
- otherwise (both below their aims, or too few samples to judge) and batch work
  waiting: the budget grows additively (``increase``).

What is judged is the part of interactive latency that batch can cause (the
scheduler feeds only those samples): the time from dispatch to first token of
chats that shared the engine with batch prefill, and the gaps of such streams.
Each change is kept in :attr:`BudgetController.changes` with the numbers judged.

After a cut, only samples observed since the cut are judged, so one bad burst
costs one cut, not one per interval until the burst leaves the window. Several
proxies running this loop in front of the same engines converge the way AIMD flows
share a link, without talking to each other.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

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

    def between(self, start: float, end: float) -> list[float]:
        """The samples taken after ``start`` and at or before ``end`` (a read)."""
        return [v for t, _, v in self._samples if start < t <= end]


@dataclass(frozen=True)
class BudgetChange:
    """One move of the budget: when, from and to, and what was judged: each
    signal's percentile (None: fewer than ``min_samples``), its sample count and
    its aim (``aim`` x target). ``cause`` is ``ttft`` or ``gap`` (the signal over
    its aim) for a cut, ``headroom`` for growth."""

    time: float
    before: int
    after: int
    cause: str
    ttft_s: float | None
    ttft_samples: int
    ttft_aim_s: float
    gap_s: float | None
    gap_samples: int
    gap_aim_s: float


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
        self.changes: deque[BudgetChange] = deque(maxlen=200)
        self.missed_at: float | None = None
        """When the loop last judged a signal over its aim (cut or already at the
        floor); None: never."""

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

    def samples(self, now: float) -> tuple[int, int]:
        """How many TTFT and gap samples the next judgement would see (a read)."""
        ttft = self.ttft.values(now, self._cut_marks[0])
        return len(ttft), len(self.gaps.values(now, self._cut_marks[1]))

    def due(self, now: float) -> bool:
        """Whether :meth:`update` at ``now`` would run the loop (an interval passed)."""
        return not now - self._last_update < self.settings.interval_s

    def next_due(self) -> float:
        """About when the loop is next due (:meth:`due` decides exactly)."""
        return self._last_update + self.settings.interval_s

    def update(self, now: float, batch_waiting: bool) -> int:
        """Run the loop if an interval has passed; returns the budget."""
        s = self.settings
        if now - self._last_update < s.interval_s:
            return self.tokens
        self._last_update = now
        p_ttft, p_gap = self.signal(now)
        ttft_over = p_ttft is not None and p_ttft > s.aim * s.ttft_target_s
        gap_over = p_gap is not None and p_gap > s.aim * s.gap_target_s
        before, counts = self.tokens, self.samples(now)
        if ttft_over or gap_over:
            self.missed_at = now
            self.tokens = max(s.min_tokens, int(self.tokens * s.decrease))
            self._cut_marks = (self.ttft.added, self.gaps.added)
        elif batch_waiting:
            self.tokens = min(s.max_tokens, self.tokens + s.increase_tokens)
        if self.tokens != before:
            self.history.append((now, self.tokens))
            cause = "ttft" if ttft_over else "gap" if gap_over else "headroom"
            self.changes.append(
                BudgetChange(
                    now, before, self.tokens, cause, p_ttft, counts[0],
                    s.aim * s.ttft_target_s, p_gap, counts[1], s.aim * s.gap_target_s,
                )
            )  # fmt: skip
        return self.tokens
