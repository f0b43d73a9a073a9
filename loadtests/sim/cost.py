"""Step time of the simulated engine, from a profile's coefficients."""

from __future__ import annotations

from loadtests.sim.profile import StepCost
from loadtests.sim.step_scheduler import SchedulerOutput


def step_seconds(cost: StepCost, out: SchedulerOutput) -> float:
    """Model time one step takes: fixed part + prefill part + decode part.

    Prefill grows with the prompt tokens computed and, through attention, with the
    context they attend to; decode grows with the number of decoding sequences and
    the context each reads from the KV cache.
    """
    prefill_tokens = 0
    prefill_context = 0.0
    decode_seqs = 0
    decode_context = 0
    for chunk in out.chunks:
        if chunk.is_decode:
            decode_seqs += 1
            decode_context += chunk.num_computed_before + 1
        else:
            prefill_tokens += chunk.num_tokens
            prefill_context += chunk.num_tokens * (chunk.num_computed_before + chunk.num_tokens / 2)
    seconds = cost.fixed_s
    seconds += cost.prefill_per_token_s * prefill_tokens
    seconds += cost.prefill_attention_per_token_context_s * prefill_context
    if decode_seqs:
        seconds += cost.decode_step_overhead_s
        seconds += cost.decode_per_token_s * decode_seqs
        seconds += cost.decode_per_context_token_s * decode_context
    return seconds
