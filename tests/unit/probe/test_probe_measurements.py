"""One size's measurements: medians, robust deviation, step counts, settling."""

from __future__ import annotations

import pytest

from loadtests.probe.measurements import Injection, SizeStalls, group_by_size, unsettled_sizes


def row(*stalls: float, steps: tuple[int, ...] = (1,)) -> SizeStalls:
    return SizeStalls(
        prompt_tokens=512,
        stalls_s=stalls,
        latencies_s=tuple(2 * s for s in stalls),
        steps=steps,
    )


def test_medians_and_share() -> None:
    r = row(0.1, 0.3, 0.2)
    assert r.median_s == pytest.approx(0.2)
    assert r.median_latency_s == pytest.approx(0.4)
    assert r.stall_share == pytest.approx(0.5)


def test_deviation_ignores_one_wild_repeat() -> None:
    assert row(0.100, 0.102, 9.0).deviation == pytest.approx(0.002 / 0.102)
    assert row(0.1, 0.2, 0.3).deviation == pytest.approx(0.5)
    assert row(0.1).deviation == 0.0


def test_steps_are_the_median_rounded_down() -> None:
    assert row(0.1, steps=(16, 17, 30)).prefill_steps == 17
    assert row(0.1, steps=(1, 2)).prefill_steps == 1


@pytest.mark.parametrize(
    ("stalls", "settled"),
    [
        ((0.10, 0.11, 0.50), True),  # two of three agree
        ((0.10, 0.30, 0.70), False),  # none agree with the median
        ((0.29, 0.68, 7.5, 0.28, 0.29), True),  # three of five after two more
        ((0.10,), False),  # one measurement settles nothing
    ],
)
def test_settled_needs_half_the_repeats_to_agree(stalls: tuple[float, ...], settled: bool) -> None:
    assert row(*stalls).settled is settled


def injection(tokens: int, stall_s: float) -> Injection:
    return Injection(
        prompt_tokens=tokens,
        stall_s=stall_s,
        baseline_gap_s=0.005,
        quiet_worst_s=0.006,
        prompt_latency_s=stall_s,
        prefill_steps=1,
    )


def test_group_by_size_in_measured_order() -> None:
    table = group_by_size([injection(512, 0.3), injection(128, 0.1), injection(512, 0.2)])
    assert [r.prompt_tokens for r in table] == [128, 512]
    assert table[1].stalls_s == (0.3, 0.2)


def test_unsettled_sizes() -> None:
    measured = [injection(128, s) for s in (0.10, 0.10, 0.9)]
    measured += [injection(512, s) for s in (0.1, 0.3, 0.7)]
    assert unsettled_sizes(measured) == [512]
