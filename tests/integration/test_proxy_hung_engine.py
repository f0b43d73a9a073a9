"""An engine that hangs mid-stream (``SIGSTOP``: its sockets stay open, nothing
comes out): the client's stream ends with an error event within the idle timeout,
the engine is ejected so new work goes to the other engine at once, and when the
engine runs again (``SIGCONT``) it finds its request closed and aborts it.

A request sent to the engine just after it stopped (before its health checks
failed) waits only until they eject it, then goes to the other engine: within
``unhealthy_after * (health_interval_s + health_timeout_s)`` of the stop, not its
``first_byte_timeout_s``; the stream begun before the stop is left to its idle
timeout."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from tests.support import MODEL
from tests.support.http import data_lines

from .proxyserver import Process, ProxyServer, engine, run_proxy, spawn_sim
from .simserver import SimServer, run_server, sim_settings

pytestmark = pytest.mark.integration

IDLE_S = 1.0
FIRST_BYTE_S = 10.0  # had a new request tried the hung engine, it would wait this long
SLACK_S = 2.0  # for a loaded test machine
TIME_SCALE = 1.0  # real time: a 1,500-token answer runs for seconds


def chat(n: int, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"tale {n}"}], **extra}


@pytest.fixture
def hung() -> Iterator[Process]:
    with spawn_sim(time_scale=TIME_SCALE) as sim:
        try:
            yield sim
        finally:
            sim.process.send_signal(signal.SIGCONT)  # a stopped process cannot exit


@pytest.fixture
def other() -> Iterator[SimServer]:
    with run_server(sim_settings(time_scale=TIME_SCALE)) as sim:
        yield sim


def open_stream_on(client: httpx.Client, stack: ExitStack, name: str) -> Iterator[str]:
    """A long chat stream that the proxy sent to engine ``name`` (new conversations
    until one lands there; the others stay open)."""
    return open_conversation_on(client, stack, name)[1]


def open_conversation_on(
    client: httpx.Client, stack: ExitStack, name: str
) -> tuple[int, Iterator[str]]:
    """:func:`open_stream_on`, and the number of its conversation (:func:`chat`)."""
    for n in range(8):
        request = chat(n, max_tokens=1500, stream=True)
        response = stack.enter_context(client.stream("POST", "/v1/chat/completions", json=request))
        events = data_lines(response)
        next(events)
        if response.headers["x-whoseturn-engine"] == name:
            return n, events
    raise AssertionError(f"no stream went to {name}")


@pytest.mark.timeout(60)
def test_an_engine_stopped_mid_stream(hung: Process, other: SimServer) -> None:
    engines = [engine(hung.base_url, "a"), engine(other.base_url, "b")]
    options = {
        "idle_timeout_s": IDLE_S,
        "first_byte_timeout_s": FIRST_BYTE_S,
        "health_interval_s": 0.2,
    }
    with run_proxy(engines, **options) as proxy, ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=proxy.base_url, timeout=30))
        events = open_stream_on(client, stack, "a")
        for _ in range(5):
            assert "error" not in json.loads(next(events))
        hung.wait_for(lambda: hung.metric("vllm:num_requests_running") >= 1)

        hung.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        *_, error, done = list(events)
        silent_s = time.monotonic() - stopped_at
        assert done == "[DONE]"
        assert "sent nothing" in json.loads(error)["error"]["message"]
        assert silent_s < IDLE_S + SLACK_S

        started = time.monotonic()
        reply = client.post("/v1/chat/completions", json=chat(99, max_tokens=3))
        answer_s = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-whoseturn-engine"] == "b"
        assert answer_s < SLACK_S
        assert proxy.metric("whoseturn_engine_up", engine="a") == 0

        hung.process.send_signal(signal.SIGCONT)
        aborted_s = hung.wait_for(lambda: hung.metric("vllm:num_requests_running") == 0)
        readmitted_s = proxy.wait_for(
            lambda: proxy.metric("whoseturn_engine_up", engine="a") == 1, timeout=10
        )
        print(
            f"error event {silent_s:.2f} s after SIGSTOP (idle timeout {IDLE_S} s); "
            f"next request answered by b in {answer_s:.3f} s; after SIGCONT the request "
            f"was aborted in {aborted_s:.2f} s, engine readmitted in {readmitted_s:.2f} s"
        )


HEALTH_INTERVAL_S = 0.2
HEALTH_TIMEOUT_S = 1.0
UNHEALTHY_AFTER = 2
EJECTED_WITHIN_S = UNHEALTHY_AFTER * (HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S)  # 2.4 s
SENT_AFTER_S = 1.5
LIVE_IDLE_S = EJECTED_WITHIN_S + 2 * SLACK_S  # the stream outlives the ejection


def engines_tried(proxy: ProxyServer, request_id: str) -> list[str]:
    """The engines the scheduler sent request ``request_id`` to, in order."""
    log = proxy.http.get("/turn/log", params={"limit": 1000}).json()
    return [
        d["engine"] for d in log["decisions"] if d["request_id"] == request_id and d["admitted"]
    ]


@pytest.mark.timeout(60)
def test_a_request_sent_just_after_the_engine_stopped(hung: Process, other: SimServer) -> None:
    engines = [engine(hung.base_url, "a"), engine(other.base_url, "b")]
    options = {
        "idle_timeout_s": LIVE_IDLE_S,
        "first_byte_timeout_s": 60.0,  # the default: the request must not wait for it
        "health_interval_s": HEALTH_INTERVAL_S,
        "health_timeout_s": HEALTH_TIMEOUT_S,
        "unhealthy_after": UNHEALTHY_AFTER,
    }
    with run_proxy(engines, **options) as proxy, ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=proxy.base_url, timeout=30))
        n, events = open_conversation_on(client, stack, "a")
        for _ in range(5):
            assert "error" not in json.loads(next(events))
        hung.wait_for(lambda: hung.metric("vllm:num_requests_running") >= 1)

        hung.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(SENT_AFTER_S)
        # the same conversation: its affinity sends it to the stopped engine
        reply = client.post("/v1/chat/completions", json=chat(n, max_tokens=3))
        answered_s = time.monotonic() - stopped_at
        assert reply.status_code == 200, reply.text
        assert engines_tried(proxy, reply.headers["x-request-id"]) == ["a", "b"]
        assert reply.headers["x-whoseturn-engine"] == "b"
        assert answered_s < EJECTED_WITHIN_S + SLACK_S
        assert proxy.metric("whoseturn_engine_up", engine="a") == 0

        # the stream begun before the stop is not cut by the ejection: it ends at its
        # idle timeout, as before
        *_, error, done = list(events)
        silent_s = time.monotonic() - stopped_at
        assert done == "[DONE]"
        assert "sent nothing" in json.loads(error)["error"]["message"]
        # (its idle time counts from its last chunk, a gap before the stop)
        assert EJECTED_WITHIN_S + SLACK_S <= silent_s < LIVE_IDLE_S + SLACK_S
        print(
            f"request sent {SENT_AFTER_S} s after SIGSTOP answered by b {answered_s:.2f} s "
            f"after the stop (bound {EJECTED_WITHIN_S:g} s + {SLACK_S:g} s); the stream "
            f"begun before ended {silent_s:.2f} s after it (idle timeout {LIVE_IDLE_S:g} s)"
        )
