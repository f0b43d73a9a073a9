"""What calibration measures, and the pure reductions from token times to measurements.

A :class:`Measurement` is one time (the median of repeated runs) and the shape of the
engine steps it is the time of:

- ``prefill``: a prompt alone, ``max_tokens`` 1; ``seconds`` is the time to first
  token seen by the client, so it includes the request's own overhead (HTTP, queueing
  into the engine loop) besides ``prefill_steps`` steps over ``prompt_tokens`` --
  unless ``engine_clock``: then it is the engine's own prefill time, steps only.
- ``decode``: ``batch`` streams decoding together; ``seconds`` is their mean step time
  while all of them decode, ``context_tokens`` the context they read per step (summed
  over the batch, averaged over the window).
- ``mixed``: a one-step prefill of ``prompt_tokens`` beside ``batch`` decoding streams;
  ``seconds`` is that step's time, read as the decode stream's gap that ends with the
  prefill's first token.

The functions here turn client-side arrival times into these numbers; they do no I/O,
so the unit tests feed them token times from the simulator in virtual time.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measured time (seconds, wall clock) and the step shape behind it."""

    kind: Kind
    seconds: float
    prompt_tokens: int = 0
    prefill_steps: int = 0
    batch: int = 0
    context_tokens: float = 0.0
    repeats: int = 1
    engine_clock: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.seconds) or self.seconds <= 0:
            raise ValueError(f"a measured time must be positive, got {self.seconds}")


class WindowError(ValueError):
    """The token times hold too few tokens where every stream was decoding."""


def prefill_steps(prompt_tokens: int, budget: int) -> int:
    """Steps a prompt alone takes under a per-step token budget (chunked prefill)."""
    return max(1, math.ceil(prompt_tokens / budget))


def lower_hull(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of points sorted by x (Andrew's monotone chain)."""
    hull: list[tuple[float, float]] = []
    for p in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) > 0:
                break
            hull.pop()
        hull.append(p)
    return hull


def envelope_slope(indices: Sequence[int], times: Sequence[float]) -> tuple[float, int, int]:
    """Seconds per token of a stream, read where no token was late.

    A token reaches the client at its step's end or later (a busy server or client
    delivers a burst at once), never earlier, so the step line runs under every
    (index, time) point: its best estimate is the edge of the points' lower hull over
    the middle index (the line under all points closest to them in sum). Returns
    (slope, first index, last index of that edge).
    """
    hull = lower_hull([(float(j), times[j]) for j in indices])
    middle = (indices[0] + indices[-1]) / 2
    for (x1, y1), (x2, y2) in itertools.pairwise(hull):
        if x1 <= middle <= x2:
            return (y2 - y1) / (x2 - x1), int(x1), int(x2)
    raise WindowError("a window of one token")


def steady_gap(
    streams: Sequence[Sequence[float]], prompt_tokens: Sequence[int], *, skip: int
) -> tuple[float, float]:
    """Step time while every stream decodes, and the context read per step then.

    ``streams[i][j]`` is when token ``j`` (0-based; token 0 ends the prefill) of stream
    ``i`` arrived. The window opens when the last stream has ``skip`` decoded tokens and
    closes at the first stream's last token; in it each stream's step time is read by
    :func:`envelope_slope`. Token ``j`` is computed over a context of ``prompt + j``
    tokens. Returns (median over streams of the step time, the contexts summed over the
    streams). Raises :class:`WindowError` if a stream has under three tokens in the
    window.
    """
    if len(streams) != len(prompt_tokens) or not streams:
        raise ValueError("one prompt length per stream, at least one stream")
    if any(len(times) <= skip for times in streams):
        raise WindowError(f"a stream ended before its token {skip}")
    start = max(times[skip] for times in streams)
    end = min(times[-1] for times in streams)
    gaps: list[float] = []
    context = 0.0
    for times, prompt in zip(streams, prompt_tokens, strict=True):
        inside = [j for j, t in enumerate(times) if start <= t <= end]
        if len(inside) < 3:
            raise WindowError(f"only {len(inside)} tokens while all {len(streams)} decode")
        gap, first, last = envelope_slope(inside, times)
        if gap <= 0:
            raise WindowError("the tokens in the window came in one burst")
        gaps.append(gap)
        context += prompt + (first + 1 + last) / 2
    return statistics.median(gaps), context


def stall_step(
    times: Sequence[float], at: float, *, baseline_gaps: int = 8, after: int = 4
) -> tuple[int, float]:
    """The decode token that arrived nearest ``at``, and how long the step it ended took.

    ``at`` is when a prefill's first token arrived: the decode token ``j`` computed in
    the same step arrives with it. The ordinary step time ``g`` is read from up to
    ``baseline_gaps`` gaps before ``j`` (:func:`envelope_slope`); the stall is ``g``
    plus how far the tokens from ``j`` on (up to ``after`` of them) lie above that
    line, each side taken at its earliest (least late) token. Returns (``j``, step
    seconds); raises :class:`WindowError` without three tokens before ``j`` and one
    after it, or if the stall comes out no longer than an ordinary step.
    """
    j = min(range(len(times)), key=lambda i: abs(times[i] - at)) if times else 0
    if j < 3 or j + 1 >= len(times):
        raise WindowError(f"the token nearest {at:.6f} is too near an end of the stream")
    before = list(range(max(0, j - 1 - baseline_gaps), j))
    gap, _, _ = envelope_slope(before, times)
    level_before = min(times[k] - gap * k for k in before)
    level_after = min(times[k] - gap * k for k in range(j, min(len(times), j + after)))
    stall = gap + level_after - level_before
    if gap <= 0 or stall <= gap:
        raise WindowError("no stall seen: the tokens around it came in a burst")
    return j, stall


def median_of(samples: Sequence[Measurement]) -> Measurement:
    """One measurement from repeats of the same shape: the medians of each number."""
    if not samples:
        raise ValueError("no samples")
    head = samples[0]
    if any(
        (s.kind, s.prompt_tokens, s.batch) != (head.kind, head.prompt_tokens, head.batch)
        for s in samples
    ):
        raise ValueError("samples of different shapes")
    return Measurement(
        kind=head.kind,
        seconds=statistics.median(s.seconds for s in samples),
        prompt_tokens=head.prompt_tokens,
        prefill_steps=head.prefill_steps,
        batch=head.batch,
        context_tokens=statistics.median(s.context_tokens for s in samples),
        repeats=len(samples),
        engine_clock=head.engine_clock,
    )
