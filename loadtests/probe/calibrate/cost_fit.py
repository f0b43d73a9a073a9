"""Fit the step-cost model to measurements: weighted least squares, no I/O.

Each measurement is a linear function of the unknowns (see :mod:`loadtests.sim.cost`):

==========  =========================================================================
prefill     overhead + steps·fixed + P·prefill + (P²/2)·attention
decode      fixed + decode_overhead + n·decode + C·decode_context
mixed       fixed + decode_overhead + n·decode + C·decode_context + P·prefill
            + (P²/2)·attention
==========  =========================================================================

(P prompt tokens, n decoding sequences, C their summed context; a prompt's attention
term is P²/2 however it is chunked.) ``overhead`` is the request's own latency outside
the engine's steps, in times taken at the client (not in the engine's own prefill
times): it is fitted, reported and left out of the profile. Only prompts
of different step counts tell ``fixed`` from ``overhead`` and ``decode_overhead``;
without them ``decode_overhead`` is the one dropped, so that decode steps keep their
full measured cost.

Rows are weighted by 1/measured, so the fit minimises relative errors and a 1-second
prefill does not drown a 5 ms decode step. The solver is Householder QR on
unit-scaled columns; a column that adds nothing new (``decode_overhead`` in the case
above, or a context term whose context never varied apart from the batch) is dropped and
its coefficient set to 0, and so is a coefficient that comes out negative (the most
negative first, then the fit is redone). Each dropped coefficient gets a note.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.probe.calibrate.token_times import Kind, Measurement
from loadtests.sim.profile import StepCost

OVERHEAD = "request_overhead_s"
COLUMNS: tuple[str, ...] = (
    "fixed_s",
    "prefill_per_token_s",
    "decode_per_token_s",
    OVERHEAD,
    "decode_step_overhead_s",
    "prefill_attention_per_token_context_s",
    "decode_per_context_token_s",
)
"""The unknowns, in the order the solver keeps them when two cannot be told apart."""

_DEPENDENT_TOL = 1e-9


def features(m: Measurement) -> dict[str, float]:
    """The row of the linear model for one measurement (coefficient name -> factor)."""
    prefill = {
        "prefill_per_token_s": float(m.prompt_tokens),
        "prefill_attention_per_token_context_s": m.prompt_tokens**2 / 2,
    }
    decode = {
        "decode_step_overhead_s": 1.0,
        "decode_per_token_s": float(m.batch),
        "decode_per_context_token_s": m.context_tokens,
    }
    if m.kind is Kind.PREFILL:
        overhead = 0.0 if m.engine_clock else 1.0
        return {"fixed_s": float(m.prefill_steps), OVERHEAD: overhead, **prefill}
    if m.kind is Kind.DECODE:
        return {"fixed_s": 1.0, **decode}
    return {"fixed_s": 1.0, **decode, **prefill}


@dataclass(frozen=True)
class FitResult:
    """Fitted coefficients, which of them the data determined, and what was measured."""

    cost: StepCost
    request_overhead_s: float
    fitted: tuple[str, ...]
    notes: tuple[str, ...]
    measurements: tuple[Measurement, ...]

    def coefficient(self, name: str) -> float:
        return self.request_overhead_s if name == OVERHEAD else float(getattr(self.cost, name))

    def predict(self, m: Measurement) -> float:
        return sum(self.coefficient(k) * v for k, v in features(m).items())

    def relative_errors(self, kind: Kind) -> list[float]:
        """(predicted - measured) / measured for each measurement of ``kind``."""
        return [
            (self.predict(m) - m.seconds) / m.seconds for m in self.measurements if m.kind is kind
        ]


def fit(measurements: Sequence[Measurement]) -> FitResult:
    """Fit the step cost to ``measurements``; raises ValueError if there are none."""
    if not measurements:
        raise ValueError("nothing to fit")
    rows = [features(m) for m in measurements]
    ys = [m.seconds for m in measurements]
    active = [c for c in COLUMNS if any(row.get(c, 0.0) != 0.0 for row in rows)]
    notes = [f"{c}: not measured, set to 0" for c in COLUMNS if c not in active]
    if all(m.prefill_steps <= 1 for m in measurements if m.kind is Kind.PREFILL):
        notes.append(
            "no prompt took more than one step, so the fixed step cost cannot be told from"
            " the request overhead: prefill-only steps get the decode steps' fixed part."
            " A smaller step budget (--max-num-batched-tokens) separates them."
        )
    while True:
        solution = _weighted_solve(rows, ys, active)
        for name in [c for c in active if solution[c] is None]:
            notes.append(f"{name}: not separable from the others in these data, set to 0")
            active.remove(name)
        coefs = {c: v for c, v in solution.items() if v is not None}
        negative = {c: v * _column_norm(rows, ys, c) for c, v in coefs.items() if v < 0}
        if not negative:
            break
        worst = min(negative, key=lambda c: negative[c])
        notes.append(f"{worst}: came out negative ({coefs[worst]:.3g}), set to 0")
        active.remove(worst)
    values = {c: coefs.get(c, 0.0) for c in COLUMNS}
    overhead = values.pop(OVERHEAD)
    return FitResult(
        cost=StepCost(**values),
        request_overhead_s=overhead,
        fitted=tuple(c for c in COLUMNS if c in active),
        notes=tuple(notes),
        measurements=tuple(measurements),
    )


def _column_norm(rows: Sequence[dict[str, float]], ys: Sequence[float], name: str) -> float:
    return math.sqrt(sum((row.get(name, 0.0) / y) ** 2 for row, y in zip(rows, ys, strict=True)))


def _weighted_solve(
    rows: Sequence[dict[str, float]], ys: Sequence[float], names: Sequence[str]
) -> dict[str, float | None]:
    """Least squares of sum(((row·x) - y) / y)^2 over the ``names`` columns."""
    columns = [[row.get(n, 0.0) / y for row, y in zip(rows, ys, strict=True)] for n in names]
    solution = lstsq(columns, [1.0] * len(ys))
    return dict(zip(names, solution, strict=True))


def lstsq(columns: Sequence[Sequence[float]], b: Sequence[float]) -> list[float | None]:
    """Least-squares solution of ``A x ≈ b`` with ``A`` given by its columns.

    Columns are scaled to unit length, then reduced by Householder reflections in the
    order given; a column whose remainder is (numerically) zero depends on the ones
    before it and gets ``None``, as does an all-zero column.
    """
    m = len(b)
    cols = [list(c) for c in columns]
    if any(len(c) != m for c in cols):
        raise ValueError("every column needs one entry per row of b")
    scales = [math.sqrt(sum(v * v for v in c)) for c in cols]
    cols = [[v / s for v in c] if s > 0 else c for c, s in zip(cols, scales, strict=True)]
    rhs = list(b)
    pivots: dict[int, int] = {}  # column -> its row in R
    row = 0
    for j, col in enumerate(cols):
        if scales[j] == 0 or row >= m:
            continue
        norm = math.sqrt(sum(v * v for v in col[row:]))
        if norm <= _DEPENDENT_TOL:
            continue
        alpha = -math.copysign(norm, col[row])
        v = col[row:]
        v[0] -= alpha
        vv = sum(x * x for x in v)
        for target in [*cols[j:], rhs]:
            dot = sum(a * x for a, x in zip(v, target[row:], strict=True))
            factor = 2 * dot / vv
            for i in range(row, m):
                target[i] -= factor * v[i - row]
        pivots[j] = row
        row += 1
    x: list[float | None] = [None] * len(cols)
    for j in sorted(pivots, reverse=True):
        r = pivots[j]
        later = sum(cols[k][r] * (x[k] or 0.0) for k in pivots if k > j)
        x[j] = (rhs[r] - later) / cols[j][r]
    return [None if v is None else v / scales[j] for j, v in enumerate(x)]
