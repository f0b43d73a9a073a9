"""The engine-measuring toolkit against engines behind httpx.MockTransport: the SSE
reader and token log, engine facts, exact-length prompts, Prometheus samples."""

from __future__ import annotations

import asyncio
import itertools
import json
import random

import httpx
import pytest

from loadtests.engine_io import (
    EngineInfo,
    EngineIOError,
    PromptMaker,
    TokenLog,
    engine_info,
    labelled_samples,
    record_tokens,
    samples,
    sse_events,
)

METRICS = """# HELP vllm:cache_config_info Information of the KV cache config.
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="32768"} 1.0
"""


def engine_transport(tokens_per_word: int = 1) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            card = {"id": "tiny", "max_model_len": 4096}
            return httpx.Response(200, json={"data": [card]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if request.url.path == "/tokenize":
            words = json.loads(request.content)["prompt"].split()
            ids = [hash(w) % 1000 for w in words for _ in range(tokens_per_word)]
            return httpx.Response(200, json={"count": len(ids), "tokens": ids})
        return httpx.Response(404)

    return httpx.MockTransport(handle)


def sse_transport(lines: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = "".join(f"{line}\n\n" for line in lines).encode()
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


async def logged(lines: list[str]) -> TokenLog:
    """The token log of a stream that sends ``lines``, one clock tick per event."""
    log, ticks = TokenLog(), itertools.count()
    async with (
        httpx.AsyncClient(transport=sse_transport(lines), base_url="http://e") as client,
        client.stream("POST", "/v1/completions") as response,
    ):
        await record_tokens(response, log, lambda: float(next(ticks)))
    return log


def test_sse_lines_count_tokens_with_and_without_usage() -> None:
    lines = [
        'data: {"choices": [{"text": "a"}]}',
        'data: {"choices": [{"text": "bc"}], "usage": {"completion_tokens": 3}}',
        'data: {"choices": [], "usage": {"completion_tokens": 3}}',
        ": keep-alive",
        "data: [DONE]",
        'data: {"choices": [{"text": "after the end"}]}',
    ]
    log = asyncio.run(logged(lines))
    assert len(log.times) == 3 and log.times[1] == log.times[2]
    assert log.closed and log.error is None


def test_the_token_log_reads_past_the_finish_and_keeps_a_bad_event_as_its_error() -> None:
    finished = [
        'data: {"choices": [{"text": "a", "finish_reason": "length"}]}',
        'data: {"choices": [], "usage": {"completion_tokens": 1}}',
        "data: [DONE]",
    ]
    done = asyncio.run(logged(finished))
    assert len(done.times) == 1 and done.closed and done.error is None
    broken = asyncio.run(logged(['data: {"choices": [{"text": "a"}]}', "data: {not json"]))
    assert len(broken.times) == 1 and isinstance(broken.error, ValueError)


def test_waiting_on_a_log_that_ends_too_soon_says_how_far_it_got() -> None:
    async def go() -> None:
        log = TokenLog()
        log.add(0.0)
        log.add(1.0, 4)
        log.close()
        await log.wait_for(4)
        await log.wait_for(5)

    with pytest.raises(EngineIOError, match="ended after 4 tokens"):
        asyncio.run(go())


def test_sse_events_skip_comments_and_stop_at_done() -> None:
    async def go() -> list[tuple[float, dict[str, object]]]:
        lines = [": comment", "event: ping", 'data: {"n": 1}', 'data:{"n": 2}', "data: [DONE]"]
        transport = sse_transport([*lines, 'data: {"n": 3}'])
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://e") as client,
            client.stream("GET", "/") as response,
        ):
            return [event async for event in sse_events(response, lambda: 7.0)]

    assert asyncio.run(go()) == [(7.0, {"n": 1}), (7.0, {"n": 2})]


def test_engine_info_reads_models_and_cache_config() -> None:
    async def go() -> EngineInfo:
        async with httpx.AsyncClient(transport=engine_transport(), base_url="http://e") as c:
            return await engine_info(c, cache_config=True)

    info = asyncio.run(go())
    assert (info.model, info.max_model_len, info.block_size, info.num_gpu_blocks) == (
        "tiny",
        4096,
        16,
        32768,
    )


def test_engine_info_refuses_a_model_the_engine_does_not_serve() -> None:
    async def go() -> EngineInfo:
        async with httpx.AsyncClient(transport=engine_transport(), base_url="http://e") as c:
            return await engine_info(c, "other")

    with pytest.raises(EngineIOError, match="'other' not at all"):
        asyncio.run(go())


def test_prompts_are_unique_and_exactly_as_long_as_asked() -> None:
    async def go() -> list[list[int]]:
        async with httpx.AsyncClient(transport=engine_transport(), base_url="http://e") as c:
            prompts = PromptMaker(c, "tiny", random.Random(1))
            return [await prompts.make(n) for n in (1, 16, 16, 300)]

    made = asyncio.run(go())
    assert [len(p) for p in made] == [1, 16, 16, 300]
    assert made[1][:1] != made[2][:1]


def test_samples_sum_over_label_sets_and_labelled_samples_keep_them() -> None:
    text = 'x_total{a="1"} 2.0\nx_total{a="2"} 3.0\n'
    assert samples(text) == {"x_total": 5.0}
    assert labelled_samples(text) == {
        ("x_total", frozenset({("a", "1")})): 2.0,
        ("x_total", frozenset({("a", "2")})): 3.0,
    }
