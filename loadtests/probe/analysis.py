"""From measured decode stalls to a verdict: does the engine interleave prefill with decode?

The runner injects prompts of several sizes beside a steady decode stream and
records, for each, the stream's worst inter-token gap while the prompt was in the
engine (its *stall*) and how many engine steps the prompt's prefill took (the
stream's gaps that stood out while it ran). This module turns those numbers into an
:class:`Analysis`; it does no I/O and reads no clock.

What tells the two policies apart:

- **serializes**: each prompt is prefilled in one step and the decode stream waits for
  all of it: one long gap per prompt, growing with the prompt all the way (a line, or
  steeper than a line once attention over a long prompt shows);
- **interleaves**: a prompt is prefilled in chunks of at most ``C`` tokens per step
  beside the running decodes: a long prompt takes several steps, a number that grows
  with the prompt, and the stall grows until a prompt fills one chunk and then levels
  off (flat, or much shallower: a later chunk attends to a longer context).

Both a line and a broken line (:mod:`loadtests.probe.curve_fit`) are fitted to the median stall
per size. The broken line has a *knee* when it beats the line by a clear margin (more
than the repeats' noise explains) and its slope past the knee is at most half the
slope below. The verdict:

- **interleaves** when the largest prompt took several steps (at least two, and at
  least twice as many as the smallest prompt); the chunk is the knee if there is one,
  else the largest prompt's size over its steps (attention can keep a CPU engine's
  stalls growing past the chunk: the steps still show it);
- **serializes** when the largest prompt took one step, there is no knee, and a line
  with a positive slope explains the stalls;
- **inconclusive** otherwise, with the reason: too few sizes, repeats that disagree,
  stalls no larger than the stream's own jitter, a knee that one-step prefills
  contradict, or step counts that are neither.

Each margin is a field of :class:`Criteria`.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loadtests.probe.curve_fit import BrokenLine, Line, fit_broken_line, fit_line
from loadtests.probe.measurements import Injection, SizeStalls, group_by_size


class Verdict(enum.StrEnum):
    INTERLEAVES = "interleaves"
    SERIALIZES = "serializes"
    INCONCLUSIVE = "inconclusive"


class ChunkFrom(enum.StrEnum):
    KNEE = "knee"
    """Where the stall curve levels off."""
    STEPS = "steps"
    """The largest prompt's size over the number of steps its prefill took."""


@dataclass(frozen=True, kw_only=True)
class Criteria:
    """The margins a verdict needs. The defaults are what the probe uses."""

    min_sizes: int = 5
    """Distinct prompt sizes needed (two each side of a knee, and one more)."""
    max_spread: float = 0.25
    """Typical relative deviation of repeats above which the data are too noisy."""
    min_stall_over_quiet: float = 1.5
    """The largest prompt's stall must be this many times the stream's quiet worst gap."""
    min_growth: float = 0.25
    """Stalls that grow less than this fraction of the smallest one are flat."""
    level_off_ratio: float = 0.5
    """A knee: slope past it at most this fraction of the slope below."""
    knee_margin: float = 0.25
    """A knee: the broken line's squared error at most this fraction of the line's."""
    min_noise: float = 0.02
    """Relative noise assumed of any stall, however well the repeats agree."""
    knee_over_noise: float = 2.0
    """A knee: the line misses the stalls by at least this many times the noise."""
    min_line_r2: float = 0.8
    """Serializing: the line must explain this much of the stalls' variance."""


DEFAULT_CRITERIA = Criteria()


@dataclass(frozen=True, kw_only=True)
class Analysis:
    """The measured table, both fits and the verdict, with the reason for it."""

    verdict: Verdict
    reason: str
    """Why, in one clause (for inconclusive: what was missing, and what to try)."""
    table: tuple[SizeStalls, ...]
    baseline_gap_s: float
    quiet_worst_s: float
    line: Line | None = None
    broken: BrokenLine | None = None
    chunk_tokens: int | None = None
    """Interleaving only: the estimated per-step prefill chunk."""
    chunk_from: ChunkFrom | None = None
    stall_level_s: float | None = None
    """Interleaving with a knee only: the fitted stall at the knee."""
    prefill_s_per_token: float | None = None
    """Stall growth per prompt token: below the knee if there is one, else the line's."""
    stalls_flat: bool = False
    """Whether the stalls hardly grow from the smallest prompt to the largest."""

    @property
    def spread(self) -> float:
        """The typical (median) relative deviation of repeats at one size."""
        repeated = [row.deviation for row in self.table if len(row.stalls_s) > 1]
        return statistics.median(repeated) if repeated else 0.0

    @property
    def top(self) -> SizeStalls:
        """The largest prompt size's row."""
        return self.table[-1]

    @property
    def steps_chunk_tokens(self) -> int | None:
        """The largest prompt's size over its prefill steps, if it took several."""
        steps = self.top.prefill_steps
        return round(self.top.prompt_tokens / steps) if steps >= 2 else None

    def line_misfit(self) -> float:
        """Root-mean-square relative residual of the line; 0 before it is fitted."""
        if self.line is None:
            return 0.0
        line = self.line
        rel = [(line.at(r.prompt_tokens) - r.median_s) / r.median_s for r in self.table]
        return math.sqrt(statistics.fmean(e * e for e in rel))


def analyze(injections: Sequence[Injection], criteria: Criteria = DEFAULT_CRITERIA) -> Analysis:
    """Judge a probe's measurements; never raises on odd data, says inconclusive instead."""
    if not injections:
        raise ValueError("no measurements to analyse")
    base = Analysis(
        verdict=Verdict.INCONCLUSIVE,
        reason="",
        table=group_by_size(injections),
        baseline_gap_s=statistics.median(i.baseline_gap_s for i in injections),
        quiet_worst_s=statistics.median(i.quiet_worst_s for i in injections),
    )
    problem = _data_problem(base, criteria)
    if problem is not None:
        return _inconclusive(base, problem)
    xs = [float(row.prompt_tokens) for row in base.table]
    ys = [row.median_s for row in base.table]
    return _judge(replace(base, line=fit_line(xs, ys), broken=fit_broken_line(xs, ys)), criteria)


def _data_problem(a: Analysis, c: Criteria) -> str | None:
    """What keeps the data from saying anything, before any fit; None if nothing."""
    if len(a.table) < c.min_sizes:
        return f"only {len(a.table)} prompt sizes measured; at least {c.min_sizes} are needed"
    if a.spread > c.max_spread:
        return (
            f"repeats of the same prompt size typically differ by {a.spread:.0%} from their "
            "median, too noisy to tell the shapes apart; probe an idle engine"
        )
    if a.top.median_s < c.min_stall_over_quiet * a.quiet_worst_s:
        return (
            f"even a {a.top.prompt_tokens}-token prompt stalls decode only "
            f"{_ms(a.top.median_s)} against {_ms(a.quiet_worst_s)} with no prompt beside "
            "it; prefills this small are too cheap to see (or run apart from decode), "
            "probe with larger prompts"
        )
    return None


def _judge(a: Analysis, c: Criteria) -> Analysis:
    """The verdict from the step counts, with the stall curve's shape as a check."""
    top, first = a.top, a.table[0]
    if top.prefill_steps == 0:
        return _inconclusive(
            a,
            f"no gap of the decode stream stood out from its quiet ones during the "
            f"{top.prompt_tokens}-token prompt; probe with larger prompts",
        )
    several = top.prefill_steps >= 2 and top.prefill_steps >= 2 * first.prefill_steps
    knee = _knee(a, c)
    if several:
        return _interleaves(a, knee) if knee is not None else _interleaves_by_steps(a, c)
    if top.prefill_steps >= 2:
        return _inconclusive(
            a,
            f"the {top.prompt_tokens}-token prompt took ~{top.prefill_steps} steps, but so "
            f"did the {first.prompt_tokens}-token one: decode ran on while prompts waited, "
            "not while they were prefilled",
        )
    if knee is not None:
        return _inconclusive(
            a,
            f"stalls level off past ~{round(knee.knee_tokens)} tokens, yet the "
            f"{top.prompt_tokens}-token prompt was prefilled in one step; repeat the probe",
        )
    return _serializes_or_not(a, c)


def _knee(a: Analysis, c: Criteria) -> BrokenLine | None:
    """The broken line, if it levels off with a clear margin over the line and the noise."""
    line, broken = a.line, a.broken
    if line is None or broken is None or line.sse <= 0:
        return None
    if a.line_misfit() < c.knee_over_noise * max(c.min_noise, 2 * a.spread):
        return None  # the line is as good as the data: any knee is noise
    if broken.slope_ratio <= c.level_off_ratio and broken.sse <= c.knee_margin * line.sse:
        return broken
    return None


def _interleaves(a: Analysis, knee: BrokenLine) -> Analysis:
    return replace(
        a,
        verdict=Verdict.INTERLEAVES,
        reason=(
            f"stalls grow until ~{round(knee.knee_tokens)} tokens, then at "
            f"{max(knee.slope_ratio, 0.0):.0%} of that rate, and the "
            f"{a.top.prompt_tokens}-token prompt was prefilled over ~{a.top.prefill_steps} "
            "steps"
        ),
        chunk_tokens=round(knee.knee_tokens),
        chunk_from=ChunkFrom.KNEE,
        stall_level_s=knee.level_s,
        prefill_s_per_token=knee.slope_s_per_token,
    )


def _interleaves_by_steps(a: Analysis, c: Criteria) -> Analysis:
    low = min(r.median_s for r in a.table)
    flat = max(r.median_s for r in a.table) - low < c.min_growth * low
    shape = (
        f"stalls stay flat from {a.table[0].prompt_tokens} tokens on"
        if flat
        else "stalls do not level off but keep growing with the prompt"
    )
    return replace(
        a,
        verdict=Verdict.INTERLEAVES,
        reason=f"the {a.top.prompt_tokens}-token prompt was prefilled over "
        f"~{a.top.prefill_steps} steps beside decode; {shape}",
        chunk_tokens=a.steps_chunk_tokens,
        chunk_from=ChunkFrom.STEPS,
        stalls_flat=flat,
        prefill_s_per_token=a.line.slope_s_per_token if a.line is not None else None,
    )


def _serializes_or_not(a: Analysis, c: Criteria) -> Analysis:
    line = a.line
    assert line is not None
    low = min(r.median_s for r in a.table)
    if max(r.median_s for r in a.table) - low < c.min_growth * low:
        return _inconclusive(
            a,
            f"stalls stay near {_ms(low)} from {a.table[0].prompt_tokens} to "
            f"{a.top.prompt_tokens} tokens and each prompt took one step: prefill too cheap "
            "to see beside decode; probe with larger prompts",
        )
    r2 = _r2(a, line)
    if line.slope_s_per_token <= 0 or r2 < c.min_line_r2:
        return _inconclusive(
            a, f"neither shape fits: a line explains {r2:.0%} of the stalls' variance"
        )
    return replace(
        a,
        verdict=Verdict.SERIALIZES,
        reason=(
            f"stalls grow with the prompt up to {a.top.prompt_tokens} tokens, each prompt "
            "prefilled in one step"
        ),
        prefill_s_per_token=line.slope_s_per_token,
    )


def _r2(a: Analysis, line: Line) -> float:
    ys = [row.median_s for row in a.table]
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    return 1.0 - line.sse / total if total > 0 else 0.0


def _inconclusive(a: Analysis, reason: str) -> Analysis:
    return replace(a, verdict=Verdict.INCONCLUSIVE, reason=reason)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"
