"""One arm's traffic: a workload (:mod:`loadtests.harness.workload_file`) driven over
HTTP against one arm, every request recorded (:class:`loadtests.harness.client.Record`).

Every traffic class runs at once: an open-loop class sends at its arrival times
(:mod:`loadtests.harness.arrivals`, seeded), a closed-loop class keeps ``concurrency``
requests outstanding, sending the next as one finishes. Prompts are real prose from
Python's documentation (:mod:`loadtests.harness.corpus`), the same in every arm for the same
seed, each starting with its own header so no two share a prefix.

An arm is where requests go (:data:`Route`). Direct, every class goes to the engines'
``/v1`` in turn (round robin); through a proxy, a ``chat`` route goes to its ``/v1``
and a ``batch`` route to its ``/batch/v1``. At the end of a run the closed-loop
streams still open are closed (the client hangs up) and marked so: they count in no
figure. Open-loop requests are waited for.

A ``batch-api`` class submits jobs to the proxy's Files and Batch API instead
(:func:`run_job`): each job a JSONL file of ``job_lines`` requests made as any other
class's, uploaded, a batch created, looked at every ``poll_s``, and at its end its
output file read and every line judged as a streamed answer is (whole, and following
its prompt's JSON schema when it carries one: :mod:`loadtests.harness.validity`). A job still
running at the end of the run is cancelled, and its partial output counted. There is
no Batch API on an engine: the direct arm sends such a class nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtests.harness.arrivals import gamma_times, periodic_times, trace_times
from loadtests.harness.client import Record, close, stream
from loadtests.harness.corpus import SETS, answer_schema, as_prompt, messages
from loadtests.harness.validity import assess
from loadtests.harness.workload_file import TrafficClass, Workload

Route = Callable[[TrafficClass], str]
"""The full URL of a class's next request."""

PATHS = {"chat": "/chat/completions", "completions": "/completions"}


def direct_route(engines: list[str]) -> Route:
    """Round robin over ``engines`` (base URLs) for every class, on ``/v1``."""
    turn = itertools.count()
    return lambda cls: f"{engines[next(turn) % len(engines)]}/v1{PATHS[cls.api]}"


def proxy_route(proxy: str) -> Route:
    """A ``chat`` route to the proxy's ``/v1``, a ``batch`` route to its ``/batch/v1``."""
    prefixes = {"chat": "/v1", "batch": "/batch/v1"}
    return lambda cls: f"{proxy}{prefixes[cls.route]}{PATHS[cls.api]}"


def send_times(workload: Workload, cls: TrafficClass) -> list[float]:
    """An open-loop class's send times, seconds from the start of a run."""
    a, duration = cls.arrival, workload.plan.duration_s
    if a.process == "closed":
        raise ValueError(f"{cls.name}: a closed loop has no send times")
    if a.process == "trace":
        assert a.trace is not None
        return trace_times(a.trace, duration)
    if a.process == "periodic":
        return periodic_times(a.rate, duration)
    return gamma_times(
        a.rate, a.burstiness, duration, workload.seed + zlib.crc32(cls.name.encode())
    )


def body(workload: Workload, cls: TrafficClass, i: int, run: int = 0) -> dict[str, Any]:
    """Request ``i`` of ``cls`` in run ``run`` of an arm: its prompt source's messages
    (:func:`messages`), the first starting with a header of its own so no two
    requests share a prefix, not even the same request of an earlier run (an engine
    that caches prefixes, vLLM's default, would otherwise answer a warm run's
    prompts from its cache). Every arm's run ``run`` sends the same requests."""
    chat = messages(cls.prompt_source, i, _start(workload, cls, i), cls.prompt_chars)
    passage = SETS[cls.prompt_source][0] in ("topics", "documents")
    name = f"{cls.name} {i}" if run == 0 else f"{cls.name} {i} (run {run})"
    header = f"{name}: what does this say?" if passage else f"{name}."
    chat[0] = {**chat[0], "content": f"{header}\n\n{chat[0]['content']}"}
    out: dict[str, Any] = {
        "model": cls.model or workload.model,
        "max_tokens": cls.max_tokens,
        "temperature": cls.temperature,
    }
    if cls.api == "chat":
        out["messages"] = chat
    else:
        out["prompt"] = as_prompt(chat)
    return out


def _start(workload: Workload, cls: TrafficClass, i: int) -> int:
    seed = workload.seed * 1_000_003 + zlib.crc32(cls.name.encode())
    return seed + 104_729 * i if cls.prompt_chars is not None else seed


def schema(workload: Workload, cls: TrafficClass, i: int) -> dict[str, Any] | None:
    """The JSON schema request ``i`` of ``cls`` asks its answer to follow, if any."""
    return answer_schema(cls.prompt_source, i, _start(workload, cls, i))


TERMINAL = ("completed", "failed", "expired", "cancelled")
CANCEL_WAIT_S = 60.0


@dataclass
class Job:
    """One Batch API job as the client saw it (monotonic seconds)."""

    id: str
    kind: str
    lines: int
    submitted_at: float
    batch_id: str | None = None
    finished_at: float | None = None
    status: str | None = None
    completed: int = 0  # lines answered (output file), of ``lines``
    failed: int = 0
    valid: int = 0  # whole and, with a schema, schema-valid (loadtests.harness.validity)
    whole: int = 0  # answered whole: status 200, exactly max_tokens tokens
    schema_checked: int = 0  # whole lines whose prompt carries a schema
    schema_valid: int = 0  # of those, the ones that follow it
    tokens: int = 0  # prompt and completion tokens of the answered lines (their usage)
    cancelled_by_client: bool = False
    error: str | None = None
    tenant: str = ""  # the tenant that submitted it ("" none)

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


@dataclass
class ArmRun:
    """One run of a workload against one arm: the records by class, and its clock."""

    started_at: float
    records: dict[str, list[Record]] = field(default_factory=dict)
    jobs: dict[str, list[Job]] = field(default_factory=dict)
    priority: dict[str, int] = field(default_factory=dict)  # class: the arm's request priority
    ended_at: float | None = None  # when its last request ended (after the drain)
    number: int = 0  # the run's place in the arm's plan (0: the first)

    def body(self, workload: Workload, cls: TrafficClass, i: int) -> dict[str, Any]:
        """:func:`body` in this run, with the arm's priority for the class if it sets
        one."""
        out = body(workload, cls, i, self.number)
        if cls.name in self.priority:
            out["priority"] = self.priority[cls.name]
        return out

    def window(self, workload: Workload) -> tuple[float, float]:
        """The window of the latencies (monotonic seconds): after warm-up, to the end.
        Throughput is counted over the whole run: every arm starts empty, and a closed
        loop's completions come in waves that a shorter window cuts unevenly."""
        plan = workload.plan
        return self.started_at + plan.warmup_s, self.started_at + plan.duration_s


def new_run(workload: Workload, priority: dict[str, int] | None = None, number: int = 0) -> ArmRun:
    """An empty run that starts now; ``priority``: the arm's request priorities;
    ``number``: the run's place in the arm's plan."""
    return ArmRun(
        time.monotonic(),
        {cls.name: [] for cls in workload.classes},
        {cls.name: [] for cls in workload.classes if cls.route == "batch-api"},
        dict(priority or {}),
        number=number,
    )


async def run_arm(
    workload: Workload,
    route: Route,
    http: httpx.AsyncClient,
    run: ArmRun,
    batch_api: str | None = None,
) -> ArmRun:
    """Drive ``workload`` over ``route`` from ``run.started_at`` for the plan's
    duration, adding every record to ``run`` as it is sent; ``run``. ``batch_api``:
    the proxy's base URL for ``batch-api`` classes (None: they send nothing)."""
    end = run.started_at + workload.plan.duration_s
    open_streams: dict[str, asyncio.Task[Record]] = {}
    senders, workers, jobs = [], [], []
    for cls in workload.classes:
        if cls.route == "batch-api":
            if batch_api is not None:
                jobs.append(asyncio.create_task(_jobs(workload, cls, batch_api, http, run, end)))
        elif cls.arrival.process == "closed":
            counter = itertools.count()
            workers += [
                asyncio.create_task(_worker(workload, cls, route, http, run, counter, open_streams))
                for _ in range(cls.arrival.concurrency)
            ]
        else:
            senders.append(asyncio.create_task(_open_loop(workload, cls, route, http, run)))
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    for worker in workers:
        worker.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    for records in run.records.values():
        for record in records:
            task = open_streams.get(record.id)
            if task is not None:
                await close(record, task)
    await asyncio.gather(*senders, *jobs)
    run.ended_at = time.monotonic()
    return run


async def _jobs(
    workload: Workload,
    cls: TrafficClass,
    base: str,
    http: httpx.AsyncClient,
    run: ArmRun,
    end: float,
) -> None:
    """A batch-api class's jobs: ``concurrency`` at once (closed), or one per arrival."""
    counter = itertools.count()

    async def one(i: int) -> None:
        job = Job(f"{cls.name}-{i}", cls.name, cls.job_lines, time.monotonic(), tenant=cls.tenant)
        run.jobs[cls.name].append(job)
        priority = run.priority.get(cls.name)
        await run_job(http, base, workload, cls, i, job, end, priority, run.number)

    if cls.arrival.process == "closed":

        async def loop() -> None:
            while time.monotonic() < end:
                await one(next(counter))
                if run.jobs[cls.name][-1].error is not None:
                    await asyncio.sleep(cls.poll_s)  # no tight loop of refused jobs

        await asyncio.gather(*(loop() for _ in range(cls.arrival.concurrency)))
        return
    tasks = []
    for i, at in enumerate(send_times(workload, cls)):
        await asyncio.sleep(max(0.0, run.started_at + at - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)


def job_file(
    workload: Workload, cls: TrafficClass, i: int, priority: int | None = None, run: int = 0
) -> bytes:
    """Job ``i``'s input file: ``job_lines`` requests, each made as :func:`body` makes
    request ``i * job_lines + k`` of the class in run ``run``."""
    lines = []
    for k in range(cls.job_lines):
        n = i * cls.job_lines + k
        lines.append(
            {
                "custom_id": f"{cls.name}-{n}",
                "method": "POST",
                "url": f"/v1{PATHS[cls.api]}",
                "body": body(workload, cls, n, run)
                | ({} if priority is None else {"priority": priority}),
            }
        )
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@dataclass(frozen=True)
class OutputCount:
    """A job's output file judged line by line (:mod:`loadtests.harness.validity`)."""

    answered: int = 0  # lines with a response
    whole: int = 0
    schema_checked: int = 0  # whole answers whose prompt carries a schema
    schema_valid: int = 0
    valid: int = 0  # whole and, with a schema, schema-valid
    tokens: int = 0  # prompt and completion tokens of the answers (their usage)


def count_output(
    text: str, max_tokens: int, schemas: dict[str, dict[str, Any] | None] | None = None
) -> OutputCount:
    """A job's output file counted: every line with a response judged as a streamed
    answer is (:func:`loadtests.harness.validity.assess`), its prompt's schema looked up by
    ``custom_id`` in ``schemas`` (none: no schema)."""
    answered = whole = checked = schema_valid = valid = tokens = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        response = row.get("response") or {}
        answered += 1
        answer = response.get("body") or {}
        usage = answer.get("usage") or {}
        tokens += int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        choice = (answer.get("choices") or [{}])[0]
        verdict = assess(
            status=response.get("status_code"),
            error=None,
            finish_reason=choice.get("finish_reason"),
            completion_tokens=usage.get("completion_tokens"),
            max_tokens=max_tokens,
            text=_answer_text(choice),
            schema=(schemas or {}).get(row.get("custom_id", "")),
        )
        whole += verdict.whole
        checked += verdict.schema_valid is not None
        schema_valid += verdict.schema_valid is True
        valid += verdict.valid
    return OutputCount(answered, whole, checked, schema_valid, valid, tokens)


def _answer_text(choice: dict[str, Any]) -> str:
    message = choice.get("message") or {}
    text = message.get("content") if isinstance(message, dict) else None
    return str(text if text is not None else choice.get("text") or "")


async def run_job(
    http: httpx.AsyncClient,
    base: str,
    workload: Workload,
    cls: TrafficClass,
    i: int,
    job: Job,
    end: float,
    priority: int | None = None,
    run: int = 0,
) -> Job:
    """Upload job ``i``'s file, create the batch, look at it every ``poll_s`` until it
    ends (cancelling it at ``end``), then count its output; ``job``. Every call
    carries the class's tenant's key, if it has one."""
    headers = workload.headers(cls)
    try:
        files = {"file": (f"{job.id}.jsonl", job_file(workload, cls, i, priority, run))}
        uploaded = await http.post(
            f"{base}/v1/files", files=files, data={"purpose": "batch"}, headers=headers
        )
        uploaded.raise_for_status()
        created = await http.post(
            f"{base}/v1/batches",
            headers=headers,
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": f"/v1{PATHS[cls.api]}",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch = created.json()
        job.batch_id = batch["id"]
        give_up = end + CANCEL_WAIT_S
        while batch["status"] not in TERMINAL and time.monotonic() < give_up:
            if time.monotonic() >= end and not job.cancelled_by_client:
                job.cancelled_by_client = True
                await http.post(f"{base}/v1/batches/{job.batch_id}/cancel", headers=headers)
            await asyncio.sleep(cls.poll_s)
            batch = (await http.get(f"{base}/v1/batches/{job.batch_id}", headers=headers)).json()
        job.status = batch["status"]
        job.finished_at = time.monotonic()
        job.failed = int((batch.get("request_counts") or {}).get("failed", 0))
        if batch.get("output_file_id"):
            content = await http.get(
                f"{base}/v1/files/{batch['output_file_id']}/content", headers=headers
            )
            schemas = {
                f"{cls.name}-{n}": schema(workload, cls, n)
                for n in range(i * cls.job_lines, (i + 1) * cls.job_lines)
            }
            counted = count_output(content.text, cls.max_tokens, schemas)
            job.completed, job.valid = counted.answered, counted.valid
            job.whole, job.schema_checked = counted.whole, counted.schema_checked
            job.schema_valid, job.tokens = counted.schema_valid, counted.tokens
    except httpx.HTTPStatusError as exc:
        job.error = f"{exc.response.status_code}: {exc.response.text}"[:500]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        job.error = f"{type(exc).__name__}: {exc}"[:500]
    return job


async def _open_loop(
    workload: Workload, cls: TrafficClass, route: Route, http: httpx.AsyncClient, run: ArmRun
) -> None:
    tasks = []
    for i, at in enumerate(send_times(workload, cls)):
        await asyncio.sleep(max(0.0, run.started_at + at - time.monotonic()))
        record = _record(cls, i, route(cls), schema(workload, cls, i))
        run.records[cls.name].append(record)
        sent = stream(http, record, run.body(workload, cls, i), workload.headers(cls))
        tasks.append(asyncio.create_task(sent))
    await asyncio.gather(*tasks)


async def _worker(
    workload: Workload,
    cls: TrafficClass,
    route: Route,
    http: httpx.AsyncClient,
    run: ArmRun,
    counter: Iterator[int],
    open_streams: dict[str, asyncio.Task[Record]],
) -> None:
    while True:
        i = next(counter)
        record = _record(cls, i, route(cls), schema(workload, cls, i))
        run.records[cls.name].append(record)
        sent = stream(http, record, run.body(workload, cls, i), workload.headers(cls))
        task = asyncio.create_task(sent)
        open_streams[record.id] = task
        await asyncio.shield(task)
        del open_streams[record.id]


def _record(cls: TrafficClass, i: int, url: str, answer: dict[str, Any] | None) -> Record:
    return Record(
        id=f"{cls.name}-{i}",
        kind=cls.name,
        url=url,
        prompt_tokens_sent=0,
        max_tokens=cls.max_tokens,
        sent_at=0.0,
        schema=answer,
        tenant=cls.tenant,
    )
