"""Two models on one card, in virtual time: the residency policy keeps chat within 2x
of its model alone while the other model's batch job completes in its window, where
waking whatever the oldest request names thrashes (issue 32)."""

from __future__ import annotations

import pytest

from loadtests.sim.card import ARMS, CardResult, CardWorkload, card_arms
from proxy.scheduler.residency import ResidencyRules

SHORT = CardWorkload(
    duration_s=1200.0,
    chat_on_s=300.0,
    chat_off_s=150.0,
    batch_lines=1500,
    window_s=1200.0,
)


@pytest.fixture(scope="module")
def arms() -> dict[str, CardResult]:
    return {r.arm: r for r in card_arms(SHORT, rules=ResidencyRules())}


def test_the_policy_keeps_chat_near_its_model_alone_and_finishes_the_batch(
    arms: dict[str, CardResult],
) -> None:
    alone, policy = arms["a alone"], arms["policy"]
    assert set(arms) == set(ARMS)
    assert alone.chats == policy.chats > 100
    assert policy.ttft_p95 <= 2 * alone.ttft_p95
    assert policy.batch_last_s is not None, "the batch job did not finish"
    assert policy.batch_last_s <= SHORT.window_s
    assert policy.batch_done == SHORT.batch_lines


def test_waking_whatever_is_asked_for_thrashes_and_chat_pays(arms: dict[str, CardResult]) -> None:
    alone, policy, demand = arms["a alone"], arms["policy"], arms["swap on demand"]
    assert demand.swaps >= 10 * max(policy.swaps, 1)
    assert demand.ttft_p95 > 10 * alone.ttft_p95
    assert alone.swaps == 0 and arms["two half cards"].swaps == 0
