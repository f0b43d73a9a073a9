"""Synthetic engines for the probe's analysis: step times of a prefill beside one decode.

A prompt of ``n`` tokens is prefilled in steps of at most ``chunk`` tokens (a
serializing engine has no chunk: one step). Each step costs a fixed part, a part per
prompt token, and attention over the context computed before it; the decode stream
waits for each step, so its stall is the longest step and the prompt's own latency
about the sum of them. The steps the probe counts are those that stand out from a
quiet decode step (twice as long).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.probe.measurements import Injection

SIZES = (128, 256, 512, 1024, 2048, 4096, 8128)


@dataclass(frozen=True, kw_only=True)
class Engine:
    chunk: int | None
    """Tokens of prefill per step; None: the whole prompt in one step."""
    fixed_s: float = 0.005
    per_token_s: float = 0.00015
    attention_s: float = 0.0
    """Per prompt token per token of context before it (real engines: ~2e-8 on a CPU)."""

    def steps(self, tokens: int) -> list[float]:
        chunk = self.chunk or tokens
        out, done = [], 0
        while done < tokens:
            n = min(chunk, tokens - done)
            out.append(self.fixed_s + self.per_token_s * n + self.attention_s * n * (done + n / 2))
            done += n
        return out


@dataclass(frozen=True, kw_only=True)
class Noise:
    relative: float = 0.0
    absolute_s: float = 0.0
    spike_odds: float = 0.0
    """Odds that one measurement is 50% too high (a hiccup on the client)."""


def injections(
    engine: Engine,
    sizes: Sequence[int] = SIZES,
    *,
    repeats: int = 3,
    noise: Noise = Noise(),
    seed: int = 0,
    gap_s: float | None = None,
) -> list[Injection]:
    """What the probe would measure on ``engine``, every size ``repeats`` times."""
    rng = random.Random(seed)
    gap = engine.fixed_s if gap_s is None else gap_s

    def noisy(t: float) -> float:
        spike = 0.5 * t if rng.random() < noise.spike_odds else 0.0
        value = t * (1 + rng.gauss(0, noise.relative)) + rng.gauss(0, noise.absolute_s) + spike
        return max(value, 1e-4)

    return [
        Injection(
            prompt_tokens=size,
            stall_s=noisy(max(engine.steps(size))),
            baseline_gap_s=gap,
            quiet_worst_s=gap * 1.2,
            prompt_latency_s=noisy(sum(engine.steps(size)) + gap / 2 + 0.002),
            prefill_steps=sum(1 for step in engine.steps(size) if step > 2 * gap),
        )
        for _ in range(repeats)
        for size in sizes
    ]
