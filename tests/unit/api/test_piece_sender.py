"""Piecing at the edge, in-process over fake engines: the pieces sent, the cache
check and its fallback, a failed piece, and what ``/turn`` and ``/metrics`` say."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest

from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, Settings
from proxy.scheduler import TrafficClass
from proxy.server import ProxyState, create_app
from tests.support.polling import wait_until

from .helpers import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    METRICS,
    Call,
    FakeEngines,
    chat_chunk,
    chat_events,
    completion_chunk,
    completion_events,
    delta,
    fake_token_ids,
    sse,
    stream_response,
    text,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

CACHE_INFO = (
    "# HELP vllm:cache_config_info Information of the KV cache config.\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",enable_prefix_caching="%s",engine="0"} 1.0\n'
)
HITS = (
    "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
    "# TYPE vllm:prefix_cache_hits_total counter\n"
    'vllm:prefix_cache_hits_total{engine="0",model_name="m"} %d.0\n'
    'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
)
TOKENS = 2000
PROMPT = "a long batch prompt"


class CachingEngines(FakeEngines):
    """Fake engines with token ids on ``/tokenize`` and a prefix cache that reports
    ``cached`` (a function of the prompt's token ids) for each request."""

    def __init__(self, caching: str = "True") -> None:
        super().__init__(a=["m"])
        self.clock = VirtualClock()
        self.token_count = TOKENS
        self.caching = caching
        self.cache: set[int] = set()  # prefix lengths the engine holds
        self.report_cached = True
        self.export_hits = False  # vllm:prefix_cache_hits_total on /metrics
        self.hits = 0
        self.fail_piece: int | None = None
        self.generate = self.answer

    def answer(self, call: Call, advance: bool = True) -> httpx.Response:
        prompt = call.body["prompt"]
        ids = prompt if isinstance(prompt, list) else list(range(TOKENS))
        if isinstance(prompt, list) and len(self.pieces()) == self.fail_piece:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        cached = max((n for n in self.cache if n < len(ids)), default=0)
        if advance:
            self.clock.advance(0.0002 * (len(ids) - cached))  # 0.2 ms a new prompt token
        self.cache.add(len(ids) // 16 * 16)
        self.hits += cached
        usage: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": 1}
        if self.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if isinstance(prompt, list):  # a piece
            events = [
                sse(completion_chunk(text("x", finish="length"))),
                sse(completion_chunk(usage=usage)),
            ]
            return stream_response([*events, b"data: [DONE]\n\n"])
        return stream_response(completion_events())

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            self.calls.append(Call("a", "/tokenize", None))
            ids = fake_token_ids(json.loads(request.content), self.token_count)
            return httpx.Response(200, json={"count": len(ids), "tokens": ids})
        if request.url.path == "/metrics":
            hits = HITS % self.hits if self.export_hits else ""
            return httpx.Response(200, text=METRICS + CACHE_INFO % self.caching + hits)
        return await super().__call__(request)

    def pieces(self) -> list[int]:
        return [
            len(c.body["prompt"])
            for c in self.seen(COMPLETIONS)
            if isinstance(c.body["prompt"], list)
        ]

    def whole(self) -> list[Call]:
        return [c for c in self.seen(COMPLETIONS) if isinstance(c.body["prompt"], str)]


@asynccontextmanager
async def running(
    settings: Settings, engines: CachingEngines
) -> AsyncIterator[tuple[httpx.AsyncClient, ProxyState]]:
    """The proxy in front of ``engines``, on the engines' clock."""
    app = create_app(settings, transport=httpx.MockTransport(engines), clock=engines.clock)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, app.state.proxy


def settings(engines: FakeEngines, piecing: str = "on") -> Settings:
    return engines.settings(engines=(engines.config("a", piecing=piecing, piece_tokens=512),))


async def post(client: httpx.AsyncClient, prompt: str = PROMPT) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 3}
    return await client.post("/batch/v1/completions", json=body)


def facts(state_turn: dict[str, Any]) -> dict[str, Any]:
    piecing = state_turn["engines"][0]["piecing"]
    assert isinstance(piecing, dict)
    return piecing


async def test_a_long_batch_prompt_goes_in_block_aligned_pieces_then_whole() -> None:
    engines = CachingEngines()
    async with running(settings(engines), engines) as (client, _):
        response = await post(client)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "Hello world!"
        # the first piece is configured; then 0.2 ms a token was measured, and with no
        # chat stream decoding two pieces may take 0.24 s: 600 tokens, 592 in whole blocks
        pieces = engines.pieces()
        assert pieces[0] == 512 and pieces[-1] < TOKENS  # the final is the real request
        assert pieces == sorted(set(pieces)) and all(n % 16 == 0 for n in pieces)
        assert {b - a for a, b in itertools.pairwise(pieces)} <= {512, 592}
        assert 592 in {b - a for a, b in itertools.pairwise(pieces)}
        assert TOKENS - pieces[-1] <= 512
        assert len(engines.whole()) == 1
        assert all(c.body["max_tokens"] == 1 for c in engines.seen(COMPLETIONS)[:3])
        turn = (await client.get("/turn")).json()
        assert facts(turn)["enabled"] is True and facts(turn)["pieces"] == len(pieces)
        log = (await client.get("/turn/log")).json()["decisions"]
        numbers = list(range(1, len(pieces) + 2))
        assert [d["piece"] for d in log if d["admitted"]] == numbers
        metrics = (await client.get("/metrics")).text
        assert f'whoseturn_prefill_pieces_total{{engine="a"}} {len(pieces)}.0' in metrics
        assert 'whoseturn_prefill_pieced_prompts_total{engine="a"} 1.0' in metrics


async def test_when_the_cache_did_not_hold_piecing_stops_and_the_prompt_goes_whole() -> None:
    engines = CachingEngines()
    engines.cache = set()
    original = engines.answer

    def forgetful(call: Call) -> httpx.Response:
        engines.cache.clear()  # evicted between two pieces
        return original(call)

    engines.generate = forgetful
    async with running(settings(engines), engines) as (client, _):
        response = await post(client)
        assert response.status_code == 200
        pieces = engines.pieces()  # a piece found less cached than was answered: stop
        assert pieces[0] == 512 and 2 <= len(pieces) <= 3
        assert len(engines.whole()) == 1  # answered once, whole
        piecing = facts((await client.get("/turn")).json())
        assert piecing["enabled"] is False and piecing["fallbacks"] == 1
        assert "did not hold" in piecing["reason"] and "found 0 of 512" in piecing["reason"]
        metrics = (await client.get("/metrics")).text
        assert (
            'whoseturn_prefill_piece_fallbacks_total{engine="a",reason="cache_miss"} 1.0' in metrics
        )
        assert (await post(client)).status_code == 200  # the next prompt is not pieced
        assert engines.pieces() == pieces and len(engines.whole()) == 2


async def test_an_engine_that_does_not_report_cached_tokens_is_not_pieced_twice() -> None:
    engines = CachingEngines()
    engines.report_cached = False
    async with running(settings(engines, "on"), engines) as (client, _):
        assert (await post(client)).status_code == 200
        assert engines.pieces() == [512]  # the first piece has nothing to check...
        piecing = facts((await client.get("/turn")).json())
        assert piecing["enabled"] is False  # ... the second cannot be checked
        assert "--enable-prompt-tokens-details" in piecing["reason"]
        assert len(engines.whole()) == 1


async def test_without_cached_tokens_the_hit_counter_checks_the_pieces() -> None:
    engines = CachingEngines()
    engines.report_cached = False  # vLLM's default: no prompt_tokens_details
    engines.export_hits = True
    async with running(settings(engines), engines) as (client, _):
        response = await post(client)
        assert response.status_code == 200
        pieces = engines.pieces()
        assert pieces[0] == 512 and len(pieces) >= 3  # every piece, then the final
        assert len(engines.whole()) == 1
        piecing = facts((await client.get("/turn")).json())
        assert piecing["enabled"] is True and piecing["fallbacks"] == 0
        assert piecing["cache_check"] == "prefix_cache_hits"
        metrics = (await client.get("/metrics")).text
        assert 'whoseturn_prefill_pieced_prompts_total{engine="a"} 1.0' in metrics


async def test_the_hit_counter_shows_a_cache_that_did_not_hold() -> None:
    engines = CachingEngines()
    engines.report_cached = False
    engines.export_hits = True
    original = engines.answer

    def forgetful(call: Call) -> httpx.Response:
        engines.cache.clear()  # evicted between two pieces: no hits counted
        return original(call)

    engines.generate = forgetful
    async with running(settings(engines), engines) as (client, _):
        assert (await post(client)).status_code == 200
        pieces = engines.pieces()
        assert pieces[0] == 512 and 2 <= len(pieces) <= 3
        assert len(engines.whole()) == 1  # answered once, whole
        piecing = facts((await client.get("/turn")).json())
        assert piecing["enabled"] is False and piecing["fallbacks"] == 1
        assert "vllm:prefix_cache_hits rose by 0 tokens" in piecing["reason"]
        assert "fewer than the 512" in piecing["reason"]


async def test_a_failed_piece_sends_the_prompt_whole_once() -> None:
    engines = CachingEngines()
    engines.fail_piece = 2  # the second piece (calls are counted as they come)
    async with running(settings(engines), engines) as (client, _):
        response = await post(client)
        assert response.status_code == 200
        assert engines.pieces()[:2] == [512, 1104] and len(engines.pieces()) <= 3
        assert len(engines.whole()) == 1
        assert facts((await client.get("/turn")).json())["enabled"] is True
        metrics = (await client.get("/metrics")).text
        assert 'reason="piece_failed"} 1.0' in metrics


@pytest.mark.parametrize(
    ("piecing", "caching", "tokens", "path"),
    [
        ("auto", "False", TOKENS, "/batch/v1/completions"),  # no prefix caching
        ("off", "True", TOKENS, "/batch/v1/completions"),
        ("auto", "True", 500, "/batch/v1/completions"),  # shorter than one piece
        ("auto", "True", TOKENS, "/v1/completions"),  # interactive: never pieced
    ],
)
async def test_what_is_not_pieced(piecing: str, caching: str, tokens: int, path: str) -> None:
    engines = CachingEngines(caching)
    engines.token_count = tokens
    async with running(settings(engines, piecing), engines) as (client, _):
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 3}
        assert (await client.post(path, json=body)).status_code == 200
        assert engines.pieces() == [] and len(engines.whole()) == 1


async def test_auto_pieces_only_after_chat_missed_its_aim_on_the_engine() -> None:
    engines = CachingEngines()
    async with running(settings(engines, "auto"), engines) as (client, state):
        # prefix caching on, but chat never missed its aim here: sent whole
        assert (await post(client)).status_code == 200
        assert engines.pieces() == [] and len(engines.whole()) == 1
        piecing = facts((await client.get("/turn")).json())
        assert piecing["enabled"] is True and piecing["piecing_now"] is False
        # the budget loop judges chat's gaps beside batch prefill over their aim
        budget = state.scheduler.engines["a"].budget
        now = state.clock.now()
        for _ in range(budget.settings.min_samples):
            budget.observe_gap(now, 1.0)
        budget.update(now + budget.settings.interval_s, batch_waiting=False)
        assert budget.missed_at is not None
        assert facts((await client.get("/turn")).json())["piecing_now"] is True
        # another prompt: the first is in the engine's prefix cache now, and would go
        # whole for that (a test of its own below)
        assert (await post(client, PROMPT + " again")).status_code == 200
        assert engines.pieces()[:1] == [512] and len(engines.whole()) == 2


async def test_a_client_gone_mid_piece_leaves_nothing_in_the_scheduler() -> None:
    engines = CachingEngines()
    release = anyio.Event()
    original = engines.answer

    async def hanging(call: Call) -> httpx.Response:
        if isinstance(call.body["prompt"], list) and len(engines.pieces()) == 2:
            await release.wait()  # the second piece never answers
        return original(call)

    engines.generate = hanging
    async with running(settings(engines), engines) as (client, state):
        with anyio.move_on_after(1.0):
            await post(client)
        await anyio.sleep(0.1)
        assert engines.pieces()[:1] == [512] and len(engines.pieces()) == 2
        assert engines.whole() == []  # the client's own request was never sent
        assert state.scheduler.jobs == {}  # every piece's job left the scheduler
        assert all(not e.inflight for e in state.scheduler.engines.values())
        release.set()


# -- deciding ahead ---------------------------------------------------------------


class Opened(httpx.AsyncByteStream):
    """A streamed answer that sends ``first`` events, then the rest once ``release``
    is set."""

    def __init__(self, events: list[bytes], first: int) -> None:
        self.events, self.first = events, first
        self.release = anyio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for n, event in enumerate(self.events):
            if n == self.first:
                await self.release.wait()
            yield event


def held(stream: Opened) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)


class TokenStream(httpx.AsyncByteStream):
    """A chat stream that sends its role and first token, then one token each time
    :meth:`token` is awaited (which returns once the proxy has read it), and ends
    when :meth:`end` is."""

    def __init__(self) -> None:
        self._in, self._out = anyio.create_memory_object_stream[bytes | None]()
        self.read = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        events = chat_events(("first",))
        yield events[0]
        yield events[1]
        with self._out:
            async for event in self._out:
                if event is None:
                    break
                yield event
                self.read += 1  # the proxy asked for more: it has handled the last one
        for event in events[2:]:
            yield event

    async def token(self) -> None:
        read = self.read
        await self._in.send(sse(chat_chunk(delta(content="x"))))
        await wait_until(lambda: self.read > read, timeout_s=5)

    async def end(self) -> None:
        with self._in:
            await self._in.send(None)


class SteppingEngines(CachingEngines):
    """Caching engines that compute a piece in steps beside a chat stream: one step
    of all its new tokens, or steps of ``threshold`` tokens where the engine chunks
    long prefills itself; the stream gets a token after each step."""

    def __init__(self, threshold: int | None = None) -> None:
        super().__init__()
        self.threshold = threshold
        self.stream = TokenStream()

    async def step(self, call: Call) -> httpx.Response:
        if call.path == CHAT:
            return held(self.stream)
        prompt = call.body["prompt"]
        if not isinstance(prompt, list):
            return self.answer(call)
        cached = max((n for n in self.cache if n < len(prompt)), default=0)
        new = len(prompt) - cached
        size = new if self.threshold is None else self.threshold
        for start in range(0, new, size):
            self.clock.advance(0.0002 * min(size, new - start))
            await self.stream.token()
        return self.answer(call, advance=False)


async def test_a_chat_that_comes_while_a_prompt_waits_turns_it_into_pieces() -> None:
    engines = CachingEngines()
    first = Opened(completion_events(), first=0)
    whole = 0

    def generate(call: Call) -> httpx.Response:
        nonlocal whole
        if call.path == COMPLETIONS and isinstance(call.body["prompt"], str):
            whole += 1
            if whole == 1:
                return held(first)  # the first prompt stays in prefill
        return engines.answer(call) if call.path == COMPLETIONS else stream_response(chat_events())

    engines.generate = generate
    budget = BudgetConfig(initial_tokens=2500, min_tokens=512)
    config = engines.config("a", piecing="auto", piece_tokens=512, budget=budget)
    async with running(engines.settings(engines=(config,)), engines) as (client, state):
        async with anyio.create_task_group() as group:
            group.start_soon(post, client)
            await wait_until(lambda: whole == 1, timeout_s=5)
            # another prompt (the same one would wait for the first's cache instead)
            group.start_soon(post, client, PROMPT + " too")  # waits: the budget is full
            await wait_until(lambda: len(state.scheduler.queues[TrafficClass.BATCH]) == 1)
            assert engines.pieces() == []  # no chat yet: the first went whole
            chat = {"model": "m", "messages": MESSAGES, "max_tokens": 3}
            assert (await client.post(CHAT, json=chat)).status_code == 200
            first.release.set()
        assert engines.pieces()[:1] == [512] and len(engines.whole()) == 2
        # chosen when its turn came, then again for its first piece on that engine
        choices = (await client.get("/turn/log")).json()["piecing"]
        assert [(c["pieces"], c["engine"]) for c in choices] == [(True, "a"), (True, "a")]
        assert choices[0]["why"].startswith("chat expected: a chat was sent here")


@pytest.mark.parametrize("threshold", [256, None])
async def test_the_first_piece_beside_a_stream_tells_whether_the_engine_chunks_itself(
    threshold: int | None,
) -> None:
    engines = SteppingEngines(threshold)
    engines.generate = engines.step
    async with running(settings(engines, "auto"), engines) as (client, state):
        async with anyio.create_task_group() as group:
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 30, "stream": True}
            group.start_soon(functools.partial(client.post, CHAT, json=body))
            await wait_until(lambda: state.admission.interactive_streams("a") == 1, timeout_s=5)
            assert state.scheduler.engines["a"].piece_depth == 1  # not judged yet
            assert (await post(client)).status_code == 200
            assert (await post(client)).status_code == 200
            piecing = facts((await client.get("/turn")).json())
            await engines.stream.end()
        assert piecing["chunks_itself"] is (threshold is not None)
        assert state.scheduler.engines["a"].piece_depth == 2
        if threshold is not None:
            # the first piece told: the rest of that prompt and the next one go whole
            assert engines.pieces() == [512] and len(engines.whole()) == 2
            assert piecing["chunking"] == (
                "a 512-token piece of 102 ms stalled a chat stream for at most 51 ms: "
                "the engine cut it into smaller steps"
            )
            assert piecing["why"].startswith("the engine chunks itself: a 512-token piece")
            assert piecing["piecing_now"] is False
        else:
            assert len(engines.pieces()) > 2 and piecing["piecing_now"] is True
            assert piecing["chunking"].endswith(
                "stalled a chat stream for at most 102 ms: one step"
            )


class BlockEngines(CachingEngines):
    """Caching engines ``a`` and ``b`` whose KV blocks differ in size."""

    def __init__(self, blocks: dict[str, int]) -> None:
        super().__init__()
        self.models = {name: ["m"] for name in blocks}
        self.blocks = blocks

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        response = await super().__call__(request)
        if request.url.path != "/metrics":
            return response
        name = request.url.host.removesuffix(".engine.test")
        said = f'block_size="{self.blocks[name]}"'
        return httpx.Response(200, text=response.text.replace('block_size="16"', said))


async def test_every_piece_ends_on_a_block_boundary_of_the_engine_it_goes_to() -> None:
    engines = BlockEngines({"a": 16, "b": 48})
    configs = tuple(engines.config(n, piecing="on", piece_tokens=500) for n in ("a", "b"))
    async with (
        running(engines.settings(engines=configs), engines) as (client, _),
        anyio.create_task_group() as group,
    ):
        for i in range(2):  # two prompts at once: the first pieces go to both engines
            group.start_soon(post, client, f"{PROMPT} {i}")
    pieces = [c for c in engines.seen(COMPLETIONS) if isinstance(c.body["prompt"], list)]
    assert {c.engine for c in pieces} == {"a", "b"}
    # the first piece is not pinned: 500 tokens end on a block of either engine (480)
    assert sorted(len(c.body["prompt"]) for c in pieces)[:2] == [480, 480]
    for c in pieces:
        assert len(c.body["prompt"]) % engines.blocks[c.engine] == 0, c


async def test_a_prompt_its_engine_holds_goes_whole_there() -> None:
    """Piecing is for prompts the engine must compute: once a prompt's pieces and
    its request ran, the same prompt again is held in the engine's prefix cache (as
    the proxy's index knows), so it goes whole."""
    engines = CachingEngines()
    async with running(settings(engines, "on"), engines) as (client, _):
        assert (await post(client)).status_code == 200
        pieces = engines.pieces()
        assert pieces[:1] == [512] and len(engines.whole()) == 1
        assert (await post(client)).status_code == 200
        assert engines.pieces() == pieces and len(engines.whole()) == 2
        assert (await post(client, PROMPT + " and more")).status_code == 200
        assert len(engines.pieces()) > len(pieces)  # another prompt is pieced again
