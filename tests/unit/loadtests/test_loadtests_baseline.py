"""The baseline workload's repetition: the running chat stays open through the whole
of the batch's prefill and is then closed by the client, so that its gaps always
measure what the batch did to it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from loadtests.compare.arms import Repetition, _rerun_reason
from loadtests.compare.baseline import Prompts, Workload, run_once
from loadtests.harness.client import Record
from loadtests.harness.corpus import Prompt

Json = dict[str, Any]
WORKLOAD = Workload(
    running_answer_tokens=4000,
    batch_prompts=2,
    batch_answer_tokens=3,
    new_chats_after_s=(0.01, 0.02),
    new_chat_answer_tokens=2,
    running_tokens_before_batch=2,
)
PROMPTS = Prompts(
    running=[{"role": "user", "content": "go on"}],
    running_tokens=7,
    batch=[Prompt("doc one", 100), Prompt("doc two", 100)],
    new_chats=[[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
)


def sse(data: Json) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


class Engine:
    """A fake engine: the long chat streams a token every millisecond until the client
    closes it; a batch prompt's first token comes after ``prefill_s`` (the second
    prompt's twice as late); short chats answer at once."""

    def __init__(self, prefill_s: float) -> None:
        self.prefill_s = prefill_s
        self.batch_seen = 0
        self.running_closed = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["max_tokens"] == WORKLOAD.running_answer_tokens:
            content = self._endless()
        elif "prompt" in body:
            self.batch_seen += 1
            content = self._answer(body["max_tokens"], self.prefill_s * self.batch_seen)
        else:
            content = self._answer(body["max_tokens"], 0.0)
        return httpx.Response(200, content=content)

    async def _endless(self) -> AsyncIterator[bytes]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield sse({"choices": [{"index": 0, "delta": {"content": "x"}}]})
        finally:
            self.running_closed = True

    async def _answer(self, tokens: int, first_after_s: float) -> AsyncIterator[bytes]:
        await asyncio.sleep(first_after_s)
        for i in range(tokens):
            finish = "length" if i == tokens - 1 else None
            yield sse({"choices": [{"index": 0, "text": "y", "finish_reason": finish}]})
        yield sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens}})
        yield b"data: [DONE]\n\n"


async def repetition(engine: Engine) -> tuple[list[Record], float]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as http:
        return await run_once(
            http, "http://e/v1", "http://e/v1", PROMPTS, WORKLOAD,
            model="tiny", priorities=False, tag="t",
        )  # fmt: skip


@pytest.mark.anyio
@pytest.mark.timeout(10)
@pytest.mark.parametrize("prefill_s", [0.05, 0.3])
async def test_the_running_chat_is_closed_once_every_batch_prompt_is_prefilled(
    prefill_s: float,
) -> None:
    engine = Engine(prefill_s)
    records, batch_at = await repetition(engine)
    running, *batch = (r for r in records if r.kind in ("running", "batch"))
    last_first = max(r.token_times[0] for r in batch)
    assert last_first - batch_at >= 2 * prefill_s
    assert running.closed_at is not None
    assert running.closed_at >= last_first
    # ... and not long after: the stream is not kept open for its 4,000 tokens
    assert running.closed_at - last_first < 1.0
    assert len(running.token_times) < WORKLOAD.running_answer_tokens
    assert engine.running_closed
    assert all(r.valid for r in records), [r.id for r in records if not r.valid]
    rep = Repetition("fcfs", 1, batch_at, records, [], None, None)
    assert rep.overlapped
    assert _rerun_reason(rep, 0.0) is None


def test_a_closed_stream_is_valid_only_with_tokens_and_no_error() -> None:
    r = Record("r", "running", "u", 7, 4000, 0.0, status=200, token_times=[0.1], closed_at=1.0)
    assert r.valid
    for broken in ({"token_times": []}, {"error": "boom"}, {"status": 500}):
        assert not Record(**{**r.__dict__, **broken}).valid


def test_a_repetition_is_run_again_for_a_stop_or_for_missing_evidence() -> None:
    batch = Record("b", "batch", "u", 9, 3, 0.0, token_times=[2.0])
    ran = Record("r", "running", "u", 7, 4000, 0.0, token_times=[0.1, 1.0], closed_at=3.0)
    rep = Repetition("fcfs", 1, 0.0, [ran, batch], [], None, None)
    assert _rerun_reason(rep, 0.1) is None
    assert _rerun_reason(rep, 0.5) == "the machine stopped for 0.50 s"
    ran.closed_at = None  # ended on its own at 1.0 s, before the batch's first token
    reason = _rerun_reason(rep, 0.0)
    assert reason == "the running stream did not overlap the batch's prefill"


def test_the_replay_takes_a_closed_streams_prompt_as_sent_and_its_answer_as_received() -> None:
    from loadtests.compare.fidelity import _answer_tokens, _prompt_tokens

    closed = {"prompt_tokens": None, "prompt_tokens_sent": 61, "max_tokens": 4000,
              "closed_at": 5.0, "token_times": [0.1] * 730}  # fmt: skip
    assert (_prompt_tokens(closed), _answer_tokens(closed)) == (61, 730)
    whole = {**closed, "prompt_tokens": 60, "closed_at": None}
    assert (_prompt_tokens(whole), _answer_tokens(whole)) == (60, 4000)
    failed = {**whole, "prompt_tokens": None}
    assert _prompt_tokens(failed) is None
