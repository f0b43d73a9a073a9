"""Aborting a pieced prompt's final request for a chat, over HTTP on the simulated
engine: aborts happen, and every batch answer is whole, given once, and equal to
the engine's own answer to the same prompt.

One ``whoseturn sim`` (cpu-tiny, default flags, real time) behind ``whoseturn
serve`` with ``piecing: on`` and ``batch_abort: auto``, and a TTFT target of
20 ms (an aim of 16 ms), so that a chat sent while a final request is in prefill
is at risk. Chats arrive every 50 ms while three long batch prompts run. Run with
``-s`` to see the numbers.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from .proxyserver import spawn_sim
from .simserver import MODEL
from .test_proxy_pieces import proxy

pytestmark = pytest.mark.integration

PROMPTS = 3
PROMPT_WORDS = 3000
MAX_TOKENS = 8
CHAT_EVERY_S = 0.05


def prompt(n: int) -> str:
    return " ".join(f"a{n}w{i}" for i in range(PROMPT_WORDS))


def body(n: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt(n), "max_tokens": MAX_TOKENS}


async def batch_answers(client: httpx.AsyncClient, path: str) -> dict[int, dict[str, object]]:
    async def one(n: int) -> tuple[int, dict[str, object]]:
        response = await client.post(path, json=body(n), timeout=120)
        assert response.status_code == 200, response.text
        return n, response.json()

    return dict(await asyncio.gather(*(one(n) for n in range(PROMPTS))))


async def chats_while(client: httpx.AsyncClient, done: asyncio.Event) -> int:
    """Chats one after another every :data:`CHAT_EVERY_S` until ``done``; how many."""
    sent = 0
    async with asyncio.TaskGroup() as group:
        while not done.is_set():
            messages = [{"role": "user", "content": f"Quick question {sent}?"}]
            chat = {"model": MODEL, "messages": messages, "max_tokens": 2}
            group.create_task(client.post("/v1/chat/completions", json=chat, timeout=60))
            sent += 1
            await asyncio.sleep(CHAT_EVERY_S)
    return sent


async def through_proxy(url: str) -> tuple[dict[int, dict[str, object]], int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        done = asyncio.Event()
        chats = asyncio.create_task(chats_while(client, done))
        start = time.monotonic()
        try:
            answers = await batch_answers(client, "/batch/v1/completions")
        finally:
            done.set()
        return answers, await chats, time.monotonic() - start


async def direct(url: str) -> dict[int, dict[str, object]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await batch_answers(client, "/v1/completions")


def text(answer: dict[str, object]) -> str:
    choices = answer["choices"]
    assert isinstance(choices, list) and len(choices) == 1
    return str(choices[0]["text"])


@pytest.mark.timeout(180)
def test_finals_aborted_for_chats_are_answered_once_and_whole(tmp_path: Path) -> None:
    with spawn_sim(time_scale=20.0) as sim:
        want = asyncio.run(direct(sim.base_url))
    settings = {"ttft_target_s": 0.02, "batch_abort": "auto"}
    with spawn_sim(time_scale=1.0) as sim, proxy(tmp_path, sim.base_url, "on", **settings) as px:
        answers, chats, seconds = asyncio.run(through_proxy(px.base_url))
        aborts = px.metric("whoseturn_batch_aborts_total")
        requeues = px.metric("whoseturn_batch_requeues_total")
        prompts = px.metric("whoseturn_prefill_pieced_prompts_total")
        ok = px.metric("whoseturn_requests_total", **{"class": "batch", "outcome": "ok"})
        facts = px.http.get("/turn").json()["engines"][0]["piecing"]
        log = px.http.get("/turn/log", params={"limit": 1000}).json()["decisions"]
    cut = [d for d in log if d["action"] == "abort"]
    print(
        f"\n{aborts:.0f} aborts, {requeues:.0f} requeues of {prompts:.0f} pieced prompts, "
        f"{chats} chats, batch done in {seconds:.2f} s; first abort: "
        f"{cut[0]['abort'] if cut else None}"
    )
    assert {n: text(a) for n, a in answers.items()} == {n: text(a) for n, a in want.items()}
    for n, answer in answers.items():
        usage = answer["usage"]
        assert isinstance(usage, dict) and usage == want[n]["usage"]  # whole: every token
    assert prompts == PROMPTS and ok == PROMPTS  # each answered once
    assert aborts >= 1 and requeues == aborts
    assert (facts["aborts"], facts["requeues"]) == (aborts, requeues)
    assert len(cut) == aborts and all(d["class"] == "batch" and d["piece"] for d in cut)
    assert all(d["abort"]["number"] <= d["abort"]["max"] == 3 for d in cut)
