"""The engine model, seen over HTTP: a chat request queued behind long prompts waits."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from loadtests.engine_io import labelled_samples

from .simserver import run_server, sim_settings

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "Is it my turn yet?"}], "max_tokens": 2}
NUM_LONG, LONG_TOKENS = 4, 1500


def long_prompt(index: int) -> list[int]:
    """Token ids unique from the first block on, so the prefix cache cannot help."""
    return [1000 + index * LONG_TOKENS + k for k in range(LONG_TOKENS)]


async def first_token_seconds(client: httpx.AsyncClient) -> float:
    start = time.monotonic()
    body = {**CHAT, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return time.monotonic() - start
    raise AssertionError("no token came")


async def requests_in_engine(client: httpx.AsyncClient) -> float:
    samples = labelled_samples((await client.get("/metrics")).text)
    return sum(
        value
        for (name, _), value in samples.items()
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    )


async def wait_for_requests(client: httpx.AsyncClient, count: int) -> None:
    """Until the engine holds ``count`` requests, running or waiting."""
    for _ in range(5000):
        if await requests_in_engine(client) >= count:
            return
        await anyio.sleep(0.001)
    raise AssertionError(f"the engine never held {count} requests")


async def post_long(client: httpx.AsyncClient, index: int) -> None:
    body = {"prompt": long_prompt(index), "max_tokens": 4}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200


@pytest.mark.anyio
async def test_chat_behind_long_prompts_waits_longer_for_its_first_token() -> None:
    with run_server(sim_settings(time_scale=10)) as sim:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=30) as client:
            alone = min([await first_token_seconds(client) for _ in range(3)])
            async with anyio.create_task_group() as group:
                for index in range(NUM_LONG):
                    group.start_soon(post_long, client, index)
                await wait_for_requests(client, NUM_LONG)
                behind = await first_token_seconds(client)
    # ~6,000 prompt tokens ahead in FCFS order: three full 2,048-token prefill steps
    # (~1.2 s model, 0.12 s wall) against ~16 ms model alone.
    assert behind > 4 * alone, (alone, behind)
    assert behind > 0.05
