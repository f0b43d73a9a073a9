"""``whoseturn demo``: the same mixed workload directly against two simulated engines
and through the proxy in front of them; the side-by-side table and a result directory.

Each arm starts its own processes (:mod:`loadtests.demo.setup`), runs
:func:`loadtests.demo.workload.run_arm`, and stops them. Through the proxy, ``GET
/turn`` is sampled twice a second for the timeline, and ``GET /turn/log`` is kept at
the end. Progress is a live line per class on a terminal (``rich``), nothing otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live

from loadtests.demo import plots
from loadtests.demo.report import side_by_side, write_records, write_report, write_result
from loadtests.demo.setup import servers
from loadtests.demo.workload import (
    ArmRun,
    DemoWorkload,
    direct_routes,
    new_run,
    proxy_routes,
    run_arm,
)
from loadtests.measures import ClassSummary, answer_mismatches, pct, summarize

DEFAULT_OUT = Path("artifacts/demo")
TIME_SCALE = 1.0
SAMPLE_INTERVAL_S = 0.5


@dataclass
class ArmResult:
    run: ArmRun
    commands: list[list[str]]
    turns: list[dict[str, Any]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoWorkload()
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="results go to OUT/<date-time>/"
    )
    parser.add_argument(
        "--duration", type=float, default=defaults.duration_s, help="seconds per arm"
    )
    parser.add_argument(
        "--warmup", type=float, default=defaults.warmup_s, help="seconds not counted"
    )
    parser.add_argument(
        "--time-scale", type=float, default=TIME_SCALE, help="the engines' --time-scale"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")


def run_demo(args: argparse.Namespace) -> int:
    """Run both arms, write the result directory, print the table; exit status 0."""
    workload = DemoWorkload(duration_s=args.duration, warmup_s=args.warmup, seed=args.seed)
    out = args.out / dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out.mkdir(parents=True)
    console = Console()
    arms = {}
    for arm in ("direct", "proxy"):
        console.print(
            f"[bold]{arm}[/bold]: starting two simulated engines"
            + (" and the proxy" if arm == "proxy" else "")
        )
        arms[arm] = asyncio.run(_arm(out, arm, workload, args.time_scale, console))
    summaries = {arm: _summaries(r.run, workload) for arm, r in arms.items()}
    answers = answer_mismatches(
        arms["direct"].run.chat + arms["direct"].run.batch,
        arms["proxy"].run.chat + arms["proxy"].run.batch,
    )
    table = side_by_side(summaries["direct"], summaries["proxy"])
    names = _plots(out, arms)
    write_records(
        out, {a: [r.to_json() for r in x.run.chat + x.run.batch] for a, x in arms.items()}
    )
    write_result(
        out,
        workload,
        time_scale=args.time_scale,
        commands={arm: r.commands for arm, r in arms.items()},
        summaries=summaries,
        answers=answers,
    )
    write_report(
        out, workload, time_scale=args.time_scale, table=table, answers=answers, plots=names
    )
    print(table)
    print(f"\nAnswer check: {answers[0]} compared, {answers[1]} differ.")
    print(f"Report: {out / 'report.md'}  plots: {', '.join(str(out / n) for n in names)}")
    return 0


def _summaries(run: ArmRun, workload: DemoWorkload) -> dict[str, ClassSummary]:
    start, end = run.window(workload)
    return {"chat": summarize(run.chat, start, end), "batch": summarize(run.batch, start, end)}


def _plots(out: Path, arms: dict[str, ArmResult]) -> list[str]:
    series = {}
    for arm, result in arms.items():
        for cls, records in (("chat", result.run.chat), ("batch", result.run.batch)):
            series[f"{cls}, {arm}"] = [t for r in records if (t := r.ttft) is not None]
    plots.ttft_plot(out / "ttft.png", series)
    plots.timeline_plot(out / "timeline.png", arms["proxy"].turns)
    return ["ttft.png", "timeline.png"]


async def _arm(
    out: Path, arm: str, workload: DemoWorkload, time_scale: float, console: Console
) -> ArmResult:
    via_proxy = arm == "proxy"
    with servers(out, arm, engines=2, time_scale=time_scale, via_proxy=via_proxy) as setup:
        routes = proxy_routes(setup.proxy) if setup.proxy else direct_routes(setup.engines)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        turns: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            run = new_run()
            async with _watch(http, setup.proxy, turns), _progress(console, arm, run):
                await run_arm(workload, routes, http, run)
            if setup.proxy:
                log = await http.get(f"{setup.proxy}/turn/log", params={"limit": 1000})
                (out / "turn-log.json").write_text(json.dumps(log.json(), indent=1))
    return ArmResult(run, setup.commands, turns)


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

    task = asyncio.create_task(sample()) if proxy else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def _progress(console: Console, arm: str, run: ArmRun) -> AsyncIterator[None]:
    """A live line per class on a terminal; nothing when not a terminal."""
    if not console.is_terminal:
        yield
        return
    with Live(console=console, refresh_per_second=4, transient=True) as live:

        async def refresh() -> None:
            while True:
                live.update(_line(arm, time.monotonic() - run.started_at, run))
                await asyncio.sleep(0.25)

        task = asyncio.create_task(refresh())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _line(arm: str, elapsed: float, run: ArmRun) -> str:
    ttft = [t for r in run.chat if (t := r.ttft) is not None]
    done = sum(1 for r in run.batch if r.valid)
    return (
        f"{arm}: {elapsed:4.0f} s  chat {len(ttft)} answered, TTFT p95 so far "
        f"{pct(ttft, 0.95) * 1000:,.0f} ms  batch {done} valid"
    )
