"""What a run is doing while it runs, with ``rich`` either way.

On a terminal: a live line per class (sent, valid, TTFT p95 so far) and, through a
proxy, whose turn it is now, redrawn four times a second and gone when the run ends.
Anywhere else (CI, ``| tee``, a log file) a redrawn line would be noise or nothing,
so plain lines are printed instead: one as the run starts, one every
:data:`PLAIN_EVERY_S` seconds (the phase, the time, the requests sent, done and
failed), one as it ends. A run of minutes in CI then shows it is alive and how it
goes, and its log keeps the lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from loadtests.harness.measures import pct
from loadtests.harness.report_sections import ms
from loadtests.harness.traffic import ArmRun
from loadtests.harness.watch import in_background
from loadtests.harness.workload_file import Plan

if TYPE_CHECKING:
    from rich.console import Console

PLAIN_EVERY_S = 10.0
LIVE_REFRESH_S = 0.25

Sleep = Callable[[float], Awaitable[Any]]


@contextlib.asynccontextmanager
async def progress(
    console: Console,
    label: str,
    run: ArmRun,
    turns: list[dict[str, Any]],
    plan: Plan,
    *,
    every_s: float = PLAIN_EVERY_S,
    sleep: Sleep = asyncio.sleep,
) -> AsyncIterator[None]:
    """Show ``run``'s progress (``label`` names it) while the body runs: live lines on
    a terminal, plain lines every ``every_s`` seconds otherwise (``sleep`` waits
    between them)."""
    if console.is_terminal:
        async with _live(console, label, run, turns):
            yield
        return

    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    say(f"{label}: started, {_planned(plan)}")

    async def tick() -> None:
        while True:
            await sleep(every_s)
            say(plain_line(label, time.monotonic() - run.started_at, run, plan))

    async with in_background(tick()):
        yield
    elapsed = time.monotonic() - run.started_at
    say(f"{label}: done after {elapsed:.0f} s: {_counts(run)}")


def _planned(plan: Plan) -> str:
    warmup = f" ({plan.warmup_s:g} s warm-up)" if plan.warmup_s else ""
    return f"{plan.duration_s:g} s planned{warmup}"


def phase(elapsed: float, plan: Plan) -> str:
    """The run's phase ``elapsed`` seconds after its start: warm-up, measured, or
    drain (the requests still open after the plan's duration, waited for)."""
    if elapsed < plan.warmup_s:
        return "warm-up"
    return "measured" if elapsed < plan.duration_s else "drain"


def plain_line(label: str, elapsed: float, run: ArmRun, plan: Plan) -> str:
    """One progress line: ``LABEL: 20 s of 40, measured: 52 sent, 50 done, 1 failed``
    (and the Batch API jobs when the workload has any)."""
    return (
        f"{label}: {elapsed:.0f} s of {plan.duration_s:g}, {phase(elapsed, plan)}: {_counts(run)}"
    )


def _counts(run: ArmRun) -> str:
    records = [r for rs in run.records.values() for r in rs]
    done = sum(1 for r in records if r.finished_at is not None)
    failed = sum(1 for r in records if r.error is not None)
    text = f"{len(records)} sent, {done} done, {failed} failed"
    jobs = [j for js in run.jobs.values() for j in js]
    if jobs:
        ended = sum(1 for j in jobs if j.finished_at is not None or j.error is not None)
        errors = sum(1 for j in jobs if j.error is not None)
        text += f"; {len(jobs)} jobs, {ended} ended, {errors} failed"
    return text


@contextlib.asynccontextmanager
async def _live(
    console: Console, label: str, run: ArmRun, turns: list[dict[str, Any]]
) -> AsyncIterator[None]:
    """A live line per class, and whose turn it is now through a proxy."""
    from rich.live import Live  # the bench's commands parse without rich

    with Live(console=console, refresh_per_second=4, transient=True) as live:

        async def refresh() -> None:
            while True:
                lines = live_lines(label, time.monotonic() - run.started_at, run)
                if turns:
                    now = ", ".join(f"{e['engine']} {e['turn']}" for e in turns[-1]["engines"])
                    lines += f"\n  whose turn: {now}"
                live.update(lines)
                await asyncio.sleep(LIVE_REFRESH_S)

        async with in_background(refresh()):
            yield


def live_lines(label: str, elapsed: float, run: ArmRun) -> str:
    """The terminal's lines: the label and time, then each class's counts so far."""
    lines = [f"{label}: {elapsed:4.0f} s"]
    for cls, records in run.records.items():
        ttft = [t for r in records if (t := r.ttft) is not None]
        valid = sum(1 for r in records if r.valid and r.closed_at is None)
        lines.append(
            f"  {cls}: {len(records)} sent, {valid} valid, TTFT p95 so far {ms(pct(ttft, 0.95))}"
        )
    return "\n".join(lines)
