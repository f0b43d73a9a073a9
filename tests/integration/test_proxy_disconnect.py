"""A client that leaves the proxy aborts its request in the engine at once, and one
that leaves while queued in the proxy never reaches the engine at all.

Every point a client can leave at is covered, each checked by the engine's own
running count (``vllm:num_requests_running``) and by the proxy's scheduler
(``GET /turn``: nothing queued, in prefill or decoding):

- (a) queued in the proxy, before the upstream request opens;
- (b) after the upstream request opened, before anything came back from it (the
  engine still in prefill), streaming and whole answers;
- (c) mid-stream, reading or not reading what the proxy sends;
- (d) waiting for a whole (non-streaming) answer.

Over real sockets a missing upstream close is hidden: httpcore closes its
connection when a read in progress is cancelled or its iterator is finalized, so
these tests pass even with the proxy's own close made a no-op.
``tests/unit/api/test_upstream_close.py`` catches that. A non-streaming request's
disconnect watcher (``until_disconnect``) made a no-op fails (a), (b, whole) and (d)
here.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.http import data_lines, post_raw
from tests.support.processes import LOOPBACK

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import (
    MODEL,
    SimServer,
    abort_latencies,
    hang_up_while_running,
    run_server,
    sim_settings,
)

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


def assert_scheduler_free(proxy: ProxyServer) -> None:
    """The proxy's scheduler holds no job: none queued, in prefill or decoding."""

    def free() -> bool:
        engines = proxy.http.get("/turn").json()["engines"]
        counts = [
            n for e in engines for part in ("queued", "prefill_tokens", "decode_streams")
            for n in e[part].values()
        ]  # fmt: skip
        return not any(counts)

    proxy.wait_for(free, 1)


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
    assert_scheduler_free(proxy)


@pytest.fixture
def proxy(slow_sim: SimServer) -> Iterator[ProxyServer]:
    """The proxy in front of the real-time engine, its only one."""
    with run_proxy([engine(slow_sim.base_url, "sim")]) as server:
        yield server


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)]
)
def test_closing_a_stream_aborts_the_engines_request(
    slow_sim: SimServer, proxy: ProxyServer, path: str, body: dict[str, Any]
) -> None:
    def leave() -> float:
        request = {**body, **LONG, "stream": True}
        with proxy.http.stream("POST", path, json=request) as response:
            assert response.status_code == 200
            events = data_lines(response)
            next(events), next(events)
            assert slow_sim.requests_running() == 1
        return time.monotonic()

    assert_aborts_quickly(slow_sim, proxy, leave)


def time_out_on_a_whole_answer(sim: SimServer, proxy: ProxyServer) -> float:
    """A non-streaming chat from a client that gives up after 0.3 s."""
    with proxy.openai(timeout=0.3) as client, pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=LONG["max_tokens"]
        )
    return time.monotonic()


def hang_up_on_a_whole_answer(sim: SimServer, proxy: ProxyServer) -> float:
    """A non-streaming completion whose client closes its socket once the engine runs it."""
    sock = post_raw(proxy.port, "/v1/completions", {**TEXT, **LONG})
    try:
        sim.wait_for(lambda: sim.requests_running() == 1, timeout=2)
        time.sleep(0.05)
    finally:
        sock.close()
    return time.monotonic()


@pytest.mark.parametrize(
    "leave",
    [time_out_on_a_whole_answer, hang_up_on_a_whole_answer],
    ids=["times_out", "hangs_up"],
)
def test_a_whole_answer_client_that_leaves_aborts_the_engines_request(
    slow_sim: SimServer, proxy: ProxyServer, leave: Callable[[SimServer, ProxyServer], float]
) -> None:
    assert_aborts_quickly(slow_sim, proxy, lambda: leave(slow_sim, proxy))


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
        assert_scheduler_free(proxy)


# -- (b) between the upstream opening and the first read ---------------------------

# A tenth of real time: a ~1,500-token prompt stays in prefill for about 3 s, so the
# client can leave once the engine holds the request and before its first token.
LONG_PROMPT = " ".join(["prefill"] * 1500)


@pytest.fixture
def prefill_sim() -> Iterator[SimServer]:
    with run_server(sim_settings(time_scale=0.1)) as server:
        yield server


def in_prefill(sim: SimServer) -> bool:
    """The engine runs one request and has produced no token yet."""
    generated = sim.metric("vllm:generation_tokens_total")
    return sim.requests_running() == 1 and generated == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_leaves_before_the_first_token_aborts_the_engines_request(
    prefill_sim: SimServer, stream: bool
) -> None:
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 20, "stream": stream}
    with run_proxy([engine(prefill_sim.base_url, "sim")]) as proxy:

        def leave() -> float:
            if stream:
                with proxy.http.stream("POST", "/v1/completions", json=body) as response:
                    # the proxy answered with headers: its upstream request is open
                    assert response.status_code == 200
                    prefill_sim.wait_for(lambda: in_prefill(prefill_sim), timeout=2)
                return time.monotonic()
            sock = post_raw(proxy.port, "/v1/completions", body)
            try:
                prefill_sim.wait_for(lambda: in_prefill(prefill_sim), timeout=2)
            finally:
                sock.close()
            return time.monotonic()

        assert_aborts_quickly(prefill_sim, proxy, leave)
        assert prefill_sim.metric("vllm:generation_tokens_total") == 0


# -- (c) mid-stream, while the proxy waits for the client to take its bytes ----------


def unread_stream(port: int, body: dict[str, Any]) -> socket.socket:
    """A streaming request from a client with a small receive buffer that never
    reads: the proxy soon waits on the client, not on the engine."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((LOOPBACK, port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock.sendall(head + data)
    return sock


@pytest.fixture
def fast_sim() -> Iterator[SimServer]:
    """Five times real time: a long answer outruns a client that does not read."""
    with run_server(sim_settings(time_scale=5.0)) as server:
        yield server


def test_a_client_that_stopped_reading_and_leaves_aborts_the_engines_request(
    fast_sim: SimServer,
) -> None:
    """The proxy is blocked writing to the client, not reading from the engine, when
    the client leaves: the hang-up still reaches the engine at once."""
    body = {"model": MODEL, "prompt": "go", "max_tokens": 2000, "stream": True}
    with run_proxy([engine(fast_sim.base_url, "sim")]) as proxy:

        def leave() -> float:
            sock = unread_stream(proxy.port, body)
            # the answer's bytes outgrow the client's buffers well before its end
            return hang_up_while_running(fast_sim, sock, after_s=0.6)

        assert_aborts_quickly(fast_sim, proxy, leave)
