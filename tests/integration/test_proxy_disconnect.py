"""A client that leaves the proxy aborts its request in the engine at once, and one
that leaves while queued in the proxy never reaches the engine at all."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.http import data_lines, post_raw

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import MODEL, SimServer, abort_latencies

pytestmark = pytest.mark.integration

# Real time and long answers: the engine is busy with nothing but the request under test.
LONG = {"max_tokens": 1500}
ABORT_WITHIN_S = 0.1
TRIES = 3
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me everything"}]
CHAT = {"model": MODEL, "messages": MESSAGES}
TEXT = {"model": MODEL, "prompt": "tell me everything"}


def engine_requests(sim: SimServer) -> float:
    """Requests the engine has finished, for any reason (aborts included)."""
    return sim.metric("vllm:request_success_total")


def assert_aborts_quickly(sim: SimServer, proxy: ProxyServer, leave: Callable[[], float]) -> None:
    """``leave()`` makes a request through the proxy, leaves it while the engine
    runs it, and returns the time it left; the engine must drop it within
    ``ABORT_WITHIN_S`` (tried up to ``TRIES`` times, see
    :func:`.simserver.abort_latencies`)."""
    latencies = abort_latencies(sim, leave, within_s=ABORT_WITHIN_S, tries=TRIES)
    shown = ", ".join(f"{t * 1000:.0f}" for t in latencies)
    print(f"engine dropped the request {shown} ms after the client left")
    assert latencies[-1] < ABORT_WITHIN_S, f"the engine kept the request {shown} ms"
    tries = len(latencies)
    assert sim.metric("vllm:num_requests_waiting") == 0
    assert sim.metric("vllm:request_success_total", finished_reason="abort") == tries
    assert engine_requests(sim) == tries
    cancelled = {"outcome": "cancelled"}
    proxy.wait_for(lambda: proxy.metric("whoseturn_requests_total", **cancelled) == tries)
    assert proxy.metric("whoseturn_decode_inflight_requests") == 0
    assert proxy.metric("whoseturn_prefill_inflight_tokens") == 0


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)]
)
def test_closing_a_stream_aborts_the_engines_request(
    slow_sim: SimServer, path: str, body: dict[str, Any]
) -> None:
    with run_proxy([engine(slow_sim.base_url, "sim")]) as proxy:

        def leave() -> float:
            request = {**body, **LONG, "stream": True}
            with proxy.http.stream("POST", path, json=request) as response:
                assert response.status_code == 200
                events = data_lines(response)
                next(events), next(events)
                assert slow_sim.requests_running() == 1
            return time.monotonic()

        assert_aborts_quickly(slow_sim, proxy, leave)


def test_a_whole_answer_client_that_times_out_aborts_the_engines_request(
    slow_sim: SimServer,
) -> None:
    with run_proxy([engine(slow_sim.base_url, "sim")]) as proxy:

        def leave() -> float:
            with proxy.openai(timeout=0.3) as client, pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=LONG["max_tokens"]
                )
            return time.monotonic()

        assert_aborts_quickly(slow_sim, proxy, leave)


def test_a_whole_answer_client_that_hangs_up_aborts_the_engines_request(
    slow_sim: SimServer,
) -> None:
    with run_proxy([engine(slow_sim.base_url, "sim")]) as proxy:

        def leave() -> float:
            sock = post_raw(proxy.port, "/v1/completions", {**TEXT, **LONG})
            try:
                slow_sim.wait_for(lambda: slow_sim.requests_running() == 1, timeout=2)
                time.sleep(0.05)
            finally:
                sock.close()
            return time.monotonic()

        assert_aborts_quickly(slow_sim, proxy, leave)


@pytest.mark.parametrize(
    ("cls", "cap", "stream"),
    [("batch", {"batch_max_inflight": 1}, False), ("interactive", {"max_inflight": 1}, True)],
)
def test_a_client_that_leaves_while_queued_in_the_proxy_never_reaches_the_engine(
    slow_sim: SimServer, cls: str, cap: dict[str, int], stream: bool
) -> None:
    prefix = "/batch" if cls == "batch" else ""
    with run_proxy([engine(slow_sim.base_url, "sim", **cap)]) as proxy:
        ahead = httpx.Client(base_url=proxy.base_url, timeout=10)
        first = {**TEXT, **LONG, "stream": True}
        with ahead, ahead.stream("POST", f"{prefix}/v1/completions", json=first) as response:
            events = data_lines(response)  # kept: dropping it would close the stream
            next(events)  # the first request holds the engine's only slot
            queued = {**CHAT, "max_tokens": 5, "stream": stream}
            sock = post_raw(proxy.port, f"{prefix}/v1/chat/completions", queued)
            depth = {"class": cls}
            try:
                proxy.wait_for(lambda: proxy.metric("whoseturn_queue_depth", **depth) == 1)
                time.sleep(0.05)
                assert proxy.metric("whoseturn_queue_depth", **depth) == 1
            finally:
                sock.close()
            proxy.wait_for(lambda: proxy.metric("whoseturn_queue_depth", **depth) == 0, 1)
            cancelled = {"class": cls, "outcome": "cancelled"}
            assert proxy.metric("whoseturn_requests_total", **cancelled) == 1
            assert slow_sim.requests_running() == 1
            assert slow_sim.metric("vllm:num_requests_waiting") == 0
        slow_sim.wait_for(lambda: slow_sim.requests_running() == 0, timeout=2)
        # Only the first request ever reached the engine (and was aborted there).
        assert engine_requests(slow_sim) == 1
        assert slow_sim.metric("vllm:request_success_total", finished_reason="abort") == 1
        assert proxy.metric("whoseturn_queue_depth") == 0
