"""Chat beside a burst of long batch prompts over HTTP, as the comparison tests run it:
the times an arm measures, prompts that share no prefix, and timed chat streams."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from .simserver import MODEL


@dataclass
class ArmTimes:
    """Each chat's time to first token and each batch prompt's time to its answer
    (seconds from the arm's start)."""

    chat_ttft_s: list[float] = field(default_factory=list)
    batch_done_s: list[float] = field(default_factory=list)

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.chat_ttft_s)

    @property
    def makespan(self) -> float:
        return max(self.batch_done_s)

    def chat_report(self) -> str:
        """The chats' TTFT p50 and each chat's TTFT, in milliseconds."""
        ttfts = ", ".join(f"{t * 1000:.0f}" for t in sorted(self.chat_ttft_s))
        return f"chat TTFT p50 {self.ttft_p50 * 1000:.0f} ms (all: {ttfts} ms)"


def unique_prompt(tag: str, tokens: int) -> str:
    """``tokens`` words of their own (one token each), so that no prompt shares a
    prefix with another of a different ``tag``."""
    return " ".join(f"{tag}w{i}" for i in range(tokens))


def chat(content: str, max_tokens: int) -> dict[str, object]:
    """A streamed chat request of one user message."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def stream_tokens(client: httpx.AsyncClient, body: dict[str, object]) -> list[float]:
    """The arrival times (monotonic) of the content chunks of one streamed chat."""
    times: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                times.append(time.monotonic())
    assert times, "no content arrived"
    return times


async def one_chat(
    client: httpx.AsyncClient, n: int, at: float, max_tokens: int, arm: ArmTimes
) -> None:
    """Chat question ``n``, sent at ``at`` (monotonic); its TTFT goes to ``arm``."""
    await asyncio.sleep(at - time.monotonic())
    sent = time.monotonic()
    times = await stream_tokens(client, chat(f"Quick question number {n}?", max_tokens))
    arm.chat_ttft_s.append(times[0] - sent)


def start_chats(
    group: asyncio.TaskGroup,
    client: httpx.AsyncClient,
    at_s: Sequence[float],
    max_tokens: int,
    arm: ArmTimes,
) -> None:
    """A task in ``group`` for each chat question ``n``, sent at ``at_s[n]`` (monotonic)."""
    for n, at in enumerate(at_s):
        group.create_task(one_chat(client, n, at, max_tokens, arm))
