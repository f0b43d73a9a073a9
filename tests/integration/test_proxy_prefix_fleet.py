"""A cache-aware fleet over HTTP: two ``whoseturn sim`` engines (each publishing its
KV-cache events, each reporting ``cached_tokens``) behind ``whoseturn serve``.

Conversations with growing history, the same requests in two arms on fresh engines:
the proxy choosing by load alone (``route_by: load``), and by prefix, its index fed
by the engines' KV events. The hit rate is the engines' own
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``). Run with ``-s`` to see it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.support.processes import free_port
from tests.support import MODEL
from tests.support.children import logged_proxy, logged_sim
from tests.support.conversations import converse, hits_and_queries

pytestmark = pytest.mark.integration

CONVERSATIONS = 6
TURNS = 4
BLOCK = 16
# a cache of 400 blocks (6,400 tokens) per engine: the six histories (~600-1,000
# tokens each) fit on two engines when each stays on one, not when each is on both
CACHE_BLOCKS = 400


def sim_flags(pub: int, replay: int) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # bound on every interface, as vLLM binds an endpoint written with ``*``
        # (an address of its own it would connect to instead)
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return [
        "--enable-prompt-tokens-details",
        "--max-model-len", "4096",
        "--num-gpu-blocks-override", str(CACHE_BLOCKS),
        "--kv-events-config", json.dumps(config),
    ]  # fmt: skip


@contextmanager
def fleet(tmp: Path, route_by: str) -> Iterator[tuple[str, list[str]]]:
    """Two fresh engines and a proxy in front of them; the proxy's URL and the
    engines'."""
    with ExitStack() as stack:
        engines: list[dict[str, Any]] = []
        urls: list[str] = []
        for i in range(2):
            pub, replay = free_port(), free_port()
            logs = tmp / f"{route_by}-sim{i}"
            _, url = stack.enter_context(logged_sim(logs, *sim_flags(pub, replay)))
            urls.append(url)
            engines.append(
                {
                    "url": url,
                    "name": f"e{i}",
                    "kv_events": f"tcp://127.0.0.1:{pub}",
                    "kv_events_replay": f"tcp://127.0.0.1:{replay}",
                }
            )
        (tmp / route_by).mkdir()
        _, proxy = stack.enter_context(
            logged_proxy(tmp / route_by, engines, route_by=route_by, name=f"proxy-{route_by}")
        )
        yield proxy, urls


def test_conversations_stay_where_their_history_is_cached(tmp_path: Path) -> None:
    rates: dict[str, float] = {}
    for route_by in ("load", "prefix"):
        with fleet(tmp_path, route_by) as (proxy, urls):
            usages = converse(proxy, MODEL, conversations=CONVERSATIONS, turns=TURNS)
            hits, queries = hits_and_queries(urls)
            rates[route_by] = hits / queries
            reported = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
            assert reported <= hits  # the engines count what their answers report
            turn = httpx.get(f"{proxy}/turn").json()
            log = httpx.get(f"{proxy}/turn/log", params={"limit": 1000}).json()["decisions"]
            if route_by == "prefix":
                entries = turn["engines"] if isinstance(turn, dict) else turn
                modes = {e["engine"]: e["prefix_index"]["mode"] for e in entries}
                assert modes == {"e0": "events", "e1": "events"}
                blocks = {e["engine"]: e["prefix_index"]["blocks"] for e in entries}
                assert all(n > 0 for n in blocks.values()), (blocks, turn)
                routes = [d["route"] for d in log if d["action"] == "admit"]
                later = routes[CONVERSATIONS:]  # every turn after the first
                assert all(r is not None and r["why"] == "prefix" for r in later), later
                # each later turn went where its history was expected
                assert all(max(r["cached_tokens"].values()) > 0 for r in later)
            metrics = httpx.get(f"{proxy}/metrics").text
            assert "whoseturn_prefix_cached_tokens_total" in metrics
    print(f"\nfleet hit rate: by load {rates['load']:.1%}, by prefix {rates['prefix']:.1%}")
    assert rates["prefix"] > rates["load"] + 0.10, rates
