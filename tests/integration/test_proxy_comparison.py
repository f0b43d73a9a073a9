"""Issue #3 over HTTP: chat beside a burst of long batch prompts, direct and proxied.

One ``whoseturn sim`` (cpu-tiny, ten times real time) per arm. Arm A: every client
talks to the engine directly, so the chat requests queue FCFS behind eight
5,300-token prompts (the shape measured on real vLLM in DESIGN.md). Arm B: the
same clients through ``whoseturn serve`` with its defaults, batch on ``/batch/v1``,
chat on ``/v1``. Engine, proxy and clients are separate processes. Run with ``-s``
to see the numbers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import pytest

from .beside_batch import ArmTimes, start_chats, unique_prompt
from .proxyserver import spawn_proxy, spawn_sim
from .simserver import MODEL

pytestmark = pytest.mark.integration

TIME_SCALE = 10.0
BATCH_PROMPTS = 8
BATCH_PROMPT_TOKENS = 5300
BATCH_MAX_TOKENS = 20
CHAT_AT_S = (0.10, 0.20, 0.30, 0.40)  # after the batch burst, real seconds
CHAT_MAX_TOKENS = 8


@dataclass
class Arm(ArmTimes):
    """The arm's times, and the classes the proxy gave its batch prompts."""

    classes: set[str] = field(default_factory=set)


async def one_batch(client: httpx.AsyncClient, path: str, n: int, start: float, arm: Arm) -> None:
    prompt = unique_prompt(f"r{n}", BATCH_PROMPT_TOKENS)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": BATCH_MAX_TOKENS}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == BATCH_MAX_TOKENS
    arm.batch_done_s.append(time.monotonic() - start)
    arm.classes.add(response.headers.get("x-whoseturn-class", "direct"))


async def run_arm(base_url: str, batch_path: str) -> Arm:
    arm = Arm()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
        start = time.monotonic()
        async with asyncio.TaskGroup() as group:
            for n in range(BATCH_PROMPTS):
                group.create_task(one_batch(client, batch_path, n, start, arm))
            at_s = [start + at for at in CHAT_AT_S]
            start_chats(group, client, at_s, CHAT_MAX_TOKENS, arm)
    return arm


def report(name: str, arm: Arm) -> None:
    print(f"{name}: {arm.chat_report()}; batch makespan {arm.makespan * 1000:.0f} ms")


def compare_once() -> tuple[Arm, Arm, float]:
    """Both arms, each on a fresh engine; the batch's held seconds through the proxy."""
    with spawn_sim(time_scale=TIME_SCALE) as sim:
        direct = asyncio.run(run_arm(sim.base_url, "/v1/completions"))
    with spawn_sim(time_scale=TIME_SCALE) as sim, spawn_proxy(sim.base_url) as px:
        proxied = asyncio.run(run_arm(px.base_url, "/batch/v1/completions"))
        held = px.metric("whoseturn_batch_held_seconds_total")
    return direct, proxied, held


def test_chat_ttft_behind_a_batch_burst_direct_vs_proxied() -> None:
    """Run again once if a ratio misses: the burst lasts about a second, so one stall
    of a busy machine in one arm moves the makespan ratio by half (seen once in CI:
    x1.57 where runs on a quiet machine give x1.11-1.12). The second run decides."""
    for attempt in (1, 2):
        direct, proxied, held = compare_once()
        print()
        report("direct ", direct)
        report("proxied", proxied)
        speedup = direct.ttft_p50 / proxied.ttft_p50
        slowdown = proxied.makespan / direct.makespan
        print(
            f"run {attempt}: chat TTFT p50 {speedup:.1f}x lower through the proxy; batch "
            f"makespan x{slowdown:.2f}; batch held {held:.2f} s in all"
        )
        if speedup >= 3.0 and slowdown <= 1.5:
            break
    assert len(direct.batch_done_s) == len(proxied.batch_done_s) == BATCH_PROMPTS
    assert proxied.classes == {"batch"}
    assert speedup >= 3.0
    assert slowdown <= 1.5
