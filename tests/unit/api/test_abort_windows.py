"""Aborting a pieced prompt's final request for a chat, at the edge, in-process over
fake engines: the upstream closed, the request requeued and sent again once, the
client answered once and whole, the counters and the decision log, a client that
leaves while requeued."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import pytest

from proxy.admission import Admission
from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, EngineConfig, Settings
from proxy.scheduler import Job, Scheduler, TrafficClass
from tests.support.polling import wait_until

from .helpers import CHAT, MESSAGES, Call, chat_events, completion_events
from .test_piece_sender import TOKENS, CachingEngines, facts, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


class Held(httpx.AsyncByteStream):
    """An engine's answer still in prefill: it sends nothing until ``release`` is set
    (then ``events``), and notes whether the proxy closed it."""

    def __init__(self, events: list[bytes] | None = None) -> None:
        self.release = anyio.Event()
        self.closed = anyio.Event()
        self.events = events or []

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await self.release.wait()
        for event in self.events:
            yield event

    async def aclose(self) -> None:
        self.closed.set()


class AbortingEngines(CachingEngines):
    """Caching engines on which the first attempt of the final request stays in
    prefill (``final``), and a chat waits behind it until it is aborted (or
    ``chat.release`` is set)."""

    def __init__(self) -> None:
        super().__init__()
        self.final = Held()
        self.chat = Held(chat_events())
        self.finals = 0
        self.generate = self.answer_or_hold

    def answer_or_hold(self, call: Call) -> httpx.Response:
        if call.path == CHAT:
            return self._streamed(self.chat)
        if isinstance(call.body["prompt"], str):  # the client's own request
            self.finals += 1
            if self.finals == 1:
                return self._streamed(self.final)
        return self.answer(call)

    def _streamed(self, held: Held) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=held)


def settings(engines: CachingEngines, piecing: str = "on", **fields: Any) -> Settings:
    # a TTFT aim (0.8 x 2 ms) that the final's prefill left (at least the 16 tokens
    # after the last 64-token piece, the floor of four blocks, at 0.2 ms a token)
    # passes at once: a chat that arrives while it is in prefill is at risk
    budget = BudgetConfig(ttft_target_s=0.002)
    engine = engines.config("a", piecing=piecing, piece_tokens=512, budget=budget)
    return engines.settings(engines=(engine,), ttft_target_s=0.002, **fields)


async def until(condition: Callable[[], bool]) -> None:
    await wait_until(condition, timeout_s=5)


async def batch(client: httpx.AsyncClient, stream: bool, out: list[httpx.Response]) -> None:
    body = {"model": "m", "prompt": "a long batch prompt", "max_tokens": 3, "stream": stream}
    out.append(await client.post("/batch/v1/completions", json=body))


async def chat(client: httpx.AsyncClient, out: list[httpx.Response]) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3}
    out.append(await client.post(CHAT, json=body))


def streamed_text(raw: str) -> str:
    chunks = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data:")]
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    texts = [json.loads(c)["choices"] for c in chunks[:-1]]
    return "".join(c[0]["text"] for c in texts if c)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_final_in_prefill_is_aborted_for_a_chat_and_answered_once(stream: bool) -> None:
    engines = AbortingEngines()
    async with running(settings(engines), engines) as (client, state):
        metrics = (await client.get("/metrics")).text
        assert 'whoseturn_batch_aborts_total{engine="a"} 0.0' in metrics
        assert 'whoseturn_batch_requeues_total{engine="a"} 0.0' in metrics
        batches: list[httpx.Response] = []
        chats: list[httpx.Response] = []
        async with anyio.create_task_group() as group:
            group.start_soon(batch, client, stream, batches)
            await until(lambda: engines.finals == 1)  # the final is in the engine
            group.start_soon(chat, client, chats)
            await until(lambda: engines.final.closed.is_set())  # aborted: upstream closed
            assert batches == []  # the client saw nothing of it
            engines.chat.release.set()  # the chat goes first, then the final again
        assert engines.finals == 2  # sent again once, whole
        assert chats[0].status_code == 200
        response = batches[0]
        assert response.status_code == 200
        if stream:
            assert streamed_text(response.text) == "Hello world!"
        else:
            assert response.json()["choices"][0]["text"] == "Hello world!"
        metrics = (await client.get("/metrics")).text
        assert 'whoseturn_batch_aborts_total{engine="a"} 1.0' in metrics
        assert 'whoseturn_batch_requeues_total{engine="a"} 1.0' in metrics
        assert 'whoseturn_requests_total{class="batch",engine="a",outcome="ok"} 1.0' in metrics
        piecing = facts((await client.get("/turn")).json())
        assert (piecing["aborts"], piecing["requeues"]) == (1, 1)
        log = (await client.get("/turn/log")).json()["decisions"]
        (abort,) = [d for d in log if d["action"] == "abort"]
        assert abort["abort"]["number"] == 1 and abort["abort"]["max"] == 3
        assert abort["abort"]["ttft_aim_s"] == 0.0016
        assert abort["abort"]["chat_waited_s"] + abort["abort"]["prefill_left_s"] > 0.0016
        final = [d for d in log if d["request_id"] == abort["request_id"]]
        assert [d["action"] for d in final] == ["admit", "abort", "hold", "admit"]
        assert final[2]["reason"] == "interactive_waiting"  # the chat goes first
        assert state.scheduler.jobs == {} and len(state.forwarder.windows) == 0


async def test_a_client_that_leaves_while_requeued_leaves_no_job() -> None:
    engines = AbortingEngines()
    async with running(settings(engines), engines) as (client, state):
        chats: list[httpx.Response] = []
        async with anyio.create_task_group() as group:
            with anyio.move_on_after(5) as scope:
                async with anyio.create_task_group() as batches:
                    batches.start_soon(batch, client, False, [])
                    await until(lambda: engines.finals == 1)
                    group.start_soon(chat, client, chats)
                    await until(lambda: engines.final.closed.is_set())
                    batches.cancel_scope.cancel()  # the batch client hangs up, requeued
            assert not scope.cancelled_caught
            await anyio.sleep(0.05)
            ids = set(state.scheduler.jobs)
            assert len(ids) == 1 and all(
                state.scheduler.jobs[i].cls.value == "interactive" for i in ids
            )
            assert not any(state.admission.knows(d.job_id) for d in state.scheduler.log if d.abort)
            engines.chat.release.set()
        assert chats[0].status_code == 200
        await anyio.sleep(0.05)
        assert engines.finals == 1  # never sent again
        assert state.scheduler.jobs == {}
        metrics = (await client.get("/metrics")).text
        assert 'whoseturn_batch_aborts_total{engine="a"} 1.0' in metrics
        assert 'whoseturn_batch_requeues_total{engine="a"} 0.0' in metrics


@pytest.mark.parametrize(
    ("mode", "piecing", "tokens", "aborts"),
    [
        ("off", "on", TOKENS, 0),
        ("auto", "on", TOKENS, 1),  # the final request of a pieced prompt
        ("auto", "on", 500, 0),  # a prompt sent whole: only under on
        ("on", "on", 500, 1),
        # piecing auto before chat's first miss: the long prompt goes whole, and may
        # be aborted as its final would be; a short one would go whole anyway
        ("auto", "auto", TOKENS, 1),
        ("auto", "auto", 500, 0),
        ("off", "auto", TOKENS, 0),
    ],
)
async def test_what_batch_abort_aborts(mode: str, piecing: str, tokens: int, aborts: int) -> None:
    engines = AbortingEngines()
    engines.token_count = tokens
    config = settings(engines, piecing, batch_abort=mode)
    async with running(config, engines) as (client, state):
        chats: list[httpx.Response] = []
        batches: list[httpx.Response] = []
        async with anyio.create_task_group() as group:
            group.start_soon(batch, client, False, batches)
            await until(lambda: engines.finals == 1)
            group.start_soon(chat, client, chats)
            await until(lambda: len(engines.seen(CHAT)) == 1)
            # a whole prompt's prefill time is not known: the chat must wait past the aim
            engines.clock.advance(0.1)
            await anyio.sleep(0.2)  # the proxy's ticks ask the rule again
            assert engines.final.closed.is_set() is bool(aborts)
            engines.final.events = completion_events()  # not aborted: it answers
            engines.final.release.set()
            engines.chat.release.set()
        assert batches[0].json()["choices"][0]["text"] == "Hello world!"
        pieced = tokens == TOKENS and piecing == "on"
        assert engines.finals == 1 + aborts and (engines.pieces() != []) is pieced
        metrics = (await client.get("/metrics")).text
        assert f'whoseturn_batch_aborts_total{{engine="a"}} {aborts}.0' in metrics
        assert f'whoseturn_batch_requeues_total{{engine="a"}} {aborts}.0' in metrics
        assert state.scheduler.jobs == {}


async def test_a_place_held_for_an_aborted_job_goes_when_its_client_leaves() -> None:
    scheduler = Scheduler([EngineConfig(name="a", models=("m",))], VirtualClock(0.0))
    admission = Admission(scheduler)
    admission.on_abort = lambda _: True  # the edge can always abort here
    released: list[str] = []
    admission.on_release = lambda: released.append(final.phase.value)
    final = Job(id="final", cls=TrafficClass.BATCH, model="m", prompt_tokens=100, arrival=0.0)
    final.abortable = True
    async with anyio.create_task_group() as group:
        group.start_soon(admission.admit, final)
        await until(lambda: final.engine == "a")
        chat = Job(id="chat", cls=TrafficClass.INTERACTIVE, model="m", prompt_tokens=9, arrival=-1)
        group.start_soon(admission.admit, chat)  # waited 1 s: past the aim, abort
        await until(lambda: final.aborts == 1)
        assert admission.knows("final") and final.phase.value == "queued"
        assert released == ["queued"]  # its tokens left prefill: the shared ledger is told
        admission.abandon("final")  # the client left before it waited again
        assert not admission.knows("final") and "final" not in scheduler.jobs
        group.cancel_scope.cancel()


class Broken(httpx.AsyncByteStream):
    """An engine's answer that breaks before its first chunk."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        raise httpx.ReadError("connection reset")
        yield b""  # pragma: no cover - never reached


@pytest.mark.parametrize("how", ["broken", "silent"])
async def test_a_final_that_fails_before_its_first_chunk_fails_as_without_aborts(
    how: str,
) -> None:
    """The first chunk of an abortable request is read before the relay starts; a
    read that fails or times out then is raised where the relay reads, so the
    request fails (or is retried) exactly as any other."""
    engines = AbortingEngines()
    if how == "broken":
        engines.final = Broken()  # type: ignore[assignment]
    async with running(settings(engines, first_byte_timeout_s=0.2), engines) as (client, state):
        responses: list[httpx.Response] = []
        await batch(client, False, responses)
        assert responses[0].status_code == 502
        assert "The engine failed mid-answer" in responses[0].json()["error"]["message"]
        assert ("timed out" in responses[0].text or "sent nothing" in responses[0].text) is (
            how == "silent"
        )
        assert engines.finals == 1 and state.scheduler.jobs == {}
        metrics = (await client.get("/metrics")).text
        assert 'whoseturn_requests_total{class="batch",engine="a",outcome="engine_error"} 1.0' in (
            metrics
        )
