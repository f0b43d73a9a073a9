"""The demo's mixed workload, and one arm of it driven over HTTP.

Chat: Poisson arrivals (seeded) of short questions on a chat route, each a streamed
answer of ``chat_answer_tokens``. Beside it a batch job that keeps
``batch_concurrency`` long documents submitted at all times (a closed loop, as a batch
runner does), so the engines are saturated. Every prompt is real prose from Python's
documentation (:mod:`loadtests.corpus`), the same in every arm, each starting with its
own header so no prefix is shared. Sampling is greedy (temperature 0).

An arm is where the two classes go: :class:`Routes`. Direct, both classes go to the
engines' ``/v1`` in turn (round robin); through the proxy, chat goes to its ``/v1`` and
batch to its ``/batch/v1``. At the end of the run the batch streams still open are
closed (the client hangs up) and marked so: they count in no figure.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from loadtests.client import Record, close, stream
from loadtests.corpus import passage

MODEL = "tiny"


@dataclass(frozen=True, kw_only=True)
class DemoWorkload:
    """The demo's workload; durations in wall-clock seconds."""

    duration_s: float = 40.0
    warmup_s: float = 8.0
    chat_rate_per_s: float = 2.0
    chat_prompt_chars: int = 400
    chat_answer_tokens: int = 48
    batch_concurrency: int = 24
    batch_doc_chars: int = 16000
    batch_answer_tokens: int = 16
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Routes:
    """Where request ``i`` of each class goes: full URLs."""

    chat: Callable[[int], str]
    batch: Callable[[int], str]


def direct_routes(engines: list[str]) -> Routes:
    """Round robin over ``engines`` (base URLs) for both classes, on ``/v1``."""
    turn = itertools.count()

    def next_engine(_: int) -> str:
        return engines[next(turn) % len(engines)]

    return Routes(
        chat=lambda i: f"{next_engine(i)}/v1/chat/completions",
        batch=lambda i: f"{next_engine(i)}/v1/completions",
    )


def proxy_routes(proxy: str) -> Routes:
    """Chat on the proxy's ``/v1``, batch on its ``/batch/v1``."""
    return Routes(
        chat=lambda _: f"{proxy}/v1/chat/completions",
        batch=lambda _: f"{proxy}/batch/v1/completions",
    )


def chat_arrivals(workload: DemoWorkload) -> list[float]:
    """Seconds from the start at which chat requests are sent: Poisson, seeded."""
    rng = random.Random(workload.seed)
    times: list[float] = []
    t = rng.expovariate(workload.chat_rate_per_s)
    while t < workload.duration_s:
        times.append(t)
        t += rng.expovariate(workload.chat_rate_per_s)
    return times


def chat_body(workload: DemoWorkload, i: int) -> dict[str, Any]:
    text = passage(7919 * i, workload.chat_prompt_chars)
    question = f"Question {i}: in one paragraph, what does this say?\n\n{text}"
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": workload.chat_answer_tokens,
        "temperature": 0,
    }


def batch_body(workload: DemoWorkload, i: int) -> dict[str, Any]:
    text = passage(104729 * i, workload.batch_doc_chars)
    return {
        "model": MODEL,
        "prompt": f"Document {i}. Extract the names it defines.\n\n{text}",
        "max_tokens": workload.batch_answer_tokens,
        "temperature": 0,
    }


@dataclass
class ArmRun:
    """What one arm produced: its records, by class, and its clock."""

    started_at: float
    chat: list[Record]
    batch: list[Record]

    def window(self, workload: DemoWorkload) -> tuple[float, float]:
        """The measured window (monotonic seconds): after warm-up, to the end."""
        return self.started_at + workload.warmup_s, self.started_at + workload.duration_s


def new_run() -> ArmRun:
    """An empty run that starts now."""
    return ArmRun(time.monotonic(), [], [])


async def run_arm(
    workload: DemoWorkload, routes: Routes, http: httpx.AsyncClient, run: ArmRun
) -> ArmRun:
    """Drive ``workload`` over ``routes`` from ``run.started_at`` until its duration has
    passed, adding every record to ``run`` as it is sent; ``run``."""
    end = run.started_at + workload.duration_s
    open_batch: dict[str, asyncio.Task[Record]] = {}
    documents = itertools.count()
    chats = asyncio.create_task(_chats(workload, routes, http, run))
    workers = [
        asyncio.create_task(_batch_worker(workload, routes, http, run, documents, open_batch))
        for _ in range(workload.batch_concurrency)
    ]
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    for worker in workers:
        worker.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    for record in run.batch:
        task = open_batch.get(record.id)
        if task is not None:
            await close(record, task)
    await chats
    return run


async def _chats(
    workload: DemoWorkload, routes: Routes, http: httpx.AsyncClient, run: ArmRun
) -> None:
    tasks = []
    for i, at in enumerate(chat_arrivals(workload)):
        await asyncio.sleep(max(0.0, run.started_at + at - time.monotonic()))
        record = _record(f"chat-{i}", "new", routes.chat(i), workload.chat_answer_tokens)
        run.chat.append(record)
        tasks.append(asyncio.create_task(stream(http, record, chat_body(workload, i))))
    await asyncio.gather(*tasks)


async def _batch_worker(
    workload: DemoWorkload,
    routes: Routes,
    http: httpx.AsyncClient,
    run: ArmRun,
    documents: Iterator[int],
    open_batch: dict[str, asyncio.Task[Record]],
) -> None:
    while True:
        i = next(documents)
        record = _record(f"batch-{i}", "batch", routes.batch(i), workload.batch_answer_tokens)
        run.batch.append(record)
        task = asyncio.create_task(stream(http, record, batch_body(workload, i)))
        open_batch[record.id] = task
        await asyncio.shield(task)
        del open_batch[record.id]


def _record(id: str, kind: str, url: str, max_tokens: int) -> Record:
    return Record(
        id=id, kind=kind, url=url, prompt_tokens_sent=0, max_tokens=max_tokens, sent_at=0.0
    )
