"""Two real vLLM engines (the tiny model, prefix caching on by default,
``--enable-prompt-tokens-details``, KV-cache events published over ZMQ), the same
conversations through three routers in turn: vLLM's router with ``round_robin``,
vLLM's router with ``cache_aware``, and whoseturn (by prefix, following the
engines' events). Between arms every engine's prefix cache is emptied
(``POST /reset_prefix_cache``, vLLM's dev-mode route), so each arm starts cold.
The hit rate is the engines' own (``vllm:prefix_cache_hits`` / ``queries``).
Run with ``-s`` to see the table; the terminal summary lists it too.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.bench.fleet_arms import Engine, EngineSpec, arm
from loadtests.bench.overhead_router import ROUTER_VENV, router_binary
from loadtests.support.processes import free_port
from loadtests.support.vllm import MODEL_NAME, VllmProcess, start_vllm
from tests.support.conversations import converse, hits_and_queries

from .vllmserver import LOG_DIR, STARTUP_ALLOWANCE_S, VllmFleet

pytestmark = pytest.mark.e2e

CONVERSATIONS = 6
TURNS = 4
ARMS = ("round-robin", "cache-aware", "whoseturn")


def engine_flags(pub: int, replay: int) -> tuple[str, ...]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # a wildcard: vLLM binds it (an address of its own it would connect to)
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return ("--enable-prompt-tokens-details", "--kv-events-config", json.dumps(config))


@pytest.fixture
def two_engines(
    vllm_fleet: VllmFleet, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[VllmProcess, Engine]]]:
    """Two fresh engines of their own (the session's servers stopped first: two cores)."""
    vllm_fleet.stop_all()
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # for /reset_prefix_cache
    started: list[tuple[VllmProcess, Engine]] = []
    try:
        for i in range(2):
            pub, replay = free_port(), free_port()
            server = start_vllm(engine_flags(pub, replay), LOG_DIR, index=80 + i)
            events, replays = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
            started.append((server, Engine(server.base_url, server.process.pid, events, replays)))
        yield started
    finally:
        for server, _ in started:
            server.stop()


def tokenize_ms(url: str, repeats: int = 20) -> float:
    """The median time of ``POST /tokenize`` of a 2,000-token chat on the engine: what
    the proxy spends on a chat before choosing its engine."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * 2000}]}
    times = []
    with httpx.Client(timeout=30) as client:
        for _ in range(repeats):
            started = time.perf_counter()
            client.post(f"{url}/tokenize", json=body).raise_for_status()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


@pytest.mark.timeout(2 * STARTUP_ALLOWANCE_S + 600)
def test_two_engines_three_routers_hit_rates(
    two_engines: list[tuple[VllmProcess, Engine]],
    tmp_path: Path,
    measured: Callable[[str], None],
) -> None:
    if router_binary(ROUTER_VENV) is None:
        pytest.fail(f"{ROUTER_VENV}/bin/vllm-router is missing: `make router-venv` builds it")
    urls = [server.base_url for server, _ in two_engines]
    engines = [e for _, e in two_engines]
    spec = EngineSpec(model=MODEL_NAME)
    rates: dict[str, float] = {}
    for name in ARMS:
        for url in urls:
            httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
        hits0, queries0 = hits_and_queries(urls)
        with arm(
            name, engines, spec, tmp_path / name, batch_window=8, router_venv=ROUTER_VENV
        ) as t:
            started = time.monotonic()
            usages = converse(t.url, MODEL_NAME, conversations=CONVERSATIONS, turns=TURNS)
            took = time.monotonic() - started
        hits, queries = hits_and_queries(urls)
        rates[name] = (hits - hits0) / (queries - queries0)
        reported = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        prompt = sum(u["prompt_tokens"] for u in usages)
        measured(
            f"{name}: fleet hit rate {rates[name]:.1%} (engines' counters), "
            f"{reported / prompt:.1%} of prompt tokens reported cached, {took:.1f} s"
        )
    measured(f"/tokenize of a 2,000-token chat on vLLM: {tokenize_ms(urls[0]):.1f} ms median")
    assert rates["whoseturn"] > rates["round-robin"] + 0.10, rates
