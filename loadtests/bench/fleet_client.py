"""The fleet benchmark's client (:mod:`loadtests.bench.fleet`): one phase of a workload
(:mod:`loadtests.bench.fleet_workloads`) sent to one arm, and what it saw.

Chats are streamed (:func:`loadtests.harness.client.stream`, which times the first
token as a user sees it), each chat's turns one after the other, every chat started
at its own time. A workload's batch lines go, on the proxy's arms, through its Batch
API (a JSONL file uploaded to ``/v1/files``, a job created at ``/v1/batches``, looked
at every :data:`POLL_S` until it ends, its output file judged line by line:
:func:`loadtests.harness.traffic.count_output`), as a pipeline uses the proxy; on the
router arms, which have no Batch API, the client sends them itself as a batch
client would: plain (non-streaming) requests, in file order, ``concurrency`` at a
time, each answer judged the same way (:func:`loadtests.harness.validity.assess`).

Where there is a batch, the chat figures count only the chats sent while it ran
(beside it), and the makespan is the batch's: from its submission to its last line.

Nothing is sent after ``deadline_s``: a chat stops between turns, a line is not
taken, a job still running is cancelled and its partial output counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtests.bench.fleet_figures import Outcome
from loadtests.bench.fleet_workloads import Chat, Line, Workload
from loadtests.harness.client import Record, stream
from loadtests.harness.traffic import TERMINAL, count_output
from loadtests.harness.validity import assess

POLL_S = 0.25
CHAT_PATH = "/v1/chat/completions"


@dataclass
class _Batch:
    """Batch lines counted as they come back."""

    lines: int = 0
    valid: int = 0
    prompt_tokens: int = 0
    seconds: float | None = None
    errors: list[str] = field(default_factory=list)


async def run_phase(
    base_url: str,
    workload: Workload,
    *,
    model: str,
    batch_api: bool,
    concurrency: int,
    deadline_s: float,
) -> Outcome:
    """Send ``workload`` to the arm at ``base_url`` and wait for every answer."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        records: list[Record] = []
        batch = _Batch(lines=len(workload.lines))
        tasks = [
            _chat(http, base_url, chat, t0, deadline, workload.chat_max_tokens, model, records)
            for chat in workload.chats
        ]
        if workload.lines and batch_api:
            tasks.append(_batch_api(http, base_url, workload, model, deadline, batch))
        elif workload.lines:
            tasks.append(
                _batch_direct(http, base_url, workload, model, concurrency, deadline, batch)
            )
        await asyncio.gather(*tasks)
    ends = [r.finished_at for r in records if r.finished_at is not None]
    makespan = batch.seconds if batch.seconds is not None else max(ends, default=t0) - t0
    failed = [r for r in records if not _answered(r)]
    errors = [r.error or f"status {r.status}" for r in failed] + batch.errors
    beside = [r for r in records if batch.seconds is None or r.sent_at < t0 + batch.seconds]
    return Outcome(
        ttfts_s=tuple(r.ttft for r in beside if r.ttft is not None and _answered(r)),
        chat_requests=len(beside),
        chat_failed=len(failed),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in records) + batch.prompt_tokens,
        makespan_s=makespan,
        lines=batch.lines,
        valid_lines=batch.valid,
        batch_s=batch.seconds,
        first_error=errors[0][:300] if errors else None,
    )


def _answered(record: Record) -> bool:
    return record.status == 200 and record.error is None and bool(record.token_times)


async def _chat(
    http: httpx.AsyncClient,
    base_url: str,
    chat: Chat,
    t0: float,
    deadline: float,
    max_tokens: int,
    model: str,
    records: list[Record],
) -> None:
    """One chat's turns, each after the answer to the one before and a pause."""
    await asyncio.sleep(max(0.0, t0 + chat.start_s - time.monotonic()))
    for turn in range(len(chat.turns)):
        if time.monotonic() >= deadline:
            return
        record = Record(
            id=f"{chat.id}-{turn}",
            kind="new",
            url=base_url + CHAT_PATH,
            prompt_tokens_sent=0,
            max_tokens=max_tokens,
            sent_at=0.0,
        )
        records.append(record)
        body = {"model": model, "messages": chat.messages(turn), "max_tokens": max_tokens}
        await stream(http, record, body)
        if turn + 1 < len(chat.turns):
            await asyncio.sleep(chat.think_s[turn])


def line_body(line: Line, model: str, max_tokens: int) -> dict[str, Any]:
    """A batch line's request body (the same on every arm)."""
    messages = [{"role": "user", "content": line.content}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens}


async def _batch_direct(
    http: httpx.AsyncClient,
    base_url: str,
    workload: Workload,
    model: str,
    concurrency: int,
    deadline: float,
    batch: _Batch,
) -> None:
    """The lines as plain requests, ``concurrency`` at a time, in file order."""
    t0 = time.monotonic()
    lines: Iterator[Line] = iter(workload.lines)  # shared: each line is taken once

    async def worker() -> None:
        for line in lines:
            if time.monotonic() >= deadline:
                return
            body = line_body(line, model, workload.line_max_tokens)
            status: int | None = None
            answer: dict[str, Any] = {}
            error: str | None = None
            try:
                response = await http.post(base_url + CHAT_PATH, json=body)
                status = response.status_code
                if status == 200:
                    answer = response.json()
                else:
                    error = f"status {status}: {response.text[:300]}"
            except (httpx.HTTPError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            _count(batch, status, answer, error, workload)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    batch.seconds = time.monotonic() - t0


def _count(
    batch: _Batch, status: int | None, answer: dict[str, Any], error: str | None, workload: Workload
) -> None:
    choice = (answer.get("choices") or [{}])[0]
    usage = answer.get("usage") or {}
    verdict = assess(
        status=status,
        error=error,
        finish_reason=choice.get("finish_reason"),
        completion_tokens=usage.get("completion_tokens"),
        max_tokens=workload.line_max_tokens,
        text=str((choice.get("message") or {}).get("content") or ""),
        schema=None,
    )
    batch.valid += verdict.valid
    batch.prompt_tokens += int(usage.get("prompt_tokens") or 0)
    if error is not None:
        batch.errors.append(error)


async def _batch_api(
    http: httpx.AsyncClient,
    base_url: str,
    workload: Workload,
    model: str,
    deadline: float,
    batch: _Batch,
) -> None:
    """The lines as one job of the proxy's Batch API."""
    t0 = time.monotonic()
    rows = [
        {
            "custom_id": line.custom_id,
            "method": "POST",
            "url": CHAT_PATH,
            "body": line_body(line, model, workload.line_max_tokens),
        }
        for line in workload.lines
    ]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    try:
        uploaded = await http.post(
            base_url + "/v1/files",
            files={"file": (f"{workload.name}.jsonl", data)},
            data={"purpose": "batch"},
        )
        uploaded.raise_for_status()
        created = await http.post(
            base_url + "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": CHAT_PATH,
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        job = created.json()
        cancelled = False
        while job["status"] not in TERMINAL:
            if time.monotonic() >= deadline and not cancelled:
                cancelled = True
                await http.post(f"{base_url}/v1/batches/{job['id']}/cancel")
            await asyncio.sleep(POLL_S)
            job = (await http.get(f"{base_url}/v1/batches/{job['id']}")).json()
        batch.seconds = time.monotonic() - t0
        if job["status"] != "completed":
            batch.errors.append(f"batch job {job['status']}")
        if job.get("output_file_id"):
            output = await http.get(f"{base_url}/v1/files/{job['output_file_id']}/content")
            batch.valid = count_output(output.text, workload.line_max_tokens).valid
            batch.prompt_tokens = _prompt_tokens(output.text)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        batch.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        batch.seconds = batch.seconds or time.monotonic() - t0


def _prompt_tokens(output: str) -> int:
    """``usage.prompt_tokens`` summed over a Batch API output file's lines."""
    total = 0
    for text in output.splitlines():
        if text.strip():
            body = (json.loads(text).get("response") or {}).get("body") or {}
            total += int((body.get("usage") or {}).get("prompt_tokens") or 0)
    return total
