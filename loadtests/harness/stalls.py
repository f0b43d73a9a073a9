"""A watch on the machine itself: how long a process that asked to wake every 10 ms
was kept from running.

On the small virtual machines this project runs on, the whole machine now and then
stops for seconds (every process at once, the engine included). A latency measured
across such a stop measures the machine, not the scheduling, so the harness runs
this watch in its own process (``python -m loadtests.harness.stalls``) and sets each
repetition against the stops seen during it. Each stop longer than the threshold is
printed as ``<monotonic start> <seconds>``.

:func:`attribute` sets an arm's stops against its phases (each run's warm-up,
measured window and drain): a phase in which a stop longer than
:data:`DISTURBING_S` fell is *disturbed*. Its figures are kept as measured and
marked, never dropped.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TICK_S = 0.010
THRESHOLD_S = 0.100
DISTURBING_S = 0.500  # a stop this long in a phase marks its figures as disturbed
OUTSIDE = "outside the runs"


def watch(threshold_s: float = THRESHOLD_S) -> None:
    """Print every stop longer than ``threshold_s`` until killed."""
    last = time.monotonic()
    while True:
        time.sleep(TICK_S)
        now = time.monotonic()
        if now - last - TICK_S > threshold_s:
            print(f"{last:.6f} {now - last - TICK_S:.6f}", flush=True)
        last = now


@dataclass
class StallWatch:
    """``python -m loadtests.harness.stalls`` as a child process, its reports collected."""

    stalls: list[tuple[float, float]] = field(default_factory=list)
    _process: subprocess.Popen[str] | None = None
    _reader: threading.Thread | None = None

    def start(self) -> StallWatch:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "loadtests.harness.stalls"], stdout=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            start, seconds = line.split()
            self.stalls.append((float(start), float(seconds)))

    def between(self, start: float, end: float) -> list[float]:
        """The lengths of the stops that overlap ``[start, end]``."""
        return [s for _, s in self.spans_between(start, end)]

    def spans_between(self, start: float, end: float) -> list[tuple[float, float]]:
        """The stops (start, length) that overlap ``[start, end]``."""
        return [(at, s) for at, s in list(self.stalls) if at < end and at + s > start]

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)
            if self._reader is not None:
                self._reader.join(5)
            if self._process.stdout is not None:
                self._process.stdout.close()


def overlaps(a: float, b: float, spans: list[tuple[float, float]]) -> bool:
    """Whether the interval ``(a, b)`` overlaps any of ``spans`` (start, length)."""
    return any(at < b and at + s > a for at, s in spans)


def stopped_within(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """How much of the interval ``(a, b)`` the ``spans`` (start, length) cover; spans
    are merged first, so overlapping stops are not counted twice."""
    covered, reach = 0.0, a
    for start, length in sorted(spans):
        lo, hi = max(start, reach), min(start + length, b)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


@dataclass(frozen=True)
class Phase:
    """A named span of an arm (monotonic seconds)."""

    name: str
    start: float
    end: float


def attribute(
    stops: Sequence[tuple[float, float]],
    phases: Sequence[Phase],
    *,
    origin: float,
    disturbing_s: float = DISTURBING_S,
) -> dict[str, Any]:
    """An arm's ``stops`` (start, length) set against its ``phases``: their count,
    longest and total length; each stop (``at`` seconds from ``origin``) with the
    phases it overlaps (:data:`OUTSIDE` when none); per phase that had any, its
    count, longest, total and whether it is disturbed (a stop longer than
    ``disturbing_s`` overlaps it); and the disturbed phases, in phase order."""
    listed: list[dict[str, Any]] = []
    per_phase: dict[str, dict[str, Any]] = {}
    for at, seconds in sorted(stops):
        names = [p.name for p in phases if overlaps(p.start, p.end, [(at, seconds)])]
        listed.append(
            {"at": round(at - origin, 3), "seconds": seconds, "phases": names or [OUTSIDE]}
        )
        for name in names or [OUTSIDE]:
            seen = per_phase.setdefault(
                name, {"count": 0, "longest_s": 0.0, "total_s": 0.0, "disturbed": False}
            )
            seen["count"] += 1
            seen["longest_s"] = max(seen["longest_s"], seconds)
            seen["total_s"] += seconds
            seen["disturbed"] = seen["disturbed"] or (seconds > disturbing_s and name != OUTSIDE)
    lengths = [s for _, s in stops]
    return {
        "threshold_s": THRESHOLD_S,
        "disturbing_s": disturbing_s,
        "count": len(lengths),
        "longest_s": max(lengths, default=0.0),
        "total_s": sum(lengths, 0.0),
        "stops": listed,
        "phases": per_phase,
        "disturbed": [p.name for p in phases if per_phase.get(p.name, {}).get("disturbed")],
    }


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        watch(float(sys.argv[1]) if len(sys.argv) > 1 else THRESHOLD_S)
