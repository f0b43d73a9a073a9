"""``request_counts.valid`` and ``invalid`` count every completed line, whatever it
asked for: plain completions and plain chat lines included (they were 0 and 0,
since only lines with a ``response_format`` were judged), and vLLM's own
structured-output fields checked as OpenAI's are. Through the runner, on both
stores, on the batch object and the records counter."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from proxy.batch.lines import quality, read_lines
from proxy.batch.postgres import PostgresStore
from proxy.batch.runner import BatchRunner, RunnerLimits
from proxy.batch.shapes import batch_object
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchStore, NewBatch
from proxy.metrics import BatchMetrics
from proxy.openai.answers import Answer
from proxy.openai.request import ChatRequest

pytestmark = pytest.mark.anyio
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
SCHEMA = {"type": "object", "required": ["a"]}


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BatchStore]:
    s: BatchStore
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    else:
        s = PostgresStore(request.getfixturevalue("postgres_db"), lambda: 1000.0, pool_size=4)
    await s.open()
    yield s
    await s.close()


def line(custom_id: str, endpoint: str, **extra: Any) -> dict[str, Any]:
    if endpoint == CHAT:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **extra}
    else:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}


def completion(text: str) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def chat(text: str | None) -> dict[str, Any]:
    return {"object": "chat.completion", "choices": [{"message": {"content": text}}]}


async def run_job(
    store: BatchStore, endpoint: str, lines: list[dict[str, Any]], answers: dict[str, Answer]
) -> tuple[dict[str, Any], dict[str, float]]:
    """The job run to its end, each line answered ``answers[custom_id]``: its batch
    object's ``request_counts`` and the records counter by status."""
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    await store.add_batch(NewBatch("batch_1", endpoint, "file-x", "24h", 86400, None))
    await store.fill_batch("batch_1", read_lines(io.BytesIO(data), endpoint, 1000))

    async def complete(req: ChatRequest, job_id: str) -> Answer:
        return answers[job_id.split("/")[1]]

    metrics = BatchMetrics()
    limits = RunnerLimits(window=4, max_attempts=1, poll_s=0.01)
    runner = BatchRunner(store, complete, metrics, limits, lambda: 1000.0)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(runner.run)
            while True:
                batch = await store.get_batch("batch_1")
                if batch is not None and batch.status == "completed":
                    break
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    records = {
        sample.labels["status"]: sample.value
        for family in metrics.collect()
        for sample in family.samples
        if sample.name == "whoseturn_batch_records_total"
    }
    return batch_object(batch)["request_counts"], records


async def test_plain_completions_are_counted_valid(store: BatchStore) -> None:
    lines = [line(f"c{i}", COMPLETIONS) for i in range(6)]
    answers = {f"c{i}": Answer.of(200, completion(f" answer {i}")) for i in range(6)}
    answers["c5"] = Answer.of(500, {"error": {"message": "engine down"}})
    counts, records = await run_job(store, COMPLETIONS, lines, answers)
    assert counts == {"total": 6, "completed": 5, "failed": 1, "valid": 5, "invalid": 0}
    assert (records["valid"], records["invalid"], records["completed"]) == (5, 0, 5)


async def test_plain_chat_lines_are_counted_and_an_answer_with_no_completion_is_invalid(
    store: BatchStore,
) -> None:
    lines = [line(f"c{i}", CHAT) for i in range(4)]
    answers = {
        "c0": Answer.of(200, chat("hello")),
        "c1": Answer.of(200, chat(None)),  # tool calls, no text: still an answer
        "c2": Answer.of(200, chat("")),
        "c3": Answer.of(200, {"object": "chat.completion", "choices": []}),
    }
    counts, _ = await run_job(store, CHAT, lines, answers)
    assert counts == {"total": 4, "completed": 4, "failed": 0, "valid": 3, "invalid": 1}


async def test_completions_with_vllms_structured_output_are_checked(store: BatchStore) -> None:
    lines = [
        line("json-ok", COMPLETIONS, guided_json=SCHEMA),
        line("json-bad", COMPLETIONS, guided_json=SCHEMA),
        line("choice-ok", COMPLETIONS, structured_outputs={"choice": ["yes", "no"]}),
        line("choice-bad", COMPLETIONS, structured_outputs={"choice": ["yes", "no"]}),
        line("format-ok", COMPLETIONS, response_format={"type": "json_object"}),
    ]
    answers = {
        "json-ok": Answer.of(200, completion('{"a": 1}')),
        "json-bad": Answer.of(200, completion('{"b": 1}')),
        "choice-ok": Answer.of(200, completion("yes")),
        "choice-bad": Answer.of(200, completion("maybe")),
        "format-ok": Answer.of(200, completion("{}")),
    }
    counts, records = await run_job(store, COMPLETIONS, lines, answers)
    assert counts == {"total": 5, "completed": 5, "failed": 0, "valid": 3, "invalid": 2}
    assert (records["valid"], records["invalid"]) == (3, 2)


@pytest.mark.parametrize(
    ("asked", "answer", "expected"),
    [
        ({}, completion(""), "valid"),  # an empty completion is still one
        ({}, {"choices": [{"index": 0}]}, "invalid"),  # a choice with no text
        ({}, {}, "invalid"),
        ({"response_format": {"type": "text"}}, chat("plain"), "valid"),
        ({"response_format": {"type": "json_object"}}, chat(None), "invalid"),
        ({"guided_json": json.dumps(SCHEMA)}, completion('{"a": 2}'), "valid"),  # as text
        ({"guided_json": None}, completion("not json"), "valid"),  # null: nothing asked
        ({"structured_outputs": {"json": SCHEMA}}, completion("[]"), "invalid"),
        ({"guided_regex": "[0-9]+"}, completion("123"), "valid"),
        ({"guided_regex": "[0-9]+"}, completion("123 apples"), "invalid"),  # the whole text
        ({"guided_regex": "("}, completion("anything"), "valid"),  # not Python's: unchecked
        ({"guided_choice": ["a", "b"]}, chat("b"), "valid"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, completion("x"), "valid"),
    ],
)
def test_an_answer_is_judged_by_what_its_line_asked(
    asked: dict[str, Any], answer: dict[str, Any], expected: str
) -> None:
    assert quality(asked, answer) == expected
