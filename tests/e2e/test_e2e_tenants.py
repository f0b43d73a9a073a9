"""A tenant's tier reaches a real vLLM engine run with ``--scheduling-policy priority``.

Tenant ``low`` (tier ``sheddable``) sends eight long chats at once; a moment later
tenant ``top`` sends one. The proxy sends every one at once (one engine, far below
its cap), so their order is the engine's: under the priority policy it serves the
lowest ``priority`` first, and the tier moves a request's priority (critical -11,
sheddable -9). Two arms on one engine, each through a fresh proxy, with prompts of
their own (no prefix cached from the other): ``top`` critical, and ``top`` sheddable
like ``low`` (the control: equal priority, served in arrival order). The count is
how many of ``low``'s chats, all sent before ``top``'s, had their first token
before it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx
import pytest

from loadtests.support.vllm import MODEL_NAME

from .vllmserver import STARTUP_ALLOWANCE_S, VllmFleet, proxy_in_front

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(STARTUP_ALLOWANCE_S + 300)]

LOW_CHATS = 8
PROMPT_WORDS = 1200
TOP_AFTER_S = 0.3


def _prompt(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(PROMPT_WORDS))


async def _first_token_at(http: httpx.AsyncClient, key: str, prompt: str) -> float:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.monotonic()
    raise AssertionError("the stream ended without a token")


async def _arm(base_url: str, seed: int) -> int:
    rng = random.Random(seed)
    lows = [_prompt(rng) for _ in range(LOW_CHATS)]
    top = _prompt(rng)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        low_tasks = [asyncio.create_task(_first_token_at(http, "sk-low", p)) for p in lows]
        await asyncio.sleep(TOP_AFTER_S)
        top_at = await _first_token_at(http, "sk-top", top)
        low_at = await asyncio.gather(*low_tasks)
    return sum(1 for t in low_at if t < top_at)


def test_a_critical_tenant_goes_first_inside_a_priority_engine(
    vllm_fleet: VllmFleet, measured: Callable[[str], None]
) -> None:
    server = vllm_fleet.get("--scheduling-policy", "priority")
    before: dict[str, int] = {}
    for seed, top_tier in enumerate(("critical", "sheddable")):
        keys = [
            {"key": "sk-low", "tenant": "low", "tier": "sheddable"},
            {"key": "sk-top", "tenant": "top", "tier": top_tier},
        ]
        with proxy_in_front(server, api_keys=keys) as proxy:
            before[top_tier] = asyncio.run(_arm(proxy.base_url, seed))
    measured(
        f"low's chats (of {LOW_CHATS}, sent {TOP_AFTER_S} s before) with a first token "
        f"before top's: top critical {before['critical']}, top sheddable {before['sheddable']}"
    )
    # the control: the engine had low's chats waiting when top's came (the evidence)
    assert before["sheddable"] >= LOW_CHATS - 2, before
    assert before["critical"] <= LOW_CHATS // 2, before
    assert before["critical"] < before["sheddable"] - 2, before
