"""What the probe measures: one :class:`Injection` per prompt, grouped by prompt size.

Plain data and pure helpers; the runner fills them in, the analysis reads them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Repeats within this fraction of their median agree with it.
AGREEMENT = 0.2


@dataclass(frozen=True, kw_only=True)
class Injection:
    """One prompt injected beside the decode stream, and what the stream saw."""

    prompt_tokens: int
    stall_s: float
    """The stream's worst gap between tokens while the prompt was in the engine."""
    baseline_gap_s: float
    """The stream's median gap just before the prompt was sent."""
    quiet_worst_s: float
    """The stream's worst gap just before the prompt was sent."""
    prompt_latency_s: float
    """From sending the prompt to its one-token answer: its own wait and prefill."""
    prefill_steps: int
    """Gaps of the decode stream that stood out while the prompt was in flight: one per
    engine step that computed part of its prefill."""


@dataclass(frozen=True, kw_only=True)
class SizeStalls:
    """All measurements at one prompt size, in measured order."""

    prompt_tokens: int
    stalls_s: tuple[float, ...]
    latencies_s: tuple[float, ...]
    steps: tuple[int, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.stalls_s)

    @property
    def median_latency_s(self) -> float:
        return statistics.median(self.latencies_s)

    @property
    def deviation(self) -> float:
        """Median absolute deviation of the stalls over their median (robust: one wild
        repeat out of three does not move it); 0 for a single measurement."""
        median = self.median_s
        if median <= 0:
            return 0.0
        return statistics.median(abs(s - median) for s in self.stalls_s) / median

    @property
    def stall_share(self) -> float:
        """Median stall over median prompt latency: ~1 if decode waited for the whole
        prefill, well under 1 if the prompt took several steps beside decode."""
        latency = self.median_latency_s
        return self.median_s / latency if latency > 0 else math.inf

    @property
    def prefill_steps(self) -> int:
        """The median number of steps the prompt's prefill took (rounded down)."""
        return math.floor(statistics.median(self.steps))

    @property
    def settled(self) -> bool:
        """Whether at least half the repeats (and at least two) agree with the median."""
        median = self.median_s
        agreeing = sum(1 for s in self.stalls_s if abs(s - median) <= AGREEMENT * median)
        return agreeing >= max(2, math.ceil(len(self.stalls_s) / 2))


def group_by_size(injections: Sequence[Injection]) -> tuple[SizeStalls, ...]:
    """The measurements per prompt size, smallest size first."""
    sizes = sorted({i.prompt_tokens for i in injections})
    return tuple(_row(size, [i for i in injections if i.prompt_tokens == size]) for size in sizes)


def unsettled_sizes(injections: Sequence[Injection]) -> list[int]:
    """Prompt sizes whose repeats disagree (see :attr:`SizeStalls.settled`): measure
    those again, so that a median is not decided by a hiccup."""
    return [row.prompt_tokens for row in group_by_size(injections) if not row.settled]


def _row(size: int, measured: list[Injection]) -> SizeStalls:
    return SizeStalls(
        prompt_tokens=size,
        stalls_s=tuple(i.stall_s for i in measured),
        latencies_s=tuple(i.prompt_latency_s for i in measured),
        steps=tuple(i.prefill_steps for i in measured),
    )
