"""Arrival processes: when the requests of an open-loop traffic class are sent.

Each gives the send times, in seconds from the start, of the requests within a
duration, from a seeded generator, so a workload sends the same schedule every run:

- **Poisson** at ``rate`` per second: exponential gaps of mean ``1 / rate``;
- **gamma** bursts at ``rate`` with ``burstiness`` ``b``: gamma gaps of shape ``1 / b``
  and the same mean, so ``b = 1`` is Poisson and a larger ``b`` clumps the requests
  (the coefficient of variation of the gaps is ``sqrt(b)``), as vLLM's benchmark does;
- **periodic** at ``rate``: one every ``1 / rate`` seconds, the first after one gap
  (a client on a timer, as a health check or a dashboard is);
- **trace**: the times listed in a file, one a line (blank lines and ``#`` comments
  skipped), sorted and cut at the duration.

A closed loop at a concurrency has no schedule: the harness sends the next request as
one finishes.
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["gamma_times", "periodic_times", "poisson_times", "trace_times"]


def poisson_times(rate: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrivals at ``rate`` per second within ``[0, duration_s)``."""
    return gamma_times(rate, 1.0, duration_s, seed)


def gamma_times(rate: float, burstiness: float, duration_s: float, seed: int) -> list[float]:
    """Arrivals with gamma gaps (shape ``1 / burstiness``, mean ``1 / rate``) within
    ``[0, duration_s)``."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    shape = 1.0 / burstiness
    scale = 1.0 / (rate * shape)
    times: list[float] = []
    t = rng.gammavariate(shape, scale)
    while t < duration_s:
        times.append(t)
        t += rng.gammavariate(shape, scale)
    return times


def periodic_times(rate: float, duration_s: float) -> list[float]:
    """One arrival every ``1 / rate`` seconds within ``(0, duration_s)``."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    times: list[float] = []
    k = 1
    while (t := k / rate) < duration_s:
        times.append(t)
        k += 1
    return times


def trace_times(path: Path, duration_s: float) -> list[float]:
    """The send times listed in ``path`` (seconds, one a line), sorted, below
    ``duration_s``. Raises :class:`ValueError` naming the line that is not a number."""
    times = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{path}:{n}: not a time in seconds: {text!r}") from None
        if value < 0:
            raise ValueError(f"{path}:{n}: a time before the start: {value}")
        times.append(value)
    return sorted(t for t in times if t < duration_s)
