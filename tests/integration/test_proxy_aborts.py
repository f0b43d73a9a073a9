"""Aborting batch requests in prefill for chats, over HTTP on the simulated engine:
aborts happen, and every batch answer is whole, given once, and equal to the
engine's own answer to the same prompt.

One ``whoseturn sim`` (cpu-tiny, default flags, real time) behind ``whoseturn
serve``; chats arrive every 50 ms while three long batch prompts run. Two
setups: ``piecing: on`` with ``batch_abort: auto``, a TTFT target of 20 ms (an aim
of 16 ms) and the engine at half speed (a final request of up to 64 new tokens then
takes ~26 ms), so that a chat sent while a final request is in prefill is at
risk; and ``piecing: off`` with ``batch_abort: on`` at the default target, where a
chat waits behind a whole 6,000-token prefill (three 2,048-token steps) until it
has waited past the aim. Run with ``-s`` to see the numbers.
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
MAX_TOKENS = 8
CHAT_EVERY_S = 0.05
TRIES = 3


def body(n: int, words: int) -> dict[str, object]:
    prompt = " ".join(f"a{n}w{i}" for i in range(words))  # no prefix shared
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}


async def batch_answers(
    client: httpx.AsyncClient, path: str, words: int
) -> dict[int, dict[str, object]]:
    async def one(n: int) -> tuple[int, dict[str, object]]:
        response = await client.post(path, json=body(n, words), timeout=120)
        assert response.status_code == 200, response.text
        return n, response.json()

    return dict(await asyncio.gather(*(one(n) for n in range(PROMPTS))))


async def chats_while(client: httpx.AsyncClient, done: asyncio.Event) -> list[float]:
    """Chats one after another every :data:`CHAT_EVERY_S` until ``done``; the time
    each took (one token: about its TTFT)."""
    took: list[float] = []

    async def one(n: int) -> None:
        messages = [{"role": "user", "content": f"Quick question {n}?"}]
        chat = {"model": MODEL, "messages": messages, "max_tokens": 1}
        sent = time.monotonic()
        response = await client.post("/v1/chat/completions", json=chat, timeout=60)
        assert response.status_code == 200, response.text
        took.append(time.monotonic() - sent)

    async with asyncio.TaskGroup() as group:
        while not done.is_set():
            group.create_task(one(len(took)))
            await asyncio.sleep(CHAT_EVERY_S)
    return took


async def through_proxy(
    url: str, words: int
) -> tuple[dict[int, dict[str, object]], list[float], float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        done = asyncio.Event()
        chats = asyncio.create_task(chats_while(client, done))
        start = time.monotonic()
        try:
            answers = await batch_answers(client, "/batch/v1/completions", words)
        finally:
            done.set()
        return answers, await chats, time.monotonic() - start


async def direct(url: str, words: int) -> dict[int, dict[str, object]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await batch_answers(client, "/v1/completions", words)


def text(answer: dict[str, object]) -> str:
    choices = answer["choices"]
    assert isinstance(choices, list) and len(choices) == 1
    return str(choices[0]["text"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("piecing", "batch_abort", "ttft_target_s", "words"),
    [("on", "auto", 0.02, 3000), ("off", "on", 0.3, 6000)],
)
def test_batch_requests_aborted_for_chats_are_answered_once_and_whole(
    tmp_path: Path, piecing: str, batch_abort: str, ttft_target_s: float, words: int
) -> None:
    with spawn_sim(time_scale=20.0) as sim:
        want = asyncio.run(direct(sim.base_url, words))
    settings = {"ttft_target_s": ttft_target_s, "batch_abort": batch_abort}
    # The evidence is an abort: a chat that came while a final request (or a whole
    # prompt) was in prefill, at risk of its aim. Pieces are small and paced, so a
    # run may see none; it is run again, on a fresh engine and proxy, up to TRIES.
    for attempt in range(1, TRIES + 1):
        with (
            spawn_sim(time_scale=0.5 if piecing == "on" else 1.0) as sim,
            proxy(tmp_path, sim.base_url, piecing, **settings) as px,
        ):
            answers, chats, seconds = asyncio.run(through_proxy(px.base_url, words))
            aborts = px.metric("whoseturn_batch_aborts_total")
            requeues = px.metric("whoseturn_batch_requeues_total")
            pieced = px.metric("whoseturn_prefill_pieced_prompts_total")
            ok = px.metric("whoseturn_requests_total", **{"class": "batch", "outcome": "ok"})
            facts = px.http.get("/turn").json()["engines"][0]["piecing"]
            log = px.http.get("/turn/log", params={"limit": 1000}).json()["decisions"]
        if aborts >= 1:
            break
        print(f"\nrun {attempt}: no chat was at risk beside a final in prefill; again")
    cut = [d for d in log if d["action"] == "abort"]
    chats.sort()
    print(
        f"\n{aborts:.0f} aborts, {requeues:.0f} requeues, {pieced:.0f} pieced prompts; "
        f"{len(chats)} chats took p50 {chats[len(chats) // 2] * 1000:.0f} ms, max "
        f"{chats[-1] * 1000:.0f} ms; batch done in {seconds:.2f} s; first abort: "
        f"{cut[0]['abort'] if cut else None}"
    )
    assert {n: text(a) for n, a in answers.items()} == {n: text(a) for n, a in want.items()}
    for n, answer in answers.items():
        usage = answer["usage"]
        assert isinstance(usage, dict) and usage == want[n]["usage"]  # whole: every token
    assert ok == PROMPTS  # each answered once
    assert pieced == (PROMPTS if piecing == "on" else 0)
    assert aborts >= 1, f"no abort in {TRIES} runs: no chat was at risk beside a prefill"
    assert requeues == aborts
    assert (facts["aborts"], facts["requeues"]) == (aborts, requeues)
    assert len(cut) == aborts and all(d["class"] == "batch" for d in cut)
    assert all(bool(d["piece"]) is (piecing == "on") for d in cut)
    assert all(d["abort"]["number"] <= d["abort"]["max"] == 3 for d in cut)
