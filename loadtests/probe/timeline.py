"""What a decode stream's token arrival times say about one injected prompt.

Pure functions of monotonic timestamps (seconds): the runner records when each token
of the decode stream arrived and when the injected prompt was sent and answered.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True, kw_only=True)
class Quiet:
    """The decode stream's gaps before anything was injected beside it."""

    median_gap_s: float
    worst_gap_s: float


def quiet_gaps(arrivals: Sequence[float], before: float) -> Quiet:
    """The gaps between tokens that all arrived before ``before``.

    The gap after the stream's first token is left out (the first token follows the
    stream's own prefill). Raises ValueError with fewer than two such gaps.
    """
    times = [t for t in arrivals if t <= before]
    gaps = [b - a for a, b in pairwise(times[1:])]
    if len(gaps) < 2:
        raise ValueError(f"need at least 2 quiet gaps, got {len(gaps)}")
    return Quiet(median_gap_s=statistics.median(gaps), worst_gap_s=max(gaps))


def stall(arrivals: Sequence[float], start: float, end: float) -> float:
    """The longest gap between consecutive tokens that overlaps ``[start, end]``.

    A gap overlaps when its later token came after ``start`` and its earlier token
    before ``end``: the step that stalled decode may have begun before the prompt was
    sent (it was waiting for that step) and ends about when the prompt is answered.
    Raises ValueError when no gap overlaps (no token arrived after ``start``).
    """
    if end < start:
        raise ValueError(f"window ends ({end}) before it starts ({start})")
    overlapping = [b - a for a, b in pairwise(arrivals) if b > start and a < end]
    if not overlapping:
        raise ValueError("no decode token arrived during the window")
    return max(overlapping)


def step_threshold(quiet: Quiet, stall_s: float) -> float:
    """A gap longer than this is a step that computed part of a prefill.

    Twice the quiet median and half as long again as the quiet worst (a decode step's
    own jitter), and an eighth of the stall: a prefill's chunks differ in cost only by
    the context they attend to (on a CPU the last chunk of an 8k-token prompt costs
    about five times the first), while shorter gaps during it are hiccups, such as
    the engine's API server reading the long prompt.
    """
    return max(2 * quiet.median_gap_s, 1.5 * quiet.worst_gap_s, stall_s / 8)


def long_gaps(arrivals: Sequence[float], start: float, end: float, threshold: float) -> int:
    """How many gaps overlapping ``[start, end]`` (as in :func:`stall`) exceed
    ``threshold``: the steps a prompt in flight over that window took."""
    return sum(1 for a, b in pairwise(arrivals) if b > start and a < end and b - a > threshold)


def tokens_after(arrivals: Sequence[float], t: float) -> int:
    """How many tokens arrived strictly after ``t``."""
    return sum(1 for a in arrivals if a > t)
