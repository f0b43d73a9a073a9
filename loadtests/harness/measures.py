"""What the harness computes from the records it kept, with the definitions of vLLM's
benchmark:

- **TTFT**: request sent → first content token;
- **ITL**: every gap between consecutive tokens of a stream (one value per gap);
- **TPOT**: ``(E2E - TTFT) / (n - 1)`` for an answer of ``n > 1`` tokens, E2E being
  request sent → last byte;
- **queue wait**: the proxy's ``X-Whoseturn-Queue-Ms``;
- **activation**: the part of the queue wait spent waiting for the model to wake on
  its card, the proxy's ``X-Whoseturn-Activation-Ms`` (absent: no wake waited for);
  the requests that waited for their model's first wake of a run (the cold
  activation) apart from those that waited for a later one (:func:`summarize_activation`);
- **valid**: a whole answer and, when the prompt carries a JSON schema, one that
  follows it (:mod:`loadtests.harness.validity`); whole and schema-checked answers are
  counted beside it;
- **valid records per hour**: valid answers finished within the measured window,
  scaled to an hour.

Percentiles are nearest-rank (the proxy's own :func:`percentile`), NaN for no value.
The answer check pairs the records of two arms by id: with greedy sampling on the same
engine the same prompt must get the same answer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loadtests.harness.client import Record
from loadtests.harness.traffic import Job
from loadtests.harness.workload_file import Bar
from proxy.scheduler.budget import percentile

__all__ = [
    "ActivationSummary",
    "ClassSummary",
    "Verdict",
    "Wake",
    "Window",
    "answer_mismatches",
    "gaps",
    "judge",
    "pct",
    "summarize",
    "summarize_activation",
    "summarize_jobs",
    "summarize_runs",
    "tpot",
    "valid_per_hour",
]


def pct(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 to 1) of ``values``; NaN if none."""
    return percentile(list(values), q) if values else math.nan


def gaps(record: Record) -> list[float]:
    """The inter-token gaps of one stream, in seconds."""
    return [b - a for a, b in itertools.pairwise(record.token_times)]


def tpot(record: Record) -> float | None:
    """Time per output token after the first: ``(E2E - TTFT) / (n - 1)``; None for an
    answer of fewer than two tokens or an unfinished one."""
    n = record.completion_tokens or len(record.token_times)
    if n < 2 or record.done is None or record.ttft is None:
        return None
    return (record.done - record.ttft) / (n - 1)


@dataclass(frozen=True)
class ClassSummary:
    """One traffic class of one arm over the measured window (seconds, counts); NaN
    for a figure the class has none of (a ``batch-api`` class streams nothing)."""

    requests: int
    valid: int
    ttft_p50: float = math.nan
    ttft_p95: float = math.nan
    ttft_p99: float = math.nan
    itl_p50: float = math.nan
    itl_p95: float = math.nan
    tpot_p50: float = math.nan
    done_p50: float = math.nan
    done_p95: float = math.nan
    queue_p95: float = math.nan
    valid_per_hour: float = math.nan
    records_per_hour: float = math.nan  # batch-api: lines answered, whole or not
    worst_gap_p50: float = math.nan  # the median over streams of each one's worst gap
    whole: int = 0  # whole answers (loadtests.harness.validity), schema or not
    schema_checked: int = 0  # whole answers whose prompt carries a JSON schema
    schema_valid: int = 0  # of those, the ones that follow it


def valid_per_hour(records: Iterable[Record], start: float, end: float) -> float:
    """Valid answers finished within ``[start, end]`` (monotonic seconds), per hour."""
    if end <= start:
        raise ValueError("the window must have a positive length")
    done = sum(
        1
        for r in records
        if r.closed_at is None and r.valid and r.finished_at is not None
        if start <= r.finished_at <= end
    )
    return done * 3600.0 / (end - start)


@dataclass(frozen=True)
class Window:
    """One run's records of one class: latencies of those sent within
    ``[start, end]``, throughput of those finished within ``[counted_from, end]``."""

    records: Sequence[Record]
    start: float
    end: float
    counted_from: float


def summarize(
    records: Sequence[Record], start: float, end: float, *, counted_from: float | None = None
) -> ClassSummary:
    """The summary of one run's ``records`` of one class (see :class:`Window`;
    ``counted_from`` defaults to ``start``)."""
    return summarize_runs(
        [Window(records, start, end, start if counted_from is None else counted_from)]
    )


def summarize_runs(windows: Sequence[Window]) -> ClassSummary:
    """The summary of one class over several runs: latencies pooled, throughput the
    valid answers of all runs over their summed length."""
    sent = [
        r
        for w in windows
        for r in w.records
        if w.start <= r.sent_at <= w.end and r.closed_at is None
    ]
    ttft = [t for r in sent if (t := r.ttft) is not None]
    itl = [g for r in sent for g in gaps(r)]
    per_token = [t for r in sent if (t := tpot(r)) is not None]
    done = [d for r in sent if (d := r.done) is not None]
    queue = [r.proxy_queue_ms / 1000.0 for r in sent if r.proxy_queue_ms is not None]
    length = sum(w.end - w.counted_from for w in windows)
    per_hour = sum(
        valid_per_hour(w.records, w.counted_from, w.end) * (w.end - w.counted_from) for w in windows
    )
    return ClassSummary(
        requests=len(sent),
        valid=sum(1 for r in sent if r.valid),
        whole=sum(1 for r in sent if r.whole),
        schema_checked=sum(1 for r in sent if r.schema_valid is not None),
        schema_valid=sum(1 for r in sent if r.schema_valid),
        ttft_p50=pct(ttft, 0.50),
        ttft_p95=pct(ttft, 0.95),
        ttft_p99=pct(ttft, 0.99),
        itl_p50=pct(itl, 0.50),
        itl_p95=pct(itl, 0.95),
        tpot_p50=pct(per_token, 0.50),
        done_p50=pct(done, 0.50),
        done_p95=pct(done, 0.95),
        queue_p95=pct(queue, 0.95),
        valid_per_hour=per_hour / length,
        # a stream the client closed on purpose counts here: its gaps until then are real
        worst_gap_p50=pct(
            [
                r.worst_gap
                for w in windows
                for r in w.records
                if w.start <= r.sent_at <= w.end and len(r.token_times) > 1
            ],
            0.50,
        ),
    )


def summarize_jobs(windows: Sequence[tuple[Sequence[Job], float, float]]) -> ClassSummary:
    """A ``batch-api`` class over several runs (``(jobs, run start, run end)``): the
    requests are the jobs' lines, records and valid records per hour count every
    answered line of every job of a run over the runs' summed length (a job still
    running at a run's end was cancelled then, its partial output counted), and the
    completion times are those of the jobs that ended on their own."""
    jobs = [j for w in windows for j in w[0]]
    length = sum(end - start for _, start, end in windows)
    if length <= 0:
        raise ValueError("the window must have a positive length")
    ended = [
        j.finished_at - j.submitted_at
        for j in jobs
        if j.finished_at is not None and not j.cancelled_by_client and j.status == "completed"
    ]
    nan = math.nan
    return ClassSummary(  # no stream: no TTFT, ITL, TPOT or queue wait
        requests=sum(j.lines for j in jobs),
        valid=sum(j.valid for j in jobs),
        whole=sum(j.whole for j in jobs),
        schema_checked=sum(j.schema_checked for j in jobs),
        schema_valid=sum(j.schema_valid for j in jobs),
        done_p50=pct(ended, 0.50),
        done_p95=pct(ended, 0.95),
        # no job at all (the direct arm, which has no Batch API): no figure, not zero
        valid_per_hour=sum(j.valid for j in jobs) * 3600.0 / length if jobs else nan,
        records_per_hour=sum(j.completed for j in jobs) * 3600.0 / length if jobs else nan,
    )


def judge(bars: Sequence[Bar], figures: dict[str, dict[str, ClassSummary]]) -> list[Verdict]:
    """Each bar of a workload file on the warm ``figures`` (arm: class: summary)."""
    out = []
    for bar in bars:
        if bar.all_valid:
            valid = sum(s.valid for arm in figures.values() for s in arm.values())
            sent = sum(s.requests for arm in figures.values() for s in arm.values())
            out.append(Verdict(f"valid answers, all arms: {valid} of {sent}", valid == sent))
            continue
        cls, _, name = bar.figure.partition(".")
        if bar.arm:
            value = getattr(figures[bar.arm][cls], name)
        else:
            a, b = (getattr(figures[arm][cls], name) for arm in bar.ratio)
            value = a / b if b else math.nan
        if bar.above is not None:
            ok, rule = value > bar.above, f"> {bar.above:g}"
        else:
            assert bar.at_most is not None
            ok, rule = value <= bar.at_most, f"<= {bar.at_most:g}"
        ok = ok and not math.isnan(value)
        of = bar.arm or f"{bar.ratio[0]} / {bar.ratio[1]}"
        label = f"{bar.figure}: {of} = {value:.2f}{' s' if bar.arm else ''} (bar {rule})"
        out.append(Verdict(label, ok))
    return out


@dataclass(frozen=True)
class Verdict:
    label: str
    met: bool

    def line(self) -> str:
        return f"{self.label}: {'met' if self.met else 'NOT met'}"


def answer_mismatches(a: Iterable[Record], b: Iterable[Record]) -> tuple[int, int]:
    """``(compared, differing)``: the records of two arms paired by id, both whole
    (not closed early; schema-valid or not), and how many of those pairs answered
    differently."""
    whole = {r.id: r for r in b if r.whole and r.closed_at is None}
    pairs = [(r, whole[r.id]) for r in a if r.whole and r.closed_at is None and r.id in whole]
    return len(pairs), sum(1 for x, y in pairs if x.text != y.text)


@dataclass(frozen=True)
class Wake:
    """A model's first wake in a run as the client saw it: the run, the model, the
    first request that waited for it (its id and wait, in seconds: the wake as near
    as the client can tell) and how many requests waited for it, that one included."""

    run: str
    model: str
    id: str
    wait_s: float
    requests: int


@dataclass(frozen=True)
class ActivationSummary:
    """The activation phase over some runs (seconds; NaN for a figure of no request):
    of ``requests`` sent, the ``waited`` that waited for their model to wake, split
    into ``first`` (they waited for their model's first wake of their run: the cold
    activation) and ``again`` (a later wake), with each run's first wakes."""

    requests: int
    waited: int = 0
    wait_p50: float = math.nan
    wait_p95: float = math.nan
    wait_max: float = math.nan
    first: int = 0
    first_p50: float = math.nan
    first_p95: float = math.nan
    first_max: float = math.nan
    again: int = 0
    again_p50: float = math.nan
    again_p95: float = math.nan
    again_max: float = math.nan
    first_wakes: list[Wake] = field(default_factory=list)


def summarize_activation(runs: Sequence[tuple[str, Iterable[Record]]]) -> ActivationSummary:
    """The activation phase of ``runs`` (a label and the records of one run, every
    class). Every request sent is counted, the warm-up's and the streams closed early
    too: a model's first wake comes at a run's start. A model's first wake in a run
    is the one its first waiting request (by time sent) waited for; it ended at that
    request's send time plus its wait, so every request of that model sent by then
    and waiting for a wake waited for the same one, and counts as ``first``."""
    sent = 0
    first: list[float] = []
    again: list[float] = []
    wakes: list[Wake] = []
    for label, records in runs:
        by_model: dict[str, list[tuple[float, float, str]]] = {}  # (sent, wait, id)
        for r in records:
            sent += 1
            if r.proxy_activation_ms is not None:
                waited = (r.sent_at, r.proxy_activation_ms / 1000.0, r.id)
                by_model.setdefault(r.model or "", []).append(waited)
        for model, waiting in by_model.items():
            waiting.sort(key=lambda w: (w[0], -w[1]))  # the longest wait of a tie first
            lead_sent, lead_wait, lead_id = waiting[0]
            ended = lead_sent + lead_wait
            cold = [wait for at, wait, _ in waiting if at <= ended]
            first += cold
            again += [wait for at, wait, _ in waiting if at > ended]
            wakes.append(Wake(label, model, lead_id, lead_wait, len(cold)))
    every = first + again
    return ActivationSummary(
        requests=sent,
        waited=len(every),
        wait_p50=pct(every, 0.50),
        wait_p95=pct(every, 0.95),
        wait_max=max(every, default=math.nan),
        first=len(first),
        first_p50=pct(first, 0.50),
        first_p95=pct(first, 0.95),
        first_max=max(first, default=math.nan),
        again=len(again),
        again_p50=pct(again, 0.50),
        again_p95=pct(again, 0.95),
        again_max=max(again, default=math.nan),
        first_wakes=wakes,
    )
