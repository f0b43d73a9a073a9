"""When will a job be done: records per second of late, per job and per model.

Pure: every time is passed in (epoch seconds). :class:`Throughput` counts the
lines recorded in one-second buckets over the last ``span_s`` seconds, for each
running job and for each model. A rate is the records in the span divided by the
span, or by the time since the job (the model: its first job) began when that is
shorter, never by less than one second. The rates are measured under whatever
chat load the proxy carries: chat comes first, so a busier chat hour shows up as
a lower batch rate and a later estimate.

:meth:`Throughput.estimate` uses the job's own rate once it has ``MIN_RECORDS``
records in the span; before that, its model's rate shared among that model's
running jobs (so a job that starts behind others on a loaded model says at once
that its window looks out of reach). The estimate is ``now + remaining / rate``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MIN_RECORDS = 8
SPAN_S = 300.0


@dataclass(frozen=True)
class Estimate:
    """What a job's batch object carries under ``whoseturn``; ``None`` fields: not
    known yet (no rate measured)."""

    estimated_completion_at: int | None
    records_per_hour: float | None
    valid_records_per_hour: float | None
    window_reachable: bool | None

    def body(self) -> dict[str, object]:
        return {
            "estimated_completion_at": self.estimated_completion_at,
            "records_per_hour": self.records_per_hour,
            "valid_records_per_hour": self.valid_records_per_hour,
            "window_reachable": self.window_reachable,
        }


class _Buckets:
    """Records and usable records per whole second, the last ``span_s`` seconds."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.seconds: deque[list[int]] = deque()  # [second, records, usable]

    def add(self, at: float, usable: bool) -> None:
        second = int(at)
        if not self.seconds or self.seconds[-1][0] != second:
            self.seconds.append([second, 0, 0])
        self.seconds[-1][1] += 1
        self.seconds[-1][2] += int(usable)

    def counts(self, now: float, span_s: float) -> tuple[int, int]:
        while self.seconds and self.seconds[0][0] <= now - span_s:
            self.seconds.popleft()
        return sum(s[1] for s in self.seconds), sum(s[2] for s in self.seconds)

    def rates(self, now: float, span_s: float) -> tuple[float, float]:
        """(records, usable records) per second."""
        records, usable = self.counts(now, span_s)
        elapsed = max(min(span_s, now - self.since), 1.0)
        return records / elapsed, usable / elapsed


class Throughput:
    """Recent batch throughput. ``begin`` a job when its lines start running (with
    the model of its first line), ``add`` each recorded line, ``end`` the job."""

    def __init__(self, span_s: float = SPAN_S) -> None:
        self.span_s = span_s
        self._jobs: dict[str, _Buckets] = {}
        self._model_of: dict[str, str] = {}
        self._models: dict[str, _Buckets] = {}

    def begin(self, batch_id: str, model: str, at: float) -> None:
        self._jobs.setdefault(batch_id, _Buckets(at))
        self._model_of[batch_id] = model
        self._models.setdefault(model, _Buckets(at))

    def add(self, at: float, batch_id: str, model: str, usable: bool) -> None:
        """One line recorded (``usable``: in the output file and, if it asked for
        structured output, valid)."""
        self._jobs.setdefault(batch_id, _Buckets(at)).add(at, usable)
        self._models.setdefault(model, _Buckets(at)).add(at, usable)

    def end(self, batch_id: str) -> None:
        self._jobs.pop(batch_id, None)
        self._model_of.pop(batch_id, None)

    def rates(self, batch_id: str, now: float) -> tuple[float, float] | None:
        """The job's (records, usable records) per second: its own, or its model's
        share; None before anything is known."""
        own = self._jobs.get(batch_id)
        if own is not None and own.counts(now, self.span_s)[0] >= MIN_RECORDS:
            return own.rates(now, self.span_s)
        model = self._model_of.get(batch_id)
        if model is None or model not in self._models:
            return None
        sharing = sum(1 for m in self._model_of.values() if m == model)
        records, usable = self._models[model].rates(now, self.span_s)
        if records == 0:
            return None
        return records / sharing, usable / sharing

    def estimate(self, batch_id: str, remaining: int, expires_at: int, now: float) -> Estimate:
        """When the job's ``remaining`` lines will be done at the rate measured."""
        rates = self.rates(batch_id, now)
        if rates is None:
            return Estimate(None, None, None, None)
        per_s, usable_per_s = rates
        done_at = int(now + remaining / per_s) if per_s > 0 else None
        reachable = done_at is not None and done_at <= expires_at
        return Estimate(done_at, round(per_s * 3600, 1), round(usable_per_s * 3600, 1), reachable)
