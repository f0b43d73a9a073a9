"""A run's progress where stdout is not a terminal (CI, ``| tee``): plain lines as it
starts, every so often (phase, time, requests sent, done and failed) and as it ends;
on a terminal, the live lines and none of those."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import pytest
from rich.console import Console

from loadtests.harness.client import Record
from loadtests.harness.progress import phase, plain_line, progress
from loadtests.harness.traffic import new_run
from loadtests.harness.workload_file import Plan, Workload, parse_workload
from tests.support.workloads import chat_class

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

PLAN = Plan(duration_s=40.0, warmup_s=5.0)


def _workload() -> Workload:
    chat = chat_class({"process": "periodic", "rate": 2}, chars=200, max_tokens=4)
    data = {"plan": {"duration_s": 40, "warmup_s": 5}, "classes": {"chat": chat}}
    return parse_workload(data, base=Path("."))


def _record(n: int, *, done: bool, error: str | None = None) -> Record:
    record = Record(f"chat-{n}", "chat", "http://s.test/v1/chat/completions", 0, 4, 0.0)
    record.finished_at = time.monotonic() if done else None
    record.error = error
    return record


class Ticks:
    """A stand-in for ``asyncio.sleep`` between plain lines: the first wait returns at
    once (a line is printed), the next one sets :attr:`printed` and waits for good."""

    def __init__(self) -> None:
        self.printed = asyncio.Event()
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        if len(self.waits) > 1:
            self.printed.set()
            await asyncio.Event().wait()


async def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=60)
    workload = _workload()
    run = new_run(workload)
    ticks = Ticks()
    async with progress(console, "proxy (warm 1/3)", run, [], workload.plan, sleep=ticks):
        run.records["chat"] += [
            _record(0, done=True),
            _record(1, done=True, error="ConnectError: refused"),
            _record(2, done=False),
        ]
        await ticks.printed.wait()
    lines = out.getvalue().splitlines()
    assert ticks.waits[0] == 10.0  # every 10 s by default
    assert lines[0] == "proxy (warm 1/3): started, 40 s planned (5 s warm-up)"
    assert lines[1].startswith("proxy (warm 1/3): 0 s of 40, warm-up: ")
    assert lines[1].endswith("3 sent, 2 done, 1 failed")  # one line, however narrow
    assert lines[2].startswith("proxy (warm 1/3): done after 0 s: 3 sent, 2 done, 1 failed")
    assert len(lines) == 3
    assert "\x1b[" not in out.getvalue()  # plain text, no terminal codes


async def test_no_plain_lines_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True)
    workload = _workload()
    run = new_run(workload)
    ticks = Ticks()
    async with progress(console, "proxy (warm 1/3)", run, [], workload.plan, sleep=ticks):
        pass
    assert "started," not in out.getvalue() and "done after" not in out.getvalue()
    assert ticks.waits == []


def test_a_line_names_the_phase() -> None:
    run = new_run(_workload())
    assert phase(4.9, PLAN) == "warm-up"
    assert phase(5.0, PLAN) == "measured"
    assert phase(41.0, PLAN) == "drain"
    assert plain_line("direct (cold)", 20.2, run, PLAN) == (
        "direct (cold): 20 s of 40, measured: 0 sent, 0 done, 0 failed"
    )
