"""The prompt counter: batch counted by an up engine's tokenizer, everything else
estimated, and estimates learning from the engine's usage."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.api.prompts import PromptCount, PromptCounter
from proxy.engines import EnginePool
from proxy.openai.request import ChatRequest, StreamWish
from proxy.scheduler import TrafficClass

from .helpers import FakeEngines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


def req(cls: TrafficClass, text: str = "x" * 400, **fields: Any) -> ChatRequest:
    base: dict[str, Any] = {
        "path": "/v1/completions", "cls": cls, "model": "m", "messages": None,
        "prompt": text, "text": text, "wish": StreamWish(False, False), "affinity": "a",
        "upstream": {},
    }  # fmt: skip
    return ChatRequest(**{**base, **fields})


async def test_batch_is_counted_by_the_first_up_engine_else_estimated() -> None:
    engines = FakeEngines(a=["m"], b=["m"])
    engines.token_count = 77
    up: list[str] = ["b"]
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        pool = EnginePool([engines.config("a"), engines.config("b")], http)
        counter = PromptCounter(pool, lambda model: list(up))
        assert await counter.count(req(TrafficClass.BATCH)) == PromptCount(77, estimated=False)
        assert [c.engine for c in engines.seen("/tokenize")] == ["b"]
        up.clear()
        assert await counter.count(req(TrafficClass.BATCH)) == PromptCount(100, estimated=True)
        assert await counter.count(req(TrafficClass.INTERACTIVE)) == PromptCount(100, True)
    assert len(engines.seen("/tokenize")) == 1


async def test_only_estimates_learn_from_usage() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(FakeEngines())) as http:
        counter = PromptCounter(EnginePool([], http), lambda model: [])
        chat = req(TrafficClass.INTERACTIVE)
        counter.learn(chat, PromptCount(400, estimated=False), 400)
        assert (await counter.count(chat)).tokens == 100
        counter.learn(chat, PromptCount(100, estimated=True), 400)
        assert (await counter.count(chat)).tokens > 100
