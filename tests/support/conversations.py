"""Conversations with growing history, sent at once through an OpenAI-compatible
server, and a fleet's prefix-cache hit rate from the engines' own counters."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from loadtests.bench.fleet_figures import cache_counts


def converse(
    url: str, model: str, *, conversations: int, turns: int, max_tokens: int = 8
) -> list[dict[str, Any]]:
    """``conversations`` chats at once through ``url``, each turn sent after the last
    one's answer and resending the history (a system prompt of its own, then every
    question and answer). The answers' ``usage``, in no particular order."""

    def one(c: int) -> list[dict[str, Any]]:
        system = f"You are assistant {c}. " + "Be brief. " * 60
        history: list[dict[str, Any]] = [{"role": "system", "content": system}]
        usages = []
        with httpx.Client(base_url=url, timeout=120) as client:
            for turn in range(turns):
                history.append({"role": "user", "content": f"Question {turn} of chat {c}? " * 8})
                body = {"model": model, "messages": history, "max_tokens": max_tokens}
                answer = client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                data = answer.json()
                usages.append(data["usage"])
                history.append(
                    {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
                )
        return usages

    with ThreadPoolExecutor(conversations) as pool:
        return [u for usages in pool.map(one, range(conversations)) for u in usages]


def hits_and_queries(engine_urls: Sequence[str]) -> tuple[float, float]:
    """The fleet's ``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``
    (prompt tokens found in the prefix cache, and looked up), summed over engines
    (read as the fleet benchmark reads them: :func:`loadtests.bench.fleet_figures.cache_counts`)."""
    counts = [cache_counts(httpx.get(f"{url}/metrics", timeout=10).text) for url in engine_urls]
    return sum(c.hits for c in counts), sum(c.queries for c in counts)
