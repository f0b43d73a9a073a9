"""When will a job be done: lines recorded per second of *busy* time, per job and per
model.

Pure: every time is passed in (epoch seconds). A job is busy while it has lines in
flight here (sent into the scheduler, not yet back); a model is busy while one of
its jobs is. The time a job waits with nothing in flight (for its tenant's limits,
for the engines' models, between one job of a model and the next, across a
restart) is not counted: a rate taken over wall time would count it and come out
low, the estimate late. Each job and each model keeps a busy clock, and
:class:`Throughput` counts the lines recorded in one-second buckets of that clock
over its last ``span_s`` busy seconds. A rate is the records in the span divided
by the span, or by the busy time so far when that is shorter, never by less than
one second. The rates are measured under whatever chat load the proxy carries:
chat comes first, so a busier chat hour shows up as a lower batch rate and a later
estimate.

:meth:`Throughput.estimate` takes the first of these that is known, and says which
in the estimate's ``basis``:

1. the job's own rate, once it has ``MIN_RECORDS`` records in its span;
2. the rate stored with the job (:class:`~proxy.batch.store.Progress`: the busy
   seconds and lines the runners measured and saved, so it survives a restart),
   said to be ``after restart`` while this process has recorded none of its lines;
3. its model's rate shared among that model's running jobs (so a job that starts
   behind others on a loaded model says at once that its window looks out of
   reach).

The estimate is ``now + remaining / rate``. :meth:`Throughput.unsaved` hands the
runner what to add to the stored :class:`~proxy.batch.store.Progress`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from proxy.batch.store import Progress

MIN_RECORDS = 8
SPAN_S = 300.0
NOT_MEASURED = "not measured yet"


@dataclass(frozen=True)
class Estimate:
    """What a job's batch object carries under ``whoseturn``; ``None`` fields: not
    known yet (no rate measured). ``basis`` says what the rate was measured over."""

    estimated_completion_at: int | None
    records_per_hour: float | None
    valid_records_per_hour: float | None
    window_reachable: bool | None
    basis: str = NOT_MEASURED

    def body(self) -> dict[str, object]:
        return {
            "estimated_completion_at": self.estimated_completion_at,
            "records_per_hour": self.records_per_hour,
            "valid_records_per_hour": self.valid_records_per_hour,
            "window_reachable": self.window_reachable,
            "basis": self.basis,
        }


@dataclass(frozen=True)
class Rate:
    """Lines recorded (``per_s``) and usable lines (``usable_per_s``) per busy
    second, and what they were measured over."""

    per_s: float
    usable_per_s: float
    basis: str


class _BusyClock:
    """Seconds of busy time: runs from :meth:`start` to :meth:`stop` (a clock that
    steps back counts nothing)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.since: float | None = None

    @property
    def running(self) -> bool:
        return self.since is not None

    def start(self, at: float) -> None:
        if self.since is None:
            self.since = at

    def stop(self, at: float) -> None:
        if self.since is not None:
            self.total += max(at - self.since, 0.0)
            self.since = None

    def read(self, at: float) -> float:
        if self.since is None:
            return self.total
        return self.total + max(at - self.since, 0.0)


class _Buckets:
    """Records and usable records per whole busy second, the last ``span_s`` of them."""

    def __init__(self) -> None:
        self.seconds: deque[list[int]] = deque()  # [busy second, records, usable]

    def add(self, busy_at: float, usable: bool) -> None:
        second = int(busy_at)
        if not self.seconds or self.seconds[-1][0] != second:
            self.seconds.append([second, 0, 0])
        self.seconds[-1][1] += 1
        self.seconds[-1][2] += int(usable)

    def counts(self, busy_now: float, span_s: float) -> tuple[int, int]:
        while self.seconds and self.seconds[0][0] <= busy_now - span_s:
            self.seconds.popleft()
        return sum(s[1] for s in self.seconds), sum(s[2] for s in self.seconds)


@dataclass
class _Model:
    clock: _BusyClock = field(default_factory=_BusyClock)
    buckets: _Buckets = field(default_factory=_Buckets)
    busy_jobs: int = 0


@dataclass
class _Job:
    model: str
    clock: _BusyClock = field(default_factory=_BusyClock)
    buckets: _Buckets = field(default_factory=_Buckets)
    in_flight: int = 0
    recorded: int = 0  # lines recorded here, in all
    saved_busy_s: float = 0.0  # the busy clock at the last save
    unsaved_records: int = 0
    unsaved_usable: int = 0


class Throughput:
    """Recent batch throughput over busy time. ``begin`` a job when its first line
    goes in flight (with that line's model: the job's lines count for it); ``sent``
    and ``back`` each line as it goes in flight and comes back (recorded or not),
    ``add`` each line recorded, ``end`` the job. A job is busy from ``begin`` until
    the lines ``sent`` are all ``back``, and again from the next ``sent``."""

    def __init__(self, span_s: float = SPAN_S) -> None:
        self.span_s = span_s
        self._jobs: dict[str, _Job] = {}
        self._models: dict[str, _Model] = {}

    def begin(self, batch_id: str, model: str, at: float) -> None:
        """The job's lines start running here: it is busy from ``at``, and counts for
        ``model`` (its rate and its share of the model's)."""
        job = self._jobs.get(batch_id)
        if job is None:
            job = self._jobs[batch_id] = _Job(model)
            self._models.setdefault(model, _Model())
        self._busy(job, at)

    def sent(self, batch_id: str, at: float) -> None:
        """One of the job's lines went in flight (after :meth:`begin`)."""
        job = self._jobs.get(batch_id)
        if job is not None:
            job.in_flight += 1
            self._busy(job, at)

    def back(self, batch_id: str, at: float) -> None:
        """One of the job's lines came back; the last one back makes the job idle."""
        job = self._jobs.get(batch_id)
        if job is not None:
            job.in_flight = max(job.in_flight - 1, 0)
            if job.in_flight == 0:
                self._idle(job, at)

    def model_of(self, batch_id: str) -> str | None:
        """The model the job's lines run on (None before its first line): a read."""
        job = self._jobs.get(batch_id)
        return job.model if job is not None else None

    def in_flight(self, batch_id: str) -> int:
        """The job's lines in flight here (0 for a job not begun): a read."""
        job = self._jobs.get(batch_id)
        return job.in_flight if job is not None else 0

    def add(self, at: float, batch_id: str, model: str, usable: bool) -> None:
        """One line recorded (``usable``: in the output file and, if it asked for
        structured output, valid). ``model`` begins a job not begun yet."""
        if batch_id not in self._jobs:
            self.begin(batch_id, model, at)
        job = self._jobs[batch_id]
        job.buckets.add(job.clock.read(at), usable)
        job.recorded += 1
        job.unsaved_records += 1
        job.unsaved_usable += int(usable)
        of_model = self._models[job.model]
        of_model.buckets.add(of_model.clock.read(at), usable)

    def end(self, batch_id: str, at: float) -> None:
        """The job's run here is over (idle from ``at``; the model keeps its rate)."""
        job = self._jobs.pop(batch_id, None)
        if job is not None:
            self._idle(job, at)

    def _busy(self, job: _Job, at: float) -> None:
        if job.clock.running:
            return
        job.clock.start(at)
        model = self._models[job.model]
        model.busy_jobs += 1
        model.clock.start(at)

    def _idle(self, job: _Job, at: float) -> None:
        if not job.clock.running:
            return
        job.clock.stop(at)
        model = self._models[job.model]
        model.busy_jobs -= 1
        if model.busy_jobs == 0:
            model.clock.stop(at)

    def unsaved(self, batch_id: str, now: float) -> Progress | None:
        """What the job measured here since the last call, to add to its stored
        progress (None: nothing). Taken: :meth:`keep` it back if the save fails."""
        job = self._jobs.get(batch_id)
        if job is None:
            return None
        busy = job.clock.read(now)
        progress = Progress(busy - job.saved_busy_s, job.unsaved_records, job.unsaved_usable)
        job.saved_busy_s, job.unsaved_records, job.unsaved_usable = busy, 0, 0
        return progress if progress.busy_s > 0 or progress.records else None

    def keep(self, batch_id: str, progress: Progress) -> None:
        """A save that failed: its measure goes with the next one."""
        job = self._jobs.get(batch_id)
        if job is not None:
            job.saved_busy_s -= progress.busy_s
            job.unsaved_records += progress.records
            job.unsaved_usable += progress.usable

    def rate(self, batch_id: str, now: float, stored: Progress | None = None) -> Rate | None:
        """The job's rate: its own, the ``stored`` one, or its model's share; None
        before anything is known."""
        job = self._jobs.get(batch_id)
        if job is not None:
            busy = job.clock.read(now)
            records, usable = job.buckets.counts(busy, self.span_s)
            if records >= MIN_RECORDS:
                span = max(min(self.span_s, busy), 1.0)
                basis = f"measured over {records} lines in {_seconds(span)} busy"
                return Rate(records / span, usable / span, basis)
        if stored is not None and stored.records >= MIN_RECORDS and stored.busy_s > 0:
            span = max(stored.busy_s, 1.0)
            measured = f"{stored.records} lines in {_seconds(span)} busy"
            basis = f"from the stored rate: {measured}"
            if job is None or not job.recorded:  # nothing of it measured here yet
                basis = f"after restart, {basis}"
            return Rate(stored.records / span, stored.usable / span, basis)
        if job is None:
            return None
        return self._model_share(job.model, now)

    def _model_share(self, name: str, now: float) -> Rate | None:
        model = self._models[name]
        busy = model.clock.read(now)
        records, usable = model.buckets.counts(busy, self.span_s)
        if records == 0:
            return None
        span = max(min(self.span_s, busy), 1.0)
        sharing = sum(1 for job in self._jobs.values() if job.model == name)
        basis = f"model {name}'s rate, {records} lines in {_seconds(span)} busy"
        if sharing > 1:
            basis += f", shared by {sharing} jobs"
        return Rate(records / span / sharing, usable / span / sharing, basis)

    def estimate(
        self,
        batch_id: str,
        remaining: int,
        expires_at: int,
        now: float,
        stored: Progress | None = None,
    ) -> Estimate:
        """When the job's ``remaining`` lines will be done at the rate measured."""
        rate = self.rate(batch_id, now, stored)
        if rate is None:
            return Estimate(None, None, None, None)
        done_at = int(now + remaining / rate.per_s) if rate.per_s > 0 else None
        reachable = done_at is not None and done_at <= expires_at
        return Estimate(
            done_at,
            round(rate.per_s * 3600, 1),
            round(rate.usable_per_s * 3600, 1),
            reachable,
            rate.basis,
        )


def _seconds(span: float) -> str:
    """A span for a basis: ``4.5 s`` under ten seconds, else whole seconds (``8 s``,
    ``300 s``)."""
    text = f"{span:.1f}" if span < 10 else f"{span:.0f}"
    return f"{text.removesuffix('.0')} s"
