"""Least-squares fits of decode stall against prompt size: a line, and a broken line.

Both are plain arithmetic on short sequences (a probe measures a dozen sizes at most),
so there is no numerical library: the broken line's knee is found by a grid search,
refined by golden-section search, and for each candidate knee the rest is an ordinary
linear least-squares problem solved through its normal equations.

- :func:`fit_line`: ``stall = a + b * tokens``, what a serializing engine shows
  (the stall is the whole prefill).
- :func:`fit_broken_line`: ``stall = a + b * min(tokens, knee) + b_after * max(tokens
  - knee, 0)``, continuous at the knee, what an interleaving engine shows: the stall
  grows until a prompt fills one step's chunk, then grows much more slowly or not at
  all (the flat case is ``b_after == 0``; attention over a longer context is what
  usually keeps it from being quite flat).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

# Candidate knees per gap between two adjacent prompt sizes, before refining the best.
_GRID = 24
_GOLDEN_STEPS = 40


@dataclass(frozen=True, kw_only=True)
class Line:
    intercept_s: float
    slope_s_per_token: float
    sse: float
    """Sum of squared residuals, seconds squared."""

    def at(self, tokens: float) -> float:
        return self.intercept_s + self.slope_s_per_token * tokens


@dataclass(frozen=True, kw_only=True)
class BrokenLine:
    intercept_s: float
    slope_s_per_token: float
    """Slope below the knee."""
    knee_tokens: float
    slope_after_s_per_token: float
    """Slope past the knee."""
    sse: float

    def at(self, tokens: float) -> float:
        below = min(tokens, self.knee_tokens)
        above = max(tokens - self.knee_tokens, 0.0)
        return (
            self.intercept_s + self.slope_s_per_token * below + self.slope_after_s_per_token * above
        )

    @property
    def level_s(self) -> float:
        """The fitted stall at the knee."""
        return self.at(self.knee_tokens)

    @property
    def slope_ratio(self) -> float:
        """Slope past the knee over the slope below it; ``inf`` if the slope below is not
        positive (no growth to level off from)."""
        if self.slope_s_per_token <= 0:
            return math.inf
        return self.slope_after_s_per_token / self.slope_s_per_token


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """The least-squares line through at least two points with distinct ``xs``."""
    _check(xs, ys, minimum=2)
    coef = _least_squares([[1.0, x] for x in xs], ys)
    if coef is None:
        raise ValueError("a line needs at least two distinct x values")
    a, b = coef
    return Line(intercept_s=a, slope_s_per_token=b, sse=_sse(xs, ys, lambda x: a + b * x))


def fit_broken_line(
    xs: Sequence[float], ys: Sequence[float], *, min_side: int = 2
) -> BrokenLine | None:
    """The least-squares broken line whose knee leaves ``min_side`` points on each side.

    ``xs`` must be sorted ascending and distinct. Points at or below the knee count
    as its left side, points above it as its right side. Returns None when there are
    too few points for such a knee (fewer than ``2 * min_side``).
    """
    _check(xs, ys, minimum=1)
    if any(b <= a for a, b in pairwise(xs)):
        raise ValueError("xs must be strictly ascending")
    gaps = [(xs[k - 1], xs[k]) for k in range(min_side, len(xs) - min_side + 1)]
    if not gaps:
        return None
    candidates = [knee for lo, hi in gaps for knee in _geometric(lo, hi, _GRID)]
    best = _best_of(xs, ys, candidates)
    if best is None:
        return None
    # Then refine: golden-section search between the best candidate's neighbours
    # (which may lie across a data point).
    lo, hi = next((lo, hi) for lo, hi in gaps if lo <= best.knee_tokens < hi)
    step = (hi / lo) ** (1 / _GRID)
    near_lo = max(gaps[0][0], best.knee_tokens / step)
    near_hi = min(gaps[-1][1], best.knee_tokens * step)
    refined = _golden(xs, ys, near_lo, near_hi)
    return refined if refined is not None and refined.sse < best.sse else best


def _golden(xs: Sequence[float], ys: Sequence[float], lo: float, hi: float) -> BrokenLine | None:
    """The best knee in ``[lo, hi]``, assuming the error has one minimum there."""
    inv_phi = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(_GOLDEN_STEPS):
        c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
        fc, fd = _broken_at(xs, ys, c), _broken_at(xs, ys, d)
        if fc is None or fd is None:
            return None
        if fc.sse <= fd.sse:
            b = d
        else:
            a = c
    return _broken_at(xs, ys, (a + b) / 2)


def _best_of(xs: Sequence[float], ys: Sequence[float], knees: Sequence[float]) -> BrokenLine | None:
    best: BrokenLine | None = None
    for knee in knees:
        fit = _broken_at(xs, ys, knee)
        if fit is not None and (best is None or fit.sse < best.sse):
            best = fit
    return best


def _broken_at(xs: Sequence[float], ys: Sequence[float], knee: float) -> BrokenLine | None:
    rows = [[1.0, min(x, knee), max(x - knee, 0.0)] for x in xs]
    coef = _least_squares(rows, ys)
    if coef is None:
        return None
    a, b, b_after = coef
    fit = BrokenLine(
        intercept_s=a, slope_s_per_token=b, knee_tokens=knee, slope_after_s_per_token=b_after, sse=0
    )
    return replace(fit, sse=_sse(xs, ys, fit.at))


def _geometric(lo: float, hi: float, count: int) -> list[float]:
    """``count`` points from ``lo`` (included) towards ``hi`` (excluded), evenly in log."""
    ratio = (hi / lo) ** (1 / count)
    return [lo * ratio**k for k in range(count)]


def _sse(xs: Sequence[float], ys: Sequence[float], model: Callable[[float], float]) -> float:
    return sum((model(x) - y) ** 2 for x, y in zip(xs, ys, strict=True))


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Solve the normal equations ``(AᵀA) c = Aᵀy``; None when ``A`` is rank-deficient."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    return _solve(ata, aty)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a (near-)singular matrix."""
    n = len(rhs)
    m = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    scale = max(abs(v) for row in matrix for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [v - factor * p for v, p in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _check(xs: Sequence[float], ys: Sequence[float], *, minimum: int) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    if len(xs) < minimum:
        raise ValueError(f"need at least {minimum} points, got {len(xs)}")
