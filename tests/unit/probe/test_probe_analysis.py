"""The verdict on synthetic stall curves: interleaving, serializing, noisy and unclear."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from loadtests.probe.analysis import Analysis, ChunkFrom, Verdict, analyze
from loadtests.probe.measurements import Injection

from .curves import SIZES, Engine, Noise, injections

# An engine on a CPU: attention over the context makes later chunks dearer.
ATTENTION = 2.4e-8
# vLLM's CPU build with the project's tiny model, fitted to whole prefills measured on
# two cores (0.2 s for 1k tokens, 1.5 s for 4k, 4.8 s for 8k): attention dominates.
REAL_CPU = {"per_token_s": 0.000138, "attention_s": 1.1e-7}
# What the probe sees on a busy client: a few percent, a millisecond, a rare hiccup.
CLIENT_NOISE = Noise(relative=0.03, absolute_s=0.001, spike_odds=0.03)


def through_client_noise(engine: Engine) -> tuple[list[Analysis], Counter[Verdict]]:
    """100 seeded probes of ``engine`` through :data:`CLIENT_NOISE`: each analysis, and
    how many gave each verdict."""
    runs = [analyze(injections(engine, noise=CLIENT_NOISE, seed=seed)) for seed in range(100)]
    return runs, Counter(a.verdict for a in runs)


# -- interleaving ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [256, 511, 1024, 2048])
def test_flat_stalls_past_a_chunk_interleave(chunk: int) -> None:
    engine = Engine(chunk=chunk, per_token_s=0.0002)
    a = analyze(injections(engine))
    assert a.verdict is Verdict.INTERLEAVES, a.reason
    assert a.chunk_from is ChunkFrom.KNEE
    assert a.chunk_tokens == pytest.approx(chunk, rel=0.02)
    assert a.prefill_s_per_token == pytest.approx(0.0002, rel=0.02)
    assert a.stall_level_s == pytest.approx(max(engine.steps(chunk)), rel=0.02)


@pytest.mark.parametrize("chunk", [511, 1024, 2048])
def test_stalls_still_growing_slowly_past_a_chunk_interleave(chunk: int) -> None:
    a = analyze(injections(Engine(chunk=chunk, attention_s=ATTENTION)))
    assert a.verdict is Verdict.INTERLEAVES, a.reason
    assert a.chunk_tokens == pytest.approx(chunk, rel=0.1)
    assert a.broken is not None and 0 < a.broken.slope_ratio < 0.5


@pytest.mark.parametrize("chunk", [511, 2048])
def test_a_real_cpu_engine_interleaving(chunk: int) -> None:
    # Past the chunk, the stall grows with the context the last chunk attends to;
    # what still shows interleaving is the number of steps a long prompt takes.
    a = analyze(injections(Engine(chunk=chunk, **REAL_CPU)))
    assert a.verdict is Verdict.INTERLEAVES, a.reason
    assert a.chunk_tokens == pytest.approx(chunk, rel=0.15)
    assert a.steps_chunk_tokens == pytest.approx(chunk, rel=0.05)


@pytest.mark.parametrize("attention_s", [0.0, ATTENTION])
def test_a_chunk_below_the_smallest_prompt(attention_s: float) -> None:
    a = analyze(injections(Engine(chunk=64, attention_s=attention_s)))
    assert a.verdict is Verdict.INTERLEAVES, a.reason
    assert a.chunk_from is ChunkFrom.STEPS
    assert a.chunk_tokens == 64
    assert a.stalls_flat is (attention_s == 0.0)


@pytest.mark.parametrize("chunk", [511, 2048])
def test_interleaving_is_recognised_through_client_noise(chunk: int) -> None:
    # 100 seeded runs: a wrong answer may say inconclusive, never serializes; the
    # chunk estimate stays close.
    runs, verdicts = through_client_noise(Engine(chunk=chunk, attention_s=ATTENTION))
    assert verdicts[Verdict.INTERLEAVES] >= 97, verdicts
    assert verdicts[Verdict.SERIALIZES] == 0
    close = [a for a in runs if a.chunk_tokens and abs(a.chunk_tokens / chunk - 1) < 0.25]
    assert len(close) >= 95


def test_a_gpu_like_interleaving_engine() -> None:
    # Decode step 20 ms; prefill 20 us per token; chunk 2048.
    engine = Engine(chunk=2048, fixed_s=0.02, per_token_s=0.00002, attention_s=1e-9)
    a = analyze(injections(engine, noise=Noise(relative=0.03), seed=3))
    assert a.verdict is Verdict.INTERLEAVES, a.reason
    assert a.chunk_tokens == pytest.approx(2048, rel=0.15)


# -- serializing ----------------------------------------------------------------------


@pytest.mark.parametrize("per_token_s", [0.0002, 0.00005, 0.00001])
def test_stalls_growing_all_the_way_serialize(per_token_s: float) -> None:
    a = analyze(injections(Engine(chunk=None, per_token_s=per_token_s)))
    assert a.verdict is Verdict.SERIALIZES, a.reason
    assert a.prefill_s_per_token == pytest.approx(per_token_s, rel=0.01)
    assert a.chunk_tokens is None


@pytest.mark.parametrize("attention", [{"attention_s": ATTENTION}, REAL_CPU])
def test_stalls_growing_faster_than_a_line_serialize(attention: dict[str, float]) -> None:
    # Attention makes a whole prefill grow faster than linearly: no knee, a bend up.
    a = analyze(injections(Engine(chunk=None, **attention)))
    assert a.verdict is Verdict.SERIALIZES, a.reason
    assert a.broken is not None and a.broken.slope_ratio > 1


def test_a_gpu_like_serializing_engine() -> None:
    engine = Engine(chunk=None, fixed_s=0.02, per_token_s=0.00002, attention_s=1e-9)
    assert analyze(injections(engine)).verdict is Verdict.SERIALIZES


@pytest.mark.parametrize("attention_s", [0.0, ATTENTION])
def test_serializing_is_recognised_through_client_noise(attention_s: float) -> None:
    _, verdicts = through_client_noise(Engine(chunk=None, attention_s=attention_s))
    assert verdicts[Verdict.SERIALIZES] >= 97, verdicts
    assert verdicts[Verdict.INTERLEAVES] == 0


def test_a_chunk_beyond_the_largest_prompt_looks_serializing() -> None:
    # Honest about it: the sentence says no knee was seen up to the largest prompt.
    a = analyze(injections(Engine(chunk=16384)))
    assert a.verdict is Verdict.SERIALIZES
    assert "8128" in a.reason


# -- inconclusive ---------------------------------------------------------------------


def test_too_few_sizes() -> None:
    a = analyze(injections(Engine(chunk=511), sizes=(128, 512, 2048, 8128)))
    assert a.verdict is Verdict.INCONCLUSIVE
    assert "only 4 prompt sizes" in a.reason


def test_repeats_that_disagree_are_too_noisy() -> None:
    # At every size the three repeats are x, 2x and 3x: typically 50% off their median.
    measured = [_injection(size, 0.0002 * size * k, steps=1) for size in SIZES for k in (1, 2, 3)]
    a = analyze(measured)
    assert a.verdict is Verdict.INCONCLUSIVE
    assert "differ by 50%" in a.reason


def test_one_wild_repeat_out_of_three_is_not_noise() -> None:
    measured = injections(Engine(chunk=511))
    measured[3] = replace(measured[3], stall_s=9.0)  # one 9-second hiccup
    a = analyze(measured)
    assert a.verdict is Verdict.INTERLEAVES, a.reason


def test_prefills_too_cheap_to_stall_decode() -> None:
    # 0.1 us per token: an 8k prompt adds under a millisecond to a 5 ms step.
    a = analyze(injections(Engine(chunk=None, per_token_s=1e-7)))
    assert a.verdict is Verdict.INCONCLUSIVE
    assert "too cheap to see" in a.reason


def test_tiny_prompts_say_nothing() -> None:
    a = analyze(injections(Engine(chunk=None), sizes=(1, 2, 3, 4, 5, 6)))
    assert a.verdict is Verdict.INCONCLUSIVE
    assert "larger prompts" in a.reason


@pytest.mark.parametrize(
    ("chunk", "steps", "reason"),
    [
        # no prefill step seen at all
        (None, 0, "no gap of the decode stream stood out"),
        # a knee, but every prompt in one step
        (511, 1, "prefilled in one step"),
        # an engine that lets decode run a few steps before each whole prefill: the
        # prompts wait, then stall decode for all of their prefill
        (None, 3, "while prompts waited"),
    ],
    ids=["no-long-gap", "knee-in-one-step", "steps-not-growing-with-the-prompt"],
)
def test_inconclusive_step_counts(chunk: int | None, steps: int, reason: str) -> None:
    measured = [replace(i, prefill_steps=steps) for i in injections(Engine(chunk=chunk))]
    a = analyze(measured)
    assert a.verdict is Verdict.INCONCLUSIVE
    assert reason in a.reason


def test_one_step_prompts_that_barely_stall() -> None:
    measured = [_injection(size, 0.020 + size * 1e-7, steps=1) for size in SIZES]
    a = analyze(measured)
    assert a.verdict is Verdict.INCONCLUSIVE
    assert "too cheap to see beside decode" in a.reason


def test_stalls_that_fall_with_the_prompt() -> None:
    measured = [_injection(size, 0.5 - size * 0.00005, steps=1) for size in SIZES]
    a = analyze(measured)
    assert a.verdict is Verdict.INCONCLUSIVE
    assert "neither shape fits" in a.reason


def test_the_analysis_keeps_the_quiet_stream_figures() -> None:
    a = analyze(injections(Engine(chunk=511), gap_s=0.004))
    assert a.baseline_gap_s == pytest.approx(0.004)
    assert a.quiet_worst_s == pytest.approx(0.0048)
    assert len(a.table) == len(SIZES)


def test_nothing_to_analyse() -> None:
    with pytest.raises(ValueError, match="no measurements"):
        analyze([])


def _injection(tokens: int, stall_s: float, *, steps: int) -> Injection:
    return Injection(
        prompt_tokens=tokens,
        stall_s=stall_s,
        baseline_gap_s=0.005,
        quiet_worst_s=0.006,
        prompt_latency_s=stall_s * 1.02,
        prefill_steps=steps,
    )
