"""Least-squares fits: exact on exact data, and the knee found where the slope changes."""

from __future__ import annotations

import math

import pytest

from loadtests.probe.curve_fit import BrokenLine, fit_broken_line, fit_line

XS = [128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8128.0]


def test_line_through_exact_points() -> None:
    line = fit_line(XS, [0.005 + 0.0002 * x for x in XS])
    assert line.intercept_s == pytest.approx(0.005)
    assert line.slope_s_per_token == pytest.approx(0.0002)
    assert line.sse == pytest.approx(0.0, abs=1e-15)


def test_line_least_squares_by_hand() -> None:
    # Through (0, 0), (1, 1), (2, 1): slope 1/2, intercept 1/6.
    line = fit_line([0.0, 1.0, 2.0], [0.0, 1.0, 1.0])
    assert line.slope_s_per_token == pytest.approx(0.5)
    assert line.intercept_s == pytest.approx(1 / 6)
    assert line.sse == pytest.approx(1 / 6)


@pytest.mark.parametrize(
    ("xs", "ys", "message"),
    [
        ([1.0], [1.0], "at least 2"),
        ([1.0, 1.0], [1.0, 2.0], "distinct"),
        ([1.0, 2.0], [1.0], "y values"),
    ],
)
def test_line_refuses_what_it_cannot_fit(xs: list[float], ys: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_line(xs, ys)


@pytest.mark.parametrize("knee", [300.0, 511.0, 700.0, 1500.0, 3000.0])
def test_broken_line_finds_the_knee_of_a_flat_top(knee: float) -> None:
    truth = BrokenLine(
        intercept_s=0.005, slope_s_per_token=0.0002, knee_tokens=knee,
        slope_after_s_per_token=0.0, sse=0.0,
    )  # fmt: skip
    fit = fit_broken_line(XS, [truth.at(x) for x in XS])
    assert fit is not None
    assert fit.knee_tokens == pytest.approx(knee, rel=0.01)
    assert fit.slope_s_per_token == pytest.approx(0.0002, rel=0.01)
    assert fit.slope_after_s_per_token == pytest.approx(0.0, abs=1e-8)
    assert fit.level_s == pytest.approx(truth.level_s, rel=0.01)
    assert fit.slope_ratio == pytest.approx(0.0, abs=0.01)


def test_broken_line_keeps_a_shallow_slope_past_the_knee() -> None:
    truth = BrokenLine(
        intercept_s=0.005, slope_s_per_token=0.0002, knee_tokens=1000.0,
        slope_after_s_per_token=0.00002, sse=0.0,
    )  # fmt: skip
    fit = fit_broken_line(XS, [truth.at(x) for x in XS])
    assert fit is not None
    assert fit.knee_tokens == pytest.approx(1000, rel=0.01)
    assert fit.slope_ratio == pytest.approx(0.1, rel=0.05)


def test_broken_line_on_a_straight_line_has_no_real_knee() -> None:
    fit = fit_broken_line(XS, [0.005 + 0.0002 * x for x in XS])
    assert fit is not None
    assert fit.slope_ratio == pytest.approx(1.0, rel=1e-6)
    assert fit.sse == pytest.approx(0.0, abs=1e-15)


def test_broken_line_leaves_points_on_both_sides() -> None:
    # The slope changes between the last two points, where no knee may go:
    # the fit must keep two points right of its knee.
    ys = [0.0002 * x for x in XS[:-1]] + [0.0002 * XS[-2]]
    fit = fit_broken_line(XS, ys)
    assert fit is not None
    assert XS[1] <= fit.knee_tokens < XS[-2]
    assert fit_broken_line(XS[:3], [1.0, 2.0, 3.0]) is None


def test_broken_line_needs_ascending_points() -> None:
    with pytest.raises(ValueError, match="ascending"):
        fit_broken_line([1.0, 3.0, 2.0, 4.0], [1.0, 2.0, 3.0, 4.0])


def test_slope_ratio_without_growth_is_infinite() -> None:
    flat = BrokenLine(
        intercept_s=1.0, slope_s_per_token=0.0, knee_tokens=10.0,
        slope_after_s_per_token=0.0, sse=0.0,
    )  # fmt: skip
    assert math.isinf(flat.slope_ratio)
