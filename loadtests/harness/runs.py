"""A workload's plan against one or two arms, and the result directory it leaves.

:func:`run_plan` runs the plan (a cold run if asked, then the warm runs) against one
arm, sampling the proxy's ``GET /turn`` twice a second for the timeline when the arm
is a proxy, and keeping its ``GET /turn/log`` at the end. Progress is a live line on a
terminal, plain lines otherwise (:mod:`loadtests.harness.progress`); a run none of whose
requests got an answer ends the arm (:func:`loadtests.harness.preflight.unanswered`).
:func:`finish` summarises the arms, checks
their answers against each other, writes ``records.jsonl``, ``result.json``,
``report.md`` and the plots, and prints the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from loadtests.harness import plots
from loadtests.harness.buckets import LengthFigures, by_length
from loadtests.harness.engine_histograms import Span, engine_view
from loadtests.harness.measures import (
    ActivationSummary,
    ClassSummary,
    Window,
    answer_mismatches,
    judge,
    pct,
    summarize_activation,
    summarize_jobs,
    summarize_runs,
)
from loadtests.harness.preflight import unanswered
from loadtests.harness.progress import progress
from loadtests.harness.report import (
    Findings,
    side_by_side,
    write_records,
    write_report,
    write_result,
)
from loadtests.harness.report_sections import activation_table, tenant_table
from loadtests.harness.stalls import Phase, StallWatch, attribute
from loadtests.harness.tenants import summarize_tenants
from loadtests.harness.traffic import ArmRun, Route, new_run, run_arm
from loadtests.harness.watch import in_background, listening_pid, peaks, watching
from loadtests.harness.workload_file import Workload

SAMPLE_INTERVAL_S = 0.5

if TYPE_CHECKING:
    from rich.console import Console

    from loadtests.harness.client import Record


@dataclass
class ArmResult:
    """An arm's runs (the cold one apart), and through a proxy its turn samples
    (``{"t": seconds from the first run's start, "engines": GET /turn's list}``)."""

    warm: list[ArmRun]
    cold: ArmRun | None = None
    turns: list[dict[str, Any]] = field(default_factory=list)
    os_samples: list[dict[str, Any]] = field(default_factory=list)
    started: list[dict[str, Any]] = field(default_factory=list)  # servers the harness started
    stalls: list[tuple[float, float]] = field(default_factory=list)  # the machine's stops
    servers: list[str] = field(default_factory=list)  # the names of the servers watched
    watch_started_at: float = 0.0  # monotonic: the scrape files' times count from it

    def valid_records(self) -> int:
        """Valid answers of every run (the cold one too), streams closed early excluded."""
        return sum(
            1
            for _, run in self.all_runs()
            for rs in run.records.values()
            for r in rs
            if r.valid and r.closed_at is None
        )

    def all_runs(self) -> list[tuple[str, ArmRun]]:
        first = [("cold", self.cold)] if self.cold is not None else []
        return first + [(f"warm-{n}", run) for n, run in enumerate(self.warm)]

    def phases(self, workload: Workload) -> list[Phase]:
        """Each run's warm-up, measured window and drain (its open requests waited
        for after the plan's duration), in order."""
        plan, out = workload.plan, []
        for label, run in self.all_runs():
            start, end = run.started_at, run.started_at + plan.duration_s
            out += [
                Phase(f"{label} warm-up", start, start + plan.warmup_s),
                Phase(f"{label} measured", start + plan.warmup_s, end),
                Phase(f"{label} drain", end, max(end, run.ended_at or end)),
            ]
        return out

    def engine_view(self, arm: str, workload: Workload, out: Path) -> dict[str, Any]:
        """Arm ``arm``'s watched servers (``out/metrics/``): each one's queue, prefill
        and TTFT histograms reduced per phase and over the warm runs' measured windows
        together (``warm measured``) (:mod:`loadtests.harness.engine_histograms`); servers
        that export none left out."""
        spans = [
            Span(p.name, p.start - self.watch_started_at, p.end - self.watch_started_at)
            for p in self.phases(workload)
        ]
        pooled = {"warm measured": [f"warm-{n} measured" for n in range(len(self.warm))]}
        found = {
            name: engine_view(out / "metrics" / f"{arm}-{name}.prom", spans, pooled)
            for name in self.servers
        }
        return {name: view for name, view in found.items() if view}

    def stall_view(self, workload: Workload) -> dict[str, Any]:
        """The machine's stops during the arm, set against its phases
        (:func:`loadtests.harness.stalls.attribute`); times from its first run's start."""
        runs = self.all_runs()
        origin = runs[0][1].started_at if runs else 0.0
        return attribute(self.stalls, self.phases(workload), origin=origin)


@dataclass(frozen=True)
class ArmTarget:
    """Where one arm's requests go: its name and route; through a proxy, the proxy's
    base URL (its turn samples and turn log kept); the servers watched meanwhile (name:
    base URL, :mod:`loadtests.harness.watch`); the request priority of each class."""

    name: str
    route: Route
    proxy: str | None = None
    servers: dict[str, str] = field(default_factory=dict)
    priority: dict[str, int] | None = None


async def run_plan(
    workload: Workload, target: ArmTarget, *, out: Path, console: Console
) -> ArmResult:
    """Run ``workload``'s plan against one arm; through a proxy, keep its turn samples
    and write its decisions to ``out/<arm>-turn-log.json``. The target's servers are
    watched meanwhile, and the machine's stops
    (:class:`loadtests.harness.stalls.StallWatch`)."""
    result = ArmResult([])
    pids = {name: listening_pid(url) for name, url in target.servers.items()}
    stalls = StallWatch().start()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    try:
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            async with (
                _watch(http, target.proxy, result.turns),
                watching(
                    http, target.servers, pids, out, target.name, result.os_samples
                ) as watch_start,
            ):
                result.servers, result.watch_started_at = list(target.servers), watch_start
                for number, label in enumerate(run_labels(workload)):
                    run = new_run(workload, target.priority, number)
                    shown = f"{target.name} ({label})"
                    async with progress(console, shown, run, result.turns, workload.plan):
                        await run_arm(workload, target.route, http, run, batch_api=target.proxy)
                    unanswered(_all_records(run), shown)
                    if label == "cold":
                        result.cold = run
                    else:
                        result.warm.append(run)
            log = await _turn_log(http, target.proxy) if target.proxy is not None else None
            if log is not None:
                (out / f"{target.name}-turn-log.json").write_text(json.dumps(log, indent=1))
    finally:
        stalls.stop()
        result.stalls = list(stalls.stalls)
    return result


def run_labels(workload: Workload) -> list[str]:
    """The names of an arm's runs, in order: ``cold``, then ``warm 1/N`` ..."""
    warm = workload.plan.warm_runs
    return ["cold"] * workload.plan.cold + [f"warm {n}/{warm}" for n in range(1, warm + 1)]


async def _turn_log(http: httpx.AsyncClient, proxy: str) -> Any:
    """The proxy's ``GET /turn/log``; None, said in a line, from a proxy gone by now:
    the run's figures are kept without its decisions."""
    try:
        return (await http.get(f"{proxy}/turn/log", params={"limit": 1000})).json()
    except (httpx.HTTPError, ValueError) as exc:
        line = f"whoseturn: warning: {proxy}/turn/log not kept ({type(exc).__name__}: {exc})"
        print(line, file=sys.stderr)
        return None


def summaries(workload: Workload, runs: list[ArmRun]) -> dict[str, ClassSummary]:
    """Each class over ``runs``: latencies after each run's warm-up, throughput over
    each whole run."""
    out = {}
    for cls in workload.classes:
        if cls.route == "batch-api":
            spans = [
                (run.jobs[cls.name], run.started_at, run.started_at + workload.plan.duration_s)
                for run in runs
            ]
            out[cls.name] = summarize_jobs(spans)
            continue
        out[cls.name] = summarize_runs(windows(workload, runs, cls.name))
    return out


def windows(workload: Workload, runs: list[ArmRun], cls: str) -> list[Window]:
    """A streamed class's records over ``runs``, each run's measured window with it."""
    return [
        Window(run.records[cls], *run.window(workload), counted_from=run.started_at) for run in runs
    ]


def lengths(workload: Workload, runs: list[ArmRun]) -> dict[str, list[LengthFigures]]:
    """Each streamed class's TTFT by prompt length over ``runs``
    (:func:`loadtests.harness.buckets.by_length`)."""
    return {
        cls.name: by_length(windows(workload, runs, cls.name))
        for cls in workload.classes
        if cls.route != "batch-api"
    }


def finish(
    out: Path,
    workload: Workload,
    arms: dict[str, ArmResult],
    *,
    setup: dict[str, Any],
    reasoning: str,
    intro: str,
) -> str:
    """Write the result directory for ``arms`` (one or two); the table, printed too."""
    figures = {arm: summaries(workload, r.warm) for arm, r in arms.items()}
    if workload.plan.cold:
        figures.update(
            {f"{a} (cold)": summaries(workload, [r.cold]) for a, r in arms.items() if r.cold}
        )
    warm = {a: figures[a] for a in arms}
    found = findings(out, workload, arms, warm)
    warm_table = side_by_side(workload, warm, disturbed=found.disturbed)
    _write_rows(out, arms)
    drawn = _plots(out, arms)
    write_result(
        out,
        workload,
        found,
        setup={**setup, "started": found.started},
        summaries=figures,
        reasoning=reasoning,
    )
    write_report(out, workload, found, intro=intro, table=warm_table, plots=drawn)
    print(warm_table)
    if activation := activation_table(found.activation):
        print(f"\nWaiting for a model to wake:\n\n{activation}")
    if tenants := tenant_table(found.tenants):
        print(f"\nTenants (warm runs):\n\n{tenants}")
    if found.answers is not None:
        print(f"\nAnswer check: {found.answers[0]} compared, {found.answers[1]} differ.")
    if found.verdicts:
        print("\n" + "\n".join(f"- {line}" for line in found.verdicts))
    print(f"\nReport: {out / 'report.md'}")
    print("Plots: " + ", ".join(str(out / name) for name in drawn))
    return warm_table


def findings(
    out: Path,
    workload: Workload,
    arms: dict[str, ArmResult],
    warm: dict[str, dict[str, ClassSummary]],
) -> Findings:
    """What the report says beside the ``warm`` figures (arm: class: summary) of ``arms``."""
    stalls = {arm: r.stall_view(workload) for arm, r in arms.items()}
    return Findings(
        answers=_answer_check(arms),
        verdicts=[v.line() for v in judge(workload.bars, warm)],
        machine={arm: machine_view(r) for arm, r in arms.items()},
        started={a: r.started for a, r in arms.items() if r.started},
        stalls=stalls,
        disturbed=disturbed_figures(stalls),
        by_prompt={arm: lengths(workload, r.warm) for arm, r in arms.items()},
        engines={
            arm: {
                "engines": r.engine_view(arm, workload, out),
                "client": client_view(workload, r.warm),
            }
            for arm, r in arms.items()
        },
        tenants={arm: summarize_tenants(workload, r.warm) for arm, r in arms.items()}
        if len(workload.tenant_names()) > 1
        else {},
        activation=activation_view(arms),
    )


def activation_view(arms: dict[str, ArmResult]) -> dict[str, ActivationSummary]:
    """Each arm's activation phase (:func:`loadtests.harness.measures.summarize_activation`)
    per traffic class (``"<arm>, <class>"``), over its warm runs, and over its cold
    run apart (``"<arm>, <class> (cold)"``)."""
    out = {}
    for arm, result in arms.items():
        runs = result.all_runs()
        classes = sorted({cls for _, run in runs for cls in run.records})
        for cls in classes:
            by_run = [(label, run.records.get(cls, [])) for label, run in runs]
            out[f"{arm}, {cls}"] = summarize_activation([r for r in by_run if r[0] != "cold"])
            if result.cold is not None:
                cold = [r for r in by_run if r[0] == "cold"]
                out[f"{arm}, {cls} (cold)"] = summarize_activation(cold)
    return out


def _answer_check(arms: dict[str, ArmResult]) -> tuple[int, int] | None:
    """``(compared, differing)`` over two arms' answers (None for one arm), run by run:
    a run's prompts are its own (:func:`loadtests.harness.traffic.body`)."""
    if len(arms) != 2:
        return None
    compared = differing = 0
    for (_, a), (_, b) in zip(*(r.all_runs() for r in arms.values()), strict=False):
        c, d = answer_mismatches(_all_records(a), _all_records(b))
        compared, differing = compared + c, differing + d
    return compared, differing


def _write_rows(out: Path, arms: dict[str, ArmResult]) -> None:
    """``records.jsonl`` (every request of every run) and ``jobs.jsonl`` (every Batch API
    job, when there were any)."""
    write_records(
        out,
        {
            a: [
                {"run": label, **rec.to_json()}
                for label, run in r.all_runs()
                for rs in run.records.values()
                for rec in rs
            ]
            for a, r in arms.items()
        },
    )
    jobs = [
        {"arm": a, "run": label, **job.to_json()}
        for a, r in arms.items()
        for label, run in r.all_runs()
        for js in run.jobs.values()
        for job in js
    ]
    if jobs:
        (out / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs))


def client_view(workload: Workload, runs: list[ArmRun]) -> dict[str, float | None]:
    """What the client saw over ``runs``' measured windows, every streamed class
    together, to set beside the engines' histograms: TTFT and the proxy's queue wait
    (``X-Whoseturn-Queue-Ms``), p50 and p95 in seconds (None for none)."""
    sent = [
        r
        for cls in workload.classes
        if cls.route != "batch-api"
        for w in windows(workload, runs, cls.name)
        for r in w.records
        if w.start <= r.sent_at <= w.end and r.closed_at is None
    ]
    ttft = [t for r in sent if (t := r.ttft) is not None]
    queue = [r.proxy_queue_ms / 1000.0 for r in sent if r.proxy_queue_ms is not None]
    figures = {
        "requests": float(len(ttft)),
        "ttft_p50": pct(ttft, 0.50),
        "ttft_p95": pct(ttft, 0.95),
        "queue_p50": pct(queue, 0.50),
        "queue_p95": pct(queue, 0.95),
    }
    return {k: None if math.isnan(v) else v for k, v in figures.items()}


def disturbed_figures(stalls: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Which figures a long stop disturbed: ``{arm: phases}`` for the warm figures
    (a warm run's phase disturbed), ``{"<arm> (cold)": phases}`` for the cold ones;
    arms without a disturbed phase are left out."""
    out: dict[str, list[str]] = {}
    for arm, view in stalls.items():
        for phase in view["disturbed"]:
            key = f"{arm} (cold)" if phase.startswith("cold ") else arm
            out.setdefault(key, []).append(phase)
    return out


def machine_view(result: ArmResult) -> dict[str, Any]:
    """An arm's peaks (:func:`loadtests.harness.watch.peaks`), with the GPUs' energy per valid
    record when there were GPUs to read."""
    view = peaks(result.os_samples)
    valid = result.valid_records()
    view["valid_records"] = valid
    if view["gpu"] is not None:
        view["gpu"]["energy_per_valid_record_j"] = (
            view["gpu"]["energy_j"] / valid if valid else None
        )
    return view


def _plots(out: Path, arms: dict[str, ArmResult]) -> list[str]:
    series = {}
    for arm, result in arms.items():
        for cls in result.warm[0].records:
            values = [
                t for run in result.warm for r in run.records[cls] if (t := r.ttft) is not None
            ]
            series[f"{cls}, {arm}"] = values
    plots.ttft_plot(out / "ttft.png", series)
    drawn = ["ttft.png"]
    for arm, result in arms.items():
        if result.turns:
            plots.timeline_plot(out / f"timeline-{arm}.png", result.turns)
            drawn.append(f"timeline-{arm}.png")
    return drawn


@contextlib.asynccontextmanager
async def _watch(
    http: httpx.AsyncClient, proxy: str | None, samples: list[dict[str, Any]]
) -> AsyncIterator[None]:
    """Sample ``GET proxy/turn`` into ``samples`` while the body runs (nothing if no proxy)."""

    async def sample() -> None:
        start = time.monotonic()
        while True:
            try:
                body = (await http.get(f"{proxy}/turn")).json()
                samples.append({"t": time.monotonic() - start, "engines": body["engines"]})
            except httpx.HTTPError:
                pass  # a missed sample is a gap in the plot, not a failure of the run
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    if not proxy:
        yield
        return
    async with in_background(sample()):
        yield


def _all_records(run: ArmRun) -> list[Record]:
    return [rec for records in run.records.values() for rec in records]
